"""Pause Python's cycle collector while building or checking a plan.

A large plan is hundreds of thousands of small acyclic records; every few hundred allocations
the collector would rescan all of them (measured on the 235B switch: planning 10-19 s with the
default thresholds, 6-10 s without). Reference counting still frees everything; only the search
for cycles, which these passes do not create, waits until the pass returns, and then until the
collector next scans its oldest generation.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cycle_collector_paused() -> Iterator[None]:
    """Disable the cycle collector inside the block; restore its previous state after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_freeze_count() == 0:
                # Move what the block built straight to the oldest generation: re-enabled
                # as it is, the collector's next pass would scan all of it at once (0.2 s
                # per plan of the 235B switch) to find no cycles. Skipped where the caller
                # froze objects itself (unfreezing would undo that).
                gc.freeze()
                gc.unfreeze()
            gc.enable()
