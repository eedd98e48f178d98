"""TE ``module``: the parameter-owning modules megatron-core subclasses."""

from .grouped_linear import GroupedLinear  # noqa: F401
from .layernorm import LayerNorm, RMSNorm  # noqa: F401
from .layernorm_linear import LayerNormLinear  # noqa: F401
from .linear import Linear  # noqa: F401
from .fp8_padding import Fp8Padding, Fp8Unpadding  # noqa: F401
