"""Axis-aligned boxes in a logical tensor's global coordinate space (half-open)."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from operator import add, ge, sub


@dataclass(frozen=True, slots=True, order=True)
class Box:
    """The region ``[lo, hi)`` of a logical tensor, one interval per dimension."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @classmethod
    def of(cls, offset: tuple[int, ...], shape: tuple[int, ...]) -> "Box":
        return cls(tuple(offset), tuple(map(add, offset, shape)))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(map(sub, self.hi, self.lo))

    @property
    def numel(self) -> int:
        return prod(map(sub, self.hi, self.lo))  # 1 for a 0-d box, as the empty product

    def __and__(self, other: "Box") -> "Box | None":
        lo = tuple(map(max, self.lo, other.lo))
        hi = tuple(map(min, self.hi, other.hi))
        return None if any(map(ge, lo, hi)) else new_box(lo, hi)

    def meets(self, other: "Box") -> bool:
        """Whether the two boxes overlap (``self & other`` is not None, without building it)."""
        return all(a < d and c < b for a, b, c, d in zip(self.lo, self.hi, other.lo, other.hi))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{l}:{h}" for l, h in zip(self.lo, self.hi)) + "]"


_alloc = object.__new__
_set_lo, _set_hi = Box.lo.__set__, Box.hi.__set__  # the slots' own setters


def new_box(lo: tuple[int, ...], hi: tuple[int, ...]) -> Box:
    """``Box(lo, hi)`` for the planner's inner loops, ``lo`` and ``hi`` already tuples: the
    same object, set through its slots instead of the frozen dataclass's ``__init__`` (about
    half the time; a plan cuts millions of boxes at 98304 GPUs)."""
    b = _alloc(Box)
    _set_lo(b, lo)
    _set_hi(b, hi)
    return b
