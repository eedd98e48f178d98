"""A same-devices switch's destination job, built at an iteration boundary before the switch.

Building the destination (megatron's modules, DDP buffers, the distributed optimizer and its
state, bound as the plan's destination storage) depends on the destination layout only, not on
the state the switch moves. ``LiveSwitcher.build_ahead`` therefore builds it at a boundary
after ``prepare``, once the destination's process groups exist (``groups_ahead``), and the
switch that follows runs only what must be synchronous: the job check, the exchange and the
commit vote.

Megatron keeps its parallel state in module globals, and a job's ``build`` changes more
outside the job (RNG streams, Megatron-LM's ``args`` and micro-batch calculator: the
switcher's ``global_state``). The build ahead runs with the destination's parallel state and
records what the build left (``Built``); then the source's parallel state, global state and RNG
streams are put back exactly, and the job trains on. The switch puts the recorded ones in
place. One difference with a build at the switch: RNG streams the build does not seed itself
are those of the boundary where it ran.

The destination is held beside the training job until the switch. On a GPU it is built ahead
only if its state plus a reserve fits in what is free (``headroom.free_bytes``): the reserve is
what the job needs above what it holds at a boundary to train an iteration (by default the
allocator's peak since start-up above what is allocated now). On the CPU nothing is checked
(see ``headroom``). Where it does not fit, the switch builds it at its own time, and its report
says why.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...ir.state import StateView, storage_tensors
from ...ir.units import format_bytes
from ..headroom import free_bytes
from ..storage import torch_dtype
from .groups_ahead import _new_group_is, _restore, _snapshot
from .job import MegatronJob, Prepared


@dataclass(slots=True)
class Built:
    """A destination job built ahead, with what its build left outside it."""

    prep: Prepared  # the prepared switch it belongs to, its slice cut into rounds
    job: MegatronJob
    storage: dict  # the job's state bound as the plan's destination storage (``bind_state``)
    parallel: dict  # megatron's parallel state of the destination (module globals)
    global_state: object  # the switcher's ``global_state.save()`` right after the build
    rng: dict  # the RNG streams the build left
    groups: int  # megatron groups it took ready-made
    seconds: float  # the build ahead, at its boundary


def _tracker_module() -> Any:
    from megatron.core.tensor_parallel import random as mrandom

    return mrandom


def rng_state() -> dict:
    """Every RNG stream a build may seed: Python, numpy, torch (CPU, CUDA) and megatron's
    tracker (the object, which a build may replace, and its states and seeds)."""
    mod = _tracker_module()
    tracker = mod._CUDA_RNG_STATE_TRACKER
    fields = None
    if tracker is not None:  # containers copied: fork and add replace and add entries
        fields = {k: (dict(v) if isinstance(v, dict) else set(v) if isinstance(v, set) else v)
                  for k, v in vars(tracker).items()}
    out = {"python": random.getstate(), "numpy": np.random.get_state(),
           "torch": torch.get_rng_state(),
           "tracker": (tracker, mod._CUDA_RNG_STATE_TRACKER_INITIALIZED, fields)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(saved: dict) -> None:
    """The streams ``rng_state`` saved, exactly."""
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    torch.set_rng_state(saved["torch"])
    if "cuda" in saved:
        torch.cuda.set_rng_state(saved["cuda"])
    mod = _tracker_module()
    tracker, initialized, fields = saved["tracker"]
    mod._CUDA_RNG_STATE_TRACKER, mod._CUDA_RNG_STATE_TRACKER_INITIALIZED = tracker, initialized
    if tracker is not None:
        vars(tracker).clear()
        vars(tracker).update({k: (dict(v) if isinstance(v, dict) else set(v)
                                  if isinstance(v, set) else v) for k, v in fields.items()})


def parallel_state() -> dict:
    """Megatron's parallel state now (its module's globals)."""
    from megatron.core import parallel_state as ps

    return _snapshot(ps)


def set_parallel_state(saved: dict) -> None:
    """Megatron's parallel state ``saved`` in place, without destroying the groups it
    replaces (they stay in use by the job that owns them)."""
    from megatron.core import parallel_state as ps

    _restore(ps, saved)


def clear_parallel_state() -> None:
    """Megatron's parallel state emptied, as ``initialize_model_parallel`` wants it, with
    every group left alive (0.19's destroy destroys groups)."""
    from megatron.core import parallel_state as ps

    with _new_group_is(lambda **kw: None, no_destroy=True):
        ps.destroy_model_parallel()


def job_reserve(cuda_device: int | None) -> int | None:
    """What the job needs above what it holds at a boundary to train an iteration: the
    allocator's peak above what is allocated now (None on the CPU)."""
    if cuda_device is None:
        return None
    return max(torch.cuda.max_memory_allocated(cuda_device)
               - torch.cuda.memory_allocated(cuda_device), 0)


def state_bytes(dst: StateView, rank: int) -> int:
    """The destination state one rank allocates (what ``bind_state`` binds)."""
    return sum(int(np.prod(shape)) * torch_dtype(dtype).itemsize
               for shape, dtype in storage_tensors(dst, rank).values())


def no_room(dst: StateView, rank: int, device: str, cuda_device: int | None,
            reserve_bytes: int | None) -> str | None:
    """Why the destination cannot be held beside the training job on this device, or None
    (it fits, or the CPU, which is not checked)."""
    free = free_bytes(cuda_device)
    if free is None:
        return None
    reserve = reserve_bytes if reserve_bytes is not None else job_reserve(cuda_device) or 0
    need = state_bytes(dst, rank)
    if need + reserve <= free:
        return None
    return (f"{device}: the destination state ({format_bytes(need)}) and the job's reserve "
            f"for training ({format_bytes(reserve)}) do not fit in the "
            f"{format_bytes(free)} free; built at the switch")


def build(build_fn: Any, spec: Any, initialize: Any) -> tuple[MegatronJob, Any]:
    """``build_fn(spec)`` with megatron's parallel state of the destination set up by
    ``initialize()`` (which returns how many groups it took ready-made); the caller puts the
    source's state back."""
    clear_parallel_state()
    groups = initialize()
    return build_fn(spec), groups
