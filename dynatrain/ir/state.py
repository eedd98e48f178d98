"""Training state in the Virtual Parameter Space: logical tensors and what each rank holds.

Every piece of state is a logical tensor ``(key, kind)``: ``key`` is the megatron-core checkpoint
key, ``kind`` one of param, main_param, exp_avg, exp_avg_sq (per parameter), buffer (router
expert_bias) or step (Adam's step count). Its shape is the checkpoint's global shape with vocab
padding removed (padding rows are not data). A rank holds a tensor as ``Region``s: a box of the
logical tensor and the slot in that rank's local storage where the box's elements sit.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache

from .box import Box
from .errors import LayoutError
from .buffers import BufferLayout, OwnedRange, owned_ranges
from .layout import Layout
from .shard import Shard, logical_box

OPTIMIZER_KINDS = ("main_param", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True, slots=True)
class LogicalTensor:
    key: str
    kind: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Elements sit in a TP-local tensor of the parameter's local shape, at ``local_offset``.

    For kind ``param`` that tensor is the module parameter ``name`` of chunk ``chunk``; for the
    optimizer kinds without the distributed optimizer, the optimizer's per-parameter tensor.
    """

    chunk: int
    name: str
    local_offset: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FlatSlot:
    """Elements sit contiguously in the DistributedOptimizer's shard of parameter ``name``.

    ``offset`` counts from the start of this rank's slice of ``param.view(-1)`` (the slice that
    Megatron's fp32 main param and Adam moments for that parameter cover).
    """

    chunk: int
    buffer: int  # index into Layout.rank_buffers(rank)
    name: str
    offset: int


@dataclass(frozen=True, slots=True)
class BufferSlot:
    """Elements sit in the module buffer ``name`` (e.g. the router's expert_bias)."""

    chunk: int
    name: str


@dataclass(frozen=True, slots=True)
class StackSlot:
    """A family of slots that differ in name only, one per index of the anchor's leading axes.

    Each layer's weight (and each expert's) is its own module parameter and DistributedOptimizer
    shard, but the layers and experts of a stage hold congruent boxes at one local position: a
    single region over their (layer[, expert]) grid stands for all of them, so the planner and
    the verifier work per grid instead of per weight (the 235B MoE switch: ~24k expert weights
    per side). ``members`` expands a region of it into the members' own slots, as storage
    sees them.
    """

    member: ParamSlot | FlatSlot  # the first member's slot; the others differ in name only
    axes: int  # leading dims of the anchor that index members (layer, expert)
    names: tuple[str, ...]  # member names, row-major over the anchor's leading dims
    # Hashed once: plans key dicts on (key, slot, anchor) per transfer, and hashing hundreds
    # of names each time cost more than the rest of the verifier's loop.
    _hash: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.member, self.axes, self.names)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # rebuilt, so the hash is this process's (string hashes are salted)
        return StackSlot, (self.member, self.axes, self.names)

    @property
    def chunk(self) -> int:
        return self.member.chunk


Slot = ParamSlot | FlatSlot | BufferSlot | StackSlot


@dataclass(frozen=True, slots=True)
class Region:
    """A box of logical tensor (key, kind) that a rank holds, and where."""

    key: str
    kind: str
    box: Box
    slot: Slot
    primary: bool = True  # False for the last stage's copy of a tied embedding


@dataclass(frozen=True, slots=True)
class Stored:
    """A box of tensor ``key`` held in one slot for several state kinds at once.

    The optimizer kinds (and, without the distributed optimizer, the param too) share boxes and
    slot coordinates, each in its own storage: one ``Stored`` stands for all of them.
    """

    key: str
    kinds: tuple[str, ...]
    box: Box
    slot: Slot
    primary: bool = True


def members(slot: Slot, anchor: Box, box: Box) -> list[tuple[Slot, Box, Box]]:
    """(slot, anchor, box) per storage tensor that ``box`` (inside ``anchor``) touches.

    A plain slot is its own only member. For a ``StackSlot`` the members are the indices of
    ``box``'s leading axes, row-major: both ends of a transfer expand one box alike.

    Raises:
        LayoutError: a family whose names do not match its anchor's leading axes, or ``box``
            outside ``anchor`` on them (a plan nobody verified).
    """
    if type(slot) is not StackSlot:
        return [(slot, anchor, box)]
    n, m = slot.axes, slot.member
    lead = anchor.shape[:n]
    if not (0 < n <= len(anchor.lo) == len(box.lo) and len(slot.names) == math.prod(lead)
            and all(a <= l < h <= z for l, h, a, z in zip(box.lo[:n], box.hi[:n], anchor.lo,
                                                          anchor.hi))):
        raise LayoutError(f"box {box} is not a part of the {len(slot.names)}-member family "
                          f"over {anchor} ({n} leading axes)")
    tail_alo, tail_ahi = anchor.lo[n:], anchor.hi[n:]
    out = []
    for idx in itertools.product(*(range(l, h) for l, h in zip(box.lo[:n], box.hi[:n]))):
        name = slot.names[_flat_index(lead, tuple(i - a for i, a in zip(idx, anchor.lo)))]
        one = tuple(i + 1 for i in idx)
        out.append((_renamed(m, name), Box(idx + tail_alo, one + tail_ahi),
                    Box(idx + box.lo[n:], one + box.hi[n:])))
    return out


def _renamed(slot: ParamSlot | FlatSlot, name: str) -> ParamSlot | FlatSlot:
    if type(slot) is ParamSlot:
        return ParamSlot(slot.chunk, name, slot.local_offset)
    return FlatSlot(slot.chunk, slot.buffer, name, slot.offset)


STACK_FAMILIES = True  # False: one region per weight (the unstacked IR, an oracle for tests)


class _Families:
    """Layer- or expert-stacked weights collected per template, emitted as ``StackSlot`` regions.

    The members of one template (one tensor key, the same regions past their leading axes at
    the same slot positions) differ only in their leading coordinates and names: the
    template's regions are computed once and each member costs one dict entry. The leading
    coordinates of a template's members are cut into boxes (``grid_boxes``); each box of two
    or more members becomes one region. Templates come out in order of first appearance.
    """

    def __init__(self, kinds: tuple[str, ...]) -> None:
        self.kinds = kinds
        self.groups: dict[tuple, tuple[tuple, dict[tuple[int, ...], str]]] = {}
        self.order: list[tuple | Stored] = []

    def add(self, sig: tuple, lead: tuple[int, ...], name: str, template) -> None:
        """Member ``name`` at ``lead`` of the template ``sig``; ``template()`` gives the
        template's (key, primary, leading axes, ((trailing lo, trailing hi, slot), ...))
        the first time ``sig`` is seen (the slot's name is replaced per member)."""
        g = self.groups.get(sig)
        if g is None:
            g = self.groups[sig] = (template(), {})
            self.order.append(sig)
        g[1][lead] = name

    def plain(self, s: Stored) -> None:
        """An entry that is not stacked, kept in its place."""
        self.order.append(s)

    def stored(self) -> list[Stored]:
        out: list[Stored] = []
        for item in self.order:
            if isinstance(item, Stored):
                out.append(item)
                continue
            (key, primary, npre, parts), names = self.groups[item]
            boxes = grid_boxes(sorted(names))
            for t_lo, t_hi, slot in parts:
                for lo, hi in boxes:
                    pts = itertools.product(*(range(a, b) for a, b in zip(lo, hi)))
                    grid = tuple(names[p] for p in pts)
                    box = Box(lo + t_lo, hi + t_hi)
                    first = _renamed(slot, grid[0])
                    out.append(Stored(key, self.kinds, box, first if len(grid) == 1 else
                                      StackSlot(first, npre, grid), primary))
        return out


def grid_boxes(points: list[tuple[int, ...]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Cover sorted, distinct integer points exactly with few boxes: runs along the last axis,
    merged over consecutive indices of the axes before that cover the same runs."""
    if not points[0]:
        return [((), ())]
    if len(points[0]) == 1:  # runs
        runs: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        start = prev_x = points[0][0]
        for (x,) in points[1:]:
            if x != prev_x + 1:
                runs.append(((start,), (prev_x + 1,)))
                start = x
            prev_x = x
        runs.append(((start,), (prev_x + 1,)))
        return runs
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    prev: list | None = None  # [head lo, head hi, the rest's boxes]

    def flush() -> None:
        if prev is not None:
            out.extend(((prev[0],) + lo, (prev[1],) + hi) for lo, hi in prev[2])

    i = 0
    while i < len(points):
        head = points[i][0]
        j = i
        while j < len(points) and points[j][0] == head:
            j += 1
        rest = grid_boxes([p[1:] for p in points[i:j]])
        if prev is not None and prev[1] == head and prev[2] == rest:
            prev[1] = head + 1
        else:
            flush()
            prev = [head, head + 1, rest]
        i = j
    flush()
    return out


def flat_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Cover the row-major flat range [a, b) of ``shape`` with boxes that are each contiguous.

    Returns (offset, size) pairs in order; at most 2*ndim - 1 of them.
    """
    if a >= b:
        return []
    if len(shape) <= 1:
        return [((a,), (b - a,))]
    inner = math.prod(shape[1:])
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    row = a // inner
    if a % inner:
        end = min(b, (row + 1) * inner)
        out += [((row,) + lo, (1,) + sz) for lo, sz in flat_boxes(shape[1:], a % inner,
                                                                    end - row * inner)]
        a, row = end, row + 1
    if b // inner > row:
        out.append(((row,) + (0,) * (len(shape) - 1), (b // inner - row,) + shape[1:]))
        a = b // inner * inner
    if a < b:
        row = a // inner
        out += [((row,) + lo, (1,) + sz) for lo, sz in flat_boxes(shape[1:], 0, b - a)]
    return out


def local_to_global(sh: Shard, lo: tuple[int, ...], size: tuple[int, ...],
                    vocab: int) -> list[tuple[tuple[int, ...], Box]]:
    """Map a local box of a shard to (local offset, logical global box) parts."""
    npre = len(sh.param.prepend)
    if size == sh.local_shape and not any(lo):  # the whole shard: its pieces as they are
        out = []
        for piece in sh.pieces:
            box = logical_box(sh.param, piece.box, vocab)
            if box is not None:
                out.append((piece.local_offset, box))
        return out
    out = []
    for piece in sh.pieces:
        psize = piece.box.shape[npre:]
        a = tuple(max(x, p) for x, p in zip(lo, piece.local_offset))
        z = tuple(min(x + s, p + ps) for x, s, p, ps in zip(lo, size, piece.local_offset, psize))
        if any(x >= y for x, y in zip(a, z)):
            continue
        g_lo = piece.box.lo[:npre] + tuple(
            g + x - p for g, x, p in zip(piece.box.lo[npre:], a, piece.local_offset))
        box = logical_box(sh.param, Box.of(g_lo, (1,) * npre + tuple(y - x for x, y in zip(a, z))),
                          vocab)
        if box is not None:
            out.append((a, box))
    return out


def merge_adjacent(parts: list[tuple[tuple[int, ...], Box]], npre: int,
                   flat_shape: tuple[int, ...] | None = None
                   ) -> list[tuple[tuple[int, ...], Box]]:
    """Merge consecutive (local offset, global box) parts that one translation maps.

    Unsplit SwiGLU keeps Megatron's two pieces ``[gate; up]``, but locally and globally they
    lie end to end: one region serves where two would double every transfer of the weight.
    Two parts merge when they abut along one local dim, by the same step in the global box,
    and agree in every other dim (``npre`` leading global dims are the size-1 layer/expert
    axes). For a flat slot (``flat_shape``: the local tensor's shape) the merged block must
    also be contiguous in row-major order, since the flat shard stores it as one run.
    """
    if len(parts) < 2:  # nearly every shard: nothing to merge
        return parts
    out = parts[:1]
    for lo, box in parts[1:]:
        plo, pbox = out[-1]
        d = _abutting_dim(plo, pbox, lo, box, npre)
        merged = None
        if d is not None:
            merged = Box(pbox.lo, tuple(box.hi[i] if i == npre + d else h
                                        for i, h in enumerate(pbox.hi)))
            if flat_shape is not None and not _row_major_contiguous(
                    flat_shape, merged.shape[npre:]):
                merged = None
        if merged is None:
            out.append((lo, box))
        else:
            out[-1] = (plo, merged)
    return out


def _abutting_dim(alo: tuple[int, ...], a: Box, blo: tuple[int, ...], b: Box,
                  npre: int) -> int | None:
    """The local dim along which part b continues part a under the same translation."""
    if a.lo[:npre] != b.lo[:npre] or a.hi[:npre] != b.hi[:npre]:
        return None
    found = None
    for d, (x, y) in enumerate(zip(alo, blo)):
        g = npre + d
        if x == y and a.lo[g] == b.lo[g] and a.hi[g] == b.hi[g]:
            continue
        step = a.hi[g] - a.lo[g]
        if found is not None or y != x + step or b.lo[g] != a.hi[g]:
            return None
        found = d
    return found


def _row_major_contiguous(shape: tuple[int, ...], size: tuple[int, ...]) -> bool:
    """Whether a block of ``size`` inside a row-major tensor of ``shape`` is one run."""
    for d, n in enumerate(size):
        if n > 1:
            return tuple(size[d + 1:]) == tuple(shape[d + 1:])
    return True


class StateView:
    """Logical tensors and per-rank regions of a ``Layout`` for the state kinds its spec names.

    ``vocab_rows``: how many rows of the vocab-split tensors (embedding, output layer) are data.
    By default the real vocabulary; the padding rows past it are zeros at initialization but
    Megatron trains them (their logits enter the softmax), so a switch between two layouts
    carries every row both hold (``transition_views``), as a checkpoint reload does.
    """

    def __init__(self, layout: Layout, vocab_rows: int | None = None) -> None:
        self.layout = layout
        V, Vp = layout.model.vocab_size, layout.padded_vocab
        self.vocab_rows = V if vocab_rows is None else vocab_rows
        if not V <= self.vocab_rows <= Vp:
            raise LayoutError(f"vocab_rows must lie in [vocab_size, padded vocab] = [{V}, {Vp}]."
                              f" Got {self.vocab_rows}")
        self._tensors: dict[tuple[str, str], LogicalTensor] | None = None
        self._buffer_cache: dict[tuple[int, ...], tuple[Stored, ...]] = {}
        st = layout.spec.state
        self.kinds: dict[str, str] = {"param": st.param}
        for k in OPTIMIZER_KINDS:
            if getattr(st, k) is not None:
                self.kinds[k] = getattr(st, k)

    def tensors(self) -> dict[tuple[str, str], LogicalTensor]:
        """Every logical tensor, keyed by (key, kind) (computed once per view)."""
        if self._tensors is None:
            self._tensors = self._collect_tensors()
        return self._tensors

    def _collect_tensors(self) -> dict[tuple[str, str], LogicalTensor]:
        L, out = self.layout, {}
        V = self.vocab_rows
        for pp in range(L.parallel.pp):
            for ep in range(L.parallel.ep):
                for cs in L._shards(pp, 0, ep, 0):
                    for sh in cs.shards:
                        if (sh.param.key, "param") in out:  # stacked keys repeat per layer
                            continue
                        shape = list(sh.global_shape)
                        if sh.param.split is not None and sh.param.split.vocab:
                            shape[len(sh.param.prepend) + sh.param.split.dim] = V
                        for kind, dtype in self.kinds.items():
                            out[(sh.param.key, kind)] = LogicalTensor(sh.param.key, kind,
                                                                      tuple(shape), dtype)
                    for b in cs.buffers:
                        out[(b.key, "buffer")] = LogicalTensor(
                            b.key, "buffer", tuple(s for _, s in b.prepend) + b.shape, "fp32")
        if len(self.kinds) > 1:
            out[("optimizer.step", "step")] = LogicalTensor("optimizer.step", "step", (), "int64")
        return out

    def regions(self, rank: int) -> tuple[Region, ...]:
        """Everything ``rank`` holds, as regions of logical tensors (one per state kind), each
        in one storage tensor (``StackSlot`` families expanded into their members)."""
        return tuple(Region(s.key, k, box, slot, s.primary)
                     for s in self.stored(rank) for slot, _, box in members(s.slot, s.box, s.box)
                     for k in s.kinds)

    def stored(self, rank: int) -> tuple[Stored, ...]:
        """Everything ``rank`` holds, kinds that share a box and slot grouped.

        The module parameters depend only on the rank's model-parallel class and the
        optimizer shards on one index more, so both parts are cached and shared by ranks.
        """
        return self.param_part(rank) + self.shard_part(rank)

    def parts(self, rank: int) -> tuple[tuple[Stored, ...], ...]:
        """``stored(rank)`` as the cached tuples it is made of, each shared by many ranks.

        Dense params depend on (pp, tp) only and expert params on (pp, ep, etp) only, each
        DistributedOptimizer buffer's shard on its own few coordinates: consumers that work
        once per distinct part (keyed by identity: the view keeps every part alive) do the
        work per distinct piece of state rather than per rank.
        """
        c = self.layout.coords(rank)
        own = (self._dense_stored(c.pp, c.tp), self._expert_stored(c.pp, c.ep, c.etp))
        return own + self._shard_parts((c.pp, c.tp, c.ep, c.etp), *self._opt_ranks(rank))

    def param_part(self, rank: int) -> tuple[Stored, ...]:
        """What ``rank`` holds in module parameters and buffers (shared by its DP replicas)."""
        c = self.layout.coords(rank)
        return self._param_stored((c.pp, c.tp, c.ep, c.etp))

    def shard_part(self, rank: int) -> tuple[Stored, ...]:
        """What ``rank``'s DistributedOptimizer holds (empty without one)."""
        c = self.layout.coords(rank)
        return self._shard_stored((c.pp, c.tp, c.ep, c.etp), *self._opt_ranks(rank))

    def _opt_ranks(self, rank: int) -> tuple[int, int]:
        L = self.layout
        if not (L.parallel.use_distributed_optimizer and len(self.kinds) > 1):
            return -1, -1  # no DistributedOptimizer shards
        return L.optimizer_rank(rank, False), L.optimizer_rank(rank, True)

    @lru_cache(maxsize=4096)
    def _param_stored(self, model: tuple[int, int, int, int]) -> tuple[Stored, ...]:
        pp, tp, ep, etp = model
        return self._dense_stored(pp, tp) + self._expert_stored(pp, ep, etp)

    @lru_cache(maxsize=4096)
    def _dense_stored(self, pp: int, tp: int) -> tuple[Stored, ...]:
        """Non-expert params and buffers of stage ``pp`` on TP rank ``tp`` (and the step)."""
        out = self._module_stored((pp, tp, 0, 0), expert=False)
        if len(self.kinds) > 1:
            out.append(Stored("optimizer.step", ("step",), Box((), ()), BufferSlot(-1, "step")))
        return tuple(out)

    @lru_cache(maxsize=4096)
    def _expert_stored(self, pp: int, ep: int, etp: int) -> tuple[Stored, ...]:
        """Expert params of stage ``pp`` on expert rank ``ep``, expert-TP rank ``etp``."""
        return tuple(self._module_stored((pp, 0, ep, etp), expert=True))

    def _module_stored(self, model: tuple[int, int, int, int], expert: bool) -> list[Stored]:
        L = self.layout
        V = self.vocab_rows
        opt_kinds = tuple(k for k in self.kinds if k != "param")
        kinds = ("param",) if L.parallel.use_distributed_optimizer else ("param", *opt_kinds)
        out: list[Stored] = []
        for cs in L._shards(*model):
            vp = cs.chunk.vp
            fam = _Families(kinds)
            for sh in cs.shards:
                if sh.param.expert != expert:
                    continue
                p = sh.param
                if p.prepend and STACK_FAMILIES:  # layer/expert-stacked: one template
                    fam.add((p.key, p.shape, p.split, sh.local_shape),
                            tuple([i for i, _ in p.prepend]), p.name,
                            lambda sh=sh: self._param_template(sh, vp))
                    continue
                parts = local_to_global(sh, (0,) * len(sh.local_shape), sh.local_shape, V)
                for lo, box in merge_adjacent(parts, len(p.prepend)):
                    out.append(Stored(p.key, kinds, box, ParamSlot(vp, p.name, lo),
                                      not p.tied_copy))
            out += fam.stored()
            if not expert:
                for b in cs.buffers:
                    pre = tuple(i for i, _ in b.prepend)
                    box = Box.of(pre + (0,) * len(b.shape), (1,) * len(pre) + b.shape)
                    out.append(Stored(b.key, ("buffer",), box, BufferSlot(vp, b.name)))
        return out

    def _param_template(self, sh: Shard, vp: int) -> tuple:
        """A stacked weight's module-param regions past its leading axes (``_Families``)."""
        npre = len(sh.param.prepend)
        parts = local_to_global(sh, (0,) * len(sh.local_shape), sh.local_shape, self.vocab_rows)
        return (sh.param.key, not sh.param.tied_copy, npre,
                tuple((box.lo[npre:], box.hi[npre:], ParamSlot(vp, sh.param.name, lo))
                      for lo, box in merge_adjacent(parts, npre)))

    @lru_cache(maxsize=1 << 14)
    def _shard_stored(self, model: tuple[int, int, int, int], dense_rank: int,
                      expert_rank: int) -> tuple[Stored, ...]:
        """The DistributedOptimizer's shards of one rank, buffer by buffer (each cached)."""
        return sum(self._shard_parts(model, dense_rank, expert_rank), ())

    def _shard_parts(self, model: tuple[int, int, int, int], dense_rank: int,
                     expert_rank: int) -> tuple[tuple[Stored, ...], ...]:
        if dense_rank < 0:
            return ()
        return tuple(self._buffer_stored(model, bi, buf, expert_rank if buf.is_expert
                                         else dense_rank)
                     for bi, buf in enumerate(self.layout._buffers(*model)))

    def _buffer_stored(self, model: tuple[int, int, int, int], bi: int, buf: BufferLayout,
                       opt_rank: int) -> tuple[Stored, ...]:
        # A buffer's contents depend on fewer coordinates than the rank's class: the dense
        # buffer on (pp, tp) once experts have their own, the expert buffer on (pp, ep, etp).
        pp, tp, ep, etp = model
        if buf.is_expert:
            key = (pp, bi, -1, ep, etp, opt_rank)
        elif self.layout.parallel.ep > 1:
            key = (pp, bi, tp, -1, -1, opt_rank)
        else:
            key = (pp, bi, tp, ep, etp, opt_rank)
        hit = self._buffer_cache.get(key)
        if hit is None:
            hit = self._buffer_cache[key] = self._compute_buffer_stored(model, bi, buf, opt_rank)
        return hit

    def _compute_buffer_stored(self, model: tuple[int, int, int, int], bi: int,
                               buf: BufferLayout, opt_rank: int) -> tuple[Stored, ...]:
        L = self.layout
        V = self.vocab_rows
        opt_kinds = tuple(k for k in self.kinds if k != "param")
        by_name = {sh.param.name: sh for cs in L._shards(*model) if cs.chunk.vp == buf.chunk
                   for sh in cs.shards}
        fam = _Families(opt_kinds)
        for o in owned_ranges(buf, opt_rank):
            sh = by_name[o.name]
            if sh.param.prepend and STACK_FAMILIES:  # layer/expert-stacked: one template
                p = sh.param
                fam.add((p.key, p.shape, p.split, sh.local_shape, o.param),
                        tuple([i for i, _ in p.prepend]), p.name,
                        lambda sh=sh, o=o: self._flat_template(sh, o, buf.chunk, bi))
                continue
            for box, slot in self._flat_regions(sh, o, buf.chunk, bi):
                fam.plain(Stored(sh.param.key, opt_kinds, box, slot, not sh.param.tied_copy))
        return tuple(fam.stored())

    def _flat_regions(self, sh: Shard, o: OwnedRange, chunk: int, bi: int
                      ) -> list[tuple[Box, FlatSlot]]:
        """The regions of the part ``o`` of a parameter that an optimizer shard holds."""
        out = []
        shape, npre = sh.local_shape, len(sh.param.prepend)
        for lo, size in flat_boxes(shape, *o.param):
            start = _flat_index(shape, lo) - o.param[0]
            parts = local_to_global(sh, lo, size, self.vocab_rows)
            for plo, box in merge_adjacent(parts, npre, shape):
                off = start + _flat_index(shape, plo) - _flat_index(shape, lo)
                out.append((box, FlatSlot(chunk, bi, o.name, off)))
        return out

    def _flat_template(self, sh: Shard, o: OwnedRange, chunk: int, bi: int) -> tuple:
        """A stacked weight's optimizer-shard regions past its leading axes (``_Families``)."""
        npre = len(sh.param.prepend)
        return (sh.param.key, not sh.param.tied_copy, npre,
                tuple((box.lo[npre:], box.hi[npre:], slot)
                      for box, slot in self._flat_regions(sh, o, chunk, bi)))


def slot_key(kind: str, slot: Slot) -> tuple:
    """The key of ``slot``'s tensor in a rank's local storage, for state ``kind``.

    Raises:
        LayoutError: ``slot`` is a ``StackSlot``, which spans several tensors (``members``).
    """
    if type(slot) is StackSlot:
        raise LayoutError(f"a family of {len(slot.names)} slots has no single storage tensor; "
                          "expand it with members()")
    return (kind, type(slot).__name__, slot.chunk, slot.name)


def storage_tensors(view: StateView, rank: int) -> dict[tuple, tuple[tuple[int, ...], str]]:
    """Every tensor of ``rank``'s local storage: ``slot_key`` -> (shape, IR dtype).

    A ``ParamSlot`` is the TP-local parameter (its local shape, padding rows included), a
    ``FlatSlot`` the DistributedOptimizer's shard of one parameter (its owned length), a
    ``BufferSlot`` the module buffer (its box). Executors allocate exactly these.

    Raises:
        LayoutError: logical tensors that share a slot disagree on its dtype.
    """
    L = view.layout
    specs = view.tensors()
    shapes = {(cs.chunk.vp, sh.param.name): sh.local_shape for cs in L.rank_shards(rank)
              for sh in cs.shards}
    lengths = {(b.chunk, o.name): o.param[1] - o.param[0] for b, owned in L.rank_owned(rank)
               for o in owned}
    out: dict[tuple, tuple[tuple[int, ...], str]] = {}
    for reg in view.regions(rank):
        k = slot_key(reg.kind, reg.slot)
        dtype = specs[(reg.key, reg.kind)].dtype
        have = out.get(k)
        if have is not None:
            if have[1] != dtype:
                raise LayoutError(f"slot {k} holds {have[1]} and {dtype} (from {reg.key})")
            continue
        s = reg.slot
        if isinstance(s, ParamSlot):
            shape = tuple(shapes[(s.chunk, s.name)])
        elif isinstance(s, FlatSlot):
            shape = (lengths[(s.chunk, s.name)],)
        else:
            shape = reg.box.shape
        out[k] = (shape, dtype)
    return out


def view_of(layout: Layout, vocab_rows: int | None = None) -> StateView:
    """The one ``StateView`` of ``layout`` (per ``vocab_rows``), so the planner and the verifier
    share its caches.

    Computing what every rank holds is the IR's job, done once; what consumers do with it
    (intersect, check) stays their own.
    """
    views = layout.__dict__.setdefault("_state_views", {})
    view = views.get(vocab_rows)
    if view is None:
        view = views[vocab_rows] = StateView(layout, vocab_rows)
    return view


def switch_vocab_rows(src: Layout, dst: Layout) -> int | None:
    """Vocab rows a switch from ``src`` to ``dst`` carries: every row both layouts hold.

    A checkpoint reload copies the overlap of the saved and the new padded vocabulary and
    zero-fills the rest (megatron-core's ``allow_shape_mismatch`` load), so rows up to the
    smaller padded size are state, padding included. None when the models' vocabularies differ
    (not the same model: the planner refuses it).
    """
    if src.model.vocab_size != dst.model.vocab_size:
        return None
    return min(src.padded_vocab, dst.padded_vocab)


def transition_views(src: Layout, dst: Layout) -> tuple[StateView, StateView]:
    """The state views of both sides of a switch, with the vocab rows the switch carries."""
    rows = switch_vocab_rows(src, dst)
    return view_of(src, rows), view_of(dst, rows)


def _flat_index(shape: tuple[int, ...], idx: tuple[int, ...]) -> int:
    flat = 0
    for s, i in zip(shape, idx):
        flat = flat * s + i
    return flat
