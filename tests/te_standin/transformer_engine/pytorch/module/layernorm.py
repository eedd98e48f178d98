"""``LayerNorm`` and ``RMSNorm`` modules (TE ``module/layernorm.py``, ``module/rmsnorm.py``):
the ops plus the legacy ``sequence_parallel`` flag, which is set on the params whenever it is
given (module/layernorm.py:137-139, module/rmsnorm.py), not gated by tp_size.
"""

from __future__ import annotations

import torch

from .. import ops


def _kwargs(params_dtype, kwargs: dict) -> dict:
    if params_dtype is not None:  # module/layernorm.py: params_dtype is the old name of dtype
        kwargs["dtype"] = params_dtype
    return kwargs


class LayerNorm(ops.LayerNorm):
    """module/layernorm.py:16-139."""

    def __init__(self, normalized_shape=None, eps: float = 1e-5,
                 sequence_parallel: bool | None = None,
                 params_dtype: torch.dtype | None = None, zero_centered_gamma: bool = False,
                 hidden_size: int | None = None, **kwargs) -> None:
        self.sequence_parallel = sequence_parallel  # set before Module.__init__, as TE does
        super().__init__(normalized_shape if normalized_shape is not None else hidden_size,
                         eps=eps, zero_centered_gamma=zero_centered_gamma,
                         **_kwargs(params_dtype, kwargs))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "sequence_parallel", None) is not None:
            self.weight.sequence_parallel = self.sequence_parallel
            self.bias.sequence_parallel = self.sequence_parallel


class RMSNorm(ops.RMSNorm):
    """module/rmsnorm.py:16-140."""

    def __init__(self, normalized_shape=None, eps: float = 1e-5,
                 sequence_parallel: bool | None = None,
                 params_dtype: torch.dtype | None = None, zero_centered_gamma: bool = False,
                 hidden_size: int | None = None, **kwargs) -> None:
        self.sequence_parallel = sequence_parallel
        super().__init__(normalized_shape if normalized_shape is not None else hidden_size,
                         eps=eps, zero_centered_gamma=zero_centered_gamma,
                         **_kwargs(params_dtype, kwargs))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "sequence_parallel", None) is not None:
            self.weight.sequence_parallel = self.sequence_parallel
