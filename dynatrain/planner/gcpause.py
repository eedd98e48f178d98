"""Pause Python's cycle collector while building or checking a plan.

A large plan is hundreds of thousands of small acyclic records; every few hundred allocations
the collector would rescan all of them (measured on the 235B switch: planning 10-19 s with the
default thresholds, 6-10 s without). Reference counting still frees everything; only the search
for cycles, which these passes do not create, waits until the pass returns, and then until the
collector next scans its oldest generation.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cycle_collector_paused() -> Iterator[None]:
    """Disable the cycle collector inside the block; restore its previous state after."""
    was_enabled = gc.isenabled()
    # Promote the block's objects unscanned at the end (below) only where nothing else can
    # be caught up in it: on the main thread (a background plan inside a training job would
    # promote the job's young objects too) and where the caller froze nothing itself.
    promote = (was_enabled and gc.get_freeze_count() == 0
               and threading.current_thread() is threading.main_thread())
    if promote:
        gc.collect(1)  # the caller's young garbage goes now, not promoted with the plan
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if promote:
                # Move what the block built straight to the oldest generation: re-enabled
                # as it is, the collector's next pass would scan all of it at once (0.2 s
                # per plan of the 235B switch) to find no cycles.
                gc.freeze()
                gc.unfreeze()
            gc.enable()
