"""Specs from the job itself: Megatron-LM args, megatron-core configs and HuggingFace configs.

Each args case writes a shipped spec's job with Megatron-LM's own argument names and checks the
spec read from it against the hand-written one: equal as specs and equal in megatron-comparable
rank facts. The HF cases read the real published config.json values (tests/fixtures/hf) and
compare them with the presets field by field.
"""

from __future__ import annotations

import json
import warnings
from argparse import Namespace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dynatrain.ir.errors import SpecError
from dynatrain.ir.facts import rank_facts
from dynatrain.ir.from_job import (
    IGNORED, MAPPED, UNSUPPORTED, UnknownArgumentsWarning, read_megatron, spec_from_megatron,
)
from dynatrain.ir.hf_config import (
    model_from_hf_config, parse_assignments, read_hf_config, spec_from_hf_config,
)
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec, parse_spec, spec_to_yaml_text
from dynatrain.ir.presets import PRESETS
from dynatrain.ir.spec import ModelConfig
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

ROOT = Path(__file__).resolve().parents[1]
HF = Path(__file__).resolve().parent / "fixtures" / "hf"

# What a Megatron-LM launch script passes for Llama-3.1-70B (local spec, bf16).
LLAMA70_ARGS = dict(
    num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
    group_query_attention=True, num_query_groups=8, kv_channels=128, swiglu=True,
    normalization="RMSNorm", position_embedding_type="rope", max_position_embeddings=131072,
    untie_embeddings_and_output_weights=True, add_bias_linear=False, vocab_size=128256,
    tokenizer_type="HuggingFaceTokenizer", transformer_impl="local", bf16=True,
    use_distributed_optimizer=True, tensor_model_parallel_size=8,
    pipeline_model_parallel_size=4, sequence_parallel=True, world_size=128,
    lr=3e-4, seq_length=8192, micro_batch_size=1, global_batch_size=512, data_path=["x"],
)
QWEN235_ARGS = dict(
    num_layers=94, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=64,
    group_query_attention=True, num_query_groups=4, kv_channels=128, swiglu=True,
    normalization="RMSNorm", position_embedding_type="rope", max_position_embeddings=40960,
    untie_embeddings_and_output_weights=True, add_bias_linear=False, qk_layernorm=True,
    vocab_size=151936, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1536,
    moe_layer_freq=1, moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-3,
    transformer_impl="local", bf16=True, use_distributed_optimizer=True,
    tensor_model_parallel_size=4, pipeline_model_parallel_size=8, expert_model_parallel_size=16,
    expert_tensor_parallel_size=1, account_for_embedding_in_pipeline_split=True,
    account_for_loss_in_pipeline_split=True, sequence_parallel=True, world_size=256,
)
W16 = {"nodes": 16, "gpus_per_node": 8}
W32 = {"nodes": 32, "gpus_per_node": 8}


def _same_facts(a, b, ranks) -> None:
    la, lb = Layout(a), Layout(b)
    assert la.world == lb.world
    for r in ranks:
        assert rank_facts(la, r) == rank_facts(lb, r), f"rank {r}"


def _named_like(spec, ref):
    return spec.model_copy(update={"name": ref.name})


def _load_sp(path):
    """A shipped spec as the args above describe it: with sequence parallelism (which the
    shipped YAML leaves at its default, off; it changes no layout fact)."""
    ref = load_spec(ROOT / path)
    return ref.model_copy(update={"parallel": ref.parallel.model_copy(
        update={"sequence_parallel": True})})


@pytest.mark.parametrize("args, world, path", [
    (LLAMA70_ARGS, W16, "specs/llama3.1-70b/tp8-pp4-dp4.yaml"),
    (QWEN235_ARGS, W32, "specs/qwen3-235b-a22b/tp4-pp8-ep16-256gpu.yaml"),
], ids=["llama70b-tp8-pp4", "qwen235b-tp4-pp8-ep16"])
def test_args_give_the_shipped_spec(args, world, path) -> None:
    job = read_megatron(args, world)
    ref = _load_sp(path)
    assert job.unknown == () and job.notes == ()
    assert _named_like(job.spec, ref) == ref
    _same_facts(job.spec, ref, (0, 37, Layout(ref).world - 1))


def test_namespace_and_validated_values() -> None:
    """A Namespace as Megatron-LM's parse_args leaves it after validate_args (derived values,
    dtypes as strings as ``json.dump(vars(args), default=str)`` writes them)."""
    ns = Namespace(**LLAMA70_ARGS, data_parallel_size=4, params_dtype="torch.bfloat16",
                   transformer_pipeline_model_parallel_size=4, expert_tensor_parallel_size=8,
                   virtual_pipeline_model_parallel_size=None, padded_vocab_size=129024)
    ref = _load_sp("specs/llama3.1-70b/tp8-pp4-dp4.yaml")
    assert _named_like(spec_from_megatron(ns, (128, 8)), ref) == ref


def test_padded_vocab_only_keeps_the_layout() -> None:
    args = {k: v for k, v in LLAMA70_ARGS.items() if k != "vocab_size"}
    job = read_megatron({**args, "padded_vocab_size": 129024}, W16)
    ref = load_spec(ROOT / "specs/llama3.1-70b/tp8-pp4-dp4.yaml")
    assert job.spec.model.vocab_size == 129024
    assert job.notes and job.notes[0].startswith("vocab_size: unknown")
    _same_facts(job.spec, ref, (0, 127))


def test_null_tokenizer_adds_its_eod_token_before_0_18() -> None:
    """Megatron-LM 0.16's NullTokenizer has vocab_size + 1 tokens; from megatron-core 0.18 on
    exactly vocab_size (from_job.null_tokenizer_adds_eod cites both)."""
    args = {**LLAMA70_ARGS, "tokenizer_type": "NullTokenizer", "vocab_size": 1024,
            "make_vocab_size_divisible_by": 128, "tensor_model_parallel_size": 8}
    old = read_megatron(args, W16, megatron_core="0.16.1").spec
    assert (old.model.vocab_size, old.megatron_core) == (1025, "0.16.1")
    with pytest.raises(SpecError) as err:  # 1025 tokens pad to 2048, not 1024
        read_megatron({**args, "padded_vocab_size": 1024}, W16, megatron_core="0.16.1")
    assert str(err.value).startswith("padded_vocab_size: disagrees with a vocabulary of 1025")
    new = read_megatron({**args, "padded_vocab_size": 1024}, W16, megatron_core="0.19.2").spec
    assert (new.model.vocab_size, new.megatron_core) == (1024, "0.19.2")
    with pytest.raises(SpecError) as err:
        read_megatron(args, W16, megatron_core="0.15.3")
    assert str(err.value).startswith("megatron_core: no known layout rules for megatron-core")


def test_megatron_defaults_fill_missing_names() -> None:
    """Megatron-LM's defaults, not the spec's: biases on, GELU MLP of 4h, no dist optimizer."""
    spec = read_megatron({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                          "vocab_size": 1000, "transformer_impl": "local",
                          "max_position_embeddings": 128}, (2, 2)).spec
    m, p, s = spec.model, spec.parallel, spec.state
    assert (m.add_bias_linear, m.ffn_hidden_size, m.position_embedding_type) == (
        True, 256, "learned_absolute")
    assert (p.use_distributed_optimizer, s.param, s.main_param) == (False, "fp32", None)
    swiglu = read_megatron({"num_layers": 2, "hidden_size": 4096, "num_attention_heads": 32,
                            "vocab_size": 1000, "transformer_impl": "local", "swiglu": True,
                            "position_embedding_type": "rope"}, (2, 2)).spec
    assert swiglu.model.ffn_hidden_size == 10880  # int(4h*2/3 / 64) * 64


def test_virtual_pipeline_from_layers_per_stage() -> None:
    args = {**LLAMA70_ARGS, "tensor_model_parallel_size": 4, "overlap_grad_reduce": True,
            "num_layers_per_virtual_pipeline_stage": 4}
    ref = _load_sp("specs/llama3.1-70b/tp4-pp4-vpp5-dp8.yaml")
    spec = read_megatron(args, W16).spec
    assert _named_like(spec, ref) == ref
    _same_facts(spec, ref, (0, 5))
    with pytest.raises(SpecError) as err:
        read_megatron({**args, "virtual_pipeline_model_parallel_size": 4}, W16)
    assert str(err.value) == ("virtual_pipeline_model_parallel_size: disagrees with "
                              "num_layers_per_virtual_pipeline_stage (which gives 5) (got 4)")


def test_cp_bucket_size_follows_megatron_lm_training() -> None:
    """Megatron-LM sizes the default bucket by DP*CP (training.py); megatron-core's DDP and a
    spec without bucket_size by DP alone."""
    args = {**LLAMA70_ARGS, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "context_parallel_size": 2, "overlap_grad_reduce": True, "world_size": None}
    job = read_megatron(args, {"nodes": 12, "gpus_per_node": 8})  # DP 48, CP 2
    assert job.spec.parallel.bucket_size == 96_000_000
    small = read_megatron(args, (16, 8))  # DP 8: both give 40M, left to the default
    assert small.spec.parallel.bucket_size is None


def test_moe_layer_freq_pattern_string() -> None:
    spec = read_megatron({**QWEN235_ARGS, "moe_layer_freq": "([0]*2+[1]*92)"}, W32).spec
    assert spec.model.moe_pattern() == (False, False) + (True,) * 92
    with pytest.raises(SpecError) as err:
        read_megatron({**QWEN235_ARGS, "moe_layer_freq": "__import__('os')"}, W32)
    assert str(err.value).startswith("moe_layer_freq: must be an int, a 0/1 list")


@pytest.mark.parametrize("arg, value", [
    ("moe_use_legacy_grouped_gemm", True),
    ("tp_only_amax_red", True),
    ("fp8_dot_product_attention", True),
    ("fp8_param_gather", True),
    ("mla_down_proj_fusion", True),
    # megatron-core 0.19 / Megatron-LM 0.19 names that change the layout.
    ("hybrid_layer_pattern", "M*-M*-"),
    ("freeze_all_layers", True),
    ("use_layer_wise_distributed_optimizer", True),
])
def test_unsupported_arguments_refused_in_one_line(arg, value) -> None:
    with pytest.raises(SpecError) as err:
        read_megatron({**QWEN235_ARGS, arg: value}, W32)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{arg}: is not supported by DynaTrain yet")


def test_precision_aware_optimizer_states_read_into_the_spec() -> None:
    """--use-precision-aware-optimizer with fp32 masters kept by TE FusedAdam and bf16 moments
    maps into the spec's state dtypes; what DynaTrain does not carry is refused by name."""
    pa = {"use_precision_aware_optimizer": True, "store_param_remainders": False,
          "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16", "bf16": True}
    st = read_megatron({**LLAMA70_ARGS, **pa}, W16).spec.state
    assert (st.param, st.main_param, st.exp_avg, st.exp_avg_sq) == ("bf16", "fp32", "bf16",
                                                                     "bf16")
    for arg, value in (("store_param_remainders", True), ("exp_avg_dtype", "fp16"),
                       ("exp_avg_sq_dtype", "fp8"), ("main_params_dtype", "fp16")):
        with pytest.raises(SpecError) as err:
            read_megatron({**LLAMA70_ARGS, **pa, arg: value}, W16)
        assert str(err.value).startswith(f"{arg}: is not supported by DynaTrain yet"), arg


def test_fp8_arguments_read_into_the_spec() -> None:
    """--fp8-format, --fp8-recipe and --fp8-amax-history-len map into the model (TE layers);
    delayed scaling with experts gets the rule's refusal, named by the argument."""
    te = {"transformer_impl": "transformer_engine", "fp8": "hybrid"}
    m = read_megatron({**LLAMA70_ARGS, **te, "fp8_amax_history_len": 16}, W16).spec.model
    assert (m.fp8, m.fp8_recipe, m.fp8_amax_history_len, m.fp8_delayed) == (
        "hybrid", "delayed", 16, True)
    m = read_megatron({**QWEN235_ARGS, **te, "fp8_recipe": "blockwise"}, W32).spec.model
    assert (m.fp8, m.fp8_recipe, m.fp8_delayed) == ("hybrid", "blockwise", False)
    assert read_megatron(LLAMA70_ARGS, W16).spec.model.fp8 is None
    with pytest.raises(SpecError) as err:
        read_megatron({**QWEN235_ARGS, **te}, W32)
    assert str(err.value).startswith("fp8_recipe: delayed scaling with experts is refused")
    with pytest.raises(SpecError) as err:
        read_megatron({**LLAMA70_ARGS, **te, "transformer_impl": "local"}, W16)
    assert str(err.value).startswith("fp8: needs transformer_impl=transformer_engine")


def test_mla_and_sink_arguments_read_into_the_spec() -> None:
    """--multi-latent-attention with its ranks and head sizes, and --softmax-type, map into
    the model; MLA with local layers gets megatron's own refusal, named by the argument."""
    mla = {"multi_latent_attention": True, "q_lora_rank": 1536, "kv_lora_rank": 512,
           "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128,
           "softmax_type": "learnable"}
    te = {"transformer_impl": "transformer_engine"}
    m = read_megatron({**QWEN235_ARGS, **mla, **te}, W32).spec.model
    assert {k: getattr(m, k) for k in mla} == mla
    plain = read_megatron(QWEN235_ARGS, W32).spec.model
    assert (plain.multi_latent_attention, plain.softmax_type) == (False, "vanilla")
    with pytest.raises(SpecError) as err:
        read_megatron({**QWEN235_ARGS, **mla, "transformer_impl": "local"}, W32)
    assert str(err.value).startswith("multi_latent_attention: needs transformer_impl="
                                     "transformer_engine")


def test_layout_pad_buckets_and_kv_channels_args() -> None:
    """--pipeline-model-parallel-layout (VPP derived as validate_args does),
    --ddp-pad-buckets-for-high-nccl-busbw and --kv-channels map into the spec; bad values get
    one line naming the argument."""
    args = {**LLAMA70_ARGS, "pipeline_model_parallel_layout": "Et*9|(t*10|)*6,t*11L",
            "ddp_pad_buckets_for_high_nccl_busbw": True}
    spec = read_megatron(args, W16).spec
    p = spec.parallel
    assert (p.pipeline_model_parallel_layout, p.vpp, p.pad_buckets_for_high_nccl_busbw) == (
        "Et*9|(t*10|)*6,t*11L", 2, True)
    assert [c.layers[:1] for c in Layout(spec).chunks(0)] == [(0,), (39,)]
    # After validate_args, args carry the derived VPP too; a different one is refused.
    assert read_megatron({**args, "virtual_pipeline_model_parallel_size": 2}, W16).spec == spec
    bad = [({"virtual_pipeline_model_parallel_size": 3}, "virtual_pipeline_model_parallel_size: "
            "conflicts with pipeline_model_parallel_layout"),
           ({"num_virtual_stages_per_pipeline_rank": 2}, "num_virtual_stages_per_pipeline_rank: "
            "cannot be combined with pipeline_model_parallel_layout"),
           ({"pipeline_model_parallel_layout": "Et*79|L"}, "pipeline_model_parallel_layout: "
            "has 2 stages, which must be a multiple of pp=4"),
           ({"pipeline_model_parallel_layout": "Et*9|(t*10|)*6,t*11mL"},
            "pipeline_model_parallel_layout: has 1 multi-token prediction layers 'm' but "
            "mtp_num_layers=None"),
           ({"pipeline_model_parallel_layout": "Et*9|(t*10|)*5,t*10m|t*11L",
             "mtp_num_layers": 1, "untie_embeddings_and_output_weights": True},
            "pipeline_model_parallel_layout: must place every decoder layer 't' before"),
           ({"pipeline_model_parallel_layout": "Et*9|(t*10|)*6,t*11L", "mtp_num_layers": 1,
             "untie_embeddings_and_output_weights": True},
            "pipeline_model_parallel_layout: has 0 multi-token prediction layers"),
           ({"mtp_num_layers": 1, "untie_embeddings_and_output_weights": False},
            "mtp_num_layers: with pp > 1 needs "
            "untie_embeddings_and_output_weights"),
           ({"mtp_use_repeated_layer": True, "mtp_num_layers": 2},
            "mtp_use_repeated_layer: is not supported by DynaTrain yet"),
           ({"pipeline_model_parallel_layout": 7}, "pipeline_model_parallel_layout: "),
           ({"ddp_pad_buckets_for_high_nccl_busbw": "yes"},
            "ddp_pad_buckets_for_high_nccl_busbw: "),
           ({"kv_channels": None, "hidden_size": 8200}, "hidden_size: must be divisible by "
            "num_attention_heads=64 without kv_channels")]
    for change, start in bad:
        with pytest.raises(SpecError) as err:
            read_megatron({**args, **change}, W16)
        assert "\n" not in str(err.value) and str(err.value).startswith(start), str(err.value)


def test_core_config_layout_and_derived_kv_channels() -> None:
    """A TransformerConfig holds the parsed layout object and kv_channels = hidden // heads
    (no divisibility check in megatron-core); both come through."""
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                        pad_buckets_for_high_nccl_busbw=True)
    cfg = _core_config(pipeline_model_parallel_layout="Ettt|t*5L", hidden_size=120,
                       kv_channels=None)
    assert cfg.kv_channels == 15
    spec = read_megatron(cfg, (8, 4), ddp_config=ddp,
                         extra={"padded_vocab_size": 1024, "position_embedding_type": "rope"}).spec
    assert (spec.model.head_dim, spec.parallel.pipeline_model_parallel_layout, spec.parallel.vpp,
            spec.parallel.pad_buckets_for_high_nccl_busbw) == (15, "Ettt|t*5L", None, True)


def test_transformer_engine_is_megatron_lm_default() -> None:
    args = {k: v for k, v in LLAMA70_ARGS.items() if k != "transformer_impl"}
    assert read_megatron(args, W16).spec.model.transformer_impl == "transformer_engine"


@pytest.mark.parametrize("change, message", [
    ({"tensor_model_parallel_size": 3}, "tensor_model_parallel_size: must divide "
     "num_attention_heads=64 (got 3)"),
    ({"num_experts": 100}, "expert_model_parallel_size: must divide num_moe_experts=100 (got 16)"),
    ({"world_size": 128}, "world_size: disagrees with the world's 256 devices (got 128)"),
    ({"data_parallel_size": 4}, "data_parallel_size: disagrees with 256 devices / "
     "(tp*pp*cp=32) (got 4)"),
    ({"bf16": False, "params_dtype": "torch.bfloat16"}, "params_dtype: disagrees with "
     "bf16=False, fp16=False (got 'torch.bfloat16')"),
    ({"fp16": True}, "fp16: cannot be combined with bf16 (got True)"),
    ({"optimizer": "sgd"}, "optimizer: is not supported by DynaTrain yet (only adam's state is "
     "modelled) (got 'sgd')"),
    # megatron-core 0.19's layout switches.
    ({"tensor_parallel_num_weight_shards": 8}, "tensor_parallel_num_weight_shards: is not "
     "supported by DynaTrain yet (generalized tensor parallelism: weights in more shards than "
     "tensor_model_parallel_size=4) (got 8)"),
    ({"expert_tensor_parallel_num_weight_shards": 2}, "expert_tensor_parallel_num_weight_shards:"
     " is not supported by DynaTrain yet (generalized tensor parallelism: weights in more shards"
     " than expert_tensor_parallel_size=1) (got 2)"),
    ({"gtp_weight_remat_size": 2}, "gtp_weight_remat_size: is not supported by DynaTrain yet "
     "(generalized tensor parallelism (weights sharded over TP x GTP)) (got 2)"),
    ({"moe_mlp_glu_interleave_size": 32}, "moe_mlp_glu_interleave_size: is not supported by "
     "DynaTrain yet (block-interleaved GLU rows in the experts' fc1) (got 32)"),
    ({"moe_single_grouped_weight": True}, "moe_single_grouped_weight: is not supported by "
     "DynaTrain yet (experts' weights as one grouped parameter) (got True)"),
    ({"moe_router_load_balancing_type": ["aux_loss", "quantile_balancing"]},
     "moe_router_load_balancing_type: is not supported by DynaTrain yet (quantile balancing: "
     "its router bias qb_beta is state DynaTrain does not model) (got \"['aux_loss', "
     "'quantile_balancing']\")"),
])
def test_bad_values_name_the_argument(change, message) -> None:
    with pytest.raises(SpecError) as err:
        read_megatron({**QWEN235_ARGS, **change}, W32)
    assert str(err.value) == message


def test_0_19_defaults_and_their_validated_values_are_accepted() -> None:
    """validate_args resolves the GTP shard counts to the TP/ETP sizes (MT19 arguments.py:
    1451-1472); those, and 0.19's other new names at their defaults, change nothing."""
    plain = read_megatron(QWEN235_ARGS, W32)
    same = read_megatron({**QWEN235_ARGS, "tensor_parallel_num_weight_shards": 4,
                          "expert_tensor_parallel_num_weight_shards": 1,
                          "gtp_weight_remat_size": 1, "expert_gtp_weight_remat_size": 1,
                          "moe_router_load_balancing_type": "seq_aux_loss",
                          "use_transformer_engine_op_fuser": True, "use_mup": True,
                          "moe_mlp_glu_interleave_size": None}, W32)
    assert same.spec == plain.spec and same.unknown == ()


def test_unknown_names_are_reported_not_dropped() -> None:
    job = read_megatron({**LLAMA70_ARGS, "moe_brand_new_layout_knob": 3}, W16)
    assert job.unknown == ("moe_brand_new_layout_knob",)
    assert "moe_brand_new_layout_knob" in job.warning()
    with pytest.warns(UnknownArgumentsWarning, match="moe_brand_new_layout_knob"):
        spec_from_megatron({**LLAMA70_ARGS, "moe_brand_new_layout_knob": 3}, W16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec_from_megatron(LLAMA70_ARGS, W16)  # all known: no warning


def test_name_lists_are_disjoint() -> None:
    assert not (MAPPED & IGNORED) and not (MAPPED & UNSUPPORTED.keys())
    assert not (IGNORED & UNSUPPORTED.keys())


def _core_config(**kw) -> TransformerConfig:
    """A real megatron-core config, built like tests/megatron_support/harness.py does."""
    base = dict(
        num_layers=8, hidden_size=128, num_attention_heads=8, num_query_groups=4,
        ffn_hidden_size=352, kv_channels=16, tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2, sequence_parallel=False, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, use_cpu_initialization=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        normalization="RMSNorm", transformer_impl="local",
        num_moe_experts=8, moe_ffn_hidden_size=64, moe_router_topk=2,
        expert_model_parallel_size=2, expert_tensor_parallel_size=1,
        moe_token_dispatcher_type="allgather",
    )
    base.update(kw)
    return TransformerConfig(**base)


HAND_WRITTEN = """
model: {num_layers: 8, hidden_size: 128, num_attention_heads: 8, num_query_groups: 4,
        ffn_hidden_size: 352, kv_channels: 16, vocab_size: 1000, make_vocab_size_divisible_by: 64,
        swiglu: true, normalization: RMSNorm, position_embedding_type: rope,
        untie_embeddings_and_output_weights: true, num_moe_experts: 8, moe_ffn_hidden_size: 64,
        moe_router_topk: 2}
parallel: {tp: 2, pp: 2, ep: 2, etp: 1, overlap_grad_reduce: true, bucket_size: 5000}
world: {nodes: 2, gpus_per_node: 4}
"""


def test_real_transformer_config_gives_the_hand_written_spec() -> None:
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                        bucket_size=5000, grad_reduce_in_fp32=True)
    extra = {"vocab_size": 1000, "make_vocab_size_divisible_by": 64,
             "position_embedding_type": "rope", "untie_embeddings_and_output_weights": True}
    job = read_megatron(_core_config(), (8, 4), ddp_config=ddp, extra=extra)
    ref = parse_spec(HAND_WRITTEN)
    assert job.unknown == ()
    assert _named_like(job.spec, ref) == ref
    _same_facts(job.spec, ref, range(8))


def test_real_transformer_config_refusals_use_core_names() -> None:
    extra = {"padded_vocab_size": 1024, "position_embedding_type": "rope"}
    assert read_megatron(_core_config(transformer_impl="transformer_engine"), (8, 4),
                         extra=extra).spec.model.transformer_impl == "transformer_engine"
    with pytest.raises(SpecError) as err:  # named as the config names it
        read_megatron(_core_config(num_moe_experts=5), (8, 4), extra=extra)
    assert str(err.value) == "expert_model_parallel_size: must divide num_moe_experts=5 (got 2)"
    with pytest.raises(SpecError) as err:
        read_megatron(_core_config(num_layers_in_first_pipeline_stage=9), (8, 4), extra=extra)
    assert str(err.value).startswith("num_layers_in_first_pipeline_stage: first + last stage")
    with pytest.raises(SpecError) as err:
        read_megatron(_core_config(), (8, 4))
    assert str(err.value).startswith("padded_vocab_size: is required")
    if "tensor_parallel_num_weight_shards" in TransformerConfig.__dataclass_fields__:  # 0.19
        cfg = _core_config(tensor_parallel_num_weight_shards=4)  # tp2 x gtp2
        assert cfg.gtp_weight_remat_size == 2
        with pytest.raises(SpecError) as err:
            read_megatron(cfg, (8, 4), extra=extra)
        assert str(err.value).startswith("tensor_parallel_num_weight_shards: is not supported "
                                         "by DynaTrain yet (generalized tensor parallelism")


def test_yaml_text_round_trips() -> None:
    spec = read_megatron(QWEN235_ARGS, W32).spec
    text = spec_to_yaml_text(spec)
    assert parse_spec(text) == spec
    assert text.startswith("name: Megatron job on 256 GPUs, TP4 PP8 EP16 DP8\n")


# Each preset against the model built from the published config.json. The presets leave
# make_vocab_size_divisible_by at Megatron's 128 (a training choice a config.json does not hold).
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_hf_config_equals_preset(preset) -> None:
    got = read_hf_config(json.loads((HF / f"{preset}.json").read_text()))
    assert got.unknown == ()
    want = ModelConfig(**PRESETS[preset])
    model = ModelConfig(**got.model)
    diff = {k: (getattr(model, k), getattr(want, k)) for k in ModelConfig.model_fields
            if getattr(model, k) != getattr(want, k)}
    assert diff == {}


def test_hf_qwen3_dense_tied_with_wide_heads() -> None:
    m = model_from_hf_config(json.loads((HF / "qwen3-0.6b.json").read_text()))
    assert (m["kv_channels"], m["untie_embeddings_and_output_weights"], m["qk_layernorm"]) == (
        128, False, True)
    assert "num_moe_experts" not in m


def test_hf_qwen3_moe_sparse_step_and_dense_layers() -> None:
    cfg = json.loads((HF / "qwen3-30b-a3b.json").read_text())
    m = model_from_hf_config({**cfg, "num_hidden_layers": 4, "decoder_sparse_step": 2,
                              "mlp_only_layers": [3]})
    assert m["moe_layer_freq"] == (0, 1, 0, 0)


def test_hf_unknown_architecture_refused() -> None:
    cfg = json.loads((HF / "llama3.1-8b.json").read_text())
    with pytest.raises(SpecError) as err:
        model_from_hf_config({**cfg, "architectures": ["FalconForCausalLM"]})
    assert str(err.value).startswith("config.architectures: is not supported by DynaTrain yet; "
                                     "known: LlamaForCausalLM")
    assert "\n" not in str(err.value)
    with pytest.raises(SpecError) as err:  # known, and refused with its reason
        model_from_hf_config({**cfg, "architectures": ["Qwen3NextForCausalLM"]})
    assert str(err.value).startswith("config.architectures: Qwen3NextForCausalLM is not "
                                     "supported by DynaTrain: its Gated DeltaNet")


def test_hf_deepseek_family() -> None:
    """Kimi-K2 (DeepSeek-V3's architecture: 384 experts, one dense layer, no MTP layer) and
    DeepSeek-V2-Lite (no q low-rank projection, softmax routing without a bias, every other
    layer sparse) read into MLA specs that compile."""
    v3 = json.loads((HF / "deepseek-v3.json").read_text())
    kimi = model_from_hf_config({**v3, "model_type": "kimi_k2", "n_routed_experts": 384,
                                 "first_k_dense_replace": 1, "num_attention_heads": 64,
                                 "num_key_value_heads": 64, "num_nextn_predict_layers": 0,
                                 "vocab_size": 163840})
    assert (kimi["num_moe_experts"], kimi["moe_first_dense_layers"], kimi["num_attention_heads"],
            "mtp_num_layers" in kimi) == (384, 1, 64, False)
    lite_cfg = {**v3, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                "q_lora_rank": None, "num_hidden_layers": 4, "first_k_dense_replace": 1,
                "moe_layer_freq": 2, "scoring_func": "softmax", "topk_method": "greedy",
                "num_nextn_predict_layers": None}
    lite = model_from_hf_config(lite_cfg)
    assert (lite["q_lora_rank"], lite["moe_layer_freq"], lite["moe_router_score_function"],
            lite["moe_router_enable_expert_bias"]) == (None, [0, 0, 1, 0], "softmax", False)
    spec = spec_from_hf_config(lite_cfg, {"tp": 2, "ep": 2}, {"nodes": 1, "gpus_per_node": 4})
    assert spec.model.multi_latent_attention and spec.model.transformer_impl == \
        "transformer_engine"
    with pytest.raises(SpecError) as err:
        model_from_hf_config({**v3, "attention_bias": True})
    assert str(err.value).startswith("config.attention_bias: is not supported by DynaTrain yet "
                                     "(megatron's MLA projections have no biases)")


def test_hf_refusals_and_unknown_keys() -> None:
    cfg = json.loads((HF / "llama3.1-8b.json").read_text())
    with pytest.raises(SpecError, match=r"^config.hidden_act: is not supported"):
        model_from_hf_config({**cfg, "hidden_act": "gelu"})
    with pytest.raises(SpecError, match=r"^config.attention_bias: is not supported"):
        model_from_hf_config({**cfg, "attention_bias": True})
    with pytest.raises(SpecError, match=r"^config.num_hidden_layers: must be a positive integer"):
        model_from_hf_config({**cfg, "num_hidden_layers": "32"})
    assert read_hf_config({**cfg, "new_knob": 1}).unknown == ("new_knob",)


def test_spec_from_hf_config_and_assignments() -> None:
    cfg = json.loads((HF / "llama3.1-70b.json").read_text())
    spec = spec_from_hf_config(cfg, parse_assignments("tp=8,pp=4", "--parallel"),
                               parse_assignments("nodes=16,gpus_per_node=8", "--world"))
    ref = load_spec(ROOT / "specs/llama3.1-70b/tp8-pp4-dp4.yaml")
    assert _named_like(spec, ref) == ref
    with pytest.raises(SpecError, match=r"^--parallel: entries look like key=value"):
        parse_assignments("tp8", "--parallel")


def test_cli_spec_from_hf_and_from_args(tmp_path, capsys) -> None:
    import json as _json

    from dynatrain.cli import main
    from dynatrain.ir.layout import Layout
    from dynatrain.ir.loader import load_spec

    out = tmp_path / "spec.yaml"
    assert main(["spec", "--from-hf", "tests/fixtures/hf/llama3.1-70b.json", "--parallel",
                 "tp=8,pp=4", "--world", "nodes=16,gpus_per_node=8", "-o", str(out)]) == 0
    shipped = Layout(load_spec("specs/llama3.1-70b/tp8-pp4-dp4.yaml"))
    got = Layout(load_spec(str(out)))
    assert got.spec.model == shipped.spec.model and got.devices == shipped.devices
    args = tmp_path / "args.json"
    args.write_text("[1, 2]")
    assert main(["spec", "--from-args", str(args)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    args.write_text(_json.dumps({"fp8_param_gather": True, "num_layers": 2}))
    assert main(["spec", "--from-args", str(args), "--world", "nodes=1,gpus_per_node=8"]) == 2
    assert "fp8" in capsys.readouterr().err
