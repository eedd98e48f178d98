"""Megatron's process groups of a switch's destination, formed while the job still trains.

A same-devices switch replaces megatron's parallel state: ``initialize_model_parallel`` creates
every group of the destination (tensor, pipeline, data, context, expert, embedding, ... and
their gloo twins), each one a rendezvous of its members through the store and, on gloo, a full
mesh of connections. That was a third of an in-place switch's downtime in the live example.
``GroupsAhead`` moves it off the critical path:

1. ``record`` (on the training thread, at the boundary where the switch is prepared): megatron's
   own ``initialize_model_parallel`` runs for the destination with ``torch.distributed.new_group``
   replaced by a recorder (and ``destroy_process_group`` by nothing), and the module's globals
   are put back as they were: the calls megatron makes, in order, and nothing created;
2. a background thread makes the same calls, with the same arguments, while the job trains on
   in its current groups: every process calls ``new_group`` for every group (as megatron does),
   so torch numbers and names them exactly as it would have at the switch. Nothing else may
   create groups meanwhile (``LiveSwitcher`` waits for the thread before it creates any);
   torch's ``use_local_synchronization`` is no way out: its names count the groups each process
   is a member of, which differ between processes;
3. at the switch, once every process of the job agreed that its groups are ready (one
   all-reduce), ``initialize`` runs ``initialize_model_parallel`` again with ``new_group``
   handing out the groups made ahead, call by call, checked against the recorded arguments. If
   any process's groups are not ready, every process creates them at the switch as before,
   after ``resync`` set torch's group counter to the highest any process reached (a thread that
   failed part way left it lower than its peers').

Gloo only: NCCL communicators are created lazily by torch (at a group's first collective)
unless the default group was bound to a device, and an eager ``ncclCommSplit`` is a collective
on the parent communicator that the training stream is using, so on NCCL groups are created at
the switch (``supported``). Not used with SHARP (``initialize_model_parallel`` then runs
barriers on the new groups).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist


def supported(init_kwargs: dict) -> bool:
    """Whether the groups of a switch can be formed ahead: gloo, no SHARP."""
    return (dist.is_initialized() and dist.get_backend() == "gloo"
            and not init_kwargs.get("use_sharp") and not init_kwargs.get("sharp_enabled_group"))


class _Recorded:
    """What ``new_group`` gave megatron while recording (never used as a group)."""

    __slots__ = ()


@contextmanager
def _new_group_is(fn: Callable[..., Any], no_destroy: bool = False) -> Iterator[None]:
    real_new, real_destroy = dist.new_group, dist.destroy_process_group
    dist.new_group = fn  # megatron calls torch.distributed.new_group(**kwargs) (create_group)
    if no_destroy:
        dist.destroy_process_group = lambda *a, **k: None
    try:
        yield
    finally:
        dist.new_group, dist.destroy_process_group = real_new, real_destroy


def _snapshot(module: Any) -> dict[str, tuple[Any, Any]]:
    """Every global of ``module``: (object, a shallow copy of its contents for containers
    that megatron fills in place)."""
    out = {}
    for k, v in vars(module).items():
        if k.startswith("__"):
            continue
        out[k] = (v, list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict)
                  else None)
    return out


def _restore(module: Any, snap: dict[str, tuple[Any, Any]]) -> None:
    for k in [k for k in vars(module) if not k.startswith("__") and k not in snap]:
        delattr(module, k)
    for k, (v, contents) in snap.items():
        if isinstance(v, list):
            v[:] = contents
        elif isinstance(v, dict):
            v.clear()
            v.update(contents)
        setattr(module, k, v)


def record(init: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``new_group`` calls megatron's ``initialize_model_parallel(**init)`` makes, in order
    (their keyword arguments); megatron's parallel state is left as it was."""
    from megatron.core import parallel_state as ps

    calls: list[dict[str, Any]] = []

    def recorder(**kwargs: Any) -> _Recorded:
        calls.append(dict(kwargs))
        return _Recorded()

    snap = _snapshot(ps)
    try:
        with _new_group_is(recorder, no_destroy=True):
            # 0.19's destroy also releases NCCL EP and symmetric-memory buffers: nothing under
            # gloo, the only backend this runs on (``supported``).
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(**init)
    finally:
        _restore(ps, snap)
    return calls


def resync(group: Any = None) -> None:
    """Every process of ``group`` continues torch's group numbering from the highest count any
    of them reached (after groups made ahead failed on some process)."""
    import torch

    world = dist.distributed_c10d._world
    count = torch.tensor([world.group_count], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    world.group_count = int(count.item())


class GroupsAhead:
    """The groups of one destination, recorded now and created in a background thread.

    Args:
        init: ``initialize_model_parallel``'s arguments for the destination.
    """

    def __init__(self, init: dict[str, Any]) -> None:
        self.init = dict(init)
        self.calls = record(self.init)
        self.groups: list[Any] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._create, name="dynatrain-groups-ahead",
                                        daemon=True)
        self._thread.start()

    def _create(self) -> None:
        try:
            for kw in self.calls:
                self.groups.append(dist.new_group(**kw))
        except BaseException as err:  # noqa: BLE001 — reported by ready(); groups made at the switch
            self.error = err

    def ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the groups; whether all were created."""
        self._thread.join(timeout)
        return not self._thread.is_alive() and self.error is None

    def initialize(self) -> int:
        """megatron's parallel state of the destination from the groups made ahead (call once
        ``ready`` said so on every process); the number of groups it took.

        Raises:
            RuntimeError: megatron asked for other groups than it did when recorded.
        """
        from megatron.core import parallel_state as ps

        queue = list(zip(self.calls, self.groups))
        taken = [0]

        def hand_out(**kwargs: Any) -> Any:
            if taken[0] >= len(queue):
                raise RuntimeError("groups ahead: megatron asked for more groups than recorded")
            want, group = queue[taken[0]]
            if dict(kwargs) != want:
                raise RuntimeError(f"groups ahead: megatron's group {taken[0]} differs from the "
                                   f"recorded one ({kwargs} != {want})")
            taken[0] += 1
            return group

        with _new_group_is(hand_out):
            ps.initialize_model_parallel(**self.init)
        if taken[0] != len(queue):
            raise RuntimeError(f"groups ahead: megatron took {taken[0]} of {len(queue)} groups")
        return taken[0]
