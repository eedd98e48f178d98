"""The torch runtime executes plans across real gloo processes, bit for bit and all or nothing.

Each case plans a transition in the parent, forks one process per device of the switch (fork is
~0.2 s where spawn re-imports torch for seconds), and in every process builds the source storage
from the same random global tensors (bf16 params, fp32 optimizer state, int64 step), runs
``switch`` and compares the destination storage byte for byte with the storage built directly
from the same tensors for the destination layout. Source checksums and measured staging against
the budget are checked too. Fault cases inject a failure or a hang into one process mid-round,
or kill it: every process must raise ``SwitchAborted`` within bounded time with its source
intact, and the same switch must then commit on retry (in place of a killed process, a new one
takes part). Workers report through JSON files (no pickles).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import multiprocessing
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.state import StateView, transition_views
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.plan import Plan
from dynatrain.runtime import exchange, executor
from dynatrain.runtime.executor import SwitchAborted, process_devices, switch
from dynatrain.runtime.local import global_state
from dynatrain.runtime.storage import (ByteViews, allocate, byte_view, checksums,
                                       fill_from_global, random_global, region, torch_dtype,
                                       within)
from dynatrain.verify.simulate import materialize

DENSE = dict(num_layers=4, hidden_size=48, num_attention_heads=12, num_query_groups=6,
             ffn_hidden_size=96, vocab_size=150, make_vocab_size_divisible_by=8, swiglu=True,
             max_position_embeddings=32)
MOE = dict(DENSE, num_moe_experts=4, moe_ffn_hidden_size=24, moe_router_enable_expert_bias=True,
           moe_router_score_function="sigmoid", moe_shared_expert_intermediate_size=48)


def spec(model: dict, devices: int | list[str], derive: bool = False, **par: object):
    if isinstance(devices, int):
        devices = [f"node{i // 4}:gpu{i % 4}" for i in range(devices)]
    return spec_from_dict({"model": model, "parallel": par, "world": {"devices": devices},
                           "state": {"derive_param": derive}})


D = [f"node{n}:gpu{g}" for n in range(2) for g in range(4)]  # 8 device ids on two "nodes"

# name -> (source spec, destination spec, budget bytes)
CASES = {
    "tp2->tp3": (spec(DENSE, 4, tp=2), spec(DENSE, 3, tp=3), 1 << 30),
    "pp2->pp3-uneven": (spec(DENSE, 2, pp=2),
                        spec(DENSE, 3, pp=3, decoder_first_pipeline_num_layers=2), 1 << 30),
    # DP shrink onto a partly different device set: source-only and destination-only devices.
    "pp2-vpp2->tp2-pp2": (spec(DENSE, 4, pp=2, vpp=2), spec(DENSE, 4, tp=2, pp=2), 1 << 30),
    "replicated->distopt-buckets": (spec(DENSE, 4, use_distributed_optimizer=False),
                                    spec(DENSE, 4, pp=2, overlap_grad_reduce=True,
                                         bucket_size=3000), 1 << 30),
    "dp4->dp2-moved": (spec(DENSE, D[:4]), spec(DENSE, [D[2], D[5]]), 1 << 30),
    "distopt->replicated": (spec(DENSE, 4, tp=2),
                            spec(DENSE, 4, tp=2, use_distributed_optimizer=False), 1 << 30),
    "moe-ep2->ep4-etp1": (spec(MOE, 4, tp=2, ep=2), spec(MOE, 4, ep=4), 1 << 30),
    "moe-ep4-etp1->tp2-etp2-ep2-pp2": (spec(MOE, 4, ep=4, etp=1), spec(MOE, 8, tp=2, ep=2, pp=2),
                                       1 << 30),
    # A tiny budget splits messages into many rounds.
    "tp1->tp2-dp2-small-budget": (spec(DENSE, 2), spec(DENSE, 4, tp=2), 16384),
    "untied-grow-8": (spec({**DENSE, "untie_embeddings_and_output_weights": True}, 4, tp=2),
                      spec({**DENSE, "untie_embeddings_and_output_weights": True}, 8, tp=2,
                           pp=2), 1 << 30),
    "derive-distopt-tp2->dp2-pp2": (spec(DENSE, 4, tp=2), spec(DENSE, 4, derive=True, pp=2),
                                    1 << 30),
    "derive-moe-ep4->ep2-edp2": (spec(MOE, 4, ep=4), spec(MOE, 4, derive=True, ep=2), 1 << 30),
    "derive-dp4-2-instances": (spec(DENSE, 4, tp=2),
                               spec(DENSE, 4, derive=True, num_distributed_optimizer_instances=2),
                               1 << 30),
    "derive-replicated-moe": (spec(MOE, 4, ep=2),
                              spec(MOE, 4, derive=True, ep=4, use_distributed_optimizer=False),
                              1 << 30),
}
SEED = 5
KILLED = 17  # exit status of a process the kill fault ends


@dataclass(frozen=True)
class Job:
    """Everything a forked worker needs (inherited through fork, never pickled)."""

    plan: Plan
    src: StateView
    dst: StateView
    devices: tuple[str, ...]
    out: Path
    timeout: float
    fault: str = "none"  # none | raise | hang | vote | kill | corrupt
    victim: int = 1  # process index the fault hits
    fault_round: int = 1
    given_dst: bool = False  # pass allocated destination storage as dst_store
    replacement: bool = False  # a process started in place of a killed one: retry only
    check_transfers: bool = False  # switch(check_transfers=...) on every attempt
    devices_given: bool = False  # switch(devices=job.devices): the group in another order
    prepared: bool = False  # prepare_exchange ahead, then switch three times (_prepared_runs)


def _init(job: Job, idx: int, attempt: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{job.out}/store{attempt}", rank=idx,
                            world_size=len(job.devices),
                            timeout=datetime.timedelta(seconds=60))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _check_commit(job: Job, device: str, tensors: dict, src, before, dst, report) -> list[str]:
    """Every way the committed switch on ``device`` could be wrong, as messages."""
    errors = []
    if device in job.plan.dst_devices:
        want = fill_from_global(job.dst, job.plan.dst_devices.index(device), tensors)
        if dst is None or dst.keys() != want.keys():
            return [f"{device}: destination keys differ"]
        for k, w in want.items():
            g = dst[k]
            if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(_bits(g), _bits(w)):
                errors.append(f"{device}: {k} differs ({g.dtype} {tuple(g.shape)})")
    elif dst is not None:
        errors.append(f"{device} is no destination device but got a storage")
    if src is not None and checksums(src) != before:
        errors.append(f"{device}: source storage changed")
    if report["peak_staging_bytes"] > report["planned_peak_staging_bytes"]:
        errors.append(f"{device}: staged {report['peak_staging_bytes']}, more than the "
                      f"{report['planned_peak_staging_bytes']} the plan says at most")
    # Pieces that go straight from or into storage stage nothing: a round stages at most what
    # the plan says, exactly that when every piece is packed (segments below
    # exchange.DIRECT_MIN_BYTES).
    for i, (got, planned) in enumerate(zip(report["round_staging_bytes"],
                                           [r["planned_staging_bytes"]
                                            for r in report["per_round"]])):
        if got > planned or (exchange.DIRECT_MIN_BYTES > (1 << 30) and got != planned):
            errors.append(f"{device}: staged {got} in round {i}, plan says {planned}")
    # The arena holds one round's staging, plus sends packed ahead only where there is room.
    most = max(report["round_staging_bytes"], default=0)
    if report["peak_staging_bytes"] < most:
        errors.append(f"{device}: peak staging {report['peak_staging_bytes']} below a round's "
                      f"{most}")
    if report["packed_ahead_bytes"] == 0 and report["peak_staging_bytes"] != most:
        errors.append(f"{device}: nothing packed ahead, yet the arena held "
                      f"{report['peak_staging_bytes']} for rounds of at most {most}")
    if report["rounds"] != len(job.plan.rounds):
        errors.append(f"{device}: ran {report['rounds']} of {len(job.plan.rounds)} rounds")
    return errors


def _fault_hook(job: Job, src, saved: list):
    """The ``on_round`` hook of the victim: raise, hang, or corrupt its source (voted out)."""
    def hook(i: int) -> None:
        if i != job.fault_round:
            return
        if job.fault == "raise":
            raise RuntimeError("injected failure")
        if job.fault == "kill":  # the process dies at once: no handler, no goodbye
            os._exit(KILLED)
        if job.fault == "hang":
            time.sleep(job.timeout + 1.5)
        if job.fault == "vote":  # flip one source element; the worker restores it afterwards
            k = sorted(src, key=repr)[0]
            saved.append((k, src[k].clone()))
            src[k].view(-1)[0] += 1
    return hook


def _corrupting(unpack):
    """``exchange._unpack`` that flips one bit of the first piece it unpacks (a bad link or a
    runtime bug), then unpacks faithfully."""
    state = {"done": False}

    def corrupt(p) -> None:
        unpack(p)
        if not state["done"]:
            state["done"] = True
            p.views[0].view(-1)[0] ^= 1
    return corrupt


def _worker(idx: int, job: Job) -> None:
    torch.set_num_threads(1)  # 2 cores shared by up to 8 processes
    device = job.devices[idx]
    res: dict = {"device": device, "errors": []}
    try:
        _init(job, idx, 1 if job.replacement else 0)
        tensors = global_state(job.src, SEED, bool(job.plan.derived))
        src = None
        if device in job.plan.src_devices:
            src = fill_from_global(job.src, job.plan.src_devices.index(device), tensors)
        before = checksums(src) if src is not None else None
        saved: list = []  # (key, original) of a source tensor the vote fault corrupts
        hook = _fault_hook(job, src, saved) if job.fault != "none" and idx == job.victim else None
        if job.fault != "none" and not job.replacement:
            t0 = time.perf_counter()
            unpack = exchange._unpack
            if job.fault == "corrupt" and idx == job.victim:
                exchange._unpack = _corrupting(unpack)
            try:
                switch(job.plan, job.src, job.dst, device, src, timeout=job.timeout,
                       verify_source=True, on_round=hook, check_transfers=job.check_transfers)
                res["errors"].append(f"{device}: the faulty switch committed")
            except SwitchAborted as err:
                res["abort"] = {"message": str(err), "seconds": time.perf_counter() - t0,
                                "round": err.round_index, "peer": err.peer,
                                "group_destroyed": err.group_destroyed}
            exchange._unpack = unpack
            for k, original in saved:
                src[k].copy_(original)
            if src is not None and checksums(src) != before:
                res["errors"].append(f"{device}: source changed by the aborted switch")
            if not dist.is_initialized():  # destroyed on abort: retry in a fresh group
                _init(job, idx, 1)
        if job.prepared:
            res["errors"] += _prepared_runs(job, idx, device, tensors, src)
            res["report"] = {}
            dist.destroy_process_group()
            (job.out / f"result{idx}.json").write_text(json.dumps(res), encoding="utf-8")
            return
        t0 = time.perf_counter()
        given = None
        if job.given_dst and device in job.plan.dst_devices:
            given = allocate(job.dst, job.plan.dst_devices.index(device))
        dst, report = switch(job.plan, job.src, job.dst, device, src, timeout=job.timeout,
                             dst_store=given, check_transfers=job.check_transfers,
                             devices=job.devices if job.devices_given else None)
        if given is not None and dst is not given:
            res["errors"].append(f"{device}: dst_store was not the storage returned")
        res["seconds"] = time.perf_counter() - t0
        res["report"] = report
        res["errors"] += _check_commit(job, device, tensors, src, before, dst, report)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 — reported to the parent, which fails the test
        res["errors"].append(f"{device} crashed:\n{traceback.format_exc()}")
    (job.out / f"result{idx}.json").write_text(json.dumps(res), encoding="utf-8")


def _prepared_runs(job: Job, idx: int, device: str, tensors: dict, src) -> list[str]:
    """Prepare the exchange once, then switch with it three times: as prepared; after the job
    trained on (every source tensor written in place, the step handed out as a fresh tensor,
    as ``extract_state`` does); after a large source tensor moved (not used: prepared at the
    switch, and it says why). Each switch must equal the storage built from the global
    tensors of that moment."""
    from dynatrain.runtime import prepared as prepared_mod

    prepared_mod.COPIED_BYTES = 8  # only the step is copied; every other tensor must stay put
    order = job.devices if job.devices_given else None
    given = None
    if device in job.plan.dst_devices:
        given = allocate(job.dst, job.plan.dst_devices.index(device))
    ex = prepared_mod.prepare_exchange(job.plan, job.src, job.dst, device, src, given,
                                       devices=order)
    rank = job.plan.src_devices.index(device) if device in job.plan.src_devices else None
    errors: list[str] = []
    later = global_state(job.src, SEED + 1, bool(job.plan.derived))
    for run in ("as prepared", "trained on", "moved"):
        if run == "trained on":
            tensors = later
            if src is not None:
                for k, t in fill_from_global(job.src, rank, later).items():
                    if k[0] == "step":
                        src = {**src, k: t}  # a fresh tensor, as extract_state hands it out
                    else:
                        src[k].copy_(t)
        if run == "moved" and src is not None:
            big = max(src, key=lambda k: (src[k].nbytes, repr(k)))
            src = {**src, big: src[big].clone()}
        before = checksums(src) if src is not None else None
        dst, report = switch(job.plan, job.src, job.dst, device, src, timeout=job.timeout,
                             dst_store=given, devices=order, prepared=ex)
        want_prepared = run != "moved" or src is None
        if report["prepared_ahead"] != want_prepared:
            errors.append(f"{device} {run}: prepared_ahead {report['prepared_ahead']} "
                          f"({report['prepared_why']})")
        if run == "moved" and src is not None and "moved since" not in report["prepared_why"]:
            errors.append(f"{device} {run}: why not prepared: {report['prepared_why']}")
        errors += [f"{run}: {e}" for e in
                   _check_commit(job, device, tensors, src, before, dst, report)]
    return errors


def run_switch(name: str, tmp_path: Path, timeout: float = 20.0, fault: str = "none",
               **kw: object) -> tuple[Job, list[dict]]:
    """Plan ``CASES[name]``, run it in one forked process per device; per-process results."""
    src, dst, budget = CASES[name]
    sv, dv = transition_views(Layout(src), Layout(dst))  # padding rows both hold are carried
    plan = plan_transition(sv.layout, dv.layout, budget)
    order = process_devices(plan)
    if kw.get("devices_given"):  # the group's ranks in reverse: only ``devices`` says so
        order = order[::-1]
    job = Job(plan, sv, dv, order, tmp_path, timeout, fault, **kw)
    ctx = tmp.start_processes(_worker, args=(job,), nprocs=len(job.devices), join=False,
                              start_method="fork")
    deadline = time.monotonic() + 90
    try:
        while not ctx.join(timeout=0.2):
            assert time.monotonic() < deadline, f"{name}: workers hung"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = [json.loads((tmp_path / f"result{i}.json").read_text(encoding="utf-8"))
               for i in range(len(job.devices))]
    return job, results


@pytest.mark.parametrize("name", list(CASES))
def test_storage_follows_the_numpy_oracle(name: str) -> None:
    # The torch storage must be the oracle's storage model with real dtypes: same keys, shapes
    # and values (the draws are exact in fp32: bf16 widens exactly, the step is < 2**24).
    for spec_ in CASES[name][:2]:
        view = StateView(Layout(spec_))
        tensors = random_global(view, SEED)
        oracle = materialize(view, {k: t.float().numpy() for k, t in tensors.items()})
        kind_dtype = {**view.kinds, "buffer": "fp32", "step": "int64"}
        for rank, want in enumerate(oracle):
            got = fill_from_global(view, rank, tensors)
            assert got.keys() == want.keys()
            for k, w in want.items():
                assert got[k].dtype == torch_dtype(kind_dtype[k[0]]), k
                assert tuple(got[k].shape) == w.shape, k
                assert torch.equal(got[k].double(), torch.from_numpy(w).double()), (rank, k)


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wire-piece thresholds scaled to the tiny test models (forked workers inherit them):
    segments of 64 bytes and more go straight from or into storage where contiguous and are
    cut into 256-byte chunks, smaller ones are packed. Every path of the exchange runs."""
    monkeypatch.setattr(exchange, "DIRECT_MIN_BYTES", 64)
    monkeypatch.setattr(exchange, "CHUNK_BYTES", 256)


@pytest.mark.parametrize("name", list(CASES))
def test_switch_is_bit_exact_across_processes(name: str, tmp_path: Path,
                                              small_pieces: None) -> None:
    job, results = run_switch(name, tmp_path, given_dst=name.startswith("derive"))
    assert [e for r in results for e in r["errors"]] == []
    moved = sum(r["report"]["bytes_sent"] for r in results)
    assert moved == job.plan.stats["bytes_moved"]
    assert moved == sum(r["report"]["bytes_received"] for r in results)
    if name.endswith("small-budget"):
        assert len(job.plan.rounds) > 3
    if job.plan.derived:
        assert all("param" not in t.kinds for m in job.plan.messages() for t in m.transfers)


@pytest.mark.parametrize("name", ["pp2-vpp2->tp2-pp2", "tp1->tp2-dp2-small-budget"])
def test_switch_in_a_group_of_another_order_is_bit_exact(name: str, tmp_path: Path,
                                                         small_pieces: None) -> None:
    # A join's world made ahead numbers its processes in the destination's order
    # (megatron.groups_ahead.Joinworld): the group's order is given as ``devices``.
    job, results = run_switch(name, tmp_path, devices_given=True, check_transfers=True)
    assert job.devices != process_devices(job.plan)
    assert [e for r in results for e in r["errors"]] == []
    assert sum(r["report"]["bytes_received"] for r in results) == job.plan.stats["bytes_moved"]


@pytest.mark.parametrize("name,order", [("tp2->tp3", False), ("pp2-vpp2->tp2-pp2", True),
                                        ("moe-ep4-etp1->tp2-etp2-ep2-pp2", False),
                                        ("derive-distopt-tp2->dp2-pp2", False)])
def test_switch_prepared_ahead_is_bit_exact_and_reads_the_source_as_it_is_then(
        name: str, order: bool, tmp_path: Path, small_pieces: None) -> None:
    job, results = run_switch(name, tmp_path, prepared=True, devices_given=order)
    assert [e for r in results for e in r["errors"]] == []


def test_devices_must_be_the_switch_processes() -> None:
    src, dst, budget = CASES["pp2-vpp2->tp2-pp2"]
    sv, dv = transition_views(Layout(src), Layout(dst))
    plan = plan_transition(sv.layout, dv.layout, budget)
    devices = process_devices(plan)
    with pytest.raises(ValueError, match="devices: 3 given, not the switch's 4 processes"):
        switch(plan, sv, dv, devices[0], None, devices=devices[:3])


@pytest.mark.parametrize("name", ["pp2-vpp2->tp2-pp2", "moe-ep4-etp1->tp2-etp2-ep2-pp2",
                                  "tp1->tp2-dp2-small-budget", "derive-moe-ep4->ep2-edp2"])
def test_rounds_posted_as_one_group_as_on_nccl_are_bit_exact(
        name: str, tmp_path: Path, small_pieces: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # The NCCL path run on gloo: each round one batch_isend_irecv, all staged sends packed
    # first, unpacked after the batch. Every operation carries tag 0, so gloo matches the
    # operations between two processes by posting order, as NCCL does: pieces posted out of
    # order on one end would land in the wrong place (or mismatch in size) and fail here.
    monkeypatch.setattr(executor, "posts_grouped", lambda pg: True)
    job, results = run_switch(name, tmp_path)
    assert [e for r in results for e in r["errors"]] == []
    assert sum(r["report"]["bytes_sent"] for r in results) == job.plan.stats["bytes_moved"]


@pytest.mark.parametrize("name", ["tp2->tp3", "moe-ep4-etp1->tp2-etp2-ep2-pp2",
                                  "derive-distopt-tp2->dp2-pp2"])
def test_switch_with_every_piece_packed_stages_what_the_plan_says(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exchange, "DIRECT_MIN_BYTES", 1 << 62)
    job, results = run_switch(name, tmp_path)
    assert [e for r in results for e in r["errors"]] == []
    assert max(max(r["report"]["round_staging_bytes"]) for r in results) == \
        job.plan.stats["peak_staging_bytes"]


@pytest.mark.parametrize("direct_min", [64, 1 << 62])
def test_next_round_is_packed_ahead_only_within_the_planned_staging(
        direct_min: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rounds of the small-budget plan carry close to its 16 KiB each. With segments of 64 bytes
    # and more sent straight from storage, little is staged, so the next round's staged sends
    # fit beside the current round's within what the plan says the device stages; with every
    # piece packed, a round stages all the plan says and packing ahead mostly has no room.
    monkeypatch.setattr(exchange, "DIRECT_MIN_BYTES", direct_min)
    monkeypatch.setattr(exchange, "CHUNK_BYTES", 256)
    job, results = run_switch("tp1->tp2-dp2-small-budget", tmp_path)
    assert [e for r in results for e in r["errors"]] == []
    ahead = sum(r["report"]["packed_ahead_bytes"] for r in results)
    staged = sum(sum(r["report"]["round_staging_bytes"]) for r in results)
    for r in results:  # the runtime never holds more staging than the verified plan counts
        assert r["report"]["peak_staging_bytes"] <= r["report"]["planned_peak_staging_bytes"]
    if direct_min == 64:
        assert 0 < ahead
    else:
        assert ahead < staged / 4


@pytest.mark.parametrize("name", ["tp2->tp3", "pp2-vpp2->tp2-pp2", "moe-ep4-etp1->tp2-etp2-ep2-pp2",
                                  "replicated->distopt-buckets"])
def test_byte_views_equal_the_region_views(name: str) -> None:
    # The one-op views the exchange uses must be the views region()/within() describe: same
    # memory, shape and (where it matters) strides, for whole regions and cut boxes.
    for spec_ in CASES[name][:2]:
        view = StateView(Layout(spec_))
        for rank in range(view.layout.world):
            store = allocate(view, rank)
            for t in store.values():  # distinct bytes everywhere
                t.view(-1).view(torch.uint8).copy_(torch.arange(t.numel() * t.element_size())
                                                   .to(torch.uint8))
            views = ByteViews(store)
            for reg in view.regions(rank):
                boxes = [reg.box]
                if reg.box.numel > 1:  # a strict sub-box: the upper half of the widest dim
                    d = max(range(len(reg.box.shape)), key=lambda i: reg.box.shape[i])
                    lo = list(reg.box.lo)
                    lo[d] += reg.box.shape[d] // 2
                    boxes.append(type(reg.box)(tuple(lo), reg.box.hi))
                for box in boxes:
                    want = byte_view(region(store, reg.kind, reg.slot, reg.box)[
                        within(box, reg.box)])
                    got = views((reg.kind,), reg.slot, reg.box, box)[0]
                    assert got.shape == want.shape and got.data_ptr() == want.data_ptr()
                    assert all(a == b for a, b, n in zip(got.stride(), want.stride(), got.shape)
                               if n > 1), (reg, box)
                    assert torch.equal(got, want)


def test_failure_mid_round_aborts_everywhere_then_retry_commits(tmp_path: Path) -> None:
    job, results = run_switch("tp1->tp2-dp2-small-budget", tmp_path, timeout=5.0,
                              fault="raise", victim=1, fault_round=2)
    assert [e for r in results for e in r["errors"]] == []
    victim = results[1]["abort"]
    assert "round 2" in victim["message"] and "injected failure" in victim["message"]
    for r in results:  # everyone aborted in bounded time, in a round, and destroyed the group
        assert r["abort"]["seconds"] < 15, r["abort"]
        assert r["abort"]["round"] is not None and r["abort"]["group_destroyed"]
        assert r["report"]["rounds"] == len(job.plan.rounds)  # the retry committed


def test_killed_process_aborts_everywhere_then_retry_with_a_replacement_commits(
        tmp_path: Path) -> None:
    # Process 1 dies mid-round (os._exit, as a crash or an OOM kill would). The others must
    # abort within bounded time with their sources intact, then retry in a fresh group with a
    # process started in its place (rebuilding its source rank), and commit bit for bit.
    src, dst, budget = CASES["tp1->tp2-dp2-small-budget"]
    sv, dv = transition_views(Layout(src), Layout(dst))
    plan = plan_transition(sv.layout, dv.layout, budget)
    job = Job(plan, sv, dv, process_devices(plan), tmp_path, 5.0, "kill", victim=1,
              fault_round=2)
    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=_worker, args=(i, job)) for i in range(len(job.devices))]
    for p in procs:
        p.start()
    procs[1].join(60)
    assert procs[1].exitcode == KILLED
    procs[1] = fork.Process(target=_worker, args=(1, dataclasses.replace(job, replacement=True)))
    procs[1].start()
    for p in procs:
        p.join(90)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results = [json.loads((tmp_path / f"result{i}.json").read_text(encoding="utf-8"))
               for i in range(len(job.devices))]
    assert [e for r in results for e in r["errors"]] == []
    for i, r in enumerate(results):
        assert r["report"]["rounds"] == len(plan.rounds)  # the retry committed everywhere
        if i != 1:
            assert r["abort"]["seconds"] < 15 and r["abort"]["group_destroyed"], r["abort"]
            assert r["abort"]["round"] is not None, r["abort"]
    assert "abort" not in results[1]  # the replacement only ran the retry


def test_corrupted_transfer_is_found_voted_out_everywhere_then_retry_commits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every piece packed, so the victim's unpack runs; it flips one bit of what it received.
    # Under check_transfers the destination's fingerprint differs from the source's: every
    # process aborts at the vote (group kept), sources intact; the retry commits.
    monkeypatch.setattr(exchange, "DIRECT_MIN_BYTES", 1 << 62)
    job, results = run_switch("moe-ep4-etp1->tp2-etp2-ep2-pp2", tmp_path, timeout=10.0,
                              fault="corrupt", victim=5, check_transfers=True)
    assert [e for r in results for e in r["errors"]] == []
    assert "differs at destination rank" in results[5]["abort"]["message"]
    for r in results:
        assert "commit vote" in r["abort"]["message"], r["abort"]
        assert r["abort"]["peer"] == job.devices[5] and not r["abort"]["group_destroyed"]
        assert r["report"]["rounds"] == len(job.plan.rounds)  # the retry committed
        assert r["report"]["check_seconds"] > 0


def test_transfer_check_passes_on_a_faithful_switch(tmp_path: Path, small_pieces: None) -> None:
    job, results = run_switch("derive-moe-ep4->ep2-edp2", tmp_path, check_transfers=True)
    assert [e for r in results for e in r["errors"]] == []
    assert all(r["report"]["check_seconds"] > 0 for r in results)


def test_hung_process_times_out_everywhere_then_retry_commits(tmp_path: Path) -> None:
    job, results = run_switch("dp4->dp2-moved", tmp_path, timeout=2.0, fault="hang", victim=2,
                              fault_round=0)
    assert [e for r in results for e in r["errors"]] == []
    for i, r in enumerate(results):
        if i != 2:
            assert r["abort"]["seconds"] < 10, r["abort"]
    assert any(r["abort"]["peer"] == job.devices[2] for r in results)  # someone names the hung one


def test_failed_vote_aborts_everywhere_and_keeps_the_group(tmp_path: Path) -> None:
    job, results = run_switch("tp2->tp3", tmp_path, timeout=10.0, fault="vote", victim=0,
                              fault_round=0)
    assert [e for r in results for e in r["errors"]] == []
    for r in results:
        assert "commit vote" in r["abort"]["message"], r["abort"]
        assert r["abort"]["peer"] == job.devices[0] and not r["abort"]["group_destroyed"]
