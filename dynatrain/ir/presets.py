"""Real architectures, in Megatron's argument names, selectable by name in a spec's ``model:``.

Numbers are the published configurations (Llama 3.1 model card, Qwen3 and Mixtral configs).
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
    "mixtral-8x22b": dict(
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, vocab_size=32768, kv_channels=128,
        num_layers=56, hidden_size=6144, ffn_hidden_size=16384, num_attention_heads=48,
        num_query_groups=8, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16384,
        max_position_embeddings=65536,
    ),
}
