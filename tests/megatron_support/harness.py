"""Ground-truth layout oracle: build REAL megatron-core models (the installed one: 0.16.1 or
0.19.2) on CPU and report what megatron itself computed (checkpoint metadata, DDP
buffers/buckets, DistributedOptimizer shards).

``megatron_facts(cfg, world_size)`` forks ``world_size`` workers (megatron is imported once, here,
in the parent), each joins a gloo process group over loopback, runs
``initialize_model_parallel``, builds every (virtual) pipeline chunk the way Megatron-LM training
does (GPTModel with the local spec -> Float16Module -> DistributedDataParallel, then
``get_megatron_optimizer``), and writes one JSON-able facts dict. Nothing here re-derives a
layout rule; every number is read off megatron's own objects. See ``megatron_facts`` for the
config keys and the facts format.

Choices that differ from a literal GPU run (none of them changes the layout):

* ``dynatrain.runtime.megatron.cpu.cpu_shim`` maps CUDA device/stream calls to cpu.
* ``cp > 1``: megatron's local ``DotProductAttention`` refuses context parallelism (only the
  Transformer Engine attention supports it), so the core-attention submodule is replaced by a
  parameter-less stand-in. Core attention holds no parameters in either implementation.
* Process groups are created with ``create_gloo_process_groups=False`` and the optimizer with
  ``use_gloo_process_groups=False`` (the default backend already is gloo; this only skips the
  duplicate CPU-side groups).
* ``bucket_size=None`` -> ``overlap_grad_reduce=False``: DDP then sets bucket_size=None, i.e. one
  bucket per buffer, except that with the distributed optimizer a ``shared_embedding`` param
  (tied embedding/output copy with pp > 1) always gets a bucket of its own. ``bucket_size=int``
  -> ``overlap_grad_reduce=True`` with that bucket size, as in training; as in Megatron-LM's
  ``get_model``, chunks after the first get ``disable_bucketing=True`` (and DDP itself ignores
  bucket_size on pp ranks > 0). Constructing DDP with overlap on needs no CUDA stream; nothing
  is run forward/backward.

Megatron-LM training conventions that are reproduced: vocab padded to a multiple of
``make_vocab_size_divisible_by * tp``; each chunk wrapped in ``Float16Module`` (casts the torch
LayerNorm params, created fp32, to bf16, so all params share one bf16 buffer) before DDP;
``grad_reduce_in_fp32=True`` (what bf16 training turns on); ``seed + 100 * pp_rank``; MoE models
use ``get_gpt_decoder_block_spec(use_transformer_engine=False)`` (per-layer local specs, so
``moe_layer_freq`` works; it calls ``get_gpt_layer_local_spec(num_experts, moe_grouped_gemm=False,
qk_layernorm)`` -> SequentialMLP), dense models ``get_gpt_layer_local_spec``. Defaults that are
this harness's own: ``position_embedding_type="rope"`` (no position-embedding parameter; pass
``"learned_absolute"`` for Megatron-LM's default) and ``moe_router_score_function="sigmoid"`` when
``moe_router_enable_expert_bias`` (megatron requires it).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
import torch.nn.functional as F

# Import megatron once, in the parent, so forked workers start warm.
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from dynatrain.runtime.megatron.cpu import cpu_shim

__all__ = ["megatron_facts", "mcore_rejects", "MegatronBuildError", "padded_vocab_size", "CFG_KEYS"]

DEFAULT_TIMEOUT_S = 120.0

# cfg key -> default (None = "not set"). The first five are required.
REQUIRED_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")
CFG_KEYS: dict[str, Any] = {
    "num_query_groups": None,
    "kv_channels": None,
    "make_vocab_size_divisible_by": 128,
    "swiglu": False,
    "untie_embeddings_and_output_weights": False,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    # Multi-latent attention (MLATransformerConfig; rope_type "rope": no parameters either way).
    "multi_latent_attention": False,
    "q_lora_rank": None,  # None: one linear_q_proj instead of the q down/up projections
    "kv_lora_rank": 32,
    "qk_head_dim": 16,
    "qk_pos_emb_head_dim": 8,
    "v_head_dim": 16,
    "softmax_type": "vanilla",  # "learnable": a per-head softmax_offset (attention sinks)
    "mtp_num_layers": None,  # multi-token prediction, its block spec built as Megatron-LM does
    "normalization": "LayerNorm",  # megatron's default; "RMSNorm" also works
    "position_embedding_type": "rope",  # "learned_absolute" adds embedding.position_embeddings
    "seq_length": 64,  # max_sequence_length (size of learned position embeddings)
    "num_moe_experts": None,
    "moe_ffn_hidden_size": None,
    "moe_router_topk": 2,
    "moe_shared_expert_intermediate_size": None,
    "moe_layer_freq": 1,
    "moe_router_enable_expert_bias": False,
    "moe_router_score_function": None,  # None: "sigmoid" if expert bias is enabled else "softmax"
    "tp": 1,
    "pp": 1,
    "vpp": None,
    "cp": 1,
    "ep": 1,
    "etp": None,
    "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
    "use_distributed_optimizer": True,
    "num_distributed_optimizer_instances": 1,
    "bucket_size": None,
    "grad_reduce_in_fp32": True,  # Megatron-LM turns this on for bf16 (fp32 main grads)
    "order": "tp-cp-ep-dp-pp",
    "seed": 1234,
    "sharded_state_dict_metadata": None,  # e.g. {"singleton_local_shards": True}
    "transformer_config_overrides": None,  # extra TransformerConfig kwargs, passed verbatim
    "ddp_config_overrides": None,  # extra DistributedDataParallelConfig kwargs (e.g. pad_buckets_for_high_nccl_busbw)
    "optimizer_config_overrides": None,  # extra OptimizerConfig kwargs (live jobs: precision-aware)
    "probes": None,  # optional extra measurements, see probes.py; adds facts["probes"]
    # Transformer Engine layer specs (tests/megatron_support/te.py runs them over the CPU
    # stand-in in tests/te_standin; "local" builds never import TE).
    "transformer_impl": "local",  # or "transformer_engine"
    "moe_grouped_gemm": False,  # TE: TEGroupedMLP experts instead of SequentialMLP
    "sequence_parallel": False,  # forced off at tp == 1, as Megatron-LM's arguments do
}


class MegatronBuildError(RuntimeError):
    """A worker failed while megatron built/wrapped the model. ``message`` is the exception text
    (``Type: message``) of the failing rank ``rank``; ``worker_traceback`` its full traceback."""

    def __init__(self, rank: int | None, message: str, worker_traceback: str):
        self.rank = rank
        self.message = message
        self.worker_traceback = worker_traceback
        super().__init__(f"megatron build failed on rank {rank}: {message}\n"
                         f"--- worker traceback ---\n{worker_traceback}")


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron-LM training's vocab padding: round up to a multiple of divisible_by * tp."""
    multiple = make_vocab_size_divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def _resolve_cfg(cfg: dict) -> dict:
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"cfg is missing required keys {missing}")
    unknown = sorted(set(cfg) - set(REQUIRED_KEYS) - set(CFG_KEYS))
    if unknown:
        raise ValueError(f"unknown cfg keys {unknown}; known: {sorted(CFG_KEYS)}")
    c = dict(CFG_KEYS)
    c.update({k: v for k, v in cfg.items() if v is not None or k in REQUIRED_KEYS})
    if c["etp"] is None:
        c["etp"] = c["tp"]
    if c["moe_router_score_function"] is None:
        c["moe_router_score_function"] = "sigmoid" if c["moe_router_enable_expert_bias"] else "softmax"
    c["padded_vocab_size"] = padded_vocab_size(c["vocab_size"], c["make_vocab_size_divisible_by"], c["tp"])
    return c


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def megatron_facts(cfg: dict, world_size: int, timeout: float = DEFAULT_TIMEOUT_S) -> list[dict]:
    """Build the model in `world_size` forked gloo processes; return one facts dict per global
    rank (index = rank).

    Raises ``MegatronBuildError`` (with megatron's message and the worker traceback) when megatron
    rejects the configuration, ``TimeoutError`` when the workers do not finish in ``timeout``
    seconds (they are killed), ``ValueError`` for unknown/missing cfg keys.

    Facts dict per rank (all JSON-able)::

      rank, padded_vocab_size,
      coords: {tp, cp, dp, pp, ep, etp, edp, dp_cp, expert_dp, intra_dp_cp, intra_edp}
          (edp == expert_dp; intra_* = rank in the partial (per-optimizer-instance) groups that
          the DistributedOptimizer shards over; equal to dp_cp/edp with one instance)
      groups: {tp, pp, dp, dp_cp, ep, etp, edp, intra_dp_cp, intra_edp, embedding}
          (sorted global ranks; embedding is [] on ranks outside the embedding group)
      chunks: [{chunk, pre_process, post_process, layer_numbers}]  (1-based global layer numbers)
      params: one per ShardedTensor in each chunk's sharded_state_dict() (factories built):
          {chunk, key, global_shape, global_offset, local_shape, axis_fragmentations, replica_id,
           prepend_axis_num, flattened_range, allow_shape_mismatch, dtype,
           param_name | None, buffer_name | None, param_local_row_offset,
           factory_key | None, factory_piece | None}
      named_parameters: {chunk, name, shape, dtype, is_expert, shared_embedding, shared,
           tensor_model_parallel, partition_dim, partition_stride}
      buffers: per chunk, ddp.buffers then ddp.expert_parallel_buffers:
          {chunk, is_expert, param_dtype, grad_dtype, numel, numel_unpadded,
           data_parallel_world_size, buckets, bucket_numel_unpadded, param_index_map,
           param_bucket, bucket_params}
      optimizer: None without the distributed optimizer, else one entry per (DistributedOptimizer,
          gbuf, bucket, param in this rank's shard):
          {chunk, is_expert, buffer (index into buffers), bucket, param_name, gbuf_world,
           gbuf_world_in_bucket, gbuf_local, param, main_param_numel}
      probes: only when cfg["probes"] is set: one result per requested probe (see probes.py)
    """
    c = _resolve_cfg(cfg)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if (dist.is_available() and dist.is_initialized()) or ps.model_parallel_is_initialized():
        # Forked workers would inherit that state and could not create their own groups.
        raise RuntimeError("megatron_facts must be called from a process without an initialized "
                           "torch.distributed default group / megatron parallel_state")
    with tempfile.TemporaryDirectory(prefix="mcore_facts_") as tmpdir:
        ctx = tmp.start_processes(
            _worker, args=(world_size, c, tmpdir), nprocs=world_size, join=False, daemon=True,
            start_method="fork",
        )
        deadline = time.monotonic() + timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"megatron_facts: workers did not finish within {timeout:.0f} s "
                        f"(world_size={world_size}); killed them. cfg={cfg}"
                    )
                try:
                    if ctx.join(timeout=min(remaining, 0.5)):
                        break
                except (tmp.ProcessRaisedException, tmp.ProcessExitedException) as exc:
                    raise _collect_error(tmpdir, world_size, exc) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(timeout=5)
        facts = []
        for r in range(world_size):
            with open(os.path.join(tmpdir, f"rank{r}.json")) as f:
                facts.append(json.load(f))
        return facts


def mcore_rejects(cfg: dict, world_size: int, timeout: float = DEFAULT_TIMEOUT_S) -> str | None:
    """megatron's error message (``Type: message``) if building this config fails, else None."""
    try:
        megatron_facts(cfg, world_size, timeout=timeout)
    except MegatronBuildError as e:
        return e.message
    return None


def _collect_error(tmpdir: str, world_size: int, exc: Exception) -> MegatronBuildError:
    """Prefer the error our worker wrapper recorded on the rank torch saw fail first (others may
    only have failed as a consequence), then on the lowest rank that recorded one."""
    first = getattr(exc, "error_index", None)
    for r in ([first] if first is not None else []) + list(range(world_size)):
        path = os.path.join(tmpdir, f"rank{r}.error.json")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    e = json.load(f)
                return MegatronBuildError(r, e["message"], e["traceback"])
            except (OSError, ValueError):
                pass
    rank = getattr(exc, "error_index", None)
    return MegatronBuildError(rank, f"{type(exc).__name__}: {exc}", str(exc))


# --------------------------------------------------------------------------------------------
# Worker
# --------------------------------------------------------------------------------------------


def _worker(rank: int, world_size: int, c: dict, tmpdir: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=DEFAULT_TIMEOUT_S),
        )
        with cpu_shim(force=True):
            facts = _build_and_extract(rank, c)
        dist.barrier()
        _write_json(os.path.join(tmpdir, f"rank{rank}.json"), facts)
    except BaseException as e:  # noqa: BLE001 - report everything, then re-raise
        _write_json(
            os.path.join(tmpdir, f"rank{rank}.error.json"),
            {"message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()},
        )
        raise


def _write_json(path: str, obj: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


class _ParamlessCoreAttention(MegatronModule):
    """Stand-in for core attention when cp > 1 (megatron's local DotProductAttention asserts
    cp == 1; only TE's supports CP). Core attention owns no parameters in either version, so the
    layout is unchanged. Build-only: forward is not supported."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **_unused):
        super().__init__(config=config)

    def forward(self, *args, **kwargs):  # pragma: no cover
        raise NotImplementedError("layout-only stand-in for context-parallel core attention")


class _ParamlessTECoreAttention(_ParamlessCoreAttention):
    """The stand-in in place of TE's core attention: like TE's (vanilla softmax) it has an
    ``_extra_state``, the empty uint8 tensor fp8-off TE saves (TE module/base.py:1385-1389),
    which megatron's ``TEDotProductAttention.sharded_state_dict`` leaves out (M16
    extensions/transformer_engine.py:1436-1455) but a default state-dict walk keeps."""

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        pass

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return {}


def _replace_core_attention(spec, te: bool = False) -> None:
    layer_specs = spec.layer_specs if isinstance(spec, TransformerBlockSubmodules) else [spec]
    for ls in layer_specs:
        assert isinstance(ls, ModuleSpec)
        ls.submodules.self_attention.submodules.core_attention = (
            _ParamlessTECoreAttention if te else _ParamlessCoreAttention)


def _transformer_config(c: dict) -> TransformerConfig:
    kw = dict(
        num_layers=c["num_layers"],
        hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"],
        ffn_hidden_size=c["ffn_hidden_size"],
        num_query_groups=c["num_query_groups"],
        kv_channels=c["kv_channels"],
        tensor_model_parallel_size=c["tp"],
        pipeline_model_parallel_size=c["pp"],
        virtual_pipeline_model_parallel_size=c["vpp"],
        context_parallel_size=c["cp"],
        expert_model_parallel_size=c["ep"],
        expert_tensor_parallel_size=c["etp"],
        sequence_parallel=bool(c["sequence_parallel"]) and c["tp"] > 1,
        num_layers_in_first_pipeline_stage=c["decoder_first_pipeline_num_layers"],
        num_layers_in_last_pipeline_stage=c["decoder_last_pipeline_num_layers"],
        account_for_embedding_in_pipeline_split=c["account_for_embedding_in_pipeline_split"],
        account_for_loss_in_pipeline_split=c["account_for_loss_in_pipeline_split"],
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gated_linear_unit=bool(c["swiglu"]),
        activation_func=F.silu if c["swiglu"] else F.gelu,
        add_bias_linear=bool(c["add_bias_linear"]),
        add_qkv_bias=bool(c["add_qkv_bias"]),
        qk_layernorm=bool(c["qk_layernorm"]),
        normalization=c["normalization"],
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    if c["num_moe_experts"] is not None:
        kw.update(
            num_moe_experts=c["num_moe_experts"],
            moe_ffn_hidden_size=c["moe_ffn_hidden_size"] or c["ffn_hidden_size"],
            moe_router_topk=c["moe_router_topk"],
            moe_shared_expert_intermediate_size=c["moe_shared_expert_intermediate_size"],
            moe_layer_freq=c["moe_layer_freq"],
            moe_router_enable_expert_bias=bool(c["moe_router_enable_expert_bias"]),
            moe_router_score_function=c["moe_router_score_function"],
            # megatron refuses a plain softmax over one chosen expert (zero gradient); the
            # order of softmax and top-k holds no state.
            moe_router_pre_softmax=(c["moe_router_topk"] == 1
                                    and c["moe_router_score_function"] == "softmax"),
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=bool(c["moe_grouped_gemm"]),
        )
    if c["softmax_type"] != "vanilla":
        kw["softmax_type"] = c["softmax_type"]
    if c["mtp_num_layers"]:
        kw["mtp_num_layers"] = c["mtp_num_layers"]
    kw.update(c["transformer_config_overrides"] or {})
    if not c["multi_latent_attention"]:
        return TransformerConfig(**kw)
    return MLATransformerConfig(
        **kw, q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
        qk_head_dim=c["qk_head_dim"], qk_pos_emb_head_dim=c["qk_pos_emb_head_dim"],
        v_head_dim=c["v_head_dim"], rope_type="rope")


def _te_spec(c: dict, config: TransformerConfig, vp_stage):
    """Megatron-LM's TE specs (MT19 models/gpt.py:53-98): the decoder block spec for MoE
    models, ``get_gpt_layer_with_transformer_engine_spec`` for dense ones. Imported here, so
    only a process that has Transformer Engine (or its stand-in) importable asks for it."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    if c["num_moe_experts"] is not None:
        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization=c["normalization"],
            vp_stage=vp_stage,
        )
    return get_gpt_layer_with_transformer_engine_spec(
        num_experts=None, moe_grouped_gemm=False, qk_layernorm=bool(c["qk_layernorm"]),
        multi_latent_attention=bool(c["multi_latent_attention"]),
    )


def sharded_metadata(c: dict) -> dict | None:
    """The ``metadata`` for ``sharded_state_dict``: the config's; ``{}`` instead of None with
    MTP, where 0.16's GPTModel reads ``metadata["dp_cp_group"]`` without a default (M16
    models/gpt/gpt_model.py:842)."""
    md = c["sharded_state_dict_metadata"]
    return {} if md is None and c["mtp_num_layers"] else md


def _mtp_block_spec(c: dict, config: TransformerConfig, spec, vp_stage):
    """The MTP block spec as Megatron-LM builds it (MT19 training/models/gpt.py:387-412): its
    inner layer takes the spec of the model's last decoder layer, or, when this stage's MoE
    block is empty, a whole-model layer spec (MT19 gpt.py:94-130). None off the MTP stage."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_layer_specs,
        get_gpt_mtp_block_spec,
    )

    te = c["transformer_impl"] == "transformer_engine"
    if isinstance(spec, TransformerBlockSubmodules) and not spec.layer_specs:
        if te:
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )
            layer = get_gpt_layer_with_transformer_engine_spec(
                c["num_moe_experts"], bool(c["moe_grouped_gemm"]), bool(c["qk_layernorm"]),
                bool(c["multi_latent_attention"]))
        else:
            layer = get_gpt_layer_local_spec(
                c["num_moe_experts"], bool(c["moe_grouped_gemm"]), bool(c["qk_layernorm"]),
                bool(c["multi_latent_attention"]), normalization=c["normalization"])
    else:
        layer = get_gpt_decoder_layer_specs(config, use_transformer_engine=te,
                                            normalization=c["normalization"],
                                            vp_stage=vp_stage)[-1]
    return get_gpt_mtp_block_spec(config, layer, use_transformer_engine=te, vp_stage=vp_stage)


def _build(c: dict):
    """Build (gpt_chunks, ddp_chunks, optimizer) like Megatron-LM training does."""
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
    )
    seed = c["seed"] + 100 * ps.get_pipeline_model_parallel_rank()  # training's _set_random_seed
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)

    config = _transformer_config(c)
    gpts = []
    for i in range(c["vpp"] or 1):
        vp_stage = i if c["vpp"] is not None else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        if c["transformer_impl"] == "transformer_engine":
            spec = _te_spec(c, config, vp_stage)
        elif c["num_moe_experts"] is not None:
            spec = get_gpt_decoder_block_spec(
                config, use_transformer_engine=False, normalization=c["normalization"],
                vp_stage=vp_stage,
            )
        else:
            spec = get_gpt_layer_local_spec(
                num_experts=None, moe_grouped_gemm=False, qk_layernorm=bool(c["qk_layernorm"]),
                multi_latent_attention=bool(c["multi_latent_attention"]),
                normalization=c["normalization"],
            )
        te = c["transformer_impl"] == "transformer_engine"
        if c["cp"] > 1:
            _replace_core_attention(spec, te)
        mtp = _mtp_block_spec(c, config, spec, vp_stage) if c["mtp_num_layers"] else None
        if mtp is not None and c["cp"] > 1:
            for layer_spec in mtp.layer_specs:  # 0.19 renamed the MTP layer's inner layer
                sub = layer_spec.submodules
                _replace_core_attention(getattr(sub, "mtp_model_layer", None)
                                        or sub.transformer_layer, te)
        gpts.append(
            GPTModel(
                config=config,
                transformer_layer_spec=spec,
                mtp_block_spec=mtp,
                vocab_size=c["padded_vocab_size"],
                max_sequence_length=c["seq_length"],
                pre_process=pre,
                post_process=post,
                share_embeddings_and_output_weights=not c["untie_embeddings_and_output_weights"],
                position_embedding_type=c["position_embedding_type"],
                vp_stage=vp_stage,
            )
        )

    overlap = c["bucket_size"] is not None
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=bool(c["grad_reduce_in_fp32"]),
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=bool(c["use_distributed_optimizer"]),
        num_distributed_optimizer_instances=c["num_distributed_optimizer_instances"],
        bucket_size=c["bucket_size"],
        **(c["ddp_config_overrides"] or {}),
    )
    ddps = [
        DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=Float16Module(config, gpt),
            disable_bucketing=(i > 0),
        )
        for i, gpt in enumerate(gpts)
    ]
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16,
        use_distributed_optimizer=bool(c["use_distributed_optimizer"]),
    )
    optimizer = get_megatron_optimizer(opt_config, ddps, use_gloo_process_groups=False)
    return gpts, ddps, optimizer


def _ranks(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group)) if group is not None else []


def _list(x) -> list:
    return [int(v) for v in x]


def _build_and_extract(rank: int, c: dict) -> dict:
    gpts, ddps, optimizer = _build(c)

    coords = {
        "tp": ps.get_tensor_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_rank(),
        "edp": ps.get_expert_data_parallel_rank(),
        "dp_cp": ps.get_data_parallel_rank(with_context_parallel=True),
        "expert_dp": ps.get_expert_data_parallel_rank(),
        "intra_dp_cp": ps.get_data_parallel_rank(with_context_parallel=True, partial_data_parallel=True),
        "intra_edp": ps.get_expert_data_parallel_rank(partial_expert_data_parallel=True),
    }
    groups = {
        "tp": _ranks(ps.get_tensor_model_parallel_group()),
        "pp": _ranks(ps.get_pipeline_model_parallel_group()),
        "dp": _ranks(ps.get_data_parallel_group()),
        "dp_cp": _ranks(ps.get_data_parallel_group(with_context_parallel=True)),
        "ep": _ranks(ps.get_expert_model_parallel_group()),
        "etp": _ranks(ps.get_expert_tensor_parallel_group()),
        "edp": _ranks(ps.get_expert_data_parallel_group()),
        "intra_dp_cp": _ranks(ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)),
        "intra_edp": _ranks(ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)),
        "embedding": _ranks(ps.get_embedding_group(check_initialized=False))
        if ps.is_rank_in_embedding_group() else [],
    }

    chunks, params, named_parameters = [], [], []
    name_of: list[dict[int, str]] = []
    for ci, gpt in enumerate(gpts):
        chunks.append({
            "chunk": ci,
            "pre_process": bool(gpt.pre_process),
            "post_process": bool(gpt.post_process),
            "layer_numbers": [int(layer.layer_number) for layer in gpt.decoder.layers],
        })
        sd = gpt.sharded_state_dict(metadata=sharded_metadata(c))
        # Collect params/buffers after sharded_state_dict (it may re-materialise fp32 buffers).
        named_p = list(gpt.named_parameters())
        named_b = [(n, b) for n, b in gpt.named_buffers() if b is not None]
        name_of.append({id(p): n for n, p in named_p})
        for name, p in named_p:
            named_parameters.append({
                "chunk": ci,
                "name": name,
                "shape": _list(p.shape),
                "dtype": str(p.dtype),
                "is_expert": not getattr(p, "allreduce", True),
                "shared_embedding": bool(getattr(p, "shared_embedding", False)),
                "shared": bool(getattr(p, "shared", False)),
                "tensor_model_parallel": bool(getattr(p, "tensor_model_parallel", False)),
                "partition_dim": int(getattr(p, "partition_dim", -1)),
                "partition_stride": int(getattr(p, "partition_stride", 1)),
            })
        for entry in _sharded_tensors(sd):
            params.append(_describe_sharded(ci, *entry, named_p, named_b))

    buffers, buffer_index = [], {}
    for ci, ddp in enumerate(ddps):
        for is_expert, bufs in ((False, ddp.buffers), (True, ddp.expert_parallel_buffers)):
            for buf in bufs:
                buffer_index[id(buf)] = len(buffers)
                buffers.append(_describe_buffer(ci, is_expert, buf, name_of[ci]))

    opt_facts = None
    if c["use_distributed_optimizer"]:
        opt_facts = []
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            if not isinstance(opt, DistributedOptimizer) or opt.is_stub_optimizer:
                continue
            opt_facts.extend(_describe_dist_opt(opt, buffer_index, buffers, name_of))

    facts = {
        "rank": rank,
        "padded_vocab_size": c["padded_vocab_size"],
        "coords": {k: int(v) for k, v in coords.items()},
        "groups": groups,
        "chunks": chunks,
        "params": params,
        "named_parameters": named_parameters,
        "buffers": buffers,
        "optimizer": opt_facts,
    }
    if c["probes"]:
        from .probes import ProbeContext, run_probes

        facts["probes"] = run_probes(ProbeContext(c, gpts, ddps, optimizer), c["probes"])
    return facts


def _sharded_tensors(sd, factory=None):
    """Yield (ShardedTensor, factory_key, factory_piece) for every ShardedTensor in a (nested)
    sharded state dict; factories are built; ShardedObjects and _extra_state are skipped."""
    if isinstance(sd, dict):
        items = sd.values()
    elif isinstance(sd, (list, tuple)):
        items = sd
    else:
        items = [sd]
    piece = 0
    for v in items:
        if isinstance(v, (dict, list, tuple)):
            yield from _sharded_tensors(v, factory)
        elif isinstance(v, ShardedTensorFactory):
            yield from _sharded_tensors(v.build(), v.key)
        elif isinstance(v, ShardedTensor):
            if not v.key.endswith("_extra_state"):
                yield v, factory, (piece if factory is not None else None)
                piece += 1
        elif isinstance(v, ShardedObject):
            continue


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage data_ptr, first element, one past last element) of t's memory, in elements."""
    start = t.storage_offset()
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
    return t.untyped_storage().data_ptr(), start, start + extent


def _find_owner(data: torch.Tensor, named) -> tuple[str, torch.Tensor] | None:
    ptr, s, e = _span(data)
    for name, t in named:
        if t.dtype != data.dtype:
            continue
        tp, ts, te = _span(t)
        if tp == ptr and ts <= s and e <= te:
            return name, t
    return None


def _describe_sharded(ci, sh: ShardedTensor, factory_key, piece, named_p, named_b) -> dict:
    rid = sh.replica_id
    rid = _list(rid) if isinstance(rid, (tuple, list)) else [int(rid)]
    fr = sh.flattened_range
    entry = {
        "chunk": ci,
        "key": sh.key,
        "global_shape": _list(sh.global_shape),
        "global_offset": _list(sh.global_offset),
        "local_shape": _list(sh.local_shape),
        "axis_fragmentations": _list(sh.axis_fragmentations) if sh.axis_fragmentations else None,
        "replica_id": rid,
        "prepend_axis_num": int(sh.prepend_axis_num),
        "flattened_range": None if fr is None else [int(fr.start), int(fr.stop)],
        "allow_shape_mismatch": bool(sh.allow_shape_mismatch),
        "dtype": str(sh.dtype),
        "param_name": None,
        "buffer_name": None,
        "param_local_row_offset": None,
        "factory_key": factory_key,
        "factory_piece": piece,
    }
    data = sh.data
    if isinstance(data, torch.Tensor):
        owner = _find_owner(data, named_p)
        field = "param_name"
        if owner is None:
            owner, field = _find_owner(data, named_b), "buffer_name"
        if owner is not None:
            name, t = owner
            entry[field] = name
            delta = data.storage_offset() - t.storage_offset()
            row = t.stride(0) if t.dim() > 0 else 1
            if delta % row:
                raise AssertionError(f"{sh.key}: piece starts mid-row of {name} (offset {delta})")
            entry["param_local_row_offset"] = delta // row
    return entry


def _describe_buffer(ci, is_expert, buf, names: dict[int, str]) -> dict:
    return {
        "chunk": ci,
        "is_expert": is_expert,
        "param_dtype": str(buf.param_dtype),
        "grad_dtype": str(buf.grad_dtype),
        "numel": int(buf.numel),
        "numel_unpadded": int(buf.numel_unpadded),
        "data_parallel_world_size": int(buf.data_parallel_world_size),
        "buckets": [_list(b) for b in buf.bucket_indices],
        "bucket_numel_unpadded": [int(b.numel_unpadded) for b in buf.buckets],
        "param_index_map": {names[id(p)]: [int(s), int(e)] for p, (s, e, _) in buf.param_index_map.items()},
        "param_bucket": {names[id(p)]: int(b) for p, (_, _, b) in buf.param_index_map.items()},
        "bucket_params": [[names[id(p)] for p in b.params_list] for b in buf.buckets],
    }


def _describe_dist_opt(opt: DistributedOptimizer, buffer_index, buffers, name_of) -> list[dict]:
    main_numel: dict[int, int | None] = {}
    for models, shards in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                           (opt.model_fp32_groups, opt.shard_fp32_groups)):
        for mg, sg in zip(models, shards):
            for mp, sp in zip(mg, sg):
                main_numel[id(mp)] = None if sp is None else int(sp.numel())
    out = []
    for gbuf_idx, buf in enumerate(opt.buffers):
        chunk = int(opt.gbuf_idx_to_model_idx_map[gbuf_idx])
        bi = buffer_index[id(buf)]
        assert buffers[bi]["chunk"] == chunk
        for bucket_ranges in opt.gbuf_ranges[gbuf_idx].values():
            for b, rng in enumerate(bucket_ranges):
                for p, r in rng["param_map"].items():
                    out.append({
                        "chunk": chunk,
                        "is_expert": buffers[bi]["is_expert"],
                        "buffer": bi,
                        "bucket": b,
                        "param_name": name_of[chunk][id(p)],
                        "gbuf_world": [r["gbuf_world"].start, r["gbuf_world"].end],
                        "gbuf_world_in_bucket": [r["gbuf_world_in_bucket"].start,
                                                 r["gbuf_world_in_bucket"].end],
                        "gbuf_local": [r["gbuf_local"].start, r["gbuf_local"].end],
                        "param": [r["param"].start, r["param"].end],
                        "main_param_numel": main_numel.get(id(p)),
                    })
    return out
