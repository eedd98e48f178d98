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



# Words, not "k/M/B": every size in dynatrain's output is in bytes ("512 B", "1.2 MiB"), so
# "70.6 B parameters" reads as 70.6 bytes and "1.2 M" as a megabyte.
_COUNT_SCALES = ((10**3, "thousand"), (10**6, "million"), (10**9, "billion"),
                 (10**12, "trillion"))


def format_count(n: int) -> str:
    """A count of things (parameters, elements) for people: ``834``, ``12.3 thousand``,
    ``1.2 million``, ``70.6 billion``, ``1.5 trillion``.

    Counts below 1000 are exact; larger ones get one decimal in the largest scale that keeps
    the number below 1000 once rounded (``999_999`` is ``1.0 million``, not ``1000.0
    thousand``). Scale words rather than ``k``/``M``/``B`` because ``B`` means bytes everywhere
    else in dynatrain's output.

    Example:
        >>> format_count(70_553_706_496)
        '70.6 billion'
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"format_count needs an int (got {type(n).__name__})")
    sign, m = ("-" if n < 0 else ""), abs(n)
    if m < 1000:
        return f"{sign}{m}"
    for scale, word in _COUNT_SCALES:
        text = f"{m / scale:.1f}"
        if float(text) < 1000 or word == _COUNT_SCALES[-1][1]:
            return f"{sign}{text} {word}"
    raise AssertionError("unreachable")
