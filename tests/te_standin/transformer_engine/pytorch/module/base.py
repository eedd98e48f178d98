"""``TransformerEngineBaseModule`` (TE ``module/base.py``): the state every TE module carries.

What matters for layouts: parameters are registered through ``register_parameter`` with an
init function and then (re)initialised, in registration order, by ``reset_parameters``
(base.py:1791-1905), and ``get_extra_state`` is an empty uint8 tensor while fp8 is off
(base.py:1354-1393), so ``state_dict()`` holds ``<prefix>._extra_state`` for every TE module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed import get_distributed_world_size
from ..fp8 import FP8GlobalStateManager
from ..utils import get_default_init_method


@dataclass
class _ParameterInitMeta:
    """module/_common.py:234-246: how ``reset_parameters`` initialises one parameter."""

    init_fn: Callable | None = None
    get_rng_state_tracker: Callable | None = None
    fp8_meta_index: int | None = None

    def __post_init__(self) -> None:
        if self.init_fn is None:
            self.init_fn = get_default_init_method()


class TransformerEngineBaseModule(torch.nn.Module):
    """base.py:890-1905, CPU and fp8-off only."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        # base.py:897-920 (TE raises without CUDA at :895; the stand-in runs on CPU)
        self.name = name
        self.fp8_initialized = False
        self.fp8 = False
        self.fp8_calibration = False
        self.fp8_meta: dict[str, Any] = {"fp8_checkpoint": False, "fp8_group": None}
        self.fp8_meta_tensors_initialized = False
        self.quantizers = {"scaling_fwd": [], "scaling_bwd": []}
        self.tp_group = None
        self.tp_size = 1
        self.sequence_parallel = False
        self.param_init_meta: dict[str, _ParameterInitMeta] = {}
        self.primary_weights_in_fp8 = FP8GlobalStateManager.with_fp8_parameters()
        self.preserve_high_precision_init_val = False
        self.fsdp_wrapped = False
        self.fsdp_group = None
        self.activation_dtype: torch.dtype | None = None
        self.wgrad_accumulation_and_reduce_hooks: list = []

    def fast_setattr(self, name: str, value: Any) -> None:
        """base.py:926-931."""
        self.__dict__[name] = value

    def module_setattr(self, name: str, value: Any) -> None:
        """base.py:933-939."""
        super().__setattr__(name, value)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """base.py:1503-1514."""
        self.fast_setattr("tp_group", tp_group)
        self.fast_setattr("tp_group_initialized", True)

    def _init_tp(self, tp_group, tp_size: int) -> None:
        """The TP size and group as every TE linear's constructor sets them (linear.py:
        1608-1625, layernorm_linear.py and grouped_linear.py alike)."""
        if tp_group is None:
            self.tp_size = tp_size
            if tp_size == 1:
                self.set_tensor_parallel_group(tp_group)
        else:
            self.tp_size = get_distributed_world_size(tp_group)
            self.set_tensor_parallel_group(tp_group)

    def set_nccl_overlap_warning_if_tp(self) -> None:
        """No userbuffer overlap exists here; nothing to warn about."""

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """base.py:1528-1540 with fp8 off: the flags stay False."""
        self.fast_setattr("fp8_parameters", False)
        self.fast_setattr("fp8", False)
        self.fast_setattr("fp8_calibration", False)

    def register_parameter(self, name: str, param, **kwargs) -> None:
        """base.py:1791-1802: register, and remember how to initialise it (once)."""
        super().register_parameter(name, param)
        if hasattr(self, "param_init_meta") and name not in self.param_init_meta:
            self.param_init_meta[name] = _ParameterInitMeta(**kwargs)

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        """base.py:1804-1905: initialise every own parameter in registration order, under
        the RNG tracker when one is given, and re-wrap it as a fresh ``Parameter``."""
        if defer_init:
            return
        for name, param in self.named_parameters(recurse=False):
            meta = self.param_init_meta[name]
            with torch.no_grad():
                if meta.get_rng_state_tracker is None:
                    meta.init_fn(param)
                elif getattr(self, "rng_tracker_name", None):
                    with meta.get_rng_state_tracker().fork(self.rng_tracker_name):
                        meta.init_fn(param)
                else:
                    with meta.get_rng_state_tracker().fork():
                        meta.init_fn(param)
            self.module_setattr(name, torch.nn.Parameter(param))

    def get_extra_state(self) -> torch.Tensor:
        """base.py:1385-1389: no fp8 state to save -> an empty uint8 tensor."""
        if self.fp8_meta["fp8_checkpoint"] or self.fp8 or self.fp8_calibration:
            raise NotImplementedError("fp8 state: not available in the CPU stand-in")
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """base.py:1419-1431: None or an empty tensor carries nothing to load."""
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        raise NotImplementedError("loading fp8 extra state: not available in the CPU stand-in")
