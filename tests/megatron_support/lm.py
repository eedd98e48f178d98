"""Test support for Megatron-LM's own training loop (``megatron.training.pretrain``, shipped in
megatron-core 0.19's wheel) on CPU, under ``dynatrain.runtime.megatron.cpu.megatron_lm_cpu``.

The wheel has no ``pretrain_gpt.py``; this module plays its part with a tiny GPT:

* ``argv(...)`` -- Megatron-LM's command line for a tiny GPT on CPU (local transformer, gloo, bf16,
  CPU initialisation, no fusions, mock data, ``NullTokenizer``), global batch 8, micro-batch 1;
* ``model_provider`` / ``dataset_provider`` / ``forward_step`` -- what ``pretrain_gpt.py`` gives
  ``pretrain`` (megatron-core's ``GPTModel`` with the local layer spec, ``MockGPTDataset``, the
  token-averaged LM loss);
* ``run_pretrain(argv, world)`` -- ``world`` forked processes (megatron is imported here, in the
  parent, so they start warm) that each parse ``argv`` with ``parse_and_validate_args``, build
  the config container with ``pretrain_cfg_container_from_args`` and run ``pretrain`` under the
  shim; returns one :class:`Record` per rank: the iteration ``train`` returned, each iteration's
  loss, and the model and optimizer state right after ``setup_model_and_optimizer`` (so after a
  ``--load``) and after ``pretrain`` returned (so after the final ``--save``).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from dynatrain.runtime.megatron.cpu import megatron_lm_cpu

# Imported in the parent so forked workers start warm (megatron.training takes tens of seconds).
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.training import get_args, get_tokenizer, training
from megatron.training.argument_utils import (core_transformer_config_from_args,
                                              pretrain_cfg_container_from_args)
from megatron.training.arguments import parse_and_validate_args

__all__ = ["GLOBAL_BATCH", "Record", "argv", "dataset_provider", "forward_step", "model_provider",
           "run_pretrain", "state_of"]

GLOBAL_BATCH = 8
SEQ = 32
VOCAB = 128


def argv(*, tp: int = 2, pp: int = 1, iters: int = 4, save: str | None = None,
         load: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """Megatron-LM's arguments for the tiny GPT on CPU (no dropout: the CPU RNG tracker is inert,
    see the shim's doc), ``iters`` iterations, ``torch_dist`` checkpoints to ``save`` / from
    ``load``."""
    a = ["--transformer-impl", "local", "--distributed-backend", "gloo", "--bf16",
         "--use-cpu-initialization", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
         "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
         "--no-persist-layer-norm",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
         "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
         "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--max-position-embeddings", str(SEQ), "--attention-dropout", "0", "--hidden-dropout", "0",
         "--micro-batch-size", "1", "--global-batch-size", str(GLOBAL_BATCH),
         "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
         "--train-iters", str(iters), "--lr", "3e-3", "--min-lr", "3e-4",
         "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--seed", "1234",
         "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--ckpt-format", "torch_dist",
         "--distributed-timeout-minutes", "2"]
    if save is not None:
        a += ["--save", save, "--save-interval", str(iters)]
    if load is not None:
        a += ["--load", load]
    return a + list(extra)


# ---- what pretrain_gpt.py gives pretrain ---------------------------------------------------------


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                   config: Any = None, pg_collection: Any = None) -> GPTModel:
    """megatron-core's GPTModel with the local layer spec, from Megatron-LM's args."""
    args = get_args()
    config = config or core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=args.qk_layernorm,
                                    normalization=args.normalization)
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, vp_stage=vp_stage,
                    pg_collection=pg_collection)


def dataset_provider(train_val_test_num_samples: list[int], vp_stage: int | None = None):
    """Mock GPT datasets, built on every rank (each reads its own batches, so TP ranks need no
    broadcast of the batch)."""
    args = get_args()
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length,
                              split="1,0,0", tokenizer=get_tokenizer(),
                              reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, create_attention_mask=True)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples,
                                         lambda: True, config).build()


dataset_provider.is_distributed = True  # pretrain builds the loaders on every rank


def _loss(loss_mask: torch.Tensor, output: torch.Tensor):
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    # (sum, tokens): the loop averages over every token of the global batch.
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1).float()])}


def forward_step(data_iterator, model):
    """One micro-batch: the mock sample's tokens through the model, the masked LM loss."""
    batch = next(data_iterator)
    tokens, labels = batch["tokens"], batch["labels"]
    out = model(tokens, batch["position_ids"], batch["attention_mask"], labels=labels)
    return out, lambda o: _loss(batch["loss_mask"], o)


# ---- running it ----------------------------------------------------------------------------------


@dataclass
class Record:
    """One rank's view of one ``pretrain`` run."""

    iteration: int = -1  # what train() returned
    losses: dict[int, float] = field(default_factory=dict)  # iteration (1-based) -> LM loss
    loaded: dict[str, torch.Tensor] = field(default_factory=dict)  # after setup_model_and_optimizer
    final: dict[str, torch.Tensor] = field(default_factory=dict)  # after pretrain returned
    args: dict[str, Any] = field(default_factory=dict)  # a few of Megatron-LM's args at the end
    # At every entry into train(): args.iteration -> the state it trains from (model, optimizer,
    # "scheduler" state, "consumed" samples, "layout" (tp, pp, dp)). A live switch enters
    # train() again after each switch; Megatron-LM's restart enters it once, after --load.
    at_train: dict[int, dict[str, Any]] = field(default_factory=dict)
    # Each live switch that committed: the iteration it ran at -> its ``SwitchResult.seconds``.
    switched: dict[int, dict[str, float]] = field(default_factory=dict)
    # ... and whether it ran the exchange made ahead (``report["prepared_ahead"]``), else why.
    prepared: dict[int, tuple[bool, str | None]] = field(default_factory=dict)


def state_of(model: list, optimizer: Any) -> dict[str, torch.Tensor]:
    """Every model tensor (bf16 params), every fp32 main param and Adam moment, by name."""
    out: dict[str, torch.Tensor] = {}
    for ci, chunk in enumerate(model):
        for name, t in chunk.state_dict().items():
            if isinstance(t, torch.Tensor):
                out[f"model{ci}.{name}"] = t.detach().clone()
    leaves = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for li, leaf in enumerate(leaves):
        inner = leaf.optimizer
        for gi, group in enumerate(inner.param_groups):
            for pi, p in enumerate(group["params"]):
                out[f"opt{li}.g{gi}.p{pi}.param"] = p.detach().clone()
                for k, v in inner.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        out[f"opt{li}.g{gi}.p{pi}.{k}"] = v.detach().clone()
    return out


def _instrument(rec: Record) -> dict:
    """Wrap the loop's functions that ``pretrain``/``train`` look up by name at call time."""
    held: dict = {}
    setup, train, step = training.setup_model_and_optimizer, training.train, training.train_step

    def setup_(*a, **k):
        model, optimizer, scheduler = setup(*a, **k)
        held.update(model=model, optimizer=optimizer)
        rec.loaded = state_of(model, optimizer)
        return model, optimizer, scheduler

    def train_(*a, **k):
        from megatron.core import parallel_state as ps

        args = get_args()
        rec.at_train[args.iteration] = {
            "state": state_of(a[1], a[2]), "scheduler": a[3].state_dict(),
            "consumed": args.consumed_train_samples,
            "args": {k: getattr(args, k) for k in (
                "tensor_model_parallel_size", "pipeline_model_parallel_size",
                "data_parallel_size", "world_size", "rank", "padded_vocab_size")},
            "micro_batches": get_num_microbatches(),
            "layout": (ps.get_tensor_model_parallel_world_size(),
                       ps.get_pipeline_model_parallel_world_size(),
                       ps.get_data_parallel_world_size())}
        out = train(*a, **k)
        rec.iteration = int(out[0])
        return out

    def step_(*a, **k):
        out = step(*a, **k)
        if "lm loss" in out[0]:
            rec.losses[get_args().curr_iteration + 1] = float(out[0]["lm loss"])
        return out

    training.setup_model_and_optimizer, training.train, training.train_step = setup_, train_, step_

    from dynatrain.runtime.megatron.control import LiveControl
    from dynatrain.runtime.megatron.job import SwitchResult

    real_switch = LiveControl.switch

    def switch_(self, job):
        it = job.iteration
        out = real_switch(self, job)
        if isinstance(self.last, SwitchResult):
            rec.switched[it] = dict(self.last.seconds)
            rec.prepared[it] = (bool(self.last.report.get("prepared_ahead")),
                                self.last.report.get("prepared_why"))
        return out

    LiveControl.switch = switch_
    return held


def _refuse_carried_scheduler_once() -> None:
    """The next ``OptimizerParamScheduler.load_state_dict`` on this process raises, as
    megatron's scheduler does for a state it does not accept (``fail_carry``): a failure after
    a switch's exchange, on one process."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    real = OptimizerParamScheduler.load_state_dict

    def refuse(self, state_dict):
        OptimizerParamScheduler.load_state_dict = real
        raise AssertionError("injected: OptimizerParamScheduler refuses the carried state")

    OptimizerParamScheduler.load_state_dict = refuse


def _dying(forward: Any, iteration: int, how: int = signal.SIGKILL) -> Any:
    """``forward`` that kills (``how``: SIGKILL) or stops (SIGSTOP: a hung node, its sockets
    open) this process and everything it started (its process group: a node that dies takes
    its checkpoint writers with it) in iteration ``iteration + 1``'s forward pass."""

    def forward_step(data_iterator, model):
        if get_args().curr_iteration == iteration:
            os.killpg(os.getpgrp(), how)
        return forward(data_iterator, model)

    return forward_step


def _worker(rank: int, world: int, argv_: list[str], tmpdir: str, options: Any = None,
            fail_carry: int | None = None, tag: str = "rank", env: dict | None = None,
            die_at: int | None = None, how: int = signal.SIGKILL) -> None:
    os.setpgrp()  # the launcher ends this process and any it started (checkpoint writers, Manager)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world),
                      GLOO_SOCKET_IFNAME="lo", CUDA_DEVICE_MAX_CONNECTIONS="1", **(env or {}))
    if fail_carry == rank:
        _refuse_carried_scheduler_once()
    try:
        rec = Record()
        held = _instrument(rec)
        store = torch.distributed.FileStore(os.path.join(tmpdir, f"store-{tag}"), world)
        sys.argv = ["pretrain_gpt.py", *argv_]
        step = forward_step if die_at is None else _dying(forward_step, die_at, how)
        with megatron_lm_cpu(force=True):
            args = parse_and_validate_args()
            cfg = pretrain_cfg_container_from_args(args)
            if options is None:  # Megatron-LM's own
                training.pretrain(cfg, dataset_provider, ModelType.encoder_or_decoder,
                                  step, model_provider=model_provider, store=store)
            else:  # the one-import change: DynaTrain's drop-in, with live switches
                from dynatrain.megatron_lm import pretrain

                pretrain(cfg, dataset_provider, ModelType.encoder_or_decoder, step,
                         model_provider=model_provider, store=store, dynatrain=options)
            rec.final = state_of(held["model"], held["optimizer"])
            rec.args = {k: getattr(args, k) for k in
                        ("iteration", "consumed_train_samples", "tensor_model_parallel_size",
                         "pipeline_model_parallel_size", "data_parallel_size")}
        torch.distributed.barrier()
        torch.save(rec, os.path.join(tmpdir, f"{tag}{rank}.pt.tmp"))
        os.replace(os.path.join(tmpdir, f"{tag}{rank}.pt.tmp"), os.path.join(tmpdir, f"{tag}{rank}.pt"))
    except BaseException as e:  # noqa: BLE001 - report, then exit non-zero
        with open(os.path.join(tmpdir, f"{tag}{rank}.error.json"), "w") as f:
            json.dump({"message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}, f)
        sys.exit(1)


def run_pretrain(argv_: list[str], world: int = 2, timeout: float = 300.0,
                 options: Any = None, fail_carry: int | None = None,
                 started: Any = None, joiners: int = 0,
                 join_env: dict | None = None,
                 die: dict[int, int] | None = None,
                 how: int = signal.SIGKILL) -> list[Record | None]:
    """Run Megatron-LM's ``pretrain`` with ``argv_`` in ``world`` forked gloo processes (not
    daemonic: the dist-checkpoint writer starts processes of its own); one Record per rank.
    With ``options`` (``dynatrain.megatron_lm.LiveOptions``) DynaTrain's ``pretrain`` runs
    instead, with live switches. ``started`` runs once every process is forked: start a
    test's own threads there (a fork while another thread holds a lock can leave the child
    waiting on it forever). ``joiners`` more processes start as a replacement node launched
    apart (ranks 0.. of a world of their own, their own store, ``join_env`` added to their
    environment); their Records follow the job's. ``die``: rank -> the iteration (0-based)
    in whose forward pass that rank is killed with everything it started (``how``: SIGKILL),
    or stopped (SIGSTOP: killed once the others are done); its Record is None."""
    die = dict(die or {})
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="mlm_loop_") as tmpdir:
        names = [("rank", r) for r in range(world)] + [("join", r) for r in range(joiners)]
        procs = [ctx.Process(target=_worker, args=(
            r, world if tag == "rank" else joiners, argv_, tmpdir, options,
            fail_carry if tag == "rank" else None, tag, None if tag == "rank" else join_env,
            die.get(r) if tag == "rank" else None, how))
            for tag, r in names]
        killed = {i for i, (tag, r) in enumerate(names) if tag == "rank" and r in die}
        for p in procs:
            p.start()
        if started is not None:
            started()
        deadline = time.monotonic() + timeout
        try:
            # Stop at the first failure: the other ranks would wait in a collective.
            # (The ranks killed on purpose are expected to end by SIGKILL; stopped ones never
            # end by themselves.)
            while time.monotonic() < deadline and \
                    any(p.exitcode is None for i, p in enumerate(procs) if i not in killed) \
                    and not any(p.exitcode for i, p in enumerate(procs) if i not in killed):
                procs[0].join(0.5)
            codes = [p.exitcode for p in procs]  # read once: a process may end meanwhile
            failed = [i for i, c in enumerate(codes) if c != 0
                      and not (i in killed and c in (-signal.SIGKILL, None))]
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.join(5)
        for i in failed:
            tag, r = names[i]
            path = os.path.join(tmpdir, f"{tag}{r}.error.json")
            if os.path.exists(path):
                with open(path) as f:
                    e = json.load(f)
                raise RuntimeError(f"{tag} {r}: {e['message']}\n{e['traceback']}")
        if failed:
            raise RuntimeError(f"{[names[i] for i in failed]} did not finish within "
                               f"{timeout:.0f} s (exit codes {[codes[i] for i in failed]})")
        return [None if i in killed else
                torch.load(os.path.join(tmpdir, f"{tag}{r}.pt"), weights_only=False)
                for i, (tag, r) in enumerate(names)]
