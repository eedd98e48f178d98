"""Switches asked for from outside a running job, through the job's store: the command
``dynatrain switch --store HOST:PORT/prefix dst.yaml`` posts the target, the job takes it up at
an iteration boundary (``LiveControl``), plans it in the background while it trains, switches,
and the command prints the outcome in one line with its exit status.

Two forked gloo workers train a TP2 job (``megatron_support.live``) on a TCPStore that this
process hosts; requests come one after another while the job trains:

* a spec of another model: refused by the planner, exit 2, the job trains on in TP2;
* a layout on 4 devices (the job has 2, no spares): refused at once, exit 2;
* PP2, asked for with the command: switched, exit 0, one line;
* two requests posted back to back (library calls): the first switches back to TP2, the
  second is refused because a switch is under way (exit 2);
* a store that cannot be reached: one line, exit 2.

Every process must have trained through all of it and end in TP2 with the iterations counted
once each; the command's only output is its one line.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_to_dict, spec_to_yaml_text
from dynatrain.runtime.megatron import LiveSwitcher, MegatronJob, Rendezvous
from dynatrain.runtime.megatron.control import LiveControl
from dynatrain.runtime.megatron.requests import post_request, wait_answer
from dynatrain.verify.check import check
from matrix import case, to_harness_cfg, to_spec
from megatron_support import live

CFG_A = case("tp2", 2, tp=2, num_query_groups=2, swiglu=True, vocab_size=256)
CFG_B = case("pp2", 2, pp=2, num_query_groups=2, swiglu=True, vocab_size=256)
CFG_OTHER = case("other-model", 2, tp=2, num_query_groups=2, swiglu=True, vocab_size=256,
                 hidden_size=128)
CFG_FOUR = case("tp2-dp2", 4, tp=2, num_query_groups=2, swiglu=True, vocab_size=256)
PREFIX = "job"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynatrain.cli", *argv], capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__))))


def test_switches_asked_for_through_the_store(tmp_path) -> None:
    spec_a, spec_b = to_spec(CFG_A), to_spec(CFG_B)
    configs = {"tp2": live.resolve(to_harness_cfg(CFG_A)),
               "pp2": live.resolve(to_harness_cfg(CFG_B))}
    files = {}
    for cfg in (CFG_A, CFG_B, CFG_OTHER, CFG_FOUR):
        files[cfg["name"]] = tmp_path / f"{cfg['name']}.yaml"
        files[cfg["name"]].write_text(spec_to_yaml_text(to_spec(cfg)))
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    address = f"127.0.0.1:{port}/{PREFIX}"
    outcomes: dict = {}

    def client() -> None:
        try:
            job_store = dist.PrefixStore(PREFIX + "/", store)
            # Library calls for the refusals; the command for the switch (its output and status).
            for name in ("other-model", "tp2-dp2"):
                spec = to_spec({"other-model": CFG_OTHER, "tp2-dp2": CFG_FOUR}[name])
                outcomes[name] = wait_answer(job_store, post_request(job_store, spec_to_dict(
                    spec), "test"), 240)
            outcomes["pp2"] = _cli("switch", str(files["pp2"]), "--store", address,
                                   "--timeout", "240")
            first = post_request(job_store, spec_to_dict(spec_a), "test")
            second = post_request(job_store, spec_to_dict(spec_b), "test")
            outcomes["back"] = wait_answer(job_store, first, 240)
            outcomes["during"] = wait_answer(job_store, second, 240)
            outcomes["unreachable"] = _cli("switch", str(files["pp2"]), "--store",
                                           f"127.0.0.1:{_free_port()}", "--connect-timeout", "1")
        finally:
            job_store = dist.PrefixStore(PREFIX + "/", store)
            job_store.set("test-stop", "1")

    def work(rank: int) -> dict:
        cfg_of: dict[int, dict] = {}

        def build(spec) -> MegatronJob:
            c = configs[spec.name]
            j = live.build(c, seed=c["seed"])
            cfg_of[id(j.optimizer)] = c
            return MegatronJob(j.ddps, j.optimizer)

        def train(job: MegatronJob) -> None:
            c = cfg_of[id(job.optimizer)]
            live.train_step(live.Job(c, [d.module.module for d in job.model_chunks],
                                     job.model_chunks, job.optimizer), job.iteration)
            job.iteration += 1

        client_store = dist.TCPStore("127.0.0.1", port, is_master=False,
                                     timeout=datetime.timedelta(seconds=120))
        rdzv = Rendezvous(client_store, "gloo", prefix=PREFIX, timeout=60)
        live.init_parallel(configs["tp2"])
        job = build(spec_a)
        sw = LiveSwitcher(spec_a, Layout(spec_a).devices[rank], build, check, rendezvous=rdzv,
                          timeout=60)
        ctl = LiveControl(sw)
        layouts = []
        while True:
            job = ctl.boundary(job)
            layouts.append(sw.spec.name)
            stop = torch.tensor([int(sw.leader and rdzv.has("test-stop"))])
            dist.broadcast(stop, src=0)
            if stop.item() or job.iteration >= 3000:
                break
            train(job)
            time.sleep(0.05)  # leave the cores to the commands (a CPU machine is shared)
        return {"layouts": layouts, "tp": ps.get_tensor_model_parallel_world_size(),
                "iteration": job.iteration}

    thread = threading.Thread(target=client, daemon=True)
    try:
        results = live.run_workers(work, 2, timeout=600, started=thread.start)
    finally:
        thread.join(timeout=30)
    other, four, pp2 = outcomes["other-model"], outcomes["tp2-dp2"], outcomes["pp2"]
    assert other.exit_code == 2 and other.line.startswith("refused:"), other
    assert "same model" in other.line, other
    assert four.exit_code == 2 and four.line.startswith("refused: world:"), four
    assert "node0:gpu2" in four.line, four
    assert pp2.returncode == 0 and pp2.stdout.startswith("request 3: switched to pp2"), pp2
    assert outcomes["back"].outcome == "switched" and outcomes["back"].exit_code == 0
    assert outcomes["during"].outcome == "refused" and outcomes["during"].exit_code == 2
    assert "already under way (request 4)" in outcomes["during"].line
    bad = outcomes["unreachable"]
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1, bad
    assert "no store answered" in bad.stderr
    for res in results:
        assert res["tp"] == 2 and res["layouts"][-1] == "tp2"
        seen = [n for i, n in enumerate(res["layouts"]) if i == 0 or res["layouts"][i - 1] != n]
        assert seen == ["tp2", "pp2", "tp2"], seen
        assert res["iteration"] == len(res["layouts"]) - 1
