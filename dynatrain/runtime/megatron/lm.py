"""Live layout switches inside Megatron-LM's own training loop (``megatron.training``).

``pretrain`` takes the arguments of the installed Megatron-LM's ``pretrain`` (megatron-core
0.19's: a ``PretrainConfigContainer`` first) and runs the same program: ``initialize_megatron``,
``setup_model_and_optimizer``, the data iterators, ``train``, the final save and evaluation —
each Megatron-LM's own function, unpatched. What it adds is DynaTrain between iterations:
``train()`` is driven in segments (it re-reads ``args.train_iters`` before every iteration,
``training.py`` ~3725 in 0.19.2, and looks ``train_step`` up by name on every call, so a
wrapper around ``train_step`` ends a segment after any step by lowering ``args.train_iters``);
between two segments the job switches live (``LiveSwitcher``, ``LiveControl``: a schedule given
here, or requests posted to the job's store with ``dynatrain switch``), and Megatron-LM's global
state is rebuilt for the new layout the way its startup builds it:

* ``args``: every layout-dependent argument (``lm_args.layout_args``), rank and world size;
* ``parallel_state``: ``initialize_model_parallel`` with the options ``initialize.py`` passes
  (~370 in 0.19.2), through the switcher;
* the micro-batch calculator for the new DP size at the same global batch
  (``reconfigure_num_microbatches_calculator``);
* RNG seeding as ``initialize_megatron`` does it (``_set_random_seed``, ~114);
* model, optimizer and scheduler: ``setup_model_and_optimizer`` with ``args.load`` unset (it
  never loads; it would also reset ``args.iteration``, ~2225, which is carried instead), with
  the process groups of the new layout (``ProcessGroupCollection.use_mpu_process_groups``);
* the data iterators at ``args.consumed_train_samples``
  (``build_train_valid_test_data_iterators``, one per virtual stage as ``pretrain`` does);
* ``train()``'s own locals (config hooks, ``num_microbatches``, the schedule) by entering it
  again; the ``interval-time`` timer it leaves running is stopped; a pending async save is
  finalized before a switch (``maybe_finalize_async_save(blocking=True)``).

Carried unchanged: ``iteration``, ``consumed_train_samples``, ``consumed_valid_samples``,
``skipped_train_samples``, ``num_floating_point_operations_so_far`` and the scheduler's state.

All or nothing: what ``build`` changes in Megatron-LM's global state (``args``, the micro-batch
calculator, RNG streams) is saved before a switch and restored when it fails
(``MegatronLMState``), so the job trains on in its previous layout.

Refused by name (one line, exit status 2): Megatron-LM's RL loop (``--perform-rl-step``),
in-process restart, local non-persistent checkpoints, and a ``pg_collection`` passed in.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import os
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ...ir.errors import DynatrainError
from ...ir.from_job import spec_from_megatron
from ...ir.layout import Layout
from ...ir.loader import load_spec, spec_from_dict, spec_to_dict
from ...ir.spec import LayoutSpec
from .control import LiveControl
from .job import MegatronJob, RecoveryFailed, Refill, Verifier
from .job import first_line as _first_line
from .lm_args import layout_args
from .live import LiveSwitcher
from .rendezvous import Rendezvous

CARRIED_ARGS = ("consumed_valid_samples", "skipped_train_samples",
                "num_floating_point_operations_so_far")


@dataclass(frozen=True)
class LiveOptions:
    """How DynaTrain runs inside Megatron-LM's loop.

    Args:
        schedule: iteration -> the layout to switch to at that boundary: a spec, its YAML
            path, a ``parallel`` block for the job's own model and devices (e.g.
            ``{"pp": 2}``), or ``{"parallel": {...}, "world": {...}}`` for other devices (e.g.
            ``"world": {"nodes": 1, "gpus_per_node": 3}``); the switch is planned
            ``prepare_ahead`` iterations before.
        requests: take up switches posted to the job's store (``dynatrain switch --store``).
        prefix: the namespace of the job's keys in the store.
        store: the store's ``HOST:PORT``; default torchrun's (``MASTER_ADDR:MASTER_PORT``).
        timeout: seconds any wait for peers may take during a switch.
        budget_bytes: staging memory per device of a switch.
        prepare_ahead: iterations between planning a scheduled switch and running it.
        gpus_per_node: for the device names ``node<N>:gpu<L>`` (default torchrun's
            ``LOCAL_WORLD_SIZE``).
        join_as: the node name of a replacement node (default the environment's
            ``DYNATRAIN_JOIN_AS``): its processes, launched by a torchrun of their own, form no
            group at start; each waits in the job's store as the spare ``<join_as>:gpu<L>``
            (``L``: ``LOCAL_RANK``) until a switch takes it in (a request naming it, e.g.
            ``dynatrain switch --store``), then trains with the job. It needs the job's store
            (``store``) and ``requests``; it takes the schedule's switches that come after it
            joined.
        recover: when a member of the job dies or hangs inside ``train()``, the survivors
            recover live (``LiveSwitcher.recover``) on a layout of the devices left, from the
            state they hold plus the newest checkpoint under ``--save`` (the lost ranges of the
            current step, or a rollback in place to an older one), and train on; False: the
            error ends the job, as in Megatron-LM.
        heartbeat: seconds between two beats of each process in the job's store (how a dead or
            stopped member is told from a slow one); with ``recover``.
        stale_after: seconds without a beat after which a member counts as gone (default ten
            heartbeats).
        abort_after: with ``recover`` on NCCL: once a member has not beaten for this many
            seconds, a watchdog aborts this process's communicators so that collectives blocked
            on it raise at once instead of at ``--distributed-timeout-minutes``
            (``LiveSwitcher(abort_after=...)``; gloo cannot abort: its group timeout releases).
        collective_timeout: seconds after which a collective of the job's process groups
            gives up on a member that stopped answering (on gloo, which cannot abort a
            collective, what releases the survivors; the roll call then waits this long for a
            survivor still blocked). Megatron-LM's groups, made with
            ``--distributed-timeout-minutes`` (whole minutes), get it once they exist, and every
            layout a switch or recovery builds is made with it. None: Megatron-LM's.
        buddy: with ``recover``: after every ``train_step`` each process copies its optimizer
            state to its host memory and to its buddy on another node (``LiveSwitcher(
            buddy=True)``), so that a recovery restores the last step every copy shares
            without reading a checkpoint (needs the distributed optimizer, bf16/fp16 params
            and ``gpus_per_node`` that puts the job on two nodes or more).
    """

    schedule: Mapping[int, LayoutSpec | str | Mapping[str, Any]] = field(default_factory=dict)
    requests: bool = True
    prefix: str = "dynatrain"
    store: str | None = None
    timeout: float = 120.0
    budget_bytes: int = 2 << 30
    prepare_ahead: int = 2
    gpus_per_node: int | None = None
    join_as: str | None = None
    recover: bool = True
    heartbeat: float = 1.0
    stale_after: float | None = None
    abort_after: float | None = None
    collective_timeout: float | None = None
    buddy: bool = False


@dataclass(frozen=True)
class Checkpoints:
    """How a recovery reads Megatron-LM's checkpoints (``dynatrain.checkpoint.megatron_lm``,
    passed in: the runtime does not import the checkpoint reader)."""

    newest: Callable[[str], str | None]  # the newest finished checkpoint under --save
    refill: Refill
    train_state: Callable[[str, tuple[str, ...]], dict]  # (checkpoint, carried args)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise DynatrainError(f"{name}: must be an integer (got {os.environ[name]!r})") from None


def _known(fn: Callable, kwargs: dict) -> dict:
    """``kwargs`` that ``fn`` accepts (the installed version's signature decides)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


class MegatronLMState:
    """Megatron-LM's global state a switch changes: saved before it, restored if it fails
    (``job.GlobalState``)."""

    def __init__(self, driver: _Driver) -> None:
        self.driver = driver

    def save(self) -> dict:
        from megatron.core import tensor_parallel
        from megatron.training import get_args

        rng = {"python": random.getstate(), "numpy": np.random.get_state(),
               "torch": torch.get_rng_state(),
               "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {"args": dict(vars(get_args())), "rng": rng, "model": self.driver.model_cfg}

    def restore(self, saved: dict) -> None:
        from megatron.core import tensor_parallel
        from megatron.training import get_args

        args = get_args()
        vars(args).clear()
        vars(args).update(saved["args"])
        self.driver.reconfigure_micro_batches()
        rng = saved["rng"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        self.driver.model_cfg = saved["model"]


class _Driver:
    """One process's run of Megatron-LM's ``pretrain`` with live switches."""

    def __init__(self, call: dict, options: LiveOptions, verify: Verifier,
                 checkpoints: Checkpoints | None = None) -> None:
        self.call, self.options, self.verify = call, options, verify
        self.checkpoints = checkpoints
        self.cfg = call["cfg_container"]
        self.model_cfg = getattr(self.cfg, "model", None)
        self.target = 0  # the user's train_iters
        # (iteration, consumed samples, FLOPs so far) the job's state holds after its last step
        self.stepped: tuple[int, int, float] = (0, 0, 0.0)
        self.segment_end = False  # the train_step wrapper ended this segment for a switch
        self.control: LiveControl | None = None
        self.progress = time.monotonic()  # when a train_step last began or ended

    # ---- Megatron-LM's startup pieces, for a layout --------------------------------------------

    def reconfigure_micro_batches(self) -> None:
        from megatron.core.num_microbatches_calculator import (
            reconfigure_num_microbatches_calculator, update_num_microbatches)
        from megatron.training import get_args

        args = get_args()
        # As set_global_variables (global_vars.py ~126 in 0.19.2): the full DP degree.
        dp = args.data_parallel_size * getattr(args, "gtp_weight_remat_size", 1)
        reconfigure_num_microbatches_calculator(**_known(
            reconfigure_num_microbatches_calculator,
            dict(rank=args.rank, rampup_batch_size=getattr(args, "rampup_batch_size", None),
                 global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                 data_parallel_size=dp,
                 decrease_batch_size_if_needed=args.decrease_batch_size_if_needed,
                 step_batch_size_schedule=getattr(args, "step_batch_size_schedule", None),
                 seq_length=getattr(args, "seq_length", None))))
        update_num_microbatches(args.consumed_train_samples, consistency_check=False)

    def init_kwargs(self) -> dict:
        """The options ``initialize.py`` passes to ``initialize_model_parallel`` besides the
        layout's sizes (those come from each spec)."""
        from megatron.core import parallel_state as ps
        from megatron.training import get_args

        a = self.call
        args = get_args()
        every = dict(
            pipeline_model_parallel_comm_backend=getattr(
                args, "pipeline_model_parallel_comm_backend", None),
            use_sharp=args.use_sharp,
            hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
            hybrid_context_parallel=getattr(args, "hybrid_context_parallel", False),
            distributed_timeout_minutes=(args.distributed_timeout_minutes
                                         if self.options.collective_timeout is None
                                         else self.options.collective_timeout / 60),
            nccl_communicator_config_path=args.nccl_communicator_config_path,
            get_embedding_ranks=a.get("get_embedding_ranks"),
            get_position_embedding_ranks=a.get("get_position_embedding_ranks"),
            create_gloo_process_groups=getattr(args, "use_gloo_process_groups",
                                               getattr(args, "enable_gloo_process_groups",
                                                       True)),
            high_priority_stream_groups=getattr(args, "high_priority_stream_groups", None),
            sharp_enabled_group=getattr(args, "sharp_enabled_group", None))
        return _known(ps.initialize_model_parallel, every)

    def seed(self) -> None:
        from megatron.training import get_args
        from megatron.training.initialize import _set_random_seed

        args = get_args()
        _set_random_seed(**_known(_set_random_seed, dict(
            seed_=args.seed, data_parallel_random_init=args.data_parallel_random_init,
            te_rng_tracker=args.te_rng_tracker,
            inference_rng_tracker=args.inference_rng_tracker,
            use_cudagraphable_rng=getattr(args, "cuda_graph_impl", "none") != "none")))

    def _model_cfg_for(self, args: Any) -> Any:
        """The container's model config with the transformer's layout fields from ``args``."""
        old = self.model_cfg
        if old is None:
            return None
        transformer = old.transformer
        names = {f.name for f in dataclasses.fields(transformer)}
        changes = {k: v for k, v in vars(args).items()
                   if k in names and getattr(transformer, k) != v and k in self._layout_keys}
        new = dataclasses.replace(old, transformer=dataclasses.replace(transformer, **changes))
        if not getattr(old, "should_pad_vocab", True) and args.padded_vocab_size is not None:
            new = dataclasses.replace(new, vocab_size=args.padded_vocab_size)
        return new

    def build(self, spec: LayoutSpec) -> MegatronJob:
        """A fresh job of ``spec`` in the current parallel state (``LiveSwitcher``'s build)."""
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.training import get_args
        from megatron.training.training import setup_model_and_optimizer

        args = get_args()
        changes = layout_args(args, spec)
        self._layout_keys = set(changes)
        vars(args).update(changes)
        args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
        self.reconfigure_micro_batches()
        self.seed()
        self.model_cfg = self._model_cfg_for(args)
        cfg = (dataclasses.replace(self.cfg, model=self.model_cfg)
               if self.model_cfg is not None else self.cfg)
        kept = {k: getattr(args, k) for k in ("load", "pretrained_checkpoint", "train_iters",
                                             "iteration", *CARRIED_ARGS) if hasattr(args, k)}
        args.load = args.pretrained_checkpoint = None  # a switch never loads a checkpoint
        args.train_iters = self.target  # the scheduler's decay steps come from it
        try:
            model, optimizer, scheduler = setup_model_and_optimizer(
                self.call["model_type"], model_provider_func=self.call.get("model_provider"),
                checkpointing_context={}, cfg_container=cfg,
                pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        finally:
            vars(args).update(kept)
        return MegatronJob(list(model), optimizer, scheduler)

    def iterators(self, n_chunks: int) -> tuple:
        """Train/valid/test iterators at ``args.consumed_train_samples``, as ``pretrain``
        builds them (a list per virtual pipeline stage with VPP)."""
        from megatron.training import get_args
        from megatron.training.training import build_train_valid_test_data_iterators

        provider = self.call["train_valid_test_dataset_provider"]
        if get_args().virtual_pipeline_model_parallel_size is None:
            return build_train_valid_test_data_iterators(provider)
        out: tuple[list, list, list] = ([], [], [])
        for vp_stage in range(n_chunks):
            stage = functools.partial(provider, vp_stage=vp_stage)
            if getattr(provider, "is_distributed", False):
                stage.is_distributed = True
            for i, it in enumerate(build_train_valid_test_data_iterators(stage)):
                out[i].append(it)
        return out

    # ---- the run -----------------------------------------------------------------------------

    def _refuse_unsupported(self, args: Any) -> None:
        c = self.call
        if c.get("inprocess_call_wrapper") is not None:
            raise DynatrainError("inprocess_call_wrapper: in-process restart is not supported "
                                 "with DynaTrain's pretrain (it restarts the processes a live "
                                 "switch keeps)")
        if c.get("pg_collection") is not None or c.get("skip_model_parallel_init"):
            raise DynatrainError("pg_collection: DynaTrain's pretrain forms the process groups "
                                 "of every layout itself; pass none")
        if getattr(args, "perform_rl_step", False):
            raise DynatrainError("perform_rl_step: Megatron-LM's RL loop is not supported by "
                                 "DynaTrain's pretrain")
        if getattr(self.cfg.checkpoint, "non_persistent_ckpt_type", None) == "local":
            raise DynatrainError("non_persistent_ckpt_type: local checkpoints are not "
                                 "supported by DynaTrain's pretrain")

    def _schedule(self, first: LayoutSpec) -> dict[int, LayoutSpec]:
        out = {}
        for it, target in self.options.schedule.items():
            if not isinstance(it, int) or isinstance(it, bool) or it < 0:
                raise DynatrainError(f"schedule: iterations must be integers >= 0 (got {it!r})")
            if isinstance(target, (str, os.PathLike)):
                out[it] = load_spec(target)
            elif isinstance(target, Mapping):  # the job's own model in another layout
                parallel = dict(target.get("parallel", {}) if "parallel" in target else target)
                doc = spec_to_dict(first)
                doc.update(parallel=parallel, name="-".join(
                    f"{k}{v}" for k, v in parallel.items()) or "dp")
                if "world" in target:
                    doc["world"] = dict(target["world"])
                    doc["name"] += f"-on-{len(Layout(spec_from_dict(doc)).devices)}"
                out[it] = spec_from_dict(doc)
            else:
                out[it] = target
        return out

    def _rendezvous(self, args: Any, where: str | None = None) -> Rendezvous:
        from .requests import parse_store_address

        store = None if where is not None else self.call.get("store")
        if where is not None or self.options.store is not None or store is None:
            where = where or self.options.store or (
                f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:"
                f"{os.environ.get('MASTER_PORT', '29500')}")
            host, port, _ = parse_store_address(where)
            store = dist.TCPStore(host, port, is_master=False,
                                  timeout=datetime.timedelta(seconds=self.options.timeout))
        return Rendezvous(store, args.distributed_backend, prefix=self.options.prefix,
                          timeout=self.options.timeout)

    def joining_as(self) -> str | None:
        """The node this process joins the running job as (None: it starts the job)."""
        name = self.options.join_as or os.environ.get("DYNATRAIN_JOIN_AS") or None
        if name is not None and re.fullmatch(r"node[0-9]+", name) is None:
            raise DynatrainError(f"join_as / DYNATRAIN_JOIN_AS: a node name node<N>, as device "
                                 f"ids name nodes (got {name!r})")
        return name

    def device(self) -> str:
        node = self.joining_as()
        if node is not None:
            return f"{node}:gpu{_env_int('LOCAL_RANK', 0)}"
        gpus = self.options.gpus_per_node or _env_int("LOCAL_WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        return f"node{rank // gpus}:gpu{rank % gpus}"

    def run(self) -> None:
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.training import get_args
        from megatron.training import training as mt

        c = self.call
        if self.joining_as() is not None:
            return self._join()
        # Looked up in training's namespace, as pretrain does (so a shim there applies).
        mt.initialize_megatron(get_embedding_ranks=c.get("get_embedding_ranks"),
                            get_position_embedding_ranks=c.get("get_position_embedding_ranks"),
                            store=c.get("store"))
        args = get_args()
        self._refuse_unsupported(args)
        bound = seconds_option("collective_timeout", self.options.collective_timeout)
        if bound is not None:
            bound_groups(bound)
        mt.set_jit_fusion_options(tp_size=args.tensor_model_parallel_size)
        self.target = args.train_iters
        gpus = self.options.gpus_per_node or _env_int("LOCAL_WORLD_SIZE", 1)
        spec = spec_from_megatron(args, {"world_size": args.world_size, "gpus_per_node": gpus})
        model, optimizer, scheduler = mt.setup_model_and_optimizer(
            c["model_type"], model_provider_func=c.get("model_provider"),
            checkpointing_context={}, cfg_container=self.cfg,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        job: MegatronJob | None = MegatronJob(list(model), optimizer, scheduler)
        sw = LiveSwitcher(spec, self.device(), self.build, self.verify,
                          rendezvous=self._rendezvous(args), budget_bytes=self.options.budget_bytes,
                          timeout=self.options.timeout, init_kwargs=self.init_kwargs(),
                          global_state=MegatronLMState(self), **self._recovery_kwargs())
        self.control = LiveControl(sw, schedule=self._schedule(spec),
                                   requests=self.options.requests,
                                   prepare_ahead=self.options.prepare_ahead)
        if sw.leader:  # what a replacement node resolves the schedule against and checks
            sw.rendezvous.post("first", {"spec": spec_to_dict(spec, Layout(spec).devices),
                                         "train_iters": self.target})
        self._loop(job, sw)

    def _recovery_kwargs(self) -> dict:
        """``LiveSwitcher``'s recovery options: heartbeats, and the checkpoint reader."""
        o = self.options
        if not o.recover:
            return {}
        if not (isinstance(o.heartbeat, (int, float)) and o.heartbeat > 0):
            raise DynatrainError(f"heartbeat: seconds > 0 (got {o.heartbeat!r})")
        out: dict = dict(heartbeat=float(o.heartbeat), stale_after=o.stale_after,
                         abort_after=o.abort_after, buddy=bool(o.buddy))
        if self.checkpoints is not None:
            c = self.checkpoints
            out.update(refill=c.refill,
                       train_state=lambda ckpt: c.train_state(ckpt, CARRIED_ARGS))
        return out

    def _join(self) -> None:
        """A replacement node's process: Megatron-LM's startup without forming a group, then a
        spare until a switch takes it in, then the job's loop."""
        from megatron.training import get_args
        from megatron.training import training as mt

        where = self.options.store or os.environ.get("DYNATRAIN_STORE") or None
        if where is None:
            raise DynatrainError("join_as: a replacement node needs the job's store: "
                                 "LiveOptions(store='HOST:PORT') or DYNATRAIN_STORE=HOST:PORT (its "
                                 "own torchrun's is another one)")
        if not self.options.requests:
            raise DynatrainError("join_as: a replacement node joins through a request; "
                                 "requests=False leaves it no way in")
        # initialize_megatron's logging and rerun state, without torch.distributed (the
        # switch that takes this process in forms its groups).
        mt.initialize_megatron(skip_mpu_initialization=True)
        args = get_args()
        self._refuse_unsupported(args)
        for flag, why in (("tp_comm_overlap", "its userbuffers are set up with the first "
                           "groups"), ("adlr_autoresume", "autoresume starts with the job")):
            if getattr(args, flag, False):
                raise DynatrainError(f"{flag}: not supported on a replacement node ({why})")
        # What _initialize_distributed does first, as initialize.py does it.
        if torch.cuda.device_count() > 0:
            torch.cuda.set_device(args.local_rank)
        mt.set_jit_fusion_options(tp_size=args.tensor_model_parallel_size)
        self.target = args.train_iters
        rdzv = self._rendezvous(args, where)
        first = rdzv.wait("first", self.options.timeout)
        if first.get("train_iters") != self.target:
            raise DynatrainError(f"train_iters: the job trains {first.get('train_iters')} "
                                 f"iterations; this node was launched with {self.target} (launch "
                                 "it with the job's arguments)")
        device = self.device()
        now = rdzv.read("current")
        if now is not None and device in Layout(spec_from_dict(now["spec"])).devices:
            raise DynatrainError(f"join_as: {device} already runs a rank of the job; name "
                                 "another node")
        sw = LiveSwitcher(None, device, self.build, self.verify, rendezvous=rdzv,
                          budget_bytes=self.options.budget_bytes, timeout=self.options.timeout,
                          init_kwargs=self.init_kwargs(), global_state=MegatronLMState(self),
                          **self._recovery_kwargs())
        self.control = LiveControl(sw, schedule=self._schedule(spec_from_dict(first["spec"])),
                                   requests=True, prepare_ahead=self.options.prepare_ahead)
        self._loop(None, sw)

    def _loop(self, job: MegatronJob | None, sw: LiveSwitcher) -> None:
        from megatron.training import get_timers
        from megatron.training import training as mt

        real_step = mt.train_step
        mt.train_step = self._step_wrapper(real_step)
        self.sw_now, self.job_now = sw, job
        self.progress = time.monotonic()
        try:
            job = self._train(job, sw, get_timers())
        finally:
            mt.train_step = real_step
            self.control.close()
        if job is not None:
            self._finish(job)
        sw.close()

    def _step_wrapper(self, real: Callable) -> Callable:
        @functools.wraps(real)
        def train_step(*a: Any, **k: Any) -> Any:
            from megatron.training import get_args

            self.progress = time.monotonic()  # a failure's error comes some time after this
            out = real(*a, **k)
            self.progress = time.monotonic()
            args = get_args()
            self._stepped(args)
            if self.sw_now.buddy:
                self._copy(args)
            if self.control.due(args.curr_iteration + 1, self.job_now):  # the boundary after
                args.train_iters = args.curr_iteration + 1
                self.segment_end = True
            return out
        return train_step

    def _stepped(self, args: Any) -> None:
        """After a step, what the job's state holds: iteration, consumed samples and FLOPs so
        far (``train()`` counts them only after ``train_step`` returns, in locals a failure
        loses: a recovery resumes from these). The FLOPs are the closed form Megatron-LM uses
        for unpacked sequences."""
        from megatron.core import parallel_state as mpu
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training import training as mt

        dp = mpu.get_data_parallel_world_size() * getattr(args, "gtp_weight_remat_size", 1)
        batch = dp * args.micro_batch_size * get_num_microbatches()
        _, _, flops = self.stepped
        count = getattr(mt, "num_floating_point_operations", None)  # a counter for logs only:
        step_flops = count(args, batch) if count is not None else 0.0  # never stop training
        self.stepped = (args.curr_iteration + 1, args.consumed_train_samples + batch,
                        flops + step_flops)

    def _copy(self, args: Any) -> None:
        """The buddy copy of the step ``train_step`` just took, with the training state after
        it (what a recovery from the copy resumes from)."""
        job = self.job_now
        it, consumed, flops = self.stepped
        job.iteration, job.consumed_samples = it, consumed
        job.extra = {k: getattr(args, k) for k in CARRIED_ARGS if hasattr(args, k)}
        job.extra["num_floating_point_operations_so_far"] = flops
        self.sw_now.snapshot(job)
        self.progress = time.monotonic()

    def _carry_out(self, job: MegatronJob, args: Any) -> None:
        job.iteration, job.consumed_samples = args.iteration, args.consumed_train_samples
        job.extra = {k: getattr(args, k) for k in CARRIED_ARGS if hasattr(args, k)}

    def _carry_in(self, job: MegatronJob, args: Any) -> None:
        args.iteration, args.consumed_train_samples = job.iteration, job.consumed_samples
        for k, v in job.extra.items():
            setattr(args, k, v)

    def _train(self, job: MegatronJob | None, sw: LiveSwitcher, timers: Any) -> MegatronJob | None:
        from megatron.core.utils import get_model_config
        from megatron.training import get_args
        from megatron.training import training as mt
        from megatron.training.async_utils import maybe_finalize_async_save

        c = self.call
        args = get_args()
        while True:
            if job is None:  # this device left: a spare until a switch takes it back
                result = sw.join()
                if result is None:
                    return None
                job = result.job
                self._carry_in(job, args)
                # The job's processes never run what was due before the boundary it joined at
                # plus prepare_ahead (they had a switch under way then): nor does this one.
                for due in [d for d in self.control.schedule
                            if d < args.iteration + self.control.ahead]:
                    del self.control.schedule[due]
            train_it, valid_it, test_it = self.iterators(len(job.model_chunks))
            self.iterators_now = (train_it, valid_it, test_it)
            if args.iteration >= self.target:
                return job
            self.segment_end = False
            self.stepped = (args.iteration, args.consumed_train_samples,
                            getattr(args, "num_floating_point_operations_so_far", 0))
            try:
                due = self.control.due(args.iteration, job)
            except Exception as err:  # noqa: BLE001 — a member died while the others waited
                job = self._recover(job, sw, err, timers)  # at the boundary; else re-raised
                if job is not None:
                    self._carry_in(job, args)
                continue
            if due:
                self.segment_end = True
            else:
                args.train_iters = self.target
                self.job_now = job  # the job train_step's buddy copies are taken of
                try:
                    iteration, flops = mt.train(
                        c["forward_step_func"], job.model_chunks, job.optimizer, job.scheduler,
                        train_it, valid_it, c.get("process_non_loss_data_func"),
                        get_model_config(job.model_chunks[0]), {}, c.get("non_loss_data_func"),
                        **_known(mt.train, dict(p2p_communicator=c.get("p2p_communicator"))))
                except Exception as err:  # noqa: BLE001 — a member died or hangs; else re-raised
                    args.train_iters = self.target
                    job = self._recover(job, sw, err, timers)
                    if job is not None:
                        self._carry_in(job, args)
                    continue
                args.iteration, args.num_floating_point_operations_so_far = iteration, flops
                args.train_iters = self.target
                self._stop_interval_timer(timers)
            if not self.segment_end:
                return job
            maybe_finalize_async_save(blocking=True)
            self._carry_out(job, args)
            job = self.control.switch(job)
            if job is not None:
                self._carry_in(job, args)
                if sw.buddy:  # the new layout's first copy, before its first step
                    sw.snapshot(job)

    @staticmethod
    def _stop_interval_timer(timers: Any) -> None:
        timer = timers("interval-time")  # train() leaves it running
        if getattr(timer, "_started", False):
            timer.stop()

    def _recover(self, job: MegatronJob, sw: LiveSwitcher, err: BaseException,
                 timers: Any) -> MegatronJob | None:
        """After ``train()`` raised: recover on the survivors if a member is gone (the job to
        train on; None: this device left the job), else raise ``err`` again (a bug, not a
        failure). A recovery that cannot restore the lost state ends this process with one
        line and its exit status (3: state lost)."""
        import sys

        from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine
        from megatron.training import get_args

        if not self.options.recover:
            raise err
        # From the job's last progress (a step began or ended) to this error: the work until
        # the failure plus the wait until the blocked collective gave up (a hung peer: the
        # groups' timeout). Not part of the recovery's downtime, which starts here.
        stalled = time.monotonic() - self.progress
        args = get_args()
        # What train() left mid-iteration: its timers still running, and the rerun state
        # machine inside a forward-backward run (its next should_run_forward_backward would
        # say no, and train_step would use losses it never computed).
        for timer in getattr(timers, "_timers", {}).values():
            if getattr(timer, "_started", False):
                timer.stop()
        get_rerun_state_machine().state = RerunState.NOT_RUNNING_YET
        it, consumed, flops = self.stepped
        job.iteration, job.consumed_samples = it, consumed
        job.extra = {k: getattr(args, k) for k in CARRIED_ARGS if hasattr(args, k)}
        job.extra["num_floating_point_operations_so_far"] = flops
        ckpt = None
        if self.checkpoints is not None and getattr(args, "save", None):
            ckpt = self.checkpoints.newest(args.save)
        try:
            result = sw.recover(job, checkpoint=ckpt)
        except RecoveryFailed as failed:
            if failed.nothing_failed:
                raise err from None
            where = "" if ckpt is not None else " [no checkpoint under --save to read]"
            print(f"dynatrain: {_first_line(failed)}{where}", file=sys.stderr, flush=True)
            raise SystemExit(failed.exit_code) from failed
        self.control.recovered(result)
        if result.job is not None and sw.buddy:  # the survivors' layout's first copy
            sw.snapshot(result.job)
        if result.job is not None and sw.leader:
            r = result.recovery
            why = _first_line(err)[:120]
            phases = ", ".join(f"{k} {v:.2f}" for k, v in result.phases().items())
            print(f"dynatrain: {', '.join(r['failed'])} failed ({why}); recovered by "
                  f"{r['mode']} on {len(r['devices'])} devices ({r['dst']}), training on from "
                  f"iteration {result.job.iteration}; the error came {stalled:.2f} s after "
                  "the job's last progress (work until the failure, then the wait for a "
                  f"collective to give up); downtime from the error "
                  f"{result.seconds.get('downtime', 0.0):.2f} s on this process ({phases} s)",
                  flush=True)
        return result.job

    def _finish(self, job: MegatronJob) -> None:
        """What ``pretrain`` does after ``train``: the last save, validation and test."""
        from megatron.core.utils import get_model_config
        from megatron.training import get_args
        from megatron.training import training as mt
        from megatron.training.async_utils import maybe_finalize_async_save

        from megatron.training import get_timers

        c, args, ck = self.call, get_args(), self.cfg.checkpoint
        iteration = args.iteration
        _, valid_it, test_it = self.iterators_now
        if ck.save and iteration != 0 and iteration % ck.save_interval != 0:
            # Running, as train() leaves it in pretrain (the driver stopped it between
            # segments): save_checkpoint_and_time stops it first.
            timer = get_timers()("interval-time", log_level=0)
            if not getattr(timer, "_started", False):
                timer.start()
            mt.save_checkpoint_and_time(iteration, job.model_chunks, job.optimizer,
                                        job.scheduler, args.num_floating_point_operations_so_far,
                                        {}, train_data_iterator=self.iterators_now[0])
        config = get_model_config(job.model_chunks[0])
        for flag, it, name in ((args.do_valid, valid_it, "validation"),
                               (args.do_test, test_it, "test")):
            if flag:
                mt.evaluate_and_print_results(
                    f"iteration {iteration} on {name} set", c["forward_step_func"], it,
                    job.model_chunks, iteration, c.get("process_non_loss_data_func"), config,
                    verbose=True, write_to_tensorboard=not self.cfg.validation.skip_train,
                    non_loss_data_func=c.get("non_loss_data_func"))
        maybe_finalize_async_save(blocking=True, terminate=True)


def drive(args: tuple, kwargs: dict, options: LiveOptions, verify: Verifier,
          checkpoints: Checkpoints | None = None) -> None:
    """Run the installed Megatron-LM's ``pretrain(*args, **kwargs)`` program with live
    switches (``dynatrain.megatron_lm.pretrain`` is the public entry point)."""
    from megatron.training import training as mt

    sig = inspect.signature(mt.pretrain)
    if "cfg_container" not in sig.parameters:
        raise DynatrainError("pretrain: DynaTrain drives the pretrain of megatron-core >= 0.19 "
                             "(a PretrainConfigContainer first); the installed one takes "
                             f"({', '.join(list(sig.parameters)[:4])}, ...)")
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as err:
        raise DynatrainError(f"pretrain: {err}") from None
    bound.apply_defaults()
    _Driver(dict(bound.arguments), options, verify, checkpoints).run()


def seconds_option(name: str, value: Any) -> float | None:
    """A ``LiveOptions`` field of seconds: None, or a number > 0 (else one line naming it)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise DynatrainError(f"{name}: seconds > 0 (got {value!r})")
    return float(value)


def bound_groups(seconds: float) -> int:
    """Give every process group of this process that megatron's parallel state holds, and the
    default group, the timeout ``seconds`` (Megatron-LM made them with whole minutes);
    the number of groups."""
    from megatron.core import parallel_state as ps

    groups: dict[int, dist.ProcessGroup] = {}

    def visit(x: Any) -> None:
        if isinstance(x, dist.ProcessGroup):
            groups[id(x)] = x
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y)

    for value in list(vars(ps).values()):
        visit(value)
    visit(dist.group.WORLD)
    for pg in groups.values():
        pg.set_timeout(datetime.timedelta(seconds=seconds))
    return len(groups)
