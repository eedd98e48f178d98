"""Test support for the live bridge: real megatron-core training jobs in forked gloo workers.

``run_workers(fn, world)`` forks ``world`` processes (megatron is imported here, in the parent,
so they start warm), joins them in a gloo group, runs ``fn(rank)`` inside the CPU shim and
returns every rank's result (written with ``torch.save``). Inside a worker:

* ``init_parallel(c)`` / ``build(c, seed)`` set up megatron's parallel state and build the model
  chunks, DDP wrappers and optimizer exactly as ``harness._build`` does (same config), but as two
  steps, so a rank can build a second, fresh model in the same parallel state, or tear the state
  down (``ps.destroy_model_parallel``) and build another layout in the same processes.
* ``train_step(job, it)`` runs one real iteration: zero grad buffers, megatron's
  forward/backward schedule (1F1B, or interleaved with VPP) over ``MICROBATCHES`` synthetic
  micro-batches with ``finalize_model_grads``, then ``optimizer.step()``. The tokens depend only
  on (iteration, DP rank, micro-batch), so two builds of one layout train on the same data.
* ``sharded_leaves(job)`` is the independent oracle: megatron's own ``sharded_state_dict()`` of
  the model chunks and of the optimizer (``fully_reshardable``: megatron gathers the optimizer's
  shards over DP and maps them to per-parameter tensors with the model's checkpoint metadata),
  as plain records. ``assemble`` places every rank's records into global tensors, requiring all
  replicas of an element to agree bit for bit and every element to be covered.
* ``native_state(job)`` is megatron's own view of everything a rank holds (module state dicts,
  DDP param buffers, the optimizer's bucket-space / per-parameter state), for bit-exact
  comparisons of two jobs that do not go through the bridge.
* ``load_dist_checkpoint(job, path)`` loads model + optimizer the way Megatron-LM does
  (``dist_checkpointing.load`` then ``load_state_dict``), with the two fixes 0.16.1 needs when
  Adam is torch's own (no Apex / Transformer Engine), see its doc.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module

from .harness import (_mtp_block_spec, _resolve_cfg, _te_spec, _transformer_config,
                      sharded_metadata)
from .probes import _may_have_children
from dynatrain.runtime.megatron.cpu import cpu_shim

# megatron-core 0.16.1 without Transformer Engine never binds moe_utils.te_general_gemm, yet the
# router's gating reads it (NameError on the first MoE forward); None selects its torch path.
from megatron.core.transformer.moe import moe_utils as _moe_utils  # noqa: E402

if not hasattr(_moe_utils, "te_general_gemm"):
    _moe_utils.te_general_gemm = None

__all__ = ["Job", "run_workers", "resolve", "init_parallel", "build", "train_step",
           "sharded_leaves", "assemble", "native_state", "save_dist_checkpoint",
           "load_dist_checkpoint", "bits_equal", "native_diffs", "EXPERT_BIAS", "MICROBATCHES",
           "SEQ", "LR"]

MICROBATCHES = 2
SEQ = 8
LR = 1e-2  # large enough that two steps move every tensor visibly
# Router expert bias as megatron requires it (sigmoid scores).
EXPERT_BIAS = dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")


@dataclass
class Job:
    """One rank's live megatron objects."""

    c: dict  # resolved harness cfg
    gpts: list  # GPTModel per chunk
    ddps: list  # DistributedDataParallel per chunk
    optimizer: Any


def resolve(cfg: dict) -> dict:
    """The harness's resolved config (defaults filled in, vocab padded)."""
    return _resolve_cfg(cfg)


# ---- processes --------------------------------------------------------------------------------


class _SetupFailed(RuntimeError):
    """The workers' own process group could not be formed (before ``fn`` ran)."""


def run_workers(fn: Callable[[int], Any], world: int, timeout: float = 120.0,
                started: Callable[[], Any] | None = None) -> list:
    """Run ``fn(rank)`` in ``world`` forked gloo workers; return their results by rank.

    ``started`` runs once every worker is forked: start a test's own threads there (a fork
    while another thread holds a lock can leave the child waiting on it forever). Where the
    workers' own gloo group fails to connect before ``fn`` runs (seen on the 2-core machine
    under the full suite's load: "connectFullMesh ... Connection closed by peer"), they are
    started once more; nothing of ``fn`` ran, so nothing it checks is retried."""
    try:
        return _run_workers(fn, world, timeout, started)
    except _SetupFailed:
        return _run_workers(fn, world, timeout, started)


def _run_workers(fn: Callable[[int], Any], world: int, timeout: float,
                 started: Callable[[], Any] | None) -> list:
    if dist.is_initialized() or ps.model_parallel_is_initialized():
        raise RuntimeError("run_workers needs a parent without a process group")
    with tempfile.TemporaryDirectory(prefix="mcore_live_") as tmpdir:
        ctx = tmp.start_processes(_worker, args=(fn, world, tmpdir), nprocs=world, join=False,
                                  daemon=True, start_method="fork")
        if started is not None:
            started()
        deadline = time.monotonic() + timeout
        try:
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers did not finish within {timeout:.0f} s")
                try:
                    if ctx.join(timeout=0.5):
                        break
                except (tmp.ProcessRaisedException, tmp.ProcessExitedException) as exc:
                    raise _error(tmpdir, world, exc) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(timeout=5)
        return [torch.load(os.path.join(tmpdir, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]


def _worker(rank: int, fn: Callable[[int], Any], world: int, tmpdir: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        store = dist.FileStore(os.path.join(tmpdir, "store"), world)
        try:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=120))
        except RuntimeError as e:
            raise _SetupFailed(str(e)) from e
        with cpu_shim(force=True):
            out = fn(rank)
        if dist.is_initialized():  # a worker whose process left its group returns alone
            dist.barrier()
        torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt.tmp"))
        os.replace(os.path.join(tmpdir, f"rank{rank}.pt.tmp"),
                   os.path.join(tmpdir, f"rank{rank}.pt"))
    except BaseException as e:  # noqa: BLE001 - report, then re-raise
        with open(os.path.join(tmpdir, f"rank{rank}.error.json"), "w") as f:
            json.dump({"message": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()}, f)
        raise


def _error(tmpdir: str, world: int, exc: Exception) -> RuntimeError:
    first = getattr(exc, "error_index", None)
    for r in ([first] if first is not None else []) + list(range(world)):
        path = os.path.join(tmpdir, f"rank{r}.error.json")
        if os.path.exists(path):
            with open(path) as f:
                e = json.load(f)
            kind = _SetupFailed if e["message"].startswith("_SetupFailed") else RuntimeError
            return kind(f"rank {r}: {e['message']}\n{e['traceback']}")
    return RuntimeError(f"worker failed: {exc}")


# ---- building and training ---------------------------------------------------------------------


def init_parallel(c: dict, **extra) -> None:
    """megatron's parallel state for layout ``c`` (as ``harness._build``); ``extra``: more
    ``initialize_model_parallel`` arguments (e.g. ``distributed_timeout_minutes``)."""
    ps.initialize_model_parallel(
        tensor_model_parallel_size=c["tp"],
        pipeline_model_parallel_size=c["pp"],
        virtual_pipeline_model_parallel_size=c["vpp"],
        context_parallel_size=c["cp"],
        expert_model_parallel_size=c["ep"],
        expert_tensor_parallel_size=c["etp"],
        num_distributed_optimizer_instances=c["num_distributed_optimizer_instances"],
        order=c["order"],
        create_gloo_process_groups=False,
        **extra,
    )


def build(c: dict, seed: int | None = None) -> Job:
    """Model chunks, DDP and optimizer for ``c`` in the current parallel state.

    ``seed`` replaces ``c["seed"]`` (a fresh build with other weights)."""
    seed = (c["seed"] if seed is None else seed) + 100 * ps.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    config = _transformer_config(c)
    gpts = []
    for i in range(c["vpp"] or 1):
        vp = i if c["vpp"] is not None else None
        if c["transformer_impl"] == "transformer_engine":
            # Only in a process that has TE (or its stand-in, megatron_support.te_live).
            spec = _te_spec(c, config, vp)
        elif c["num_moe_experts"] is not None:
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                              normalization=c["normalization"], vp_stage=vp)
        else:
            spec = get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False,
                                            qk_layernorm=bool(c["qk_layernorm"]),
                                            multi_latent_attention=bool(
                                                c["multi_latent_attention"]),
                                            normalization=c["normalization"])
        mtp = _mtp_block_spec(c, config, spec, vp) if c["mtp_num_layers"] else None
        gpts.append(GPTModel(
            config=config, transformer_layer_spec=spec, mtp_block_spec=mtp,
            vocab_size=c["padded_vocab_size"],
            max_sequence_length=c["seq_length"],
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=not c["untie_embeddings_and_output_weights"],
            position_embedding_type=c["position_embedding_type"], vp_stage=vp))
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=bool(c["grad_reduce_in_fp32"]), overlap_grad_reduce=False,
        use_distributed_optimizer=bool(c["use_distributed_optimizer"]),
        num_distributed_optimizer_instances=c["num_distributed_optimizer_instances"])
    ddps = [DistributedDataParallel(config=config, ddp_config=ddp_config,
                                    module=Float16Module(config, g), disable_bucketing=(i > 0))
            for i, g in enumerate(gpts)]
    opt_config = OptimizerConfig(optimizer="adam", lr=LR, min_lr=LR / 10, bf16=True,
                                 params_dtype=torch.bfloat16,
                                 use_distributed_optimizer=bool(c["use_distributed_optimizer"]),
                                 **_optimizer_overrides(c))
    optimizer = get_megatron_optimizer(opt_config, ddps, use_gloo_process_groups=False)
    config.finalize_model_grads_func = finalize_model_grads
    return Job(c, gpts, ddps, optimizer)


def _optimizer_overrides(c: dict) -> dict:
    """``optimizer_config_overrides`` with dtype names as torch dtypes (JSON carries names)."""
    out = dict(c.get("optimizer_config_overrides") or {})
    for k, v in out.items():
        if isinstance(v, str) and v in ("fp32", "bf16", "fp16"):
            out[k] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[v]
    return out


def _batches(c: dict, it: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    dp = ps.get_data_parallel_rank()
    out = []
    for mb in range(MICROBATCHES):
        g = torch.Generator().manual_seed(1_000_003 * it + 1009 * dp + mb)
        seq = torch.randint(0, c["vocab_size"], (1, SEQ + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def train_step(job: Job, it: int) -> list[float]:
    """One training iteration (see module doc); the losses this rank saw (last stage only)."""
    batches = _batches(job.c, it)
    pos = torch.arange(SEQ).unsqueeze(0)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)

    def forward_step(data_iterator, model):
        ids, labels = next(data_iterator)
        out = model(ids, pos, mask, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    chunks = len(job.ddps)
    data = [iter(batches) for _ in range(chunks)] if chunks > 1 else iter(batches)
    for m in job.ddps:
        m.train()
        m.zero_grad_buffer()
    job.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=job.ddps,
        num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=1, forward_only=False)
    ok, _, _ = job.optimizer.step()
    assert ok, "optimizer step failed"
    return [float(d["loss"]) for d in losses]


# ---- the oracle: megatron's own sharded state dicts -------------------------------------------


def _model_sd(job: Job) -> dict:
    md = sharded_metadata(job.c)
    return {f"model{i}": g.sharded_state_dict(metadata=md) for i, g in enumerate(job.gpts)}


_SD_META = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _sd_meta(job: "Job") -> dict:
    """The checkpoint format: fully_reshardable, except for TE FusedAdam's int16 param
    remainders, which megatron copies into fp32 buffers there and cannot load back (M16
    optimizer/distrib_optimizer.py:1028-1064, 911-940): then core's default,
    fully_sharded_model_space, which keeps their dtype."""
    o = job.c.get("optimizer_config_overrides") or {}
    if o.get("use_precision_aware_optimizer") and o.get("store_param_remainders", True):
        return dict(_SD_META, distrib_optim_sharding_type="fully_sharded_model_space")
    return _SD_META


def _walk(sd, out: list) -> None:
    if isinstance(sd, dict):
        for v in sd.values():
            _walk(v, out)
    elif isinstance(sd, (list, tuple)):
        for v in sd:
            _walk(v, out)
    elif isinstance(sd, ShardedTensorFactory):
        _walk(sd.build(), out)
    elif isinstance(sd, ShardedTensor):
        out.append(sd)


def _steps(sd, out: set) -> None:
    """Adam's step as the optimizer state dict records it (param groups / common_step)."""
    if isinstance(sd, dict):
        for k, v in sd.items():
            if k in ("step", "common_step") and not isinstance(v, (dict, list)):
                out.add(float(v))
            else:
                _steps(v, out)
    elif isinstance(sd, (list, tuple)):
        for v in sd:
            _steps(v, out)


def sharded_leaves(job: Job) -> dict:
    """This rank's ShardedTensors of model and optimizer (cloned data) and the step."""
    model_sd = _model_sd(job)
    opt_sd = job.optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=_SD_META)
    tensors: list[ShardedTensor] = []
    _walk(model_sd, tensors)
    _walk(opt_sd, tensors)
    steps: set = set()
    _steps(opt_sd, steps)
    recs = [{"key": t.key, "global_shape": tuple(t.global_shape),
             "global_offset": tuple(t.global_offset), "prepend": int(t.prepend_axis_num),
             "data": t.data.detach().clone(), "replica_id": t.replica_id}
            for t in tensors if not t.key.endswith("_extra_state")]
    return {"tensors": recs, "steps": sorted(steps)}


def assemble(per_rank: list[dict]) -> tuple[dict[str, torch.Tensor], set]:
    """Global tensors by checkpoint key from every rank's ``sharded_leaves``; the step set.

    Every element must be covered, and all replicas of an element must agree bit for bit."""
    shapes: dict[str, tuple] = {}
    dtypes: dict[str, torch.dtype] = {}
    for res in per_rank:
        for r in res["tensors"]:
            if shapes.setdefault(r["key"], r["global_shape"]) != r["global_shape"]:
                raise AssertionError(f"{r['key']}: global shapes differ across ranks")
            if dtypes.setdefault(r["key"], r["data"].dtype) != r["data"].dtype:
                raise AssertionError(f"{r['key']}: dtypes differ across ranks")
    out = {k: torch.zeros(s, dtype=dtypes[k]) for k, s in shapes.items()}
    seen = {k: torch.zeros(s, dtype=torch.bool) for k, s in shapes.items()}
    steps: set = set()
    for res in per_rank:
        steps.update(res["steps"])
        for r in res["tensors"]:
            data = r["data"]
            size = (1,) * r["prepend"] + tuple(data.shape)
            sl = tuple(slice(o, o + n) for o, n in zip(r["global_offset"], size))
            dst, have = out[r["key"]][sl], seen[r["key"]][sl]
            data = data.reshape(size)
            clash = have & ~_bitwise_eq(dst, data)
            if clash.any():
                raise AssertionError(f"{r['key']}: replicas disagree at offset "
                                     f"{r['global_offset']}")
            dst.copy_(data)
            have.fill_(True)
    for k, s in seen.items():
        if not s.all():
            raise AssertionError(f"{k}: {int((~s).sum())} elements are on no rank")
    return out, steps


def _bitwise_eq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype != b.dtype:
        raise AssertionError(f"dtype {a.dtype} vs {b.dtype}")
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.contiguous().view(ints) == b.contiguous().view(ints)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and bool(_bitwise_eq(a.reshape(-1), b.reshape(-1)).all()))


# ---- megatron's own view of a rank's state -----------------------------------------------------


def native_state(job: Job) -> dict[str, Any]:
    """Everything the rank holds, read through megatron's own accessors (cloned)."""
    out: dict[str, Any] = {}
    for i, g in enumerate(job.gpts):
        for k, v in g.state_dict(keep_vars=True).items():
            if k.endswith("_extra_state") and isinstance(v, torch.Tensor) and v.numel():
                out.update({f"model{i}.{k}/{f}": x for f, x in _fp8_extra_state(v).items()})
            elif isinstance(v, torch.Tensor):
                out[f"model{i}.{k}"] = v.detach().clone()
    for i, ddp in enumerate(job.ddps):
        for j, buf in enumerate(list(ddp.buffers) + list(ddp.expert_parallel_buffers)):
            if buf.param_data is not None:
                out[f"ddp{i}.buffer{j}.param_data"] = buf.param_data.detach().clone()
    leaves = getattr(job.optimizer, "chained_optimizers", None) or [job.optimizer]
    for j, opt in enumerate(leaves):
        if isinstance(opt, DistributedOptimizer):
            state = opt.get_parameter_state_dp_reshardable()
            for g, per_dtype in ((k, v) for k, v in state.items() if isinstance(k, int)):
                for buckets in per_dtype.values():
                    for b, params in enumerate(buckets):
                        for p, tensors in enumerate(params):
                            for name, t in tensors.items():
                                out[f"opt{j}.gbuf{g}.bucket{b}.{p}.{name}"] = (
                                    t.detach().clone() if isinstance(t, torch.Tensor) else t)
        else:
            sd = opt.state_dict()
            for idx, st in sd["optimizer"]["state"].items():
                for name, t in st.items():
                    out[f"opt{j}.state{idx}.{name}"] = t.detach().clone()
            for gi, group in enumerate(sd["fp32_from_fp16_params"]):
                for pi, t in enumerate(group):
                    out[f"opt{j}.fp32_from_fp16.{gi}.{pi}"] = t.detach().clone()
    return out


def _fp8_extra_state(v: torch.Tensor) -> dict[str, Any]:
    """A TE module's pickled fp8 ``_extra_state``, field by field. Its bytes cannot be
    compared: pickling a tensor records its storage's address (test-only unpickling of what
    this process's own TE stand-in wrote)."""
    import pickle

    state = pickle.loads(v.numpy().tobytes())
    out: dict[str, Any] = {}
    for f, x in state.items():
        if f == "recipe":
            out[f] = (type(x).__qualname__, sorted((k, repr(y)) for k, y in vars(x).items()))
        elif f == "extra_fp8_variables":
            out[f] = list(x.items())
        else:
            out[f] = x
    return out


def native_diffs(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names of the entries of two ``native_state`` dicts that differ (in bits, for tensors)."""
    if set(a) != set(b):
        return [f"keys differ: {sorted(set(a) ^ set(b))[:4]}"]
    return [k for k in a if not (bits_equal(a[k], b[k]) if isinstance(a[k], torch.Tensor)
                                 else a[k] == b[k])]


# ---- megatron's dist-checkpoint (the reference for a layout switch) ---------------------------


def save_dist_checkpoint(job: Job, path: str) -> None:
    """model + fully_reshardable optimizer state with ``dist_checkpointing.save``."""
    from megatron.core import dist_checkpointing

    model_sd = _model_sd(job)
    sd = {"model": model_sd, "optimizer": job.optimizer.sharded_state_dict(
        model_sd, is_loading=False, metadata=_sd_meta(job))}
    with _may_have_children():
        dist_checkpointing.save(sd, path)


def load_dist_checkpoint(job: Job, path: str, missing_extra_state: bool = False) -> list[str]:
    """Load ``save_dist_checkpoint``'s files into a freshly built job, as Megatron-LM does.

    ``missing_extra_state`` (TE jobs): megatron's TE core attention has an ``_extra_state`` in
    its ``state_dict`` but none in its ``sharded_state_dict``, so a strict load fails and
    Megatron-LM falls back to ``strict=False`` (``load_model_state_dict`` in its
    training/checkpointing.py): such keys keep the fresh build's value. Here only
    ``_extra_state`` keys may be missing, and none unexpected. Returns the missing keys.

    Two fixes that megatron-core 0.16.1 needs with torch's own Adam (no Apex / TE), applied
    here only: (1) ``load_parameter_state_from_fully_reshardable`` passes no 'step' tensor, yet
    ``_set_main_param_and_optimizer_states`` copies every state key including torch Adam's
    per-parameter 'step' (KeyError): the step is kept, as ``load_state_dict`` already set it;
    (2) ``load_state_dict`` gives every parameter the same 'step' tensor object, which torch's
    Adam then increments once per parameter per step: each parameter gets its own copy.
    Optimizer states that do not exist yet are created with megatron's own dummy step.
    """
    from megatron.core import dist_checkpointing

    leaves = getattr(job.optimizer, "chained_optimizers", None) or [job.optimizer]
    for opt in leaves:
        if isinstance(opt, DistributedOptimizer) and len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()
    model_sd = _model_sd(job)
    sd = {"model": model_sd, "optimizer": job.optimizer.sharded_state_dict(
        model_sd, is_loading=True, metadata=_sd_meta(job))}
    loaded = dist_checkpointing.load(sd, path)
    missing: list[str] = []
    for i, g in enumerate(job.gpts):
        if not missing_extra_state:
            g.load_state_dict(loaded["model"][f"model{i}"], strict=True)
            continue
        res = g.load_state_dict(loaded["model"][f"model{i}"], strict=False)
        bad = [k for k in res.missing_keys if not k.endswith("._extra_state")]
        if bad or res.unexpected_keys:
            raise RuntimeError(f"model{i}: missing {bad[:4]}, unexpected "
                               f"{res.unexpected_keys[:4]}")
        missing += [f"model{i}.{k}" for k in res.missing_keys]
    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def keep_step(self, model_param, tensors):
        main = self.optimizer.param_groups[
            self.model_param_group_index_map[model_param][0]]["params"][
            self.model_param_group_index_map[model_param][1]]
        state = self.optimizer.state[main]
        step = state.pop("step", None)
        try:
            original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = keep_step
    try:
        job.optimizer.load_state_dict(loaded["optimizer"])
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original
    for opt in leaves:
        for st in opt.optimizer.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()
    return missing
