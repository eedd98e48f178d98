"""Which decoder layers each pipeline stage and virtual chunk builds.

Mirrors megatron-core 0.16.1's ``get_num_layers_to_build`` and ``get_transformer_layer_offset``
formula for formula (even split, uneven first/last stage, VPP, embedding/loss accounted in the
split), so odd combinations land where Megatron puts them. ``stage_layers`` then checks that the
result partitions the layers; a spec that does not is rejected by the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True, slots=True)
class PipelineSplit:
    """The pipeline arguments that decide the layer map."""

    num_layers: int
    pp: int
    vpp: int | None = None
    first: int | None = None  # decoder_first_pipeline_num_layers
    last: int | None = None  # decoder_last_pipeline_num_layers
    account_embedding: bool = False
    account_loss: bool = False


def num_layers_to_build(s: PipelineSplit, pp_rank: int, vp: int | None) -> int:
    """Layers built by pipeline rank ``pp_rank``, virtual chunk ``vp`` (Megatron's formula)."""
    if s.first is not None or s.last is not None:
        left, stages = s.num_layers, s.pp
        if s.first is not None:
            left, stages = left - s.first, stages - 1
        if s.last is not None:
            left, stages = left - s.last, stages - 1
        per_rank = left // stages if stages > 0 else 0
        if pp_rank == 0 and s.first is not None:
            per_rank = s.first
        if pp_rank == s.pp - 1 and s.last is not None:
            per_rank = s.last
    else:
        total = s.num_layers + s.account_embedding + s.account_loss
        per_rank = total // s.pp
    n = per_rank // s.vpp if (s.vpp is not None and s.pp > 1) else per_rank
    vpp = s.vpp or 1
    if s.account_embedding and pp_rank == 0 and (vp or 0) == 0:
        n -= 1
    if s.account_loss and pp_rank == s.pp - 1 and (vp or 0) == vpp - 1:
        n -= 1
    return n


def layer_offset(s: PipelineSplit, pp_rank: int, vp: int | None) -> int:
    """Global index of the first layer of (``pp_rank``, ``vp``) (Megatron's formula)."""
    if s.pp <= 1:
        return 0
    if s.first is not None or s.last is not None:
        middle_stages = s.pp - (s.first is not None) - (s.last is not None)
        f = s.first or 0
        l = s.last or 0
        middle_layers = s.num_layers - f - l
        middle_rank = pp_rank if s.first is None else pp_rank - 1
        if s.vpp is not None:
            f_v, l_v, m_v = f // s.vpp, l // s.vpp, middle_layers // s.vpp
            total_v = f_v + m_v + l_v
            if pp_rank == 0:
                return vp * total_v
            return vp * total_v + f_v + middle_rank * (m_v // middle_stages)
        per_rank = middle_layers // middle_stages if middle_stages > 0 else 0
        return 0 if pp_rank == 0 else middle_rank * per_rank + f
    total = s.num_layers + s.account_embedding + s.account_loss
    per_rank = total // s.pp
    if s.vpp is not None:
        offset = vp * (total // s.vpp) + pp_rank * (per_rank // s.vpp)
    else:
        offset = pp_rank * per_rank
    if s.account_embedding and not ((vp or 0) == 0 and pp_rank == 0):
        offset -= 1
    return offset


@lru_cache(maxsize=256)
def stage_layers(s: PipelineSplit) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``result[pp][vp]`` is the tuple of global layer indices (0-based) that chunk builds."""
    vps = range(s.vpp) if s.vpp is not None else [None]
    out = []
    for pp in range(s.pp):
        chunks = []
        for vp in vps:
            start, n = layer_offset(s, pp, vp), num_layers_to_build(s, pp, vp)
            chunks.append(tuple(range(start, start + max(n, 0))))
        out.append(tuple(chunks))
    return tuple(out)


def split_problem(s: PipelineSplit) -> str | None:
    """Why this split is not a partition of the layers, or None if it is."""
    try:
        layers = stage_layers(s)
    except ZeroDivisionError:
        return "this combination divides by zero in megatron-core's layer offset"
    seen: list[int] = []
    for pp, chunks in enumerate(layers):
        for vp, chunk in enumerate(chunks):
            if num_layers_to_build(s, pp, None if s.vpp is None else vp) < 0:
                return f"pipeline stage {pp} chunk {vp} would build a negative number of layers"
            seen.extend(chunk)
    if sorted(seen) != list(range(s.num_layers)):
        return "the stages do not build every layer exactly once"
    return None
