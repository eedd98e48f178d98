"""Transformer Engine configurations for the parity tests (tests/test_te_parity.py).

Entries are ``matrix.case`` dicts (Megatron argument names + ``world``) plus the TE knobs
``moe_grouped_gemm`` and ``sequence_parallel``; ``to_te_spec`` makes the DynaTrain spec with
``model.transformer_impl: transformer_engine``. ``FAST`` (the default profile) covers every
dimension once: dense and MoE, grouped and sequential experts, GQA, SwiGLU, biases, RMSNorm,
qk-layernorm, PP/VPP, EP/ETP, sequence parallel, the distributed optimizer on and off.
"""

from __future__ import annotations

import functools

from matrix import MOE, case, drawn_case, to_harness_cfg, to_spec_dict

from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.spec import LayoutSpec

G = dict(moe_grouped_gemm=True)
SP = dict(sequence_parallel=True)
# Multi-latent attention at test sizes (the spec's defaults are Megatron-LM's, 128-wide heads).
MLA = dict(multi_latent_attention=True, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
           v_head_dim=16, normalization="RMSNorm", position_embedding_type="rope")
SINKS = dict(softmax_type="learnable")

# fmt: off
CASES: list[dict] = [
    case("te-tp1-single", 1),
    case("te-tp2-dp2", 4, tp=2),
    case("te-tp2-sp-gqa2-swiglu-bias", 4, tp=2, num_query_groups=2, swiglu=True,
         add_bias_linear=True, **SP),
    case("te-tp4-gqa2-swiglu", 4, tp=4, num_query_groups=2, swiglu=True),
    case("te-tp2-gqa2-swiglu-untied", 4, tp=2, num_query_groups=2, swiglu=True,
         untie_embeddings_and_output_weights=True),
    case("te-tp3-nonpow2", 3, tp=3, num_attention_heads=6, hidden_size=48, ffn_hidden_size=96,
         num_query_groups=3, swiglu=True),
    case("te-tp2-bias-layernorm", 2, tp=2, add_bias_linear=True),
    case("te-tp2-rmsnorm-rope-qkln", 2, tp=2, normalization="RMSNorm",
         position_embedding_type="rope", qk_layernorm=True),
    case("te-tp1-sp-forced-off", 2, **SP),
    case("te-dp4-no-distopt", 4, use_distributed_optimizer=False),
    case("te-tp2-sp-no-distopt-swiglu", 4, tp=2, swiglu=True, use_distributed_optimizer=False,
         **SP),
    case("te-pp2-tied", 2, pp=2),
    case("te-pp2-untied-tp2-sp", 4, pp=2, tp=2, untie_embeddings_and_output_weights=True, **SP),
    case("te-pp2-vpp2-tied-tp2", 4, pp=2, vpp=2, num_layers=4, tp=2),
    case("te-pp3-uneven-first", 3, pp=3, num_layers=5, decoder_first_pipeline_num_layers=1),
    case("te-cp2-tp2", 4, cp=2, tp=2),
    case("te-buckets-small", 2, bucket_size=2000),
    case("te-moe-ep2-sequential", 2, ep=2, **MOE),
    case("te-moe-ep2-grouped", 2, ep=2, **MOE, **G),
    case("te-moe-ep2-etp1-tp2-grouped-sp", 4, tp=2, ep=2, etp=1, **MOE, **G, **SP),
    case("te-moe-ep2-etp2-tp2-swiglu-grouped", 4, tp=2, ep=2, swiglu=True, **MOE, **G),
    case("te-moe-ep2-etp2-tp2-swiglu-sequential", 4, tp=2, ep=2, swiglu=True, **MOE),
    case("te-moe-ep4-etp1-swiglu-grouped", 4, ep=4, swiglu=True, **MOE, **G),
    case("te-moe-ep1-tp2-swiglu-grouped", 2, tp=2, swiglu=True, **MOE, **G),
    case("te-moe-ep1-tp2-sequential", 2, tp=2, **MOE),
    case("te-moe-shared-gate-expert-bias-grouped", 4, tp=2, ep=2, etp=1, swiglu=True,
         moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True,
         moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid", **MOE, **G),
    case("te-moe-dense-first-layer-grouped", 4, num_layers=3, tp=2, ep=2, etp=1,
         moe_layer_freq=[0, 1, 1], **MOE, **G),
    case("te-moe-freq2-pp2-grouped", 4, num_layers=4, pp=2, ep=2, moe_layer_freq=2, **MOE, **G),
    case("te-moe-bias-etp1-grouped", 4, tp=2, ep=2, etp=1, add_bias_linear=True, **MOE, **G),
    case("te-moe-bias-etp1-sequential", 4, tp=2, ep=2, etp=1, add_bias_linear=True, **MOE),
    case("te-moe-rmsnorm-qkln-grouped", 2, ep=2, normalization="RMSNorm", qk_layernorm=True,
         **MOE, **G),
    case("te-moe-pp2-vpp2-ep2-tp2-grouped-sp", 8, num_layers=4, pp=2, vpp=2, tp=2, ep=2, etp=1,
         swiglu=True, moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
         **MOE, **G, **SP),
    case("te-moe-no-distopt-ep2-grouped", 4, ep=2, tp=2, etp=1, use_distributed_optimizer=False,
         **MOE, **G),
    case("te-moe-buckets-ep2-grouped", 4, ep=2, bucket_size=3000, **MOE, **G),
    case("te-moe-instances2-edp4-grouped", 8, ep=2, tp=2, etp=1, swiglu=True,
         num_distributed_optimizer_instances=2, **MOE, **G),
    case("te-sinks-tp2-gqa2", 4, tp=2, num_query_groups=2, **SINKS),
    case("te-mla-tp2-qlora-qkln-sinks-pp2", 4, tp=2, pp=2, num_layers=4, q_lora_rank=24,
         qk_layernorm=True, **MLA, **SINKS),
    case("te-mla-tp2-qkln-no-qlora", 2, tp=2, qk_layernorm=True, **MLA),
    case("te-mla-layernorm-bias-vpp2", 4, pp=2, vpp=2, num_layers=4, q_lora_rank=24,
         qk_layernorm=True, add_bias_linear=True, **dict(MLA, normalization="LayerNorm")),
    case("te-mla-moe-ep2-etp1-tp2-grouped-shared", 4, tp=2, ep=2, etp=1, swiglu=True,
         q_lora_rank=24, qk_layernorm=True, moe_layer_freq=[0, 1],
         moe_shared_expert_intermediate_size=32, moe_router_enable_expert_bias=True,
         moe_router_score_function="sigmoid", **MOE, **G, **MLA),
    case("te-mla-moe-ep2-sequential-sinks", 2, ep=2, **MOE, **MLA, **SINKS),
    case("te-mtp-pp2-untied-qkln", 4, pp=2, tp=2, mtp_num_layers=2, qk_layernorm=True,
         untie_embeddings_and_output_weights=True, position_embedding_type="rope"),
    case("te-mtp-mla-moe-pp2-ep2-grouped", 4, pp=2, ep=2, num_layers=4, mtp_num_layers=1,
         q_lora_rank=24, qk_layernorm=True, moe_layer_freq=[0, 1, 1, 1],
         moe_shared_expert_intermediate_size=32, untie_embeddings_and_output_weights=True,
         **MOE, **G, **MLA),
]
# fmt: on

FAST_NAMES = (
    "te-tp2-sp-gqa2-swiglu-bias",  # dense, TP, SP, GQA, SwiGLU, biases
    "te-tp2-rmsnorm-rope-qkln",  # RMSNorm (no layer_norm_bias), qk norms
    "te-dp4-no-distopt",  # plain DDP, no dist-opt
    "te-pp2-vpp2-tied-tp2",  # PP, VPP, tied embedding
    "te-moe-ep2-etp1-tp2-grouped-sp",  # grouped experts, EP, ETP != TP, SP
    "te-moe-ep2-etp2-tp2-swiglu-sequential",  # sequential TE experts, ETP = TP
    "te-moe-ep1-tp2-swiglu-grouped",  # EP = 1: experts in the dense buffer
    "te-moe-shared-gate-expert-bias-grouped",  # shared experts, gate, expert bias
    "te-mla-tp2-qlora-qkln-sinks-pp2",  # MLA with q down/up projections, fused norms, sinks
    "te-mla-tp2-qkln-no-qlora",  # MLA's linear_q_proj: its norm differs between versions
    "te-mla-moe-ep2-etp1-tp2-grouped-shared",  # DeepSeek-V3's shape: MLA, first layer dense
    "te-mtp-mla-moe-pp2-ep2-grouped",  # and its MTP layer on the last stage
)
FAST = [c for c in CASES if c["name"] in FAST_NAMES]
assert len(FAST) == len(FAST_NAMES)


# One training step on top of megatron's own forward (tests/test_te_train.py). RoPE for the
# dense case: forward_loss seeds a weight by its name and TP rank, so a TP-replicated 2-D
# weight (a position-embedding table) would differ between TP ranks, which sequence
# parallelism (each rank embeds only its slice of the sequence) would expose.
TOKENS = [[3, 17, 99, 150, 7, 64, 2, 188], [5, 5, 120, 33, 180, 9, 41, 77]]
LABELS = [[17, 99, 150, 7, 64, 2, 188, 1], [5, 120, 33, 180, 9, 41, 77, 3]]
TRAIN_PROBES = [{"name": "forward_loss", "vocab_size": 200, "tokens": TOKENS, "labels": LABELS},
                {"name": "train_step", "tokens": TOKENS, "labels": LABELS}]
TRAIN = [
    case("te-train-tp2-sp-gqa-swiglu-bias-rope", 2, tp=2, num_query_groups=2, swiglu=True,
         add_bias_linear=True, sequence_parallel=True, position_embedding_type="rope"),
    # top-k = all experts: no discrete routing choice for bf16 rounding to flip between specs
    case("te-train-moe-ep2-bias-sequential-topk4", 2, ep=2, add_bias_linear=True,
         **dict(MOE, moe_router_topk=4)),
    case("te-train-moe-ep2-swiglu-grouped", 2, ep=2, swiglu=True, moe_grouped_gemm=True, **MOE),
]


# The bridge (extract/install) on trained TE jobs (tests/test_te_bridge.py).
BRIDGE = [
    case("te-bridge-tp2-dp2-sp-gqa-swiglu", 4, tp=2, num_query_groups=2, swiglu=True,
         sequence_parallel=True, position_embedding_type="rope", vocab_size=256),
    case("te-bridge-moe-ep2-grouped-expert-bias", 4, ep=2, swiglu=True, moe_grouped_gemm=True,
         moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid", **MOE),
    case("te-bridge-pp2-no-distopt-sequential", 4, pp=2, ep=2, use_distributed_optimizer=False,
         add_bias_linear=True, **MOE),
]


# megatron-core 0.16's TE wrapper re-creates biases under use_cpu_initialization and leaves
# sequential experts' biases dense (versions.Series.te_cpu_init_dense_expert_bias).
CPU_INIT = case("te-cpu-init-moe-ep2-bias-sequential", 2, ep=2, add_bias_linear=True, **MOE)


def default_request() -> list[tuple[dict, int]]:
    """The default profile's TE builds, run in one child: ``FAST``, ``TRAIN``, ``BRIDGE``,
    ``random_cases()``, then ``CPU_INIT`` built with ``use_cpu_initialization``."""
    return ([(to_harness_cfg(c), c["world"]) for c in FAST]
            + [(dict(to_harness_cfg(c), probes=TRAIN_PROBES), c["world"]) for c in TRAIN]
            + [(dict(to_harness_cfg(c), probes=[TRAIN_PROBES[1], {
                "name": "te_bridge", "spec": to_te_spec_dict(c)}]), c["world"])
               for c in BRIDGE]
            + [(to_harness_cfg(c), c["world"]) for c in random_cases()]
            + [(dict(to_harness_cfg(CPU_INIT), transformer_config_overrides={
                "use_cpu_initialization": True}), CPU_INIT["world"])])


def to_te_spec(cfg: dict) -> LayoutSpec:
    """The DynaTrain spec of a TE case."""
    return spec_from_dict(to_te_spec_dict(cfg))


def to_te_spec_dict(cfg: dict) -> dict:
    """The DynaTrain spec mapping of a TE case."""
    d = to_spec_dict(cfg)
    d["model"]["transformer_impl"] = "transformer_engine"
    if cfg.get("moe_grouped_gemm"):
        d["model"]["moe_grouped_gemm"] = True
    if cfg.get("sequence_parallel"):
        d["parallel"]["sequence_parallel"] = True
    return d


def to_te_harness_cfg(cfg: dict) -> dict:
    """A TE case as the harness's input (``te.te_facts`` adds transformer_impl)."""
    return to_harness_cfg(cfg)


@functools.cache
def random_cases() -> list[dict]:
    """The default profile's 30 random MLA / attention-sink / MTP jobs."""
    return random_feature_cases(30)


TRAIN_SEQ = 8  # megatron_support.live.SEQ: the sequence length the live harness trains


def random_fp8_delayed_cases(n: int, max_world: int = 4) -> list[dict]:
    """``n`` small random dense TE jobs training with fp8 delayed scaling, drawn
    (reproducibly) by the gate's own strategies; without context parallelism (the CPU core
    attention has none) and with VPP only up to PP 2 (the live harness trains 2 microbatches);
    models megatron could not train on the harness's sequences are left out."""
    from hypothesis import HealthCheck, Phase, assume, given, settings
    from hypothesis import strategies as st
    from strategies import _spec, layouts, models

    @st.composite
    def docs(draw: st.DrawFn) -> dict:
        model = draw(models(moe=False))
        assume(model.get("fp8_recipe") == "delayed")
        # megatron's attention takes the GQA path when num_query_groups < TP, which MLA's
        # forward cannot run (M16 transformer/attention.py:289-296); the layout is the same.
        if model.get("multi_latent_attention"):
            model.pop("num_query_groups", None)
        doc = draw(layouts(model, max_world=max_world))
        assume(doc["parallel"].get("cp", 1) == 1)
        spec = _spec(doc)
        # The harness trains 2 microbatches; the interleaved schedule needs at least pp.
        assume(spec.parallel.vpp is None or spec.parallel.pp <= 2)
        # What megatron can train on the harness's sequences: rotary embeddings rotate pairs
        # (an even head size), learned positions cover the sequence.
        m = spec.model
        rotary = m.qk_pos_emb_head_dim if m.multi_latent_attention else m.head_dim
        assume(m.position_embedding_type != "rope" or rotary % 2 == 0)
        assume(m.position_embedding_type != "learned_absolute"
               or m.max_position_embeddings >= TRAIN_SEQ)
        return doc

    drawn: list[dict] = []

    @settings(max_examples=n, database=None, derandomize=True, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(doc=docs())
    def collect(doc: dict) -> None:
        drawn.append(doc)

    collect()
    return [drawn_case({**doc, "name": f"te-fp8-random-{i}"})[0] for i, doc in enumerate(drawn)]


def random_feature_cases(n: int, max_world: int = 4) -> list[dict]:
    """``n`` small random TE jobs that use multi-latent attention, attention sinks or MTP, drawn
    (reproducibly) by the gate's own strategies: any model and layout those draw, given the
    feature. Context parallelism is left out with a learnable softmax: the harness swaps core
    attention for a parameter-less stand-in when cp > 1 (neither CPU core attention has CP)."""
    from hypothesis import HealthCheck, Phase, assume, given, settings
    from hypothesis import strategies as st
    from strategies import _spec, layouts, models

    @st.composite
    def docs(draw: st.DrawFn) -> dict:
        model = draw(models())
        assume(model.get("transformer_impl") == "transformer_engine")
        assume(model.get("multi_latent_attention") or model.get("softmax_type") == "learnable"
               or model.get("mtp_num_layers"))
        doc = draw(layouts(model, max_world=max_world))
        assume(doc["parallel"].get("cp", 1) == 1 or model.get("softmax_type") != "learnable")
        _spec(doc)  # as the gate: a rule the construction missed rejects the example
        return doc

    drawn: list[dict] = []

    @settings(max_examples=n, database=None, derandomize=True, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(doc=docs())
    def collect(doc: dict) -> None:
        drawn.append(doc)

    collect()
    cases = []
    for i, doc in enumerate(drawn):
        cfg, _ = drawn_case({**doc, "name": f"te-random-{i}"})
        cases.append(cfg)
    return cases
