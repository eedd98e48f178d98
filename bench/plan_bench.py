"""Planner benchmark: headline transitions, scaling with ranks, and PyTorch DCP's planner.

Five sections, each printed as a table and written to one JSON file:

1. headline: shipped spec pairs planned with a 2 GiB staging budget on the H100 topology; plan
   time, verification time and plan quality (bytes and predicted seconds against their lower
   bounds).
2. scaling: Llama-3.1-70B TP8 PP4 DP d -> TP8 PP8 DP d/2 on the same world, 64 to 8192 ranks;
   plan seconds, seconds per rank and the log-log slope of seconds against ranks.
3. dcp: the same weights-only transition planned by PyTorch DCP's resharding planner
   (``create_default_local_load_plan`` for every destination rank, then the global load plan)
   and by ``plan_transition``, in one process; the ratio is DCP seconds / ours.
4. slices: for each headline pair and scaling point, one process's own part
   (``plan_slice(..., spread=the global plan's)``) for the first, middle and last device, cold,
   next to the global plan's time; the DCP section adds our slowest slice of its case and the
   ratio DCP slowest rank / our slice.
5. series_405b: Llama-3.1-405B TP8 PP16 on N -> 3N/4 GPUs; up to ``--global-max`` GPUs the
   whole ``dynatrain plan A B --json P`` command (its wall time and its own plan and verify
   seconds), slices at every size, each in a fresh process (time, peak RSS).

Run ``python bench/plan_bench.py [--quick] [--full] [--global-max N] [--out FILE]``.
``--quick`` skips the 405B pair and series, stops the scaling sweep at 1024 ranks, runs one DCP
case and slices the middle device only (about a minute on a loaded 2-core machine).
``--full`` extends the 405B series from 2048 and 4096 to 98304 GPUs.
Everything is computed locally from the shipped specs; nothing touches the network.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec, spec_from_dict
from dynatrain.ir.spec import LayoutSpec
from dynatrain.ir.state import StateView
from dynatrain.planner.cost import H100
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.slices import plan_slice
from dynatrain.verify.check import verify

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
DEFAULT_OUT = ROOT / "bench" / "results" / "plan_bench.json"
BUDGET_BYTES = 2 << 30
GIB = 1 << 30

# (label, source spec, destination spec, skipped by --quick)
HEADLINE: tuple[tuple[str, str, str, bool], ...] = (
    ("70B pp4->pp8", "llama3.1-70b/tp8-pp4-dp4", "llama3.1-70b/tp8-pp8-dp2", False),
    ("70B dp4->dp3", "llama3.1-70b/tp8-pp4-dp4", "llama3.1-70b/tp8-pp4-dp3-96gpu", False),
    ("235B tp4pp8ep16->tp8pp4ep8", "qwen3-235b-a22b/tp4-pp8-ep16-256gpu",
     "qwen3-235b-a22b/tp8-pp4-ep8-256gpu", False),
    ("235B ep16->ep8 192gpu", "qwen3-235b-a22b/tp4-pp8-ep16-256gpu",
     "qwen3-235b-a22b/tp4-pp8-ep8-192gpu", False),
    ("405B dp32->dp24", "llama3.1-405b/tp8-pp16-dp32-4096gpu",
     "llama3.1-405b/tp8-pp16-dp24-3072gpu", True),
    ("DeepSeek-V3 ep64->ep32 512gpu", "deepseek-v3/tp2-pp8-ep64-1024gpu",
     "deepseek-v3/tp2-pp8-ep32-512gpu", False),
    ("GPT-OSS-120B dp16->dp12 96gpu", "gpt-oss-120b/tp2-pp4-ep8-128gpu",
     "gpt-oss-120b/tp2-pp4-ep8-96gpu", False),
)
SCALING_MODEL = "llama3.1-70b"
SCALING_WORLDS = tuple(64 << i for i in range(8))  # 64 .. 8192
QUICK_MAX_WORLD = 1024
PASS_COLUMNS = ("intersect", "pick_sources", "agree_rounds", "rounds")  # plan_transition's passes
TAIL_FROM = 1024  # fixed per-plan costs blur the slope on small worlds; fit the tail apart too
DCP_LARGE_WORLD = 1024  # a second, larger DCP case; --quick runs only the shipped 70B pair
DCP_REPEATS = 3
WEIGHTS_ONLY = {"main_param": None, "exp_avg": None, "exp_avg_sq": None}  # a StateConfig


# ---- helpers ------------------------------------------------------------------------------------

def spec_path(name: str) -> Path:
    return SPECS / f"{name}.yaml"


def clear_ir_caches() -> int:
    """Empty every ``lru_cache`` in the loaded dynatrain modules; returns how many.

    The IR memoizes model tables and shards by value at module level, so a second plan of the
    same model in one process runs warm. Clearing them times each plan as a fresh process
    would run it, and frees the layouts that method caches keep alive.
    """
    cleared = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("dynatrain.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            owners = [obj, *vars(obj).values()] if isinstance(obj, type) else [obj]
            for fn in owners:
                if callable(getattr(fn, "cache_clear", None)):
                    fn.cache_clear()
                    cleared += 1
    return cleared


@contextmanager
def settled_heap(collect: bool = True) -> Iterator[None]:
    """Collect garbage, then keep the objects that exist now out of the timed region's GC.

    Without this the collector rescans everything already built (torch's modules, DCP's
    inputs for every rank, earlier results) during the timed code, a cost no real run of
    either planner pays. ``collect=False`` also turns the collector off inside.
    """
    gc.collect()
    gc.freeze()
    if not collect:
        gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def timed_plan(src: LayoutSpec, dst: LayoutSpec, warm: bool = False,
               verified: bool = False) -> dict[str, Any]:
    """Plan ``src -> dst`` from freshly compiled layouts; the plan's stats plus seconds per pass.

    Cold by default (IR caches emptied first): compiling the layouts is part of planning.
    ``verified``: also run the verifier as ``dynatrain plan`` does (``verify_seconds``, ``ok``).
    """
    if not warm:
        clear_ir_caches()
    passes: dict[str, float] = {}

    def trace(name: str, _out: Any, seconds: float) -> None:
        passes[name] = passes.get(name, 0.0) + seconds

    # The collector is off while timed, as ``dynatrain plan`` leaves it: there the planner's
    # pause moves what it built to the oldest generation unscanned on the way out. Under the
    # frozen heap of ``settled_heap`` that move would thaw the bench's own objects, so the
    # pause skips it, and re-enabling the collector would scan every object of the plan once
    # (0.2-0.3 s on the 235B switch, seconds at 98304 GPUs), a cost the command never pays.
    with settled_heap(collect=False):
        s, d = Layout(src), Layout(dst)
        plan = plan_transition(s, d, budget_bytes=BUDGET_BYTES, topology=H100, trace=trace)
    stats = dict(plan.stats, pass_seconds=passes)
    if verified:  # as `dynatrain plan` does: same layouts, so the IR's caches are shared
        with settled_heap(collect=False):
            report = verify(plan, s, d, H100)
        stats.update(verify_seconds=report.seconds, verified=report.ok)
    del plan
    return stats


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def sampled_devices(src: LayoutSpec, dst: LayoutSpec) -> list[str]:
    """First, middle and last device of the switch (source devices, then new ones)."""
    s, d = Layout(src).devices, Layout(dst).devices
    seen = set(s)
    devs = [*s, *(x for x in d if x not in seen)]
    return list(dict.fromkeys([devs[0], devs[len(devs) // 2], devs[-1]]))


def timed_slice(src: LayoutSpec, dst: LayoutSpec, device: str,
                spread: tuple[int, int]) -> dict[str, Any]:
    """One process's part: ``device``'s slice from fresh layouts, cold (IR caches emptied).

    ``seconds`` counts compiling the layouts, as a process that plans only its own part
    would; ``slice_seconds`` is ``plan_slice``'s own figure.
    """
    clear_ir_caches()
    with settled_heap():
        t = time.perf_counter()
        part = plan_slice(Layout(src), Layout(dst), BUDGET_BYTES, device, spread=spread)
        seconds = time.perf_counter() - t
    return dict(device=device, seconds=seconds, slice_seconds=part.stats["slice_seconds"],
                transfers=part.stats["transfers"], messages=part.stats["messages"])


def slice_times(src: LayoutSpec, dst: LayoutSpec, spread: Any,
                one: bool = False, repeats: int = 1) -> dict[str, Any]:
    """Slice seconds of the sampled devices (``one``: the middle device only): max, mean
    and each; each device's the best of ``repeats`` cold runs."""
    devs = sampled_devices(src, dst)
    runs = [best_of(repeats, lambda d=d: timed_slice(src, dst, d, tuple(spread)),
                    key=lambda r: r["seconds"])
            for d in (devs[len(devs) // 2:][:1] if one else devs)]
    secs = [r["seconds"] for r in runs]
    return dict(slice_max_seconds=max(secs), slice_mean_seconds=sum(secs) / len(secs),
                slices=runs)


def log_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) against log(x): 1.0 means linear growth."""
    if len(xs) < 2:
        return None
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / den if den else None


def print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    """Plain fixed-width table: first column left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    print(f"\n{title}")
    print(line(headers))
    print(line(["-" * w for w in widths]))
    for r in rows:
        print(line(r))


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


# ---- 1. headline transitions --------------------------------------------------------------------

# Each headline switch is planned this many times, cold, and the run with the least plan +
# verify time is kept: on a small shared machine single runs of a few seconds vary by tens of
# percent. (The 405B series, minutes per size, runs once.)
HEADLINE_REPEATS = 3


def headline_row(label: str, src_name: str, dst_name: str) -> dict[str, Any]:
    """One shipped transition: its plan stats plus the two quality ratios (the best of
    ``HEADLINE_REPEATS`` cold runs)."""
    src, dst = load_spec(spec_path(src_name)), load_spec(spec_path(dst_name))
    s = best_of(HEADLINE_REPEATS, lambda: timed_plan(src, dst, verified=True),
                key=lambda r: r["plan_seconds"] + r["verify_seconds"])
    return dict(
        label=label, src=src_name, dst=dst_name,
        src_ranks=Layout(src).world, dst_ranks=Layout(dst).world,
        plan_seconds=s["plan_seconds"], verify_seconds=s["verify_seconds"],
        verified=s["verified"], transfers=s["transfers"], messages=s["messages"],
        rounds=s["rounds"], bytes_moved=s["bytes_moved"], bytes_lower_bound=s["bytes_lower_bound"],
        bytes_local=s["bytes_local"], bytes_ratio=ratio(s["bytes_moved"], s["bytes_lower_bound"]),
        predicted_seconds=s["predicted_seconds"], lower_bound_seconds=s["lower_bound_seconds"],
        time_ratio=ratio(s["predicted_seconds"], s["lower_bound_seconds"]),
        peak_staging_bytes=s["peak_staging_bytes"], budget_bytes=s["budget_bytes"],
        pass_seconds=s["pass_seconds"], spread=s["spread"],
    )


def run_headline(quick: bool, only: str | None = None) -> list[dict[str, Any]]:
    rows = [headline_row(label, a, b) for label, a, b, slow in HEADLINE
            if not (quick and slow) and (only is None or only in label)]
    print_table(
        f"1. Headline transitions (budget 2 GiB/device, H100 topology; best of "
        f"{HEADLINE_REPEATS} cold runs)",
        ["transition", "ranks", "plan s", "verify s", "transfers", "msgs", "rounds", "moved GiB", "LB GiB",
         "x", "pred s", "LB s", "x", "peak/budget GiB"],
        [[r["label"], f"{r['src_ranks']}->{r['dst_ranks']}", fmt(r["plan_seconds"]),
          fmt(r["verify_seconds"]) + ("" if r["verified"] else " FAIL"), str(r["transfers"]), str(r["messages"]), str(r["rounds"]),
          fmt(r["bytes_moved"] / GIB, ".1f"), fmt(r["bytes_lower_bound"] / GIB, ".1f"),
          fmt(r["bytes_ratio"]), fmt(r["predicted_seconds"], ".3f"),
          fmt(r["lower_bound_seconds"], ".3f"), fmt(r["time_ratio"]),
          f"{r['peak_staging_bytes'] / GIB:.2f}/{r['budget_bytes'] / GIB:.2f}"] for r in rows],
    )
    return rows


# ---- 2. scaling with ranks ----------------------------------------------------------------------

def scaling_spec(world: int, pp: int, weights_only: bool = False) -> LayoutSpec:
    """The scaling model at TP8 and the given PP on ``world`` ranks (8 GPUs per node)."""
    raw: dict[str, Any] = dict(model=SCALING_MODEL, parallel=dict(tp=8, pp=pp),
                               world=dict(nodes=world // 8, gpus_per_node=8))
    if weights_only:
        raw["state"] = WEIGHTS_ONLY
    return spec_from_dict(raw, origin=f"{SCALING_MODEL} W={world} pp={pp}")


def run_scaling(quick: bool) -> dict[str, Any]:
    worlds = [w for w in SCALING_WORLDS if not quick or w <= QUICK_MAX_WORLD]
    rows = []
    for w in worlds:
        s = timed_plan(scaling_spec(w, 4), scaling_spec(w, 8))
        rows.append(dict(ranks=w, src=f"tp8-pp4-dp{w // 32}", dst=f"tp8-pp8-dp{w // 64}",
                         plan_seconds=s["plan_seconds"],
                         seconds_per_rank=s["plan_seconds"] / w, transfers=s["transfers"],
                         messages=s["messages"], rounds=s["rounds"],
                         pass_seconds=s["pass_seconds"], spread=s["spread"]))
    xs, ys = [r["ranks"] for r in rows], [r["plan_seconds"] for r in rows]
    tail = [(x, y) for x, y in zip(xs, ys) if x >= TAIL_FROM]
    out = dict(model=SCALING_MODEL, transition="tp8-pp4-dpD -> tp8-pp8-dpD/2 (full state)",
               rows=rows, exponent_all=log_slope(xs, ys),
               exponent_tail=log_slope([x for x, _ in tail], [y for _, y in tail]),
               tail_from_ranks=TAIL_FROM)
    print_table(
        f"2. Scaling: {SCALING_MODEL} TP8 PP4 DP d -> TP8 PP8 DP d/2, same world (full state)",
        ["ranks", "plan s", "ms/rank", "transfers", "msgs", "rounds", *PASS_COLUMNS],
        [[str(r["ranks"]), fmt(r["plan_seconds"]), fmt(r["seconds_per_rank"] * 1e3, ".3f"),
          str(r["transfers"]), str(r["messages"]), str(r["rounds"]),
          *(fmt(r["pass_seconds"].get(p)) for p in PASS_COLUMNS)] for r in rows],
    )
    print(f"log-log slope of plan seconds vs ranks: {fmt(out['exponent_all'])} over "
          f"{xs[0]}..{xs[-1]}; {fmt(out['exponent_tail'])} over ranks >= {TAIL_FROM}")
    return out


# ---- 3. PyTorch DCP's resharding planner --------------------------------------------------------

def weights_only(name: str) -> LayoutSpec:
    """A shipped spec with its optimizer kinds removed (params only)."""
    raw = yaml.safe_load(spec_path(name).read_text(encoding="utf-8"))
    raw["state"] = WEIGHTS_ONLY
    return spec_from_dict(raw, origin=name)


def _fqn(key: str, kind: str) -> str:
    return key if kind == "param" else f"{key}/{kind}"


def _boxes_by_fqn(view: StateView, rank: int, primary_only: bool) -> dict[str, set]:
    """The distinct boxes ``rank`` holds, per DCP key (one key per logical tensor).

    One box per storage tensor (``regions``: each layer's and expert's weight apart), as
    megatron-core's sharded state dict gives DCP one chunk per module parameter; the IR's
    stacked regions are the planner's own economy, not DCP's.
    """
    out: dict[str, set] = {}
    for reg in view.regions(rank):
        if primary_only and not reg.primary:  # a tied copy is not saved twice
            continue
        out.setdefault(_fqn(reg.key, reg.kind), set()).add(reg.box)
    return out


class DCPInputs:
    """What DCP's load planner reads, built from the IR: checkpoint metadata and state dicts.

    The metadata has one ``ChunkStorageMetadata`` per distinct source box (replicas saved
    once). Each destination rank's state dict maps a key to a ``_Shards`` object exposing the
    boxes it holds through the ``__create_chunk_list__`` protocol that DTensor implements, so
    DCP computes reads from metadata alone, with no tensors allocated.
    """

    def __init__(self, src: LayoutSpec, dst: LayoutSpec) -> None:
        import torch
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata)

        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                  "int64": torch.int64}
        sv, dv = StateView(Layout(src)), StateView(Layout(dst))
        shapes = {_fqn(k, kind): t for (k, kind), t in sv.tensors().items()}

        def chunks(boxes: set) -> list:
            # Sorted so the metadata (and DCP's read order) is the same on every run.
            return [ChunkStorageMetadata(offsets=torch.Size(b.lo), sizes=torch.Size(b.shape))
                    for b in sorted(boxes)]

        saved: dict[str, set] = {}
        for r in range(sv.layout.world):
            for fqn, boxes in _boxes_by_fqn(sv, r, primary_only=True).items():
                saved.setdefault(fqn, set()).update(boxes)
        self.metadata = Metadata(state_dict_metadata={
            fqn: TensorStorageMetadata(TensorProperties(dtype=dtypes[shapes[fqn].dtype]),
                                       torch.Size(shapes[fqn].shape), chunks(boxes))
            for fqn, boxes in sorted(saved.items())})
        self.saved_chunks = sum(len(b) for b in saved.values())
        self.state_dicts, self.dst_elements = [], 0
        for r in range(dv.layout.world):
            held = sorted(_boxes_by_fqn(dv, r, primary_only=False).items())
            self.state_dicts.append({fqn: _Shards(torch.Size(shapes[fqn].shape), chunks(boxes))
                                     for fqn, boxes in held})
            self.dst_elements += sum(b.numel for _, boxes in held for b in boxes)
        self.src_ranks, self.dst_ranks = sv.layout.world, dv.layout.world


class _Shards:
    """A sharded tensor as DCP's planner sees it: global size plus local chunks, no data."""

    __slots__ = ("_size", "_chunks")

    def __init__(self, size: Any, chunks: list) -> None:
        self._size, self._chunks = size, chunks

    def size(self) -> Any:
        return self._size

    def __create_chunk_list__(self) -> list:
        return self._chunks


def dcp_load_planning(inputs: DCPInputs) -> dict[str, Any]:
    """Time DCP's load planning: every destination rank's local plan, then the global plan.

    In a distributed load each rank builds its own local plan; here they run one after another,
    so the total is the work summed over ranks and the per-rank maximum is the critical path.
    The collector is off: one process holding every rank's plans would otherwise pay full
    collections that no single rank's process pays (this favours DCP).
    """
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner, create_default_local_load_plan)

    plans, slowest = [], 0.0
    with settled_heap(collect=False):
        t0 = time.perf_counter()
        for sd in inputs.state_dicts:
            t = time.perf_counter()
            plans.append(create_default_local_load_plan(sd, inputs.metadata))
            slowest = max(slowest, time.perf_counter() - t)
        t1 = time.perf_counter()
        plans = DefaultLoadPlanner().create_global_plan(plans)
        t2 = time.perf_counter()
    read = sum(math.prod(item.lengths) for p in plans for item in p.items)
    if read != inputs.dst_elements:  # DCP must read exactly what the destination holds
        raise SystemExit(f"DCP plans read {read} elements; the destination holds "
                         f"{inputs.dst_elements}")
    return dict(local_total_seconds=t1 - t0, local_max_seconds=slowest,
                global_seconds=t2 - t1, total_seconds=t2 - t0,
                read_items=sum(len(p.items) for p in plans))


def dcp_metadata_read(inputs: DCPInputs) -> float:
    """Time unpickling the checkpoint's metadata, which every DCP rank does before it plans
    (``FileSystemReader.read_metadata``: ``pickle.load`` of the ``.metadata`` file). From bytes
    already in memory: the file read is left out (this favours DCP)."""
    blob = pickle.dumps(inputs.metadata)
    with settled_heap():
        t = time.perf_counter()
        pickle.loads(blob)  # our own bytes, made just above
        return time.perf_counter() - t


def dcp_save_validation(inputs: DCPInputs) -> float:
    """Time ``_validate_global_plan``: the only global validation DCP runs (at save time).

    The load path (``DefaultLoadPlanner.create_global_plan``) validates nothing; the save
    coordinator checks bounds, pairwise overlap and volume of every chunk in the metadata.
    """
    from torch.distributed.checkpoint.default_planner import _validate_global_plan
    from torch.distributed.checkpoint.planner import SavePlan

    # Only len(global_plan) > 1 matters to it (it enables the volume check).
    plans = [SavePlan([]) for _ in range(inputs.src_ranks)]
    with settled_heap():
        t = time.perf_counter()
        errors = _validate_global_plan(plans, inputs.metadata)
        elapsed = time.perf_counter() - t
    if errors:  # the IR's source boxes must tile every tensor exactly
        raise SystemExit(f"DCP rejects the IR's source metadata: {errors[:3]}")
    return elapsed


def best_of(n: int, fn: Callable[[], Any], key: Callable[[Any], float]) -> Any:
    """The fastest of ``n`` runs (timing noise only ever adds)."""
    return min((fn() for _ in range(n)), key=key)


def dcp_row(label: str, src: LayoutSpec, dst: LayoutSpec, repeats: int) -> dict[str, Any]:
    """DCP's planner and ours on one weights-only transition, both timed in this process."""
    ours = best_of(repeats, lambda: timed_plan(src, dst), key=lambda s: s["plan_seconds"])
    # Warm: the IR caches hold this model already (a controller that planned it before).
    warm = best_of(repeats, lambda: timed_plan(src, dst, warm=True),
                   key=lambda s: s["plan_seconds"])
    inputs = DCPInputs(src, dst)
    dcp = best_of(repeats, lambda: dcp_load_planning(inputs), key=lambda d: d["total_seconds"])
    validate = min(dcp_save_validation(inputs) for _ in range(repeats))
    metadata_read = min(dcp_metadata_read(inputs) for _ in range(repeats))
    slices = slice_times(src, dst, ours["spread"], repeats=repeats)  # best of n, as DCP
    return dict(
        label=label, src_ranks=inputs.src_ranks, dst_ranks=inputs.dst_ranks, repeats=repeats,
        saved_chunks=inputs.saved_chunks,
        dst_entries=sum(len(sd) for sd in inputs.state_dicts),
        ours_seconds=ours["plan_seconds"], ours_warm_seconds=warm["plan_seconds"],
        ours_transfers=ours["transfers"],
        ours_bytes_moved=ours["bytes_moved"], ours_bytes_local=ours["bytes_local"],
        dcp_local_total_seconds=dcp["local_total_seconds"],
        dcp_local_max_seconds=dcp["local_max_seconds"],
        dcp_global_seconds=dcp["global_seconds"], dcp_seconds=dcp["total_seconds"],
        dcp_read_items=dcp["read_items"], dcp_save_validation_seconds=validate,
        ratio=ratio(dcp["total_seconds"], ours["plan_seconds"]),
        ratio_critical_path=ratio(dcp["local_max_seconds"] + dcp["global_seconds"],
                                  ours["plan_seconds"]),
        # One process's own part on both sides: DCP's slowest rank against our slowest
        # sampled slice (cold, each the best of the same repeats as DCP).
        **slices,
        ratio_slowest_rank_over_slice=ratio(dcp["local_max_seconds"],
                                            slices["slice_max_seconds"]),
        # A real DCP rank first unpickles the checkpoint's metadata (file read not counted).
        dcp_metadata_read_seconds=metadata_read,
        ratio_rank_with_metadata_over_slice=ratio(dcp["local_max_seconds"] + metadata_read,
                                                  slices["slice_max_seconds"]),
    )


def run_dcp(quick: bool) -> dict[str, Any]:
    try:
        import torch.distributed.checkpoint  # noqa: F401
    except ImportError as err:
        print(f"\n3. DCP comparison skipped: {err}")
        return dict(rows=[], dcp_planner_ratio=None, skipped=str(err))
    rows = [dcp_row("70B tp8-pp4-dp4 -> tp8-pp8-dp2", weights_only("llama3.1-70b/tp8-pp4-dp4"),
                    weights_only("llama3.1-70b/tp8-pp8-dp2"), DCP_REPEATS)]
    if not quick:
        w = DCP_LARGE_WORLD
        rows.append(dcp_row(f"70B tp8-pp4-dp{w // 32} -> tp8-pp8-dp{w // 64}",
                            scaling_spec(w, 4, True), scaling_spec(w, 8, True), 1))
    print_dcp(rows)
    return dict(rows=rows, dcp_planner_ratio=rows[0]["ratio"])


def print_dcp(rows: list[dict[str, Any]]) -> None:
    print_table(
        "3. PyTorch DCP load planner vs plan_transition, weights only (one process)",
        ["transition", "ranks", "ours s", "warm s", "DCP s", "x", "DCP max/rank s", "x crit",
         "our slice s", "DCP rank/slice", "DCP meta read s", "+meta/slice", "DCP validate s",
         "ours transfers", "DCP reads"],
        [[r["label"], f"{r['src_ranks']}->{r['dst_ranks']}", fmt(r["ours_seconds"], ".3f"),
          fmt(r["ours_warm_seconds"], ".3f"), fmt(r["dcp_seconds"], ".3f"), fmt(r["ratio"]),
          fmt(r["dcp_local_max_seconds"], ".4f"), fmt(r["ratio_critical_path"]),
          fmt(r["slice_max_seconds"], ".4f"), fmt(r["ratio_slowest_rank_over_slice"], ".3f"),
          fmt(r["dcp_metadata_read_seconds"], ".4f"),
          fmt(r["ratio_rank_with_metadata_over_slice"], ".3f"),
          fmt(r["dcp_save_validation_seconds"], ".4f"), str(r["ours_transfers"]),
          str(r["dcp_read_items"])] for r in rows],
    )
    print("ours s: cold (IR caches emptied), best of the repeats; warm s: caches already hold "
          "the model.\nx = DCP s (every destination rank's local plan + global plan) / ours s; "
          "x crit uses DCP's slowest single rank instead of the sum.\nour slice s: the slowest of "
          "our first/middle/last device's slice (cold, best of the repeats); DCP rank/slice = DCP max/rank s / our "
          "slice s (per-process work on both sides).\nDCP meta read s: unpickling the checkpoint's metadata, which every DCP rank does before "
          "planning (file read not counted); +meta/slice = (DCP max/rank s + it) / our slice s.")


# ---- 4. per-device slices -----------------------------------------------------------------------

def run_slices(headline: list[dict[str, Any]], scaling: dict[str, Any],
               quick: bool) -> list[dict[str, Any]]:
    """Each headline pair and scaling point: one device's slice against the global plan.
    ``quick``: the middle device only, and only the largest scaling point."""
    rows = []
    for h in headline:
        src, dst = load_spec(spec_path(h["src"])), load_spec(spec_path(h["dst"]))
        rows.append(dict(label=h["label"], ranks=f"{h['src_ranks']}->{h['dst_ranks']}",
                         plan_seconds=h["plan_seconds"], spread=h["spread"],
                         **slice_times(src, dst, h["spread"], one=quick)))
    for r in scaling["rows"][-1:] if quick else scaling["rows"]:
        w = r["ranks"]
        rows.append(dict(label=f"{SCALING_MODEL} scaling W={w}", ranks=f"{w}->{w}",
                         plan_seconds=r["plan_seconds"], spread=r["spread"],
                         **slice_times(scaling_spec(w, 4), scaling_spec(w, 8), r["spread"],
                                       one=quick)))
    for r in rows:
        r["plan_over_slice_max"] = ratio(r["plan_seconds"], r["slice_max_seconds"])
    print_table(
        "4. Per-device slices: plan_slice(spread=global plan's) for the first, middle and last "
        "device (--quick: middle only), cold",
        ["transition", "ranks", "plan s", "slice max s", "slice mean s", "plan/slice",
         "slice msgs (max)"],
        [[r["label"], r["ranks"], fmt(r["plan_seconds"]), fmt(r["slice_max_seconds"], ".3f"),
          fmt(r["slice_mean_seconds"], ".3f"), fmt(r["plan_over_slice_max"], ".1f"),
          str(max(x["messages"] for x in r["slices"]))] for r in rows],
    )
    return rows


# ---- 5. Llama-3.1-405B TP8 PP16, N -> 3N/4 GPUs -------------------------------------------------

SERIES_MODEL = "llama3.1-405b"
SERIES_SIZES = (2048, 4096)
SERIES_FULL_SIZES = (2048, 4096, 12288, 24576, 49152, 98304)
SERIES_GLOBAL_MAX = 4096  # the global plan beyond this takes many minutes and GiB here


def series_raw(world: int) -> dict[str, Any]:
    """Llama-3.1-405B TP8 PP16 on ``world`` GPUs, as the shipped 405B specs (8 GPUs/node)."""
    return dict(model=SERIES_MODEL, name=f"{SERIES_MODEL} tp8-pp16-dp{world // 128}",
                parallel=dict(tp=8, pp=16, account_for_embedding_in_pipeline_split=True,
                              account_for_loss_in_pipeline_split=True),
                world=dict(nodes=world // 8, gpus_per_node=8))


def peak_rss() -> int:
    """This process's peak RSS in bytes: ``VmHWM``, which exec resets. (``ru_maxrss`` keeps
    the high-water mark of the forked parent's copy across exec on Linux, so a child of a
    large bench process would report the parent's size.)"""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_slice(job: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: the specs, then one device's slice; seconds and peak RSS.

    ``spread`` None: ``agree`` is this process alone (its own numbers, no peers)."""
    before = peak_rss()
    t = time.perf_counter()
    src = Layout(spec_from_dict(job["src"], origin="src"))
    dst = Layout(spec_from_dict(job["dst"], origin="dst"))
    spread = job["spread"]
    kw: dict[str, Any] = ({"spread": tuple(spread)} if spread is not None
                          else {"agree": lambda v: v})
    part = plan_slice(src, dst, job["budget"], job["device"], **kw)
    seconds = time.perf_counter() - t
    return dict(device=job["device"], seconds=seconds,
                slice_seconds=part.stats["slice_seconds"], spread=part.stats["spread"],
                transfers=part.stats["transfers"], messages=part.stats["messages"],
                rss_before_bytes=before,
                rss_peak_bytes=peak_rss())


def slice_in_process(src: dict, dst: dict, device: str, spread: Any) -> dict[str, Any]:
    job = dict(src=src, dst=dst, device=device, spread=spread, budget=BUDGET_BYTES)
    out = subprocess.run([sys.executable, __file__, "--slice-child"], input=json.dumps(job),
                         capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode:
        raise SystemExit(f"slice of {device} failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def command_in_process(src: dict, dst: dict) -> dict[str, Any]:
    """``dynatrain plan A B --json P`` in a fresh process, as the issue's table measured it:
    its wall time (``command_seconds``: start-up, imports, compiling, planning, verifying,
    writing the JSON and the summary) and the plan's summary as the JSON records it (the
    command's own ``plan_seconds`` and ``verify_seconds``). A failed verification exits
    non-zero and stops the bench."""
    with tempfile.TemporaryDirectory() as tmp:
        a, b, out = Path(tmp, "src.yaml"), Path(tmp, "dst.yaml"), Path(tmp, "plan.json")
        a.write_text(yaml.safe_dump(src), encoding="utf-8")
        b.write_text(yaml.safe_dump(dst), encoding="utf-8")
        t = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "dynatrain.cli", "plan", str(a), str(b),
                               "--json", str(out)], capture_output=True, text=True, cwd=ROOT,
                              check=False)
        seconds = time.perf_counter() - t
        if done.returncode:
            raise SystemExit(f"dynatrain plan {src['name']} -> {dst['name']} failed "
                             f"({done.returncode}): {done.stderr.strip()[-500:]}")
        return dict(json_summary(out), command_seconds=seconds, json_bytes=out.stat().st_size)


def json_summary(path: Path) -> dict[str, Any]:
    """The ``summary`` object of a plan file, parsed without reading its rounds (the file of
    the 98304-GPU plan is 1 GB; the summary comes before the rounds)."""
    with open(path, encoding="utf-8") as f:
        head = f.read(1 << 24)
    at = head.index('"summary":') + len('"summary":')
    return json.JSONDecoder().raw_decode(head, at)[0]


def run_series(full: bool, global_max: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    spread, spread_from = None, None
    for n in SERIES_FULL_SIZES if full else SERIES_SIZES:
        m = n * 3 // 4
        src_raw, dst_raw = series_raw(n), series_raw(m)
        row: dict[str, Any] = dict(gpus=f"{n}->{m}", src_ranks=n, dst_ranks=m)
        if n <= global_max:
            s = command_in_process(src_raw, dst_raw)
            spread, spread_from = s["spread"], n
            row.update(plan_seconds=s["plan_seconds"], verify_seconds=s["verify_seconds"],
                       verified=True, transfers=s["transfers"],
                       messages=s["messages"], rounds=s["rounds"], pairs=s["pairs"],
                       pair_classes=s["pair_classes"],
                       command_seconds=s["command_seconds"], json_bytes=s["json_bytes"],
                       time_ratio=ratio(s["predicted_seconds"], s["lower_bound_seconds"]))
        devs = sampled_devices(spec_from_dict(src_raw, origin="src"),
                               spec_from_dict(dst_raw, origin="dst"))
        runs = [slice_in_process(src_raw, dst_raw, d, spread) for d in devs]
        secs = [r["seconds"] for r in runs]
        row.update(spread=runs[0]["spread"], spread_from=spread_from if spread else "agree alone",
                   slice_max_seconds=max(secs), slice_mean_seconds=sum(secs) / len(secs),
                   slice_rss_max_bytes=max(r["rss_peak_bytes"] for r in runs), slices=runs)
        rows.append(row)
        print(f"  405B {row['gpus']}: plan {fmt(row.get('plan_seconds'))} s, slice max "
              f"{row['slice_max_seconds']:.2f} s", flush=True)
    print_table(
        f"5. {SERIES_MODEL} TP8 PP16, N -> 3N/4 GPUs (the command up to {global_max} GPUs; "
        "it and the slices in fresh processes)",
        ["GPUs", "transfers", "msgs", "pairs", "classes", "rounds", "plan s", "verify s",
         "command s", "pred/LB", "slice max s", "slice mean s", "slice RSS GiB"],
        [[r["gpus"], str(r.get("transfers", "-")), str(r.get("messages", "-")),
          str(r.get("pairs", "-")), str(r.get("pair_classes", "-")),
          str(r["rounds"]) if "rounds" in r else f"{r['spread'][1]}*", fmt(r.get("plan_seconds")),
          fmt(r.get("verify_seconds")), fmt(r.get("command_seconds"), ".1f"),
          fmt(r.get("time_ratio"), ".3f"),
          fmt(r["slice_max_seconds"]), fmt(r["slice_mean_seconds"]),
          fmt(r["slice_rss_max_bytes"] / GIB)] for r in rows],
    )
    print("plan s, verify s: the command's own figures; command s: the wall time of "
          "`dynatrain plan A B --json P` in a fresh process (imports, compiling, planning, "
          "verifying, writing the JSON).")
    print("pairs: device pairs that exchange; classes: those cut alike, kept once by the "
          "global plan (planner.classes).")
    print("slice s: a fresh process compiling both layouts and computing its own part; RSS: "
          "its peak (interpreter and imports included). Without a global plan, slices use "
          "the (unit, rounds) of the largest size planned (rounds marked *; spread_from in the "
          "JSON).")
    return dict(model=SERIES_MODEL, global_max=global_max, rows=rows)


# ---- main ---------------------------------------------------------------------------------------

def environment(quick: bool) -> dict[str, Any]:
    """What the numbers were measured on, so results files can be compared."""
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return dict(quick=quick, python=sys.version.split()[0], torch=torch_version,
                cpus=os.cpu_count(), loadavg_at_start=os.getloadavg(),
                machine=platform.platform(), processor=platform.processor() or None,
                git=commit, budget_bytes=BUDGET_BYTES, topology=H100.name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="skip 405B, scale to 1024 ranks only, one DCP case, slice the middle device only")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON file ({DEFAULT_OUT})")
    ap.add_argument("--full", action="store_true",
                    help="the 405B N -> 3N/4 series up to 98304 GPUs (slices always; the "
                         "global plan only up to --global-max)")
    ap.add_argument("--global-max", type=int, default=SERIES_GLOBAL_MAX,
                    help=f"405B series: plan globally only up to this many GPUs "
                         f"(default {SERIES_GLOBAL_MAX})")
    ap.add_argument("--only", metavar="TEXT",
                    help="only the headline transitions whose label contains TEXT (no scaling, "
                         "DCP, slices or series)")
    ap.add_argument("--slice-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.slice_child:  # one slice in this fresh process (run_series), JSON in and out
        print(json.dumps(child_slice(json.loads(sys.stdin.read()))))
        return 0

    t0 = time.perf_counter()
    result: dict[str, Any] = dict(environment=environment(args.quick))
    result["headline"] = run_headline(args.quick, args.only)
    if args.only is not None:
        if not result["headline"]:
            ap.error(f"--only: no headline transition's label contains {args.only!r}")
        return _write(result, args.out, t0)
    result["scaling"] = run_scaling(args.quick)
    dcp = run_dcp(args.quick)
    result["dcp"] = dcp["rows"]
    result["dcp_planner_ratio"] = dcp["dcp_planner_ratio"]
    result["slices"] = run_slices(result["headline"], result["scaling"], args.quick)
    if not args.quick:
        result["series_405b"] = run_series(args.full, args.global_max)
    return _write(result, args.out, t0)


def _write(result: dict[str, Any], out: Path, t0: float) -> int:
    result["wall_seconds"] = time.perf_counter() - t0
    result["environment"]["loadavg_at_end"] = os.getloadavg()  # other load skews timings
    # ru_maxrss is KiB on Linux; peak over the whole run.
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"\nwall {result['wall_seconds']:.1f} s, peak RSS "
          f"{result['peak_rss_bytes'] / GIB:.2f} GiB; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
