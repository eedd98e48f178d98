"""Live switch vs checkpoint-based switch of the same training job: downtime and wall time.

    python bench/live_bench.py                 # both models of examples/live_switch_gpt.py
    python bench/live_bench.py --model moe     # one of them
    python bench/live_bench.py --out FILE      # JSON elsewhere (default bench/results/)
    python bench/live_bench.py --model dense --iterations-per-layout 1   # the shortest run

The run and the model are ``examples/live_switch_gpt.py``'s (8 processes, 8 -> 6 -> 8 -> 8,
each layout trained a few iterations), forked from this process on CPU with gloo (or NCCL on
GPUs). At every switch both ways are measured, side by side on the same state:

* **checkpoint-based** (restart-free): megatron's ``dist_checkpointing.save`` of model and
  fully reshardable optimizer in the source layout, the destination's process group and
  megatron's parallel state formed, a fresh destination job built, ``dist_checkpointing.load``
  into it. Downtime = wall time = save + regroup + build + load. A real restart would add
  process start-up and imports; a shared filesystem would make save and load slower than this
  machine's page cache does.
* **live**: ``LiveSwitcher.switch``; its plan and verification ran in the background while the
  job trained. Downtime = the ``switch`` call (slowest process); wall time = plan + verify +
  downtime.

Next to the live downtime the table gives the downtime DynaTrain predicts for the switch
(``dynatrain.planner.cost.predicted_downtime``: the wire model plus the fixed costs, on the
``gloo-local`` preset under gloo, ``h100`` under NCCL) and what it models, the ``switch`` call
(``live switch()``); the rest of the live downtime (forming groups and megatron's parallel
state, building and installing the destination job) is outside every prediction.

The two destination jobs are compared bit for bit; where they differ, the table says which one
keeps megatron's invariant param == bf16(main param) (megatron-core 0.16.1's own reload breaks
it into TP2·PP2·VPP2, warning "param range exceeds unpadded buffer ... data corruption").
Training continues from the live switch's state. Every number is the slowest process's; the
table gives both ways and the ratios (checkpoint / live); the JSON has every part.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import sys
import tempfile
import time

# The processes are forked from this one, and CUDA cannot be used after a fork once the parent
# touched it (importing megatron does). One process per GPU is needed for NCCL, so unless asked
# for it, GPUs are hidden before torch loads and the run is on CPU with gloo.
if "--nccl" not in sys.argv:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import live_switch_gpt as example  # noqa: E402  (imports megatron once, here: workers start warm)
import mcore_job  # noqa: E402
from forked import run_forked  # noqa: E402  (bench/)

from dynatrain.ir.layout import Layout  # noqa: E402
from dynatrain.ir.state import view_of  # noqa: E402
from dynatrain.planner.cost import PRESETS, predicted_downtime  # noqa: E402
from dynatrain.planner.pipeline import plan_transition  # noqa: E402
from dynatrain.runtime.megatron import (LiveSwitcher, Rendezvous, cpu,  # noqa: E402
                                        extract_state, install_state, parallel_kwargs)
from dynatrain.verify.check import check  # noqa: E402

TRAIN_PER_LAYOUT = 2  # iterations trained in each layout before its next switch (default)


def worker(device: str, model: str, store_path: str, tmpdir: str, args) -> None:
    from megatron.core import parallel_state as ps

    cpu.set_device(int(device.rsplit("gpu", 1)[1]))
    store = dist.FileStore(store_path, -1)
    rdzv = Rendezvous(store, cpu.backend(), prefix=f"bench-{model}", timeout=300)
    mdict = example.MODELS[model]
    specs = [example.spec(mdict, n, p, k) for _, n, p, k, _ in example.SCHEDULES[model]]
    trainer = mcore_job.GlobalBatch(args.global_batch, args.seq, example.BASE["vocab_size"])
    kw = dict(rendezvous=rdzv, timeout=300, init_kwargs=mcore_job.init_kwargs())
    with cpu.cpu_shim():
        job = None
        if device in Layout(specs[0]).devices:
            rdzv.form("start", Layout(specs[0]).devices, device)
            ps.initialize_model_parallel(**parallel_kwargs(specs[0]), **mcore_job.init_kwargs())
            job = mcore_job.build_job(specs[0])
            sw = LiveSwitcher(specs[0], device, mcore_job.build_job, check, **kw)
            trainer.step(job)
            mcore_job.save_checkpoint(job, os.path.join(tmpdir, "warmup"))  # first-save costs
        else:
            sw = LiveSwitcher(None, device, mcore_job.build_job, check, **kw)
        k = 0
        while True:
            if job is None:
                result = sw.join()
                if result is None:
                    return
                k = result.generation
                ckpt = {"save": store_get_float(store, f"bench/{model}/{k}/save")}
            else:
                if k == len(specs) - 1:
                    trainer.step(job)
                    sw.close()
                    return
                for _ in range(args.iterations_per_layout):
                    trainer.step(job)
                dst = specs[k + 1]
                sw.prepare(dst).result()
                # A same-devices switch's destination job is built now, at the boundary before
                # the switch (its time is counted in the live wall time, not the downtime).
                sw.build_ahead(job)
                path = os.path.join(tmpdir, f"{model}-{k + 1}")
                dist.barrier()
                t0 = time.perf_counter()
                mcore_job.save_checkpoint(job, path)
                save = max_over_group(time.perf_counter() - t0)
                if sw.leader:
                    store.set(f"bench/{model}/{k + 1}/save", str(save))
                ckpt = {"save": save}
                result = sw.switch(job)
                k = result.generation
                if result.role == "left":
                    job = None
                    continue
            job = checkpoint_switch(sw, result, os.path.join(tmpdir, f"{model}-{k}"), ckpt,
                                    store, model, k)


def checkpoint_switch(sw, result, path: str, ckpt: dict, store, model: str, k: int):
    """The checkpoint-based switch into the layout the live switch just reached; returns the
    checkpoint-loaded job (the live job's groups are replaced), holding the live job's state."""
    from megatron.core import parallel_state as ps

    spec, layout, device = sw.spec, sw.layout, sw.device
    t0 = time.perf_counter()
    ps.destroy_model_parallel()
    sw.rendezvous.form(f"ckpt-{model}-{k}", layout.devices, device)
    ps.initialize_model_parallel(**parallel_kwargs(spec), **mcore_job.init_kwargs())
    t1 = time.perf_counter()
    ref = mcore_job.build_job(spec)
    t2 = time.perf_counter()
    failure = None
    try:
        mcore_job.load_checkpoint(ref, path)
    except Exception as err:  # noqa: BLE001 — recorded: megatron cannot load it
        failure = f"{type(err).__name__}: {err}"
    t3 = time.perf_counter()
    view, rank = view_of(layout), layout.devices.index(device)
    a = extract_state(view, rank, result.job.model_chunks, result.job.optimizer)
    b = extract_state(view, rank, ref.model_chunks, ref.optimizer)
    same = (failure is None and set(a) == set(b) and all(bits(a[x]) == bits(b[x]) for x in a)
            and (result.job.iteration, result.job.consumed_samples,
                 result.job.scheduler.state_dict()) ==
            (ref.iteration, ref.consumed_samples, ref.scheduler.state_dict()))
    consistent = (params_match_main_params(result.job),
                  failure is None and params_match_main_params(ref))
    s, r = result.seconds, result.report
    mine = [t1 - t0, t2 - t1, t3 - t2, s["downtime"], s["exchange"],
            s.get("plan", 0.0) + s.get("verify", 0.0), float(not same),
            float(not consistent[0]), float(not consistent[1]), s.get("build_ahead", 0.0)]
    got = gather(mine + [r["bytes_received"], r["bytes_local"]])
    phases: list = [None] * dist.get_world_size()
    dist.all_gather_object(phases, result.phases())
    if layout.devices.index(device) == 0:
        worst = [max(g[i] for g in got) for i in range(len(mine))]
        (regroup, build, load, downtime, exchange, plan_verify, differ, bad_live, bad_ckpt,
         built_ahead) = worst
        rec = {"switch": k, "to": spec.name, "processes": layout.world,
               "bytes_moved": int(sum(g[-2] for g in got)),
               "bytes_local": int(sum(g[-1] for g in got)),
               "checkpoint_bytes": dir_bytes(path), "bit_exact": differ == 0,
               "live_params_match_main": bad_live == 0, "ckpt_params_match_main": bad_ckpt == 0,
               "ckpt_save_s": ckpt["save"], "ckpt_regroup_s": regroup, "ckpt_build_s": build,
               "ckpt_load_s": load, "live_downtime_s": downtime, "live_exchange_s": exchange,
               "live_plan_verify_s": plan_verify}
        rec["ckpt_load_failed"] = failure
        # The live downtime by phase, each phase's slowest process.
        rec["live_phases_s"] = {n: max(p.get(n, 0.0) for p in phases) for n in phases[0]}
        rec["ckpt_downtime_s"] = ckpt["save"] + regroup + build + load
        rec["live_built_ahead_s"] = built_ahead  # 0: built at the switch
        rec["live_wall_s"] = plan_verify + built_ahead + downtime
        store.set(f"bench/{model}/record/{k}", json.dumps(rec))
    if not same:  # train on from the live switch's state (megatron's reload can be wrong)
        install_state(view, rank, ref.model_chunks, ref.optimizer, a)
    return ref


def params_match_main_params(job) -> bool:
    """Megatron keeps every bf16 param equal to its fp32 main param cast to bf16 (the optimizer
    step writes it so): a consistency check of the optimizer state against the model."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(job.optimizer, "chained_optimizers", None) or [job.optimizer]:
        if not isinstance(opt, DistributedOptimizer):
            continue
        for p in opt.model_param_gbuf_map:
            r = opt._get_model_param_range_map(p)["param"]
            main = opt._get_main_param_and_optimizer_states(p)["param"]
            if not torch.equal(p.detach().view(-1)[r.start:r.end], main.to(p.dtype)):
                return False
    return True


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def gather(values: list[float]) -> list[list[float]]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    got = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t)
    return [g.cpu().tolist() for g in got]


def max_over_group(x: float) -> float:
    return max(g[0] for g in gather([x]))


def store_get_float(store, key: str) -> float:
    store.wait([key])
    return float(store.get(key).decode())


# ---- driver ------------------------------------------------------------------------------------


def _run_worker(device, model, store_path, tmpdir, args, err_dir) -> None:
    run_forked(worker, (device, model, store_path, tmpdir, args),
               os.path.join(err_dir, f"{device}.txt"))


def run_model(model: str, args) -> list[dict]:
    devices = [f"node0:gpu{i}" for i in range(8)]
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="live_bench_") as tmpdir:
        store_path = os.path.join(tmpdir, "store")
        store = dist.FileStore(store_path, -1)
        procs = [ctx.Process(target=_run_worker, args=(d, model, store_path, tmpdir, args,
                                                        tmpdir)) for d in devices]
        for p in procs:
            p.start()
        try:
            deadline = time.monotonic() + args.timeout
            while any(p.exitcode is None for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs) or \
                        time.monotonic() > deadline:
                    errors = [open(os.path.join(tmpdir, f)).read() for f in os.listdir(tmpdir)
                              if f.endswith(".txt")]
                    raise RuntimeError("a worker failed:\n" + (errors[0] if errors else
                                                               "timeout"))
                time.sleep(0.1)
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
                p.join(timeout=5)
        n = len(example.SCHEDULES[model]) - 1
        recs = [json.loads(store.get(f"bench/{model}/record/{k}")) for k in range(1, n + 1)]
    for rec, pred in zip(recs, predictions(model)):
        rec.update(pred)
    return recs


def predictions(model: str) -> list[dict]:
    """Each switch's predicted downtime, planned here as every process plans it
    (``LiveSwitcher``'s default budget and topology), on this backend's preset."""
    mdict = example.MODELS[model]
    specs = [example.spec(mdict, n, p, k) for _, n, p, k, _ in example.SCHEDULES[model]]
    topo = PRESETS["gloo-local" if cpu.backend() == "gloo" else "h100"]
    out = []
    for a, b in zip(specs, specs[1:]):
        d = predicted_downtime(plan_transition(Layout(a), Layout(b), 2 << 30), topo)
        out.append({"predicted_topology": topo.name, "predicted_downtime_s": d.total_seconds,
                    "predicted_wire_s": d.wire_seconds, "predicted_fixed_s": d.fixed_seconds,
                    "predicted_excludes": list(d.excludes())})
    return out


def table(model: str, recs: list[dict]) -> str:
    head = (f"{'switch':34s} {'procs':>5s} {'moved':>9s} {'ckpt':>9s} | {'live down':>9s} "
            f"{'switch()':>9s} {'predicted':>9s} {'live wall':>9s} | {'save':>6s} "
            f"{'regrp':>6s} {'build':>6s} {'load':>6s} "
            f"{'ckpt down':>9s} | {'down x':>7s} {'wall x':>7s} exact")
    lines = [f"model: {model}", head, "-" * len(head)]
    for r in recs:
        lines.append(
            f"{r['switch']}: -> {r['to']:29s} {r['processes']:5d} "
            f"{r['bytes_moved'] / 2**20:7.2f}MB {r['checkpoint_bytes'] / 2**20:7.2f}MB | "
            f"{r['live_downtime_s']:8.3f}s {r['live_exchange_s']:8.3f}s "
            f"{r['predicted_downtime_s']:8.3f}s {r['live_wall_s']:8.3f}s | "
            f"{r['ckpt_save_s']:5.2f}s {r['ckpt_regroup_s']:5.2f}s {r['ckpt_build_s']:5.2f}s "
            f"{r['ckpt_load_s']:5.2f}s {r['ckpt_downtime_s']:8.3f}s | "
            f"{r['ckpt_downtime_s'] / r['live_downtime_s']:6.1f}x "
            f"{r['ckpt_downtime_s'] / r['live_wall_s']:6.1f}x {_exact(r)}")
    lines.append("live downtime by phase (slowest process each, s):")
    for r in recs:
        ahead = r.get("live_built_ahead_s", 0.0)
        lines.append(f"{r['switch']}: " + ", ".join(f"{n} {s:.3f}"
                                                    for n, s in r["live_phases_s"].items())
                     + (f"; destination built ahead in {ahead:.3f}" if ahead else ""))
    return "\n".join(lines)


def _exact(r: dict) -> str:
    if r["bit_exact"]:
        return "yes"
    if r["ckpt_load_failed"]:
        return f"megatron's load failed ({r['ckpt_load_failed'][:40]})"
    # Which side is right: megatron keeps param == bf16(main_param) after every step.
    return (f"NO (param == bf16(main): live {'yes' if r['live_params_match_main'] else 'no'}, "
            f"checkpoint {'yes' if r['ckpt_params_match_main'] else 'no'})")


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["moe", "dense", "both"], default="both")
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--iterations-per-layout", type=int, default=TRAIN_PER_LAYOUT, metavar="N",
                    help=f"iterations trained in each layout before its switch (default "
                         f"{TRAIN_PER_LAYOUT}; at least 1)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--nccl", action="store_true",
                    help="run on 8 GPUs with NCCL (needs 8 visible GPUs); default: CPU with gloo, "
                         "GPUs hidden")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "live_bench.json"))
    args = ap.parse_args()
    if args.iterations_per_layout < 1:
        ap.error(f"--iterations-per-layout: must be at least 1 (got {args.iterations_per_layout})")
    models = ["moe", "dense"] if args.model == "both" else [args.model]
    t0 = time.perf_counter()
    out: dict = {"environment": {"python": platform.python_version(), "torch": torch.__version__,
                                 "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                                 "backend": cpu.backend()},
                 "global_batch": args.global_batch, "seq": args.seq,
                 "iterations_per_layout": args.iterations_per_layout, "models": {}}
    all_recs = []
    for model in models:
        recs = run_model(model, args)
        all_recs += recs
        out["models"][model] = recs
        print(table(model, recs), flush=True)
        print(flush=True)
    timed = [r for r in all_recs if not r["ckpt_load_failed"]]
    down = geomean([r["ckpt_downtime_s"] / r["live_downtime_s"] for r in timed])
    wall = geomean([r["ckpt_downtime_s"] / r["live_wall_s"] for r in timed])
    out["downtime_ratio_geomean"], out["wall_ratio_geomean"] = down, wall
    out["all_bit_exact"] = all(r["bit_exact"] for r in all_recs)
    pred = [r["predicted_downtime_s"] / r["live_exchange_s"] for r in all_recs]
    out["predicted_over_switch_call_geomean"] = geomean(pred)
    out["wall_seconds"] = time.perf_counter() - t0
    print(f"checkpoint-based / live, geometric mean over the {len(timed)} switches megatron "
          f"could reload: downtime {down:.1f}x, wall time {wall:.1f}x; live == checkpoint "
          f"reload bit for bit: {sum(r['bit_exact'] for r in all_recs)} of {len(all_recs)}")
    print(f"predicted downtime ({all_recs[0]['predicted_topology']}: wire + fixed) / measured "
          f"switch() call: geometric mean {out['predicted_over_switch_call_geomean']:.2f}, "
          f"range {min(pred):.2f}..{max(pred):.2f}; the live downtime adds what no prediction "
          f"models (groups, megatron's parallel state, building the destination job)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
