"""Quantization recipe records (TE ``common/recipe/__init__.py``), as plain data.

megatron-core only names these (``isinstance(..., DelayedScaling)`` when splitting a grouped
linear's fp8 state); the stand-in never quantizes, so none of them changes any computation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Format(enum.Enum):
    """FP8 formats (names as in TE)."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


class Recipe:
    """Base of the recipes; the predicates TE's modules ask."""

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def nvfp4(self) -> bool:
        return False

    def custom(self) -> bool:
        return False


@dataclass
class DelayedScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass
class Float8CurrentScaling(Recipe):
    fp8_format: Format = Format.HYBRID


@dataclass
class MXFP8BlockScaling(Recipe):
    fp8_format: Format = Format.E4M3


@dataclass
class Float8BlockScaling(Recipe):
    fp8_format: Format = Format.E4M3
