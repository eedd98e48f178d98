"""Calibrate the ``gloo-local`` topology: the fixed costs and wire speed of a switch here.

    python bench/calibrate_fixed_costs.py              # 11 switches x 2-4 budgets x 2 ways x 2
    python bench/calibrate_fixed_costs.py --quick      # 5 switches x 1-2 budgets x 2 ways x 1
    python bench/calibrate_fixed_costs.py --refit FILE # fit again the runs of an earlier JSON
    python bench/calibrate_fixed_costs.py --out FILE   # JSON elsewhere (default bench/results/)

Each run is ``dynatrain.runtime.local.run_local`` (what ``dynatrain run-plan`` runs: one gloo
CPU process per device, bit-exact check) on the tiny GPT of ``specs/tiny-gpt/`` switched
(and the same GPT 4x and 8x wider) between layouts of 4 devices, at staging budgets that give
1 to hundreds of rounds, so that the number of rounds and the bytes vary independently; and on
``runtime_bench.py``'s 40M-parameter model (its two switches, ~375 MiB moved), so that the
wire speed is also fitted on the large messages that bench moves. Each switch runs two ways:
as a live switch runs, into destination storage allocated before the switch, in processes that
ran the same switch once before (``preallocated=True, warmup=True``); and as ``run-plan`` runs
it, allocating its destination in fresh processes. Each (switch, budget, way) counts once in
the fit, by its fastest repeat. From every run's per-process switch reports it takes the
slowest process's ``total_seconds`` (the downtime of the switch call) and fits:

* on the first way, the per-switch part (``switch_fixed_s``), the per-round part
  (``round_fixed_us``) and the wire bandwidth (``intra_node_GBps``): a least-squares fit of the
  downtime against one, the plan's rounds and the wire model's busiest-link bytes per round,
  summed over rounds; each run's error counts relative to its downtime, so a 30 ms switch
  weighs as much as a 1 s one;
* on the second, what it takes beyond that prediction, against one (``allocate_fixed_s``) and
  the busiest device's destination bytes (``first_touch_GBps``), alike.

It prints every run, the fitted constants, each run's predicted downtime with them against
its measured one, and writes the same as JSON; the constants go into ``PRESETS["gloo-local"]``
in ``dynatrain/planner/cost.py`` by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.state import transition_views
from dynatrain.planner.cost import PRESETS, destination_bytes, link_bytes, predicted_downtime
from dynatrain.planner.pipeline import plan_transition
from dynatrain.runtime.local import run_local
from runtime_bench import MODEL as LLAMA_40M  # this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "calibrate_fixed_costs.json"
KIB = 1 << 10
MODEL = yaml.safe_load((ROOT / "specs" / "tiny-gpt" / "tp2-dp2.yaml").read_text())["model"]
# The same GPT 4x and 8x wider (~16x and ~64x the bytes): the tiny one moves too little to pin
# the bandwidth. The widest runs only at the large budgets (small ones give hundreds of rounds).
WIDE = {**MODEL, "hidden_size": 512, "ffn_hidden_size": 1408}
WIDEST = {**MODEL, "hidden_size": 1024, "ffn_hidden_size": 2816}

# (source parallel, destination parallel) on the same 4 devices
PAIRS: dict[str, tuple[dict, dict]] = {
    "tp2-dp2 -> pp2-dp2": ({"tp": 2}, {"pp": 2}),
    "pp2-dp2 -> tp2-dp2": ({"pp": 2}, {"tp": 2}),
    "dp4 -> tp4": ({}, {"tp": 4}),
    "tp4 -> tp2-pp2": ({"tp": 4}, {"tp": 2, "pp": 2}),
    "tp2-pp2 -> pp4": ({"tp": 2, "pp": 2}, {"pp": 4}),
    "pp4 -> dp4": ({"pp": 4}, {}),
    "wide tp2-dp2 -> pp2-dp2": ({"tp": 2}, {"pp": 2}),
    "wide dp4 -> tp4": ({}, {"tp": 4}),
    "widest tp2-dp2 -> tp4": ({"tp": 2}, {"tp": 4}),
    "40M tp2-dp2 -> tp4": ({"tp": 2}, {"tp": 4}),  # runtime_bench's two switches
    "40M tp2-dp2 -> tp2-pp2": ({"tp": 2}, {"tp": 2, "pp": 2}),
}
QUICK_PAIRS = ("tp2-dp2 -> pp2-dp2", "pp4 -> dp4", "wide dp4 -> tp4", "widest tp2-dp2 -> tp4",
               "40M tp2-dp2 -> tp4")
LARGE = ("widest", "40M")  # run only at budgets of 4 MiB and more (else hundreds of rounds)
BUDGETS = (64 << 20, 4 << 20, 1 << 20, 256 * KIB)  # 1 to ~40 rounds


def _layout(name: str, par: dict) -> Layout:
    model = (LLAMA_40M if name.startswith("40M") else WIDEST if name.startswith("widest")
             else WIDE if name.startswith("wide") else MODEL)
    return Layout(spec_from_dict({"name": "tiny-gpt", "model": model, "parallel": par,
                                  "world": {"nodes": 1, "gpus_per_node": 4}}))


def wire_bytes(plan) -> int:
    """Sum over rounds of the busiest device's busiest link (bytes): what the wire model
    divides by the link speed (all devices here are on one "node")."""
    total = 0
    for rnd in plan.rounds:
        per = link_bytes(rnd.messages).values()
        total += max((max(lb.intra_out, lb.intra_in) for lb in per), default=0)
    return total


def busiest_messages(plan) -> int:
    """Sum over rounds of the most remote messages one device sends and receives."""
    total = 0
    for rnd in plan.rounds:
        count: dict[str, int] = {}
        for m in rnd.messages:
            if not m.local:
                count[m.src_device] = count.get(m.src_device, 0) + 1
                count[m.dst_device] = count.get(m.dst_device, 0) + 1
        total += max(count.values(), default=0)
    return total


def _plan(name: str, budget: int):
    src_par, dst_par = PAIRS[name]
    sv, dv = transition_views(_layout(name, src_par), _layout(name, dst_par))
    return plan_transition(sv.layout, dv.layout, budget), sv, dv


def measure(name: str, budget: int, preallocated: bool) -> dict[str, Any]:
    plan, sv, dv = _plan(name, budget)
    # Into preallocated storage as a live switch runs: in processes that switched before (one
    # untimed switch first). Allocating as run-plan runs: in fresh processes.
    results = run_local(plan, sv, dv, timeout=60.0, preallocated=preallocated,
                        warmup=preallocated)
    errors = [e for r in results for e in r["errors"]]
    if errors:
        raise SystemExit(f"{name}: {errors[0]}")
    reps = [r["report"] for r in results]
    downtime = max(r["total_seconds"] for r in reps)
    fixed = max(r["setup_seconds"] for r in reps) + min(r["vote_seconds"] for r in reps)
    return {"case": name, "budget_bytes": budget, "preallocated": preallocated,
            "rounds": len(plan.rounds),
            "destination_bytes": max(destination_bytes(plan).values(), default=0),
            "messages": sum(1 for m in plan.messages() if not m.local),
            "busiest_messages": busiest_messages(plan),
            "bytes_moved": plan.stats["bytes_moved"], "wire_bytes": wire_bytes(plan),
            "downtime_s": downtime, "switch_fixed_s": fixed,
            "setup_s": max(r["setup_seconds"] for r in reps),
            "vote_s": min(r["vote_seconds"] for r in reps),
            "exchange_s": max(r["exchange_seconds"] for r in reps),
            "round_wait_s": max(r["round_wait_seconds"] for r in reps),
            "plan": plan}


def fit(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Fit on the switches into preallocated storage: the per-switch part measured (median),
    per-round cost and bandwidth fitted to the rest; then, on the switches that allocate their
    destination, the rate that gets it ready (``first_touch_GBps``) fitted to what they take
    beyond that.

    Each (switch, budget, mode) counts once, by its fastest repeat: on a shared host the
    others measure the other work as much as the switch (as every bench here takes the best);
    every error counts relative to the downtime, so a 60 ms switch weighs as much as a 1 s one.
    """
    best = best_runs(runs)
    pre = [r for r in best if r.get("preallocated")]
    if not pre or not all("destination_bytes" in r for r in best):
        raise SystemExit("no switch into preallocated storage among the runs (a calibration "
                         "of before first_touch_GBps): run the calibration again")
    # downtime = switch_fixed + rounds * per_round + wire_bytes * per_byte, on relative errors
    a = np.array([[1.0, r["rounds"], r["wire_bytes"]] for r in pre], dtype=float)
    y = np.array([r["downtime_s"] for r in pre])
    w = 1.0 / y
    (switch_fixed, per_round, per_byte), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    if min(switch_fixed, per_round) < 0 or per_byte <= 0:  # the measured fixed part instead
        switch_fixed = statistics.median(r["switch_fixed_s"] for r in pre)
        a, y = a[:, 1:], y - switch_fixed
        (per_round, per_byte), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
        per_round, per_byte = max(0.0, per_round), max(per_byte, 1e-12)
    out = {"switch_fixed_s": switch_fixed, "round_fixed_us": per_round * 1e6,
           "intra_node_GBps": 1e-9 / per_byte}
    alloc = [r for r in best if not r.get("preallocated")]
    topo = replace_topology(out)
    # downtime = predicted into existing storage + c + bytes * x: least squares on relative
    # errors (c: what a fresh process's switch pays beyond a warm one's)
    if alloc:
        a = np.array([[1.0, r["destination_bytes"]] for r in alloc], dtype=float)
        y = np.array([r["downtime_s"] - predicted_downtime(r["plan"], topo).total_seconds
                      for r in alloc])
        w = 1.0 / np.array([r["downtime_s"] for r in alloc])
        (c, x), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
        if c < 0 or x <= 0:  # refit the one that makes sense alone
            d, ww = a[:, 1], w * w
            if x > 0:
                c, x = 0.0, max(float(np.dot(ww * d, y) / np.dot(ww, d * d)), 1e-15)
            else:
                c, x = max(0.0, float(np.dot(ww, y) / ww.sum())), 1e-15
    else:
        c, x = 0.0, 1e-15
    out["allocate_fixed_s"] = float(c)
    out["first_touch_GBps"] = min(1e6, 1e-9 / x)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 switches, 1-2 budgets, 1 repeat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--refit", type=Path, help="fit the runs of this earlier JSON, run nothing")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    names = QUICK_PAIRS if args.quick else tuple(PAIRS)
    budgets = (BUDGETS[0], BUDGETS[-1]) if args.quick else BUDGETS
    repeats = 1 if args.quick else args.repeats
    t0 = time.perf_counter()
    runs = json.loads(args.refit.read_text())["runs"] if args.refit else []
    for r in runs:
        r["plan"] = _plan(r["case"], r["budget_bytes"])[0]
    print(f"{'switch':<24} {'budget':>8} {'dst':>5} {'rnd':>3} {'msgs':>4} {'wire MiB':>8} {'down s':>7} "
          f"{'setup s':>7} {'vote s':>7} {'exch s':>7}")
    for _ in range(0 if args.refit else repeats):
        for name in names:
            for budget in budgets:
                if name.startswith(LARGE) and budget < 4 << 20:
                    continue
                for pre in (True, False):
                    r = measure(name, budget, pre)
                    runs.append(r)
                    print(f"{name:<24} {budget // KIB:>6}Ki {'pre' if pre else 'alloc':>5} "
                          f"{r['rounds']:>3} {r['messages']:>4} "
                          f"{r['wire_bytes'] / 2**20:8.2f} {r['downtime_s']:7.3f} "
                          f"{r['setup_s']:7.3f} {r['vote_s']:7.3f} {r['exchange_s']:7.3f}",
                          flush=True)
    consts = fit(runs)
    topo = replace_topology(consts)
    print(f"\nfitted over {len(best_runs(runs))} switches (the fastest of {len(runs)} runs): "
          f"switch_fixed_s {consts['switch_fixed_s']:.4f}, "
          f"round_fixed_us {consts['round_fixed_us']:.0f}, intra_node_GBps "
          f"{consts['intra_node_GBps']:.3f}, allocate_fixed_s {consts['allocate_fixed_s']:.4f}, "
          f"first_touch_GBps {consts['first_touch_GBps']:.3f}")
    errs, by_mode = [], {"preallocated": [], "allocating": []}
    for r in best_runs(runs):
        d = predicted_downtime(r["plan"], topo, allocates=not r.get("preallocated"))
        r["predicted_s"] = d.total_seconds
        errs.append(d.total_seconds / r["downtime_s"])
        by_mode["preallocated" if r.get("preallocated") else "allocating"].append(errs[-1])
    for mode, e in [("all", errs), *by_mode.items()]:
        if not e:
            continue
        dec = statistics.quantiles(e, n=10) if len(e) > 1 else e * 9
        inside = sum(0.7 <= x <= 1.4 for x in e)
        print(f"predicted / measured downtime with them ({mode}, {len(e)} switches): median "
              f"{statistics.median(e):.2f}, 10-90% {dec[0]:.2f}..{dec[-1]:.2f}, range "
              f"{min(e):.2f}..{max(e):.2f}; {inside} of {len(e)} within 0.7-1.4x")
    out = {"environment": {"cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                           "python": sys.version.split()[0]},
           "constants": consts, "predicted_over_measured": errs,
           "predicted_over_measured_by_mode": by_mode,
           "runs": [{k: v for k, v in r.items() if k != "plan"} for r in runs],
           "wall_seconds": time.perf_counter() - t0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


def best_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fastest repeat of each (switch, budget, mode)."""
    best: dict[tuple, dict[str, Any]] = {}
    for r in runs:
        k = (r["case"], r["budget_bytes"], bool(r.get("preallocated")))
        if k not in best or r["downtime_s"] < best[k]["downtime_s"]:
            best[k] = r
    return list(best.values())


def replace_topology(consts: dict[str, float]):
    """The ``gloo-local`` preset with the fitted constants in place of its own."""
    base = PRESETS["gloo-local"]
    return base.model_copy(update={k: float(v) for k, v in consts.items()})


if __name__ == "__main__":
    sys.exit(main())
