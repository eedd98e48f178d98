"""Live layout switches of a tiny GPT in training, through a simulated spot preemption.

    torchrun --nproc-per-node 8 --master-port 29533 examples/live_switch_gpt.py

Eight processes (CPU with gloo, or GPUs with NCCL) train a 4-layer GPT (hidden 64, GQA,
SwiGLU, RMSNorm, RoPE) on synthetic data, 24 sequences of 32 tokens per iteration, and switch
layouts live, without checkpoints. ``--model moe`` (the default: 6 experts, top-2, in every
layer) runs

    iterations  1-6   DP8 EP2               8 processes
    iterations  7-12  PP2 DP3 EP3           6 processes   spot preemption: gpu6-7 leave (spares)
    iterations 13-18  PP2 DP4 EP2 ETP2      8 processes   capacity is back: the spares join
    iterations 19-24  DP8                   8 processes   reshape

and ``--model dense`` TP2 DP4 -> PP2 DP3 (gpu6-7 leave) -> TP2 PP2 VPP2 DP2 (they join) ->
PP4 DP2. MoE layouts keep TP1 (see ``SCHEDULES``).

Each switch is planned and verified in the background two iterations ahead, then runs at the
iteration boundary: every process of both layouts meets through a ``Rendezvous`` on torchrun's
own store, the state moves (params, fp32 main params, Adam moments, step, LR scheduler,
iteration, consumed samples) and training continues; the micro-batches per rank change with DP
so the global batch does not. Printed: the loss of every iteration, and for every switch its
downtime, the bytes moved and what planning took. ``--no-switch`` trains the same iterations in
the first layout only (a reference loss curve). ``--iterations-per-layout N`` trains N
iterations in each layout instead of 6 (the switches move with it; 1 is the shortest run), and
``--json FILE`` writes every switch's record and every iteration's loss.

The processes that leave idle as spares in ``LiveSwitcher.join`` until a switch takes them
back; a process started later on another machine would do the same with a ``Rendezvous`` on
the same store (see ``tests/test_live_world.py``).

Every wait is bounded (``TIMEOUT``; a spare waits at most ``SPARE_TIMEOUT`` for a switch) and
names the devices it waits for; a launch with another number of processes than 8 is refused at
once, before torch and megatron load. Each process hides the warnings megatron-core and torch
print on a machine without Transformer Engine or Apex (``quiet_library_warnings``).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Mapping

BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=128, vocab_size=500, make_vocab_size_divisible_by=16,
            max_position_embeddings=64, swiglu=True, normalization="RMSNorm",
            position_embedding_type="rope")
MODELS = {"moe": dict(BASE, num_moe_experts=6, moe_ffn_hidden_size=64, moe_router_topk=2),
          "dense": BASE}
# Per model: (first iteration, name, parallel config, processes, what happens). MoE layouts
# keep TP1: megatron trains MoE with TP only under sequence parallelism, whose norms need
# Transformer Engine or Apex (not on a CPU machine); the dense model shows TP changes.
SCHEDULES = {
    "moe": [
        (0, "dp8-ep2", dict(ep=2), 8, "start"),
        (6, "pp2-dp3-ep3", dict(pp=2, ep=3), 6, "spot preemption: gpu6-7 leave"),
        (12, "pp2-dp4-ep2-etp2", dict(pp=2, ep=2, etp=2), 8, "capacity is back: gpu6-7 join"),
        (18, "dp8", dict(), 8, "reshape"),
    ],
    "dense": [
        (0, "tp2-dp4", dict(tp=2), 8, "start"),
        (6, "pp2-dp3", dict(pp=2), 6, "spot preemption: gpu6-7 leave"),
        (12, "tp2-pp2-vpp2-dp2", dict(tp=2, pp=2, vpp=2), 8, "capacity is back: gpu6-7 join"),
        (18, "pp4-dp2", dict(pp=4), 8, "reshape"),
    ],
}
# Every layout's devices are node0:gpu0..: the launch must give the largest one, on one node.
PROCESSES = max(k for schedule in SCHEDULES.values() for _, _, _, k, _ in schedule)
ITERATIONS_PER_LAYOUT = 6  # the schedules' switch iterations are multiples of it
PREPARE_AHEAD = 2  # plan and verify this many iterations before the switch
TIMEOUT = 180.0  # seconds any wait for peers may take (group formation, a switch, a vote)
SPARE_TIMEOUT = 600.0  # seconds a spare waits for a switch that takes it back
EXIT_BAD_LAUNCH = 2  # dynatrain's status for bad input


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="moe")
    ap.add_argument("--no-switch", action="store_true", help="stay in the first layout")
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--iterations-per-layout", type=int, default=ITERATIONS_PER_LAYOUT,
                    metavar="N", help="train N iterations in each layout (default "
                    f"{ITERATIONS_PER_LAYOUT}; the switches move with it)")
    ap.add_argument("--json", help="write the switch records and the losses here (rank 0 of "
                    "the last layout)")
    args = ap.parse_args(argv)
    if args.iterations_per_layout < 1:
        ap.error(f"--iterations-per-layout: must be at least 1 (got {args.iterations_per_layout})")
    return args


def schedule_of(model: str, per_layout: int) -> list[tuple[int, str, dict, int, str]]:
    """``SCHEDULES[model]`` with each layout trained ``per_layout`` iterations."""
    return [(i * per_layout, n, p, k, why) for i, (_, n, p, k, why)
            in enumerate(SCHEDULES[model])]


def launch_problem(env: Mapping[str, str]) -> str | None:
    """Why this launch cannot run the example, in one line (None: it can).

    The example needs ``PROCESSES`` processes on one node, started by torchrun (which sets
    ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``); with fewer, the first group
    would wait for processes that never come.
    """
    how = f"torchrun --nproc-per-node {PROCESSES} examples/live_switch_gpt.py"
    if "LOCAL_RANK" not in env:
        return f"live_switch_gpt.py needs {PROCESSES} processes started by torchrun: {how}"
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        local = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    except ValueError:
        return f"live_switch_gpt.py: WORLD_SIZE/LOCAL_WORLD_SIZE are not integers; run {how}"
    if world != PROCESSES:
        return f"live_switch_gpt.py needs {PROCESSES} processes (got {world}): {how}"
    if local != PROCESSES:
        return (f"live_switch_gpt.py needs its {PROCESSES} processes on one node (got {local} "
                f"per node): {how}")
    return None


def quiet_library_warnings() -> None:
    """Hide, in this process, the warnings megatron-core 0.16.1 and torch print on a machine
    without Transformer Engine or Apex (9 per process, two lines each): only these messages,
    categories and modules; any other warning still shows."""
    for message, category, module in (
            ("Transformer Engine and Apex are not installed", UserWarning, r"megatron\.core\."),
            ("Apex is not installed", UserWarning, r"megatron\.core\."),
            ("full scope is deprecated", UserWarning, r"megatron\.core\.transformer\."),
            (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is "
             r"deprecated", FutureWarning, r"torch\.distributed\.")):
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


if __name__ == "__main__":
    ARGS = parse_args()
    if (PROBLEM := launch_problem(os.environ)) is not None:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one line, not one per process
            print(PROBLEM, file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_LAUNCH)
    quiet_library_warnings()

import datetime  # noqa: E402  (a wrong launch is refused before torch and megatron load)
from concurrent import futures  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mcore_job  # noqa: E402  (imports megatron; the shim is applied per process below)

from dynatrain.ir.errors import DynatrainError  # noqa: E402
from dynatrain.ir.layout import Layout  # noqa: E402
from dynatrain.ir.loader import spec_from_dict  # noqa: E402
from dynatrain.planner.cost import PRESETS, predicted_downtime  # noqa: E402
from dynatrain.report.summary import plural  # noqa: E402
from dynatrain.runtime.megatron import (LiveSwitcher, Rendezvous,  # noqa: E402
                                        RendezvousTimeout, SwitchFailed, cpu, parallel_kwargs)
from dynatrain.verify.check import check  # noqa: E402


def spec(model: dict, name: str, parallel: dict, processes: int):
    return spec_from_dict({"name": name, "model": model, "parallel": parallel,
                           "world": {"nodes": 1, "gpus_per_node": processes}})


def label(s) -> str:
    p = s.parallel
    parts = ([f"TP{p.tp}"] if p.tp > 1 else []) + ([f"PP{p.pp}"] if p.pp > 1 else [])
    parts += ([f"VPP{p.vpp}"] if p.vpp else []) + [f"DP{Layout(s).dp}"]
    parts += ([f"EP{p.ep}"] if p.ep > 1 else []) + ([f"ETP{p.etp}"] if (p.etp or 1) > 1 else [])
    return " ".join(parts)


def main(args: argparse.Namespace) -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    device = f"node{os.environ.get('GROUP_RANK', '0')}:gpu{local_rank}"
    cpu.set_device(local_rank)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT))
    rdzv = Rendezvous(store, cpu.backend(), prefix="live-switch-gpt", timeout=TIMEOUT)
    model = MODELS[args.model]
    schedule = [(it, spec(model, n, p, k), why)
                for it, n, p, k, why in schedule_of(args.model, args.iterations_per_layout)]
    iterations = len(schedule) * args.iterations_per_layout
    if args.no_switch:
        schedule = schedule[:1]
    try:
        with cpu.cpu_shim():
            run(device, rdzv, schedule, iterations, args)
    except DynatrainError as err:  # a peer missing or a switch that cannot roll back: one line
        print(f"{device}: {err}", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)


def run(device: str, rdzv: Rendezvous, schedule: list, iterations: int, args) -> None:
    from megatron.core import parallel_state as ps

    trainer = mcore_job.GlobalBatch(args.global_batch, args.seq, BASE["vocab_size"])
    first = schedule[0][1]
    kw = dict(rendezvous=rdzv, timeout=TIMEOUT, init_kwargs=mcore_job.init_kwargs())
    job = None
    if device in Layout(first).devices:
        rdzv.form("start", Layout(first).devices, device)
        ps.initialize_model_parallel(**parallel_kwargs(first), **mcore_job.init_kwargs())
        job = mcore_job.build_job(first)
        sw = LiveSwitcher(first, device, mcore_job.build_job, check, **kw)
        if sw.leader:
            print(f"iteration 0: {label(first)} on {Layout(first).world} processes, global "
                  f"batch {args.global_batch} x {args.seq} tokens", flush=True)
    else:
        sw = LiveSwitcher(None, device, mcore_job.build_job, check, **kw)
    switch_at = {it: (s, why) for it, s, why in schedule[1:]}
    # Plan ahead, but never before the previous switch (one switch is prepared at a time).
    ahead = min(PREPARE_AHEAD, args.iterations_per_layout)
    records: list[dict] = []
    losses: dict[int, float] = {}  # the iterations this process printed
    pending = None  # the switch being prepared (its plan predicts the exchange's downtime)
    t_step = time.perf_counter()
    while True:
        if job is None:  # a spare: wait until a switch takes this device (or the job ends)
            try:
                result = sw.join(timeout=SPARE_TIMEOUT)
            except RendezvousTimeout as err:  # every layout's rank 0 (it announces) is gpu0
                leader = Layout(first).devices[0]
                raise RendezvousTimeout(f"a spare waited {SPARE_TIMEOUT:.0f} s for {leader} "
                                        f"(the job's rank 0) to announce a switch: {err}",
                                        (leader,)) from err
            if result is None:
                return
            job = result.job
            for past in [i for i in switch_at if i <= job.iteration]:
                del switch_at[past]  # switches up to now happened without this process
            records.append(report(sw, result, None))
            continue
        it = job.iteration
        if it == iterations:
            break
        if it in switch_at:
            why = switch_at.pop(it)[1]
            try:
                result = sw.switch(job)
            except SwitchFailed as err:  # the job trains on in the old layout
                job = err.job
                if job is None:
                    raise
                if sw.leader:
                    print(f"switch failed, training on: {err}", flush=True)
                continue
            job = result.job
            if result.role != "left":  # a leaver has no group now: it goes idle as a spare
                plan = pending.result().plan if pending is not None else None
                records.append(report(sw, result, why, plan))
            t_step = time.perf_counter()
            continue
        if it + ahead in switch_at:
            pending = sw.prepare(switch_at[it + ahead][0])  # plans while it trains
        if it + 1 in switch_at and pending is not None:
            # The boundary before the switch: the destination job is built now (once every
            # process has its plan; where the world changes, in its world made ahead, the
            # joiners building with the job), so the switch only checks, exchanges and votes.
            # Where it cannot be, it is built at the switch (the reason is kept).
            futures.wait([pending])
            sw.build_ahead(job)
        loss = trainer.step(job)
        printer = (loss is not None and ps.get_tensor_model_parallel_rank() == 0
                   and ps.get_data_parallel_rank() == 0)
        if printer:
            losses[it + 1] = loss
            now = time.perf_counter()
            print(f"iteration {it + 1:3d}  loss {loss:.4f}  {label(sw.spec)}  "
                  f"{trainer.micro_batches()} micro-batches/rank  {now - t_step:.2f} s",
                  flush=True)
            t_step = now
    sw.close()
    # Each iteration's loss was printed by one process; every process is in the last layout.
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses)
    if args.json and sw.leader:
        merged = {i: v for part in gathered for i, v in part.items()}
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "no_switch": args.no_switch,
                       "iterations_per_layout": args.iterations_per_layout,
                       "iterations": job.iteration, "switches": records,
                       "losses": [merged.get(i) for i in range(1, iterations + 1)]}, f, indent=1)


def report(sw: LiveSwitcher, result, why: str | None, plan=None) -> dict:
    """Gather what the switch cost over the new layout's processes; its rank 0 prints it, with
    the downtime predicted for the plan's exchange (wire model plus the runtime's fixed costs:
    gloo-local measured on a CPU machine, h100 for NCCL)."""
    s, r = result.seconds, result.report
    mine = torch.tensor([r["bytes_received"], r["bytes_local"], s["downtime"], s["exchange"],
                         s.get("plan", 0.0) + s.get("verify", 0.0), r["rounds"],
                         float(result.role == "joined"), r.get("arrived_at", -1.0),
                         r.get("left_at", -1.0)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        mine = mine.cuda()
    got = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(got, mine)
    t = torch.stack(got).cpu()
    rec = {"generation": result.generation, "to": sw.spec.name, "processes": len(got),
           "joined": int(t[:, 6].sum()), "bytes_moved": int(t[:, 0].sum()),
           "bytes_local": int(t[:, 1].sum()), "downtime_s": float(t[:, 2].max()),
           "exchange_s": float(t[:, 3].max()), "plan_verify_s": float(t[:, 4].max()),
           "rounds": int(t[:, 5].max())}
    # The job's downtime: from the last process's arrival at the boundary to the last one's
    # departure (one machine's wall clock; a process's own downtime includes its wait for the
    # slower ones to finish their iteration).
    # Joiners were not in the job when it stopped: they report no arrival (0).
    stayed = t[:, 6] == 0
    rec["job_downtime_s"] = (float(t[:, 8].max() - t[stayed, 7].max())
                             if bool((t[stayed, 7] > 0).all() and (t[:, 8] > 0).all()) else None)
    if plan is not None:
        topo = PRESETS["h100" if dist.get_backend() == "nccl" else "gloo-local"]
        rec["predicted_exchange_s"] = predicted_downtime(plan, topo).total_seconds
    # The downtime by phase: each phase's slowest process (the phases hold each other up, so
    # their sum is about the downtime).
    phases: list = [None] * dist.get_world_size()
    dist.all_gather_object(phases, (result.phases(), result.seconds.get("groups_wait", 0.0),
                                    result.seconds.get("build_ahead"),
                                    bool(r.get("prepared_ahead"))))
    rec["phases_s"] = {name: max(p.get(name, 0.0) for p, _, _, _ in phases)
                       for name in phases[0][0]}
    # Each process's part of the exchange made at the build ahead (build_ahead(job)): the
    # switch's exchange then only moved bytes.
    rec["exchange_made_ahead"] = all(m for _, _, _, m in phases)
    # Megatron's groups of a same-devices switch or of one where devices only leave (then the
    # destination's world too), made while the job trained (LiveSwitcher's groups_ahead): how
    # many this process took ready-made.
    rec["groups_ahead"] = int(r.get("groups_ahead", 0))
    rec["world_ahead"] = bool(r.get("world_ahead", False))
    rec["groups_wait_s"] = max(w for _, w, _, _ in phases)  # of parallel_state: waiting for them
    built = [b for _, _, b, _ in phases]
    # The destination job built at the boundary before the switch (LiveSwitcher.build_ahead):
    # the slowest process's time there, else why it was built at the switch.
    rec["built_ahead_s"] = max(built) if all(b is not None for b in built) else None
    rec["built_at_switch_because"] = None if rec["built_ahead_s"] is not None else sw.ahead_why
    if sw.leader:
        note = f"  ({why})" if why else ""
        print(f"switch {rec['generation']} -> {label(sw.spec)} on {rec['processes']} processes"
              f"{note}: downtime {rec['downtime_s']:.2f} s (exchange {rec['exchange_s']:.3f} s"
              + (f", predicted {rec['predicted_exchange_s']:.3f} s" if plan is not None else "")
              + f", {plural(rec['rounds'], 'round')}), {rec['bytes_moved'] / 2**20:.2f} MiB moved + "
              f"{rec['bytes_local'] / 2**20:.2f} MiB local, {rec['joined']} joined; planned and "
              f"verified in the background in {rec['plan_verify_s']:.2f} s", flush=True)
        world = "the destination's world and " if rec["world_ahead"] else ""
        ahead = (f"; {world}{rec['groups_ahead']} of megatron's groups made while training "
                 f"(waited {rec['groups_wait_s']:.3f} s for them)" if rec["groups_ahead"] else "")
        if rec["built_ahead_s"] is not None:
            made = " and every process's exchange made" if rec["exchange_made_ahead"] else ""
            ahead += (f"; destination job built{made} ahead, at the boundary before "
                      f"({rec['built_ahead_s']:.3f} s)")
        print("  phases: " + ", ".join(f"{name} {s:.3f}" for name, s in rec["phases_s"].items())
              + f" s (slowest process each){ahead}", flush=True)
        if rec["job_downtime_s"] is not None:
            print(f"  the job stood still {rec['job_downtime_s']:.3f} s from the last process's "
                  "arrival at the boundary", flush=True)
    return rec


if __name__ == "__main__":
    main(ARGS)
