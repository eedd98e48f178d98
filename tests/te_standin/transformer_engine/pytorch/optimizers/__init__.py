"""TE's fused optimizers (``optimizers/__init__.py``): what megatron-core imports from here.

megatron-core imports ``FusedAdam`` and ``FusedSGD`` together in one ``try`` (M16 optimizer/
__init__.py:12-34) and uses TE's ``FusedAdam`` whenever TE is installed; the multi-tensor
kernels (``multi_tensor_l2norm``...) are not offered, so megatron's grad clipping falls back to
its own local implementation, as it does without Apex.
"""

from .fused_adam import FusedAdam
from .fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedSGD"]
