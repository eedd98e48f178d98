"""fp8 global state (TE ``quantization.py``): always off in the stand-in.

``fp8_autocast(enabled=False)`` is accepted (megatron-core opens it around every TE forward);
``enabled=True`` raises, since nothing here can quantize.
"""

from __future__ import annotations

import contextlib

from ..common.recipe import DelayedScaling, Recipe


class FP8GlobalStateManager:
    """The queries megatron-core and TE's modules make; fp8 is never enabled."""

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return False

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return False

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return False

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return False

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        return False

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        return DelayedScaling()

    @classmethod
    def get_fp8_group(cls):
        return None

    @classmethod
    def is_fp8_available(cls) -> tuple[bool, str]:
        return False, "the CPU stand-in of Transformer Engine has no fp8"


@contextlib.contextmanager
def fp8_autocast(enabled: bool = False, calibrating: bool = False, fp8_recipe=None,
                 fp8_group=None, _graph: bool = False):
    """A no-op context when fp8 is off; fp8 itself is not available."""
    if enabled or calibrating:
        raise NotImplementedError("the CPU stand-in of Transformer Engine cannot run fp8")
    yield


autocast = fp8_autocast


@contextlib.contextmanager
def fp8_model_init(enabled: bool = False, recipe=None, preserve_high_precision_init_val=False):
    """TE ``quantization.py`` ``fp8_model_init``: parameters created in fp8 when enabled; the
    stand-in has no fp8, so only the disabled form is accepted."""
    if enabled:
        raise NotImplementedError("the CPU stand-in of Transformer Engine cannot hold fp8 params")
    yield


quantized_model_init = fp8_model_init
