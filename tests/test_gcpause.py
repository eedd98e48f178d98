"""The planner's collector pause: it must not keep the caller's cyclic garbage alive.

A process that froze nothing has a freeze count of 0 on Python 3.11 and, on 3.12, the
interpreter's own immortal objects that full collections park in the permanent generation
(``interpreter_frozen``: 375 static builtin types' ``__mro__``/``__bases__`` tuples here).
"""

from __future__ import annotations

import gc
import sys
import threading
import weakref

from dynatrain.planner.gcpause import cycle_collector_paused, interpreter_frozen


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cycle collector frees it


def _cycle() -> weakref.ref:
    node = _Node()
    return weakref.ref(node)


def test_what_the_interpreter_freezes_itself() -> None:
    """The fact the pause relies on: a full collection leaves exactly the interpreter's own
    immortal objects frozen (none before 3.12), all of them immortal tuples on 3.12."""
    gc.collect()
    assert gc.get_freeze_count() == interpreter_frozen()
    assert (interpreter_frozen() > 0) == (sys.version_info >= (3, 12))
    gc.unfreeze()  # they come back on the next full collection: nothing else is frozen
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gc.get_freeze_count() == interpreter_frozen()


def test_caller_cycles_are_freed_not_promoted() -> None:
    assert gc.isenabled()
    gc.collect()
    dead = _cycle()  # garbage in the young generation when the pause starts
    assert dead() is not None
    with cycle_collector_paused():
        assert not gc.isenabled()
        kept = [object() for _ in range(1000)]  # what a plan would build
    assert gc.isenabled() and gc.get_freeze_count() == 0  # the block froze nothing
    assert dead() is None  # collected at entry, not moved to the oldest generation
    assert any(o is kept for o in gc.get_objects(generation=2))  # promoted, unscanned


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
    assert gc.get_freeze_count() <= interpreter_frozen()  # it froze nothing


def test_a_frozen_caller_stays_frozen() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with cycle_collector_paused():
            pass
        # Not unfrozen behind the caller's back (that would move every frozen object out).
        # Frozen objects that other threads of the worker free meanwhile leave the count: a
        # background thread dropping an earlier test's process groups freed 2 of 1.9 million.
        assert frozen - 1000 <= gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_a_live_switch_pauses_the_collector_without_promoting(monkeypatch) -> None:
    """A live switch (and a spare's join, a recovery) runs with the collector paused: a full
    collection of a heap holding the old and the new job took 0.2-0.5 s of a preemption
    switch on the example. Nothing is frozen or collected by the pause itself."""
    from dynatrain.runtime.megatron.live import LiveSwitcher

    seen = {}

    def now(self, job):
        seen["enabled"], seen["frozen"] = gc.isenabled(), gc.get_freeze_count()
        return "result"

    monkeypatch.setattr(LiveSwitcher, "_switch_now", now)
    sw = object.__new__(LiveSwitcher)
    sw.spec = sw.layout = sw._pending = object()
    before = gc.get_freeze_count()
    assert gc.isenabled()
    assert LiveSwitcher.switch(sw, None) == "result"
    assert seen == {"enabled": False, "frozen": before} and gc.isenabled()
