"""Layout specs from the job itself: Megatron-LM's ``args`` or megatron-core's config objects.

``read_megatron(args_or_config, world)`` maps a job's own settings onto a ``LayoutSpec``:

* Megatron-LM's parsed ``args`` (an ``argparse.Namespace``, or a mapping such as the JSON of
  ``vars(args)``) in its CLI names (``num_experts``, ``group_query_attention``,
  ``padded_vocab_size``, ...). A name missing from the mapping takes Megatron-LM's default
  (core_v0.16.1 ``megatron/training/arguments.py``; 0.19.2 keeps these defaults), and the values
  ``validate_args`` derives
  (``ffn_hidden_size`` for SwiGLU, the virtual pipeline size, ETP = TP) are derived the same way.
* megatron-core's ``TransformerConfig`` and, optionally, ``DistributedDataParallelConfig`` of a
  running job, read by duck typing (``ir`` imports no megatron). A config has no vocabulary or
  embedding settings (those are GPTModel arguments): pass them in ``extra`` in Megatron-LM's
  names, e.g. ``extra={"padded_vocab_size": model.vocab_size,
  "untie_embeddings_and_output_weights": True, "position_embedding_type": "rope"}``.

Every name falls in one of three lists: ``MAPPED`` (read into the spec or checked against it),
``UNSUPPORTED`` (changes the layout in a way DynaTrain does not model yet: a value other than
the accepted ones is refused with one ``SpecError`` naming the argument) and ``IGNORED`` (no
effect on where parameters and optimizer state live: learning rate, data, logging, kernels).
The lists cover every argument of Megatron-LM's parser of 0.19.2 and core_v0.16.1 (and the
core_v0.15.3 names since renamed or dropped), and every value Megatron-LM's training loop sets
on ``args`` while it runs (``iteration``, ``do_train``, ``model_type``, ...), so the live
``args`` of a running job read without a warning (tests/test_megatron_lm_args.py checks the
installed Megatron-LM's parser and sources; tests/fixtures/megatron_lm holds core_v0.16.1's).
A name in none of them (a newer Megatron, a fork) is not read; ``JobSpec.unknown`` lists it
and ``spec_from_megatron`` warns with one line, so nothing is dropped without a word.

Rules that changed between versions follow the job's megatron-core version (``megatron_core=``,
default the installed one, which the spec then names): NullTokenizer's vocabulary.
``dynatrain.runtime.megatron.lm_args.layout_args`` is the inverse for a layout switch: the
argument values that make a job's ``args`` describe another spec of the same model.

Citations: MT19/MT16 = Megatron-LM's megatron/training of 0.19.2 / core_v0.16.1, M19/M16 =
megatron/core of those versions.
"""

from __future__ import annotations

import ast
import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import versions
from .errors import SpecError
from .loader import spec_from_dict
from .spec import LayoutSpec

# Megatron-LM's defaults (core_v0.16.1) for every name read here.
_DEFAULTS: dict[str, Any] = dict(
    num_layers=None, hidden_size=None, ffn_hidden_size=None, num_attention_heads=None,
    group_query_attention=False, num_query_groups=1, kv_channels=None, swiglu=False,
    untie_embeddings_and_output_weights=False, vocab_size=None, padded_vocab_size=None,
    tokenizer_type=None, make_vocab_size_divisible_by=128, max_position_embeddings=None,
    position_embedding_type="learned_absolute", use_rotary_position_embeddings=False,
    normalization="LayerNorm", add_bias_linear=True, add_qkv_bias=False, qk_layernorm=False,
    num_experts=None, moe_ffn_hidden_size=None, moe_router_topk=2,
    moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False, moe_layer_freq=1,
    moe_router_enable_expert_bias=False, moe_router_score_function="softmax",
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
    num_virtual_stages_per_pipeline_rank=None, context_parallel_size=1,
    expert_model_parallel_size=1, expert_tensor_parallel_size=None,
    decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
    account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
    use_distributed_optimizer=False, num_distributed_optimizer_instances=1,
    overlap_grad_reduce=False, ddp_bucket_size=None, use_tp_pp_dp_mapping=False, bf16=False,
    fp16=False, params_dtype=None, use_precision_aware_optimizer=False, main_params_dtype="fp32",
    store_param_remainders=True,
    exp_avg_dtype="fp32", exp_avg_sq_dtype="fp32", optimizer="adam", world_size=None,
    data_parallel_size=None, transformer_pipeline_model_parallel_size=None,
    pipeline_model_parallel_layout=None, ddp_pad_buckets_for_high_nccl_busbw=False,
    # Megatron-LM builds Transformer Engine layers unless told otherwise (arguments.py).
    transformer_impl="transformer_engine", moe_grouped_gemm=False,
    # Checked (``_refuse_unsupported``), not read into the spec. 0.19: generalized TP's shard
    # counts (None or the TP/ETP size means no GTP; validate_args resolves None to that size).
    tensor_parallel_num_weight_shards=None, expert_tensor_parallel_num_weight_shards=None,
    # 0.19 adds "quantile_balancing", whose router keeps a persistent per-expert bias.
    moe_router_load_balancing_type="aux_loss",
    # Read into parallel.sequence_parallel; validate_args turns it off at TP 1 (MT19
    # arguments.py:1393-1399, MT16 arguments.py:907-912), and so does the import.
    sequence_parallel=False,
    # Multi-latent attention (MT16 arguments.py: --q-lora-rank ... --v-head-dim) and sinks.
    multi_latent_attention=False, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=128,
    qk_pos_emb_head_dim=64, v_head_dim=128, softmax_type="vanilla", mtp_num_layers=None,
    # Checked per version (``_refuse_version_specific``), not read into the spec.
    use_cpu_initialization=None,
    # fp8 training: Megatron-LM's --fp8-format is args.fp8 (MT16 arguments.py); the recipe and
    # history length are read only when it is set.
    fp8=None, fp8_recipe="delayed", fp8_amax_history_len=1,
)
MAPPED = frozenset(_DEFAULTS)

# name -> (accepted values, what the others would need). Defaults are accepted.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    # With moe_grouped_gemm: megatron's legacy GroupedMLP (one fused weight per layer).
    "moe_use_legacy_grouped_gemm": ((False,), "the legacy GroupedMLP experts"),
    "fp8_param_gather": ((False,), "fp8 parameters"),
    # Amaxes reduced over TP only (M16 parallel_state.py:1509-1532): each data-parallel
    # replica then keeps other delayed-scaling state, and a reload takes replica 0's.
    "tp_only_amax_red": ((False,), "fp8 amaxes reduced over tensor parallelism only"),
    "fp8_dot_product_attention": ((False,), "fp8 attention (core attention's own fp8 state)"),
    "fp8_multi_head_attention": ((False,), "fp8 attention (core attention's own fp8 state)"),
    "fp4": ((None,), "fp4 training"),
    "fp4_param": ((False,), "fp4 parameters"),
    "te_precision_config_file": ((None, ""), "a Transformer Engine precision recipe"),
    "quant_recipe": ((None,), "a quantization recipe"),
    "use_kitchen": ((False,), "kitchen quantization"),
    "use_kitchen_attention": ((False,), "kitchen attention"),
    "heterogeneous_layers_config_path": ((None, ""), "heterogeneous layers"),
    "heterogeneous_layers_config_encoded_json": ((None, ""), "heterogeneous layers"),
    "heterogeneous_block_specs": ((False,), "heterogeneous layers"),
    "moe_latent_size": ((None,), "MoE latent projections"),
    "moe_extended_tp": ((False,), "extended expert TP"),
    "experimental_attention_variant": ((None,), "experimental attention variants"),
    "linear_attention_freq": ((None,), "linear attention layers"),
    "attention_output_gate": ((False,), "attention output gates"),
    "qk_l2_norm": ((False,), "L2 query/key norms"),
    "quick_geglu": ((False,), "quick-GeGLU (only SwiGLU gating is modelled)"),
    "is_hybrid_model": ((False,), "hybrid (Mamba) models"),
    "hybrid_override_pattern": ((None, ""), "hybrid (Mamba) models"),
    # 0.19's name for it (MT19 arguments.py:719-727).
    "hybrid_layer_pattern": ((None, ""), "hybrid (Mamba) models"),
    # requires_grad_(False) on every module (MT19 training.py:1778-1784): frozen parameters
    # get no gradient buffer, so the DDP buffers and optimizer ranges differ.
    "freeze_all_layers": ((False,), "frozen layers (no DDP buffers for their parameters)"),
    # Separate buffers per optimizer owner (M19 param_and_grad_buffer.py:919-933); set by
    # validate_args for non-Adam optimizers (MT19 arguments.py:1669-1681), refused anyway.
    "use_layer_wise_distributed_optimizer": ((False,), "the layer-wise distributed optimizer"),
    "hybrid_attention_ratio": ((0, 0.0), "hybrid (Mamba) models"),
    "hybrid_mlp_ratio": ((0, 0.0), "hybrid (Mamba) models"),
    "decoder_num_layers": ((None,), "encoder-decoder models"),
    "spec": ((None,), "a custom layer spec"),
    "use_legacy_models": ((False,), "legacy (non-mcore) models"),
    "use_inference_optimized_layers": ((False,), "inference-optimized layers"),
    "use_megatron_fsdp": ((False,), "Megatron FSDP"),
    "use_custom_fsdp": ((False,), "Megatron FSDP"),
    "use_torch_fsdp2": ((False,), "torch FSDP2"),
    "ddp_num_buckets": ((None,), "a bucket count (its size depends on each rank's "
                        "parameters); give ddp_bucket_size"),
    # HybridDeviceOptimizer (M16 optimizer/cpu_offloading/hybrid_optimizer.py:227-355): per-
    # parameter CPU torch AdamW optimizers (own step tensors) next to a GPU FusedAdam.
    "optimizer_cpu_offload": ((False,), "optimizer state split between per-parameter CPU "
                              "AdamW optimizers and a GPU FusedAdam"),
    # Megatron-LM sets it at run time when it loads a ModelOpt checkpoint (MT16
    # training.py:1168-1177): the model then comes from ModelOpt's provider (quantizers,
    # distillation teachers), not the GPT layout DynaTrain models.
    "modelopt_enabled": ((False,), "ModelOpt models"),
    # Before 0.16 (core_v0.15.3 arguments.py:1298-1303): they turn kitchen quantization on.
    "kitchen_config_file": ((None, ""), "kitchen quantization"),
    "kitchen_recipe_number": ((None,), "kitchen quantization"),
    # Before 0.16 (core_v0.15.3 arguments.py:1507-1510): a Retro model's retriever encoder.
    "retro_add_retriever": ((False,), "Retro models"),
    # ---- megatron-core 0.19 ----
    # Generalized TP: weights sharded over TP x GTP_remat (M19 model_parallel_config.py:58-75,
    # 135-152; tensor_parallel/generalized_tensor_parallelism.py:1-17).
    "gtp_weight_remat_size": ((1,), "generalized tensor parallelism (weights sharded over "
                              "TP x GTP)"),
    "expert_gtp_weight_remat_size": ((1,), "generalized tensor parallelism for experts"),
    # Experts' fc1 rows stored in alternating gate/up blocks: the non-fused path de-interleaves
    # fc1's output (M19 transformer/moe/experts.py:719-726, 809-821), so the rows are not
    # [gate_r; up_r] as DynaTrain (and the checkpoint's SwiGLU split) lays them out.
    "moe_mlp_glu_interleave_size": ((None,), "block-interleaved GLU rows in the experts' fc1"),
    # All experts' weights (biases) as one TE GroupedTensor parameter (M19
    # transformer_config.py:835-845; te-and-versions.md §1).
    "moe_single_grouped_weight": ((False,), "experts' weights as one grouped parameter"),
    "moe_single_grouped_bias": ((False,), "experts' biases as one grouped parameter"),
    "fp4_param_gather": ((False,), "fp4 parameters"),  # NVFP4 params in uint8 buffers
    # One fused q/kv down projection (FusedMLASelfAttention, M19 models/gpt/
    # gpt_layer_specs.py:257-294): other modules and keys than the unfused MLA modelled here.
    "mla_down_proj_fusion": ((False,), "MLA's fused q/kv down projection"),
    # One MTP layer built and applied mtp_num_layers times (M19 multi_token_prediction.py:
    # 1745-1756): one layer's parameters, not mtp_num_layers'.
    "mtp_use_repeated_layer": ((False,), "one MTP layer repeated"),
}

# No effect on where parameters and optimizer state live (checked name by name against
# core_v0.16.1's Megatron-LM arguments, TransformerConfig and DistributedDataParallelConfig).
# Some only matter together with an UNSUPPORTED switch that is refused (fp8_quantizer_factory:
# the custom recipe, refused by the spec's fp8_recipe).
_IGNORED_16 = """
_cpu_offloading_context accumulate_allreduce_grads_in_fp32 activation_func_clamp_value
activation_func_fp8_input_store adam_beta1 adam_beta2 adam_eps add_position_embedding
adlr_autoresume adlr_autoresume_interval align_grad_reduce align_param_gather
allow_ambiguous_pad_tokens app_tag_run_name app_tag_run_version apply_query_key_layer_scaling
apply_residual_connection_post_layernorm apply_rope_fusion apply_wd_to_qk_layernorm async_save
async_tensor_model_parallel_allreduce attention_backend attention_dropout
attention_softmax_in_fp32 auto_detect_ckpt_format autocast_dtype average_in_collective
barrier_with_L1_time batch_invariant_mode batch_p2p_comm batch_p2p_sync batch_size
bert_binary_head bert_embedder_type bert_load bias_activation_fusion bias_dropout_fusion
bias_gelu_fusion bias_swiglu_fusion biencoder_projection_dim
biencoder_shared_query_context_model block_data_path cache_mla_latents calc_ft_timeouts
calculate_per_token_loss check_for_large_grads check_for_nan_in_grad
check_for_nan_in_loss_and_grad check_for_spiky_loss
check_weight_hash_across_dp_replicas_interval checkpoint_activations
ckpt_assume_constant_structure ckpt_convert_format ckpt_convert_save
ckpt_convert_update_legacy_dist_opt_format ckpt_format ckpt_fully_parallel_load
ckpt_fully_parallel_save ckpt_fully_parallel_save_deprecated ckpt_step classes_fraction
clip_grad clone_scatter_output_in_embedding config_logger_dir consumed_train_samples
consumed_valid_samples cp_comm_type cpu_offloading cpu_offloading_activations
cpu_offloading_double_buffering cpu_offloading_num_layers cpu_offloading_weights
create_all_gather_group create_attention_mask_in_dataloader cross_entropy_fusion_impl
cross_entropy_loss_fusion cuda_graph_impl cuda_graph_retain_backward_graph cuda_graph_scope
cuda_graph_use_single_mempool cuda_graph_warmup_steps data_args_path data_cache_path
data_parallel_random_init data_path data_per_class_fraction data_sharding
dataloader_defer_npy_index_mmap dataloader_fast_cache_load dataloader_type
ddp_average_in_collective ddp_reduce_scatter_with_fp32_accumulation deallocate_pipeline_outputs
decode_only_cuda_graphs decoder_seq_length decoupled_lr decoupled_min_lr
decrease_batch_size_if_needed defer_embedding_wgrad_compute delay_wgrad_compute
deprecated_use_mcore_models deterministic_mode dino_bottleneck_size dino_freeze_last_layer
dino_head_hidden_size dino_local_crops_number dino_local_img_size dino_norm_last_layer
dino_teacher_temp dino_warmup_teacher_temp dino_warmup_teacher_temp_epochs
disable_bf16_reduced_precision_matmul disable_chunked_prefill disable_jit_fuser
disable_parameter_transpose_cache disable_straggler_on_startup disable_symmetric_registration
dist_ckpt_format_deprecated dist_ckpt_optim_fully_reshardable dist_ckpt_save_pre_mcore_014
dist_ckpt_strictness distrib_optim_fully_reshardable_mem_efficient distribute_saved_activations
distributed_backend distributed_timeout_minutes distributed_timeout_seconds_after_init
dsa_indexer_head_dim dsa_indexer_loss_coeff dsa_indexer_n_heads dsa_indexer_topk
dsa_indexer_use_sparse_loss dump_param_to_param_group_map embedding_init_method
embedding_init_method_std embedding_path empty_unused_memory_level enable_autocast
enable_cuda_graph enable_experimental enable_ft_package enable_full_sharding_in_hsdp
enable_gloo_process_groups enable_msc enable_one_logger encoder_num_layers encoder_seq_length
end_weight_decay eod_mask_loss ep_overlap_early_attn_memory_release error_injection_rate
error_injection_type eval_interval eval_iters evidence_data_path exit_duration_in_mins
exit_interval exit_on_missing_checkpoint exit_signal exit_signal_handler
exit_signal_handler_for_dataloader external_cuda_graph fake_process_group fim_data fim_eod_token
fim_fragment_rate fim_middle_token fim_no_prefix fim_pad_token fim_prefix_token fim_rate
fim_split_sample fim_spm_rate fim_suffix_token finalize_model_grads_func
fine_grained_activation_offloading finetune first_last_layers_bf16 flash_decode
fp16_lm_cross_entropy fp32_residual_connection fp4_quantizer_factory fp4_recipe
fp8_amax_compute_algo fp8_interval fp8_margin
fp8_quantizer_factory fp8_wgrad fsdp_double_buffer
fsdp_manual_registration ft_num_warmup_iters full_validation fused_single_qkv_rope
global_batch_size glu_linear_offset grad_reduce_in_bf16 grad_reduce_in_fp32 grad_scale_func
grad_sync_func gradient_accumulation_fusion gradient_reduce_div_fusion grpo_clamp_eps_lower
grpo_clamp_eps_upper grpo_entropy_term_weight grpo_filter_groups_with_same_reward
grpo_group_size grpo_iterations grpo_kl_beta grpo_prompts_per_step head_lr_mult
hetereogenous_dist_checkpoint hidden_dropout hierarchical_context_parallel_sizes
high_priority_stream_groups hybrid_context_parallel hysteresis ict_head_size ict_load img_h
img_w indexer_batch_size indexer_log_interval inference_batch_times_seqlen_threshold
inference_coordinator_port inference_dynamic_batching inference_dynamic_batching_block_size
inference_dynamic_batching_buffer_size_gb inference_dynamic_batching_cuda_graph_max_tokens
inference_dynamic_batching_cuda_graph_mixed_prefill_count
inference_dynamic_batching_max_requests inference_dynamic_batching_max_tokens
inference_dynamic_batching_num_cuda_graphs inference_dynamic_batching_paused_buffer_size_gb
inference_dynamic_batching_track_paused_request_events
inference_dynamic_batching_unified_memory_level inference_fuse_tp_communication
inference_logging_step_interval inference_max_batch_size inference_max_seq_length
inference_rng_tracker inference_sampling_seed inference_wandb_logging init_method
init_method_std init_method_xavier_uniform init_model_with_meta_device initial_loss_scale
inprocess_active_world_size inprocess_barrier_timeout inprocess_completion_timeout
inprocess_empty_cuda_cache inprocess_granularity inprocess_hard_timeout
inprocess_heartbeat_interval inprocess_heartbeat_timeout inprocess_last_call_wait
inprocess_max_iterations inprocess_monitor_process_interval inprocess_monitor_thread_interval
inprocess_progress_watchdog_interval inprocess_restart inprocess_soft_timeout
inprocess_termination_grace_time iter_per_epoch iterations_to_skip keep_fp8_transpose_cache
kitchen_attention_backend langrl_env_config langrl_external_server
langrl_inference_server_conversation_template langrl_inference_server_type layernorm_epsilon
layernorm_zero_centered_gamma lazy_mpu_init legacy_tokenizer linear_conv_kernel_dim
linear_key_head_dim linear_num_key_heads linear_num_value_heads linear_value_head_dim load
load_main_params_from_ckpt local_rank log_device_memory_used log_energy log_interval
log_loss_scale_to_tensorboard log_max_attention_logit log_memory_interval
log_memory_to_tensorboard log_num_zeros_in_grad log_params_norm log_progress log_straggler
log_throughput log_timers_to_tensorboard log_validation_ppl_to_tensorboard
log_world_size_to_tensorboard logging_level loss_scale loss_scale_window lr lr_decay_iters
lr_decay_samples lr_decay_style lr_warmup_fraction lr_warmup_init lr_warmup_iters
lr_warmup_samples lr_wsd_decay_iters lr_wsd_decay_samples lr_wsd_decay_style main_grads_dtype
mamba_head_dim mamba_num_groups mamba_num_heads mamba_state_dim manual_gc manual_gc_eval
manual_gc_interval mask_factor mask_prob mask_type masked_softmax_fusion
max_seqlen_per_dp_cp_rank max_tokens_to_oom memory_efficient_layer_norm memory_snapshot_path
merge_file micro_batch_size microbatch_group_size_per_vp_stage mid_level_dataset_surplus
min_loss_scale min_lr min_offloaded_tensor_size mlp_chunks_for_prefill mmap_bin_files mock_data
model_parallel_size moe_apply_probs_on_input moe_aux_loss_coeff moe_deepep_num_sms
moe_enable_deepep moe_enable_routing_replay moe_expert_capacity_factor
moe_flex_dispatcher_backend moe_hybridep_num_sms moe_input_jitter_eps moe_layer_recompute
moe_pad_expert_input_to_capacity moe_pad_experts_for_cuda_graph_inference moe_per_layer_logging
moe_permute_fusion moe_router_bias_update_rate moe_router_dtype moe_router_force_load_balancing
moe_router_fusion moe_router_group_topk moe_router_num_groups
moe_router_padding_for_fp8 moe_router_padding_for_quantization moe_router_pre_softmax
moe_router_topk_limited_devices moe_router_topk_scaling_factor moe_shared_expert_overlap
moe_token_dispatcher_type moe_token_drop_policy moe_token_dropping moe_upcycling_granularity
moe_use_upcycling moe_z_loss_coeff mrope_section mscale
mscale_all_dim mtp_loss_scaling_factor mtp_standalone multiple_validation_sets
muon_extra_scale_factor muon_fp32_matmul_prec muon_momentum muon_num_ns_steps muon_scale_mode
muon_split_qkv muon_tp_mode muon_use_nesterov nccl_all_reduce_for_prefill
nccl_communicator_config_path nccl_ub no_load_optim no_load_rng no_persist_layer_norm
no_rope_freq no_save_optim no_save_rng no_sync_func no_weight_decay_cond_type
non_persistent_ckpt_type non_persistent_global_ckpt_dir non_persistent_local_ckpt_algo
non_persistent_local_ckpt_dir non_persistent_save_interval num_channels num_classes
num_dataset_builder_threads num_layers_at_end_in_bf16 num_layers_at_start_in_bf16
num_microbatches_with_partial_activation_checkpoints num_workers object_storage_cache_path
offload_modules one_logger_async one_logger_project one_logger_run_name onnx_safe openai_gelu
optimizer_offload_fraction outer_dp_sharding_strategy output_bert_embeddings
output_layer_init_method overlap_cpu_optimizer_d2h_h2d overlap_moe_expert_parallel_comm
overlap_p2p_comm overlap_p2p_comm_warmup_flush overlap_param_gather
overlap_param_gather_with_optimizer_step override_opt_param_scheduler param_sync_func patch_dim
per_dataset_sequences_path per_split_data_args_path perform_initialization perform_rl_step
persist_layer_norm phase_transition_iterations pin_cpu_grads pin_cpu_params pipeline_dtype
pipeline_model_parallel_comm_backend preserve_fp32_weights pretrained_checkpoint profile
profile_ranks profile_step_end profile_step_start qk_clip qk_clip_alpha
qk_clip_threshold query_in_block_prob rampup_batch_size rank
recompute_activations recompute_granularity recompute_method recompute_modules
recompute_num_layers record_memory_history reduce_scatter_with_fp32_accumulation refit_method
relative_attention_max_distance relative_attention_num_buckets replication replication_factor
replication_jump rerun_mode reset_attention_mask reset_position_ids
result_rejected_tracker_filename retriever_report_topk_accuracies retriever_score_scaling
reuse_grad_buf_for_mxfp8_param_ag rl_default_temperature rl_default_top_k rl_default_top_p
rl_importance_sampling_truncation_coef rl_inference_expert_model_parallel_size
rl_inference_expert_tensor_model_parallel_size rl_inference_logprobs_is_correction
rl_inference_model_unified_memory_level rl_inference_pipeline_model_parallel_size
rl_inference_tensor_model_parallel_size rl_offload_inference_model_weights_when_idle
rl_offload_kv_cache_during_training rl_offload_optimizer_during_inference
rl_parallel_generation_tasks rl_partial_rollouts rl_prompts_per_eval
rl_remove_kv_cache_during_training rl_reset_cuda_graphs rl_sequence_packing_algo
rl_sequence_packing_max_sequences_per_bin rl_skip_bos_token rl_training_cuda_graphs
rl_use_sequence_packing rl_verify_model_weights_swap rope_scaling_factor rope_type rotary_base
rotary_interleaved rotary_percent rotary_scaling_factor rotary_seq_len_interpolation_factor
run_workload_inspector_server sample_rate save save_dgrads_interval save_interval
save_retain_interval save_wgrads_interval scatter_gather_tensors_in_pipeline seed seq_length
sft sft_tokenizer_prompt_format sgd_momentum sharp_enabled_group
short_seq_prob skip_train skipped_train_samples softmax_scale split squared_relu
start_weight_decay straggler_ctrlr_port straggler_minmax_count strict_fsdp_dtensor_load
suggested_communication_unit_size swin_backbone_type symmetric_ar_type te_rng_tracker
tensorboard_dir tensorboard_log_interval tensorboard_queue_size test_data_path test_mode
tiktoken_num_special_tokens tiktoken_pattern tiktoken_special_tokens timers timing_log_level
timing_log_option titles_data_path tokenizer_hf_include_special_tokens tokenizer_hf_use_fast
tokenizer_metadata tokenizer_model tokenizer_sentencepiece_legacy tokenizer_special_tokens
torch_fsdp2_reshard_after_forward tp_comm_atomic_ag tp_comm_atomic_rs
tp_comm_bootstrap_backend tp_comm_bulk_dgrad tp_comm_bulk_wgrad tp_comm_overlap
tp_comm_overlap_ag tp_comm_overlap_cfg tp_comm_overlap_disable_fc1 tp_comm_overlap_disable_qkv
tp_comm_overlap_rs tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_split_rs
train_data_path train_iters train_samples train_sync_interval trust_remote_code
use_checkpoint_args use_checkpoint_opt_param_scheduler use_dist_ckpt
use_dist_ckpt_deprecated use_flash_attn use_fused_weighted_squared_relu use_legacy_static_engine
use_mamba_mem_eff_path use_mp_args_from_checkpoint_args use_one_sent_docs
use_persistent_ckpt_worker use_pytorch_profiler use_ring_exchange_p2p use_rope_scaling use_sharp
use_te_activation_func use_te_rng_tracker use_tokenizer_model_from_checkpoint_args
use_torch_optimizer_for_cpu_offload valid_data_path variable_seq_lengths
vision_backbone_type vision_pretraining vision_pretraining_type vocab_extra_ids vocab_file
wandb_entity wandb_exp_name wandb_project wandb_save_dir warmup weight_decay
weight_decay_incr_style wgrad_deferral_limit window_attn_skip_freq window_size yaml_cfg
"""
# megatron-core 0.19.2's new TransformerConfig and DistributedDataParallelConfig fields that
# leave the layout alone, by why (M19 = megatron/core 0.19.2, read field by field).
_IGNORED_19 = {
    # Activation memory and recompute: offloading, paged stashing of expert activations,
    # CUDA-graph capture, MLP chunks along the sequence (M19 transformer_config.py:1047,
    # 1204-1290; transformer_layer.py:872-907).
    "activation memory": """
        activation_offload_fraction cpu_offloading_retain_pinned_cpu_buffers cuda_graph_modules
        delay_offload_until_cuda_graph delta_offload_bytes_across_pp_ranks
        fine_grained_offloading_max_inflight_offloads moe_paged_stash moe_paged_stash_page_size
        moe_paged_stash_buffer_size_factor_cuda moe_paged_stash_buffer_size_factor_cpu
        mlp_chunks_for_training""",
    # Kernels over the modules' own parameters: TE op-fuser ops are built from the existing
    # weights and kept outside the module tree (M19 extensions/transformer_engine.py:2722-2800,
    # 3036-3139; transformer/moe/experts.py:402-433; moe/shared_experts.py:457-490: there the
    # GLU interleave is a flag on the op, the stored weights stay [gate; up]); the fused
    # residual RMSNorm keeps TE RMSNorm's parameters (extensions/transformer_engine.py:630-660).
    "kernels": """
        flash_attention_version fused_residual_rmsnorm use_transformer_engine_op_fuser
        use_grouped_gemm_for_dense_mlp use_grouped_gemm_for_shared_expert
        moe_shared_expert_glu_interleave_size high_priority_a2a_comm_stream
        overlap_dispatch_backward_with_experts_wgrad""",
    # Loss and learning-rate scaling: gradient-scale hooks; MuP (init, per-group LR/eps,
    # embedding and logit multipliers: optimizer/__init__.py:131-250,
    # models/common/language_module/language_module.py:230-340); quantile balancing's EMA
    # (that routing is refused: moe_router_load_balancing_type); the benchmark-only forced
    # router bias (a module-level cache, not state: moe/router.py:860-864, moe_utils.py:1250).
    "scaling": """
        moe_grad_scale_func mtp_grad_scale_func experimental_attention_variant_loss_scale_func
        use_mup mup_width_mult mup_base_hidden_size mup_embedding_mult mup_output_mult
        mup_base_head_dim mup_attn_scale_power moe_router_quantile_balancing_ema
        moe_router_force_biased""",
    "token dispatch": """
        moe_permute_fusion_into_hybridep moe_hybridep_pad_uneven_dispatch_inputs
        moe_flex_dispatcher_num_sms moe_hybridep_num_blocks_permute
        moe_hybridep_num_blocks_unpermute moe_hybridep_num_sms_preprocessing
        moe_ncclep_static_shape moe_ncclep_zero_copy moe_expert_rank_capacity_factor""",
    "inference": """
        inference_cuda_graph_scope inference_disable_triton_nvls_kernels
        inference_grouped_gemm_backend inference_moe_disable_fused_quant_kernels
        inference_moe_token_dispatcher_type""",
    # Only with features refused elsewhere: DSA (experimental_attention_variant), Mamba
    # (is_hybrid_model, mtp_hybrid_override_pattern), the mxfp8 LM head (fp8). MTP's detached
    # heads only put its parameters in a grad-norm group of their own (M19 transformer/
    # multi_token_prediction.py:1694-1697).
    "refused features": """
        mtp_detach_heads mtp_hybrid_override_pattern
        dsa_indexer_topk_freq dsa_indexer_skip_topk_offset dsa_kernel_backend
        dsa_indexer_rope_interleaved dsa_indexer_rotate_activation dsa_indexer_scoring_relu
        dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32 mamba_training_ssm_states_dtype
        fp8_output_proj""",
    # DDP: fp32 copies of some main grads beside unchanged buffers
    # (distributed/param_and_grad_buffer.py:1363-1382); Megatron FSDP's options (FSDP refused).
    "ddp": """
        param_name_patterns_for_fp32_local_accumulation fsdp_db_use_persist_buf_on_alloc_fail
        fsdp_all_gather_in_start_param_sync megatron_fsdp_main_params_dtype
        megatron_fsdp_main_grads_dtype megatron_fsdp_grad_comm_dtype
        megatron_fsdp_use_decoupled_grad megatron_fsdp_cuda_graph_mode
        megatron_fsdp_enable_fine_grained_param_gather megatron_fsdp_max_pool_double_buffer""",
}
# Megatron-LM's own names beyond megatron-core's configs: the 0.19.2 parser's new arguments
# (MT19 = megatron/training 0.19.2; each checked against where it is read), the values its
# training loop sets on ``args`` at run time (every ``args.X = ...`` outside the parser in
# MT19 and core_v0.16.1's megatron/training), and names of earlier parsers (core_v0.15.3).
_IGNORED_LM = {
    # Set while the job runs: progress counters, flags of which splits have data, the model
    # type (ModelType has one member, encoder_or_decoder, in 0.16.1 and 0.19.2: M19 enums.py:6-9).
    # MT19 training.py:1709 (model_type), 1421 and 3811 (curr_iteration), 2170-2226
    # (num_floating_point_operations_so_far, iteration), 3934 (consumed_train_bins),
    # 4595-4597 (do_train, do_valid, do_test); checkpointing.py:1855 (iteration);
    # arguments.py:133 (_is_global_batch_size_explicitly_specified), 543
    # (grpo_samples_per_iteration); MT16 training.py:3417 (to_test).
    "run time": """
        do_train do_valid do_test iteration curr_iteration model_type
        num_floating_point_operations_so_far consumed_train_bins grpo_samples_per_iteration
        _is_global_batch_size_explicitly_specified to_test""",
    # Only read under use_megatron_fsdp (refused): MT19 arguments.py:1100-1163 and M19
    # optimizer/__init__.py:1083-1090. Megatron-LM 0.19's default is optim_grads_params
    # (megatron-core's DDP config keeps no_shard, distributed_data_parallel_config.py:100),
    # so every 0.19 job carries it.
    "fsdp only": "data_parallel_sharding_strategy",
    # Megatron-LM's name (MT19 training.py:1995-1996) for the DDP config's
    # param_name_patterns_for_fp32_local_accumulation (above, "ddp").
    "ddp": "ddp_param_name_patterns_for_fp32_local_accumulation",
    # The vocabulary comes from padded_vocab_size (or vocab_size, padded): the tokenizer's own
    # files and ids do not change the rows once it is set. null_tokenizer_eod_id/pad_id are
    # ids inside NullTokenizer's vocab_size (M19 tokenizers/text/libraries/null_tokenizer.py:
    # 16-20, 59-62). pad_vocab_size=False leaves padded_vocab_size unset and the model still
    # pads vocab_size (MT19 argument_utils.py:473-479, models/gpt.py:284-291).
    "tokenizer": """
        chat_template metadata_path special_tokens tokenizer_hf_no_include_special_tokens
        tokenizer_hf_no_use_fast tokenizer_sentencepiece_ignore_extra_whitespaces
        null_tokenizer_eod_id null_tokenizer_pad_id pad_vocab_size""",
    "checkpointing": """
        async_ckpt_cpu_priority async_ckpt_io_priority async_ckpt_use_cpu_shm async_strategy
        ckpt_fully_parallel_load_exchange_algo ckpt_fully_parallel_load_process_group
        ckpt_fully_parallel_save_process_group ckpt_load_validate_sharding_integrity
        dist_ckpt_workers override_ckpt_iteration stream_ckpt_dequant verify_integrity
        disable_msc_deprecated""",
    "data and batches": """
        dataloader_inter_document_masking eval_global_batch_size eval_micro_batch_size
        step_batch_size_schedule start_eval_at_iter validation_set_names""",
    # Distillation logits written or read as data (MT19 arguments.py logits_* group), not
    # parameters; traces and dumps of activations, params and routing.
    "logging and fault tolerance": """
        exit_signal_handler_for_training fault_injector_delay_start_iteration
        fault_injector_fault_delay fault_injector_fault_probabilities fault_injector_fault_types
        fault_injector_mtti_seconds fault_injector_num_ranks fault_injector_offset_seconds
        fault_injector_ranks fault_injector_seed flight_recorder_dump_on_timeout
        flight_recorder_dump_path flight_recorder_extra_dump_on_exec
        flight_recorder_include_only_active flight_recorder_include_stack_trace
        flight_recorder_trace_buffer_size gpu_sniff_test_interval nvtx_ranges record_shapes
        pytorch_profiler_collect_callstack pytorch_profiler_collect_chakra
        pytorch_profiler_collect_shapes moe_routing_trace_capture_hidden_states
        moe_routing_trace_capture_logits moe_routing_trace_dump_weights
        moe_routing_trace_max_training_iters moe_routing_trace_path save_activations_interval
        save_params_interval save_tokens_per_expert_interval logits_load_decode_threads
        logits_load_dir logits_load_ignore_errors logits_load_kd_loss_alpha
        logits_load_msc_prefetch_depth logits_load_prefetch_factor logits_save_dir
        logits_save_dtype logits_save_top_k logits_save_top_p logits_save_top_p_min_k""",
    "inference and RL": """
        enable_chunked_prefill inference_cuda_graph_all_prefills inference_cuda_graph_max_tokens
        inference_disable_ep_consensus inference_dynamic_batching_async_sched_mode
        inference_dynamic_batching_cuda_graph_sizing_distribution
        inference_dynamic_batching_enable_prefix_caching inference_dynamic_batching_logprobs_mode
        inference_dynamic_batching_mamba_memory_ratio
        inference_dynamic_batching_prefix_caching_coordinator_policy
        inference_dynamic_batching_prefix_caching_eviction_policy
        inference_dynamic_batching_prefix_caching_mamba_gb
        inference_dynamic_batching_prefix_caching_routing_alpha
        inference_dynamic_batching_sampling_backend
        inference_dynamic_batching_track_generated_token_events inference_max_requests
        inference_shards inference_text_gen_server_logging
        inference_use_synchronous_zmq_collectives mamba_inference_conv_states_dtype
        mamba_inference_ssm_states_dtype num_speculative_tokens offset_sampling_seed_by_dp_rank
        rl_consumption_granularity rl_generation_lag rl_inference_parsers
        rl_kv_cache_management_mode rl_persist_cuda_graphs rl_profile rl_profile_dir
        rl_submission_granularity""",
    # Only with features refused elsewhere: optimizers other than Adam (``optimizer``), the
    # layer-wise distributed optimizer (use_layer_wise_param_layout, MT19 training.py:
    # 1635-1642). YaRN's frequencies are non-persistent buffers
    # (M19 models/common/embeddings/yarn_rotary_pos_embedding.py:196-201); the spec refuses
    # position_embedding_type yarn by name anyway.
    "refused or parameter-free features": """
        lion_beta1 lion_beta2 muon_coefficient_type muon_nesterov muon_scalar_optimizer
        use_layer_wise_param_layout yarn_beta_fast yarn_beta_slow
        yarn_correction_range_round_to_int yarn_original_max_position_embeddings""",
    # A capturable Adam keeps its per-parameter step as a tensor on the device, which the step
    # transfer keeps (runtime bridge._write_step: full_like the old one); the CUDA graph of
    # the step is Megatron-LM's wrapper around the optimizer (MT19 training.py:3633-3638),
    # like the model's CUDA graphs (cuda_graph_impl) a property of the built job, not of the
    # layout. use_gloo_process_groups adds CPU groups beside the NCCL ones.
    "kernels and process groups": """
        optimizer_cuda_graph use_gloo_process_groups cuda_graph_scope_deprecated""",
    # Earlier names (core_v0.15.3 arguments.py:1631-1635: norm values, not shapes; the Retro
    # retriever's and older GRPO/inference/Mamba options beside the refused features).
    "before 0.16": """
        norm_epsilon apply_layernorm_1p disable_mamba_mem_eff_path grpo_default_temperature
        grpo_default_top_p inference_dynamic_batching_buffer_guaranteed_fraction
        inference_dynamic_batching_buffer_overflow_factor
        inference_dynamic_batching_max_requests_override
        inference_dynamic_batching_max_tokens_override retriever_seq_length
        retro_cyclic_train_iters retro_encoder_attention_dropout retro_encoder_hidden_dropout
        retro_encoder_layers retro_project_dir rl_calculate_intra_group_similarity
        rl_sequence_packing_bin_size""",
}
# (moe_router_load_balancing_type, ignored for 0.16, is checked since 0.19's quantile
# balancing: _DEFAULTS.)
IGNORED = frozenset(_IGNORED_16.split()).union(
    *(names.split() for names in (*_IGNORED_19.values(), *_IGNORED_LM.values())))

# megatron-core config fields named differently from Megatron-LM's arguments.
_CORE_NAMES = {
    "num_moe_experts": "num_experts",
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
    "fp8_param": "fp8_param_gather",
}
_DDP_NAMES = {
    "bucket_size": "ddp_bucket_size",
    "num_buckets": "ddp_num_buckets",  # megatron-core 0.19's DDP config field
    "pad_buckets_for_high_nccl_busbw": "ddp_pad_buckets_for_high_nccl_busbw",
}
_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "fp16": "fp16",
           "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16"}


class UnknownArgumentsWarning(UserWarning):
    """Some of a job's argument names are in none of DynaTrain's lists and were not read."""


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A spec read from a job, with what was not read.

    Attributes:
        spec: the validated layout spec.
        unknown: names in none of ``MAPPED``, ``UNSUPPORTED`` or ``IGNORED`` (not read).
        notes: facts the job did not give and how they were filled in.
    """

    spec: LayoutSpec
    unknown: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def warning(self) -> str | None:
        """One line naming the unknown names, or None when every name is known."""
        if not self.unknown:
            return None
        shown = ", ".join(self.unknown[:20])
        more = f" and {len(self.unknown) - 20} more" if len(self.unknown) > 20 else ""
        return (f"{len(self.unknown)} argument(s) unknown to DynaTrain were not read; check that "
                f"none changes the layout: {shown}{more}")


def spec_from_megatron(args_or_config: Any, world: Any, *, ddp_config: Any = None,
                       extra: Mapping[str, Any] | None = None, name: str | None = None,
                       megatron_core: str | None = None) -> LayoutSpec:
    """The ``LayoutSpec`` of a Megatron job; warns (``UnknownArgumentsWarning``) about names
    it did not read. See ``read_megatron`` for the arguments."""
    job = read_megatron(args_or_config, world, ddp_config=ddp_config, extra=extra, name=name,
                        megatron_core=megatron_core)
    if (line := job.warning()) is not None:
        warnings.warn(line, UnknownArgumentsWarning, stacklevel=2)
    return job.spec


def read_megatron(args_or_config: Any, world: Any, *, ddp_config: Any = None,
                  extra: Mapping[str, Any] | None = None, name: str | None = None,
                  megatron_core: str | None = None) -> JobSpec:
    """Map a job's settings onto a spec.

    Args:
        args_or_config: Megatron-LM's ``args`` (Namespace or mapping of its argument names), or
            a megatron-core ``TransformerConfig`` (any dataclass with its fields).
        world: ``{"nodes": N, "gpus_per_node": G}`` (optionally ``first_node``), ``{"devices":
            [...]}``, or for a running job ``{"world_size": W, "gpus_per_node": G}`` or the
            pair ``(W, G)``.
        ddp_config: megatron-core's ``DistributedDataParallelConfig`` (config path only).
        extra: more settings in Megatron-LM's argument names; they win over the others.
        name: the spec's name; by default one is made from the sizes.
        megatron_core: the job's megatron-core version (default: the installed one, as a spec
            without ``megatron_core`` means); the spec names it, and it decides the rules
            that changed between versions (NullTokenizer's vocabulary).

    Raises:
        SpecError: one line naming the argument: unsupported, inconsistent or invalid.

    Example:
        >>> job = read_megatron({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        ...     "padded_vocab_size": 1024, "position_embedding_type": "rope",
        ...     "transformer_impl": "local", "bf16": True, "tensor_model_parallel_size": 2},
        ...     (4, 4))
        >>> (job.spec.parallel.tp, job.spec.world.nodes, job.spec.state.param)
        (2, 1, 'bf16')
    """
    if isinstance(args_or_config, Mapping):
        raw, labels, source = dict(args_or_config), {}, "args"
        if ddp_config is not None:
            raise SpecError("ddp_config", "goes with a TransformerConfig; Megatron-LM's args "
                            "already hold the DDP settings")
    elif dataclasses.is_dataclass(args_or_config) and not isinstance(args_or_config, type):
        raw, labels = _from_core(args_or_config, ddp_config)
        source = "config"
    elif hasattr(args_or_config, "__dict__") and not isinstance(args_or_config, type):
        raw, labels, source = dict(vars(args_or_config)), {}, "args"
    else:
        raise SpecError("args", "must be Megatron-LM's args (a Namespace or a mapping) or a "
                        "megatron-core TransformerConfig", type(args_or_config).__name__)
    raw.update(extra or {})
    for key in raw:
        if not isinstance(key, str):
            raise SpecError("args", "argument names must be strings", key)
    known = MAPPED | UNSUPPORTED.keys() | IGNORED | labels.keys()
    unknown = tuple(sorted(k for k in raw if k not in known))
    a = {**_DEFAULTS, **{k: v for k, v in raw.items() if k in MAPPED or k in UNSUPPORTED}}

    def label(arg: str) -> str:  # the name the caller used for an argument
        return labels.get(arg, arg)

    try:
        version = versions.normalize(versions.default() if megatron_core is None
                                     else megatron_core)
    except ValueError as err:
        raise SpecError("megatron_core", str(err), _plain(megatron_core)) from None
    _refuse_null_sizes(a, label)
    _refuse_unsupported(a, label)
    _refuse_version_specific(a, label, version)
    doc, origin, notes = _document(a, world, label, training=source == "args",
                                   version=version)
    if name is not None:
        doc["name"] = name
    try:
        spec = spec_from_dict(doc, origin="spec")
    except SpecError as err:
        # The argument behind the field (or behind the list the bad entry is in).
        field = next((f for f in origin if err.field == f or err.field.startswith(f + ".")), None)
        if field is None:
            raise
        raise SpecError(origin[field] + err.field[len(field):], err.rule, err.value) from None
    return JobSpec(spec, unknown, tuple(notes))


def _from_core(config: Any, ddp_config: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """A TransformerConfig (+ DDP config) as Megatron-LM argument names; labels map back."""
    out: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for obj, names in ((config, _CORE_NAMES), (ddp_config, _DDP_NAMES)):
        if obj is None:
            continue
        fields = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) \
            else list(vars(obj))
        for field in fields:
            arg = names.get(field, field)
            out[arg] = getattr(obj, field)
            if arg != field:
                labels[arg] = field
    gated = bool(out.pop("gated_linear_unit", False))
    act = getattr(out.pop("activation_func", None), "__name__", None)
    if gated and act != "silu":
        raise SpecError("gated_linear_unit", "with an activation other than silu is not "
                        "supported by DynaTrain yet (only SwiGLU)", act)
    out["swiglu"] = gated
    labels["swiglu"] = "gated_linear_unit"
    groups = out.get("num_query_groups")
    out["group_query_attention"] = groups is not None
    for arg in ("params_dtype",):
        if arg in out:
            out[arg] = str(out[arg])
    return out, labels


def _refuse_version_specific(a: dict[str, Any], label: Callable[[str], str],
                             version: str) -> None:
    """Layouts a megatron-core version builds that the spec cannot say."""
    ep = a["expert_model_parallel_size"]
    if (versions.series(version).te_cpu_init_dense_expert_bias and a["use_cpu_initialization"]
            and a["transformer_impl"] == "transformer_engine" and a["add_bias_linear"]
            and a["num_experts"] and isinstance(ep, int) and ep > 1
            and not a["moe_grouped_gemm"]):
        raise SpecError(label("use_cpu_initialization"), f"is not supported by DynaTrain on "
                        f"megatron-core {version} with Transformer Engine layers, sequential "
                        "experts, biases and EP > 1 (its TE wrapper re-creates each expert bias "
                        "as a dense parameter, averaged across EP ranks that hold different "
                        "experts; 0.19 fixed it)", True)


def _refuse_null_sizes(a: dict[str, Any], label: Callable[[str], str]) -> None:
    """TP, PP, CP and EP have no None in Megatron-LM (validate_args multiplies and compares
    them: MT19 arguments.py:422-427); only ETP's None has a meaning (ETP = TP, :569-570)."""
    for short in ("tp", "pp", "cp", "ep"):
        arg = _PARALLEL[short]
        if a[arg] is None:
            raise SpecError(label(arg), "must be a positive integer, not null (Megatron-LM's "
                            "default is 1)")


def _refuse_unsupported(a: dict[str, Any], label: Callable[[str], str]) -> None:
    # The user-facing GTP knobs first: a config derives gtp_weight_remat_size from them.
    for shards, size_arg in (("tensor_parallel_num_weight_shards", "tensor_model_parallel_size"),
                             ("expert_tensor_parallel_num_weight_shards",
                              "expert_tensor_parallel_size")):
        size = a[size_arg] if a[size_arg] is not None else a["tensor_model_parallel_size"]
        if a[shards] is not None and a[shards] != size:
            raise SpecError(label(shards), "is not supported by DynaTrain yet (generalized "
                            f"tensor parallelism: weights in more shards than {size_arg}="
                            f"{size})", _plain(a[shards]))
    for arg, (accepted, what) in UNSUPPORTED.items():
        value = a.get(arg, accepted[0])
        if not any(value is ok or (type(value) is type(ok) and value == ok) for ok in accepted):
            raise SpecError(label(arg), f"is not supported by DynaTrain yet ({what})",
                            _plain(value))
    if a["add_qkv_bias"] and not a["add_bias_linear"]:
        raise SpecError(label("add_qkv_bias"), "is not supported by DynaTrain yet (QKV biases "
                        "without add_bias_linear)", True)
    balancing = a["moe_router_load_balancing_type"]
    if "quantile_balancing" in (balancing if isinstance(balancing, (list, tuple))
                                else (balancing,)):
        # M19 transformer/moe/router.py:220-253: a persistent per-expert bias qb_beta.
        raise SpecError(label("moe_router_load_balancing_type"), "is not supported by "
                        "DynaTrain yet (quantile balancing: its router bias qb_beta is state "
                        "DynaTrain does not model)", _plain(balancing))
    if a["use_precision_aware_optimizer"]:
        _refuse_precision_aware(a, label)
    if a["optimizer"] != "adam":
        raise SpecError("optimizer", "is not supported by DynaTrain yet (only adam's state is "
                        "modelled)", a["optimizer"])


def _refuse_precision_aware(a: dict[str, Any], label: Callable[[str], str]) -> None:
    """The precision-aware optimizer's states DynaTrain carries: TE FusedAdam's fp32 masters
    and fp32/bf16 moments, keyed by the bf16 shards (M16 optimizer/distrib_optimizer.py:
    406-449, 883-940). Int16 remainders are half a master (the other half is the bf16 param),
    and fp16/fp8 states are scaled by factors FusedAdam does not save."""
    if a["store_param_remainders"]:
        raise SpecError(label("store_param_remainders"), "is not supported by DynaTrain yet "
                        "with the precision-aware optimizer (TE FusedAdam then keeps each master "
                        "param only as an int16 remainder of the bf16 param; run with "
                        "--no-store-param-remainders)", True)
    for arg, ok in (("main_params_dtype", ("fp32",)), ("exp_avg_dtype", ("fp32", "bf16")),
                    ("exp_avg_sq_dtype", ("fp32", "bf16"))):
        text = str(a[arg]).lower().removeprefix("torch.")
        if _DTYPES.get(text) not in ok:
            raise SpecError(label(arg), "is not supported by DynaTrain yet (TE FusedAdam scales "
                            "fp16/fp8 optimizer states per tensor by factors it does not save; "
                            f"carried: {', '.join(ok)})", _plain(a[arg]))


def _document(a: dict[str, Any], world: Any, label: Callable[[str], str], *, training: bool,
              version: str) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """The spec document, the argument behind each spec field, and notes."""
    notes: list[str] = []
    origin = {f"model.{k}": label(k) for k in _MODEL_SAME}
    origin.update({"model.num_moe_experts": label("num_experts"),
                   "model.swiglu": label("swiglu"), "model.vocab_size": label("vocab_size")})
    origin.update({f"parallel.{short}": label(arg) for short, arg in _PARALLEL.items()})
    origin.update({f"parallel.{k}": label(k) for k in _PARALLEL_SAME})
    origin["parallel.bucket_size"] = label("ddp_bucket_size")
    origin["parallel.pad_buckets_for_high_nccl_busbw"] = label(
        "ddp_pad_buckets_for_high_nccl_busbw")
    origin["parallel.pipeline_model_parallel_layout"] = label("pipeline_model_parallel_layout")
    origin["parallel.order"] = label("use_tp_pp_dp_mapping")
    origin["parallel.sequence_parallel"] = label("sequence_parallel")
    for field in ("transformer_impl", "moe_grouped_gemm", "fp8", "fp8_recipe",
                  "fp8_amax_history_len"):
        origin[f"model.{field}"] = label(field)

    model = {k: a[k] for k in _MODEL_SAME if a[k] is not None}
    # validate_args: 0 experts means a dense model (MT19 arguments.py:1593-1594, MT16 1014-1015).
    model["num_moe_experts"] = None if a["num_experts"] == 0 else a["num_experts"]
    model["swiglu"] = a["swiglu"]
    if a["ffn_hidden_size"] is None and isinstance(a["hidden_size"], int):
        h = a["hidden_size"]  # validate_args' default: SwiGLU keeps ~8h^2 MLP params
        model["ffn_hidden_size"] = int((4 * h * 2 / 3) / 64) * 64 if a["swiglu"] else 4 * h
    model["num_query_groups"] = a["num_query_groups"] if a["group_query_attention"] else None
    if a["use_rotary_position_embeddings"]:
        model["position_embedding_type"] = "rope"
    model["moe_layer_freq"] = _moe_layer_freq(a["moe_layer_freq"], label("moe_layer_freq"))
    model["transformer_impl"] = _plain(a["transformer_impl"])
    model["moe_grouped_gemm"] = a["moe_grouped_gemm"]
    if a["fp8"] is not None:
        model.update(fp8=_plain(a["fp8"]), fp8_recipe=_plain(a["fp8_recipe"]),
                     fp8_amax_history_len=a["fp8_amax_history_len"])
    tp = a["tensor_model_parallel_size"]
    model["vocab_size"] = _vocab(a, tp, label, notes, version)
    if model.get("position_embedding_type") == "learned_absolute" and (
            a["max_position_embeddings"] is None):
        raise SpecError(label("max_position_embeddings"),
                        "is required with position_embedding_type learned_absolute")

    parallel = {short: a[arg] for short, arg in _PARALLEL.items() if a[arg] is not None}
    parallel.update({k: a[k] for k in _PARALLEL_SAME if a[k] is not None})
    if parallel.get("etp") == tp:
        del parallel["etp"]  # validate_args sets ETP = TP; the spec's None means the same
    if a["ddp_bucket_size"] is not None:
        parallel["bucket_size"] = a["ddp_bucket_size"]
    # Megatron-LM turns sequence parallelism off at TP 1 (MT19 arguments.py:1393-1399).
    sp = a["sequence_parallel"]
    parallel["sequence_parallel"] = False if sp is True and tp == 1 else sp
    parallel["order"] = "tp-cp-ep-pp-dp" if a["use_tp_pp_dp_mapping"] else "tp-cp-ep-dp-pp"
    layout = _layout(a["pipeline_model_parallel_layout"], label)
    if layout is not None:
        parallel["pipeline_model_parallel_layout"] = layout
    if a["ddp_pad_buckets_for_high_nccl_busbw"] is not False:
        parallel["pad_buckets_for_high_nccl_busbw"] = a["ddp_pad_buckets_for_high_nccl_busbw"]
    if training and a["kv_channels"] is None and _int(a["num_attention_heads"]) and (
            _int(a["hidden_size"]) and a["hidden_size"] % a["num_attention_heads"]):
        raise SpecError(label("hidden_size"), "must be divisible by num_attention_heads="
                        f"{a['num_attention_heads']} without kv_channels (Megatron-LM's "
                        "validate_args asserts it)", a["hidden_size"])
    vpp = _vpp(a, label)
    if vpp is not None:
        parallel["vpp"] = vpp
        origin["parallel.vpp"] = label(_vpp_source(a))

    world_doc = _world(world)
    size = len(world_doc["devices"]) if "devices" in world_doc else (
        world_doc["nodes"] * world_doc["gpus_per_node"])
    if a["world_size"] is not None and a["world_size"] != size:
        raise SpecError(label("world_size"), f"disagrees with the world's {size} devices",
                        a["world_size"])
    mp = _int(tp) * _int(a["pipeline_model_parallel_size"]) * _int(a["context_parallel_size"])
    if a["data_parallel_size"] is not None and mp and a["data_parallel_size"] * mp != size:
        raise SpecError(label("data_parallel_size"), f"disagrees with {size} devices / "
                        f"(tp*pp*cp={mp})", a["data_parallel_size"])
    tpp = a["transformer_pipeline_model_parallel_size"]
    if tpp is not None and tpp != a["pipeline_model_parallel_size"]:
        raise SpecError(label("transformer_pipeline_model_parallel_size"),
                        "disagrees with pipeline_model_parallel_size", tpp)
    if training and a["overlap_grad_reduce"] and a["ddp_bucket_size"] is None and mp:
        # Megatron-LM's training loop sizes the default bucket by the DP x CP group, where
        # megatron-core's DDP (and a spec without bucket_size) uses DP only.
        dp, cp = size // mp, _int(a["context_parallel_size"])
        if max(40_000_000, 1_000_000 * dp * cp) != max(40_000_000, 1_000_000 * dp):
            parallel["bucket_size"] = 1_000_000 * dp * cp
            notes.append(f"bucket_size: Megatron-LM's default for DP*CP={dp * cp}")

    doc = {"name": _name(a, size, mp), "model": model, "parallel": parallel, "world": world_doc,
           "state": _state(a, label), "megatron_core": version}
    return doc, origin, notes


_MODEL_SAME = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
    "make_vocab_size_divisible_by", "max_position_embeddings", "position_embedding_type",
    "normalization", "untie_embeddings_and_output_weights", "add_bias_linear", "qk_layernorm",
    "moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "moe_router_enable_expert_bias", "moe_router_score_function",
    "num_query_groups", "moe_layer_freq", "multi_latent_attention", "q_lora_rank",
    "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "softmax_type",
    "mtp_num_layers",
)
_PARALLEL = {
    "tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size", "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
}
_PARALLEL_SAME = (
    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
    "use_distributed_optimizer", "num_distributed_optimizer_instances", "overlap_grad_reduce",
)


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def null_tokenizer_adds_eod(version: str) -> bool:
    """Whether Megatron-LM's NullTokenizer of this megatron-core version has ``vocab_size + 1``
    tokens (its EOD appended) or exactly ``vocab_size``.

    Before 0.18 it appended the EOD: core_v0.16.1 megatron/training/tokenizer/tokenizer.py:
    813-835 (``_vocab_size_without_eod + 1``; the tokenizer Megatron-LM 0.16 builds,
    global_vars.py:15) and megatron/core/tokenizers/text/libraries/null_tokenizer.py:50-52 of
    0.16.1 and 0.17.x. From core_v0.18.0 on, ``vocab_size`` is the given one and the EOD is its
    last id (M19 tokenizers/text/libraries/null_tokenizer.py:16-20, 59-62), built by
    tokenizers/utils/build_tokenizer.py:87-107 (MT19 global_vars.py:17 imports that one).
    """
    return versions.series_key(version) < (0, 18)


def _vocab(a: dict[str, Any], tp: Any, label: Callable[[str], str], notes: list[str],
           version: str) -> Any:
    """The tokenizer's vocabulary (what Megatron pads), checked against padded_vocab_size."""
    padded, vocab, m = a["padded_vocab_size"], a["vocab_size"], a["make_vocab_size_divisible_by"]
    if vocab is not None and a["tokenizer_type"] == "NullTokenizer" and _int(vocab) and (
            null_tokenizer_adds_eod(version)):
        vocab += 1
    if padded is None:
        if vocab is None:
            raise SpecError(label("padded_vocab_size"), "is required (or vocab_size): "
                            "Megatron-LM sets it once the tokenizer is built")
        return vocab
    mult = _int(m) * _int(tp)
    if not _int(padded) or not mult:
        return padded  # the spec's own checks name the bad value
    if vocab is None:
        if padded % mult:
            raise SpecError(label("padded_vocab_size"), f"must be a multiple of "
                            f"make_vocab_size_divisible_by*tensor_model_parallel_size={mult}",
                            padded)
        notes.append(f"vocab_size: unknown; the padded {padded} rows are taken as the "
                     "vocabulary, so another TP pads from there")
        return padded
    if _int(vocab) and -(-vocab // mult) * mult != padded:
        raise SpecError(label("padded_vocab_size"), f"disagrees with a vocabulary of {vocab} "
                        f"padded to a multiple of {mult} ({-(-vocab // mult) * mult})", padded)
    return vocab


def _vpp_source(a: dict[str, Any]) -> str:
    for arg in ("virtual_pipeline_model_parallel_size", "num_virtual_stages_per_pipeline_rank",
                "num_layers_per_virtual_pipeline_stage"):
        if a[arg] is not None:
            return arg
    return "virtual_pipeline_model_parallel_size"


def _vpp(a: dict[str, Any], label: Callable[[str], str]) -> Any:
    """validate_args' virtual pipeline size; None for no interleaving."""
    given = a["virtual_pipeline_model_parallel_size"]
    derived = a["num_virtual_stages_per_pipeline_rank"]
    per_stage = a["num_layers_per_virtual_pipeline_stage"]
    if a["pipeline_model_parallel_layout"] not in (None, ""):
        # validate_args: the layout alone sets VPP (the spec derives and checks it).
        for arg in ("num_layers_per_virtual_pipeline_stage",
                    "num_virtual_stages_per_pipeline_rank"):
            if a[arg] is not None:
                raise SpecError(label(arg), "cannot be combined with "
                                "pipeline_model_parallel_layout", a[arg])
        return None if given == 1 else given
    if per_stage is not None:
        arg = label("num_layers_per_virtual_pipeline_stage")
        if derived is not None:
            raise SpecError(arg, "cannot be combined with num_virtual_stages_per_pipeline_rank")
        if a["decoder_first_pipeline_num_layers"] or a["decoder_last_pipeline_num_layers"]:
            raise SpecError(arg, "cannot be combined with uneven first/last stages; give "
                            "num_virtual_stages_per_pipeline_rank", per_stage)
        n, pp = a["num_layers"], a["pipeline_model_parallel_size"]
        if not (_int(per_stage) and _int(n) and _int(pp)):
            raise SpecError(arg, "must be a positive integer", per_stage)
        n += bool(a["account_for_embedding_in_pipeline_split"]) + bool(
            a["account_for_loss_in_pipeline_split"])
        if n % pp or (n // pp) % per_stage:
            raise SpecError(arg, f"must divide the {n / pp:g} layers of each pipeline stage",
                            per_stage)
        derived = (n // pp) // per_stage
    if given is not None and derived is not None and given != derived:
        source = "num_layers_per_virtual_pipeline_stage" if per_stage is not None else (
            "num_virtual_stages_per_pipeline_rank")
        raise SpecError(label("virtual_pipeline_model_parallel_size"),
                        f"disagrees with {source} (which gives {derived})", given)
    vpp = given if given is not None else derived
    return None if vpp == 1 else vpp


_LAYER_CHARS = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}


def _layout(v: Any, label: Callable[[str], str]) -> Any:
    """The layout string: as given, or rebuilt from a TransformerConfig's parsed layout
    (``PipelineParallelLayerLayout.input_data``: the string, or lists of layer names)."""
    v = getattr(v, "input_data", v)
    if v is None or v == "":
        return None
    if isinstance(v, (list, tuple)):
        try:
            return "|".join("".join(_LAYER_CHARS[str(getattr(x, "name", x)).strip().lower()]
                                    for x in row) for row in v)
        except (KeyError, TypeError):
            raise SpecError(label("pipeline_model_parallel_layout"), "lists must hold the layer "
                            "types embedding, decoder, mtp or loss", _plain(v)) from None
    return v


def _moe_layer_freq(v: Any, arg: str) -> Any:
    """An int, a 0/1 list, or Megatron-LM's pattern string such as ``([0]*1+[1]*47)``."""
    if isinstance(v, list):
        return tuple(v)
    if not isinstance(v, str):
        return v
    text = v.strip().strip("'\"")
    try:
        if "[" not in text:
            return int(text)
        out = _pattern(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        out = None
    if not isinstance(out, list) or len(out) > 10_000:
        raise SpecError(arg, "must be an int, a 0/1 list or a pattern like ([0]*1+[1]*47)",
                        v[:60])
    return tuple(out)


def _pattern(node: ast.AST) -> Any:
    """Evaluate ints, lists of ints, + and * only: no names, no calls, bounded size."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_pattern(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern(node.left), _pattern(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult):
            n, seq = (right, left) if isinstance(left, list) else (left, right)
            if isinstance(seq, list) and isinstance(n, int) and 0 <= n * len(seq) <= 10_000:
                return seq * n
    raise ValueError("not a 0/1 pattern")


def _world(world: Any) -> dict[str, Any]:
    if isinstance(world, (tuple, list)) and len(world) == 2:
        world = {"world_size": world[0], "gpus_per_node": world[1]}
    if not isinstance(world, Mapping):
        raise SpecError("world", "must be {nodes, gpus_per_node}, {devices} or (world_size, "
                        "gpus_per_node)", type(world).__name__)
    doc = dict(world)
    if "world_size" in doc:
        w, g = doc.pop("world_size"), doc.get("gpus_per_node")
        if not (_int(w) and _int(g)) or w % g:
            raise SpecError("world.world_size", "must be a positive multiple of gpus_per_node",
                            w)
        doc["nodes"] = w // g
    if "devices" in doc and isinstance(doc["devices"], (list, tuple)):
        return doc
    if not (_int(doc.get("nodes")) and _int(doc.get("gpus_per_node"))):
        raise SpecError("world", "needs positive nodes and gpus_per_node, or a devices list")
    return doc


def _dtype(v: Any, arg: str) -> str:
    text = str(v).lower().removeprefix("torch.")
    if text not in _DTYPES:
        raise SpecError(arg, "is not supported by DynaTrain yet (only fp32, bf16, fp16)",
                        _plain(v))
    return _DTYPES[text]


def _state(a: dict[str, Any], label: Callable[[str], str]) -> dict[str, Any]:
    if a["bf16"] and a["fp16"]:
        raise SpecError(label("fp16"), "cannot be combined with bf16", True)
    param = "bf16" if a["bf16"] else "fp16" if a["fp16"] else "fp32"
    if a["params_dtype"] is not None and _dtype(a["params_dtype"], label("params_dtype")) != param:
        raise SpecError(label("params_dtype"), f"disagrees with bf16={bool(a['bf16'])}, "
                        f"fp16={bool(a['fp16'])}", _plain(a["params_dtype"]))
    precise = a["use_precision_aware_optimizer"]
    kind = {k: _dtype(a[k], k) if precise else "fp32"
            for k in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")}
    # fp32 training has no separate main params: the optimizer steps the params themselves.
    return {"param": param, "main_param": None if param == "fp32" else kind["main_params_dtype"],
            "exp_avg": kind["exp_avg_dtype"], "exp_avg_sq": kind["exp_avg_sq_dtype"]}


def _name(a: dict[str, Any], size: int, mp: int) -> str:
    sizes = [("TP", a["tensor_model_parallel_size"]), ("PP", a["pipeline_model_parallel_size"]),
             ("CP", a["context_parallel_size"]), ("EP", a["expert_model_parallel_size"])]
    parts = [f"{k}{v}" for k, v in sizes if v not in (None, 1)]
    if mp:
        parts.append(f"DP{size // mp}")
    return f"Megatron job on {size} GPUs, " + " ".join(parts)


def _plain(v: Any) -> Any:
    return v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
