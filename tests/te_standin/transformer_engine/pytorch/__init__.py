"""``transformer_engine.pytorch``: what megatron-core's TE wrappers import and subclass."""

from . import distributed, fp8, ops, tensor  # noqa: F401
from .attention import DotProductAttention  # noqa: F401
from .fp8 import fp8_autocast  # noqa: F401
from .module import (Fp8Padding, Fp8Unpadding, GroupedLinear, LayerNorm,  # noqa: F401
                     LayerNormLinear, Linear, RMSNorm)
