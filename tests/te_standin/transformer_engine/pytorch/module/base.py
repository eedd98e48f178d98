"""``TransformerEngineBaseModule`` (TE ``module/base.py``): the state every TE module carries.

What matters for layouts: parameters are registered through ``register_parameter`` with an
init function and then (re)initialised, in registration order, by ``reset_parameters``
(base.py:1791-1905), and ``get_extra_state`` is an empty uint8 tensor while fp8 is off
(base.py:1354-1393), so ``state_dict()`` holds ``<prefix>._extra_state`` for every TE module.

fp8: the first forward under an fp8 autocast records the recipe, the GEMM count and the format
maxima in ``fp8_meta`` and allocates each direction's recipe state (base.py:1106-1175,
1311-1316, 1528-1585); with delayed scaling that is ``scale`` (ones) and ``amax_history``
(zeros) for 3 forward and 2 backward tensors per GEMM, registered once in the global buffers
(base.py:1587-1641). ``get_extra_state`` then pickles the recipe, those four tensors and the
plain ``fp8_meta`` values; ``set_extra_state`` restores them (base.py:1354-1480). Stateless
recipes (current, block and MX scaling) save an empty tensor (base.py:1391-1393).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pickle

import torch

from ..distributed import get_distributed_world_size
from ..fp8 import DelayedScalingRecipeState, FP8GlobalStateManager, StatelessRecipeState
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
        """base.py:1528-1585: fp8 on -> recipe, GEMM count, group, format maxima and the
        recipe state (once per recipe); fp8 off -> ``fp8_initialized`` False, state kept."""
        meta = self.fp8_meta
        fp8 = FP8GlobalStateManager.is_fp8_enabled()
        self.fast_setattr("fp8_parameters", FP8GlobalStateManager.with_fp8_parameters())
        self.fast_setattr("fp8", fp8)
        self.fast_setattr("fp8_calibration", False)
        meta["fp8_checkpoint"] = fp8
        if not fp8:
            self.fast_setattr("fp8_initialized", False)
            return
        original = meta.get("recipe", None)
        if self.fp8_initialized and FP8GlobalStateManager.get_fp8_recipe() == original:
            return
        meta["recipe"] = FP8GlobalStateManager.get_fp8_recipe()
        meta["num_gemms"] = num_gemms
        meta["fp8_group"] = FP8GlobalStateManager.get_fp8_group()
        meta["fp8_max_fwd"] = meta["recipe"].fp8_format.value.max_fwd
        meta["fp8_max_bwd"] = meta["recipe"].fp8_format.value.max_bwd
        self.init_fp8_meta_tensors(meta["recipe"])
        self.fast_setattr("fp8_initialized", True)
        meta["recipe"] = FP8GlobalStateManager.get_fp8_recipe()

    def set_meta_tensor(self, fwd: bool, recipe) -> None:
        """base.py:1106-1175: the direction's recipe state; an existing delayed-scaling state
        is kept (its tensors are what the global buffers and a loaded checkpoint hold)."""
        key = "scaling_fwd" if fwd else "scaling_bwd"
        old = self.fp8_meta.get(key)
        if self.fp8_meta_tensors_initialized and recipe.delayed() and \
                isinstance(old, DelayedScalingRecipeState):
            if old.amax_history.shape[0] != recipe.amax_history_len:
                raise NotImplementedError("changing amax_history_len: not in the CPU stand-in")
            return
        n = self.fp8_meta["num_gemms"] * (3 if fwd else 2)
        mode = "forward" if fwd else "backward"
        if recipe.delayed():
            state = DelayedScalingRecipeState(recipe, mode, n)
            if isinstance(old, DelayedScalingRecipeState) and \
                    old.amax_history.shape == state.amax_history.shape:
                state.scale, state.amax_history = old.scale, old.amax_history  # inherit_state_from
        else:
            state = StatelessRecipeState(recipe, mode, n)
        self.fp8_meta[key] = state

    def init_fp8_meta_tensors(self, recipe) -> None:
        """base.py:1311-1316."""
        self.set_meta_tensor(True, recipe)
        self.set_meta_tensor(False, recipe)
        self.fast_setattr("fp8_meta_tensors_initialized", True)

    def prepare_forward(self, inp: torch.Tensor, num_gemms: int = 1) -> torch.Tensor:
        """base.py:1587-1641 (no activation recompute): fp8 metadata, then the module's
        delayed-scaling tensors into the global buffers."""
        self.init_fp8_metadata(num_gemms=num_gemms)
        if self.fp8 and isinstance(self.fp8_meta.get("scaling_fwd"), DelayedScalingRecipeState):
            if self.sequence_parallel:
                assert self.fp8_meta["recipe"].reduce_amax, (
                    "Amax reduction across tensor parallel group is necessary when using "
                    "sequence parallelism with FP8.")
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(self.fp8_meta)
        return inp

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
        """base.py:1354-1417: empty without fp8 or with a stateless recipe; otherwise the
        pickled recipe, the delayed-scaling tensors and the plain ``fp8_meta`` values."""
        if not (self.fp8_meta["fp8_checkpoint"] or self.fp8 or self.fp8_calibration):
            return torch.empty(0, dtype=torch.uint8)
        recipe = self.fp8_meta["recipe"]
        if not recipe.delayed():  # is_stateless_recipe (base.py:1391-1393)
            return torch.empty(0, dtype=torch.uint8)
        state = {"recipe": recipe}
        fwd, bwd = self.fp8_meta["scaling_fwd"], self.fp8_meta["scaling_bwd"]
        state["scale_fwd"] = fwd.scale.clone()
        state["amax_history_fwd"] = fwd.amax_history.clone()
        state["scale_bwd"] = bwd.scale.clone()
        state["amax_history_bwd"] = bwd.amax_history.clone()
        state["extra_fp8_variables"] = {
            k: v for k, v in self.fp8_meta.items()
            if k != "buffer_index_and_autocast_key"
            and isinstance(v, (bool, int, float, str, tuple, list))}
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """base.py:1419-1480: None or an empty tensor carries nothing; otherwise the plain
        values and the recipe go back into ``fp8_meta``, the recipe state is (re)allocated
        and the four tensors are copied in. (Test-only code: it unpickles what this process's
        own ``get_extra_state`` wrote into a checkpoint.)"""
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        state = pickle.loads(state.detach().cpu().numpy().tobytes())
        self.fp8_meta.update(state["extra_fp8_variables"])
        self.fp8_meta["recipe"] = state["recipe"]
        self.init_fp8_meta_tensors(self.fp8_meta["recipe"])
        fwd, bwd = self.fp8_meta["scaling_fwd"], self.fp8_meta["scaling_bwd"]
        fwd.scale.copy_(state["scale_fwd"])
        fwd.amax_history.copy_(state["amax_history_fwd"])
        bwd.scale.copy_(state["scale_bwd"])
        bwd.amax_history.copy_(state["amax_history_bwd"])
