"""Which decoder layers each pipeline stage and virtual chunk builds.

Mirrors megatron-core 0.16.1's ``get_num_layers_to_build`` and ``get_transformer_layer_offset``
formula for formula (even split, uneven first/last stage, VPP, embedding/loss accounted in the
split, or an explicit ``pipeline_model_parallel_layout`` string), so odd combinations land where
Megatron puts them. ``stage_layers`` then checks that the result partitions the layers; a spec
that does not is rejected by the rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

# A layout string may expand to at most this many layer characters: Megatron would happily
# build "t*10**12" in memory; a real layout has a few hundred.
MAX_LAYOUT_CHARS = 1 << 20
LAYOUT_CHARS = "ELtm"  # embedding, loss, decoder ("transformer"), multi-token prediction
# megatron-core 0.16.1 pipeline_parallel_layer_layout.py:291-301, applied in this order, each in
# one left-to-right pass (no nesting): "(ab|)*2" -> "ab|ab|", then "x*3" -> "xxx".
_UNROLL = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))


class LayoutParseError(ValueError):
    """A pipeline layout string megatron-core cannot parse; the message is the rule."""


@lru_cache(maxsize=256)
def parse_layout(text: str) -> tuple[str, ...]:
    """The stages of a ``pipeline_model_parallel_layout`` string, in Megatron's order.

    Commas are dropped, ``(...)*n`` and then ``x*n`` are unrolled, and the result is split on
    ``|`` (megatron-core 0.16.1 ``PipelineParallelLayerLayout.parse_str_to_list``). Stage ``s``
    belongs to pipeline rank ``s % pp``, virtual chunk ``s // pp``.

    Raises:
        LayoutParseError: an unknown character, or an expansion past ``MAX_LAYOUT_CHARS``.

    Example:
        >>> parse_layout("Et|(tt|)*2tL")
        ('Et', 'tt', 'tt', 'tL')
    """
    s = text.replace(",", "")
    for pattern in _UNROLL:
        grow = 0
        for m in pattern.finditer(s):
            if len(m.group(2).lstrip("0")) > 7:  # int() of a long digit run alone is slow
                raise LayoutParseError(f"repeats {m.group(0)[:20]!r} too many times")
            grow += len(m.group(1)) * int(m.group(2)) - len(m.group(0))
        if len(s) + grow > MAX_LAYOUT_CHARS:
            raise LayoutParseError(f"expands to more than {MAX_LAYOUT_CHARS} characters")
        s = pattern.sub(lambda m: m.group(1) * int(m.group(2)), s)
    stages = tuple(s.split("|"))
    for stage in stages:
        bad = next((c for c in stage if c not in LAYOUT_CHARS), None)
        if bad is not None:
            raise LayoutParseError(f"has the invalid layer character {bad!r} after unrolling "
                                   "(known: E embedding, t decoder layer, m MTP layer, L loss; "
                                   "'(...)*n', 'x*n', ',' and '|' as separators)")
    return stages


def layout_problem(stages: tuple[str, ...], pp: int, num_layers: int,
                   mtp_num_layers: int | None = None) -> str | None:
    """Why megatron-core 0.16.1 refuses these layout stages for ``pp``, ``num_layers`` and
    ``mtp_num_layers`` (``PipelineParallelLayerLayout.__init__`` and ``validate_layer_layout``,
    pipeline_parallel_layer_layout.py:85-150), or None.

    One more than megatron: the MTP layers must sit on the last pipeline rank. Elsewhere
    (megatron's ``mtp_standalone``) their stage's embedding copy is outside the default
    embedding group, which only Megatron-LM's own ``get_embedding_ranks`` may widen.
    """
    if len(stages) % pp:
        return f"has {len(stages)} stages, which must be a multiple of pp={pp}"
    vpp = len(stages) // pp
    flat = "".join(stages[v * pp + r] for v in range(vpp) for r in range(pp))
    if not flat.startswith("E"):
        return "must start with the embedding 'E' (the first layer in stage order)"
    if not flat.endswith("L"):
        return "must end with the loss 'L' (the last layer in stage order)"
    if flat.count("E") != 1:
        return f"must name the embedding 'E' exactly once, not {flat.count('E')} times"
    if flat.count("L") != 1:
        return f"must name the loss 'L' exactly once, not {flat.count('L')} times"
    if flat.count("t") != num_layers:
        return f"has {flat.count('t')} decoder layers 't' but num_layers={num_layers}"
    mtp = mtp_num_layers or 0
    if flat.count("m") != mtp:
        return (f"has {flat.count('m')} multi-token prediction layers 'm' but "
                f"mtp_num_layers={mtp_num_layers}")
    if "t" in flat[flat.find("m"):] and mtp:
        return "must place every decoder layer 't' before the MTP layers 'm'"
    holder = [s for s, stage in enumerate(stages) if "m" in stage]
    if holder and (len(set(holder)) > 1 or holder[0] != len(stages) - 1):
        return ("must put all MTP layers 'm' in the last stage of the last pipeline rank "
                "(megatron wants them in one stage, the last virtual one of its rank; DynaTrain "
                "does not model them on an earlier rank)")
    return None


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
    layout: tuple[str, ...] | None = None  # pipeline_model_parallel_layout stages, parsed


def _layout_chunk(s: PipelineSplit, pp_rank: int, vp: int | None) -> str:
    assert s.layout is not None
    return s.layout[(vp or 0) * s.pp + pp_rank]


def num_layers_to_build(s: PipelineSplit, pp_rank: int, vp: int | None) -> int:
    """Layers built by pipeline rank ``pp_rank``, virtual chunk ``vp`` (Megatron's formula)."""
    if s.layout is not None:  # transformer_block.py:90-93: the t's of that stage
        return _layout_chunk(s, pp_rank, vp).count("t")
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
    if s.layout is not None:  # transformer_layer.py:50-53: t's of every earlier stage
        before = s.layout[:(vp or 0) * s.pp + pp_rank]
        return sum(stage.count("t") for stage in before)
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
