"""``DotProductAttention`` (TE ``attention/dot_product_attention/dot_product_attention.py:415``).

It owns no parameter unless ``softmax_type == "learnable"``: then one fp32 ``softmax_offset``
of num_heads / tp_size (dot_product_attention.py:772-783; "off-by-one" keeps a plain zero
tensor, "vanilla" None). The forward here is plain softmax attention in the ``sbhd``/``bshd``
layouts with GQA, causal or explicit boolean masks (True = masked out), and the learnable or
off-by-one sink as an extra logit per head; context parallelism is refused.
"""

from __future__ import annotations

import math

import torch

from ..module.base import TransformerEngineBaseModule

_MASKS = ("no_mask", "causal", "padding", "padding_causal", "arbitrary")


class DotProductAttention(TransformerEngineBaseModule):
    """softmax(q k^T * scale [+ mask]) v over each head (GQA: k/v heads are shared)."""

    def __init__(self, num_attention_heads: int, kv_channels, num_gqa_groups: int | None = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd",
                 attn_mask_type: str = "causal", window_size=None, sequence_parallel: bool = False,
                 tp_size: int = 1, get_rng_state_tracker=None, tp_group=None,
                 layer_number: int | None = None, attention_type: str = "self",
                 cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p",
                 softmax_scale: float | None = None, softmax_type: str = "vanilla",
                 return_max_logit: bool = False, name: str | None = None, **unsupported):
        if unsupported:
            raise NotImplementedError(f"CPU stand-in DotProductAttention: {sorted(unsupported)}")
        if cp_group is not None:
            raise NotImplementedError("context parallelism: not available in the CPU stand-in")
        if window_size not in (None, (-1, -1), (-1, 0)) or return_max_logit:
            raise NotImplementedError("sliding windows / max logits: not in the CPU stand-in")
        super().__init__(name=name)
        self.qkv_format = qkv_format
        attn_mask_type = attn_mask_type.replace(",", "_")
        self.attn_mask_type = ("padding_causal" if attn_mask_type == "causal_padding"
                               else attn_mask_type)
        self._init_tp(tp_group, tp_size)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.num_attention_heads = num_attention_heads
        self.layer_number = 1 if layer_number is None else layer_number
        self.cp_group, self.cp_global_ranks, self.cp_stream = None, cp_global_ranks, cp_stream
        self.cp_comm_type = cp_comm_type
        k = kv_channels if isinstance(kv_channels, int) else kv_channels[0]
        self.hidden_size_per_attention_head_k = k
        self.hidden_size_per_attention_head_v = (kv_channels if isinstance(kv_channels, int)
                                                 else kv_channels[1])
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        self.num_gqa_groups_per_partition = int(self.num_gqa_groups // self.tp_size)
        assert num_attention_heads % self.num_gqa_groups == 0, \
            "The number of attention heads must be divisible by the number of GQA groups!"
        self.softmax_scale = 1.0 / math.sqrt(k) if softmax_scale is None else softmax_scale
        self.attention_type = attention_type
        self.attention_dropout = attention_dropout
        self.sequence_parallel = sequence_parallel
        self.softmax_type = softmax_type
        heads = self.num_attention_heads // self.tp_size
        if softmax_type == "vanilla":  # dot_product_attention.py:772-783
            self.softmax_offset = None
        elif softmax_type == "off-by-one":
            self.softmax_offset = torch.zeros(heads)
        elif softmax_type == "learnable":
            self.register_parameter("softmax_offset", torch.nn.Parameter(torch.zeros(heads)),
                                    get_rng_state_tracker=get_rng_state_tracker)
        else:
            raise ValueError(f"softmax_type {softmax_type!r} not supported")

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type: str = "p2p") -> None:
        if cp_group is not None:
            raise NotImplementedError("context parallelism: not available in the CPU stand-in")

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor,
                value_layer: torch.Tensor, attention_mask: torch.Tensor | None = None,
                qkv_format: str | None = None, attn_mask_type: str | None = None,
                core_attention_bias_type: str = "no_bias", core_attention_bias=None,
                **unsupported) -> torch.Tensor:
        used = {k: v for k, v in unsupported.items() if v is not None}
        if used or core_attention_bias_type != "no_bias":
            raise NotImplementedError(f"CPU stand-in DotProductAttention.forward: {sorted(used)}")
        fmt = qkv_format or self.qkv_format
        mask_type = (attn_mask_type or self.attn_mask_type).replace(",", "_")
        if fmt == "sbhd":  # [s, b, h, d] -> [b, h, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))
        elif fmt == "bshd":
            q, k, v = (t.permute(0, 2, 1, 3) for t in (query_layer, key_layer, value_layer))
        else:
            raise NotImplementedError(f"qkv_format {fmt!r}: only sbhd/bshd in the CPU stand-in")
        rep = q.shape[1] // k.shape[1]
        if rep > 1:  # GQA: each k/v head serves rep consecutive query heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale
        sq, sk = scores.shape[-2:]
        masked = torch.zeros(sq, sk, dtype=torch.bool)
        if "causal" in mask_type:  # top-left aligned, as TE's "causal"
            masked = torch.triu(torch.ones(sq, sk, dtype=torch.bool), 1)
        if mask_type in ("padding", "padding_causal", "arbitrary") and attention_mask is not None:
            masked = masked | attention_mask.bool()
        scores = scores.masked_fill(masked, float("-inf"))
        if self.softmax_offset is not None:  # a sink logit per head, dropped after softmax
            sink = self.softmax_offset.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        if self.training and self.attention_dropout > 0:
            probs = torch.nn.functional.dropout(probs, self.attention_dropout)
        out = torch.matmul(probs.to(v.dtype), v)  # [b, h, s, d]
        if fmt == "sbhd":
            out = out.permute(2, 0, 1, 3)
        else:
            out = out.permute(0, 2, 1, 3)
        return out.reshape(*out.shape[:2], -1)
