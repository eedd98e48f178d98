"""TE's operation-based API (``ops/``), the part TE's norm modules are built on.

``LayerNorm`` registers ``weight`` then ``bias`` (ops/basic/layer_norm.py:100-117),
``RMSNorm`` only ``weight`` (ops/basic/rmsnorm.py:101-107); both initialise gamma to ones (zeros
when zero-centered) and beta to zeros (layer_norm.py:144-175, rmsnorm.py:134-160). An op with no
quantizer state saves an empty uint8 ``_extra_state`` (ops/op.py:632-703).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .._math import norm


class FusibleOperation(torch.nn.Module):
    """ops/op.py:59."""


class BasicOperation(FusibleOperation):
    """ops/op.py:176; fp8 off, so no quantizer state."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)  # ops/op.py:702-703

    def set_extra_state(self, state) -> None:
        if state is not None and (not isinstance(state, torch.Tensor) or state.numel()):
            raise NotImplementedError("quantizer state: not available in the CPU stand-in")


class Sequential(torch.nn.Module):
    """ops/sequential.py: ops applied in order (megatron's op-fuser MLP builds one)."""

    def __init__(self, *ops: torch.nn.Module) -> None:
        super().__init__()
        self._ops = torch.nn.ModuleList(ops)

    def append(self, op: torch.nn.Module) -> None:
        self._ops.append(op)

    def forward(self, x):
        for op in self._ops:
            x = op(x)
        return x


def _shape(normalized_shape) -> tuple[int, ...]:
    if not isinstance(normalized_shape, Iterable):
        return (normalized_shape,)
    return tuple(normalized_shape)


def _dtype(dtype):
    return torch.get_default_dtype() if dtype is None else dtype


def _dev(device):
    return torch.device("cpu") if device in (None, "cuda") or isinstance(device, int) else device


class LayerNorm(BasicOperation):
    """ops/basic/layer_norm.py:34-175."""

    def __init__(self, normalized_shape, *, eps: float = 1e-5, device=None, dtype=None,
                 zero_centered_gamma: bool = False, sm_margin=0) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        shape, device, dtype = _shape(normalized_shape), _dev(device), _dtype(dtype)
        self.register_parameter("weight", torch.nn.Parameter(torch.empty(shape, device=device,
                                                                         dtype=dtype)))
        self.register_parameter("bias", torch.nn.Parameter(torch.empty(shape, device=device,
                                                                       dtype=dtype)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            (torch.nn.init.zeros_ if self.zero_centered_gamma else torch.nn.init.ones_)(
                self.weight)
            torch.nn.init.zeros_(self.bias)

    def forward(self, x):
        return norm(x, "LayerNorm", self.weight, self.bias, self.eps, self.zero_centered_gamma)


class RMSNorm(BasicOperation):
    """ops/basic/rmsnorm.py:34-160."""

    def __init__(self, normalized_shape, *, eps: float = 1e-5, device=None, dtype=None,
                 zero_centered_gamma: bool = False, sm_margin=0) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        shape, device, dtype = _shape(normalized_shape), _dev(device), _dtype(dtype)
        self.register_parameter("weight", torch.nn.Parameter(torch.empty(shape, device=device,
                                                                         dtype=dtype)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            (torch.nn.init.zeros_ if self.zero_centered_gamma else torch.nn.init.ones_)(
                self.weight)

    def forward(self, x):
        return norm(x, "RMSNorm", self.weight, None, self.eps, self.zero_centered_gamma)
