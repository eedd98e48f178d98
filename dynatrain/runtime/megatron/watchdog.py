"""Release collectives blocked on a dead peer at once, where the backend can (NCCL).

A collective whose peer died or stopped blocks until its group's timeout. NCCL communicators
can be aborted from another thread (``ProcessGroupNCCL.abort``, what nvidia-resiliency-ext's
in-process restart does, and torch's ``distributed_c10d._abort_process_group``, which aborts
every group of the process between ``ncclGroupStart``/``ncclGroupEnd`` so that the aborts do
not deadlock each other); the blocked call then raises in the training loop, which calls
``LiveSwitcher.recover``. Gloo cannot abort a collective (pytorch#130345; measured here with
torch 2.13: after ``_abort_process_group`` a gloo all-reduce on a silent peer still waits for
that peer), so under gloo the watchdog only records what it saw and the bounded group timeout
(``LiveSwitcher(collective_timeout=...)``) releases the survivors.

``Watchdog`` is a daemon thread: every ``poll`` seconds it asks the heartbeats (``Liveness``)
whether a device of the job's current layout stopped beating for ``abort_after`` seconds, and
then aborts once. ``abort_after`` should be well above ``stale_after`` (a healthy process whose
heartbeat thread is starved for a moment must not bring the job down); Megatron-LM's own hang
detection waits 60 s (soft) and 90 s (hard) by default.

Measured on one GPU (``bench/nccl_abort_probe.py``; H200, torch 2.11, NCCL 2.28.9): a
collective blocked in the creation of its communicator, on a peer that never came, is not
released by the abort, nor by a 5 s group timeout, blocking or non-blocking creation alike.
A formed communicator whose peer died needs two GPUs and has not been checked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger("dynatrain.runtime")


def abort_all_groups() -> bool:
    """Abort every process group of this process where that releases its collectives
    (NCCL); under gloo do nothing (its groups stay registered for ``recover`` to tear down).
    Whether it aborted."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return False
    c10d._abort_process_group()
    return True


class Watchdog:
    """Aborts this process's groups once a device of the job stops beating.

    Args:
        devices: the job's devices now (a callable: the layout changes with each switch).
        stale: ``Liveness(..., stale_after=abort_after).stale``: the devices that stopped.
        abort: what to call (default ``abort_all_groups``); called at most once.
        poll: seconds between two looks.
    """

    def __init__(self, devices: Callable[[], Sequence[str]],
                 stale: Callable[[Sequence[str]], set[str]],
                 abort: Callable[[], object] = abort_all_groups, poll: float = 0.5) -> None:
        self.devices, self.stale, self.abort, self.poll = devices, stale, abort, poll
        self.fired: tuple[tuple[str, ...], float] | None = None  # (who, when: monotonic)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dynatrain-watchdog",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                devices = tuple(self.devices())
                gone = self.stale(devices) if devices else set()
            except Exception:  # noqa: BLE001 — a store hiccup; look again
                continue
            if gone:
                who = tuple(d for d in devices if d in gone)
                self.fired = (who, time.monotonic())
                try:
                    done = self.abort()
                except Exception as err:  # noqa: BLE001 — the group timeout still releases
                    done = f"failed: {err}"
                log.warning("watchdog: %s stopped beating; %s", ", ".join(who),
                            "aborted this process's groups" if done is True else
                            f"abort {done}" if isinstance(done, str) else
                            "its groups cannot be aborted here: their timeout releases them")
                return

    def stop(self) -> None:
        self._stop.set()
