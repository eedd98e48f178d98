"""The planner's collector pause: it must not keep the caller's cyclic garbage alive."""

from __future__ import annotations

import gc
import threading
import weakref

from dynatrain.planner.gcpause import cycle_collector_paused


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cycle collector frees it


def _cycle() -> weakref.ref:
    node = _Node()
    return weakref.ref(node)


def test_caller_cycles_are_freed_not_promoted() -> None:
    assert gc.isenabled()
    gc.collect()
    dead = _cycle()  # garbage in the young generation when the pause starts
    assert dead() is not None
    with cycle_collector_paused():
        assert not gc.isenabled()
        kept = [object() for _ in range(1000)]  # what a plan would build
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert dead() is None  # collected at entry, not moved to the oldest generation
    assert kept


def test_background_thread_restores_the_collector_without_freezing() -> None:
    seen = {}

    def plan() -> None:
        with cycle_collector_paused():
            seen["inside"] = gc.isenabled()
        seen["after"] = gc.isenabled()

    t = threading.Thread(target=plan)
    t.start()
    t.join()
    assert seen == {"inside": False, "after": True}
    assert gc.get_freeze_count() == 0


def test_a_frozen_caller_stays_frozen() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with cycle_collector_paused():
            pass
        assert gc.get_freeze_count() == frozen  # not unfrozen behind the caller's back
    finally:
        gc.unfreeze()
