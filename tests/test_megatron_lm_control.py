"""Megatron-LM's own loop under ``dynatrain.megatron_lm.pretrain``: a world that shrinks and
grows again, switches asked for from outside while it trains, and a failure after the exchange.

* World change 4 -> 3 -> 4: four gloo processes start in TP2 DP2; at iteration 2 the job moves
  to DP3 on three of them (the fourth idles as a spare), at iteration 4 back to TP2 DP2 on all
  four (the spare joins). After each switch every rank's state equals Megatron-LM's own restart
  from the checkpoint the live job saved at that iteration, ``--load``ed into the destination
  layout on as many processes, and the next iterations' losses are equal.
* Requests: two processes train TP2 while requests come through the job's store (a TCPStore
  this test hosts, ``LiveOptions(store=...)``): PP2 while the LR scheduler of one rank's
  destination refuses the carried state after the exchange (failed, exit 4: every process
  trains on in TP2 with Megatron-LM's args and micro-batch count as before), PP2 again with ``dynatrain switch`` (switched, exit 0), a spec of another
  model and a layout on 4 devices (refused, exit 2).
"""

from __future__ import annotations

import datetime
import json
import importlib.metadata
import importlib.util
import os
import socket
import subprocess
import sys
import threading

import pytest

if importlib.util.find_spec("megatron.training") is None:
    pytest.skip(f"megatron-core {importlib.metadata.version('megatron-core')}'s wheel has no "
                "megatron.training (Megatron-LM's loop ships with 0.19)", allow_module_level=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dynatrain.ir.loader import spec_from_dict, spec_to_dict, spec_to_yaml_text  # noqa: E402
from dynatrain.megatron_lm import LiveOptions  # noqa: E402
from dynatrain.runtime.megatron.requests import post_request, wait_answer  # noqa: E402
from megatron_support import lm  # noqa: E402

BASE = ("--num-layers", "2", "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable",
        "--untie-embeddings-and-output-weights")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _same(a: dict, b: dict) -> list[str]:
    assert sorted(a) == sorted(b)
    return [n for n in a if not torch.equal(a[n], b[n])]


def test_world_shrinks_and_grows_inside_megatron_lm(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    base = BASE + ("--global-batch-size", "12")  # DP 2, 3 and 4 divide it
    schedule = {2: {"parallel": {}, "world": {"nodes": 1, "gpus_per_node": 3}},
                4: {"parallel": {"tp": 2}}}
    live = lm.run_pretrain(
        lm.argv(tp=2, iters=6, extra=base + ("--save", ckpt, "--save-interval", "2")),
        world=4, timeout=600, options=LiveOptions(schedule=schedule, requests=False,
                                                  timeout=120))
    to_dp3 = lm.run_pretrain(lm.argv(tp=1, iters=6, load=ckpt, extra=base + (
        "--ckpt-step", "2")), world=3, timeout=600)
    back = lm.run_pretrain(lm.argv(tp=2, iters=6, load=ckpt, extra=base + (
        "--ckpt-step", "4")), world=4, timeout=600)
    spare = live[3]
    assert sorted(spare.at_train) == [0, 4]  # it sat out iterations 3 and 4
    # Both world changes built Megatron-LM's destination job at the boundary before, in the
    # new world made while the job trained: the shrink in the job's world, the grow with the
    # spare, which built with the job while it waited to join.
    for rank in range(3):
        for it in (2, 4):
            phases = live[rank].switched[it]
            assert "build_ahead" in phases and "build" not in phases, (rank, it, sorted(phases))
            # ... and each process's part of the exchange, from the views of Megatron-LM's
            # model and optimizer it took then (the job trained on between the two)
            assert tuple(live[rank].prepared[it]) == (True, None), (rank, it,
                                                                     live[rank].prepared[it])
    for rank in range(3):
        mine, ref = live[rank].at_train[2], to_dp3[rank].at_train[2]
        assert mine["layout"] == ref["layout"] == (1, 1, 3)
        assert mine["args"] == ref["args"] and mine["micro_batches"] == ref["micro_batches"]
        assert mine["scheduler"] == ref["scheduler"] and mine["consumed"] == ref["consumed"]
        assert _same(mine["state"], ref["state"]) == [], f"rank {rank}"
    for rank in range(4):
        mine, ref = live[rank].at_train[4], back[rank].at_train[4]
        assert mine["layout"] == ref["layout"] == (2, 1, 2)
        assert mine["args"] == ref["args"] and mine["micro_batches"] == ref["micro_batches"]
        assert mine["scheduler"] == ref["scheduler"] and mine["consumed"] == ref["consumed"]
        assert _same(mine["state"], ref["state"]) == [], f"rank {rank}"
        assert live[rank].iteration == 6
    for runs, its in ((to_dp3, (3, 4)), (back, (5, 6))):
        got = {i: live[r].losses[i] for r in range(len(runs)) for i in its if i in live[r].losses}
        ref = {i: runs[r].losses[i] for r in range(len(runs)) for i in its if i in runs[r].losses}
        assert got and got == ref


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_requests_and_a_failing_build_inside_megatron_lm(tmp_path):
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))
    job = dist.PrefixStore("mlm/", store)
    out: dict = {}
    first: dict = {}

    def spec(parallel, world=2, **model):
        """The job's own spec (as it posts it) in another layout, or of another model."""
        doc = dict(first, parallel=parallel, world={"nodes": 1, "gpus_per_node": world})
        doc["model"] = dict(first["model"], **model)
        return spec_from_dict(doc)

    def client():
        try:
            job.wait(["current"], datetime.timedelta(seconds=300))
            first.update(json.loads(job.get("current"))["spec"])
            out["failed"] = wait_answer(job, post_request(job, spec_to_dict(spec({"pp": 2}))), 300)
            path = tmp_path / "pp2.yaml"
            path.write_text(spec_to_yaml_text(spec({"pp": 2})))
            out["cli"] = subprocess.run(
                [sys.executable, "-m", "dynatrain.cli", "switch", str(path), "--store",
                 f"127.0.0.1:{port}/mlm", "--timeout", "300"],
                capture_output=True, text=True, timeout=400, cwd=ROOT)
            out["other"] = wait_answer(job, post_request(job, spec_to_dict(
                spec({"pp": 2}, hidden_size=128))), 300)
            out["four"] = wait_answer(job, post_request(job, spec_to_dict(
                spec({"tp": 2}, world=4))), 300)
        except Exception as err:  # noqa: BLE001 — reported by the asserts below
            out["error"] = err

    thread = threading.Thread(target=client, daemon=True)
    recs = lm.run_pretrain(lm.argv(tp=2, iters=60, extra=BASE), world=2, timeout=900,
                           fail_carry=1, started=thread.start, options=LiveOptions(
                               store=f"127.0.0.1:{port}", prefix="mlm", timeout=120))
    thread.join(timeout=60)
    assert "error" not in out, out.get("error")
    assert out["failed"].outcome == "failed" and out["failed"].exit_code == 4, out["failed"]
    assert "OptimizerParamScheduler refuses" in out["failed"].line or \
        "another process" in out["failed"].line
    cli = out["cli"]
    assert cli.returncode == 0 and cli.stdout.startswith("request 2: switched to "), cli
    assert out["other"].outcome == "refused" and out["other"].exit_code == 2
    assert out["four"].outcome == "refused" and "node0:gpu2" in out["four"].line
    for rec in recs:
        entries = [rec.at_train[k] for k in sorted(rec.at_train)]
        layouts = [e["layout"] for e in entries]
        # TP2 before and after the failed switch, with the same args; then PP2.
        assert layouts[0] == (2, 1, 1) and layouts[-1] == (1, 2, 1), layouts
        tp2 = [e for e in entries if e["layout"] == (2, 1, 1)]
        assert len(tp2) >= 2, layouts  # train() entered again after the failure, in TP2
        assert all(e["args"] == tp2[0]["args"] and e["micro_batches"] == tp2[0]["micro_batches"]
                   for e in tp2)
        assert rec.iteration == 60


def test_a_replacement_node_joins_the_running_job(tmp_path):
    """A replacement node started apart (its own launch, its own store, ``DYNATRAIN_JOIN_AS=node1``
    and the job's store in ``DYNATRAIN_STORE``) waits as two spares while node0 trains TP2; a
    request for TP2 DP2 on both nodes takes them in. Every rank's state then equals Megatron-LM's
    own restart from the checkpoint the live job saved at that iteration, ``--load``ed into TP2
    DP2 on four processes, and the next iterations' losses are equal."""
    import re

    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))
    job = dist.PrefixStore("mlm/", store)
    ckpt = str(tmp_path / "ckpt")
    base = BASE + ("--global-batch-size", "12")
    out: dict = {}

    def client():
        try:
            job.wait(["current"], datetime.timedelta(seconds=300))
            doc = json.loads(job.get("current"))["spec"]
            spares = ["node1:gpu0", "node1:gpu1"]
            job.wait([f"spare/{d}" for d in spares], datetime.timedelta(seconds=300))
            doc = dict(doc, world={"devices": ["node0:gpu0", "node0:gpu1", *spares]})
            out["answer"] = wait_answer(job, post_request(job, doc, source="test"), 300)
        except Exception as err:  # noqa: BLE001 — reported by the asserts below
            out["error"] = err

    thread = threading.Thread(target=client, daemon=True)
    recs = lm.run_pretrain(
        lm.argv(tp=2, iters=12, extra=base + ("--save", ckpt, "--save-interval", "1")), world=2,
        timeout=900, started=thread.start, joiners=2,
        join_env={"DYNATRAIN_JOIN_AS": "node1", "DYNATRAIN_STORE": f"127.0.0.1:{port}"},
        options=LiveOptions(store=f"127.0.0.1:{port}", prefix="mlm", timeout=120))
    thread.join(timeout=60)
    assert "error" not in out, out.get("error")
    ans = out["answer"]
    assert ans.outcome == "switched", ans
    [at] = map(int, re.findall(r"at iteration (\d+)", ans.line))
    assert at < 12, ans.line
    ref = lm.run_pretrain(lm.argv(tp=2, iters=12, load=ckpt, extra=base + (
        "--ckpt-step", str(at))), world=4, timeout=600)
    for rank, rec in enumerate(recs):  # the job's two ranks, then node1's
        mine, theirs = rec.at_train[at], ref[rank].at_train[at]
        assert mine["layout"] == theirs["layout"] == (2, 1, 2)
        assert mine["args"] == theirs["args"] and mine["micro_batches"] == theirs["micro_batches"]
        assert mine["scheduler"] == theirs["scheduler"] and mine["consumed"] == theirs["consumed"]
        assert _same(mine["state"], theirs["state"]) == [], f"rank {rank}"
        assert rec.iteration == 12
    its = range(at + 1, 13)
    got = {i: r.losses[i] for r in recs for i in its if i in r.losses}
    want = {i: r.losses[i] for r in ref for i in its if i in r.losses}
    assert got and got == want
