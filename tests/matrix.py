"""The configuration matrix shared by the megatron-core comparison and the round-trip tests.

Each entry is a flat dict of Megatron argument names (the harness's input) plus ``world``; every
entry is small enough to build with megatron-core on CPU in a second or two.
"""

from __future__ import annotations

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.spec import LayoutSpec

_MODEL_KEYS = {
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
    "kv_channels", "vocab_size", "make_vocab_size_divisible_by", "swiglu",
    "untie_embeddings_and_output_weights", "add_bias_linear", "qk_layernorm", "num_moe_experts",
    "moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size",
    "moe_layer_freq", "moe_router_enable_expert_bias", "normalization", "position_embedding_type",
    "max_position_embeddings", "moe_shared_expert_gate", "moe_router_score_function",
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
    "qk_pos_emb_head_dim", "v_head_dim", "softmax_type", "transformer_impl", "moe_grouped_gemm",
    "mtp_num_layers", "fp8", "fp8_recipe", "fp8_amax_history_len",
}
# TransformerConfig fields the harness sets by override (fp8_amax_compute_algo: harness only,
# it changes no state's shape).
_FP8_KEYS = ("fp8", "fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo")
_PARALLEL_KEYS = {
    "tp", "pp", "vpp", "cp", "ep", "etp", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "use_distributed_optimizer",
    "num_distributed_optimizer_instances", "bucket_size", "order",
    "pipeline_model_parallel_layout", "pad_buckets_for_high_nccl_busbw",
}

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
            vocab_size=200, make_vocab_size_divisible_by=16, max_position_embeddings=64)
MOE = dict(num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2)


def case(name: str, world: int, **kw: object) -> dict:
    return {"name": name, "world": world, **BASE, **kw}


# fmt: off
CASES: list[dict] = [
    case("tp1-single", 1),
    case("tp2-dp2", 4, tp=2),
    case("tp4-gqa2-swiglu", 4, tp=4, num_query_groups=2, swiglu=True),
    case("tp2-gqa2-swiglu-untied", 4, tp=2, num_query_groups=2, swiglu=True,
         untie_embeddings_and_output_weights=True),
    case("tp3-nonpow2", 3, tp=3, num_attention_heads=6, hidden_size=48, ffn_hidden_size=96,
         num_query_groups=3, swiglu=True),
    case("tp2-bias-layernorm", 2, tp=2, add_bias_linear=True, normalization="LayerNorm"),
    case("tp2-rmsnorm-rope-qkln", 2, tp=2, normalization="RMSNorm", position_embedding_type="rope",
         qk_layernorm=True),
    case("dp4-no-distopt", 4, use_distributed_optimizer=False),
    case("tp2-dp2-no-distopt-swiglu", 4, tp=2, swiglu=True, use_distributed_optimizer=False),
    case("pp2-tied", 2, pp=2),
    case("pp2-tied-tp2-dp2", 8, pp=2, tp=2),
    case("pp2-untied", 2, pp=2, untie_embeddings_and_output_weights=True),
    case("pp2-vpp2", 2, pp=2, vpp=2, num_layers=4),
    case("pp2-vpp2-tied-tp2", 4, pp=2, vpp=2, num_layers=4, tp=2),
    case("pp3-uneven-first", 3, pp=3, num_layers=5, decoder_first_pipeline_num_layers=1),
    case("pp3-uneven-last", 3, pp=3, num_layers=5, decoder_last_pipeline_num_layers=3),
    case("pp4-uneven-vpp2", 4, pp=4, vpp=2, num_layers=12, decoder_first_pipeline_num_layers=2,
         decoder_last_pipeline_num_layers=2),
    case("pp2-account-emb-loss", 2, pp=2, num_layers=2, account_for_embedding_in_pipeline_split=True,
         account_for_loss_in_pipeline_split=True),
    case("cp2-tp2", 4, cp=2, tp=2),
    case("cp2-dp2", 4, cp=2),
    case("buckets-small", 2, bucket_size=2000),
    case("buckets-small-tied-pp2", 4, pp=2, bucket_size=2000),
    case("order-tp-dp-pp-cp", 8, tp=2, cp=2, order="tp-pp-dp-cp-ep"),
    case("moe-ep2-tp1", 2, ep=2, **MOE),
    case("moe-ep2-etp1-tp2", 4, tp=2, ep=2, etp=1, **MOE),
    case("moe-ep2-etp2-tp2-swiglu", 4, tp=2, ep=2, swiglu=True, **MOE),
    case("moe-ep4-etp1-dp4", 4, ep=4, swiglu=True, **MOE),
    case("moe-ep1-etp-eq-tp2", 2, tp=2, ep=1, swiglu=True, **MOE),
    case("moe-shared-gate-expert-bias", 4, tp=2, ep=2, etp=1, swiglu=True,
         moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True,
         moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid", **MOE),
    case("moe-dense-first-layer", 4, num_layers=3, tp=2, ep=2, etp=1,
         moe_layer_freq=[0, 1, 1], **MOE),
    case("moe-freq2-pp2", 4, num_layers=4, pp=2, ep=2, moe_layer_freq=2, **MOE),
    case("moe-bias-etp1", 4, tp=2, ep=2, etp=1, add_bias_linear=True, **MOE),
    case("moe-cp2-ep2", 4, cp=2, ep=2, **MOE),
    case("moe-pp2-vpp2-ep2-tp2", 8, num_layers=4, pp=2, vpp=2, tp=2, ep=2, etp=1, swiglu=True,
         moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid", **MOE),
    case("moe-no-distopt-ep2", 4, ep=2, tp=2, etp=1, use_distributed_optimizer=False, **MOE),
    case("moe-buckets-ep2", 4, ep=2, bucket_size=3000, **MOE),
    case("distopt-instances2-dp4", 4, num_distributed_optimizer_instances=2),
    case("sinks-tp2-gqa2-pp2", 4, tp=2, pp=2, num_query_groups=2, softmax_type="learnable"),
    case("mtp-tp2-tied-pp1", 2, tp=2, mtp_num_layers=1),
    case("mtp2-pp2-tp2-untied-rope", 4, pp=2, tp=2, mtp_num_layers=2, position_embedding_type="rope",
         untie_embeddings_and_output_weights=True),
    case("mtp-moe-pp2-vpp2-ep2-untied", 4, pp=2, vpp=2, ep=2, num_layers=4, mtp_num_layers=1,
         moe_layer_freq=[0, 1, 1, 1], position_embedding_type="rope",
         untie_embeddings_and_output_weights=True, **MOE),
    case("mtp-moe-last-layer-dense", 2, ep=2, mtp_num_layers=1, moe_layer_freq=[1, 0], **MOE),
    case("distopt-instances2-moe-ep2-edp4", 8, ep=2, tp=2, etp=1, swiglu=True,
         num_distributed_optimizer_instances=2, **MOE),
]

# Megatron's other layout options (tests/test_layout_options.py): explicit pipeline layouts with
# and without VPP (derived as stages / pp), uneven and empty stages, bus-bandwidth bucket padding
# and kv_channels derived as hidden // heads.
OPTION_CASES: list[dict] = [
    case("layout-pp3-uneven", 6, pp=3, tp=2, num_layers=4, pipeline_model_parallel_layout="Et|tt|tL"),
    case("layout-empty-first-stage", 3, pp=3, num_layers=3, untie_embeddings_and_output_weights=True,
         pipeline_model_parallel_layout="|Ett|tL"),
    case("layout-vpp2-repeat", 4, pp=2, num_layers=8, bucket_size=2000,
         pipeline_model_parallel_layout="E(tt|)*3ttL"),
    case("layout-vpp2-empty-chunks", 2, pp=2, num_layers=4,
         pipeline_model_parallel_layout="Ett|tt||L"),
    case("layout-vpp3-x-n", 2, pp=2, num_layers=7, pipeline_model_parallel_layout="Et*2|t|t,t|t||tL"),
    case("layout-moe-pattern", 4, pp=2, ep=2, num_layers=4, moe_layer_freq=[0, 1, 0, 1],
         pipeline_model_parallel_layout="Ettt|tL", **MOE),
    case("pad-busbw-dp4-buckets", 4, pad_buckets_for_high_nccl_busbw=True, bucket_size=3000),
    case("pad-busbw-moe-ep2-vpp", 8, pp=2, vpp=2, num_layers=4, ep=2, tp=2, etp=1, swiglu=True,
         pad_buckets_for_high_nccl_busbw=True, **MOE),
    case("pad-busbw-no-distopt", 2, pad_buckets_for_high_nccl_busbw=True,
         use_distributed_optimizer=False),
    case("kv-derived-floor-gqa", 4, tp=2, hidden_size=60, num_attention_heads=8,
         num_query_groups=2, ffn_hidden_size=64),
    case("layout-mtp-last-stage", 4, pp=2, tp=2, num_layers=4, mtp_num_layers=1,
         position_embedding_type="rope", untie_embeddings_and_output_weights=True,
         pipeline_model_parallel_layout="Ett|ttmL"),
]
# fmt: on


def drawn_case(doc: dict) -> tuple[dict, int]:
    """A spec document drawn by tests/strategies.py as a flat config like the ones above
    (world size from its ranks)."""
    spec = spec_from_dict(doc)
    model = {"ffn_hidden_size": spec.model.ffn, **doc["model"]}  # the harness needs it given
    if model.pop("moe_first_dense_layers", 0):  # the harness takes the per-layer pattern
        model["moe_layer_freq"] = [int(x) for x in spec.model.moe_pattern()]
    par = {k: v for k, v in doc["parallel"].items() if k != "overlap_grad_reduce"}
    world = Layout(spec).world
    return {"name": doc.get("name") or "random", "world": world, **model, **par}, world


def to_spec_dict(cfg: dict) -> dict:
    """A harness config as a DynaTrain spec mapping."""
    model = {k: v for k, v in cfg.items() if k in _MODEL_KEYS}
    par = {k: v for k, v in cfg.items() if k in _PARALLEL_KEYS and v is not None}
    if cfg.get("bucket_size") is not None:
        par["overlap_grad_reduce"] = True
    out = {"name": cfg["name"], "model": model, "parallel": par,
           "world": {"nodes": 1, "gpus_per_node": cfg["world"]}}
    if "state" in cfg:  # the spec's state dtypes (the harness takes optimizer overrides)
        out["state"] = cfg["state"]
    return out


def to_spec(cfg: dict) -> LayoutSpec:
    return spec_from_dict(to_spec_dict(cfg))


def to_harness_cfg(cfg: dict) -> dict:
    """A matrix entry as the megatron harness's input."""
    out = {k: v for k, v in cfg.items() if k not in ("name", "world", "state")}
    out["seq_length"] = out.pop("max_position_embeddings")
    # Spell out DynaTrain's defaults (Megatron's own) so both sides build the same model.
    out.setdefault("position_embedding_type", "learned_absolute")
    out.setdefault("normalization", "LayerNorm")
    overrides: dict = {k: out.pop(k) for k in _FP8_KEYS if k in out}
    if out.pop("moe_shared_expert_gate", False):
        overrides["moe_shared_expert_gate"] = True
    if (text := out.pop("pipeline_model_parallel_layout", None)) is not None:
        overrides["pipeline_model_parallel_layout"] = text
        # Megatron-LM passes the VPP the layout implies to initialize_model_parallel too.
        out["vpp"] = to_spec(cfg).parallel.vpp
    if overrides:
        out["transformer_config_overrides"] = overrides
    if out.pop("pad_buckets_for_high_nccl_busbw", False):
        out["ddp_config_overrides"] = {"pad_buckets_for_high_nccl_busbw": True}
    return out
