"""Megatron-core integration: a live job's state as the IR's per-rank storage and back, and
layout switches of a running job.

megatron-core is imported lazily (only when a function runs), so ``import dynatrain`` stays
light on machines without it.
"""

from .bridge import STEP_KEY, SlotSpec, extract_state, install_state, read_step, storage_spec
from .live import LiveSwitcher, MegatronJob, Prepared, SwitchResult, parallel_kwargs

__all__ = ["STEP_KEY", "LiveSwitcher", "MegatronJob", "Prepared", "SlotSpec", "SwitchResult",
           "extract_state", "install_state", "parallel_kwargs", "read_step", "storage_spec"]
