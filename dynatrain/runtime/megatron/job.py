"""The records a live switch passes around: the job a training loop holds, a prepared switch,
what a switch returns, and the error it raises when it did not happen."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...ir.errors import DynatrainError
from ...ir.layout import Layout
from ...ir.spec import LayoutSpec
from ...planner.plan import Plan


@dataclass
class MegatronJob:
    """What a training loop holds between iterations, for one rank.

    ``iteration`` and ``consumed_samples`` (the global sample count the data pipeline resumes
    from) and the scheduler's state are carried across a switch to the destination job, also
    to processes that join it.
    """

    model_chunks: list  # per virtual pipeline chunk (DDP-wrapped, as megatron trains them)
    optimizer: Any  # what get_megatron_optimizer returned
    scheduler: Any = None  # megatron's OptimizerParamScheduler (state_dict/load_state_dict)
    iteration: int = 0
    consumed_samples: int = 0
    # More counters the training loop carries across a switch (JSON values: e.g. Megatron-LM's
    # num_floating_point_operations_so_far, consumed_valid_samples).
    extra: dict = field(default_factory=dict)


Builder = Callable[[LayoutSpec], MegatronJob]  # build a fresh job in the current parallel state


class GlobalState(Protocol):
    """What a job's ``Builder`` changes outside the job it returns (Megatron-LM's ``args``, its
    micro-batch calculator, RNG streams): ``save`` before a switch, ``restore`` (with what
    ``save`` returned) when the switch fails, after megatron's parallel state of the source
    layout is back."""

    def save(self) -> object: ...

    def restore(self, saved: object) -> None: ...


Verifier = Callable[[Plan, Layout, Layout], object]  # raises if the plan breaks a rule
# Plan reading the lost ranges (a planner.lost.LostState) of a checkpoint into one rank of a
# layout: (checkpoint, layout, rank, lost) -> (the checkpoint's Adam step or None, a function
# that writes them into that rank's storage). Raises DynatrainError (exit status 2) for a
# checkpoint it refuses. Passed in (see dynatrain.checkpoint): the runtime layer does not
# import the checkpoint reader.
# ``lost`` None: the rank's whole state (a rollback to the checkpoint).
Refill = Callable[[str, Layout, int, Any], tuple[int | None, Callable[[dict], object]]]
# The training state a checkpoint was saved with, as ``carried`` gives it (iteration,
# consumed_samples, scheduler, extra): where a rollback to that checkpoint resumes.
TrainState = Callable[[str], dict]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A planned and verified switch."""

    src_spec: LayoutSpec
    src: Layout
    dst_spec: LayoutSpec
    dst: Layout
    plan: Plan | None  # None: a slice whose rounds are cut at switch time (``pairs``)
    digest: bytes  # blake2b of the plan's canonical JSON, its summary (timings) left out
    plan_seconds: float
    verify_seconds: float
    generation: int | None  # the switch's number in the rendezvous (None: no rendezvous)
    in_place: bool  # same devices in the same, sorted order: the job's group runs the switch
    # A same-devices switch plans only this device's slice (planner.slices): its pairs come
    # from prepare, its rounds at switch time, once the job agrees on their number.
    pairs: Any = None


@dataclass(frozen=True)
class Notice:
    """A preemption notice being met (``LiveSwitcher.notice``): the switch to ``dst_spec``,
    off the ``leaving`` devices, is prepared; the training loop's next ``switch`` runs it.

    ``deadline`` is on this process's ``time.monotonic()`` clock; ``fits()`` says whether the
    switch, once done, was done before it. ``predicted_seconds`` is the planner's predicted
    downtime of the switch (wire time plus fixed costs; forming groups and building the
    destination job are not in it).
    """

    leaving: tuple[str, ...]
    dst_spec: LayoutSpec
    deadline: float
    predicted_seconds: float | None

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self) -> bool:
        return self.seconds_left() >= 0


@dataclass
class SwitchResult:
    """What a committed switch gives this process.

    ``role`` is ``"stayed"`` (a process of both layouts), ``"joined"`` (a spare or newly
    started process that runs a destination rank now) or ``"left"`` (its device is not in the
    destination: ``job`` is None and the process may idle as a spare, ``LiveSwitcher.join``,
    or exit).
    """

    job: MegatronJob | None
    report: dict  # executor.switch's report
    seconds: dict[str, float] = field(default_factory=dict)
    role: str = "stayed"
    generation: int | None = None
    # After ``LiveSwitcher.recover``: the failed devices, the destination's grid, the lost
    # bytes and what this rank refilled from the checkpoint (empty after a switch).
    recovery: dict = field(default_factory=dict)

    # ``seconds`` keys that are not phases of the downtime: planned in the background, or
    # measured inside a phase.
    NOT_PHASES = ("plan", "verify", "check", "downtime", "groups_wait", "build_ahead")

    def phases(self) -> dict[str, float]:
        """This process's downtime by phase, in the order they ran; their sum is
        ``seconds["downtime"]`` up to the bookkeeping between them.

        Same devices: ``check_agree`` (the job check against the IR, binding the source state,
        agreeing on the plan's digest), ``save_state`` (what a rollback restores),
        ``parallel_state`` (megatron's groups for the destination; of it,
        ``seconds["groups_wait"]`` waited for the groups made ahead), ``build`` (the destination
        job, and the vote that every process built it), ``exchange``, ``install`` (the step,
        the scheduler, counters, and the commit vote). With the destination built ahead
        (``LiveSwitcher.build_ahead``) neither ``parallel_state`` nor ``build`` runs at the
        switch; ``seconds["build_ahead"]`` is that build's time, at its own boundary. Another
        world: ``agree``, ``switch_group``, ``plan_vote``, ``exchange``, ``dst_group``,
        ``parallel_state``, ``build``, ``install``, ``commit_vote``; where devices only leave,
        the destination's world and megatron's groups were made while the job trained
        (``switch_group`` is then the agreement that they are ready, ``seconds["groups_wait"]``
        of it; no ``plan_vote``: the job's own agreement reached every process of the switch;
        ``dst_group`` makes the destination's world the default group), and with the
        destination job built ahead neither ``parallel_state`` nor ``build`` runs. A recovery: ``detect``,
        ``agree``, ``prepare``, ``switch_group``, ``exchange``, ``refill`` or ``reload``,
        ``commit_vote``, ``dst_group``, ``build``, ``install``.
        """
        return {k: v for k, v in self.seconds.items() if k not in self.NOT_PHASES}


class SwitchFailed(DynatrainError):
    """A switch did not happen; every process is back in the source layout.

    Attributes:
        job: the job to train on: the job passed to ``switch`` when its process groups
            survived, else a job rebuilt in re-formed groups with the very same state
            (bit for bit); None on a process that runs no source rank (a joiner) or when
            the source layout could not be re-formed (a source process is gone).
    """

    def __init__(self, message: str, job: MegatronJob | None) -> None:
        self.job = job
        super().__init__(message)


class RecoveryFailed(SwitchFailed):
    """A recovery did not happen; ``job`` is the job passed to ``recover``, state untouched
    (its process groups are not usable: a member died), so ``recover`` may be retried.

    ``exit_code`` is 2 when the input was refused (a checkpoint that is missing, truncated, of
    another model, of an unknown format version or of another step; a destination that does
    not fit), 3 when state is lost and nothing can restore it (no checkpoint given, or no way
    to roll back to the one given), else 4 (a process died, timed out or voted no while
    recovering).
    """

    def __init__(self, message: str, job: MegatronJob | None, exit_code: int) -> None:
        super().__init__(message, job)
        self.exit_code = exit_code
        self.nothing_failed = False  # every device answered the roll call: none is gone


def first_line(err: BaseException) -> str:
    """An error's first line (its type's name when it has no text)."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def where_failed(failure: BaseException | None) -> str:
    """Which process a failure agreed on by every process happened on, and why."""
    if failure is None:
        return "another process"
    return f"this process: {type(failure).__name__}: {failure}"


def parallel_kwargs(spec: LayoutSpec) -> dict:
    """``parallel_state.initialize_model_parallel`` arguments of a spec's layout."""
    p = spec.parallel
    return dict(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
                virtual_pipeline_model_parallel_size=p.vpp, context_parallel_size=p.cp,
                expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.expert_tp,
                num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
                order=p.order)


def carried(job: MegatronJob) -> dict:
    """What a switch carries besides the state: iteration, samples, the scheduler (JSON)."""
    return {"iteration": job.iteration, "consumed_samples": job.consumed_samples,
            "scheduler": job.scheduler.state_dict() if job.scheduler is not None else None,
            "extra": dict(job.extra)}


def carry_into(job: MegatronJob, carry: dict) -> None:
    """Give a freshly built ``job`` what ``carried`` took from the old one."""
    if carry["scheduler"] is not None:
        if job.scheduler is None:
            raise DynatrainError("the job has an LR scheduler, the built one has none")
        job.scheduler.load_state_dict(carry["scheduler"])
    job.iteration = int(carry["iteration"])
    job.consumed_samples = int(carry["consumed_samples"])
    job.extra = dict(carry.get("extra") or {})
