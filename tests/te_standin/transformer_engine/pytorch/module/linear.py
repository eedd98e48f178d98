"""``Linear`` (TE ``module/linear.py:1525-2237``).

Registration order (linear.py:1741-1800): every weight (``weight``), then every bias
(``bias``); without a bias, ``bias`` is a plain empty tensor attribute, not a parameter
(linear.py:1795-1798). TP attributes (linear.py:1851-1870): weights TMP with dim 1 for row
and 0 otherwise, stride 1; a column bias TMP dim 0; a row bias only gets
``sequence_parallel``. ``sequence_parallel`` is kept only when tp_size > 1 (linear.py:1627).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..distributed import set_tensor_model_parallel_attributes
from ..utils import divide, get_default_init_method, init_method_constant
from ._gemm import GEMM_PARALLEL_MODES, parallel_gemm
from .base import TransformerEngineBaseModule


class Linear(TransformerEngineBaseModule):
    """y = x W^T + b, with TE's column/row tensor parallelism."""

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Callable | None = None,
                 rng_tracker_name: str | None = None, init_method: Callable | None = None,
                 bias: bool = True, return_bias: bool = False,
                 params_dtype: torch.dtype | None = None,
                 parallel_mode: str | None = None, parameters_split=None,
                 device="cuda", name: str | None = None, save_original_input: bool = False,
                 **unsupported) -> None:
        _reject_fused(unsupported)
        if parameters_split is not None:
            raise NotImplementedError("parameters_split: not used by megatron-core")
        super().__init__(name)
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        # linear.py:1592-1601
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias = bias
        self.return_bias = return_bias
        self.apply_bias = bias and not return_bias
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        # linear.py:1602: keep the unquantized input for the backward (memory only; the
        # stand-in's autograd keeps what it keeps); megatron sets it on linear_proj and
        # shared experts under fp8 (M16 extensions/transformer_engine.py:2501-2518).
        self.save_original_input = save_original_input
        # linear.py:1608-1625
        self._init_tp(tp_group, tp_size)
        self.parallel_mode = parallel_mode
        assert self.parallel_mode in GEMM_PARALLEL_MODES, \
            f"parallel_mode {parallel_mode} not supported"
        if self.parallel_mode == "column":
            self.out_features = divide(self.out_features, self.tp_size)
        elif self.parallel_mode == "row":
            self.in_features = divide(self.in_features, self.tp_size)
        self.sequence_parallel = (self.tp_size > 1) and sequence_parallel  # linear.py:1627
        if init_method is None:
            init_method = get_default_init_method()
        device = _device(device)
        # linear.py:1697-1709: one buffer each; the params are (whole) views of them
        weight_tensor = torch.empty(self.out_features, self.in_features, device=device,
                                    dtype=params_dtype)
        self.weight_names, self.bias_names = ["weight"], ["bias"]  # linear.py:1713-1718
        self.register_parameter("weight", torch.nn.Parameter(weight_tensor),
                                init_fn=init_method, get_rng_state_tracker=get_rng_state_tracker,
                                fp8_meta_index=1)  # linear.py:1774-1780 (GEMM1_WEIGHT)
        if self.use_bias:  # linear.py:1783-1794
            self.register_parameter(
                "bias", torch.nn.Parameter(torch.empty(self.out_features, device=device,
                                                       dtype=params_dtype)),
                init_fn=init_method_constant(0.0))
        else:  # linear.py:1795-1798
            self.bias = torch.Tensor().to(dtype=params_dtype, device=device)
        self.reset_parameters(defer_init=str(device) == "meta")
        self.gemm_bias_unfused_add = self.parallel_mode == "row" and self.apply_bias

    def reset_parameters(self, defer_init: bool = False) -> None:
        """linear.py:1851-1870."""
        super().reset_parameters(defer_init=defer_init)
        if defer_init:
            return
        set_tensor_model_parallel_attributes(self.weight, True,
                                             1 if self.parallel_mode == "row" else 0, 1)
        if self.use_bias:
            if self.parallel_mode == "row":
                self.bias.sequence_parallel = self.sequence_parallel
            elif self.parallel_mode == "column":
                set_tensor_model_parallel_attributes(self.bias, True, 0, 1)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None,
                fp8_output: bool = False, fp8_grad: bool = False):
        """TE returns ``(out, bias)`` when ``return_bias`` and ``out`` otherwise."""
        out = parallel_gemm(self, inp, self.weight, self.bias if self.apply_bias else None)
        if self.return_bias:
            return out, self.bias.to(out.dtype)
        return out


def _device(device):
    # megatron passes "cpu" (use_cpu_initialization) or the current CUDA device, which the
    # test shim maps to "cpu".
    return torch.device("cpu") if device in (None, "cuda") or isinstance(device, int) else device


def _reject_fused(kwargs: dict) -> None:
    """Userbuffer overlap, delayed wgrad and symmetric all-reduce are GPU paths the stand-in
    does not have; megatron passes them only when asked for, mostly as False/None."""
    on = {k: v for k, v in kwargs.items()
          if v not in (None, False) and k not in ("ub_name", "symmetric_ar_type")}
    if on:
        raise NotImplementedError(f"CPU stand-in of Transformer Engine: unsupported {on}")
    if kwargs.get("symmetric_ar_type") is not None:
        raise NotImplementedError("symmetric_ar_type: not available in the CPU stand-in")
