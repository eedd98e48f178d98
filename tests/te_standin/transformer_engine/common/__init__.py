"""``transformer_engine.common``: only the quantization recipes megatron-core names."""

from . import recipe  # noqa: F401
