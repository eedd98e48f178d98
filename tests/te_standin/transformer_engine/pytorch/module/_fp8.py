"""fp8 GEMM operands on CPU: quantize-dequantize with torch's float8 dtypes.

A GEMM under fp8 casts its input (forward slot ``3k``), its weight (``3k+1``) and, in the
backward, the output gradient (backward slot ``2k``) to fp8 (TE linear.py:2082-2113; slots from
pytorch/csrc/common.h:76-97). With delayed scaling each cast uses the module's scale from
earlier steps and max-accumulates the tensor's amax into row 0 of its amax history
(cast/fp8/quantize_fp8.cuh:217-229); current scaling (and, in this stand-in, block and MX
scaling too) scales every tensor by its own amax and keeps no state. Values beyond the
format's largest are clamped to it (TE's conversion saturates). The first fp8 module of an
autocast updates the backward scales at the end of its backward (linear.py:1467-1470).
"""

from __future__ import annotations

import torch

from ..fp8 import (DelayedScalingRecipeState, FP8GlobalStateManager, get_fp8_max,
                   get_fp8_torch_dtype)


def _qdq(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fmax: float) -> torch.Tensor:
    q = torch.clamp(x.float() * scale, -fmax, fmax).to(dtype)
    return (q.float() * torch.reciprocal(scale)).to(x.dtype)


def _cast(x: torch.Tensor, meta: dict, forward: bool, slot: int) -> torch.Tensor:
    recipe = meta["recipe"]
    fmax, dtype = get_fp8_max(recipe, forward), get_fp8_torch_dtype(recipe, forward)
    state = meta["scaling_fwd" if forward else "scaling_bwd"]
    with torch.no_grad():
        amax = x.detach().abs().max().float() if x.numel() else torch.zeros(())
        if isinstance(state, DelayedScalingRecipeState):
            row = state.amax_history[0]
            row[slot] = torch.maximum(row[slot], amax)
            return _qdq(x, state.scale[slot], dtype, fmax)
        scale = torch.where(amax > 0, fmax / amax, torch.ones(()))
        return _qdq(x, scale, dtype, fmax)


class _Operand(torch.autograd.Function):
    """Forward: the fp8 input or weight; backward: its gradient passes through (the GEMM's
    own gradients are cast at ``_Output``). ``update_bwd`` marks the first module's weight,
    whose gradient is the last this module's backward produces."""

    @staticmethod
    def forward(ctx, x, meta, slot, update_bwd):
        ctx.update_bwd = update_bwd
        return _cast(x, meta, True, slot)

    @staticmethod
    def backward(ctx, grad):
        if ctx.update_bwd:
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        return grad, None, None, None


class _Output(torch.autograd.Function):
    """Forward: the GEMM's output unchanged; backward: the output gradient in fp8."""

    @staticmethod
    def forward(ctx, y, meta, slot):
        ctx.meta, ctx.slot = meta, slot
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return _cast(grad, ctx.meta, False, ctx.slot), None, None


def fp8_operands(module, x: torch.Tensor, weight: torch.Tensor, gemm: int = 0):
    """``x`` and ``weight`` as the GEMM ``gemm`` of ``module`` reads them under fp8."""
    meta = module.fp8_meta
    first = FP8GlobalStateManager.is_first_fp8_module() and torch.is_grad_enabled()
    delayed = isinstance(meta["scaling_fwd"], DelayedScalingRecipeState)
    return (_Operand.apply(x, meta, 3 * gemm, False),
            _Operand.apply(weight, meta, 3 * gemm + 1, first and delayed))


def fp8_output(module, y: torch.Tensor, gemm: int = 0) -> torch.Tensor:
    return _Output.apply(y, module.fp8_meta, 2 * gemm)
