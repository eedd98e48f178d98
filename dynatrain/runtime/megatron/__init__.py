"""Megatron-core integration: a live job's state as the IR's per-rank storage and back.

megatron-core is imported lazily (only when a function runs), so ``import dynatrain`` stays
light on machines without it.
"""

from .bridge import STEP_KEY, SlotSpec, extract_state, install_state, read_step, storage_spec

__all__ = ["STEP_KEY", "SlotSpec", "extract_state", "install_state", "read_step", "storage_spec"]
