"""Recovery time: every part of a recovery, measured on the CPU job, and modelled at scale.

    python bench/recovery_bench.py             # measured (best of 2) and the model
    python bench/recovery_bench.py --repeat 1  # the shortest run (the test suite's)
    python bench/recovery_bench.py --no-model  # measure only
    python bench/recovery_bench.py --full      # model the 405B case too (its plan is slow)
    python bench/recovery_bench.py --out FILE  # JSON elsewhere (default bench/results/)

**Measured.** Four forked gloo processes train the dense tiny GPT of
``examples/live_switch_gpt.py`` (``examples/mcore_job.py``'s job, DP4 with the
DistributedOptimizer). In iteration 3 one process is SIGKILLed in a forward pass; each survivor
catches the error its iteration raises and calls ``LiveSwitcher.recover`` (heartbeat every
0.1 s, ``stale_after`` 1.5 s), three ways:

* ``exchange``: ``num_distributed_optimizer_instances=2``, no checkpoint at all;
* ``refill``: one instance, the checkpoint of iteration 2 (the last finished): the dead
  process's optimizer shard is read from it, the rest moves between the survivors;
* ``rollback``: one instance, a checkpoint of iteration 1 only: every survivor reloads it;
* ``buddy``: one instance with buddy copies (``LiveSwitcher(buddy=True)``, ``snapshot`` after
  every step), on two nodes of two devices, no checkpoint: the survivors restore the last
  finished step from their own copies and the dead process's buddy. Its first iterations run
  without copies and then with them, so the per-step cost of the copies is measured side by
  side in one run (``step_s`` without, ``step_with_copy_s`` with; the copy's host memory beside
  the state it copies).

``release`` is the time from the death to the error a survivor's iteration raises: at once
where the survivor is in a collective with the dead process (its sockets close), the job's
group timeout (here 10 s) where it waits on another survivor (gloo cannot abort a collective).
The parts are ``SwitchResult.seconds`` of the survivor released last: detect (the roll call,
cut short by the dead heartbeat), agree, prepare (plan, verify, choose the way back, read
checkpoint metadata), switch_group and exchange (not in a rollback), refill or reload,
dst_group, build, install, commit_vote. ``total`` is from the death until the last survivor
trains again.

**Modelled.** For the shipped presets losing one node of 8 GPUs: the survivors' plan is made and
verified here (seconds measured), its exchange time is the planner's wire model on the H100
preset, and the rest comes from stated assumptions (``--read-GBps`` per device from the
checkpoint store, ``--detect-s`` for a dead heartbeat, ``--groups-s``, ``--build-s``; a hang
adds the job's group timeout, a rollback the iterations since its checkpoint); beside them the
peers' published figures. The model is an estimate, not a measurement: it says so in its table.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import platform
import signal
import sys
import tempfile
import time
import traceback

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # forked CPU processes (see live_bench.py)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import live_switch_gpt as example  # noqa: E402  (imports megatron once, here)
import mcore_job  # noqa: E402
from dynatrain.checkpoint import LoadStats, load_planned, open_checkpoint, plan_load  # noqa: E402
from dynatrain.checkpoint.load import read_step  # noqa: E402
from dynatrain.runtime.megatron import LiveSwitcher, Rendezvous  # noqa: E402
from dynatrain.verify.check import check  # noqa: E402

DEVICES = [f"node0:gpu{i}" for i in range(4)]
VICTIM = "node0:gpu3"
# Buddy copies go to another node: the buddy way runs on two nodes of two.
BUDDY_DEVICES = ["node0:gpu0", "node0:gpu1", "node1:gpu0", "node1:gpu1"]
COPY_STEPS = 3  # iterations timed without copies, then with them (the buddy way)
GLOBAL_BATCH = 12  # DP4 and DP3 alike
# The job's group timeout. Gloo cannot abort a collective: a survivor whose collective peers
# are all alive, but blocked on the dead one, waits this long (in a ring reduce-scatter, every
# survivor not next to the dead process).
COLLECTIVE_S = 10.0
PHASES = ("detect", "agree", "prepare", "switch_group", "exchange", "refill", "reload",
          "dst_group", "build", "install", "commit_vote")


# ---- the CPU job ------------------------------------------------------------------------------


def refill(ckpt: str, layout, rank: int, lost):
    """``LiveSwitcher``'s ``refill`` on DynaTrain's checkpoint reader (``lost`` None: all)."""
    c = open_checkpoint(ckpt)
    load = plan_load(c, layout, [rank], only=lost)

    def write(store: dict) -> None:
        load_planned(load, stores={rank: store}, stats=LoadStats())

    return read_step(c), write


def train_state(ckpt: str) -> dict:
    """What ``mcore_job.save_checkpoint`` kept beside the tensors."""
    with open(os.path.join(ckpt, "train_state.json")) as f:
        doc = json.load(f)
    return {"iteration": doc["iteration"], "consumed_samples": doc["consumed_samples"],
            "scheduler": doc["scheduler"], "extra": {}}


def _job_spec(instances: int, devices: list[str]):
    spec = example.spec(example.MODELS["dense"], f"dp4 x{instances}",
                        {"num_distributed_optimizer_instances": instances}, len(devices))
    world = spec.world.model_copy(update={"devices": tuple(devices)})
    return spec.model_copy(update={"world": world})


def _devices(way: str) -> tuple[list[str], str]:
    return (BUDDY_DEVICES, BUDDY_DEVICES[-1]) if way == "buddy" else (DEVICES, VICTIM)


def worker(device: str, way: str, store_path: str, tmpdir: str) -> None:
    gc.freeze()  # forked: the bench's imports stay out of its cycle collections (forked.py)
    try:
        example.quiet_library_warnings()
        torch.set_num_threads(1)
        example.cpu.set_device(_devices(way)[0].index(device))
        with example.cpu.cpu_shim():
            _recover_once(device, way, store_path, tmpdir)
    except BaseException:  # noqa: BLE001 — reported by the parent
        with open(os.path.join(tmpdir, f"{device}.error"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _recover_once(device: str, way: str, store_path: str, tmpdir: str) -> None:
    """Train, lose ``VICTIM`` in iteration 3, recover ``way``, train one more iteration."""
    store = dist.FileStore(store_path, -1)
    rdzv = Rendezvous(store, "gloo", prefix="job", timeout=60.0)
    devices, victim = _devices(way)
    spec = _job_spec(2 if way == "exchange" else 1, devices)
    trainer = mcore_job.GlobalBatch(GLOBAL_BATCH, 32, spec.model.vocab_size)
    rdzv.form("start", devices, device)
    from megatron.core import parallel_state as ps

    from dynatrain.runtime.megatron.job import parallel_kwargs

    ps.initialize_model_parallel(**parallel_kwargs(spec), **mcore_job.init_kwargs(),
                                 distributed_timeout_minutes=COLLECTIVE_S / 60)
    job = mcore_job.build_job(spec)
    sw = LiveSwitcher(spec, device, mcore_job.build_job, check, rendezvous=rdzv,
                      timeout=60.0, heartbeat=0.1, stale_after=1.5, refill=refill,
                      train_state=train_state, collective_timeout=COLLECTIVE_S,
                      init_kwargs=mcore_job.init_kwargs(), buddy=way == "buddy")
    old, last = os.path.join(tmpdir, "it1"), os.path.join(tmpdir, "it2")
    copies = {}
    if way == "buddy":
        copies = _time_copies(trainer, job, sw)
    else:
        trainer.step(job)
        mcore_job.save_checkpoint(job, old)
        trainer.step(job)
    if way == "refill":
        mcore_job.save_checkpoint(job, last)
    if device == victim:
        calls = [0]

        def die(module, args):
            calls[0] += 1
            if calls[0] == 2:
                store.set("died", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        job.model_chunks[0].register_forward_pre_hook(die)
    released = None
    try:
        trainer.step(job)
    except Exception:  # noqa: BLE001 — what a survivor sees of a dead peer
        released = time.time() - float(store.get("died").decode())
    if released is None:
        raise RuntimeError("iteration 3 finished although a peer died in it")
    ckpt = {"exchange": None, "refill": last, "rollback": old, "buddy": None}[way]
    res = sw.recover(job, checkpoint=ckpt)
    if res.recovery["mode"] != way:
        raise RuntimeError(f"recovered by {res.recovery['mode']}, not {way}")
    if res.job is not None:
        trainer.step(res.job)  # it trains on
    doc = {"seconds": res.seconds, "release": released, "mode": res.recovery["mode"],
           "dst": res.recovery["dst"], "lost_bytes": res.recovery["lost_bytes"],
           "refilled_bytes": res.recovery["refilled_bytes"],
           "iteration": res.recovery["iteration"], **copies}
    sw.close()
    with open(os.path.join(tmpdir, f"{device}.json"), "w") as f:
        json.dump(doc, f)


def _time_copies(trainer, job, sw) -> dict:
    """``COPY_STEPS`` iterations without buddy copies, then as many with one after each (the
    copies the recovery uses): seconds per iteration each way (median), the copy's parts (the
    copy to host at the boundary; the exchange, which runs during the next iteration's passes,
    and how long that iteration's optimizer step waited for it), and the host memory the copies
    take beside the state they copy."""
    from statistics import median

    from dynatrain.runtime.megatron import extract_state

    def timed(copy: bool) -> tuple[float, dict]:
        times, parts = [], []
        for i in range(COPY_STEPS):
            dist.barrier()  # every process starts the iteration together
            t0 = time.perf_counter()
            trainer.step(job)  # its optimizer step waits for the last copy's exchange
            if copy:
                if i:
                    parts.append(dict(sw._buddy.seconds))  # that copy, its exchange done
                sw.snapshot(job)
            times.append(time.perf_counter() - t0)
        if copy:
            sw._buddy.finish()
            parts.append(dict(sw._buddy.seconds))
        return median(times), {k: median(p[k] for p in parts) for k in parts[0]} if parts else {}

    step_s, _ = timed(False)
    step_with, parts = timed(True)
    b = sw._buddy
    live = extract_state(b.view, b.rank, job.model_chunks, job.optimizer)
    state = sum(t.numel() * t.element_size() for t in live.values())
    return {"step_s": step_s, "step_with_copy_s": step_with, "copy_parts_s": parts,
            "copy_host_bytes": b.host_bytes, "state_bytes": state}


def run_way(way: str, timeout: float) -> dict:
    """One recovery ``way``; the slowest survivor's seconds per part."""
    ctx = multiprocessing.get_context("fork")
    devices, victim = _devices(way)
    with tempfile.TemporaryDirectory(prefix="recovery_bench_") as tmpdir:
        store_path = os.path.join(tmpdir, "store")
        procs = [ctx.Process(target=worker, args=(d, way, store_path, tmpdir)) for d in devices]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = [f for f in os.listdir(tmpdir) if f.endswith(".error")]
        if errors:
            with open(os.path.join(tmpdir, errors[0])) as f:
                raise RuntimeError(f"{way}: {errors[0]}:\n{f.read()[-3000:]}")
        docs = []
        for d in devices:
            path = os.path.join(tmpdir, f"{d}.json")
            if d != victim:
                if not os.path.exists(path):
                    raise RuntimeError(f"{way}: {d} did not finish within {timeout:.0f} s")
                with open(path) as f:
                    docs.append(json.load(f))
    # The parts of the survivor released last (the others' roll call waits for it); the
    # recovery ends when the slowest survivor is done.
    last = max(docs, key=lambda doc: doc["release"])
    parts = {k: last["seconds"].get(k, 0.0) for k in PHASES}
    return {"way": way, "release": last["release"], "parts": parts,
            "downtime": last["seconds"]["downtime"],
            "total": max(doc["release"] + doc["seconds"]["downtime"] for doc in docs),
            "dst": docs[0]["dst"], "lost_bytes": docs[0]["lost_bytes"],
            # Bytes read again from a checkpoint, or taken from the buddy copies.
            "reread_bytes": 0 if way == "buddy" else sum(doc["refilled_bytes"] for doc in docs),
            "from_copies_bytes": sum(doc["refilled_bytes"] for doc in docs) if way == "buddy"
            else 0,
            "resumed_at_iteration": docs[0]["iteration"],
            **({"copies": {k: max(doc[k] for doc in docs) if k != "copy_parts_s" else
                           last[k] for k in ("step_s", "step_with_copy_s", "copy_parts_s",
                                            "copy_host_bytes", "state_bytes")}}
               if way == "buddy" else {})}


# ---- the model at scale -----------------------------------------------------------------------

PRESETS = [  # (source, destination, failed node)
    ("specs/llama3.1-70b/tp8-pp4-dp4.yaml", "specs/llama3.1-70b/tp8-pp4-dp3-96gpu.yaml", "node15"),
    ("specs/qwen3-235b-a22b/tp4-pp8-ep16-256gpu.yaml",
     "specs/qwen3-235b-a22b/tp4-pp8-ep8-192gpu.yaml", "node31"),
    ("specs/llama3.1-405b/tp8-pp16-dp32-4096gpu.yaml",
     "specs/llama3.1-405b/tp8-pp16-dp24-3072gpu.yaml", "node511"),
]
PEERS = [  # published figures (bench/README.md and docs/benchmarks.md cite them)
    ("nvidia-resiliency-ext", "in-process restart: destroying a group ~0.5 s; hang timeouts "
     "60 s / 90 s (Megatron-LM defaults); then a checkpoint reload; ~90 s cycles reported"),
    ("SageMaker HyperPod checkpointless", "under 2 min (from 15-30 min), second optimizer "
     "instance, same world size with a spare"),
    ("checkpoint restart", "process start, NCCL init, load, plus every iteration since the "
     "checkpoint: minutes to hours"),
]


def model(args) -> list[dict]:
    from dynatrain.ir.layout import DTYPE_BYTES, Layout
    from dynatrain.ir.loader import load_spec, spec_from_dict, spec_to_dict
    from dynatrain.ir.state import OPTIMIZER_KINDS
    from dynatrain.ir.summary import rank_elements
    from dynatrain.planner.cost import H100, predicted_downtime
    from dynatrain.planner.lost import LostState
    from dynatrain.planner.pipeline import plan_transition

    root = os.path.join(HERE, "..")
    rows = []
    for src_path, dst_path, node in PRESETS[: None if args.full else 2]:
        src, dst = load_spec(os.path.join(root, src_path)), load_spec(os.path.join(root, dst_path))
        failed = frozenset(d for d in Layout(src).devices if d.split(":")[0] == node)
        for inst in (1, 2):
            doc = spec_to_dict(src)
            doc["parallel"] = dict(doc["parallel"], num_distributed_optimizer_instances=inst)
            s = spec_from_dict(doc)
            t0 = time.perf_counter()
            plan = plan_transition(Layout(s), Layout(dst), 2 << 30, H100, failed=failed,
                                   allow_lost=True)
            plan_s = time.perf_counter() - t0
            lost = LostState.from_json(plan.stats["lost"])
            lay = Layout(dst)
            opt_bytes = sum(DTYPE_BYTES[getattr(dst.state, k)] for k in OPTIMIZER_KINDS
                            if getattr(dst.state, k) is not None)

            def state_bytes(r: int) -> int:
                params, opt = rank_elements(lay, r)
                return params * DTYPE_BYTES[dst.state.param] + opt * opt_bytes

            # Every stage's first rank (ranks of one stage hold alike).
            per_dev = max(state_bytes(r) for r in range(0, lay.world, max(1, lay.world // 64)))
            # The refill reads each lost range on the one destination rank that holds it: here
            # assumed spread evenly over the destination's devices.
            lost_per_dev = lost.nbytes / max(1, lay.world)
            wire = predicted_downtime(plan, H100).total_seconds
            common = args.detect_s + args.groups_s + args.build_s + plan_s
            row = {"src": s.name, "dst": dst.name, "failed": node, "instances": inst,
                   "plan_seconds": plan_s, "exchange_seconds": wire,
                   "lost_bytes": lost.nbytes, "state_bytes_per_device": per_dev}
            if not lost:
                row["way"], row["total_seconds"] = "exchange", common + wire
            else:
                row["refill"] = common + wire + lost_per_dev / (args.read_GBps * 1e9)
                row["rollback"] = common + per_dev / (args.read_GBps * 1e9)
                # Buddy copies: the lost shards come from the failed node's buddies over the
                # network, spread over the destination's devices like the refill's reads.
                row["buddy"] = common + wire + lost_per_dev / (args.nic_GBps * 1e9)
                params, opt = rank_elements(Layout(s), 0)
                # Four copies of a rank's optimizer state (two steps, its own and its ward's).
                row["buddy_host_bytes_per_device"] = 4 * opt * opt_bytes
                # What a step waits for: the copy to host at the boundary (the exchange with
                # the buddy overlaps the next passes; at these sizes it fits in them).
                row["buddy_copy_seconds_per_step"] = opt * opt_bytes / (args.d2h_GBps * 1e9)
                row["buddy_exchange_seconds_per_step"] = opt * opt_bytes / (args.nic_GBps * 1e9)
                row["way"] = "refill (checkpoint of this step), rollback or buddy copies"
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=2, help="runs per way; the best is kept")
    ap.add_argument("--no-model", action="store_true", help="measure only")
    ap.add_argument("--full", action="store_true", help="model the 405B case too (slow plan)")
    ap.add_argument("--read-GBps", type=float, default=2.0,
                    help="checkpoint read bandwidth per device, GB/s (assumed)")
    ap.add_argument("--detect-s", type=float, default=1.5, help="dead heartbeat (assumed)")
    ap.add_argument("--nic-GBps", type=float, default=25.0,
                    help="host-to-host bandwidth per GPU for buddy copies, GB/s (assumed)")
    ap.add_argument("--d2h-GBps", type=float, default=25.0,
                    help="device-to-host copy bandwidth per GPU for buddy copies, GB/s (assumed)")
    ap.add_argument("--groups-s", type=float, default=5.0,
                    help="forming the destination's NCCL groups at scale (assumed)")
    ap.add_argument("--build-s", type=float, default=5.0,
                    help="building the destination job (assumed)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "recovery_bench.json"))
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat: at least 1")
    measured = []
    for way in ("exchange", "refill", "rollback", "buddy"):
        runs = [run_way(way, args.timeout) for _ in range(args.repeat)]
        measured.append(min(runs, key=lambda r: r["downtime"]))
    print(f"measured on this machine ({os.cpu_count()} CPUs, gloo, 4 processes, one SIGKILLed "
          "in a forward pass; seconds, slowest survivor, best of "
          f"{args.repeat})")
    short = [p for p in PHASES if any(m["parts"][p] for m in measured)]
    print(f"  {'way':9} {'release':>8} " + " ".join(f"{p[:9]:>9}" for p in short)
          + f" {'downtime':>9} {'total':>7}  resumes at")
    for m in measured:
        print(f"  {m['way']:9} {m['release']:8.3f} "
              + " ".join(f"{m['parts'][p]:9.3f}" for p in short)
              + f" {m['downtime']:9.3f} {m['total']:7.3f}  iteration "
              f"{m['resumed_at_iteration']}")
    c = measured[-1]["copies"]
    print(f"\nbuddy copies, per iteration (median of {COPY_STEPS}, slowest process): "
          f"{c['step_s'] * 1e3:.1f} ms without, {c['step_with_copy_s'] * 1e3:.1f} ms with "
          f"({c['step_with_copy_s'] / c['step_s']:.2f}x; copy to host "
          f"{c['copy_parts_s']['copy'] * 1e3:.1f} ms at the boundary; the exchange with the "
          f"buddy runs during the next passes, and the next optimizer step waited "
          f"{c['copy_parts_s']['wait'] * 1e3:.1f} ms for it); host memory "
          f"{c['copy_host_bytes'] / 2**20:.1f} MiB per process for "
          f"{c['state_bytes'] / 2**20:.1f} MiB of state "
          f"({c['copy_host_bytes'] / c['state_bytes']:.2f}x)")
    rows = [] if args.no_model else model(args)
    if rows:
        print(f"\nmodelled (an estimate: plan measured here, exchange from the H100 wire model; "
              f"assumed: detect {args.detect_s} s, groups {args.groups_s} s, build "
              f"{args.build_s} s, checkpoint reads {args.read_GBps} GB/s per device, buddy "
              f"copies {args.d2h_GBps} GB/s to host and {args.nic_GBps} GB/s between hosts per "
              "GPU)")
        for r in rows:
            ways = (f"exchange {r['total_seconds']:.1f} s" if "total_seconds" in r else
                    f"refill {r['refill']:.1f} s, rollback {r['rollback']:.1f} s + the "
                    f"iterations since the checkpoint, buddy copies {r['buddy']:.1f} s "
                    f"({r['buddy_host_bytes_per_device'] / 2**30:.0f} GiB host memory per GPU; "
                    f"per step a {r['buddy_copy_seconds_per_step']:.2f} s copy to host and a "
                    f"{r['buddy_exchange_seconds_per_step']:.2f} s exchange overlapping the "
                    "next passes)")
            print(f"  {r['src']} minus {r['failed']}, {r['instances']} optimizer instance(s): "
                  f"lost {r['lost_bytes'] / 2**30:.1f} GiB, plan {r['plan_seconds']:.1f} s, "
                  f"exchange {r['exchange_seconds']:.2f} s; {ways}")
        print("\npeers (published)")
        for name, what in PEERS:
            print(f"  {name}: {what}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"environment": {"python": platform.python_version(),
                                   "torch": torch.__version__, "cpus": os.cpu_count()},
                   "measured": measured, "model": rows, "peers": PEERS,
                   "assumptions": {k: getattr(args, k) for k in
                                   ("read_GBps", "detect_s", "groups_s", "build_s",
                                    "nic_GBps", "d2h_GBps")}},
                  f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
