"""A megatron dist checkpoint as a source: loaded straight into any destination layout.

The checkpoint's global coordinates are DynaTrain's logical coordinates (the IR mirrors
megatron's ``sharded_state_dict`` one to one): checkpoint key ``K`` is the logical tensor
``(K, param)`` (or ``(K, buffer)`` for the router's expert_bias), ``optimizer.state.param.K``
(``fp32_param`` without the distributed optimizer) its ``main_param``, and
``optimizer.state.exp_avg[_sq].K`` its Adam moments (the ``fully_reshardable`` optimizer format);
Adam's step comes from the common state (``common.pt``, or in megatron-core 0.19 the
``common_state`` entry: ``format.py``). So a load is a plan whose source is the checkpoint's
chunks: every region a destination rank holds is cut by the chunks of its key, and each chunk
that some destination needs is read once (``torch.load(weights_only=True)`` of its bytes) and
copied into every destination region it meets, in parallel threads whose chunks in flight stay
within a byte budget.

The saved bf16 params are loaded as saved (not re-derived from the fp32 main params), which
keeps param == bf16(main_param) where megatron-core 0.16.1's own reload breaks it. Vocab padding
rows are state up to the smaller of the checkpoint's and the destination's padded vocabulary;
rows only the destination has stay zero (megatron's ``allow_shape_mismatch`` reload).
"""

from __future__ import annotations

import bisect
import math
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..ir.box import Box
from ..ir.layout import Layout
from ..ir.slots import Slot
from ..ir.state import StateView, view_of
from ..ir.tiling import tiling_fault
from ..ir.units import format_bytes, parse_bytes
from ..planner.lost import disjoint_union
from ..runtime.storage import Storage, allocate, region, torch_dtype, within
from .format import (Checkpoint, CheckpointError, Chunk, open_checkpoint, read_chunk, shown,
                     untiled)

PREFIXES: dict[str, tuple[str, ...]] = {
    "main_param": ("optimizer.state.param.", "optimizer.state.fp32_param."),
    "exp_avg": ("optimizer.state.exp_avg.",),
    "exp_avg_sq": ("optimizer.state.exp_avg_sq.",),
}
DEFAULT_BUDGET = 256 << 20  # bytes of chunks in flight while loading


def base_key(ckpt_key: str) -> tuple[str, str]:
    """(model key, state kind) of a checkpoint key (kind ``param`` for a model tensor)."""
    for kind, prefixes in PREFIXES.items():
        for pre in prefixes:
            if ckpt_key.startswith(pre):
                return ckpt_key[len(pre):], kind
    return ckpt_key, "param"


@dataclass(frozen=True, slots=True)
class Piece:
    """Box ``box`` of a chunk goes to destination ``rank``'s region (``kind``, ``slot``,
    ``anchor``)."""

    rank: int
    kind: str
    slot: Slot
    anchor: Box
    box: Box


@dataclass
class CheckpointLoad:
    """A load planned: which chunks each destination rank reads and where their boxes go."""

    ckpt: Checkpoint
    layout: Layout
    view: StateView
    ranks: tuple[int, ...]
    keys: dict[tuple[str, str], str]  # logical (key, kind) -> checkpoint key
    step: int | None  # Adam's step, when the destination holds one
    # (checkpoint key, chunk index) -> the pieces it feeds, in the order chunks are read
    pieces: dict[tuple[str, int], list[Piece]] = field(default_factory=dict)

    def chunk(self, ck: tuple[str, int]) -> Chunk:
        return self.ckpt.tensors[ck[0]].chunks[ck[1]]

    def per_rank(self) -> dict[int, dict]:
        """Per destination rank: bytes read (whole chunks), bytes written, chunks, files."""
        out = {r: {"bytes_read": 0, "bytes_written": 0, "chunks": 0, "files": set()}
               for r in self.ranks}
        for ck, pieces in self.pieces.items():
            ch = self.chunk(ck)
            isz = torch.empty((), dtype=self.ckpt.tensors[ck[0]].dtype).element_size()
            for r in {p.rank for p in pieces}:
                s = out[r]
                s["bytes_read"] += ch.length
                s["chunks"] += 1
                s["files"].add(ch.file)
            for p in pieces:
                out[p.rank]["bytes_written"] += p.box.numel * isz
        for s in out.values():
            s["files"] = sorted(s["files"])
        return out

    def summary(self) -> dict:
        """The load as a plan: what ``dynatrain plan CKPT_DIR dst.yaml`` reports."""
        per = self.per_rank()
        read_once = sum(self.chunk(ck).length for ck in self.pieces)
        return {
            "checkpoint": self.ckpt.path,
            "format": f"{self.ckpt.format[0]} v{self.ckpt.format[1]}",
            "checkpoint_bytes": self.ckpt.total_bytes,
            "checkpoint_files": len(self.ckpt.files),
            "checkpoint_chunks": sum(len(t.chunks) for t in self.ckpt.tensors.values()),
            "destination": self.layout.spec.name,
            "ranks": len(self.ranks),
            "vocab_rows": self.view.vocab_rows,
            "padded_vocab": self.layout.padded_vocab,
            "step": self.step,
            "bytes_read": sum(s["bytes_read"] for s in per.values()),
            "bytes_read_once": read_once,
            "bytes_written": sum(s["bytes_written"] for s in per.values()),
            "chunks_read": len(self.pieces),
            "per_rank": {r: {**s, "device": self.layout.devices[r]} for r, s in per.items()},
        }


def checkpoint_keys(ckpt: Checkpoint, view: StateView) -> dict[tuple[str, str], str]:
    """The checkpoint key of every logical tensor of ``view`` (the step excepted).

    Raises:
        CheckpointError: the checkpoint lacks one of them.
    """
    by_base: dict[tuple[str, str], str] = {}
    for ck in ckpt.tensors:
        by_base.setdefault(base_key(ck), ck)
    out = {}
    for key, kind in view.tensors():
        if kind == "step":
            continue
        ck = by_base.get((key, "param" if kind == "buffer" else kind))
        if ck is None:
            what = ("saved without optimizer state?" if kind in PREFIXES
                    else "a checkpoint of another model?")
            raise CheckpointError(f"checkpoint {ckpt.path}: holds no {kind} of {key} ({what})")
        out[(key, kind)] = ck
    return out


def _vocab_dims(layout: Layout) -> dict[str, int]:
    """Per vocab-split checkpoint key, the dim that runs over the padded vocabulary."""
    out: dict[str, int] = {}
    seen = set()
    for rank in range(len(layout.devices)):
        c = layout.coords(rank)
        if (c.pp, c.ep) in seen:
            continue
        seen.add((c.pp, c.ep))
        for cs in layout.rank_shards(rank):
            for sh in cs.shards:
                p = sh.param
                if p.split is not None and p.split.vocab:
                    out[p.key] = len(p.prepend) + p.split.dim
    return out


def match(ckpt: Checkpoint, layout: Layout) -> StateView:
    """The destination's state view for this checkpoint (vocab rows both hold).

    Raises:
        CheckpointError: the checkpoint is of another model (keys, shapes or dtypes differ), or
            in an optimizer format DynaTrain does not read.
    """
    where = f"checkpoint {ckpt.path}"
    if any(k.startswith("optimizer.distributed.") for k in ckpt.tensors):
        raise CheckpointError(f"{where}: optimizer state saved dp_reshardable (bucket space of "
                              "the saving layout); save it fully_reshardable "
                              "(--dist-ckpt-optim-fully-reshardable) to load it into another "
                              "layout")
    base = view_of(layout)
    V = layout.model.vocab_size
    vocab = _vocab_dims(layout)
    keys = checkpoint_keys(ckpt, base)
    dst_keys = {k for k, _ in base.tensors()}
    for ck in ckpt.tensors:
        if base_key(ck)[0] not in dst_keys:
            raise CheckpointError(f"{where}: holds {ck}, a tensor the destination model has "
                                  "not (a checkpoint of another model?)")
    rows = set()
    for (key, kind), ck in keys.items():
        t, want = ckpt.tensors[ck], base.tensors()[(key, kind)]
        d = vocab.get(key)
        shape = list(t.shape)
        if d is not None and len(shape) == len(want.shape) and shape[d] >= V:
            rows.add(shape[d])
            shape[d] = V
        if tuple(shape) != want.shape:
            raise CheckpointError(f"{where}: {ck} is {list(t.shape)}, the destination model's "
                                  f"{key} is {list(want.shape)}"
                                  f"{' plus vocab padding' if d is not None else ''} (a "
                                  "checkpoint of another model?)")
        if t.dtype != torch_dtype(want.dtype):
            raise CheckpointError(f"{where}: {ck} is {t.dtype}, the destination holds {kind} as "
                                  f"{want.dtype} (loading would not be bit-exact)")
    if len(rows) > 1:
        raise CheckpointError(f"{where}: its vocab-split tensors disagree on the padded "
                              f"vocabulary ({sorted(rows)})")
    return view_of(layout, min(rows.pop(), layout.padded_vocab)) if rows else base


STEP_LIMIT = 2**63  # Adam's step is stored as int64 (``runtime.storage``)


def read_step(ckpt: Checkpoint) -> int:
    """Adam's step from the common state (param groups' ``step``, or ``common_step``); 0 when the
    optimizer has not stepped yet.

    Raises:
        CheckpointError: the optimizer entry is not a dict, or the recorded steps disagree or
            are not whole numbers in [0, 2**63).
    """
    optimizer = ckpt.common().get("optimizer", {})
    if not isinstance(optimizer, dict):
        raise CheckpointError(f"checkpoint {ckpt.path}: {ckpt.common_name}'s optimizer entry is "
                              f"a {type(optimizer).__name__}, not a dict")
    found: set[int] = set()
    # A stack, not recursion: the state may nest deeper than Python's recursion limit, and a
    # pickle can make a list that holds itself (each container is visited once).
    todo, seen = [optimizer], set()
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("step", "common_step") and not isinstance(v, (dict, list, tuple)):
                    found.add(_step(ckpt, v))
                else:
                    todo.append(v)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    if len(found) > 1:
        raise CheckpointError(f"checkpoint {ckpt.path}: {ckpt.common_name} records Adam steps "
                              f"{sorted(found)}, not one whole number")
    return found.pop() if found else 0


def _step(ckpt: Checkpoint, value: object) -> int:
    """One recorded step as an int: a whole number in [0, 2**63), or a tensor of one."""
    x = value
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise CheckpointError(f"checkpoint {ckpt.path}: {ckpt.common_name} records an Adam "
                                  f"step tensor of {x.numel()} elements, not one")
        x = x.item()
    if isinstance(x, float) and math.isfinite(x) and x.is_integer():
        x = int(x)  # (NaN and inf are not, and fail below)
    if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < STEP_LIMIT:
        raise CheckpointError(f"checkpoint {ckpt.path}: {ckpt.common_name} records Adam step "
                              f"{shown(x)}: a step must be one whole number in [0, 2**63)")
    return x


class _ChunkIndex:
    """The chunks of one checkpoint key, found by their dim-0 range (any chunk meeting a box
    is among those returned; whether they tile it is ``plan_load``'s check)."""

    def __init__(self, chunks: tuple[Chunk, ...]) -> None:
        self.chunks = chunks
        if not chunks or not chunks[0].box.lo:
            self.cuts, self.cells = [0], [list(range(len(chunks)))]
            return
        self.cuts = sorted({c.box.lo[0] for c in chunks} | {c.box.hi[0] for c in chunks})
        self.cells = [[] for _ in self.cuts]
        for i, c in enumerate(chunks):
            for j in range(bisect.bisect_left(self.cuts, c.box.lo[0]),
                           bisect.bisect_left(self.cuts, c.box.hi[0])):
                self.cells[j].append(i)

    def meeting(self, box: Box) -> list[int]:
        if not box.lo:
            return self.cells[0]
        lo = max(bisect.bisect_right(self.cuts, box.lo[0]) - 1, 0)
        hi = bisect.bisect_left(self.cuts, box.hi[0])
        if hi - lo == 1:
            return self.cells[lo]
        return sorted({i for j in range(lo, hi) for i in self.cells[j]})


def _wanted(only) -> dict[tuple[str, str], list[Box]] | None:
    """``only`` as disjoint boxes per logical tensor: a ``LostState`` (its entries) or (key,
    kind, box) triples, which may repeat and overlap (each element is still written once)."""
    if only is None:
        return None
    out: dict[tuple[str, str], list[Box]] = defaultdict(list)
    entries = getattr(only, "entries", None)
    if entries is not None:
        for e in entries:
            out[(e.key, e.kind)].extend(e.boxes)
    else:
        for key, kind, box in only:
            out[(key, kind)].append(box)
    return {k: disjoint_union(v) for k, v in out.items()}


def plan_load(ckpt: Checkpoint | str | os.PathLike[str], layout: Layout,
              ranks: list[int] | tuple[int, ...] | None = None, *, only=None) -> CheckpointLoad:
    """Plan loading ``ckpt`` into ``ranks`` of ``layout`` (all by default); nothing is read but
    metadata (and the common state when the destination holds Adam's step).

    ``only``: load just these parts of the state (what was lost when devices failed): a
    ``planner.lost.LostState`` or (key, kind, ``Box``) triples in logical coordinates. Then
    only the chunks that meet them are read, and ``load_planned(stores=...)`` writes them into
    storage the switch fills with the rest.

    Raises:
        CheckpointError: anything ``open_checkpoint`` or ``match`` refuses, a destination rank
            out of range, or a destination region the checkpoint's chunks do not tile exactly
            (a part in no chunk, or in two).
    """
    if not isinstance(ckpt, Checkpoint):
        ckpt = open_checkpoint(ckpt)
    world = len(layout.devices)
    ranks = tuple(range(world)) if ranks is None else tuple(ranks)
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise CheckpointError(f"destination rank {bad[0]} is not in [0, {world})")
    view = match(ckpt, layout)
    keys = checkpoint_keys(ckpt, view)
    wanted = _wanted(only)
    need_step = ("optimizer.step", "step") in view.tensors() and (
        wanted is None or ("optimizer.step", "step") in wanted)
    step = read_step(ckpt) if need_step else None
    index = {ck: _ChunkIndex(ckpt.tensors[ck].chunks) for ck in set(keys.values())}
    pieces: dict[tuple[str, int], list[Piece]] = defaultdict(list)
    for rank in ranks:
        for reg in view.regions(rank):
            if reg.kind == "step":
                continue
            ck = keys[(reg.key, reg.kind)]
            idx = index[ck]
            if wanted is None:
                targets = [reg.box]
            else:
                targets = [b for w in wanted.get((reg.key, reg.kind), ())
                           if (b := reg.box & w) is not None]
            for target in targets:
                cuts: list[tuple[int, Box]] = []
                for ci in idx.meeting(target):
                    b = target & idx.chunks[ci].box
                    if b is not None:
                        cuts.append((ci, b))
                # Exact tiling, not a count of elements (a duplicate and a hole cancel out).
                # ``open_checkpoint`` proved the chunks tile each tensor; a ``Checkpoint`` built
                # by other code is held to the same here, before anything is read.
                fault = tiling_fault(target, [b for _, b in cuts])
                if fault is not None:
                    raise CheckpointError(
                        f"checkpoint {ckpt.path}: its chunks of {ck} do not tile {target}, "
                        f"which destination rank {rank} holds: "
                        f"{untiled(fault, [idx.chunks[ci].box for ci, _ in cuts], 'chunk')}")
                for ci, b in cuts:
                    pieces[(ck, ci)].append(Piece(rank, reg.kind, reg.slot, reg.box, b))
    order = sorted(pieces, key=lambda ck: (ckpt.tensors[ck[0]].chunks[ck[1]].file,
                                           ckpt.tensors[ck[0]].chunks[ck[1]].offset))
    return CheckpointLoad(ckpt, layout, view, ranks, keys, step, {ck: pieces[ck] for ck in order})


@dataclass
class LoadStats:
    """What a load did: bytes read from chunk files, written into storage, seconds."""

    bytes_read: int = 0
    bytes_written: int = 0
    chunks: int = 0
    peak_in_flight: int = 0
    seconds: float = 0.0


def load_planned(plan: CheckpointLoad, device: torch.device | None = None, *,
                 budget: int | str = DEFAULT_BUDGET, threads: int | None = None,
                 stats: LoadStats | None = None,
                 stores: dict[int, Storage] | None = None) -> dict[int, Storage]:
    """Run a planned load: fresh storage for each destination rank, filled from the chunks
    (or ``stores``, the ranks' existing storage, where only the planned pieces are written).

    Chunks are read in file order by ``threads`` workers (default: up to 4); the chunks read but
    not yet copied stay within ``budget`` bytes (a chunk larger than the budget is read alone).

    Raises:
        CheckpointError: a chunk's bytes are corrupt (nothing is returned).
    """
    t0 = time.perf_counter()
    limit = parse_bytes(budget, "budget") if isinstance(budget, str) else int(budget)
    if limit <= 0:
        raise CheckpointError(f"budget must be positive. Got {budget!r}")
    stats = stats if stats is not None else LoadStats()
    if stores is None:
        stores = {r: allocate(plan.view, r, device) for r in plan.ranks}
    elif set(stores) != set(plan.ranks):
        raise CheckpointError(f"stores are for ranks {sorted(stores)}, the load plans "
                              f"{sorted(plan.ranks)}")
    if plan.step is not None:
        for r in plan.ranks:
            for reg in plan.view.regions(r):
                if reg.kind == "step":
                    region(stores[r], "step", reg.slot, reg.box).fill_(plan.step)
    cond = threading.Condition()
    in_flight = [0]
    lock = threading.Lock()

    def work(ck: tuple[str, int]) -> None:
        ch = plan.chunk(ck)
        try:
            t = read_chunk(plan.ckpt, ck[0], ch)
            written = 0
            for p in plan.pieces[ck]:
                dst = region(stores[p.rank], p.kind, p.slot, p.anchor)[within(p.box, p.anchor)]
                dst.copy_(t[within(p.box, ch.box)])
                written += dst.numel() * dst.element_size()
            with lock:
                stats.bytes_read += ch.length
                stats.bytes_written += written
                stats.chunks += 1
        finally:
            with cond:
                in_flight[0] -= ch.length
                cond.notify_all()

    n = threads or min(4, os.cpu_count() or 1)
    pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="dynatrain-ckpt")
    try:
        futures: list = []
        for ck in plan.pieces:
            size = plan.chunk(ck).length
            with cond:
                cond.wait_for(lambda: in_flight[0] == 0 or in_flight[0] + size <= limit)
                in_flight[0] += size
                stats.peak_in_flight = max(stats.peak_in_flight, in_flight[0])
            futures.append(pool.submit(work, ck))
            _raise_done(futures)  # fail early on a corrupt chunk
        for f in futures:
            f.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    stats.seconds = time.perf_counter() - t0
    return stores


def _raise_done(futures: list) -> None:
    """Re-raise the error of a finished chunk read; forget the reads that went well."""
    while futures and futures[0].done():
        futures.pop(0).result()


def load_checkpoint_ranks(ckpt_dir: str | os.PathLike[str], layout: Layout,
                          ranks: list[int] | tuple[int, ...] | None = None,
                          device: torch.device | None = None, *,
                          budget: int | str = DEFAULT_BUDGET, threads: int | None = None,
                          stats: LoadStats | None = None) -> dict[int, Storage]:
    """Storage of each of ``ranks`` (default all) of ``layout``, loaded from the checkpoint.

    Every chunk is read once, however many of these ranks need it. Raises ``CheckpointError``
    (one line, exit status 2) for anything ``plan_load`` or ``load_planned`` refuses; then no
    storage is returned.
    """
    return load_planned(plan_load(ckpt_dir, layout, ranks), device, budget=budget,
                        threads=threads, stats=stats)


def load_checkpoint(ckpt_dir: str | os.PathLike[str], layout: Layout, rank: int,
                    device: torch.device | None = None, *, budget: int | str = DEFAULT_BUDGET,
                    threads: int | None = None, stats: LoadStats | None = None) -> Storage:
    """Destination ``rank``'s storage (``runtime.storage`` layout) from the checkpoint: only
    the chunks that meet what the rank holds are read.

    Example:
        >>> store = load_checkpoint("ckpt/iter_100", Layout(spec), rank=0)  # doctest: +SKIP
    """
    return load_checkpoint_ranks(ckpt_dir, layout, [rank], device, budget=budget,
                                 threads=threads, stats=stats)[rank]


def load_checkpoint_into(ckpt_dir: str | os.PathLike[str], layout: Layout, rank: int,
                         model_chunks, optimizer, device: torch.device | None = None, *,
                         budget: int | str = DEFAULT_BUDGET, threads: int | None = None,
                         stats: LoadStats | None = None) -> int | None:
    """Load the checkpoint into a live megatron-core rank built for ``layout``: model chunks
    (params, so their DDP buffers too), fp32 main params, Adam moments and step, expert_bias.

    The checkpoint is read and checked into fresh storage first; the job is written only once
    that succeeded (``install_state``), so a refused checkpoint leaves the job as it was.
    Returns Adam's step (None for a weights-only destination).
    """
    from ..runtime.megatron.bridge import install_state

    plan = plan_load(ckpt_dir, layout, [rank])
    store = load_planned(plan, device, budget=budget, threads=threads, stats=stats)[rank]
    install_state(plan.view, rank, model_chunks, optimizer, store)
    return plan.step


def checkpoint_layout_summary(ckpt_dir: str | os.PathLike[str] | Checkpoint) -> dict:
    """What a checkpoint holds, without a destination: format, files, bytes, and per tensor its
    shape, dtype, chunk count and bytes (what ``dynatrain plan CKPT_DIR`` can show)."""
    ckpt = ckpt_dir if isinstance(ckpt_dir, Checkpoint) else open_checkpoint(ckpt_dir)
    tensors = {}
    for ck, t in sorted(ckpt.tensors.items()):
        key, kind = base_key(ck)
        tensors[ck] = {"key": key, "kind": kind, "shape": list(t.shape),
                       "dtype": str(t.dtype).removeprefix("torch."), "chunks": len(t.chunks),
                       "bytes": t.nbytes}
    by_kind: dict[str, int] = defaultdict(int)
    for t in tensors.values():
        by_kind[t["kind"]] += t["bytes"]
    return {"path": ckpt.path, "format": f"{ckpt.format[0]} v{ckpt.format[1]}",
            "files": dict(sorted(ckpt.files.items())), "file_bytes": ckpt.total_bytes,
            "tensor_bytes": sum(t["bytes"] for t in tensors.values()),
            "bytes_by_kind": dict(by_kind), "tensors": tensors}


def format_load(summary: dict, per_device: bool = False) -> str:
    """``CheckpointLoad.summary()`` as text (what ``dynatrain plan CKPT_DIR dst.yaml`` prints)."""
    s = summary
    per = s["per_rank"]
    reads = [v["bytes_read"] for v in per.values()] or [0]
    files = [len(v["files"]) for v in per.values()] or [0]
    pad = ("" if s["vocab_rows"] >= s["padded_vocab"] else
           f"; vocab rows {s['vocab_rows']}..{s['padded_vocab'] - 1} zero (padding the "
           "checkpoint has not)")
    lines = [
        f"checkpoint {s['checkpoint']} ({s['format']}, {s['checkpoint_chunks']} chunks in "
        f"{s['checkpoint_files']} files, {format_bytes(s['checkpoint_bytes'])})  ->  "
        f"{s['destination']}",
        f"  read    {format_bytes(s['bytes_read'])} over {s['ranks']} destination ranks "
        f"({format_bytes(min(reads))} .. {format_bytes(max(reads))} per device, "
        f"{min(files)} .. {max(files)} files each); {s['chunks_read']} chunks, "
        f"{format_bytes(s['bytes_read_once'])} if each is read once",
        f"  written {format_bytes(s['bytes_written'])} of state into destination storage"
        f"{pad}",
        f"  step    {s['step']}" if s["step"] is not None else "  step    (weights only)",
    ]
    if per_device:
        for r, v in per.items():
            lines.append(f"    rank {r:>4} {v['device']:<14} read "
                         f"{format_bytes(v['bytes_read']):>10}  written "
                         f"{format_bytes(v['bytes_written']):>10}  {v['chunks']} chunks from "
                         f"{len(v['files'])} files")
    return "\n".join(lines)
