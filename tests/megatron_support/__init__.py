"""Test support: ground-truth megatron-core 0.16.1 layout facts built on CPU (see harness.py)."""

from .harness import CFG_KEYS, MegatronBuildError, mcore_rejects, megatron_facts, padded_vocab_size

__all__ = ["CFG_KEYS", "MegatronBuildError", "mcore_rejects", "megatron_facts", "padded_vocab_size"]
