"""Numbers a person wants from a layout: world, groups, bytes per rank per state kind."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .layout import DTYPE_BYTES, Layout
from .state import StateView


@dataclass(frozen=True, slots=True)
class KindBytes:
    kind: str
    dtype: str
    min_bytes: int
    max_bytes: int
    total_bytes: int


def rank_elements(layout: Layout, rank: int) -> tuple[int, int]:
    """(param elements, optimizer-state elements per kind) that ``rank`` holds."""
    params = sum(math.prod(sh.local_shape) for cs in layout.rank_shards(rank) for sh in cs.shards)
    if not layout.parallel.use_distributed_optimizer:
        return params, params
    opt = sum(o.param[1] - o.param[0] for _, owned in layout.rank_owned(rank) for o in owned)
    return params, opt


def bytes_by_kind(layout: Layout) -> list[KindBytes]:
    """Per state kind: min/max bytes any rank holds, and the total over ranks (with padding)."""
    view = StateView(layout)
    per_rank = [rank_elements(layout, r) for r in range(layout.world)]
    out = []
    for kind, dtype in view.kinds.items():
        idx = 0 if kind == "param" else 1
        vals = [pr[idx] * DTYPE_BYTES[dtype] for pr in per_rank]
        out.append(KindBytes(kind, dtype, min(vals), max(vals), sum(vals)))
    return out


def largest_tensors(layout: Layout, n: int = 5) -> list[tuple[str, tuple[int, ...], int]]:
    """The ``n`` largest logical parameter tensors: (key, shape, elements)."""
    tensors = [t for (key, kind), t in StateView(layout).tensors().items() if kind == "param"]
    tensors.sort(key=lambda t: (-t.numel, t.key))
    return [(t.key, t.shape, t.numel) for t in tensors[:n]]


def logical_parameter_count(layout: Layout) -> int:
    return sum(t.numel for (k, kind), t in StateView(layout).tensors().items() if kind == "param")

