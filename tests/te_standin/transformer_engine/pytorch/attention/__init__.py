"""TE ``attention``: only ``DotProductAttention``."""

from .dot_product_attention import DotProductAttention  # noqa: F401
