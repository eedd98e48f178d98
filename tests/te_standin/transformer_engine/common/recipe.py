"""Quantization recipes (TE ``common/recipe/__init__.py``).

As in TE, the recipes are pydantic dataclasses (recipe/__init__.py:12), which ignore keyword
arguments they do not declare: megatron-core's ``TEDelayedScaling`` passes ``params_dtype``,
``device`` and ``override_linear_precision`` through (M16 extensions/transformer_engine.py:
2191-2224), and TE >= 2.0 drops them this way. ``Format`` carries each format's largest value
(recipe/__init__.py:20-50), which the delayed-scaling update divides by the amax.
"""

from __future__ import annotations

import enum
from typing import Literal, NamedTuple

from pydantic.dataclasses import dataclass


class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """FP8 formats and their largest values (recipe/__init__.py:29-50)."""

    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


class Recipe:
    """Base of the recipes; the predicates TE's modules ask (recipe/__init__.py:107-171)."""

    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def mxfp8(cls) -> bool:
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def nvfp4(cls) -> bool:
        return False

    @classmethod
    def custom(cls) -> bool:
        return False


@dataclass(repr=False)
class DelayedScaling(Recipe):
    """recipe/__init__.py:173-283: scales from the amax history of earlier steps."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."

    def __repr__(self) -> str:
        # recipe/__init__.py:272-282; the autocast key is built from it
        return (f"recipe_type={type(self).__name__}, margin={self.margin}, "
                f"format={str(self.fp8_format).split('.')[1]}, "
                f"amax_history_len={self.amax_history_len}, reduce_amax={self.reduce_amax}, "
                f"fp8_dpa={self.fp8_dpa}, fp8_mha={self.fp8_mha}, backward_override=None")


@dataclass(repr=False)
class Float8CurrentScaling(Recipe):
    """recipe/__init__.py:286-334: each tensor scaled by its own current amax (no state)."""

    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __repr__(self) -> str:
        return (f"recipe_type={type(self).__name__}, "
                f"format={str(self.fp8_format).split('.')[1]}")


@dataclass(repr=False)
class MXFP8BlockScaling(Recipe):
    """recipe/__init__.py:337-389: per-32-element block scales (no state)."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __repr__(self) -> str:
        return (f"recipe_type={type(self).__name__}, "
                f"format={str(self.fp8_format).split('.')[1]}")


@dataclass(repr=False)
class Float8BlockScaling(Recipe):
    """recipe/__init__.py:392-486: 1x128 / 128x128 block scales (no state)."""

    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __repr__(self) -> str:
        return (f"recipe_type={type(self).__name__}, "
                f"format={str(self.fp8_format).split('.')[1]}")
