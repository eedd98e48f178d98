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
    notice at random (one per ``--node-hours`` node-hours) or fail without one (one per
    ``--fail-node-hours``), and come back after ``--back-min`` minutes. Per switch (a node
    leaving on notice or coming back):

    * live: every device's state moved once over its NIC (an upper bound of the exchange) +
      the new world's communicators + building the job (NCCL groups are not made ahead);
      it trains on every device that stays;
    * checkpoint: save + a cold start of the processes (measured here) + communicators +
      build + load, at ``--ckpt-GBps`` per device; it trains on every device that stays;
    * live, world ahead: the same with the communicators and the job formed while the job
      trains, so the switch is the exchange and its commit vote (built on gloo where devices
      only leave, as on notice, or join after the job's devices; not NCCL communicators);
    * dp-only: the replicas' cross-replica communicators formed again (a group of as many
      members as replicas; each replica's own keep running), a returning replica healing its
      state from a peer over its NICs; it trains on whole replicas only (those without a node
      that is out).

    Per failure: ``--detect-s`` to see it, then for live (either kind: a failure is not known
    ahead) a recovery from the buddy copies, priced as a switch built at the time; for
    checkpoint a restart (cold start, communicators, build, load) and the work since the last
    save lost, half of ``--save-interval-min`` on average (saves assumed asynchronous, so
    they cost nothing else); for dp-only the cross-replica communicators formed again (the
    other replicas hold the state).

    Throughput scales perfectly with the devices in use. The effective training time ratio is
    (1 - downtime per second) x the mean fraction of devices in use."""
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
            fails_hour = nodes / args.fail_node_hours  # failures without notice per hour
            # nodes out at a time, on average
            out_nodes = (per_hour + fails_hour) * args.back_min / 60.0
            nodes_per_rep = max(1, replica // 8)
            # Replicas hit by out_nodes nodes falling at random (expected count).
            hit = reps * (1.0 - (1.0 - 1.0 / reps) ** out_nodes) if reps > 1 else \
                min(1.0, out_nodes)
            nccl = _nccl_init_s(n, args)
            wire = state / (H100.inter_node_GBps * 1e9)
            ckpt_io = state / (args.ckpt_GBps * 1e9)
            regroup = _nccl_init_s(reps, args)  # cross-replica groups: as many as replicas
            live = wire + nccl + args.build_s
            restart = cold_start + nccl + args.build_s + ckpt_io
            ways = {  # (per switch, per failure, devices in use)
                "live": (live, args.detect_s + live, 1.0 - out_nodes * 8 / n),
                "live-ahead": (wire + VOTE_S, args.detect_s + live, 1.0 - out_nodes * 8 / n),
                "checkpoint": (ckpt_io + restart,
                               args.detect_s + restart + 30.0 * args.save_interval_min,
                               1.0 - out_nodes * 8 / n),
                # Leaving: communicators; coming back: heal from a peer + communicators.
                "dp-only": ((2 * regroup + wire) / 2, args.detect_s + regroup,
                            1.0 - hit * nodes_per_rep * 8 / n),
            }
            label = "/".join(os.path.splitext(path)[0].split("/")[1:])
            row = {"preset": label, "gpus": n, "replica_gpus": replica,
                   "state_GB_per_device": state / 1e9, "notices_per_hour": per_hour,
                   "failures_per_hour": fails_hour, "nodes_out": out_nodes, "nccl_init_s": nccl}
            for way, (down, fail, used) in ways.items():
                # a notice: two switches (leaving, back); a failure: itself and the way back
                per_s = (2 * per_hour * down + fails_hour * (fail + down)) / 3600.0
                busy = min(1.0, per_s)
                row[way] = {"downtime_per_switch_s": down, "downtime_per_failure_s": fail,
                            "devices_in_use": max(0.0, used),
                            "ratio": (1.0 - busy) * max(0.0, used)}
            rows.append(row)
    return rows


def scale_table(rows: list[dict], args, cold_start: float) -> str:
    head = (f"{'preset':36s} {'GPUs':>7s} {'notices/h':>9s} {'fails/h':>7s} {'out':>5s} | "
            + " | ".join(f"{w:>10s} switch  fail  use  ratio" for w in WAYS_MODELLED))
    lines = [f"modelled (not measured): a node of 8 GPUs gets a notice every {args.node_hours:g}"
             f" node-hours, fails without one every {args.fail_node_hours:g} node-hours "
             f"(seen after {args.detect_s:g} s) and is back after {args.back_min:g} min; "
             f"communicators {args.nccl_init_s_1k:g} s at 1k GPUs to "
             f"{args.nccl_init_s_100k:g} s at 100k (assumed), build {args.build_s:g} s, "
             f"checkpoint I/O {args.ckpt_GBps:g} GB/s per device and a save every "
             f"{args.save_interval_min:g} min, cold start {cold_start:.1f} s (measured here), "
             "exchange at the H100 preset's NIC speed", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['preset'][:36]:36s} {r['gpus']:7d} {r['notices_per_hour']:9.2f} "
                     f"{r['failures_per_hour']:7.2f} {r['nodes_out']:5.1f} | " + " | ".join(
                         f"{r[w]['downtime_per_switch_s']:9.1f}s "
                         f"{r[w]['downtime_per_failure_s']:6.0f}s {r[w]['devices_in_use']:5.3f} "
                         f"{r[w]['ratio']:5.3f}" for w in WAYS_MODELLED))
    lines.append("published, each on its own trace: " + "; ".join(
        f"{name}: {what}" for name, what in PUBLISHED))
    return "\n".join(lines)
