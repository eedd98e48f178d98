"""Layout specs: the YAML a user writes (model + parallel config + world + state), validated.

Field names follow Megatron's arguments; ``parallel`` also takes the short aliases tp, pp, vpp, cp,
ep and etp. Structural problems (unknown field, wrong type) come from pydantic; the rules that
megatron-core enforces (divisibility, supported combinations) are checked in ``rules.py``. Either
way the caller sees one ``SpecError`` naming the field, the rule and the value.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from . import versions
from .pipeline import LayoutParseError, parse_layout

PositiveInt = Annotated[StrictInt, Field(ge=1, le=1 << 40)]
NonNegInt = Annotated[StrictInt, Field(ge=0, le=1 << 40)]
DEVICE_ID = re.compile(r"^node([0-9]{1,6}):gpu([0-9]{1,4})\Z")  # ASCII digits only


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ModelConfig(_Strict):
    """A GPT architecture in Megatron's argument names (local or Transformer Engine layers)."""

    num_layers: Annotated[StrictInt, Field(ge=1, le=10_000)]  # per-layer tables stay small
    hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    ffn_hidden_size: PositiveInt | None = None  # default 4*hidden, as Megatron
    num_query_groups: PositiveInt | None = None  # default: no GQA
    kv_channels: PositiveInt | None = None  # default hidden/heads
    vocab_size: PositiveInt
    make_vocab_size_divisible_by: PositiveInt = 128
    max_position_embeddings: PositiveInt = 4096
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    swiglu: StrictBool = False
    untie_embeddings_and_output_weights: StrictBool = False
    add_bias_linear: StrictBool = False
    qk_layernorm: StrictBool = False
    # Multi-latent attention (DeepSeek-V2/V3, Kimi-K2); defaults are Megatron-LM's arguments.
    multi_latent_attention: StrictBool = False
    q_lora_rank: PositiveInt | None = None  # None: one linear_q_proj, no q down/up projection
    kv_lora_rank: PositiveInt = 32
    qk_head_dim: PositiveInt = 128
    qk_pos_emb_head_dim: PositiveInt = 64
    v_head_dim: PositiveInt = 128
    # "learnable": attention sinks, a per-head softmax_offset parameter (GPT-OSS).
    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = "vanilla"
    # Multi-token prediction layers on the last pipeline stage (DeepSeek-V3: 1).
    mtp_num_layers: Annotated[StrictInt, Field(ge=0, le=10_000)] | None = None
    num_moe_experts: Annotated[StrictInt, Field(ge=1, le=16_384)] | None = None
    moe_ffn_hidden_size: PositiveInt | None = None
    moe_router_topk: PositiveInt = 2
    moe_shared_expert_intermediate_size: PositiveInt | None = None
    moe_shared_expert_gate: StrictBool = False
    moe_layer_freq: PositiveInt | tuple[Annotated[StrictInt, Field(ge=0, le=1)], ...] = 1
    moe_first_dense_layers: NonNegInt = 0  # convenience: the first k layers are dense
    moe_router_enable_expert_bias: StrictBool = False
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    # Megatron's --transformer-impl: "local" (megatron's own modules; the default here) or
    # "transformer_engine" (TE modules: norms fused into linear_qkv/linear_fc1, see model.py).
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    moe_grouped_gemm: StrictBool = False  # TE GroupedLinear experts (weight0..N-1)
    # fp8 training (Megatron-LM's --fp8-format, --fp8-recipe, --fp8-amax-history-len; TE only).
    # Delayed scaling keeps per-module scales and amax histories (training state, carried);
    # the other recipes keep none (docs/spec.md).
    fp8: Literal["e4m3", "hybrid"] | None = None
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "delayed"
    fp8_amax_history_len: Annotated[StrictInt, Field(ge=1, le=100_000)] = 1

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn

    def moe_pattern(self) -> tuple[bool, ...]:
        """Which layers are MoE layers (Megatron's moe_layer_freq semantics)."""
        n = self.num_layers
        if not self.num_moe_experts:
            return (False,) * n
        if isinstance(self.moe_layer_freq, tuple):
            pattern = tuple(bool(x) for x in self.moe_layer_freq)
        else:
            pattern = tuple(i % self.moe_layer_freq == 0 for i in range(n))
        k = self.moe_first_dense_layers
        return tuple(False if i < k else p for i, p in enumerate(pattern))

    @property
    def fp8_delayed(self) -> bool:
        """Delayed-scaling fp8: every TE GEMM module keeps scales and amax histories."""
        return self.fp8 is not None and self.fp8_recipe == "delayed"

    @property
    def homogeneous_layers(self) -> bool:
        """True when the checkpoint stacks layers on a leading axis (Megatron's rule)."""
        if isinstance(self.moe_layer_freq, tuple) or self.moe_first_dense_layers:
            return False
        return self.moe_layer_freq == 1


class ParallelConfig(_Strict):
    """Megatron's parallel arguments; DP is derived from the world size."""

    tp: PositiveInt = Field(1, validation_alias=AliasChoices("tp", "tensor_model_parallel_size"))
    pp: PositiveInt = Field(1, validation_alias=AliasChoices("pp", "pipeline_model_parallel_size"))
    vpp: PositiveInt | None = Field(
        None, validation_alias=AliasChoices("vpp", "virtual_pipeline_model_parallel_size")
    )
    cp: PositiveInt = Field(1, validation_alias=AliasChoices("cp", "context_parallel_size"))
    ep: PositiveInt = Field(1, validation_alias=AliasChoices("ep", "expert_model_parallel_size"))
    etp: PositiveInt | None = Field(
        None, validation_alias=AliasChoices("etp", "expert_tensor_parallel_size")
    )
    decoder_first_pipeline_num_layers: PositiveInt | None = None
    decoder_last_pipeline_num_layers: PositiveInt | None = None
    account_for_embedding_in_pipeline_split: StrictBool = False
    account_for_loss_in_pipeline_split: StrictBool = False
    use_distributed_optimizer: StrictBool = True
    num_distributed_optimizer_instances: PositiveInt = 1
    overlap_grad_reduce: StrictBool = False
    # Megatron forces it off at tp=1; it only sets TP attributes, no layout fact (model.py).
    sequence_parallel: StrictBool = False
    bucket_size: PositiveInt | None = None
    # Dist-opt only (megatron ignores it otherwise): bucket ends padded to lcm(D, 128, 2**16).
    pad_buckets_for_high_nccl_busbw: StrictBool = False
    # Megatron's layout string, e.g. "Et|(tt|)*2tL"; stage s is (pp s % pp, vp s // pp).
    pipeline_model_parallel_layout: Annotated[StrictStr, Field(max_length=1 << 16)] | None = None
    order: str = "tp-cp-ep-dp-pp"

    @model_validator(mode="before")
    @classmethod
    def _vpp_from_layout(cls, data: Any) -> Any:
        """VPP = layout stages / pp when not given, as megatron-core's TransformerConfig and
        Megatron-LM's arguments derive it; the rules check a given VPP against the layout."""
        if not isinstance(data, dict):
            return data
        text = data.get("pipeline_model_parallel_layout")
        if not isinstance(text, str) or any(data.get(k) is not None for k in (
                "vpp", "virtual_pipeline_model_parallel_size")):
            return data
        pp = data.get("pp", data.get("pipeline_model_parallel_size", 1))
        try:
            stages = len(parse_layout(text)) if len(text) <= 1 << 16 else 0
        except LayoutParseError:
            return data  # the rules name the problem
        if type(pp) is int and pp >= 1 and stages % pp == 0 and stages // pp > 1:
            return {**data, "vpp": stages // pp}
        return data

    @field_validator("order")
    @classmethod
    def _order_is_permutation(cls, v: str) -> str:
        tokens = v.split("-")
        if sorted(tokens) != sorted(["tp", "cp", "ep", "dp", "pp"]):
            raise ValueError("must be a '-'-joined permutation of tp, cp, ep, dp, pp")
        return v

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    @property
    def vp(self) -> int:
        return self.vpp or 1


class WorldConfig(_Strict):
    """The devices of a layout: ``nodes`` x ``gpus_per_node`` or an explicit device list.

    Device ids are ``node{N}:gpu{M}``; rank ``r`` runs on ``devices[r]``. Two layouts that name the
    same device ids share that hardware (the planner keeps data that does not have to move).
    """

    nodes: PositiveInt | None = None
    gpus_per_node: PositiveInt | None = None
    first_node: NonNegInt = 0
    devices: tuple[str, ...] | None = None

    @field_validator("devices")
    @classmethod
    def _valid_devices(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("must list at least one device")
        for d in v:
            if not isinstance(d, str) or not DEVICE_ID.match(d):
                raise ValueError(f"device ids look like 'node3:gpu5'; {d!r} does not")
        if len(set(v)) != len(v):
            dup = next(d for d in v if v.count(d) > 1)
            raise ValueError(f"device {dup!r} is listed twice")
        return v


DType = Literal["bf16", "fp16", "fp32"]


class StateConfig(_Strict):
    """Which kinds of training state exist and their dtypes (Adam's step is one scalar)."""

    param: DType = "bf16"
    main_param: DType | None = "fp32"
    exp_avg: DType | None = "fp32"
    exp_avg_sq: DType | None = "fp32"
    # Opt-in: the destination rebuilds its ``param`` by casting the main params its optimizer
    # holds (and, under the distributed optimizer, all-gathering them over DP as Megatron does
    # after every step) instead of receiving them. Saves the param bytes; valid because
    # Megatron keeps param == cast(main_param) at every step boundary.
    derive_param: bool = False


class LayoutSpec(_Strict):
    """A whole layout spec: model, parallel config, world and state kinds."""

    name: str | None = None
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    world: WorldConfig
    state: StateConfig = StateConfig()
    # The megatron-core whose layout this is; layouts differ between versions (versions.py).
    # Default: the installed megatron-core (read from package metadata), else 0.16.1; an
    # installed version of an unknown series is refused by name, not silently replaced.
    megatron_core: str = Field(default_factory=versions.default, validate_default=True)

    @field_validator("megatron_core", mode="before")
    @classmethod
    def _known_megatron_core(cls, v: object) -> str:
        return versions.normalize(v)
