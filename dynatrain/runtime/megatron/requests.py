"""Switches asked for from outside a running job: an operator or a cluster scheduler posts a
target layout, or a preemption notice, to the job's store; the job takes it up at an iteration
boundary and answers.

The store is the one the job's ``Rendezvous`` uses (under torchrun the agent's TCPStore at
``MASTER_ADDR:MASTER_PORT``), under the same prefix. Keys (JSON documents, never pickle):

* ``requests``: a counter; a client takes the next number with an atomic add;
* ``request/<n>``: ``{"dst": <spec document>, "source": "<who asked>"}``, or a preemption
  notice ``{"notice": {"leaving": ["node3:gpu0", ...], "deadline_unix": <seconds since the
  epoch>}, "source": ...}``: those devices go away at that time (an absolute time, as schedulers
  announce it: the job's rank 0 counts the seconds left on its own clock, so the two hosts'
  clocks must agree, e.g. by NTP);
* ``notice/<n>``: ``{"dst": <spec document>, "predicted_s": <seconds or null>}``, the layout
  the job's rank 0 chose for notice ``n`` (the top of ``suggest`` on the devices that stay)
  and its predicted downtime; every process of the job prepares that one;
* ``taken/<n>``: the request as rank 0 read and accepted it (every process of the job
  prepares that copy, so a request rewritten meanwhile cannot make them disagree);
* ``current``: ``{"spec": <spec document>}``, the layout the job runs now (its rank 0 posts
  it at start and after every switch): a request starts from it to keep the job's model;
* ``answer/<n>``: what became of it, written once by the job's rank 0:
  ``{"outcome": "switched" | "refused" | "failed", "line": "<one line>", "exit": <status>}``,
  the line starting with what happened ("switched to ...", "refused: ...", "failed and rolled
  back, ...").

Exit statuses (``ir.errors``): switched 0; refused 2 (a spec that does not parse, another model,
a layout that does not fit the devices, a switch already under way: the job never started it);
failed 4 (the switch started and was rolled back: the job trains on in its previous layout).
A request that is not a JSON object (not UTF-8, not JSON, NaN or Infinity, a key given twice,
nested too deeply for the parser, over ``MAX_REQUEST_BYTES``) is refused in one line like any
other. A notice is refused when its deadline has passed by the time the job takes it up, when
it names a device that is not in the job (or every device), when no layout fits the rest, or
when a switch is already under way; a notice that is met says whether the switch ended before the
deadline. ``dynatrain switch --store HOST:PORT[/prefix] dst.yaml`` and ``dynatrain notice
--store ... --leaving DEVICES --deadline SECONDS`` are the command-line clients.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass

import torch.distributed as dist

from ...ir.errors import EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_OK, DynatrainError
from ...ir.strict import json_object

OUTCOME_EXIT = {"switched": EXIT_OK, "refused": EXIT_BAD_INPUT, "failed": EXIT_ABORTED}
MAX_REQUEST_BYTES = 64 << 20  # a spec document naming 100k devices is about 2 MiB


class StoreUnreachable(DynatrainError):
    """No store answers at the address given (bad input: exit status 2)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """What the job did with a request."""

    number: int
    outcome: str  # "switched", "refused" or "failed"
    line: str

    @property
    def exit_code(self) -> int:
        return OUTCOME_EXIT[self.outcome]


def parse_store_address(text: str) -> tuple[str, int, str]:
    """``HOST:PORT[/prefix]`` -> (host, port, prefix); the prefix defaults to ``dynatrain``.

    Raises:
        DynatrainError: one line naming what is wrong (exit status 2).
    """
    where, _, prefix = text.partition("/")
    host, sep, port = where.rpartition(":")
    if not sep or not host:
        raise DynatrainError(f"--store: expected HOST:PORT[/prefix] (got {text!r})")
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise DynatrainError(f"--store: the port must be an integer in 1..65535 (got {port!r})")
    return host, int(port), (prefix.strip("/") or "dynatrain")


def connect(address: str, timeout: float) -> dist.Store:
    """A client connection to the job's store, under its prefix."""
    host, port, prefix = parse_store_address(address)
    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, OSError, ValueError) as err:
        raise StoreUnreachable(f"--store {host}:{port}: no store answered within {timeout:g} s "
                               f"({type(err).__name__})") from None
    return dist.PrefixStore(prefix + "/", store)


def post_request(store: dist.Store, dst_doc: dict, source: str = "dynatrain switch") -> int:
    """Post a switch to the layout ``dst_doc`` (a spec document); its request number."""
    n = int(store.add("requests", 1))
    store.set(f"request/{n}", json.dumps({"dst": dst_doc, "source": source}, sort_keys=True))
    return n


def post_notice(store: dist.Store, leaving: list[str], deadline_s: float,
                source: str = "dynatrain notice") -> int:
    """Post a preemption notice: ``leaving`` go away ``deadline_s`` seconds from now (sent as
    an absolute time, ``time.time() + deadline_s``); its request number."""
    n = int(store.add("requests", 1))
    doc = {"notice": {"leaving": list(leaving), "deadline_unix": time.time() + deadline_s},
           "source": source}
    store.set(f"request/{n}", json.dumps(doc, sort_keys=True))
    return n


def wait_answer(store: dist.Store, n: int, timeout: float, poll: float = 0.1) -> Answer:
    """Wait for the job's answer to request ``n``.

    Raises:
        DynatrainError: no answer within ``timeout`` seconds (exit status 4: the job did not
            take the request up; it may still do so).
    """
    deadline = time.monotonic() + timeout
    key = f"answer/{n}"
    while not store.check([key]):
        if time.monotonic() > deadline:
            err = DynatrainError(f"request {n}: the job did not answer within {timeout:g} s (it "
                                 "takes requests up at iteration boundaries; is it training?)")
            err.exit_code = EXIT_ABORTED
            raise err
        time.sleep(poll)
    try:
        doc = parse_document(store.get(key), key)
        if doc.get("outcome") not in OUTCOME_EXIT or not isinstance(doc.get("line"), str):
            raise DynatrainError(f"{key}: expected {{'outcome': one of "
                                 f"{', '.join(OUTCOME_EXIT)}, 'line': text}}")
    except DynatrainError as err:  # not the job's answer: what became of the request is unknown
        err = DynatrainError(f"request {n}: the answer cannot be read ({err})")
        err.exit_code = EXIT_ABORTED
        raise err from None
    return Answer(n, doc["outcome"], doc["line"])


def read_request(store: dist.Store, n: int) -> dict | None:
    """Request ``n`` as posted (None: numbered, not written yet), parsed strictly.

    Raises:
        DynatrainError: one line naming what is wrong (the job refuses it, exit status 2).
    """
    key = f"request/{n}"
    return parse_document(store.get(key), key) if store.check([key]) else None


def parse_document(raw: bytes, key: str) -> dict:
    """The JSON object stored under ``key``, parsed strictly (what a client wrote is not
    trusted: UTF-8, standard JSON, no key twice, at most ``MAX_REQUEST_BYTES``).

    Raises:
        DynatrainError: one line starting with ``key``, saying what is wrong (exit status 2).
    """
    if len(raw) > MAX_REQUEST_BYTES:
        raise DynatrainError(f"{key}: {len(raw)} bytes, over the {MAX_REQUEST_BYTES} a "
                             "request may hold")
    return json_object(raw, key, "named fields", finite=True)


def answer(store: dist.Store, n: int, outcome: str, line: str) -> None:
    """Write the job's answer to request ``n`` (the job's rank 0)."""
    if outcome not in OUTCOME_EXIT:
        raise ValueError(f"unknown outcome {outcome!r}")
    store.set(f"answer/{n}", json.dumps({"outcome": outcome, "line": line,
                                         "exit": OUTCOME_EXIT[outcome]}, sort_keys=True))
