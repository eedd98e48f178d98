"""``FusedSGD`` (TE ``optimizers/fused_sgd.py``): imported by megatron-core next to FusedAdam.

The stand-in keeps TE's constructor (fused_sgd.py:80-110) and runs torch's SGD, which is the
same update for ``wd_after_momentum=False`` (weight decay folded into the gradient first).
"""

from __future__ import annotations

import torch


class FusedSGD(torch.optim.SGD):
    """SGD with TE FusedSGD's arguments; no fused kernels."""

    def __init__(self, params, lr=1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *,
                 wd_after_momentum=False, materialize_master_grads=True,
                 set_grad_none=None) -> None:
        if wd_after_momentum:
            raise NotImplementedError("CPU stand-in of TE FusedSGD: wd_after_momentum")
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
