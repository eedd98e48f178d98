"""Pause Python's cycle collector while building or checking a plan.

A large plan is hundreds of thousands of small acyclic records; every few hundred allocations
the collector would rescan all of them (measured on the 235B switch: planning 10-19 s with the
default thresholds, 6-10 s without). Reference counting still frees everything; only the search
for cycles, which these passes do not create, waits until the pass returns, and then until the
collector next scans its oldest generation.

On Python 3.12 the permanent generation (``gc.freeze``'s) is never empty: static builtin types'
``__mro__`` and ``__bases__`` tuples are immortal there (PEP 683; their refcount is the
immortal one, as ``None``'s), and every full collection moves the immortal objects it meets
into the permanent generation (``update_refs`` in CPython 3.12's Modules/gcmodule.c): 375 of
them in a bare ``python3.12 -I -S``, none on 3.11. So "the caller froze nothing" is a freeze
count no larger than the interpreter's own immortal objects (``interpreter_frozen``), not 0.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache


@lru_cache(maxsize=1)
def interpreter_frozen() -> int:
    """How many objects the interpreter itself keeps in the permanent generation after a full
    collection: the GC-tracked immortal objects (0 before Python 3.12).

    In 3.12 these are the ``__mro__`` and ``__bases__`` tuples of the static builtin types,
    made immortal at startup (heap types' tuples stay mortal); found by walking the static
    types from ``object`` (a static type derives from static types only) and comparing
    refcounts with ``None``'s, immortal too.
    """
    if sys.version_info < (3, 12):
        return 0
    immortal = sys.getrefcount(None)  # an immortal's refcount does not move
    heap = 1 << 9  # Py_TPFLAGS_HEAPTYPE
    seen: set[int] = set()
    found: set[int] = set()
    stack = [object]
    while stack:
        t = stack.pop()
        if id(t) in seen or t.__flags__ & heap:
            continue
        seen.add(id(t))
        for tup in (t.__mro__, t.__bases__):
            if gc.is_tracked(tup) and sys.getrefcount(tup) == immortal:
                found.add(id(tup))
        stack.extend(type.__subclasses__(t))
    return len(found)


@contextmanager
def cycle_collector_paused(promote_after: bool = True) -> Iterator[None]:
    """Disable the cycle collector inside the block; restore its previous state after.

    ``promote_after``: move what the block allocated to the oldest generation unscanned
    (a plan's records, below); False: only paused (a live switch, whose downtime a full
    collection of a training process's heap would otherwise stretch by tenths of a second:
    the collection comes after it)."""
    was_enabled = gc.isenabled()
    # Promote the block's objects unscanned at the end (below) only where nothing else can
    # be caught up in it: on the main thread (a background plan inside a training job would
    # promote the job's young objects too) and where the caller froze nothing itself. A
    # caller's gc.freeze() moves every tracked object, the immortal ones included, so the
    # count then exceeds the interpreter's own (module docstring).
    promote = (promote_after and was_enabled and gc.get_freeze_count() <= interpreter_frozen()
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
                # per plan of the 235B switch) to find no cycles. (On 3.12 this also moves
                # the immortal tuples to the oldest generation; the next full collection
                # parks them in the permanent one again.)
                gc.freeze()
                gc.unfreeze()
            gc.enable()
