"""``GroupedLinear`` (TE ``module/grouped_linear.py:1538-2512``): ``num_gemms`` linears that
each take a contiguous block of rows (``m_splits``) of one input.

Registration (grouped_linear.py:1738-1770): one loop over the GEMMs registers ``weight{i}``
[out, in] then, with a bias, ``bias{i}`` [out], so weights and biases interleave; without a
bias ``bias{i}`` is a plain empty tensor attribute. A bias with tp_size > 1 is refused
(:1717-1721). This TE version sets TP attributes only for the single grouped weight/bias
(:1978-2035, off unless ``NVTE_GROUPED_LINEAR_SINGLE_PARAM``); per-GEMM params get none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..utils import divide, get_default_init_method, init_method_constant
from ._gemm import GEMM_PARALLEL_MODES
from .base import TransformerEngineBaseModule
from .linear import _device, _reject_fused


class GroupedLinear(TransformerEngineBaseModule):
    """out[rows of GEMM i] = inp[rows of GEMM i] W_i^T + b_i."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1, get_rng_state_tracker: Callable | None = None,
                 rng_tracker_name: str | None = None, init_method: Callable | None = None,
                 bias: bool = True, return_bias: bool = False,
                 params_dtype: torch.dtype | None = None, parallel_mode: str | None = None,
                 device="cuda", single_grouped_weight: bool = False,
                 single_grouped_bias: bool = False, name: str | None = None,
                 save_original_input: bool = False, **unsupported) -> None:
        _reject_fused(unsupported)
        if single_grouped_weight or single_grouped_bias:
            raise NotImplementedError("single grouped weight/bias: not in the CPU stand-in")
        super().__init__(name)
        self.save_original_input = save_original_input  # grouped_linear.py:1655 (memory only)
        self.params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias = bias
        self.return_bias = return_bias
        self.apply_bias = bias and not return_bias
        self.single_grouped_weight = self.single_grouped_bias = False
        self.init_method = init_method
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        self._init_tp(tp_group, tp_size)
        if self.tp_size > 1 and bias:
            raise ValueError("GroupedLinear doesn't support bias when TP > 1. Because the TP "
                             "communication is handled outside of this module.")
        self.parallel_mode = parallel_mode
        if self.parallel_mode not in GEMM_PARALLEL_MODES:
            raise ValueError(f"parallel_mode {parallel_mode!r} not supported.")
        if self.parallel_mode == "column":
            self.out_features = divide(self.out_features, self.tp_size)
        elif self.parallel_mode == "row":
            self.in_features = divide(self.in_features, self.tp_size)
        self.sequence_parallel = (self.tp_size > 1) and sequence_parallel
        if init_method is None:
            init_method = get_default_init_method()
        device = _device(device)
        for i in range(self.num_gemms):  # grouped_linear.py:1738-1770
            self.register_parameter(
                f"weight{i}",
                torch.nn.Parameter(torch.empty(self.out_features, self.in_features,
                                               device=device, dtype=self.params_dtype)),
                init_fn=init_method, get_rng_state_tracker=get_rng_state_tracker,
                fp8_meta_index=1 + 3 * i)
            if self.use_bias:
                self.register_parameter(
                    f"bias{i}",
                    torch.nn.Parameter(torch.empty(self.out_features, device=device,
                                                   dtype=self.params_dtype)),
                    init_fn=init_method_constant(0.0))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=self.params_dtype,
                                                             device=device))
        self.reset_parameters(defer_init=str(device) == "meta")

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: bool | None = None):
        if self.tp_size > 1:
            raise NotImplementedError("GroupedLinear with TE-side TP communication: megatron "
                                      "always handles expert TP outside the module")
        self.init_fp8_metadata(num_gemms=self.num_gemms)
        if self.fp8:
            raise NotImplementedError("fp8 GroupedLinear: not in the CPU stand-in (DynaTrain "
                                      "refuses delayed scaling with experts)")
        m_splits = [int(m) for m in m_splits]
        if len(m_splits) != self.num_gemms:
            raise ValueError(f"Number of splits ({len(m_splits)}) should match number of "
                             f"GEMMs ({self.num_gemms}).")
        x = inp.reshape(-1, self.in_features)
        outs = []
        for i, part in enumerate(torch.split(x, m_splits)):
            y = torch.matmul(part, getattr(self, f"weight{i}").t())
            if self.apply_bias:
                y = y + getattr(self, f"bias{i}")
            outs.append(y)
        out = torch.cat(outs).view(*inp.shape[:-1], self.out_features)
        if self.return_bias:
            return out, [getattr(self, f"bias{i}").to(out.dtype) for i in range(self.num_gemms)]
        return out
