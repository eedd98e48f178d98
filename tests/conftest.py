"""Hypothesis profiles for the property gate (tests/test_gate.py), chosen by DYNATRAIN_HYPOTHESIS;
and the cleanup of what the TE tests' workers shared in a run.

``ci`` (the default) is derandomized, so every run checks the same examples and a red CI run
is reproducible; ``deep`` draws fresh examples each run, many more of them, for hunting bugs.
Tests that pass their own settings profile (tests/test_spec_hostile.py) are unaffected.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import os
import tempfile
import time

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,  # derandomized: replaying saved failures would only add noise
    deadline=None,  # example time varies with world size and budget; no per-example limit
    # Every dimension the gate covers is also checked on its own example in every run
    # (test_gate.test_strategy_reaches); the random examples add breadth, ``deep`` depth
    # (200 keeps the default suite within its 10 minutes on the 2-core machine).
    max_examples=200,
    print_blob=True,
    # Each example plans and simulates a whole transition: slow by hypothesis' standards.
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "deep",
    max_examples=2000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("DYNATRAIN_HYPOTHESIS", "ci"))

# Every process a test forks (the multi-process jobs) starts with what it inherited frozen
# (``gc.freeze``, as Python's gc docs advise for fork without exec): its cycle collector then
# never rescans the worker's heap of torch, megatron and hypothesis objects, whose headers it
# would write page by page into the child's copy-on-write memory. Measured on
# tests/test_live_world.py: 62 CPU-seconds without, 50 with.
os.register_at_fork(after_in_child=gc.freeze)


# Files whose tests each start their own processes and share nothing (no module fixture, no
# cache): their tests go to the xdist workers one by one, these first (the longest among them
# at the very first) so that no long test starts last. Every other file runs whole on one
# worker, its module fixtures built once. (xdist's own ``loadgroup`` cannot say this under
# pytest 9: it marks a group by rewriting ``item._nodeid``, which pytest 9 no longer reads, so
# every test became a group of its own and module fixtures were built on both workers.)
SPREAD = {"test_bench_short.py", "test_shipped_examples.py", "test_live_world.py",
          "test_live_failures.py", "test_live_buddy.py",
          "test_megatron_lm_control.py", "test_megatron_lm_recovery.py"}
FIRST = "tests/test_bench_short.py::test_bench_short_run[goodput_bench]"  # about 5 minutes


def _scope(nodeid: str) -> str:
    """What one xdist worker runs together: the test itself in a SPREAD file, else its file."""
    path = nodeid.split("::", 1)[0]
    return nodeid if os.path.basename(path) in SPREAD else path


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent without xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadscope":  # another --dist given: xdist's own
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return ByScope(config, log)


def pytest_collection_modifyitems(items) -> None:
    # Scopes are handed out in collection order (``--no-loadscope-reorder``): the SPREAD
    # files' tests first, FIRST before them; a stable sort keeps every file's own order.
    items.sort(key=lambda item: (item.nodeid != FIRST, item.path.name not in SPREAD))


def pytest_sessionstart(session) -> None:
    session.config._dynatrain_started = time.time()


def pytest_sessionfinish(session) -> None:
    """On the controller (not an xdist worker): remove the TE facts earlier runs' workers
    shared (``megatron_support.te._shared``); files of runs still going are newer."""
    if hasattr(session.config, "workerinput"):
        return
    started = getattr(session.config, "_dynatrain_started", time.time())
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "dynatrain-te-*")):
        with contextlib.suppress(OSError):
            if os.path.getmtime(path) < started:
                os.remove(path)
