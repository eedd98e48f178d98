"""Live layout switches of a training tiny MoE GPT, through a simulated spot preemption.

    torchrun --nproc-per-node 8 --master-port 29533 examples/live_switch_gpt.py

Eight processes (CPU with gloo, or GPUs with NCCL) train a 4-layer MoE GPT on synthetic data
with a global batch of 24 sequences, and switch layouts live, without checkpoints:

    iteration  0  TP2 DP4 EP4            8 processes
    iteration  6  TP2 DP3 EP2            6 processes   spot preemption: gpu6-7 leave (spares)
    iteration 12  TP2 PP2 DP2 EP2        8 processes   capacity is back: the spares join
    iteration 18  TP1 DP8 EP4            8 processes

Each switch is planned and verified in the background two iterations ahead, then runs at the
iteration boundary: every process of both layouts meets through a ``Rendezvous`` on torchrun's
own store, the state moves (params, fp32 main params, Adam moments, step, LR scheduler,
iteration, consumed samples) and training continues; the micro-batches per rank change with DP
so the global batch does not. Printed: the loss of every iteration, and for every switch its
downtime, the bytes moved and what planning took. ``--no-switch`` trains the same iterations in
the first layout only (a reference loss curve).

The processes that leave idle as spares in ``LiveSwitcher.join`` until a switch takes them
back; a process started later on another machine would do the same with a ``Rendezvous`` on
the same store (see ``tests/test_live_world.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mcore_job  # noqa: E402  (imports megatron; the shim is applied per process below)

from dynatrain.ir.layout import Layout  # noqa: E402
from dynatrain.ir.loader import spec_from_dict  # noqa: E402
from dynatrain.runtime.megatron import (LiveSwitcher, Rendezvous, SwitchFailed,  # noqa: E402
                                        parallel_kwargs)
from dynatrain.verify.check import check  # noqa: E402

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
ITERATIONS = 24
PREPARE_AHEAD = 2  # plan and verify this many iterations before the switch


def spec(model: dict, name: str, parallel: dict, processes: int):
    return spec_from_dict({"name": name, "model": model, "parallel": parallel,
                           "world": {"nodes": 1, "gpus_per_node": processes}})


def label(s) -> str:
    p = s.parallel
    parts = ([f"TP{p.tp}"] if p.tp > 1 else []) + ([f"PP{p.pp}"] if p.pp > 1 else [])
    parts += ([f"VPP{p.vpp}"] if p.vpp else []) + [f"DP{Layout(s).dp}"]
    parts += ([f"EP{p.ep}"] if p.ep > 1 else []) + ([f"ETP{p.etp}"] if (p.etp or 1) > 1 else [])
    return " ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="moe")
    ap.add_argument("--no-switch", action="store_true", help="stay in the first layout")
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--json", help="write the switch records here (rank 0 of the last layout)")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    device = f"node{os.environ.get('GROUP_RANK', '0')}:gpu{local_rank}"
    mcore_job.set_device(local_rank)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=300))
    rdzv = Rendezvous(store, mcore_job.backend(), prefix="live-switch-gpt", timeout=180)
    model = MODELS[args.model]
    schedule = [(it, spec(model, n, p, k), why) for it, n, p, k, why in SCHEDULES[args.model]]
    if args.no_switch:
        schedule = schedule[:1]
    with mcore_job.cpu_shim():
        run(device, rdzv, schedule, args)


def run(device: str, rdzv: Rendezvous, schedule: list, args) -> None:
    from megatron.core import parallel_state as ps

    trainer = mcore_job.GlobalBatch(args.global_batch, args.seq, BASE["vocab_size"])
    first = schedule[0][1]
    kw = dict(rendezvous=rdzv, timeout=180, init_kwargs=mcore_job.init_kwargs())
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
    records: list[dict] = []
    t_step = time.perf_counter()
    while True:
        if job is None:  # a spare: wait until a switch takes this device (or the job ends)
            result = sw.join()
            if result is None:
                return
            job = result.job
            for past in [i for i in switch_at if i <= job.iteration]:
                del switch_at[past]  # switches up to now happened without this process
            records.append(report(sw, result, None))
            continue
        it = job.iteration
        if it == ITERATIONS:
            break
        if it + PREPARE_AHEAD in switch_at:
            sw.prepare(switch_at[it + PREPARE_AHEAD][0])  # plans while the job trains
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
                records.append(report(sw, result, why))
            t_step = time.perf_counter()
            continue
        loss = trainer.step(job)
        printer = (loss is not None and ps.get_tensor_model_parallel_rank() == 0
                   and ps.get_data_parallel_rank() == 0)
        if printer:
            now = time.perf_counter()
            print(f"iteration {it + 1:3d}  loss {loss:.4f}  {label(sw.spec)}  "
                  f"{trainer.micro_batches()} micro-batches/rank  {now - t_step:.2f} s",
                  flush=True)
            t_step = now
    sw.close()
    if args.json and sw.leader:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


def report(sw: LiveSwitcher, result, why: str | None) -> dict:
    """Gather what the switch cost over the new layout's processes; its rank 0 prints it."""
    s, r = result.seconds, result.report
    mine = torch.tensor([r["bytes_received"], r["bytes_local"], s["downtime"], s["exchange"],
                         s.get("plan", 0.0) + s.get("verify", 0.0), r["rounds"],
                         float(result.role == "joined")], dtype=torch.float64)
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
    if sw.leader:
        note = f"  ({why})" if why else ""
        print(f"switch {rec['generation']} -> {label(sw.spec)} on {rec['processes']} processes"
              f"{note}: downtime {rec['downtime_s']:.2f} s (exchange {rec['exchange_s']:.3f} s"
              f", {rec['rounds']} rounds), {rec['bytes_moved'] / 2**20:.2f} MiB moved + "
              f"{rec['bytes_local'] / 2**20:.2f} MiB local, {rec['joined']} joined; planned and "
              f"verified in the background in {rec['plan_verify_s']:.2f} s", flush=True)
    return rec


if __name__ == "__main__":
    main()
