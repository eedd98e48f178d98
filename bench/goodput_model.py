"""The goodput bench's model of its trace at 1k-100k GPUs for the shipped presets (an estimate
from stated assumptions, not a measurement): ``goodput_bench.py`` prints it after the measured
ways; ``scale_model``'s docstring says what each way's downtime and devices in use are made of.
"""

from __future__ import annotations

import math
import os

from dynatrain.ir.layout import Layout

HERE = os.path.dirname(os.path.abspath(__file__))
WAYS_MODELLED = ("live", "live-ahead", "checkpoint", "dp-only")

SCALE_PRESETS = ["specs/llama3.1-70b/tp8-pp4-dp4.yaml",
                 "specs/qwen3-235b-a22b/tp4-pp8-ep16-256gpu.yaml",
                 "specs/deepseek-v3/tp2-pp8-ep32-512gpu.yaml"]
SCALES = [1024, 10240, 102400]
VOTE_S = 0.1  # assumed: the commit vote, one small all-gather
# Published goodput of the peers (docs/field.md): each on its own trace, not this one.
PUBLISHED = [("LiveR", "99% goodput on spot GPUs (live handoff, target world pre-warmed)"),
             ("ByteRobust", "97% effective training time ratio, 3 months on 9,600 GPUs"),
             ("SageMaker HyperPod", "up to 95% goodput (checkpointless, spares)")]


def _nccl_init_s(n: int, args) -> float:
    """Assumed: forming a world's communicators, log-linear in the GPUs between the two
    stated points (1,024 and 102,400)."""
    lo, hi = args.nccl_init_s_1k, args.nccl_init_s_100k
    x = (math.log(n) - math.log(1024)) / (math.log(102400) - math.log(1024))
    return lo + (hi - lo) * min(max(x, 0.0), 1.0)


def scale_model(args, cold_start: float) -> list[dict]:
    """Each preset at 1k-100k GPUs through a trace like the bench's: nodes of 8 GPUs get a
    notice at random (one per ``--node-hours`` node-hours), come back after ``--back-min``
    minutes. Per switch (a node leaving or coming back):

    * live: every device's state moved once over its NIC (an upper bound of the exchange) +
      the new world's communicators + building the job (the world is not formed ahead);
      it trains on every device that stays;
    * checkpoint: save + a cold start of the processes (measured here) + communicators +
      build + load, at ``--ckpt-GBps`` per device; it trains on every device that stays;
    * live, world ahead (not built for world changes yet: #37's first item): the same with the
      communicators and the job formed while the job trains, so the switch is the exchange
      and its commit vote;
    * dp-only: the replicas' cross-replica communicators formed again (a group of as many
      members as replicas; each replica's own keep running), a returning replica healing its
      state from a peer over its NICs; it trains on whole replicas only (those without a node
      that is out).

    Throughput scales perfectly with the devices in use. The effective training time ratio is
    (1 - switches per second x downtime per switch) x the mean fraction of devices in use."""
    from dynatrain.ir.layout import DTYPE_BYTES
    from dynatrain.ir.loader import load_spec
    from dynatrain.ir.state import OPTIMIZER_KINDS
    from dynatrain.ir.summary import rank_elements
    from dynatrain.planner.cost import H100

    rows = []
    for path in SCALE_PRESETS:
        spec = load_spec(os.path.join(HERE, "..", path))
        lay = Layout(spec)
        coords = [lay.coords(r) for r in range(lay.world)]
        reps_base = min(1 + max(c.dp for c in coords), 1 + max(c.edp for c in coords))
        replica = lay.world // reps_base  # devices holding one whole copy of the model
        opt_bytes = sum(DTYPE_BYTES[getattr(spec.state, k)] for k in OPTIMIZER_KINDS
                        if getattr(spec.state, k) is not None)
        sample = range(0, lay.world, max(1, lay.world // 64))
        per = [rank_elements(lay, r) for r in sample]
        p_bytes = max(p for p, _ in per) * DTYPE_BYTES[spec.state.param]
        o_bytes = max(o for _, o in per) * opt_bytes
        for target in SCALES:
            reps = max(1, round(target / replica))
            n = reps * replica
            nodes = n // 8
            state = p_bytes + o_bytes * reps_base / reps  # the optimizer shards over replicas
            per_hour = nodes / args.node_hours  # notices per hour
            out_nodes = per_hour * args.back_min / 60.0  # nodes out at a time, on average
            nodes_per_rep = max(1, replica // 8)
            # Replicas hit by out_nodes nodes falling at random (expected count).
            hit = reps * (1.0 - (1.0 - 1.0 / reps) ** out_nodes) if reps > 1 else \
                min(1.0, out_nodes)
            nccl = _nccl_init_s(n, args)
            wire = state / (H100.inter_node_GBps * 1e9)
            ckpt_io = state / (args.ckpt_GBps * 1e9)
            regroup = _nccl_init_s(reps, args)  # cross-replica groups: as many as replicas
            ways = {
                "live": ((wire + nccl + args.build_s), 1.0 - out_nodes * 8 / n),
                "live-ahead": (wire + VOTE_S, 1.0 - out_nodes * 8 / n),
                "checkpoint": ((2 * ckpt_io + cold_start + nccl + args.build_s),
                               1.0 - out_nodes * 8 / n),
                # Leaving: communicators; coming back: heal from a peer + communicators.
                "dp-only": ((2 * regroup + wire) / 2, 1.0 - hit * nodes_per_rep * 8 / n),
            }
            label = "/".join(os.path.splitext(path)[0].split("/")[1:])
            row = {"preset": label, "gpus": n, "replica_gpus": replica,
                   "state_GB_per_device": state / 1e9, "notices_per_hour": per_hour,
                   "nodes_out": out_nodes, "nccl_init_s": nccl}
            for way, (down, used) in ways.items():
                busy = min(1.0, 2 * per_hour * down / 3600.0)  # two switches per notice
                row[way] = {"downtime_per_switch_s": down, "devices_in_use": max(0.0, used),
                            "ratio": (1.0 - busy) * max(0.0, used)}
            rows.append(row)
    return rows


def scale_table(rows: list[dict], args, cold_start: float) -> str:
    head = (f"{'preset':36s} {'GPUs':>7s} {'notices/h':>9s} {'out':>5s} | "
            + " | ".join(f"{w:>10s} down  use  ratio" for w in WAYS_MODELLED))
    lines = [f"modelled (not measured): a node of 8 GPUs gets a notice every {args.node_hours:g}"
             f" node-hours and is back after {args.back_min:g} min; communicators "
             f"{args.nccl_init_s_1k:g} s at 1k GPUs to {args.nccl_init_s_100k:g} s at 100k "
             f"(assumed), build {args.build_s:g} s, checkpoint I/O {args.ckpt_GBps:g} GB/s per "
             f"device, cold start {cold_start:.1f} s (measured here), exchange at the H100 "
             "preset's NIC speed", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['preset'][:36]:36s} {r['gpus']:7d} {r['notices_per_hour']:9.2f} "
                     f"{r['nodes_out']:5.1f} | " + " | ".join(
                         f"{r[w]['downtime_per_switch_s']:9.1f}s {r[w]['devices_in_use']:5.3f} "
                         f"{r[w]['ratio']:5.3f}" for w in WAYS_MODELLED))
    lines.append("published, each on its own trace: " + "; ".join(
        f"{name}: {what}" for name, what in PUBLISHED))
    return "\n".join(lines)
