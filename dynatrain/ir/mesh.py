"""Rank <-> coordinates, the way megatron-core's ``RankGenerator`` numbers ranks.

Order tokens run fastest to slowest: ``rank = sum(idx_k * prod(size_j for j before k))``. The
dense grid has (tp, cp, ep=1, dp, pp); the expert grid reuses the same ranks as (etp, cp=1, ep,
edp, pp). A group's rank is the position of a rank in the ascending list of its group's members.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True, slots=True)
class Grid:
    """A named rank grid: sizes per token, in an order from fastest to slowest."""

    order: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, order: str, **sizes: int) -> "Grid":
        tokens = tuple(order.split("-"))
        return cls(tokens, tuple(sizes[t] for t in tokens))

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    def strides(self) -> tuple[int, ...]:
        out, acc = [], 1
        for s in self.sizes:
            out.append(acc)
            acc *= s
        return tuple(out)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of ``rank`` on every token."""
        out = {}
        for t, s in zip(self.order, self.sizes):
            out[t] = rank % s
            rank //= s
        return out

    def rank(self, **coords: int) -> int:
        return sum(coords[t] * st for t, st in zip(self.order, self.strides()))

    def group(self, rank: int, tokens: tuple[str, ...]) -> tuple[int, ...]:
        """Ascending ranks that differ from ``rank`` only in ``tokens``."""
        c = self.coords(rank)
        members = [0]
        for t, s, st in zip(self.order, self.sizes, self.strides()):
            if t in tokens:
                members = [m + i * st for i in range(s) for m in members]
            else:
                members = [m + c[t] * st for m in members]
        return tuple(sorted(members))

    def group_rank(self, rank: int, tokens: tuple[str, ...]) -> int:
        """Position of ``rank`` in its group over ``tokens`` (faster tokens vary faster)."""
        c, pos, acc = self.coords(rank), 0, 1
        for t, s in zip(self.order, self.sizes):
            if t in tokens:
                pos += c[t] * acc
                acc *= s
        return pos


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Every coordinate of one rank, dense and expert."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int
    dp_cp: int  # rank in the data-parallel-with-context group (optimizer sharding, dense)

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Mesh:
    """Dense and expert grids over the same ``world`` ranks."""

    order: str
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int

    @cached_property
    def dense(self) -> Grid:
        return Grid.of(self.order, tp=self.tp, cp=self.cp, ep=1, dp=self.dp, pp=self.pp)

    @cached_property
    def expert(self) -> Grid:
        return Grid.of(self.order, tp=self.etp, cp=1, ep=self.ep, dp=self.edp, pp=self.pp)

    @property
    def world(self) -> int:
        return self.dense.world

    def coords(self, rank: int) -> RankCoords:
        d, e = self.dense.coords(rank), self.expert.coords(rank)
        return RankCoords(
            rank=rank, tp=d["tp"], cp=d["cp"], dp=d["dp"], pp=d["pp"], ep=e["ep"],
            etp=e["tp"], edp=e["dp"], dp_cp=self.dense.group_rank(rank, ("cp", "dp")),
        )

    def groups(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Megatron's process groups of ``rank`` by name."""
        return {
            "tp": self.dense.group(rank, ("tp",)),
            "pp": self.dense.group(rank, ("pp",)),
            "dp": self.dense.group(rank, ("dp",)),
            "cp": self.dense.group(rank, ("cp",)),
            "dp_cp": self.dense.group(rank, ("cp", "dp")),
            "ep": self.expert.group(rank, ("ep",)),
            "etp": self.expert.group(rank, ("tp",)),
            "edp": self.expert.group(rank, ("dp",)),
        }
