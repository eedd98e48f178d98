"""Megatron-LM's checkpoints as a live recovery reads them: the newest one under ``--save``,
the training state it was saved with, and the lost ranges (or everything) read from it.

Megatron-LM saves iteration ``N`` of a ``torch_dist`` checkpoint to ``<save>/iter_000000N``
(a megatron-core dist checkpoint, ``format.py``) and then writes ``N`` to
``<save>/latest_checkpointed_iteration.txt`` (megatron/training/checkpointing.py,
``get_checkpoint_tracker_filename``): the tracker names only finished checkpoints. The
common state holds ``iteration``, ``opt_param_scheduler`` and ``args`` (with
``consumed_train_samples``), read through the allow-list unpickler of ``format.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from ..ir.layout import Layout
from .format import CheckpointError, member, open_checkpoint, shown
from .load import LoadStats, load_planned, plan_load, read_step

TRACKER = "latest_checkpointed_iteration.txt"


def newest(save_dir: str | os.PathLike[str]) -> str | None:
    """The newest finished checkpoint under Megatron-LM's ``--save`` directory, or None.

    Raises:
        CheckpointError: the tracker file names no iteration, or a directory outside
            ``save_dir``.
    """
    root = os.path.realpath(save_dir)
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        name = "release"
    else:
        try:
            it = int(text)
        except ValueError:
            raise CheckpointError(f"checkpoint {save_dir}: {TRACKER} holds {text[:40]!r}, not "
                                  "an iteration") from None
        if it < 0:
            raise CheckpointError(f"checkpoint {save_dir}: {TRACKER} holds {it}, not an "
                                  "iteration")
        name = f"iter_{it:07d}"
    path = member(os.fspath(save_dir), root, name)  # a link out of --save is refused
    return path if os.path.isdir(path) else None


def train_state(ckpt: str, carried: Iterable[str] = ()) -> dict[str, Any]:
    """Where a rollback to ``ckpt`` resumes, as ``runtime.megatron.job.carried`` gives it:
    iteration, consumed samples, the LR scheduler's state and ``carried`` args (with
    ``num_floating_point_operations_so_far``) under ``extra``.

    Raises:
        CheckpointError: not a Megatron-LM checkpoint (no iteration or no args), or its
            iteration or ``args.consumed_train_samples`` is not a whole number >= 0.
    """
    common = open_checkpoint(ckpt).common()
    args, it = common.get("args"), common.get("iteration")
    if args is None or not isinstance(it, int) or isinstance(it, bool):
        raise CheckpointError(f"checkpoint {ckpt}: no iteration and args in its common state "
                              "(not saved by Megatron-LM)")
    consumed = getattr(args, "consumed_train_samples", 0)
    for what, n in (("iteration", it), ("args.consumed_train_samples", consumed)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:  # unpickled: anything
            raise CheckpointError(f"checkpoint {ckpt}: {what} {shown(n)} in its common state is "
                                  "not a whole number >= 0")
    extra = {k: getattr(args, k) for k in carried if hasattr(args, k)}
    if "num_floating_point_operations_so_far" in common:
        extra["num_floating_point_operations_so_far"] = common[
            "num_floating_point_operations_so_far"]
    return {"iteration": it, "consumed_samples": consumed,
            "scheduler": common.get("opt_param_scheduler"), "extra": extra}


def refill(ckpt: str, layout: Layout, rank: int,
           lost: Any) -> tuple[int | None, Callable[[dict], object]]:
    """``LiveSwitcher``'s ``refill``: the checkpoint's Adam step, and a function writing the
    ``lost`` ranges (None: the rank's whole state) of ``rank`` into its storage. Planned from
    the metadata only, so a checkpoint it cannot read is refused before anything moves."""
    c = open_checkpoint(ckpt)
    load = plan_load(c, layout, [rank], only=lost)

    def write(store: dict) -> LoadStats:
        stats = LoadStats()
        load_planned(load, stores={rank: store}, stats=stats)
        return stats

    return read_step(c), write
