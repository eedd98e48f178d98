"""Geometry of a shard's local storage: flat ranges as boxes, local boxes as global ones.

A TP shard maps blocks of its local tensor to boxes of the logical tensor (``shard.Piece``).
``local_to_global`` maps any local box through those pieces, ``flat_boxes`` covers a row-major
flat range (a DistributedOptimizer shard) with boxes, and ``merge_adjacent`` joins parts that one
translation maps (SwiGLU's unsplit ``[gate; up]``) into one region.
"""

from __future__ import annotations

import math
from operator import add, ge, sub

from .box import Box
from .shard import Shard, logical_box


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
    hi = tuple(map(add, lo, size))
    lead = (1,) * npre
    for piece in sh.pieces:  # a hot path at scale (every optimizer shard): tuple maps
        off, g = piece.local_offset, piece.box
        a = tuple(map(max, lo, off))
        z = tuple(map(min, hi, map(add, off, map(sub, g.hi[npre:], g.lo[npre:]))))
        if any(map(ge, a, z)):
            continue
        g_lo = g.lo[:npre] + tuple(map(add, g.lo[npre:], map(sub, a, off)))
        box = logical_box(sh.param, Box.of(g_lo, lead + tuple(map(sub, z, a))), vocab)
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
