"""Preemption notices through the job's store: ``dynatrain notice --store HOST:PORT/prefix
--leaving DEVICES --deadline SECONDS`` (or ``requests.post_notice``) tells a job running under
``LiveControl`` that devices go away; its rank 0 checks the notice, picks the best layout on the
devices that stay (``suggest``) and every process prepares it while the job trains; the job
switches at the first boundary where every plan is ready and answers whether it met the
deadline.

Four forked gloo processes train DP4 (``megatron_support.failures.store_notice_worker``) on a
TCPStore this process hosts; a client thread posts, one after another:

* a notice whose deadline has already passed: refused, exit 2, the job trains on;
* a notice naming a device that is not in the job: refused, exit 2;
* a notice document whose deadline is not a finite number: refused, exit 2;
* with the command, node0:gpu3 leaves in 60 s: switched to the suggested layout on the other
  three, exit 0, one line saying the notice was met; node0:gpu3 leaves the job;
* a second notice posted while that one is under way: refused, exit 2;
* with the command, a deadline that is not a positive number, and a store that does not answer:
  one line each, exit 2, nothing posted.

(That such a switch leaves the state bit for bit where megatron's reload puts it is
``test_live_failures.test_a_preemption_notice_is_met_by_a_switch_before_the_deadline``.)
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from dynatrain.runtime.megatron.requests import post_notice, wait_answer
from matrix import case
from megatron_support import elastic
from megatron_support import failures as fl

MODEL = dict(num_layers=4, num_query_groups=2, swiglu=True, vocab_size=200)
DEV = [f"node0:gpu{i}" for i in range(4)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dynatrain.cli", *argv], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_notices_through_the_store_and_the_command() -> None:
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    job_store = dist.PrefixStore("job/", store)
    address = f"127.0.0.1:{port}/job"
    outcomes: dict = {}

    def client() -> None:
        try:
            while not job_store.check(["current"]):  # the job posts its layout once it runs
                time.sleep(0.05)
            outcomes["passed"] = wait_answer(job_store, post_notice(job_store, [DEV[3]], -1.0,
                                                                    "test"), 240)
            outcomes["unknown"] = wait_answer(job_store, post_notice(
                job_store, ["node7:gpu0"], 60.0, "test"), 240)
            # A hostile document (json writes inf as Infinity): refused, rank 0 trains on.
            n = int(job_store.add("requests", 1))
            job_store.set(f"request/{n}", json.dumps({"notice": {
                "leaving": [DEV[3]], "deadline_unix": float("inf")}}))
            outcomes["infinite"] = wait_answer(job_store, n, 240)
            cmd = _cli("notice", "--leaving", DEV[3], "--deadline", "60", "--store", address,
                       "--timeout", "240")
            while int(job_store.add("requests", 0)) < 4:
                time.sleep(0.01)
            during = post_notice(job_store, [DEV[2]], 60.0, "test")
            outcomes["cmd"] = (*cmd.communicate(timeout=300), cmd.returncode)
            outcomes["during"] = wait_answer(job_store, during, 240)
            for name, argv in {"nan": ("--deadline", "nan", "--store", address),
                               "zero": ("--deadline", "0", "--store", address),
                               "nostore": ("--deadline", "30", "--store",
                                           f"127.0.0.1:{_free_port()}", "--connect-timeout",
                                           "1")}.items():
                p = _cli("notice", "--leaving", DEV[1], *argv)
                outcomes[name] = (*p.communicate(timeout=120), p.returncode)
            outcomes["requests"] = int(job_store.add("requests", 0))
        finally:
            job_store.set("test-stop", "1")

    fns = {d: fl.store_notice_worker(case("dp4", 4, **MODEL), d, DEV, port, 12, 60.0, 30.0)
           for d in DEV}
    thread = threading.Thread(target=client, daemon=True)
    try:  # the client starts once every process is forked (never fork beside a busy thread)
        got = elastic.run_processes(fns, timeout=600.0, started=thread.start)
    finally:
        if thread.ident is not None:  # started
            thread.join(timeout=30)
    passed, unknown, during = outcomes["passed"], outcomes["unknown"], outcomes["during"]
    assert passed.exit_code == 2 and "before the job took the notice up" in passed.line, passed
    assert unknown.exit_code == 2 and "node7:gpu0 is not a device of the job" in unknown.line
    out, err, code = outcomes["cmd"]
    assert code == 0 and err == "" and out.count("\n") == 1, outcomes["cmd"]
    assert out.startswith("request 4: switched to ") and "on 3 devices" in out, out
    assert "met the notice" in out and "before its deadline" in out, out
    assert during.exit_code == 2 and "already under way (request 4)" in during.line, during
    infinite = outcomes["infinite"]
    assert infinite.exit_code == 2 and "a finite number" in infinite.line, infinite
    for name, says in (("nan", "--deadline"), ("zero", "--deadline"),
                       ("nostore", "no store answered")):
        out, err, code = outcomes[name]
        assert code == 2 and out == "" and err.count("\n") == 1 and says in err, (name, err)
    assert outcomes["requests"] == 5  # the refused commands posted nothing
    assert got[DEV[3]]["role"] == "left"
    for d in DEV[:3]:
        r = got[d]
        assert r["role"] == "stayed" and r["devices"] == DEV[:3], r
        seen = [n for i, n in enumerate(r["layouts"]) if i == 0 or r["layouts"][i - 1] != n]
        assert len(seen) == 2, seen
        # Trained through all of it: one layout per boundary, every iteration counted once.
        assert r["iteration"] == len(r["layouts"]) - 1, r
