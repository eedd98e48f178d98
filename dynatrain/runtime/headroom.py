"""Headroom of a live switch: does this device have free the memory the switch will take?

A running job already holds its source state, so that memory is already not free: what the
switch still takes on a device is its destination state (the storage the destination job
allocates for the device's ranks) plus the most the device stages in any one round. That must
fit in what is free on the device now; the verifier's check against a topology's device memory
cannot see what the job's activations, allocator cache and communicator buffers already use.

On a GPU, free is what the driver reports free (``torch.cuda.mem_get_info``) plus the caching
allocator's wholly unused segments (it returns those to the driver before an allocation fails);
its fragments inside used segments are not counted, so the check errs on the side of refusing.
Read while training runs, mid-iteration activations are still allocated: at the iteration
boundary where the switch runs, at least as much is free.

On the CPU (gloo) nothing is checked: the processes of a node share the host's memory, so one
process's ``psutil.virtual_memory().available`` counts the same free memory once per process
(passing switches that do not fit), and the kernel overcommits and swaps rather than failing.

Not counted: memory the destination job allocates besides its state (gradient buffers,
activations of its first iteration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ir.errors import DynatrainError
from ..ir.state import StateView, storage_tensors
from ..ir.units import format_bytes
from ..planner.plan import Plan
from .storage import torch_dtype


@dataclass(frozen=True, slots=True)
class SwitchNeed:
    """What a switch takes on one device beyond the source state it already holds."""

    device: str
    dst_state_bytes: int  # the destination state of the device's ranks
    staging_bytes: int  # the most the device stages in one round
    staging_round: int  # that round

    @property
    def total_bytes(self) -> int:
        return self.dst_state_bytes + self.staging_bytes

    def counted(self) -> str:
        """The sum in words, e.g. ``destination state 1.0 GiB + staging 2.0 GiB in round 3``."""
        staging = f"staging {format_bytes(self.staging_bytes)}"
        if self.staging_bytes:
            staging += f" in round {self.staging_round}"
        return f"destination state {format_bytes(self.dst_state_bytes)} + {staging}"


class NoHeadroom(DynatrainError):
    """A device has less memory free than a switch would take on it; nothing was moved.

    Attributes:
        need: what the switch takes on the device, part by part.
        free_bytes: what was free on the device.
    """

    def __init__(self, need: SwitchNeed, free_bytes: int) -> None:
        self.need, self.free_bytes = need, free_bytes
        super().__init__(
            f"{need.device}: the switch needs {format_bytes(need.total_bytes)} "
            f"({need.total_bytes} bytes: {need.counted()}; the source state is already "
            f"allocated) but {format_bytes(free_bytes)} ({free_bytes} bytes) is free on the "
            f"device — free memory, or switch with a smaller budget_bytes or onto more devices")


def switch_need(plan: Plan, dst: StateView, device: str) -> SwitchNeed:
    """What ``plan`` takes on ``device``: its ranks' destination storage (``storage_tensors``,
    what an executor allocates) and its peak staging (its remote messages of one round, sent
    and received)."""
    state = sum(math.prod(shape) * torch_dtype(dtype).itemsize
                for rank, dev in enumerate(plan.dst_devices) if dev == device
                for shape, dtype in storage_tensors(dst, rank).values())
    per_round = [sum(m.nbytes for m in rnd.messages
                     if not m.local and device in (m.src_device, m.dst_device))
                 for rnd in plan.rounds]
    staging = max(per_round, default=0)
    return SwitchNeed(device, state, staging, per_round.index(staging) if per_round else 0)


def check_headroom(need: SwitchNeed, free_bytes: int) -> None:
    """Refuse a switch that takes more than ``free_bytes`` on its device.

    Raises:
        NoHeadroom: ``need.total_bytes > free_bytes``, naming the device, both figures and the
            parts counted.

    Example:
        >>> check_headroom(SwitchNeed("node0:gpu0", 4 << 30, 1 << 30, 2), 6 << 30)  # fits
    """
    if need.total_bytes > free_bytes:
        raise NoHeadroom(need, free_bytes)


def job_cuda_device() -> int | None:
    """The CUDA device of the calling thread when the job has put anything on a GPU, else None
    (a CPU job). Read on the job's own thread: a planning thread has its own current device."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def free_bytes(cuda_device: int | None) -> int | None:
    """Bytes free for a switch on ``cuda_device`` now (see the module docstring); None on the
    CPU, which is not checked."""
    if cuda_device is None:
        return None
    free, _total = torch.cuda.mem_get_info(cuda_device)
    stats = torch.cuda.memory_stats(cuda_device)
    try:  # whole free segments: reserved, neither allocated nor a fragment of a used segment
        cached = (stats["reserved_bytes.all.current"] - stats["allocated_bytes.all.current"]
                  - stats["inactive_split_bytes.all.current"])
    except KeyError:  # an allocator backend without these counters: the driver's figure only
        cached = 0
    return free + max(cached, 0)


def check_switch_headroom(plan: Plan, dst: StateView, device: str,
                          cuda_device: int | None) -> SwitchNeed | None:
    """``check_headroom`` of ``plan`` on ``device`` against what is free now; None (unchecked)
    on the CPU.

    Raises:
        NoHeadroom: the switch does not fit in the device's free memory.
    """
    free = free_bytes(cuda_device)
    if free is None:
        return None
    need = switch_need(plan, dst, device)
    check_headroom(need, free)
    return need
