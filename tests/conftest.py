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
# cache): their tests go to the xdist workers one by one. Every other file runs whole on one
# worker, its module fixtures built once (``--dist loadgroup`` in pyproject.toml).
SPREAD = {"test_bench_short.py", "test_shipped_examples.py", "test_live_world.py",
          "test_live_failures.py", "test_live_buddy.py",
          "test_megatron_lm_control.py", "test_megatron_lm_recovery.py"}


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(items) -> None:
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group(item.nodeid if name in SPREAD else name))


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
