"""Where the processes of a job, and those that may join it, meet: a key-value store they all
reach, used to form process groups and to publish switches.

A ``Rendezvous`` wraps a ``torch.distributed`` store that every process of the job can reach,
spare and late-starting processes included: under ``torchrun`` the agent's own TCPStore
(``TCPStore(MASTER_ADDR, MASTER_PORT, is_master=False)``), on one machine a ``FileStore``, on a
cluster any TCPStore that outlives the processes. Everything dynatrain writes lives under
``prefix/``:

* ``form(name, devices, device)`` makes the default process group the processes of
  ``devices`` (rank = position in ``devices``), destroying the one this process had. Each
  ``name`` is used once per job: its keys are the group's rendezvous.
* ``post``/``read``/``wait`` publish and read small JSON documents (switch announcements;
  never pickle, so a process reads nothing but data from the store).
* ``vote(name, devices, device, outcome)`` is a commit vote through the store, not through a
  process group, so it still works while processes move between groups.
* ``beat``/``beats`` are per-device heartbeat counters (``recovery.Heartbeat`` bumps them; a
  counter that stops moving is a process that stopped answering); ``present`` is a bounded
  roll call that gives up early on devices known to be dead and returns who did not answer;
  ``propose`` is first-writer-wins (``compare_set``), so processes agree on one value.

Every wait is bounded (``timeout``, default the rendezvous's; only ``wait`` may be told to wait
on, for a spare idling until a switch names it), logs who it still waits for to the
``dynatrain.runtime`` logger every ``LOG_EVERY`` seconds, and on timeout raises
``RendezvousTimeout`` naming the devices that did not come.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import threading
import time
from collections.abc import Sequence

import torch.distributed as dist

from ...ir.errors import EXIT_ABORTED, DynatrainError

log = logging.getLogger("dynatrain.runtime")
LOG_EVERY = 5.0  # seconds between two "still waiting for ..." lines of one wait
CHECK_KEYS = 4096  # keys looked up in one store request (see Rendezvous.has_all)


def release_in_background(groups: list) -> None:
    """Drop ``groups``, destroyed process groups whose last references this list holds (the
    caller's are gone), in a thread of its own: a gloo group's destructor joins its threads,
    about 5 ms a group on the test machine, and torch releases the GIL while it runs, so the
    switch goes on meanwhile. Objects that still use a group (an old job's modules) keep it
    until they go."""
    held = [groups.pop() for _ in range(len(groups))]
    threading.Thread(target=held.clear, name="dynatrain-release-groups", daemon=True).start()


class RendezvousTimeout(DynatrainError):
    """A wait on the rendezvous store did not complete in time.

    Attributes:
        missing: the devices that did not come (empty when the waiter did not know who).
    """

    exit_code = EXIT_ABORTED  # peers did not come: whatever waited on them did not happen

    def __init__(self, message: str, missing: Sequence[str] = ()) -> None:
        self.missing = tuple(missing)
        super().__init__(message)


def _names(devices: Sequence[str], limit: int = 8) -> str:
    more = f" and {len(devices) - limit} more" if len(devices) > limit else ""
    return ", ".join(devices[:limit]) + more


class _Waiting:
    """Logs, at most every ``LOG_EVERY`` seconds, who a wait still waits for."""

    def __init__(self, what: str, timeout: float) -> None:
        self.what, self.timeout = what, timeout
        self.start = self.next = time.monotonic()
        self.next += LOG_EVERY

    def due(self, now: float) -> bool:
        return now >= self.next

    def tick(self, missing: Sequence[str] = ()) -> None:
        now = time.monotonic()
        if self.due(now):
            self.next = now + LOG_EVERY
            limit = "" if math.isinf(self.timeout) else f" of {self.timeout:.0f} s"
            who = f": still waiting for {_names(missing)}" if missing else ""
            log.info("%s%s (%.0f s%s)", self.what, who, now - self.start, limit)


class Rendezvous:
    """A store every process of the job reaches, the backend its groups use, and a prefix.

    Args:
        store: a ``torch.distributed`` Store shared by all processes (TCPStore, FileStore).
        backend: the backend of every process group formed (``"nccl"``, ``"gloo"``).
        prefix: the namespace of this job's keys in the store.
        timeout: seconds a group formation or a wait for peers may take (read at each call);
            ``form`` sets it as the store's timeout (gloo's connection setup waits on it).
        init_kwargs: extra ``init_process_group`` arguments (e.g. ``device_id`` for NCCL).
        group_timeout: seconds a collective of a default group it forms waits for a peer
            (None: ``timeout``). Bounded like ``LiveSwitcher(collective_timeout=...)``, it
            releases a process blocked on a dead peer in the training loop's own collectives
            on that group, so that it reaches ``recover`` in that time.

    Example:
        >>> store = dist.TCPStore(host, port, is_master=False)  # doctest: +SKIP
        >>> rdzv = Rendezvous(store, "nccl", timeout=120)
        >>> rdzv.form("start", layout.devices, "node0:gpu3")
    """

    def __init__(self, store: dist.Store, backend: str, *, prefix: str = "dynatrain",
                 timeout: float = 60.0, init_kwargs: dict | None = None,
                 group_timeout: float | None = None) -> None:
        if group_timeout is not None and not group_timeout > 0:
            raise ValueError(f"group_timeout: seconds > 0 (got {group_timeout!r})")
        self.backend, self.prefix, self.timeout = backend, prefix.rstrip("/"), timeout
        self.group_timeout = group_timeout
        self.init_kwargs = dict(init_kwargs or {})
        self.store = dist.PrefixStore(self.prefix + "/", store)

    def __repr__(self) -> str:
        return f"Rendezvous({self.backend!r}, prefix={self.prefix!r}, timeout={self.timeout})"

    # ---- process groups ----------------------------------------------------------------------

    def form(self, name: str, devices: Sequence[str], device: str, dead=None) -> None:
        """Make the default process group exactly the processes of ``devices``.

        Every process of ``devices`` calls it with the same ``name`` (fresh for each group);
        this process becomes rank ``devices.index(device)``. A default group this process
        had is destroyed first (with every group made from it). ``dead()`` (a callable
        returning a set of devices, e.g. those whose heartbeat stopped) ends the wait early
        once a device still missing is in it: the group cannot be formed without it.

        Raises:
            ValueError: ``device`` is not in ``devices``.
            RendezvousTimeout: some of ``devices`` did not arrive within the timeout, or are
                dead (named).
        """
        if device not in devices:
            raise ValueError(f"{device} is not one of the {len(devices)} devices of group "
                             f"{name!r}")
        self.leave()
        td = datetime.timedelta(seconds=self.timeout)
        self.store.set_timeout(td)
        # torch's own store barrier says how many are missing, not who: meet here first.
        self.store.set(f"arrived/{name}/{device}", "1")
        keys = [f"arrived/{name}/{d}" for d in devices]
        self._all(f"forming group {name!r}", keys, list(devices), self.timeout, dead=dead,
                  any_dead=True)
        missing = [d for k, d in zip(keys, devices) if not self.store.check([k])]
        if missing:  # only with ``dead``: one that will never come ends the wait
            gone = sorted(set(missing) & set(dead()), key=list(devices).index) or missing
            raise RendezvousTimeout(f"forming group {name!r}: {_names(gone)} "
                                    f"{'is' if len(gone) == 1 else 'are'} gone (no heartbeat)",
                                    gone)
        collectives = td if self.group_timeout is None else \
            datetime.timedelta(seconds=self.group_timeout)
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"pg/{name}/", self.store),
                                rank=list(devices).index(device), world_size=len(devices),
                                timeout=collectives,
                                **self.init_kwargs)

    @staticmethod
    def leave() -> None:
        """Destroy this process's default group (and all groups made from it), if any."""
        if dist.is_initialized():
            held = list(dist.distributed_c10d._world.pg_map)
            dist.destroy_process_group()
            release_in_background(held)

    # ---- documents ---------------------------------------------------------------------------

    def post(self, key: str, doc: dict) -> None:
        """Publish a JSON document under ``key``."""
        self.store.set(key, json.dumps(doc, sort_keys=True))

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def has_all(self, keys: Sequence[str]) -> bool:
        """Whether every key of ``keys`` exists: one store request per ``CHECK_KEYS`` keys
        (TCPStore's server drops a client that checks over 131072 keys in one request)."""
        return all(self.store.check(list(keys[i:i + CHECK_KEYS]))
                   for i in range(0, len(keys), CHECK_KEYS))

    def read(self, key: str) -> dict | None:
        """The document under ``key``, or None if there is none yet (does not wait)."""
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def wait(self, key: str, timeout: float | None = None, *,
             unless: str | Sequence[str] | None = None, poll: float = 0.05,
             who: Sequence[str] = ()) -> dict | None:
        """The document under ``key`` once it exists; None if ``unless`` (a key, or any of
        several) appears first.

        Polls the store, from every millisecond up to every ``poll`` seconds. ``who``: the
        devices expected to post ``key``, named in the log and the error.

        Raises:
            RendezvousTimeout: neither appeared within ``timeout`` seconds (None: wait on,
                e.g. a spare waiting for a switch that names it).
        """
        limit = math.inf if timeout is None else timeout
        deadline = time.monotonic() + limit
        waiting = _Waiting(f"waiting for {key!r}", limit)
        pause = 0.001
        others = [unless] if isinstance(unless, str) else list(unless or ())
        while True:
            if self.store.check([key]):
                return json.loads(self.store.get(key))
            if any(self.store.check([k]) for k in others):
                return None
            if time.monotonic() > deadline:
                by = f" (to be posted by {_names(who)})" if who else ""
                raise RendezvousTimeout(f"{key!r} did not appear in the store within "
                                        f"{limit:.1f} s{by}", who)
            waiting.tick(who)
            time.sleep(pause)
            pause = min(pause * 2, poll)

    def _all(self, what: str, keys: Sequence[str], devices: Sequence[str],
             timeout: float, poll: float = 0.05, dead=None, any_dead: bool = False) -> None:
        """Wait until every key of ``keys`` (posted by ``devices``, in order) exists, or (with
        ``dead``) every device still missing is dead (``any_dead``: one of them is)."""
        deadline = time.monotonic() + timeout
        waiting = _Waiting(what, timeout)
        pause = 0.001
        while not self.has_all(keys):  # few requests for all; names only when needed
            now = time.monotonic()
            if now > deadline or waiting.due(now) or dead is not None:
                missing = [d for k, d in zip(keys, devices) if not self.store.check([k])]
                gone = set(missing) & set(dead()) if dead is not None else set()
                if not missing or (gone and (any_dead or gone == set(missing))):
                    return
                if now > deadline:
                    raise RendezvousTimeout(f"{what}: {len(missing)} of {len(devices)} "
                                            f"device(s) did not come within {timeout:.1f} s: "
                                            f"{_names(missing)}", missing)
                waiting.tick(missing)
            time.sleep(pause)
            pause = min(pause * 2, poll)

    def present(self, name: str, devices: Sequence[str], device: str, timeout: float, *,
                dead=None, poll: float = 0.05) -> tuple[str, ...]:
        """A roll call: post that ``device`` is here, wait for ``devices`` to say so too.

        Waits at most ``timeout`` seconds, less once every device still missing is one that
        ``dead()`` (a callable returning a set of devices; None: none known) says is dead.
        Logs who is still missing while it waits.

        Returns:
            The devices that did not answer, in ``devices`` order (empty: all came).
        """
        self.store.set(f"{name}/{device}", "1")
        keys = {d: f"{name}/{d}" for d in devices}
        deadline = time.monotonic() + timeout
        waiting = _Waiting(f"roll call {name!r}", timeout)
        pause = 0.001
        every = list(keys.values())
        while True:
            # a few requests while some are missing; one per device only to name them
            missing = ([] if self.has_all(every) else
                       [d for d in devices if not self.store.check([keys[d]])])
            if not missing or time.monotonic() > deadline:
                return tuple(missing)
            if dead is not None and set(missing) <= set(dead()):
                return tuple(missing)
            waiting.tick(missing)
            time.sleep(pause)
            pause = min(pause * 2, poll)

    def propose(self, key: str, doc: dict) -> dict:
        """Post ``doc`` under ``key`` unless some process did first; the document that won."""
        won = self.store.compare_set(key, "", json.dumps(doc, sort_keys=True))
        return json.loads(won)

    def beat(self, device: str) -> None:
        """Advance ``device``'s heartbeat counter."""
        self.store.add(f"beat/{device}", 1)

    def beats(self, devices: Sequence[str]) -> dict[str, int]:
        """Every device's heartbeat counter (0: it never beat)."""
        return {d: int(self.store.add(f"beat/{d}", 0)) for d in devices}

    def count(self, key: str, add: int = 0) -> int:
        """Atomically add ``add`` to the counter ``key``; its new value."""
        return int(self.store.add(key, add))

    def vote(self, name: str, devices: Sequence[str], device: str, outcome: str,
             timeout: float | None = None, *, dead=None) -> dict[str, str | None]:
        """Post this process's ``outcome`` ("ok" or why not) and wait for every device's.

        Returns every device's outcome; None for a device that did not vote in time (then the
        wait stopped at ``timeout``, default the rendezvous timeout, and logged who is missing)
        or that ``dead()`` (as for ``present``) says is dead, which ends the wait early.
        """
        self.post(f"{name}/{device}", {"outcome": outcome})
        keys = [f"{name}/{d}" for d in devices]
        try:
            self._all(f"vote {name!r}", keys, list(devices),
                      self.timeout if timeout is None else timeout, dead=dead)
        except RendezvousTimeout as err:
            log.warning("%s", err)
        out: dict[str, str | None] = {}
        for d, k in zip(devices, keys):
            doc = self.read(k)
            out[d] = None if doc is None else str(doc["outcome"])
        return out


__all__ = ["Rendezvous", "RendezvousTimeout"]
