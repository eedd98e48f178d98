"""Real architectures, in Megatron's argument names, selectable by name in a spec's ``model:``.

Numbers are the published configurations (Llama 3.1 model card; the Qwen3, Mixtral,
DeepSeek-V3 and GPT-OSS config.json files, read the way ``hf_config.py`` reads them).
"""

from __future__ import annotations

_LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    untie_embeddings_and_output_weights=True,
    vocab_size=128256,
    kv_channels=128,
    max_position_embeddings=131072,
)
_QWEN3_MOE = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    untie_embeddings_and_output_weights=True,
    qk_layernorm=True,
    vocab_size=151936,
    kv_channels=128,
    num_query_groups=4,
    num_moe_experts=128,
    moe_router_topk=8,
    max_position_embeddings=40960,
)

PRESETS: dict[str, dict[str, object]] = {
    "llama3.1-8b": dict(
        _LLAMA, num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
        num_attention_heads=32, num_query_groups=8,
    ),
    "llama3.1-70b": dict(
        _LLAMA, num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
        num_attention_heads=64, num_query_groups=8,
    ),
    "llama3.1-405b": dict(
        _LLAMA, num_layers=126, hidden_size=16384, ffn_hidden_size=53248,
        num_attention_heads=128, num_query_groups=8,
    ),
    "qwen3-30b-a3b": dict(
        _QWEN3_MOE, num_layers=48, hidden_size=2048, ffn_hidden_size=6144,
        num_attention_heads=32, moe_ffn_hidden_size=768,
    ),
    "qwen3-235b-a22b": dict(
        _QWEN3_MOE, num_layers=94, hidden_size=4096, ffn_hidden_size=12288,
        num_attention_heads=64, moe_ffn_hidden_size=1536,
    ),
    # DeepSeek-V3 (671B): multi-latent attention, 3 dense layers then 256 routed experts
    # (top-8, sigmoid scores with a bias) plus one shared expert, one MTP layer.
    "deepseek-v3": dict(
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, vocab_size=129280,
        max_position_embeddings=163840, transformer_impl="transformer_engine",
        num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128,
        multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
        qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True,
        num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
        moe_shared_expert_intermediate_size=2048, moe_first_dense_layers=3,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_grouped_gemm=True, mtp_num_layers=1,
    ),
    # GPT-OSS-120B: attention sinks, biases everywhere, 128 experts (top-4) in every layer. Its
    # clamped GLU holds the parameters of a SwiGLU (``swiglu`` is the gated fc1 layout).
    "gpt-oss-120b": dict(
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, vocab_size=201088,
        max_position_embeddings=131072, transformer_impl="transformer_engine",
        num_layers=36, hidden_size=2880, ffn_hidden_size=2880, num_attention_heads=64,
        num_query_groups=8, kv_channels=64, add_bias_linear=True, softmax_type="learnable",
        num_moe_experts=128, moe_router_topk=4, moe_ffn_hidden_size=2880,
        moe_grouped_gemm=True,
    ),
    "mixtral-8x22b": dict(
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, vocab_size=32768, kv_channels=128,
        num_layers=56, hidden_size=6144, ffn_hidden_size=16384, num_attention_heads=48,
        num_query_groups=8, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16384,
        max_position_embeddings=65536,
    ),
}
