"""The math of TE's GEMM modules in plain torch: y = x W^T (+ b), with TP communication
around it, and the two normalisations TE fuses in front (forward only; autograd does the rest).
"""

from __future__ import annotations

import torch

from .._math import norm  # noqa: F401  (re-exported for the fused modules)
from ..distributed import column_input, row_output

GEMM_PARALLEL_MODES = ("row", "column", None)  # TE constants.py GemmParallelModes


def parallel_gemm(module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """One TP-aware GEMM as TE's Linear does it (linear.py forward): a column-parallel layer
    gathers (sequence parallel) or copies its input, a row-parallel one reduces its output;
    a row-parallel bias is added after the reduction (linear.py:1804-1809)."""
    mode, tp, sp, group = module.parallel_mode, module.tp_size, module.sequence_parallel, \
        module.tp_group
    if mode == "column":
        x = column_input(x, group, tp, sp)
    y = torch.matmul(x, weight.t())
    if mode == "row":
        y = row_output(y, group, tp, sp)
    if bias is not None and bias.numel():
        y = y + bias
    return y
