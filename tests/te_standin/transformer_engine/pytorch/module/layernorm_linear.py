"""``LayerNormLinear`` (TE ``module/layernorm_linear.py:1207-2003``): a norm fused in front of
a (column-parallel) linear.

Registration order: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only; RMSNorm sets
the attribute to None) (layernorm_linear.py:1449-1465), then ``weight`` and ``bias`` as in
``Linear`` (layernorm_linear.py:1540-1571). TP attributes (layernorm_linear.py:1648-1672): the
norm params only get ``sequence_parallel`` (kept only when tp_size > 1, :1383); weight and
bias as in ``Linear``. Row parallelism is refused (:1370-1373).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..distributed import set_tensor_model_parallel_attributes
from ..utils import divide, get_default_init_method, init_method_constant
from ._gemm import GEMM_PARALLEL_MODES, norm, parallel_gemm
from .base import TransformerEngineBaseModule
from .linear import _device, _reject_fused


class LayerNormLinear(TransformerEngineBaseModule):
    """y = norm(x) W^T + b."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1, get_rng_state_tracker: Callable | None = None,
                 init_method: Callable | None = None, bias: bool = True,
                 normalization: str = "LayerNorm", return_bias: bool = False,
                 params_dtype: torch.dtype | None = None, parallel_mode: str | None = None,
                 return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False, parameters_split=None,
                 zero_centered_gamma: bool = False, device="cuda", name: str | None = None,
                 rng_tracker_name: str | None = None, **unsupported) -> None:
        _reject_fused(unsupported)
        if parameters_split is not None or return_layernorm_output_gathered:
            raise NotImplementedError("parameters_split / gathered norm output: not used here")
        super().__init__(name)
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.normalization = normalization
        assert normalization in ["LayerNorm", "RMSNorm"], "Unsupported normalization type!"
        self.use_bias = bias
        self.return_bias = return_bias
        self.apply_bias = self.use_bias and not return_bias
        self.return_layernorm_output = return_layernorm_output
        self.zero_centered_gamma = zero_centered_gamma
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        self._init_tp(tp_group, tp_size)
        self.parallel_mode = parallel_mode
        assert self.parallel_mode in GEMM_PARALLEL_MODES, \
            f"parallel_mode {parallel_mode} not supported"
        if self.parallel_mode == "row":
            raise NotImplementedError("Normalization does not support tensor-parallel "
                                      "distribution.")
        if self.parallel_mode == "column":
            self.out_features = divide(self.out_features, self.tp_size)
        if init_method is None:
            init_method = get_default_init_method()
        self.sequence_parallel = (self.tp_size > 1) and sequence_parallel
        self.eps = eps
        device = _device(device)
        # layernorm_linear.py:1449-1465
        self.register_parameter(
            "layer_norm_weight",
            torch.nn.Parameter(torch.empty(self.in_features, device=device, dtype=params_dtype)),
            init_fn=init_method_constant(float(not self.zero_centered_gamma)))
        if self.normalization != "RMSNorm":
            self.register_parameter(
                "layer_norm_bias",
                torch.nn.Parameter(torch.empty(self.in_features, device=device,
                                               dtype=params_dtype)),
                init_fn=init_method_constant(0.0))
        else:
            self.layer_norm_bias = None
        self.weight_names, self.bias_names = ["weight"], ["bias"]
        self.register_parameter(
            "weight", torch.nn.Parameter(torch.empty(self.out_features, self.in_features,
                                                     device=device, dtype=params_dtype)),
            init_fn=init_method, get_rng_state_tracker=get_rng_state_tracker, fp8_meta_index=1)
        if self.use_bias:
            self.register_parameter(
                "bias", torch.nn.Parameter(torch.empty(self.out_features, device=device,
                                                       dtype=params_dtype)),
                init_fn=init_method_constant(0.0))
        else:  # layernorm_linear.py:1568-1571
            self.bias = torch.Tensor().to(dtype=params_dtype, device=device)
        self.reset_parameters(defer_init=str(device) == "meta")

    def reset_parameters(self, defer_init: bool = False) -> None:
        """layernorm_linear.py:1648-1672."""
        super().reset_parameters(defer_init=defer_init)
        if defer_init:
            return
        self.layer_norm_weight.sequence_parallel = self.sequence_parallel
        if self.normalization != "RMSNorm":
            self.layer_norm_bias.sequence_parallel = self.sequence_parallel
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        if self.use_bias and self.parallel_mode == "column":
            set_tensor_model_parallel_attributes(self.bias, True, 0, 1)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None,
                fp8_output: bool = False, fp8_grad: bool = False):
        ln_out = norm(inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias,
                      self.eps, self.zero_centered_gamma)
        out = parallel_gemm(self, ln_out, self.weight, self.bias if self.apply_bias else None)
        outs = [out]
        if self.return_bias:
            outs.append(self.bias.to(out.dtype))
        if self.return_layernorm_output:
            outs.append(ln_out)
        return tuple(outs) if len(outs) > 1 else out
