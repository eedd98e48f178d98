"""Runtime gate: random plans from the property gate's strategies run across real gloo processes.

Hypothesis draws a transition as the property gate does (tests/strategies.py), with worlds of
at most 8 ranks and at most 8 processes for the switch (source and destination devices
together), plans it, and runs it with ``run_local``: one forked process per device, each
building its source rank's storage from the same random global tensors, switching, and
comparing its destination storage byte for byte with the storage built directly for its
destination rank. It also draws the exchange's wire-piece thresholds, so that one example
takes the default path (tiny tensors: everything packed in one run per message), another
sends every segment of 64 bytes or more straight from and into storage in 256-byte chunks,
and another packs every segment; and whether a round is posted as NCCL needs it (one
``batch_isend_irecv``, operations matched by order) or piece by piece as on gloo, and whether
the switch compares transfer fingerprints before committing (``check_transfers``). Each example
forks up to 8 processes, so the ``ci`` profile runs a few dozen (derandomized: the same ones
every run) and ``deep`` many more.
"""

from __future__ import annotations

import os
from unittest import mock

from hypothesis import HealthCheck, assume, event, given, note, settings
from hypothesis import strategies as st

from dynatrain.ir.layout import Layout
from dynatrain.ir.state import transition_views
from dynatrain.planner.pipeline import plan_transition
from dynatrain.runtime import exchange, executor
from dynatrain.runtime.executor import process_devices
from dynatrain.runtime.local import run_local
from dynatrain.runtime.storage import storage_layout

from strategies import Transition, transitions

MAX_PROCESSES = 8
POOL = tuple(f"node{n}:gpu{g}" for n in range(2) for g in range(4))
EXAMPLES = {"ci": 20, "deep": 400}[os.environ.get("DYNATRAIN_HYPOTHESIS", "ci")]
# (DIRECT_MIN_BYTES, CHUNK_BYTES): as shipped; straight where contiguous in small chunks; all
# packed.
PIECES = {"default": (exchange.DIRECT_MIN_BYTES, exchange.CHUNK_BYTES),
          "straight": (64, 256), "packed": (1 << 62, exchange.CHUNK_BYTES)}


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow,
                                                        HealthCheck.filter_too_much])
@given(t=transitions(max_world=MAX_PROCESSES, pool=POOL), seed=st.integers(0, 2**31 - 1),
       pieces=st.sampled_from(sorted(PIECES)), grouped=st.booleans(), check=st.booleans())
def test_random_plan_runs_bit_exact_across_gloo_processes(t: Transition, seed: int, pieces: str,
                                                          grouped: bool, check: bool) -> None:
    note(f"src = {t.src_doc!r}")
    note(f"dst = {t.dst_doc!r}")
    note(f"budget = {t.budget}, place = {t.place!r}, pieces = {pieces}, grouped = {grouped}, "
         f"check = {check}")
    src, dst = Layout(t.src), Layout(t.dst)
    plan = plan_transition(src, dst, t.budget, place=t.place)
    devices = process_devices(plan)
    assume(len(devices) <= MAX_PROCESSES)
    event(f"{len(devices)} processes, {len(plan.rounds)} rounds, pieces {pieces}"
          + (", grouped" if grouped else ""))
    sv, dv = transition_views(src, dst)
    direct_min, chunk = PIECES[pieces]
    # The forked processes inherit the thresholds and the posting mode set here.
    with mock.patch.object(exchange, "DIRECT_MIN_BYTES", direct_min), \
            mock.patch.object(exchange, "CHUNK_BYTES", chunk), \
            mock.patch.object(executor, "posts_grouped", lambda pg: grouped):
        results = run_local(plan, sv, dv, seed=seed, timeout=30.0, check_transfers=check)
    assert [e for r in results for e in r["errors"]] == []
    assert [r["device"] for r in results] == list(devices)
    for r in results:  # every destination rank was compared, tensor by tensor (a rank may
        # hold nothing: TP ranks whose vocabulary rows are all new padding)
        if r["device"] in plan.dst_devices:
            rank = plan.dst_devices.index(r["device"])
            assert r["checked"] == len(storage_layout(dv, rank)), r["device"]
        assert r["report"]["peak_staging_bytes"] <= t.budget, r["device"]
    sent = sum(r["report"]["bytes_sent"] for r in results)
    assert sent == sum(r["report"]["bytes_received"] for r in results)
    assert sent == plan.stats["bytes_moved"]
