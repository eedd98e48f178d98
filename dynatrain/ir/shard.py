"""Tensor-parallel shards: which rows/columns of a parameter's global tensor a TP rank holds.

A shard is a list of pieces; each piece maps a block of the local parameter (starting at
``local_offset``) to a box of the global tensor. Plain splits give one piece; SwiGLU's
``[gate_r; up_r]`` gives two. Offsets here include the prepended layer/expert axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .box import Box
from .errors import LayoutError
from .model import ParamDef


@dataclass(frozen=True, slots=True)
class Piece:
    """A block of the local parameter and the global box it holds.

    ``local_offset`` indexes the local parameter (no prepended axes); ``box`` is in the
    checkpoint's global coordinates (prepended axes first, vocab padding included).
    """

    local_offset: tuple[int, ...]
    box: Box


@dataclass(frozen=True, slots=True)
class Shard:
    """A parameter as one TP rank holds it."""

    param: ParamDef
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    fragments: tuple[int, ...]  # Megatron's axis_fragmentations

    @property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.param.prepend) + self.param.shape


@lru_cache(maxsize=1 << 16)
def shard(p: ParamDef, tp_rank: int, tp_size: int) -> Shard:
    """Split ``p`` for rank ``tp_rank`` of a ``tp_size``-way group (``p.split.group``)."""
    pre_off = tuple(i for i, _ in p.prepend)
    pre_frag = tuple(s for _, s in p.prepend)
    nd = len(p.shape)
    # SwiGLU stays two pieces even unsplit: Megatron's factory always emits [gate; up] halves.
    if p.split is None or (tp_size == 1 and not p.split.glu):
        box = Box.of(pre_off + (0,) * nd, (1,) * len(pre_off) + p.shape)
        frag = pre_frag + (1,) * nd
        return Shard(p, p.shape, (Piece((0,) * nd, box),), frag)
    d = p.split.dim
    if p.shape[d] % (tp_size * (2 if p.split.glu else 1)):
        raise LayoutError(f"{p.name}: dim {d} of {p.shape} does not split {tp_size} ways")
    local = list(p.shape)
    local[d] //= tp_size
    frag = [1] * nd
    frag[d] = tp_size * (2 if p.split.glu else 1)
    pieces = []
    if p.split.glu:
        half = p.shape[d] // 2
        chunk = half // tp_size
        for k in range(2):
            lo_local = [0] * nd
            lo_local[d] = k * chunk
            lo = [0] * nd
            lo[d] = k * half + tp_rank * chunk
            size = list(local)
            size[d] = chunk
            pieces.append(Piece(tuple(lo_local), Box.of(pre_off + tuple(lo),
                                                          (1,) * len(pre_off) + tuple(size))))
    else:
        lo = [0] * nd
        lo[d] = tp_rank * local[d]
        pieces.append(Piece((0,) * nd, Box.of(pre_off + tuple(lo),
                                              (1,) * len(pre_off) + tuple(local))))
    return Shard(p, tuple(local), tuple(pieces), pre_frag + tuple(frag))


def logical_box(p: ParamDef, box: Box, vocab_size: int) -> Box | None:
    """Clip a checkpoint box to logical data: vocab padding rows are not logical data."""
    if p.split is None or not p.split.vocab:
        return box
    d = len(p.prepend) + p.split.dim
    hi = list(box.hi)
    hi[d] = min(hi[d], vocab_size)
    return box & Box(box.lo, tuple(hi))
