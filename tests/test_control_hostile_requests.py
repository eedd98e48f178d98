"""Requests posted to a running job's store by a client that does not follow the protocol
(``runtime.megatron.requests``): rank 0 refuses each in one line with exit status 2, and the job
takes up the next good request as usual; every process prepares the request as rank 0 accepted
it, even if ``request/<n>`` is rewritten afterwards. Without processes: a stand-in switcher on
an in-memory store, rank 0's look at the store (``_look``) and every process's take-up
(``_take``) called as ``LiveControl.due`` calls them. The clients (``dynatrain switch``,
``dynatrain notice``) likewise refuse what they read from the store if no job of this version
wrote it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from dynatrain import cli
from dynatrain.ir.errors import DynatrainError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec, spec_to_dict
from dynatrain.runtime.megatron.control import LiveControl
from dynatrain.runtime.megatron.rendezvous import Rendezvous
from dynatrain.runtime.megatron.requests import MAX_REQUEST_BYTES, wait_answer

SPECS = Path(__file__).resolve().parents[1] / "specs" / "tiny-gpt"


def _control() -> tuple[LiveControl, Rendezvous, list]:
    spec = load_spec(SPECS / "tp2-dp2.yaml")
    rdzv = Rendezvous(dist.HashStore(), "gloo", prefix="t")
    prepared: list = []
    sw = SimpleNamespace(rendezvous=rdzv, leader=True, active=True, spec=spec,
                         layout=Layout(spec), group=None, prepare=prepared.append)
    return LiveControl(sw, requests=True), rdzv, prepared


def _post(rdzv: Rendezvous, raw: bytes) -> int:
    n = int(rdzv.store.add("requests", 1))
    rdzv.store.set(f"request/{n}", raw)
    return n


def _good() -> bytes:
    dst = load_spec(SPECS / "pp2-dp2.yaml")
    return json.dumps({"dst": spec_to_dict(dst, Layout(dst).devices)}).encode()


HOSTILE = [
    (b"\xff\xfe{}", "request/1: not UTF-8 (byte 0)"),
    (b'{"dst": ', "request/1: not JSON ("),
    (b"[" * 200_000, "request/1: not JSON (nested too deeply)"),
    (b'"a layout"', "request/1: must be a JSON object of named fields (got str)"),
    (b"[1, 2]", "request/1: must be a JSON object of named fields (got list)"),
    (b"1e999", "request/1: must be a JSON object of named fields (got float)"),
    (b'{"dst": {}, "dst": {}}', "request/1: duplicate key 'dst': each key may appear once"),
    (b'{"notice": {"leaving": ["node0:gpu3"], "deadline_unix": NaN}}',
     "request/1: NaN is not a JSON number (expected a finite number)"),
    (b'{"notice": {"leaving": ["node0:gpu3"], "deadline_unix": -Infinity}}',
     "request/1: -Infinity is not a JSON number"),
    (b'{"notice": {"leaving": ["node0:gpu3"], "deadline_unix": 1e999}}',
     "notice: expected {'leaving': [device names], 'deadline_unix': seconds since the "
     "epoch, a finite number}"),
    (b'{"notice": {"leaving": "node0:gpu3", "deadline_unix": 1}}',
     "notice: expected {'leaving': [device names]"),
    (b'{"notice": [1]}', "notice: expected {'leaving': [...], 'deadline_unix': ...}"),
    (b'{"dst": 5}', "request: expected a document with a 'dst' layout spec"),
    (b'{"dst": {"model": 5}}', ""),  # the spec's own one-line error
    (b"", "request/1: not JSON ("),
]


@pytest.mark.parametrize("raw, says", HOSTILE, ids=[f"case{i}" for i in range(len(HOSTILE))])
def test_a_request_that_breaks_the_protocol_is_refused_in_one_line(raw: bytes, says: str):
    control, rdzv, prepared = _control()
    n = _post(rdzv, raw)
    assert control._look() == (n, 0, 0)  # answered, not taken
    got = wait_answer(rdzv.store, n, timeout=1)
    assert got.outcome == "refused" and got.exit_code == 2, got
    assert got.line.startswith("refused: ") and says in got.line and "\n" not in got.line, got
    assert "Traceback" not in got.line and not prepared
    good = _post(rdzv, _good())  # the job takes the next request up as usual
    assert control._look() == (good, 1, 0)


def test_a_request_over_the_size_limit_is_refused_unread(monkeypatch):
    monkeypatch.setattr("dynatrain.runtime.megatron.requests.MAX_REQUEST_BYTES", 1000)
    control, rdzv, _ = _control()
    n = _post(rdzv, b'{"dst": "' + b"x" * 2000 + b'"}')
    control._look()
    got = wait_answer(rdzv.store, n, timeout=1)
    assert got.exit_code == 2 and "request/1: 2011 bytes, over the 1000" in got.line, got
    assert MAX_REQUEST_BYTES >= 16 << 20  # room for a spec naming 100k devices


def test_every_process_prepares_the_request_as_rank_0_accepted_it():
    control, rdzv, prepared = _control()
    n = _post(rdzv, _good())
    assert control._look() == (n, 1, 0)
    rdzv.store.set(f"request/{n}", b"rewritten after rank 0 took it up")
    control._take(n, 0)  # every process, after rank 0's broadcast
    dst = load_spec(SPECS / "pp2-dp2.yaml")
    assert [spec_to_dict(s, Layout(s).devices) for s in prepared] == [
        spec_to_dict(dst, Layout(dst).devices)]
    assert control.pending is not None and control.pending.request == n


@pytest.mark.parametrize("raw, says", [
    (b"not json", "request 1: the answer cannot be read (answer/1: not JSON ("),
    (b'{"outcome": "won", "line": "?"}', "answer/1: expected {'outcome': one of switched, "),
    (b'{"outcome": "switched"}', "answer/1: expected {'outcome'"),
])
def test_a_client_refuses_an_answer_that_is_not_the_jobs(raw: bytes, says: str) -> None:
    store = dist.HashStore()
    store.set("answer/1", raw)
    with pytest.raises(DynatrainError) as err:
        wait_answer(store, 1, timeout=1)
    assert says in str(err.value) and "\n" not in str(err.value), err.value
    assert err.value.exit_code == 4  # what became of the request is unknown


def test_the_notice_command_refuses_a_store_whose_current_layout_is_not_a_jobs(capsys) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{server.port}/job"
    job = dist.PrefixStore("job/", server)  # as the client sees the store (``connect``)
    for raw, says in [(b"\x80", "current: not UTF-8 (byte 0)"),
                      (b'{"spec": 1}', "current: expected {'spec': the job's layout spec}")]:
        job.set("current", raw)
        code = cli.main(["notice", "--leaving", "node0:gpu3", "--deadline", "30", "--store",
                         address, "--timeout", "1"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and says in err, err
        assert err.startswith(f"dynatrain: error: --store {address}: "), err
    assert not job.check(["requests"])  # nothing posted


class _Counting:
    """A store that counts the keys looked up per request (``check``)."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.checks = store, []

    def check(self, keys: list[str]) -> bool:
        self.checks.append(len(keys))
        return self.store.check(keys)

    def __getattr__(self, name: str):
        return getattr(self.store, name)


def test_a_layout_naming_a_million_devices_is_refused_after_a_few_store_requests() -> None:
    # Rank 0 looks the devices outside the job up as spares while every process waits for it
    # at the boundary: a batch per request, one by one only up to the first five missing.
    control, rdzv, _ = _control()
    rdzv.store = _Counting(rdzv.store)
    dst = load_spec(SPECS / "tp2-dp2.yaml")
    doc = spec_to_dict(dst, Layout(dst).devices)
    doc["world"] = {"nodes": 131_072, "gpus_per_node": 8}
    for d in ("node7:gpu1", "node9:gpu0"):  # two of them wait as spares
        rdzv.store.set(f"spare/{d}", b"{}")
    n = _post(rdzv, json.dumps({"dst": doc}).encode())
    rdzv.store.checks.clear()
    control._look()
    got = wait_answer(rdzv.store, n, timeout=1)
    assert got.exit_code == 2 and got.line == (
        "refused: world: the layout needs 1048576 devices; node0:gpu4, node0:gpu5, node0:gpu6, "
        "node0:gpu7 and more neither run(s) a rank of the job nor wait(s) as a spare"), got
    assert max(rdzv.store.checks) <= 4096 and len(rdzv.store.checks) < 20, rdzv.store.checks


def test_every_key_of_a_world_over_the_tcpstore_limit_is_checked_without_losing_the_store():
    # TCPStore's server drops a client that checks over 131072 keys in one request: a world
    # that large is looked up in batches, and the store still answers afterwards.
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rdzv = Rendezvous(dist.TCPStore("127.0.0.1", server.port, is_master=False), "gloo",
                      prefix="w")
    keys = [f"ready/node{i // 8}:gpu{i % 8}" for i in range(140_000)]
    for i in range(0, len(keys), 65_536):  # (the server's limit holds for multi_set too)
        rdzv.store.multi_set(keys[i:i + 65_536], [b"1"] * len(keys[i:i + 65_536]))
    assert rdzv.has_all(keys) and not rdzv.has_all(keys + ["ready/node99999:gpu0"])
    rdzv.post("after", {"ok": True})
    assert rdzv.read("after") == {"ok": True}
