"""Megatron-core integration: a live job's state as the IR's per-rank storage and back, and
layout switches of a running job, on the same processes or on a world that shrinks or grows.

megatron-core is imported lazily (only when a function runs), so ``import dynatrain`` stays
light on machines without it.
"""

from .bridge import STEP_KEY, SlotSpec, extract_state, install_state, read_step, storage_spec
from .job import (GlobalState, MegatronJob, Notice, Prepared, RecoveryFailed, Refill, SwitchFailed,
                  SwitchResult, TrainState, parallel_kwargs)
from .live import LiveSwitcher
from .lm_args import layout_args
from .rendezvous import Rendezvous, RendezvousTimeout

__all__ = ["STEP_KEY", "GlobalState", "LiveSwitcher", "MegatronJob", "Notice", "Prepared",
           "RecoveryFailed", "Refill", "Rendezvous", "RendezvousTimeout", "SlotSpec",
           "SwitchFailed", "SwitchResult", "TrainState", "extract_state", "install_state",
           "layout_args", "parallel_kwargs", "read_step", "storage_spec"]
