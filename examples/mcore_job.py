"""Example helper: a megatron-core GPT training job for a DynaTrain layout spec, trained with a
fixed global batch, and megatron's dist-checkpoint save/load for the benchmark's comparison.

* ``build_job(spec)`` builds what Megatron-LM's ``setup_model_and_optimizer`` builds for the
  spec's model and parallel config, in the current parallel state: GPTModel chunks (local
  transformer spec; MoE layers with the allgather dispatcher), ``Float16Module`` (bf16), DDP,
  megatron's optimizer (Adam, distributed optimizer as the spec says) and its LR scheduler.
  It is ``LiveSwitcher``'s ``build``.
* ``GlobalBatch`` trains it: every iteration consumes ``global_batch`` samples, DP rank ``d``
  takes samples ``consumed + m * dp + d`` as its micro-batches ``m < global_batch / dp``
  (megatron's pretraining sampler order). A DP change changes the micro-batches per rank, never
  the samples of an iteration nor the averaged gradient (megatron divides each micro-batch loss
  by their number and averages gradients over DP).
* Synthetic data: sample ``s`` is an arithmetic sequence modulo the vocabulary whose start and
  stride are drawn from ``s`` alone, so the loss falls quickly and every layout sees the same
  tokens.

On a machine without CUDA the example runs these jobs on CPU (gloo) under
``dynatrain.runtime.megatron.cpu.cpu_shim``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dynatrain.ir.layout import Layout
from dynatrain.ir.spec import LayoutSpec
from dynatrain.runtime.megatron import MegatronJob
from dynatrain.runtime.megatron.cpu import fork_results_queue

# megatron-core 0.16.1 without Transformer Engine never binds moe_utils.te_general_gemm, yet the
# router reads it; None selects its torch path.
from megatron.core.transformer.moe import moe_utils as _moe_utils  # noqa: E402

if not hasattr(_moe_utils, "te_general_gemm"):
    _moe_utils.te_general_gemm = None

LR = 3e-3
SEED = 1234


# ---- building a job for a spec ---------------------------------------------------------------


def init_kwargs() -> dict:
    """Extra ``initialize_model_parallel`` arguments of every layout."""
    return dict(create_gloo_process_groups=False)


def _config(spec: LayoutSpec):
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, p = spec.model, spec.parallel
    kw = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn,
        num_query_groups=m.num_query_groups, kv_channels=m.kv_channels,
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp, context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.expert_tp,
        sequence_parallel=p.tp > 1 and bool(m.num_moe_experts),  # megatron requires it
        num_layers_in_first_pipeline_stage=p.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=p.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=p.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=p.account_for_loss_in_pipeline_split,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu, add_bias_linear=m.add_bias_linear,
        qk_layernorm=m.qk_layernorm, normalization=m.normalization,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        # Megatron-LM's p2p defaults: with VPP it overlaps p2p instead of batching it (batched,
        # PP2's two directions go to one peer and swap activations with gradients).
        overlap_p2p_comm=p.vpp is not None, batch_p2p_comm=p.vpp is None)
    if m.num_moe_experts:
        kw.update(num_moe_experts=m.num_moe_experts, moe_ffn_hidden_size=m.moe_ffn,
                  moe_router_topk=m.moe_router_topk, moe_layer_freq=m.moe_layer_freq,
                  moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
                  moe_router_score_function=m.moe_router_score_function,
                  moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                  moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)
    return TransformerConfig(**kw)


def build_job(spec: LayoutSpec, seed: int = SEED) -> MegatronJob:
    """A fresh job for ``spec`` in the current parallel state (see the module docstring)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_local_spec)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    m, p = spec.model, spec.parallel
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()  # Megatron-LM's seeding
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available(),
                                    force_reset_rng=True)
    config = _config(spec)
    chunks = []
    for i in range(p.vpp or 1):
        vp = i if p.vpp is not None else None
        if m.num_moe_experts:
            layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                    normalization=m.normalization, vp_stage=vp)
        else:
            layer_spec = get_gpt_layer_local_spec(qk_layernorm=m.qk_layernorm,
                                                  normalization=m.normalization)
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=layer_spec,
            vocab_size=Layout(spec).padded_vocab, max_sequence_length=m.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
            position_embedding_type=m.position_embedding_type, vp_stage=vp))
    if torch.cuda.is_available():
        # Megatron-LM's get_model moves every module to the GPU ("GPU allocation",
        # megatron/training/training.py): megatron creates the MoE router's weight on the CPU
        # (transformer/moe/router.py) and only the distributed optimizer's param buffer would
        # move it; megatron's non-distributed optimizer refuses a CPU parameter.
        for c in chunks:
            c.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=p.use_distributed_optimizer,
        num_distributed_optimizer_instances=p.num_distributed_optimizer_instances)
    ddps = [DistributedDataParallel(config=config, ddp_config=ddp_config,
                                    module=Float16Module(config, g), disable_bucketing=i > 0)
            for i, g in enumerate(chunks)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, min_lr=LR / 10, bf16=True,
                        params_dtype=torch.bfloat16, clip_grad=1.0,
                        use_distributed_optimizer=p.use_distributed_optimizer),
        ddps, use_gloo_process_groups=False)
    config.finalize_model_grads_func = finalize_model_grads
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=LR / 10, lr_warmup_steps=4,
        lr_decay_steps=100, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=100, wd_incr_style="constant")
    return MegatronJob(ddps, optimizer, scheduler)


# ---- training with a fixed global batch ------------------------------------------------------


class GlobalBatch:
    """Trains jobs on synthetic data with ``global_batch`` samples of ``seq`` tokens per step."""

    def __init__(self, global_batch: int, seq: int, vocab_size: int) -> None:
        self.global_batch, self.seq, self.vocab = global_batch, seq, vocab_size

    def micro_batches(self) -> int:
        from megatron.core import parallel_state as ps

        dp = ps.get_data_parallel_world_size()
        if self.global_batch % dp:
            raise ValueError(f"the global batch {self.global_batch} is no multiple of DP {dp}")
        return self.global_batch // dp

    def sample(self, s: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(s)
        start = int(torch.randint(0, self.vocab, (1,), generator=g))
        stride = int(torch.randint(1, 4, (1,), generator=g))
        return (start + stride * torch.arange(self.seq + 1)) % self.vocab

    def step(self, job: MegatronJob) -> float | None:
        """One iteration; the global batch's mean loss on the last pipeline stage, else None."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        nmb = self.micro_batches()
        batches = [self.sample(job.consumed_samples + m * dp + d).unsqueeze(0)
                   for m in range(nmb)]
        pos = torch.arange(self.seq).unsqueeze(0).cuda()
        mask = torch.triu(torch.ones(1, 1, self.seq, self.seq, dtype=torch.bool), 1).cuda()

        def forward_step(data_iterator, model):
            seq = next(data_iterator).cuda()
            out = model(seq[:, :-1], pos, mask, labels=seq[:, 1:])

            def loss_func(output):
                loss = output.float().mean()
                return loss, {"loss": loss.detach().clone()}  # megatron scales loss in place

            return out, loss_func

        chunks = job.model_chunks
        data = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
        for c in chunks:
            c.train()
            c.zero_grad_buffer()
        job.optimizer.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=chunks,
            num_microbatches=nmb, seq_length=self.seq, micro_batch_size=1, forward_only=False)
        ok, _, _ = job.optimizer.step()
        if not ok:
            raise RuntimeError("optimizer step failed")
        job.scheduler.step(increment=1)
        job.iteration += 1
        job.consumed_samples += self.global_batch
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return None
        total = torch.tensor([sum(float(x["loss"]) for x in out)], dtype=torch.float64).cuda()
        dist.all_reduce(total, group=ps.get_data_parallel_group())
        return float(total) / self.global_batch


# ---- megatron's dist-checkpoint (the checkpoint-based switch the benchmark compares with) -----

_SD_META = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _sharded(job: MegatronJob, loading: bool) -> dict:
    from megatron.core.utils import unwrap_model

    model_sd = {f"model{i}": m.sharded_state_dict()
                for i, m in enumerate(unwrap_model(list(job.model_chunks)))}
    return {"model": model_sd, "optimizer": job.optimizer.sharded_state_dict(
        model_sd, is_loading=loading, metadata=_SD_META)}


def save_checkpoint(job: MegatronJob, path: str) -> None:
    """Model and optimizer (fully reshardable) with ``dist_checkpointing.save``, as Megatron-LM
    saves them, plus the scheduler state, iteration and samples (rank 0 writes them)."""
    import json

    from megatron.core import dist_checkpointing

    fork_results_queue()  # megatron would spawn a Manager: seconds
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(_sharded(job, loading=False), path)
    if dist.get_rank() == 0:
        with open(os.path.join(path, "train_state.json"), "w") as f:
            json.dump({"scheduler": job.scheduler.state_dict(), "iteration": job.iteration,
                       "consumed_samples": job.consumed_samples}, f)
    dist.barrier()


def load_checkpoint(job: MegatronJob, path: str) -> None:
    """Load ``save_checkpoint``'s files into a freshly built job, as Megatron-LM does
    (``dist_checkpointing.load`` then ``load_state_dict``), with two fixes megatron-core 0.16.1
    needs with torch's own Adam (Megatron-LM on GPUs uses Apex/TE's, keeping the step per
    param group): keep the per-parameter 'step' that ``load_state_dict`` set (the fully
    reshardable loader passes none) and give every parameter its own step tensor."""
    import json

    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.utils import unwrap_model

    leaves = getattr(job.optimizer, "chained_optimizers", None) or [job.optimizer]
    for opt in leaves:
        if isinstance(opt, DistributedOptimizer) and len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()
    loaded = dist_checkpointing.load(_sharded(job, loading=True), path)
    for i, m in enumerate(unwrap_model(list(job.model_chunks))):
        m.load_state_dict(loaded["model"][f"model{i}"], strict=True)
    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def keep_step(self, model_param, tensors):
        group, index = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][index]]
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
    with open(os.path.join(path, "train_state.json")) as f:
        common = json.load(f)
    job.scheduler.load_state_dict(common["scheduler"])
    job.iteration, job.consumed_samples = common["iteration"], common["consumed_samples"]
