"""Training state in the Virtual Parameter Space: logical tensors and what each rank holds.

Every piece of state is a logical tensor ``(key, kind)``: ``key`` is the megatron-core checkpoint
key, ``kind`` one of param, main_param, exp_avg, exp_avg_sq (per parameter), buffer (router
expert_bias, TE fp8 scales and amax histories) or step (Adam's step count). Its shape is the
checkpoint's global shape with vocab padding removed (padding rows are not data). A rank
holds a tensor as ``Region``s: a box of the logical tensor and the slot in that rank's local
storage where the box's elements sit (``slots``). Consumers that work on many ranks read
``Stored`` entries instead, where the layers and experts of a stage are one family region
(``StackSlot``).

Transformer Engine layouts: each TE module's ``_extra_state`` object is not training state here. A
switch re-initialises it instead of carrying it, which is exactly what megatron's reload does with
fp8 off: TE saves an empty uint8 tensor (TE module/base.py:1385-1389, ops/op.py:702-703), loading
an empty tensor returns without touching the module (base.py:1429-1431), and megatron's
grouped-linear load hook returns early when there is no fp8 state (M16
extensions/transformer_engine.py:1553-1641). So a freshly built destination module already holds
what a reload would give it (tests/test_te_parity.py checks both facts against megatron). With fp8
delayed scaling the extra state holds scales and amax histories: those are state here, four
``buffer`` tensors per TE GEMM module (``model.fp8_meta_buffers``), replicated over TP and DP as
megatron's amax reduction keeps them (docs/spec.md).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from operator import add, ge, sub

from .box import Box
from .buffers import BufferLayout, OwnedRange, owned_spans
from .errors import LayoutError
from .geometry import flat_boxes, local_to_global, merge_adjacent
from .layout import Layout
from .model import ParamDef
from .shard import Shard, shard
# The slot types are the state's vocabulary: imported here, they are importable from here too.
from .slots import (BufferSlot, FlatSlot, ParamSlot, Slot, StackSlot, flat_index, grid_boxes,
                    members, renamed, slot_key)

OPTIMIZER_KINDS = ("main_param", "exp_avg", "exp_avg_sq")
STEP_KEY = "optimizer.step"  # the Adam step: one scalar per rank, held with the parameters


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
            g = self.groups[sig] = (template(), {}, None)
            self.order.append(sig)
        g[1][lead] = name

    def add_family(self, sig: tuple, template: tuple, cut: tuple) -> None:
        """A whole template at once: its members already cut into boxes (``family_cut``)."""
        self.groups[sig] = (template, None, cut)
        self.order.append(sig)

    def plain(self, s: Stored) -> None:
        """An entry that is not stacked, kept in its place."""
        self.order.append(s)

    def stored(self) -> list[Stored]:
        out: list[Stored] = []
        for item in self.order:
            if isinstance(item, Stored):
                out.append(item)
                continue
            (key, primary, npre, parts), names, cut = self.groups[item]
            if cut is None and len(names) == 1:  # one member (most optimizer shards at scale)
                (lead, name), = names.items()
                lead_hi = tuple([i + 1 for i in lead])
                for t_lo, t_hi, slot in parts:
                    out.append(Stored(key, self.kinds, Box(lead + t_lo, lead_hi + t_hi),
                                      renamed(slot, name), primary))
                continue
            for t_lo, t_hi, slot in parts:
                for lo, hi, grid in cut or family_cut(names):
                    box = Box(lo + t_lo, hi + t_hi)
                    first = renamed(slot, grid[0])
                    out.append(Stored(key, self.kinds, box, first if len(grid) == 1 else
                                      StackSlot(first, npre, grid), primary))
        return out


@lru_cache(maxsize=1 << 14)
def _stacked_template(rep: ParamDef, rank: int, size: int, vp: int, vocab: int) -> tuple:
    """A stacked weight's module-param regions past its leading axes (``_Families``) on TP
    rank ``rank`` of ``size``: ``rep`` is a member with its leading indices zeroed, so every
    stage and layout of a model shares the result (a slice compiles classes of both)."""
    sh = shard(rep, rank, size)
    npre = len(rep.prepend)
    parts = local_to_global(sh, (0,) * len(sh.local_shape), sh.local_shape, vocab)
    return (rep.key, not rep.tied_copy, npre,
            tuple((box.lo[npre:], box.hi[npre:], ParamSlot(vp, rep.name, lo))
                  for lo, box in merge_adjacent(parts, npre)))


def family_cut(names: dict[tuple[int, ...], str]
               ) -> tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...]], ...]:
    """A family's members (leading coordinates -> name) cut into boxes of their grid: (lo, hi,
    member names row-major) per box (``grid_boxes``)."""
    out = []
    for lo, hi in grid_boxes(sorted(names)):
        pts = itertools.product(*(range(a, b) for a, b in zip(lo, hi)))
        out.append((lo, hi, tuple([names[p] for p in pts])))
    return tuple(out)


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
        self._templates: dict[tuple, tuple] = {}  # whole stacked weights' shard templates
        self._parts: dict[int, tuple[tuple[Stored, ...], ...]] = {}  # ``parts`` per rank
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
        # From the parameter definitions: splitting every class's shards would cost seconds
        # on a large MoE model, and the global shapes do not depend on the split. Every EP
        # rank holds the same keys (its experts are indices of a leading axis): EP rank 0's
        # definitions name them all.
        for pp in range(L.parallel.pp):
            for defs, bufs in L.chunk_defs(pp, 0):
                for d in defs:
                    if (d.key, "param") in out:  # stacked keys repeat per layer
                        continue
                    shape = [s for _, s in d.prepend] + list(d.shape)
                    if d.split is not None and d.split.vocab:
                        shape[len(d.prepend) + d.split.dim] = V
                    for kind, dtype in self.kinds.items():
                        out[(d.key, kind)] = LogicalTensor(d.key, kind, tuple(shape), dtype)
                for b in bufs:
                    out[(b.key, "buffer")] = LogicalTensor(
                        b.key, "buffer", tuple(s for _, s in b.prepend) + b.shape, "fp32")
        if len(self.kinds) > 1:
            out[(STEP_KEY, "step")] = LogicalTensor(STEP_KEY, "step", (), "int64")
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
        hit = self._parts.get(rank)
        if hit is None:  # kept: the planner, the verifier and the memory check all ask
            c = self.layout.coords(rank)
            own = (self._dense_stored(c.pp, c.tp), self._expert_stored(c.pp, c.ep, c.etp))
            hit = self._parts[rank] = own + self._shard_parts((c.pp, c.tp, c.ep, c.etp),
                                                              *self._opt_ranks(rank))
        return hit

    def param_part(self, rank: int) -> tuple[Stored, ...]:
        """What ``rank`` holds in module parameters and buffers (shared by its DP replicas)."""
        c = self.layout.coords(rank)
        return self._param_stored((c.pp, c.tp, c.ep, c.etp))

    def model_part(self, model: tuple[int, int, int, int]) -> tuple[Stored, ...]:
        """``param_part`` of the ranks of model-parallel class ``model`` = (pp, tp, ep, etp)."""
        return self._param_stored(model)

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
            out.append(Stored(STEP_KEY, ("step",), Box((), ()), BufferSlot(-1, "step")))
        return tuple(out)

    @lru_cache(maxsize=4096)
    def _expert_stored(self, pp: int, ep: int, etp: int) -> tuple[Stored, ...]:
        """Expert params of stage ``pp`` on expert rank ``ep``, expert-TP rank ``etp``."""
        return tuple(self._module_stored((pp, 0, ep, etp), expert=True))

    def _module_stored(self, model: tuple[int, int, int, int], expert: bool) -> list[Stored]:
        L = self.layout
        pp, tp, ep, etp = model
        rank = etp if expert else tp
        kinds = self._module_kinds()
        out: list[Stored] = []
        for vp, plain, families, buffers in self._module_groups(pp, ep if expert else 0, expert):
            for p in plain:
                sh = L.shard_of(p, rank)
                parts = local_to_global(sh, (0,) * len(sh.local_shape), sh.local_shape,
                                        self.vocab_rows)
                for lo, box in merge_adjacent(parts, len(p.prepend)):
                    out.append(Stored(p.key, kinds, box, ParamSlot(vp, p.name, lo),
                                      not p.tied_copy))
            fam = _Families(kinds)
            for i, (rep, cut) in enumerate(families):
                fam.add_family(i, _stacked_template(rep, *L.split_of(rep, rank), vp,
                                                    self.vocab_rows), cut)
            out += fam.stored()
            for b in buffers:
                pre = tuple(i for i, _ in b.prepend)
                box = Box.of(pre + (0,) * len(b.shape), (1,) * len(pre) + b.shape)
                out.append(Stored(b.key, ("buffer",), box, BufferSlot(vp, b.name)))
        return out

    def _module_kinds(self) -> tuple[str, ...]:
        opt_kinds = tuple(k for k in self.kinds if k != "param")
        return ("param",) if self.layout.parallel.use_distributed_optimizer else \
            ("param", *opt_kinds)

    @lru_cache(maxsize=1024)
    def _module_groups(self, pp: int, ep: int, expert: bool) -> tuple:
        """Per chunk of stage ``pp``: (vp, unstacked params, stacked families, buffers), the
        same for every TP rank, so a stage's layers are grouped once, not once per TP rank.
        A family is (its first member, its members cut into boxes); its members share
        the key, shape and split, hence the local shape and the regions past the leading axes
        (``_Families``). The first member is kept with its leading indices zeroed: its
        template is then the same for every stage and layout of the model
        (``_stacked_template``). Families are in order of first appearance."""
        out = []
        for ch, (defs, bufs) in zip(self.layout.chunks(pp), self.layout.chunk_defs(pp, ep)):
            plain, groups = [], {}
            for p in defs:
                if p.expert != expert:
                    continue
                if p.prepend and STACK_FAMILIES:  # layer/expert-stacked: one template
                    sig = (p.key, p.shape, p.split)
                    if sig not in groups:
                        groups[sig] = (replace(p, prepend=tuple([(0, n) for _, n in p.prepend])),
                                       {})
                    groups[sig][1][tuple([i for i, _ in p.prepend])] = p.name
                else:
                    plain.append(p)
            out.append((ch.vp, tuple(plain),
                        tuple((rep, family_cut(names)) for rep, names in groups.values()),
                        () if expert else bufs))
        return tuple(out)

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
        elif self.layout.experts_own_buffer:
            key = (pp, bi, tp, -1, -1, opt_rank)
        else:
            key = (pp, bi, tp, ep, etp, opt_rank)
        hit = self._buffer_cache.get(key)
        if hit is None:
            hit = self._buffer_cache[key] = self._compute_buffer_stored(model, bi, buf, opt_rank)
        return hit

    def _compute_buffer_stored(self, model: tuple[int, int, int, int], bi: int,
                               buf: BufferLayout, opt_rank: int) -> tuple[Stored, ...]:
        opt_kinds = tuple(k for k in self.kinds if k != "param")
        by_name = self._shards_by_name(model, buf.chunk)
        fam = _Families(opt_kinds)
        groups, params = fam.groups, buf.params
        for i, a, z, lo in owned_spans(buf, opt_rank):
            bp = params[i]
            sh = by_name[bp.name]
            p = sh.param
            if p.prepend and STACK_FAMILIES:  # layer/expert-stacked: one template
                sig = (p.key, p.shape, p.split, sh.local_shape, (a - bp.start, z - bp.start))
                lead = tuple([j for j, _ in p.prepend])
                g = groups.get(sig)
                if g is not None:  # a member of a template already seen (most of a MoE
                    g[1][lead] = p.name  # buffer's experts): no range object at all
                    continue
                o = OwnedRange(bp.name, bp.bucket, (a, z), (a - lo, z - lo), sig[-1])
                fam.add(sig, lead, p.name,
                        lambda sh=sh, o=o: self._flat_template(sh, o, buf.chunk, bi))
                continue
            o = OwnedRange(bp.name, bp.bucket, (a, z), (a - lo, z - lo),
                           (a - bp.start, z - bp.start))
            for box, slot in self._flat_regions(sh, o, buf.chunk, bi):
                fam.plain(Stored(sh.param.key, opt_kinds, box, slot, not sh.param.tied_copy))
        return tuple(fam.stored())

    @lru_cache(maxsize=4096)
    def _shards_by_name(self, model: tuple[int, int, int, int], chunk: int) -> dict[str, Shard]:
        """The shards of chunk ``chunk`` of a class by parameter name (every buffer shard of
        the class looks its parameters up here)."""
        return {sh.param.name: sh for cs in self.layout._shards(*model) if cs.chunk.vp == chunk
                for sh in cs.shards}

    def _flat_regions(self, sh: Shard, o: OwnedRange, chunk: int, bi: int
                      ) -> list[tuple[Box, FlatSlot]]:
        """The regions of the part ``o`` of a parameter that an optimizer shard holds."""
        out = []
        shape, npre = sh.local_shape, len(sh.param.prepend)
        for lo, size in flat_boxes(shape, *o.param):
            start = flat_index(shape, lo) - o.param[0]
            parts = local_to_global(sh, lo, size, self.vocab_rows)
            for plo, box in merge_adjacent(parts, npre, shape):
                off = start + flat_index(shape, plo) - flat_index(shape, lo)
                out.append((box, FlatSlot(chunk, bi, o.name, off)))
        return out

    def _flat_template(self, sh: Shard, o: OwnedRange, chunk: int, bi: int) -> tuple:
        """A stacked weight's optimizer-shard regions past its leading axes (``_Families``).

        Computed in the coordinates past those axes, straight from the split's template (a
        stacked weight is never vocab-split, so no row is clipped). A whole weight's template
        is the same on every optimizer rank that owns one: kept per view."""
        p, shape = sh.param, sh.local_shape
        whole = o.param[0] == 0 and o.param[1] == math.prod(shape)
        key = (p.key, p.split, shape, sh.template, o.param, chunk, bi) if whole else None
        hit = self._templates.get(key) if whole else None
        if hit is None:
            hit = (p.key, not p.tied_copy, len(p.prepend),
                   tuple(_stripped_flat_regions(shape, sh.template, o, chunk, bi)))
            if whole:
                self._templates[key] = hit
        return hit


def _stripped_flat_regions(shape: tuple[int, ...], pieces: tuple, o: OwnedRange, chunk: int,
                           bi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], FlatSlot]]:
    """``StateView._flat_regions`` of a weight without leading axes nor vocab rows: (global lo,
    global hi, slot) per region, the split given as its template ((local offset, global lo,
    global hi), ...)."""
    if len(shape) == 2:  # nearly every weight: scalar arithmetic, no tuple maps
        return _stripped_flat_regions_2d(shape, _piece_table(pieces), o, chunk, bi)
    out = []
    base = o.param[0]
    for lo, size in flat_boxes(shape, *o.param):
        hi = tuple(map(add, lo, size))
        parts = []
        for off, g_lo, g_hi in pieces:
            a = tuple(map(max, lo, off))
            z = tuple(map(min, hi, map(add, off, map(sub, g_hi, g_lo))))
            if any(map(ge, a, z)):
                continue
            shift = tuple(map(sub, g_lo, off))
            parts.append((a, Box(tuple(map(add, a, shift)), tuple(map(add, z, shift)))))
        for plo, box in merge_adjacent(parts, 0, shape):
            out.append((box.lo, box.hi, FlatSlot(chunk, bi, o.name,
                                                 flat_index(shape, plo) - base)))
    return out


@lru_cache(maxsize=1 << 12)
def _piece_table(pieces: tuple) -> tuple[tuple[int, int, int, int, int, int], ...]:
    """A 2-d split template as (local row, local col, local row end, local col end, row
    shift, col shift) per piece."""
    return tuple((o0, o1, o0 + h0 - g0, o1 + h1 - g1, g0 - o0, g1 - o1)
                 for (o0, o1), (g0, g1), (h0, h1) in pieces)


def _stripped_flat_regions_2d(shape: tuple[int, int], table: tuple, o: OwnedRange, chunk: int,
                              bi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], FlatSlot]]:
    """``_stripped_flat_regions`` of a 2-d weight: the flat range cut into a partial first
    row, whole rows and a partial last row (``flat_boxes``'s boxes, in its order), each
    mapped through the pieces."""
    rows, cols = shape
    a, b = o.param
    boxes = []
    row = a // cols
    if a % cols:
        end = min(b, (row + 1) * cols)
        boxes.append((row, a % cols, row + 1, end - row * cols))
        a, row = end, row + 1
    if b // cols > row:
        boxes.append((row, 0, b // cols, cols))
        a = b // cols * cols
    if a < b:
        boxes.append((a // cols, 0, a // cols + 1, b - a))
    out = []
    base = o.param[0]
    for r0, c0, r1, c1 in boxes:
        parts = []
        for p0, p1, e0, e1, s0, s1 in table:
            a0, z0 = (r0 if r0 > p0 else p0), (r1 if r1 < e0 else e0)
            a1, z1 = (c0 if c0 > p1 else p1), (c1 if c1 < e1 else e1)
            if a0 < z0 and a1 < z1:
                parts.append(((a0, a1), Box((a0 + s0, a1 + s1), (z0 + s0, z1 + s1))))
        for (l0, l1), box in merge_adjacent(parts, 0, shape):
            out.append((box.lo, box.hi, FlatSlot(chunk, bi, o.name, l0 * cols + l1 - base)))
    return out


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


