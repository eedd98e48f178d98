"""The math of TE's GEMM modules in plain torch: y = x W^T (+ b), with TP communication
around it, and the two normalisations TE fuses in front (forward only; autograd does the rest).
"""

from __future__ import annotations

import torch

from .._math import norm  # noqa: F401  (re-exported for the fused modules)
from ..distributed import column_input, row_output
from ._fp8 import fp8_operands, fp8_output

GEMM_PARALLEL_MODES = ("row", "column", None)  # TE constants.py GemmParallelModes


def parallel_gemm(module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """One TP-aware GEMM as TE's Linear does it (linear.py forward): a column-parallel layer
    gathers (sequence parallel) or copies its input, a row-parallel one reduces its output;
    a row-parallel bias is added after the reduction (linear.py:1804-1809). Under an fp8
    autocast the GEMM reads fp8 operands (``_fp8.py``)."""
    mode, tp, sp, group = module.parallel_mode, module.tp_size, module.sequence_parallel, \
        module.tp_group
    if mode == "column":
        x = column_input(x, group, tp, sp)
    x = module.prepare_forward(x, num_gemms=1)
    if module.fp8:  # operands and output gradient in fp8 (module/_fp8.py)
        x, weight = fp8_operands(module, x, weight)
        y = fp8_output(module, torch.matmul(x, weight.t()))
    else:
        y = torch.matmul(x, weight.t())
    if mode == "row":
        y = row_output(y, group, tp, sp)
    if bias is not None and bias.numel():
        y = y + bias
    return y
