"""Tensor-parallel shards: which rows/columns of a parameter's global tensor a TP rank holds.

A shard is a list of pieces; each piece maps a block of the local parameter (starting at
``local_offset``) to a box of the global tensor. Plain splits give one piece; SwiGLU's
``[gate_r; up_r]`` gives two. Offsets here include the prepended layer/expert axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from .box import Box
from .errors import LayoutError
from .model import ParamDef, TPSplit


@dataclass(frozen=True, slots=True)
class Piece:
    """A block of the local parameter and the global box it holds.

    ``local_offset`` indexes the local parameter (no prepended axes); ``box`` is in the
    checkpoint's global coordinates (prepended axes first, vocab padding included).
    """

    local_offset: tuple[int, ...]
    box: Box


@dataclass(frozen=True)
class Shard:
    """A parameter as one TP rank holds it.

    ``pieces`` is built on first use: a stage of a stacked model has one shard per layer, but
    its regions come from one template per weight (``state._Families``), so most shards are
    only asked for their local shape.
    """

    param: ParamDef
    local_shape: tuple[int, ...]
    template: tuple  # ((local offset, global lo, global hi), ...) without the prepended axes
    fragments: tuple[int, ...]  # Megatron's axis_fragmentations

    @property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.param.prepend) + self.param.shape

    @cached_property
    def pieces(self) -> tuple[Piece, ...]:
        if not self.param.prepend:
            return tuple([Piece(lo, Box(a, z)) for lo, a, z in self.template])
        pre_off = tuple([i for i, _ in self.param.prepend])
        pre_one = tuple([i + 1 for i in pre_off])
        return tuple([Piece(lo, Box(pre_off + a, pre_one + z)) for lo, a, z in self.template])


def shard(p: ParamDef, tp_rank: int, tp_size: int) -> Shard:
    """Split ``p`` for rank ``tp_rank`` of a ``tp_size``-way group (``p.split.group``)."""
    template = _split_template(p.shape, p.split, tp_rank, tp_size)
    if template is None:
        raise LayoutError(f"{p.name}: dim {p.split.dim} of {p.shape} does not split "
                          f"{tp_size} ways")
    local, pieces, frag = template
    if p.prepend:
        frag = tuple([s for _, s in p.prepend]) + frag
    return Shard(p, local, pieces, frag)


@lru_cache(maxsize=1 << 12)
def _split_template(shape: tuple[int, ...], split: TPSplit | None, tp_rank: int, tp_size: int
                    ) -> tuple[tuple[int, ...], tuple, tuple[int, ...]] | None:
    """The split of a parameter without its leading axes: (local shape, pieces as (local
    offset, global lo, global hi), fragments), or None if the split dim does not divide.
    The same for every layer and expert of a weight, so a 235B MoE layout computes it a few
    dozen times instead of 50k."""
    nd = len(shape)
    # SwiGLU stays two pieces even unsplit: Megatron's factory always emits [gate; up] halves.
    if split is None or (tp_size == 1 and not split.glu):
        return shape, (((0,) * nd, (0,) * nd, shape),), (1,) * nd
    d = split.dim
    halves = 2 if split.glu else 1
    if shape[d] % (tp_size * halves):
        return None
    local = list(shape)
    local[d] //= tp_size
    frag = [1] * nd
    frag[d] = tp_size * halves
    pieces = []
    chunk = shape[d] // halves // tp_size
    for k in range(halves):
        lo_local = [0] * nd
        lo_local[d] = k * chunk
        lo = [0] * nd
        lo[d] = k * (shape[d] // halves) + tp_rank * chunk
        hi = list(local)
        hi[d] = lo[d] + chunk
        pieces.append((tuple(lo_local), tuple(lo), tuple(hi)))
    return tuple(local), tuple(pieces), tuple(frag)


def logical_box(p: ParamDef, box: Box, vocab_size: int) -> Box | None:
    """Clip a checkpoint box to logical data: vocab padding rows are not logical data."""
    if p.split is None or not p.split.vocab:
        return box
    d = len(p.prepend) + p.split.dim
    hi = list(box.hi)
    hi[d] = min(hi[d], vocab_size)
    return box & Box(box.lo, tuple(hi))
