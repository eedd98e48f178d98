"""The parameters megatron-core's GPT model builds on one pipeline chunk.

For a chunk (pipeline rank, virtual chunk) and an expert-parallel rank, ``chunk_params`` lists
every parameter in ``named_parameters()`` order with its checkpoint key, full shape and how tensor
parallelism splits it. That order matters: the DDP buffers place parameters in reverse of it.

Two layer specs (``model.transformer_impl``), with the same shapes, splits and (but one) keys:

* ``local``: ``input_layernorm``, attention (``linear_proj`` before ``linear_qkv``: attention
  builds core attention and the output projection first, M16 transformer/attention.py:318,349),
  ``pre_mlp_layernorm``, MLP; the norms' checkpoint keys are mapped onto the fused TE names
  (M16 models/gpt/gpt_layer_specs.py:416-420).
* ``transformer_engine``: the input norm lives in ``linear_qkv`` (TE LayerNormLinear registers
  ``layer_norm_weight``, ``layer_norm_bias`` before ``weight``, ``bias``; TE
  module/layernorm_linear.py:1449-1571), so it comes *after* ``linear_proj``; a dense layer's
  pre-MLP norm likewise opens ``linear_fc1``. A MoE layer keeps a TENorm ``pre_mlp_layernorm``
  whose key is its own, ``pre_mlp_layernorm.weight`` (the local spec saves it as
  ``mlp.linear_fc1.layer_norm_weight``). With ``moe_grouped_gemm`` the experts are TE
  GroupedLinear: ``linear_fc1.weight0``, ``bias0``, ``weight1`` ... interleaved (TE
  module/grouped_linear.py:1738-1770), saved under the SequentialMLP keys, one expert index
  each (M16 extensions/transformer_engine.py:1738-1799). Core attention holds no parameter
  (vanilla softmax). ``parallel.sequence_parallel`` only sets TP attributes, so it is no input.

Newer attention and heads: multi-latent attention (TE only; its own input norm, whole down
projections, norms fused into the up projections, ``mla_modules``); attention sinks (a per-head
``softmax_offset`` registered before ``linear_proj``); MTP layers after the final norm of the
last stage, each a norm pair, ``eh_proj``, one transformer layer and a final norm, with that
stage's own embedding copy. Where versions differ, ``versions.Series`` says how.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from .spec import ModelConfig
from .versions import series


@dataclass(frozen=True, slots=True)
class TPSplit:
    """How a tensor-parallel group splits a parameter.

    ``glu``: the parameter is ``[gate; up]`` along dim 0 and TP rank r holds ``[gate_r; up_r]``.
    ``vocab``: dim 0 runs over the padded vocabulary; rows at or past the real vocab are padding.
    """

    dim: int
    group: str  # "tp" (dense) or "etp" (experts)
    glu: bool = False
    vocab: bool = False


@dataclass(frozen=True, slots=True)
class ParamDef:
    """One model parameter of a chunk, before tensor-parallel splitting."""

    name: str  # named_parameters() name inside the chunk's GPTModel
    key: str  # megatron-core checkpoint key (the logical tensor's name)
    shape: tuple[int, ...]  # TP-unsplit shape (vocab padded), without prepended axes
    prepend: tuple[tuple[int, int], ...] = ()  # (index, size) of leading layer/expert axes
    split: TPSplit | None = None
    expert: bool = False  # an expert weight (EP/ETP grid)
    tied_copy: bool = False  # the last stage's copy of a tied embedding
    shared_embedding: bool = False


@dataclass(frozen=True, slots=True)
class BufferDef:
    """A persistent non-parameter buffer that is training state (router expert_bias)."""

    name: str
    key: str
    shape: tuple[int, ...]
    prepend: tuple[tuple[int, int], ...] = ()
    # One of a TE module's delayed-scaling tensors, held in ``fp8_meta`` (not a registered
    # buffer): ``name`` is then ``<module>._extra_state.<tensor>`` (FP8_META_TENSORS).
    fp8_meta: bool = False


# A TE module's delayed-scaling state: scales and amax histories of its 3 forward (input,
# weight, output) and 2 backward (output gradient, input gradient) fp8 tensors per GEMM,
# saved in its ``_extra_state`` (TE module/base.py:1106-1175, 1354-1417).
FP8_META_TENSORS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")


def fp8_meta_buffers(m: ModelConfig, name: str, key: str, pre: tuple) -> list[BufferDef]:
    """The delayed-scaling tensors of TE GEMM module ``name`` (one GEMM: dense modules only,
    the rules refuse delayed scaling with experts), replicated like the module's bias."""
    L = m.fp8_amax_history_len
    shapes = {"scale_fwd": (3,), "amax_history_fwd": (L, 3), "scale_bwd": (2,),
              "amax_history_bwd": (L, 2)}
    return [BufferDef(f"{name}._extra_state.{t}", f"{key}._extra_state.{t}", shapes[t], pre,
                      fp8_meta=True) for t in FP8_META_TENSORS]


def padded_vocab(m: ModelConfig, tp: int) -> int:
    """Megatron's vocab padding: round up to a multiple of make_vocab_size_divisible_by * tp."""
    mult = m.make_vocab_size_divisible_by * tp
    return -(-m.vocab_size // mult) * mult


@lru_cache(maxsize=4096)
def chunk_params(
    m: ModelConfig, tp: int, ep: int, ep_rank: int, layers: tuple[int, ...],
    pre: bool, post: bool, pipelined: bool, *, megatron_core: str,
) -> tuple[tuple[ParamDef, ...], tuple[BufferDef, ...]]:
    """Parameters and state buffers of one chunk, in ``named_parameters()`` order.

    ``pipelined``: pp > 1, so a tied embedding is shared between the first and last stage.
    ``megatron_core``: the version that builds it (a few modules differ, ``versions.py``).
    """
    params: list[ParamDef] = []
    buffers: list[BufferDef] = []
    H, vp = m.hidden_size, padded_vocab(m, tp)
    vocab_split = TPSplit(0, "tp", vocab=True)
    tied = not m.untie_embeddings_and_output_weights
    # The MTP layers sit on the last stage (the rules refuse them elsewhere), which then builds
    # an embedding of its own, kept equal to the first stage's like a tied output layer (M16
    # models/gpt/gpt_model.py:147-160, language_module.py:186-221).
    mtp = post and bool(m.mtp_num_layers)
    if pre or mtp:
        params.append(ParamDef("embedding.word_embeddings.weight",
                               "embedding.word_embeddings.weight", (vp, H), split=vocab_split,
                               tied_copy=not pre,
                               shared_embedding=pipelined and (tied or bool(m.mtp_num_layers))))
        if m.position_embedding_type == "learned_absolute":
            params.append(ParamDef("embedding.position_embeddings.weight",
                                   "embedding.position_embeddings.weight",
                                   (m.max_position_embeddings, H)))
    moe = m.moe_pattern()
    ver = series(megatron_core)
    for local, layer in enumerate(layers):
        _layer(params, buffers, m, ep, ep_rank, f"decoder.layers.{local}",
               *_layer_key(m, layer), moe[layer], ver.mla_q_proj_norm)
    if has_final_norm(m, layers, post):
        params.extend(_norm(m, "decoder.final_layernorm", "decoder.final_layernorm", (), H))
    for k in range(m.mtp_num_layers if mtp else 0):
        _mtp_layer(params, buffers, m, ep, ep_rank, k, ver)
    if post and (not tied or not pre):
        key = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
        params.append(ParamDef("output_layer.weight", key, (vp, H), split=vocab_split,
                               tied_copy=tied, shared_embedding=tied))
    return tuple(params), tuple(buffers)


def _norm(m: ModelConfig, name: str, key: str, pre: tuple, size: int) -> list[ParamDef]:
    out = [ParamDef(f"{name}.weight", f"{key}_weight" if key.endswith("layer_norm") else
                    f"{key}.weight", (size,), pre)]
    if m.normalization == "LayerNorm":
        out.append(ParamDef(f"{name}.bias", f"{key}_bias" if key.endswith("layer_norm") else
                            f"{key}.bias", (size,), pre))
    return out


def _fused_norm(m: ModelConfig, name: str, key: str, pre: tuple, size: int) -> list[ParamDef]:
    """A norm fused into TE LayerNormLinear ``name`` (weight, then bias for LayerNorm)."""
    kinds = ("weight", "bias") if m.normalization == "LayerNorm" else ("weight",)
    return [ParamDef(f"{name}.layer_norm_{k}", f"{key}.layer_norm_{k}", (size,), pre)
            for k in kinds]


def _linear(name: str, key: str, out_f: int, in_f: int, pre: tuple, split: TPSplit | None,
            bias: bool, bias_split: bool, expert: bool = False) -> list[ParamDef]:
    w = ParamDef(f"{name}.weight", f"{key}.weight", (out_f, in_f), pre, split, expert)
    if not bias:
        return [w]
    b_split = TPSplit(0, split.group, glu=split.glu) if (bias_split and split) else None
    return [w, ParamDef(f"{name}.bias", f"{key}.bias", (out_f,), pre, b_split, expert)]


def has_final_norm(m: ModelConfig, layers: tuple[int, ...], post: bool) -> bool:
    """Whether a chunk builds the decoder's final norm: the last stage does; with MTP, the chunk
    holding the last decoder layer, wherever it is (M16 transformer/transformer_block.py:
    390-417)."""
    return (m.num_layers - 1) in layers if m.mtp_num_layers else post


def _layer_key(m: ModelConfig, layer: int) -> tuple[str, tuple]:
    """Decoder layer ``layer``'s checkpoint key and leading layer axis (stacked or not)."""
    if m.homogeneous_layers:
        return "decoder.layers", ((layer, m.num_layers),)
    return f"decoder.layers.{layer}", ()


def mtp_inner_moe(m: ModelConfig) -> bool:
    """Whether an MTP layer's transformer layer is an MoE layer: Megatron-LM gives it the spec
    of the model's last decoder layer (MT19 training/models/gpt.py:387-412). (Its MoE spec for
    an MTP stage without decoder layers differs only where the rules refuse the layout.)"""
    return bool(m.num_moe_experts) and m.moe_pattern()[-1]


def _mtp_layer(params: list[ParamDef], buffers: list[BufferDef], m: ModelConfig, ep: int,
               ep_rank: int, k: int, ver) -> None:
    """MTP layer ``k``: norms of the embedding and of the hidden state, their joint projection,
    one transformer layer and a final norm, each under its own, never stacked, key (M16
    transformer/multi_token_prediction.py:632-678, 1151-1162). 0.19 names the inner layer
    ``mtp_model_layer`` and saves it as ``transformer_layer`` (M19 multi_token_prediction.py:
    1555-1558)."""
    H, name, key = m.hidden_size, f"mtp.layers.{k}", f"mtp.layers.{k}"
    params += _norm(m, f"{name}.enorm", f"{key}.enorm", (), H)
    params += _norm(m, f"{name}.hnorm", f"{key}.hnorm", (), H)
    params += _linear(f"{name}.eh_proj", f"{key}.eh_proj", H, 2 * H, (), TPSplit(0, "tp"),
                      False, False)
    _layer(params, buffers, m, ep, ep_rank, f"{name}.{ver.mtp_inner_name}",
           f"{key}.transformer_layer", (), mtp_inner_moe(m),
           ver.mla_q_proj_norm)
    params += _norm(m, f"{name}.final_layernorm", f"{key}.final_layernorm", (), H)


def _layer(params: list[ParamDef], buffers: list[BufferDef], m: ModelConfig, ep: int,
           ep_rank: int, name: str, key: str, pre: tuple, is_moe: bool, q_norm: bool) -> None:
    """One transformer layer named ``name`` under checkpoint key ``key`` (``pre``: its
    leading layer axis when layers are stacked)."""
    H = m.hidden_size
    bias = m.add_bias_linear
    row = TPSplit(1, "tp")
    te = m.transformer_impl == "transformer_engine"
    if m.multi_latent_attention:
        _mla(params, m, name, key, pre, q_norm)
    else:
        _attention(params, m, name, key, pre)
    if not te:
        params += _norm(m, f"{name}.pre_mlp_layernorm", f"{key}.mlp.linear_fc1.layer_norm",
                        pre, H)
    elif is_moe:
        params += _norm(m, f"{name}.pre_mlp_layernorm", f"{key}.pre_mlp_layernorm", pre, H)
    else:
        params += _fused_norm(m, f"{name}.mlp.linear_fc1", f"{key}.mlp.linear_fc1", pre, H)
    glu = TPSplit(0, "tp", glu=m.swiglu)
    fc1_out = 2 if m.swiglu else 1
    if not is_moe:
        params += _linear(f"{name}.mlp.linear_fc1", f"{key}.mlp.linear_fc1", fc1_out * m.ffn, H,
                          pre, glu, bias, True)
        params += _linear(f"{name}.mlp.linear_fc2", f"{key}.mlp.linear_fc2", H, m.ffn, pre, row,
                          bias, False)
        if te and m.fp8_delayed:
            for mod in _gemm_modules(m, q_norm):
                buffers += fp8_meta_buffers(m, f"{name}.{mod}", f"{key}.{mod}", pre)
        return
    E = m.num_moe_experts or 0
    params += _linear(f"{name}.mlp.router", f"{key}.mlp.router", E, H, pre, None, bias, False)
    if m.moe_router_enable_expert_bias:
        buffers.append(BufferDef(f"{name}.mlp.router.expert_bias",
                                 f"{key}.mlp.router.expert_bias", (E,), pre))
    per_rank = E // ep
    e_glu, e_row = TPSplit(0, "etp", glu=m.swiglu), TPSplit(1, "etp")
    ekey = f"{key}.mlp.experts.experts"
    if m.moe_grouped_gemm:  # TEGroupedMLP: one GroupedLinear per projection
        for fc, out_f, in_f, split, b_split in (
                ("linear_fc1", fc1_out * m.moe_ffn, H, e_glu, True),
                ("linear_fc2", H, m.moe_ffn, e_row, False)):
            for j in range(per_rank):
                epre = pre + ((ep_rank * per_rank + j, E),)
                for p in _linear(f"{name}.mlp.experts.{fc}", f"{ekey}.{fc}", out_f, in_f, epre,
                                 split, bias, b_split, expert=True):
                    params.append(replace(p, name=f"{p.name}{j}"))
    for j in range(0 if m.moe_grouped_gemm else per_rank):
        epre = pre + ((ep_rank * per_rank + j, E),)
        ename = f"{name}.mlp.experts.local_experts.{j}"
        params += _linear(f"{ename}.linear_fc1", f"{ekey}.linear_fc1", fc1_out * m.moe_ffn, H,
                          epre, e_glu, bias, True, expert=True)
        params += _linear(f"{ename}.linear_fc2", f"{ekey}.linear_fc2", H, m.moe_ffn, epre, e_row,
                          bias, False, expert=True)
    if m.moe_shared_expert_intermediate_size:
        fs = m.moe_shared_expert_intermediate_size
        sname, skey = f"{name}.mlp.shared_experts", f"{key}.mlp.shared_experts"
        if m.moe_shared_expert_gate:
            params.append(ParamDef(f"{sname}.gate_weight", f"{skey}.gate_weight", (1, H), pre))
        params += _linear(f"{sname}.linear_fc1", f"{skey}.linear_fc1", fc1_out * fs, H, pre,
                          glu, False, True)
        params += _linear(f"{sname}.linear_fc2", f"{skey}.linear_fc2", H, fs, pre, row, False,
                          False)


def _gemm_modules(m: ModelConfig, q_norm: bool) -> list[str]:
    """A dense TE layer's GEMM modules, in build order (each keeps fp8 state)."""
    attn = [proj for proj, _ in mla_modules(m, q_norm)] if m.multi_latent_attention \
        else ["linear_qkv"]
    return ["self_attention.linear_proj", *(f"self_attention.{a}" for a in attn),
            "mlp.linear_fc1", "mlp.linear_fc2"]


def _softmax_offset(params: list[ParamDef], m: ModelConfig, name: str, key: str,
                    pre: tuple) -> None:
    """Attention sinks: core attention registers a per-head ``softmax_offset`` before the
    output projection is built, split over TP by head (M16 transformer/
    dot_product_attention.py:118-140, 250-270; TE extensions/transformer_engine.py:1436-1455)."""
    if m.softmax_type == "learnable":
        params.append(ParamDef(f"{name}.self_attention.core_attention.softmax_offset",
                               f"{key}.self_attention.core_attention.softmax_offset",
                               (m.num_attention_heads,), pre, TPSplit(0, "tp")))


def _attention(params: list[ParamDef], m: ModelConfig, name: str, key: str, pre: tuple) -> None:
    """Self-attention with one fused QKV projection (and its input norm)."""
    H, hn, np_, ng = m.hidden_size, m.head_dim, m.num_attention_heads, m.groups
    bias, col, row = m.add_bias_linear, TPSplit(0, "tp"), TPSplit(1, "tp")
    te = m.transformer_impl == "transformer_engine"
    if not te:
        params += _norm(m, f"{name}.input_layernorm",
                        f"{key}.self_attention.linear_qkv.layer_norm", pre, H)
    _softmax_offset(params, m, name, key, pre)
    params += _linear(f"{name}.self_attention.linear_proj", f"{key}.self_attention.linear_proj",
                      H, np_ * hn, pre, row, bias, False)
    if te:
        params += _fused_norm(m, f"{name}.self_attention.linear_qkv",
                              f"{key}.self_attention.linear_qkv", pre, H)
    params += _linear(f"{name}.self_attention.linear_qkv", f"{key}.self_attention.linear_qkv",
                      ng * (np_ // ng + 2) * hn, H, pre, col, bias, True)
    if m.qk_layernorm:
        for qk in ("q_layernorm", "k_layernorm"):
            params += _norm(m, f"{name}.self_attention.{qk}", f"{key}.self_attention.{qk}",
                            pre, hn)


def mla_modules(m: ModelConfig, q_norm: bool) -> tuple[tuple[str, int | None], ...]:
    """The projections of TE multi-latent attention after ``linear_proj``, in build order, each
    with the size of the norm fused into it (None: no norm).

    The down projections are TE ``Linear`` in ``duplicated`` mode: whole on every TP rank (M16
    transformer/multi_latent_attention.py:406-480). With ``qk_layernorm`` the q/kv norms are
    fused into the up projections (M16 models/gpt/gpt_layer_specs.py:233-244); ``q_norm``: the
    version also fuses one into ``linear_q_proj`` (``versions.Series.mla_q_proj_norm``).
    """
    qkn = m.qk_layernorm
    if m.q_lora_rank is None:
        q = (("linear_q_proj", m.hidden_size if qkn and q_norm else None),)
    else:
        q = (("linear_q_down_proj", None), ("linear_q_up_proj", m.q_lora_rank if qkn else None))
    return (*q, ("linear_kv_down_proj", None),
            ("linear_kv_up_proj", m.kv_lora_rank if qkn else None))


def _mla(params: list[ParamDef], m: ModelConfig, name: str, key: str, pre: tuple,
         q_norm: bool) -> None:
    """Multi-latent attention with Transformer Engine layers (megatron-core's local core
    attention cannot build it: it takes no separate key/value head sizes). The input norm is
    a TENorm of its own, built before self-attention (M16 gpt_layer_specs.py:245-262)."""
    H, heads = m.hidden_size, m.num_attention_heads
    col, row = TPSplit(0, "tp"), TPSplit(1, "tp")
    params += _norm(m, f"{name}.input_layernorm", f"{key}.input_layernorm", pre, H)
    _softmax_offset(params, m, name, key, pre)
    params += _linear(f"{name}.self_attention.linear_proj", f"{key}.self_attention.linear_proj",
                      H, heads * m.v_head_dim, pre, row, m.add_bias_linear, False)
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    shapes = {"linear_q_proj": (heads * q_head, H, col),
              "linear_q_down_proj": (m.q_lora_rank, H, None),
              "linear_q_up_proj": (heads * q_head, m.q_lora_rank, col),
              "linear_kv_down_proj": (m.kv_lora_rank + m.qk_pos_emb_head_dim, H, None),
              "linear_kv_up_proj": (heads * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank,
                                    col)}
    for proj, norm in mla_modules(m, q_norm):
        pname, pkey = f"{name}.self_attention.{proj}", f"{key}.self_attention.{proj}"
        if norm is not None:
            params += _fused_norm(m, pname, pkey, pre, norm)
        out_f, in_f, split = shapes[proj]
        params += _linear(pname, pkey, out_f, in_f, pre, split, False, False)


@dataclass(frozen=True, slots=True)
class ExtraStateDef:
    """A Transformer Engine module's ``_extra_state``: one checkpoint ShardedObject.

    Its global shape and offset are the layer (and expert) grid position, ``(1,)``/``(0,)``
    without one (M16 transformer/utils.py:151-191); with fp8 off its data is an empty uint8
    tensor (TE module/base.py:1385-1389, ops/op.py:702-703).
    """

    key: str
    prepend: tuple[tuple[int, int], ...] = ()
    expert: bool = False


@lru_cache(maxsize=4096)
def chunk_extra_states(m: ModelConfig, ep: int, ep_rank: int, layers: tuple[int, ...],
                       post: bool, *, megatron_core: str) -> tuple[ExtraStateDef, ...]:
    """The ``_extra_state`` objects of one chunk's TE modules (none for the local spec).

    Every TE linear and TENorm has one; core attention only with a learnable softmax, whose
    state dict it then saves whole (M16 extensions/transformer_engine.py:1436-1455), and the
    embedding and output layer are not TE modules. Each GEMM of a grouped linear saves its
    own, under the linear's key.
    """
    if m.transformer_impl != "transformer_engine":
        return ()
    out: list[ExtraStateDef] = []
    moe = m.moe_pattern()
    ver = series(megatron_core)
    for layer in layers:
        out += _layer_extra_states(m, ep, ep_rank, *_layer_key(m, layer), moe[layer],
                                   ver.mla_q_proj_norm)
    if has_final_norm(m, layers, post):
        out.append(ExtraStateDef("decoder.final_layernorm._extra_state"))
    if post:
        for k in range(m.mtp_num_layers or 0):  # in MTP layer order: norms, projection, layer
            key = f"mtp.layers.{k}"
            out += [ExtraStateDef(f"{key}.{mod}._extra_state")
                    for mod in ("enorm", "hnorm", "eh_proj")]
            inner = _layer_extra_states(m, ep, ep_rank, f"{key}.transformer_layer", (),
                                        mtp_inner_moe(m), ver.mla_q_proj_norm)
            core = ExtraStateDef(f"{key}.transformer_layer.self_attention.core_attention"
                                 "._extra_state")
            if ver.mtp_core_attention_extra_state and core not in inner:
                inner.insert(0, core)
            out += inner
            out.append(ExtraStateDef(f"{key}.final_layernorm._extra_state"))
    return tuple(out)


def _layer_extra_states(m: ModelConfig, ep: int, ep_rank: int, key: str, pre: tuple,
                        is_moe: bool, q_norm: bool) -> list[ExtraStateDef]:
    """The ``_extra_state`` objects of one TE transformer layer under checkpoint key ``key``."""
    mods = ["input_layernorm"] if m.multi_latent_attention else []
    if m.softmax_type == "learnable":
        mods.append("self_attention.core_attention")
    mods.append("self_attention.linear_proj")
    if m.multi_latent_attention:
        mods += [f"self_attention.{proj}" for proj, _ in mla_modules(m, q_norm)]
    else:
        mods.append("self_attention.linear_qkv")
        if m.qk_layernorm:
            mods += ["self_attention.q_layernorm", "self_attention.k_layernorm"]
    mods += ["pre_mlp_layernorm"] if is_moe else ["mlp.linear_fc1", "mlp.linear_fc2"]
    out = [ExtraStateDef(f"{key}.{mod}._extra_state", pre) for mod in mods]
    if not is_moe:
        return out
    E = m.num_moe_experts or 0
    per_rank = E // ep
    for fc in ("linear_fc1", "linear_fc2"):
        for j in range(per_rank):
            out.append(ExtraStateDef(f"{key}.mlp.experts.experts.{fc}._extra_state",
                                     pre + ((ep_rank * per_rank + j, E),), expert=True))
    if m.moe_shared_expert_intermediate_size:
        out += [ExtraStateDef(f"{key}.mlp.shared_experts.{fc}._extra_state", pre)
                for fc in ("linear_fc1", "linear_fc2")]
    return out
