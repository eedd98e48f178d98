"""A spec's ``model`` from a HuggingFace ``config.json`` (Llama, Qwen3, Qwen3-MoE, Mixtral,
DeepSeek-V2/V3 and Kimi-K2, GPT-OSS).

``model_from_hf_config(config)`` gives the mapping of Megatron argument names that a spec's
``model:`` takes, the way Megatron-Bridge-style converters set a Megatron GPT model up from those
checkpoints: RMSNorm, SwiGLU, RoPE, no linear biases, one KV group per KV head; DeepSeek's
multi-latent attention, MTP layers and GPT-OSS's attention sinks with Transformer Engine layers
(megatron builds MLA with TE only). Keys that change the parameters are read (``HF_MAPPED``) or
refused when set to something Megatron's GPT layers do not build; keys with no effect on the parameters (rope settings, norm epsilon, token
ids, dtype) are in ``HF_IGNORED``; anything else is listed by ``read_hf_config`` as unknown.
Megatron training choices that a config.json does not hold (``make_vocab_size_divisible_by``)
keep the spec's defaults.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import SpecError
from .loader import spec_from_dict
from .spec import LayoutSpec
from .strict import json_object, read_bounded

MAX_CONFIG_BYTES = 16 << 20  # a config.json or an args dump is a few KiB

# architecture -> (model_type, MoE keys it uses or None for dense, qk norm)
ARCHITECTURES: dict[str, tuple[str, str | None, bool]] = {
    "LlamaForCausalLM": ("llama", None, False),
    "Qwen3ForCausalLM": ("qwen3", None, True),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "qwen3_moe", True),
    "MixtralForCausalLM": ("mixtral", "mixtral", False),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "deepseek", True),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "deepseek", True),  # also Kimi-K2's
    "GptOssForCausalLM": ("gpt_oss", "gpt_oss", False),
}
# Architectures refused with their reason (the others: "not supported yet; known: ...").
REFUSED: dict[str, str] = {
    "Qwen3NextForCausalLM": "its Gated DeltaNet linear-attention layers are not a GPT layer "
                            "megatron-core's GPT model builds",
}
HF_MAPPED = frozenset("""
architectures model_type hidden_size intermediate_size num_hidden_layers num_attention_heads
num_key_value_heads head_dim vocab_size tie_word_embeddings max_position_embeddings hidden_act
attention_bias mlp_bias num_experts num_local_experts num_experts_per_tok moe_intermediate_size
decoder_sparse_step mlp_only_layers
q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim n_routed_experts
n_shared_experts first_k_dense_replace moe_layer_freq scoring_func topk_method
num_nextn_predict_layers experts_per_token
""".split())
HF_IGNORED = frozenset("""
_name_or_path attention_dropout bos_token_id eos_token_id pad_token_id initializer_range
rms_norm_eps rope_theta rope_scaling rope_parameters partial_rotary_factor pretraining_tp
use_cache torch_dtype dtype transformers_version max_window_layers sliding_window
use_sliding_window layer_types norm_topk_prob output_router_logits router_aux_loss_coef
router_jitter_noise auto_map aux_loss_alpha seq_aux ep_size n_group topk_group
routed_scaling_factor rope_interleave quantization_config swiglu_limit initial_context_length
""".split())


@dataclass(frozen=True, slots=True)
class HFModel:
    """A spec ``model`` mapping read from a config.json, and the keys that were not read."""

    model: dict[str, Any]
    unknown: tuple[str, ...] = ()


def model_from_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The spec ``model`` mapping (Megatron argument names) of a HuggingFace config.json.

    Raises:
        SpecError: an unknown architecture or a setting Megatron's GPT layers do not build, in
            one line naming the config key (``config.<key>``).

    Example:
        >>> cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        ...        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        ...        "num_key_value_heads": 2, "vocab_size": 1000}
        >>> model_from_hf_config(cfg)["num_query_groups"]
        2
    """
    return read_hf_config(config).model


def read_hf_config(config: Mapping[str, Any]) -> HFModel:
    """``model_from_hf_config`` plus the keys in neither ``HF_MAPPED`` nor ``HF_IGNORED``."""
    if not isinstance(config, Mapping):
        raise SpecError("config", "a HuggingFace config must be a JSON object",
                        type(config).__name__)
    arch = _architecture(config)
    model_type, moe, qk_norm = ARCHITECTURES[arch]
    if config.get("hidden_act", "silu") != "silu":
        raise SpecError("config.hidden_act", "is not supported by DynaTrain yet (only silu: "
                        "SwiGLU)", config.get("hidden_act"))
    heads = _positive(config, "num_attention_heads")
    hidden = _positive(config, "hidden_size")
    head_dim = config.get("head_dim")
    model: dict[str, Any] = dict(
        num_layers=_positive(config, "num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=_positive(config, "intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=_positive(config, "num_key_value_heads", heads),
        kv_channels=hidden // heads if head_dim is None else _positive(config, "head_dim"),
        vocab_size=_positive(config, "vocab_size"),
        max_position_embeddings=_positive(config, "max_position_embeddings", 4096),
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        untie_embeddings_and_output_weights=not _flag(config, "tie_word_embeddings"),
        add_bias_linear=_biases(config, arch),
        qk_layernorm=qk_norm,
    )
    if moe == "deepseek":
        _deepseek(config, model)
    elif moe == "gpt_oss":
        topk = "num_experts_per_tok" if "num_experts_per_tok" in config else "experts_per_token"
        model.update(num_moe_experts=_positive(config, "num_local_experts"),
                     moe_router_topk=_positive(config, topk),
                     moe_ffn_hidden_size=model["ffn_hidden_size"], softmax_type="learnable",
                     transformer_impl="transformer_engine", moe_grouped_gemm=True)
    if head_dim is None and hidden % heads and not model.get("multi_latent_attention"):
        raise SpecError("config.hidden_size", f"must be divisible by num_attention_heads="
                        f"{heads} (or set head_dim)", hidden)
    if moe == "mixtral":
        model.update(num_moe_experts=_positive(config, "num_local_experts"),
                     moe_router_topk=_positive(config, "num_experts_per_tok"),
                     moe_ffn_hidden_size=model["ffn_hidden_size"])
    elif moe == "qwen3_moe" and config.get("num_experts", 0):
        model.update(num_moe_experts=_positive(config, "num_experts"),
                     moe_router_topk=_positive(config, "num_experts_per_tok"),
                     moe_ffn_hidden_size=_positive(config, "moe_intermediate_size"))
        pattern = _qwen3_moe_layers(config, model["num_layers"])
        model["moe_layer_freq"] = 1 if all(pattern) else pattern
    unknown = tuple(sorted(str(k) for k in config if k not in HF_MAPPED and k not in HF_IGNORED))
    return HFModel(model, unknown)


def spec_from_hf_config(config: Mapping[str, Any], parallel: Mapping[str, Any],
                        world: Mapping[str, Any], *, name: str | None = None,
                        state: Mapping[str, Any] | None = None) -> LayoutSpec:
    """A validated spec: the model of ``config`` plus a spec's ``parallel``/``world``/``state``."""
    doc: dict[str, Any] = {"model": model_from_hf_config(config), "parallel": dict(parallel),
                           "world": dict(world)}
    if name is not None:
        doc["name"] = name
    if state is not None:
        doc["state"] = dict(state)
    return spec_from_dict(doc)


def read_json_object(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """The JSON object in file ``path``: a HuggingFace config.json or Megatron-LM's args dump
    (``dynatrain spec --from-hf/--from-args``); ``what`` says what its keys are.

    Read at most ``MAX_CONFIG_BYTES`` and without waiting on a pipe nobody writes
    (``read_bounded``): ``/dev/zero`` or a FIFO is refused or read as empty, never read forever.

    Raises:
        SpecError: one line naming the file: unreadable, too large, not JSON, not an object.
    """
    name = os.fspath(path)
    try:
        data = read_bounded(path, MAX_CONFIG_BYTES)
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        raise SpecError(name, f"cannot read ({getattr(err, 'strerror', None) or err})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise SpecError(name, f"must be at most {MAX_CONFIG_BYTES >> 20} MiB (a config or "
                        "argument dump is a few KiB)")
    return json_object(data, name, what)


def parse_assignments(text: str, field: str) -> dict[str, Any]:
    """``"tp=8,pp=4,overlap_grad_reduce=true"`` as a mapping (ints and booleans converted).

    ``field`` names the option in the one-line ``SpecError`` for a malformed entry.
    """
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise SpecError(field, "entries look like key=value, separated by commas", item)
        if key in out:
            raise SpecError(f"{field}.{key}", "is given twice", value)
        low = value.lower()
        out[key] = (True if low == "true" else False if low == "false"
                    # ASCII digits only: str.isdigit() also takes '²', which int() refuses.
                    else int(value) if re.fullmatch(r"-?[0-9]{1,18}", value) else value)
    return out


def _deepseek(config: Mapping[str, Any], model: dict[str, Any]) -> None:
    """DeepSeek-V2/V3 (and Kimi-K2): MLA with its q/kv norms, shared experts, the first
    ``first_k_dense_replace`` layers dense, sigmoid scores with a bias for ``noaux_tc`` routing
    (its ``e_score_correction_bias``), and ``num_nextn_predict_layers`` MTP layers."""
    if model["add_bias_linear"]:
        raise SpecError("config.attention_bias", "is not supported by DynaTrain yet (megatron's "
                        "MLA projections have no biases)", True)
    q_lora = config.get("q_lora_rank")
    model.update(
        multi_latent_attention=True, transformer_impl="transformer_engine",
        q_lora_rank=None if q_lora is None else _positive(config, "q_lora_rank"),
        kv_lora_rank=_positive(config, "kv_lora_rank"),
        qk_head_dim=_positive(config, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=_positive(config, "qk_rope_head_dim"),
        v_head_dim=_positive(config, "v_head_dim"))
    del model["kv_channels"], model["num_query_groups"]  # MLA has its own head sizes
    if config.get("n_routed_experts") is None:
        return
    n, shared = model["num_layers"], config.get("n_shared_experts") or 0
    moe_ffn = _positive(config, "moe_intermediate_size")
    first = config.get("first_k_dense_replace", 0)
    freq = _positive(config, "moe_layer_freq", 1)
    if type(first) is not int or not 0 <= first < n:
        raise SpecError("config.first_k_dense_replace", f"must be an integer in [0, {n})", first)
    # HF's rule: layer i is sparse when i >= first_k_dense_replace and i % moe_layer_freq == 0.
    pattern = [int(i >= first and i % freq == 0) for i in range(n)]
    scoring = config.get("scoring_func", "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise SpecError("config.scoring_func", "must be softmax or sigmoid", scoring)
    mtp = config.get("num_nextn_predict_layers") or 0
    if type(mtp) is not int or mtp < 0:
        raise SpecError("config.num_nextn_predict_layers", "must be a non-negative integer", mtp)
    model.update(
        num_moe_experts=_positive(config, "n_routed_experts"),
        moe_router_topk=_positive(config, "num_experts_per_tok"), moe_ffn_hidden_size=moe_ffn,
        moe_router_score_function=scoring,
        moe_router_enable_expert_bias=config.get("topk_method") == "noaux_tc",
        moe_grouped_gemm=True)
    if freq == 1:  # dense then sparse: Megatron's own way to say it
        model.update(moe_layer_freq=1, moe_first_dense_layers=first)
    else:
        model["moe_layer_freq"] = pattern
    if shared:
        if type(shared) is not int or shared < 0:
            raise SpecError("config.n_shared_experts", "must be a non-negative integer", shared)
        model["moe_shared_expert_intermediate_size"] = shared * moe_ffn
    if mtp:
        model["mtp_num_layers"] = mtp


def _architecture(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures")
    if archs is None:  # older configs: fall back on model_type
        model_type = config.get("model_type")
        if model_type is None:
            raise SpecError("config.architectures", "is required (or model_type); known: "
                            + ", ".join(ARCHITECTURES))
        if not isinstance(model_type, str):  # a list or object is no dict key to look up
            raise SpecError("config.model_type", "must be a string such as llama", model_type)
        by_type = {t: a for a, (t, _, _) in ARCHITECTURES.items()}
        if model_type in by_type:
            return by_type[model_type]
        archs = [model_type]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise SpecError("config.architectures", "must be a list of class names such as "
                        '["LlamaForCausalLM"]', archs)
    if len(archs) == 1 and archs[0] in REFUSED:
        raise SpecError("config.architectures", f"{archs[0]} is not supported by DynaTrain: "
                        f"{REFUSED[archs[0]]}", archs)
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise SpecError("config.architectures", "is not supported by DynaTrain yet; known: "
                        + ", ".join(ARCHITECTURES), archs)
    return archs[0]


def _positive(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None and default is not None:
        value = default
    if type(value) is not int or value < 1:
        raise SpecError(f"config.{key}", "must be a positive integer", value)
    return value


def _flag(config: Mapping[str, Any], key: str) -> bool:
    value = config.get(key, False)
    if not isinstance(value, bool):
        raise SpecError(f"config.{key}", "must be true or false", value)
    return value


def _biases(config: Mapping[str, Any], arch: str) -> bool:
    """Megatron's add_bias_linear covers QKV, output projection and both MLP linears at once."""
    attn = _flag(config, "attention_bias")
    mlp = _flag(config, "mlp_bias") if arch == "LlamaForCausalLM" else attn
    if attn != mlp:
        raise SpecError("config.attention_bias", "is not supported by DynaTrain yet (attention "
                        "and MLP biases must be both on or both off)", attn)
    return attn


def _qwen3_moe_layers(config: Mapping[str, Any], n: int) -> tuple[int, ...]:
    """HF's rule: layer i is sparse unless listed in mlp_only_layers, every step-th layer."""
    step = _positive(config, "decoder_sparse_step", 1)
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(type(i) is int for i in dense):
        raise SpecError("config.mlp_only_layers", "must be a list of layer indexes", dense)
    return tuple(int(i not in dense and (i + 1) % step == 0) for i in range(n))
