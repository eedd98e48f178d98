"""Switch a running Megatron-core job to another parallel layout between two iterations.

Every process of the job owns a ``LiveSwitcher`` for its device. ``prepare(dst_spec)`` plans
the switch and has it verified in a background thread while training goes on (the planner is
deterministic, so every process computes the same plan on its own; ``switch`` confirms that
with one all-gather of the plan's digest before anything moves). ``switch(job)`` then, at an
iteration boundary:

1. binds the job's state as IR storage (``extract_state``: views, no copies);
2. runs the plan across the processes (``executor.switch``: all or nothing; an abort leaves
   the job and megatron's parallel state untouched, so training simply goes on in the old
   layout);
3. tears down megatron's parallel state and initializes the destination layout's;
4. builds the destination model chunks and optimizer (the caller's ``build``, the code that
   built the job in the first place), installs the switched storage into them
   (``install_state``) and carries the LR scheduler state and the iteration over.

If step 3 or 4 fails, the old layout's parallel state is restored before the error is raised,
so the old job can keep training. Megatron's RNG streams cannot continue across a layout change
(megatron ignores the RNG state whenever TP or PP change); ``build`` seeds them for the new
coordinates, as at startup.

Limits: every process must be in both layouts with the same rank (megatron's parallel state
lives in the default process group, whose size and ranks a switch cannot change), and the
device names must sort in rank order (``executor.switch`` orders processes by device name).
The verifier is passed in by the caller (``dynatrain.verify.check.check``): the runtime layer
does not import the verifier.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...ir.errors import DynatrainError, LayoutError
from ...ir.layout import Layout
from ...ir.spec import LayoutSpec
from ...ir.state import transition_views
from ...planner.cost import H100, Topology
from ...planner.pipeline import plan_transition
from ...planner.plan import Plan
from ...planner.serialize import plan_to_json
from ..executor import process_devices, switch
from .bridge import extract_state, install_state


@dataclass
class MegatronJob:
    """What a training loop holds between iterations, for one rank."""

    model_chunks: list  # per virtual pipeline chunk (DDP-wrapped, as megatron trains them)
    optimizer: Any  # what get_megatron_optimizer returned
    scheduler: Any = None  # megatron's OptimizerParamScheduler (state_dict/load_state_dict)
    iteration: int = 0


Builder = Callable[[LayoutSpec], MegatronJob]  # build a fresh job in the current parallel state
Verifier = Callable[[Plan, Layout, Layout], object]  # raises if the plan breaks a rule


@dataclass(frozen=True, slots=True)
class Prepared:
    """A planned and verified switch."""

    dst_spec: LayoutSpec
    dst: Layout
    plan: Plan
    digest: bytes  # blake2b of the plan's canonical JSON, its summary (timings) left out
    plan_seconds: float
    verify_seconds: float


@dataclass
class SwitchResult:
    """The destination job and what the switch took on this process."""

    job: MegatronJob
    report: dict  # executor.switch's report
    seconds: dict[str, float] = field(default_factory=dict)


def parallel_kwargs(spec: LayoutSpec) -> dict:
    """``parallel_state.initialize_model_parallel`` arguments of a spec's layout."""
    p = spec.parallel
    return dict(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
                virtual_pipeline_model_parallel_size=p.vpp, context_parallel_size=p.cp,
                expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.expert_tp,
                num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
                order=p.order)


def _check_world(src: Layout, dst: Layout) -> None:
    if src.devices != dst.devices:
        raise LayoutError("a live switch keeps every process at its rank: both layouts must "
                          f"run on the same devices in the same order. Got {len(src.devices)} "
                          f"devices ({src.devices[0]}, ...) and {len(dst.devices)} "
                          f"({dst.devices[0]}, ...)")
    if tuple(sorted(src.devices)) != src.devices:
        raise LayoutError("executor.switch orders processes by device name, so the device "
                          f"names must sort in rank order. Got {src.devices[:4]}...")


class LiveSwitcher:
    """Plans, verifies and runs layout switches of the Megatron job on this process.

    Args:
        spec: the layout the job runs now.
        device: this process's device (its rank is ``Layout(spec).devices.index(device)``).
        build: builds a fresh job for a spec; called after megatron's parallel state for that
            spec is initialized, on every process.
        verify: checks a plan against its layouts and raises if it breaks a rule
            (``dynatrain.verify.check.check``).
        budget_bytes: staging budget per device of a switch.
        timeout: seconds any one wait for peers may take before a switch aborts.
        group: the process group of the job (None: the default group).
        init_kwargs: extra ``initialize_model_parallel`` arguments (e.g.
            ``create_gloo_process_groups``), used for every layout.

    Example:
        >>> sw = LiveSwitcher(spec_a, "node0:gpu3", build, check)  # doctest: +SKIP
        >>> sw.prepare(spec_b)                      # plans in the background
        >>> job = sw.switch(job).job                # at an iteration boundary
    """

    def __init__(self, spec: LayoutSpec, device: str, build: Builder, verify: Verifier, *,
                 budget_bytes: int = 2 << 30, timeout: float = 60.0,
                 group: dist.ProcessGroup | None = None, topology: Topology = H100,
                 init_kwargs: dict | None = None) -> None:
        self.spec, self.layout = spec, Layout(spec)
        if device not in self.layout.devices:
            raise LayoutError(f"device {device} is not in the layout ({self.layout.devices[0]},"
                              " ...)")
        self.device, self.build, self.verify = device, build, verify
        self.budget_bytes, self.timeout, self.group = budget_bytes, timeout, group
        self.topology, self.init_kwargs = topology, dict(init_kwargs or {})
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynatrain-plan")
        self._pending: Future[Prepared] | None = None

    @property
    def rank(self) -> int:
        return self.layout.devices.index(self.device)

    def prepare(self, dst_spec: LayoutSpec) -> Future[Prepared]:
        """Plan and verify the switch to ``dst_spec`` in the background; errors surface in
        ``switch`` (or from the returned future)."""
        if self._pending is not None and not self._pending.done():
            raise DynatrainError("a switch is already being prepared")
        self._pending = self._pool.submit(self._prepare, self.layout, dst_spec)
        return self._pending

    def ready(self) -> bool:
        """True once ``prepare``'s plan is done (or failed)."""
        return self._pending is not None and self._pending.done()

    def _prepare(self, src: Layout, dst_spec: LayoutSpec) -> Prepared:
        dst = Layout(dst_spec)
        _check_world(src, dst)
        t0 = time.perf_counter()
        plan = plan_transition(src, dst, self.budget_bytes, self.topology)
        t1 = time.perf_counter()
        self.verify(plan, src, dst)
        t2 = time.perf_counter()
        if process_devices(plan) != src.devices:
            raise LayoutError("the plan's processes are not the job's ranks in order")
        doc = plan_to_json(plan)
        del doc["summary"]  # timings: the only part that differs between processes
        text = json.dumps(doc, sort_keys=True).encode()
        return Prepared(dst_spec, dst, plan, hashlib.blake2b(text, digest_size=16).digest(),
                        t1 - t0, t2 - t1)

    def _agree(self, digest: bytes) -> None:
        """Every process must have planned the very same switch (a failed plan: zeros)."""
        mine = torch.frombuffer(bytearray(digest), dtype=torch.int64)
        world = dist.get_world_size(self.group)
        got = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(got, mine, group=self.group)
        if any(not torch.equal(g, mine) for g in got):
            raise DynatrainError(f"{self.device}: the processes planned different switches")

    def switch(self, job: MegatronJob) -> SwitchResult:
        """Run the prepared switch on ``job`` (every process, at an iteration boundary).

        Returns the destination job (fresh model chunks and optimizer holding the switched
        state, the scheduler state and iteration carried over); this switcher then runs the
        destination layout. On any error the old job and layout stay usable.

        Raises:
            DynatrainError: nothing was prepared, or planning/verification failed.
            SwitchAborted: the exchange aborted; the job is untouched.
        """
        from megatron.core import parallel_state as ps

        if self._pending is None:
            raise DynatrainError("switch() needs a prepare(dst_spec) first")
        t = [time.perf_counter()]
        try:
            prep, failure = self._pending.result(), None
        except Exception as err:  # noqa: BLE001 — raised below, once every process knows
            prep, failure = None, err
        self._agree(bytes(16) if prep is None else prep.digest)
        if failure is not None:
            raise failure
        assert prep is not None
        t.append(time.perf_counter())
        # The plan's views: both carry the vocab padding rows the two layouts share.
        src_view, dst_view = transition_views(self.layout, prep.dst)
        src = extract_state(src_view, self.rank, job.model_chunks, job.optimizer)
        scheduler = job.scheduler.state_dict() if job.scheduler is not None else None
        t.append(time.perf_counter())
        dst, report = switch(prep.plan, src_view, dst_view, self.device, src, self.group,
                             timeout=self.timeout)
        del src
        t.append(time.perf_counter())
        try:
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(**parallel_kwargs(prep.dst_spec), **self.init_kwargs)
            t.append(time.perf_counter())
            new = self.build(prep.dst_spec)
            t.append(time.perf_counter())
            install_state(dst_view, self.rank, new.model_chunks, new.optimizer, dst)
            if scheduler is not None:
                if new.scheduler is None:
                    raise LayoutError("the job has an LR scheduler, the built one has none")
                new.scheduler.load_state_dict(scheduler)
            new.iteration = job.iteration
        except BaseException:
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(**parallel_kwargs(self.spec), **self.init_kwargs)
            raise
        t.append(time.perf_counter())
        self.spec, self.layout, self._pending = prep.dst_spec, prep.dst, None
        names = ("agree", "extract", "exchange", "parallel_state", "build", "install")
        seconds = {n: b - a for n, a, b in zip(names, t, t[1:])}
        seconds.update(plan=prep.plan_seconds, verify=prep.verify_seconds)
        return SwitchResult(new, report, seconds)
