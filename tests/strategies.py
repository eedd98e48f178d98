"""Hypothesis strategies for random small models, valid layouts of them and transitions.

Everything is valid by construction: each layout field is drawn from the values the model's
divisibility and megatron-core's rules (``dynatrain/ir/rules.py``) leave open, given the fields
drawn before it, so almost nothing is rejected. The final ``spec_from_dict`` is a safety net.
Specs are plain dicts (what a user writes in YAML), so a shrunk failure can be pasted back into
``spec_from_dict``. Tensors stay tiny and worlds at most ``MAX_WORLD`` ranks so that simulating
a plan takes well under a second.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from hypothesis import assume
from hypothesis import strategies as st

from dynatrain.ir.errors import DynatrainError
from dynatrain.ir.layout import DTYPE_BYTES, Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.pipeline import (
    PipelineSplit,
    layout_problem,
    parse_layout,
    split_problem,
)
from dynatrain.ir.spec import LayoutSpec, ModelConfig
from dynatrain.ir.state import StateView

MAX_WORLD = 16
MAX_PP = 4
MAX_ROUNDS = 48
# Explicit device lists are drawn from this pool; nodes x gpus_per_node worlds also reach
# gpu4..gpu7 and later nodes, so source and destination share some devices and not others.
POOL = tuple(f"node{n}:gpu{g}" for n in range(5) for g in range(4))
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
TOKENS = ("tp", "cp", "ep", "dp", "pp")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- models --------------------------------------------------------------------------------


@st.composite
def models(draw: st.DrawFn, moe: bool | None = None, te: bool = True) -> dict:
    """A small GPT in Megatron's argument names: dense or MoE, GQA, SwiGLU, tied or not;
    sometimes with Transformer Engine layers (``te=False``: never, for tests that build the
    model with megatron in this process, where TE cannot be imported).

    Sizes are picked so that many tensor-parallel sizes (1, 2, 3, 4, 6, 8) divide something.
    """
    is_moe = draw(st.booleans()) if moe is None else moe
    L = draw(st.integers(1, 6))
    # Many heads first: 1 head leaves tp=1 only (hypothesis still shrinks towards 4).
    heads = draw(st.sampled_from([4, 8, 2, 6, 12, 3, 1]))
    groups = draw(st.sampled_from(_divisors(heads)))  # 1 (MQA) .. heads (no GQA)
    m: dict = dict(num_layers=L, num_attention_heads=heads)
    if groups != heads or draw(st.booleans()):
        m["num_query_groups"] = groups
    if draw(st.integers(0, 4)) == 0:  # kv_channels: hidden need not divide by heads
        m["kv_channels"] = draw(st.sampled_from([2, 4, 6, 8]))
        m["hidden_size"] = draw(st.integers(16, 64))
    else:
        head_dim = draw(st.sampled_from([d for d in range(1, 65) if 16 <= heads * d <= 64]))
        m["hidden_size"] = heads * head_dim
    if draw(st.integers(0, 5)):
        m["ffn_hidden_size"] = draw(st.sampled_from([48, 24, 96, 72, 36, 12, 16, 32, 40, 64]))
    # A vocab that rarely divides make_vocab_size_divisible_by * tp: padding rows all around.
    m["vocab_size"] = draw(st.integers(8, 100))
    m["make_vocab_size_divisible_by"] = draw(st.sampled_from([4, 8, 1, 2, 16]))
    m["max_position_embeddings"] = draw(st.integers(4, 32))
    m["position_embedding_type"] = draw(st.sampled_from(["learned_absolute", "rope", "none"]))
    m["normalization"] = draw(st.sampled_from(["LayerNorm", "RMSNorm"]))
    for flag in ("swiglu", "untie_embeddings_and_output_weights", "qk_layernorm",
                 "add_bias_linear"):
        m[flag] = draw(st.booleans())
    # Transformer Engine layers: fused norms reorder the params, buffers and optimizer ranges.
    te = te and draw(st.integers(0, 2)) == 0
    if te:
        m["transformer_impl"] = "transformer_engine"
    if draw(st.integers(0, 3)) == 0:  # attention sinks (a learnable offset has a parameter)
        m["softmax_type"] = draw(st.sampled_from(["learnable", "off-by-one"]))
    if te and draw(st.integers(0, 2)) == 0:  # MLA: megatron builds it with TE layers only
        _mla_fields(draw, m)
    if draw(st.integers(0, 4)) == 0:  # MTP: untied, and no learned positions (rules.py)
        m["mtp_num_layers"] = draw(st.integers(1, 2))
        m["untie_embeddings_and_output_weights"] = True
        if m["position_embedding_type"] == "learned_absolute":
            m["position_embedding_type"] = "rope"
    if is_moe:
        _moe_fields(draw, m)
        if te and draw(st.booleans()):
            m["moe_grouped_gemm"] = True
    if te and draw(st.integers(0, 2)) == 0:
        _fp8_fields(draw, m)
    return m


def _fp8_fields(draw: st.DrawFn, m: dict) -> None:
    """fp8 training: delayed scaling (carried state) where the rules allow it, else a recipe
    without state."""
    m["fp8"] = draw(st.sampled_from(["hybrid", "e4m3"]))
    delayed_ok = not (m.get("num_moe_experts") or m.get("mtp_num_layers")
                      or m.get("softmax_type") == "learnable")
    recipes = (["delayed"] * 3 if delayed_ok else []) + ["tensorwise", "blockwise", "mxfp8"]
    m["fp8_recipe"] = draw(st.sampled_from(recipes))
    if m["fp8_recipe"] == "delayed":
        m["fp8_amax_history_len"] = draw(st.integers(1, 4))


def _mla_fields(draw: st.DrawFn, m: dict) -> None:
    """Multi-latent attention at small sizes; with and without the q down/up projections."""
    m["multi_latent_attention"] = True
    m["q_lora_rank"] = draw(st.sampled_from([None, 8, 12, 24]))
    m["kv_lora_rank"] = draw(st.sampled_from([8, 16, 12, 32]))
    m["qk_head_dim"] = draw(st.sampled_from([4, 8, 16, 6]))
    m["qk_pos_emb_head_dim"] = draw(st.sampled_from([2, 4, 8]))
    m["v_head_dim"] = draw(st.sampled_from([4, 8, 16, 6]))


def _moe_fields(draw: st.DrawFn, m: dict) -> None:
    L = m["num_layers"]
    E = draw(st.integers(2, 8))
    m["num_moe_experts"] = E
    m["moe_router_topk"] = draw(st.integers(1, min(E, 4)))
    m["moe_ffn_hidden_size"] = draw(st.sampled_from([8, 4, 6, 12, 16, 24]))
    if draw(st.booleans()):
        m["moe_router_enable_expert_bias"] = True
        m["moe_router_score_function"] = "sigmoid"
    elif draw(st.booleans()):
        m["moe_router_score_function"] = "sigmoid"
    if not m["add_bias_linear"] and draw(st.booleans()):  # shared experts have no biases
        m["moe_shared_expert_intermediate_size"] = draw(st.sampled_from([12, 24, 48, 8, 18]))
        m["moe_shared_expert_gate"] = draw(st.booleans())
    # Per-layer keys instead of one stacked tensor: a layer pattern or leading dense layers.
    freq = draw(st.sampled_from(["every", "int", "list"]))
    if freq == "int":
        m["moe_layer_freq"] = draw(st.integers(1, 3))
    elif freq == "list":
        m["moe_layer_freq"] = draw(st.lists(st.integers(0, 1), min_size=L, max_size=L))
    if L > 1 and draw(st.integers(0, 3)) == 0:
        m["moe_first_dense_layers"] = draw(st.integers(1, L - 1))


# ---- layouts -------------------------------------------------------------------------------


def _tp_ok(m: ModelConfig, tp: int) -> bool:
    """TP sizes megatron-core can build: heads, groups, ffn and every column split divide."""
    qkv_rows = m.head_dim * (m.num_attention_heads + 2 * m.groups)
    g = m.groups
    return (m.num_attention_heads % tp == 0 and (g % tp == 0 if g >= tp else tp % g == 0)
            and m.ffn % tp == 0 and qkv_rows % tp == 0
            and (m.moe_shared_expert_intermediate_size or 0) % tp == 0
            and (not m.mtp_num_layers or m.hidden_size % tp == 0))


@lru_cache(maxsize=64)
def pipelines(num_layers: int) -> tuple[dict, ...]:
    """Every pipeline split of ``num_layers`` with pp <= MAX_PP that megatron-core accepts.

    Even splits (optionally with the embedding/loss accounted as a layer, which can leave a
    stage with no layers), uneven first/last stages, and VPP on top of either. The first entry
    is no pipeline at all, so that is what hypothesis shrinks to. Layout strings are drawn
    from ``layout_pipelines``.
    """
    L, out = num_layers, [{}]
    for pp in range(2, MAX_PP + 1):
        for emb, loss in ((False, False), (True, False), (False, True), (True, True)):
            total = L + emb + loss
            if total % pp:
                continue
            for vpp in (None, 2, 3):
                if vpp and (total // pp) % vpp:
                    continue
                out.append(_pipeline(pp, vpp, None, None, emb, loss))
        for first, last in itertools.product((None, *range(1, L + 1)), repeat=2):
            if first is None and last is None:
                continue
            middle = pp - (first is not None) - (last is not None)
            rest = L - (first or 0) - (last or 0)
            if rest < 0 or (middle == 0) != (rest == 0) or (middle and rest % middle):
                continue
            for vpp in (None, 2, 3):
                if vpp and not (middle and (first or 0) % vpp == 0 and (last or 0) % vpp == 0
                                and (rest // middle) % vpp == 0):
                    continue
                out.append(_pipeline(pp, vpp, first, last, False, False))
    return tuple(p for p in out if not p or _split_ok(L, p))


@lru_cache(maxsize=64)
def layout_pipelines(num_layers: int) -> tuple[dict, ...]:
    """Pipelines given as a ``pipeline_model_parallel_layout`` string, pp <= MAX_PP."""
    out = [{"pp": pp, "pipeline_model_parallel_layout": text}
           for pp in range(2, MAX_PP + 1) for vpp in (1, 2, 3)
           for text in _layout_strings(num_layers, pp, vpp)]
    return tuple(p for p in out if _split_ok(num_layers, p))


def _split_ok(L: int, p: dict) -> bool:
    text = p.get("pipeline_model_parallel_layout")
    if text is not None:
        return layout_problem(parse_layout(text), p["pp"], L) is None
    return split_problem(PipelineSplit(
        L, p["pp"], p.get("vpp"), p.get("decoder_first_pipeline_num_layers"),
        p.get("decoder_last_pipeline_num_layers"),
        p.get("account_for_embedding_in_pipeline_split", False),
        p.get("account_for_loss_in_pipeline_split", False))) is None


def _layout_strings(L: int, pp: int, vpp: int, per_shape: int = 6) -> list[str]:
    """A spread of ``pipeline_model_parallel_layout`` strings for ``pp * vpp`` stages: uneven
    and empty stages, E/L markers on an empty edge stage or next to the first/last layer, and
    Megatron's ``t*n``, ``(...)*n`` and ``,`` spellings (VPP is then derived as stages / pp)."""
    S = pp * vpp
    # Compositions of L into S parts (stars and bars), a deterministic spread of them.
    comps = [tuple(b - a - 1 for a, b in zip((-1, *bars), (*bars, L + S - 1)))
             for bars in itertools.combinations(range(L + S - 1), S - 1)]
    picked = comps[:: max(1, len(comps) // per_shape)][:per_shape]
    out = []
    for i, counts in enumerate(picked):
        stages = ["t" * n if (i + k) % 2 else (f"t*{n}" if n > 1 else "t" * n)
                  for k, n in enumerate(counts)]
        has = [k for k, n in enumerate(counts) if n]
        first = has[0] if i % 3 == 1 else 0  # E may sit after empty leading stages
        last = has[-1] if i % 3 == 2 else S - 1
        stages[first] = "E" + stages[first]
        stages[last] = stages[last] + "L"
        text = "|".join(stages)
        if i % 4 == 3 and len(set(stages[1:-1])) == 1 and S > 3:  # "(x|)*n" for equal middles
            text = f"{stages[0]}|({stages[1]}|)*{S - 2}{stages[-1]}"
        elif i % 4 == 2:
            text = text.replace("|", ",|", 1)  # a cosmetic comma
        out.append(text)
    return out


def _pipeline(pp: int, vpp: int | None, first: int | None, last: int | None, emb: bool,
              loss: bool) -> dict:
    p: dict = {"pp": pp}
    for name, v in (("vpp", vpp), ("decoder_first_pipeline_num_layers", first),
                    ("decoder_last_pipeline_num_layers", last),
                    ("account_for_embedding_in_pipeline_split", emb or None),
                    ("account_for_loss_in_pipeline_split", loss or None)):
        if v is not None:
            p[name] = v
    return p


@st.composite
def layouts(draw: st.DrawFn, model: dict, pool: tuple[str, ...] = POOL,
            max_world: int = MAX_WORLD) -> dict:
    """A parallel config and world for ``model`` that megatron-core accepts.

    TP (incl. 3 and 6 where they divide), PP even/uneven/accounted or an explicit layout
    string, VPP, CP, DP, EP, ETP, rank order, distributed optimizer (with instances, small
    buckets and bus-bandwidth padding) or not, and a world
    of at most ``max_world`` ranks: ``nodes x gpus_per_node`` or an arbitrary ordered subset
    of ``pool``.
    """
    m = ModelConfig.model_validate(model)
    tps = [t for t in range(1, min(8, max_world) + 1) if _tp_ok(m, t)]
    tp = draw(st.sampled_from(tps[:1] + tps[1:] * 2))  # tp > 1 twice as likely as tp = 1
    pipes = [p for p in pipelines(m.num_layers) if tp * p.get("pp", 1) <= max_world]
    if draw(st.integers(0, 3)) == 3:  # an explicit layout string a quarter of the time
        pipes = [p for p in layout_pipelines(m.num_layers)
                 if tp * p["pp"] <= max_world] or pipes
    pipe = draw(st.sampled_from(pipes))
    if m.mtp_num_layers and "pipeline_model_parallel_layout" in pipe:  # MTP before the loss
        text = pipe["pipeline_model_parallel_layout"]
        at = text.rindex("L")
        pipe = {**pipe, "pipeline_model_parallel_layout":
                text[:at] + "m" * m.mtp_num_layers + text[at:]}
    pp = pipe.get("pp", 1)
    cp = draw(st.sampled_from([c for c in (1, 2, 1, 3) if tp * pp * c <= max_world]))
    dp = draw(st.integers(1, max_world // (tp * pp * cp)))
    world = tp * pp * cp * dp
    par: dict = {"tp": tp, **pipe}
    if cp > 1:
        par["cp"] = cp
    distopt = draw(st.booleans())
    inst_of = dp * cp  # what num_distributed_optimizer_instances must divide
    if m.num_moe_experts:
        E = m.num_moe_experts
        pairs = [(ep, etp) for ep in _divisors(E) for etp in _divisors(m.moe_ffn)
                 if (world // pp) % (ep * etp) == 0 and (etp == 1 or not m.add_bias_linear)]
        ep = draw(st.sampled_from(sorted({ep for ep, _ in pairs})))  # EP first: not mostly 1
        etp = draw(st.sampled_from([e for p, e in pairs if p == ep]))
        if ep == 1 and etp != tp:  # megatron-core loses optimizer state here (rules.py)
            distopt = False
        if ep > 1:
            par["ep"] = ep
        if etp != tp or draw(st.booleans()):
            par["etp"] = etp
        edp = world // (etp * ep * pp)
        inst_of = math.gcd(inst_of, edp)  # and the expert data-parallel size
    par["use_distributed_optimizer"] = distopt
    if draw(st.integers(0, 4)) == 0:  # pads buckets to 2**16 (only with the dist-opt)
        par["pad_buckets_for_high_nccl_busbw"] = True
    if distopt and inst_of > 1 and draw(st.integers(0, 3)) == 0:
        par["num_distributed_optimizer_instances"] = draw(st.sampled_from(_divisors(inst_of)[1:]))
    if draw(st.booleans()):
        par["overlap_grad_reduce"] = True
        if draw(st.integers(0, 3)):  # else Megatron's default: one bucket
            par["bucket_size"] = draw(st.integers(1, 3000))
    order = draw(_orders((bool(m.num_moe_experts) or cp > 1) and pp > 1))
    if order != DEFAULT_ORDER:
        par["order"] = order
    return {"model": model, "parallel": par, "world": draw(_worlds(world, pool))}


def _orders(pp_last: bool) -> st.SearchStrategy[str]:
    """Megatron's default order, its tp-pp-dp alternative, or any permutation.

    With experts (or cp > 1: the expert grid has no cp) and pp > 1 an order not ending in pp
    needs the dense and expert grids to agree on DP sizes and pipeline groups (rules.py), so
    there pp stays last.
    """
    if pp_last:
        rest = st.permutations(TOKENS[:4]).map(lambda t: "-".join((*t, "pp")))
        return st.one_of(st.just(DEFAULT_ORDER), rest)
    return st.one_of(st.just(DEFAULT_ORDER), st.just("tp-cp-ep-pp-dp"),
                     st.permutations(TOKENS).map("-".join))


@st.composite
def _worlds(draw: st.DrawFn, size: int, pool: tuple[str, ...]) -> dict:
    if size > len(pool) or draw(st.booleans()):
        gpn = draw(st.sampled_from([g for g in _divisors(size) if g <= 8][::-1]))
        w = {"nodes": size // gpn, "gpus_per_node": gpn}
        first = draw(st.integers(0, 2))
        if first:
            w["first_node"] = first
        return w
    return {"devices": list(draw(st.permutations(pool))[:size])}


# ---- transitions ---------------------------------------------------------------------------

STATES = (
    {},  # Megatron's default: bf16 params, fp32 main params and Adam moments
    {"param": "fp16"},
    {"param": "fp32", "main_param": None},  # fp32 training: no separate main params
    {"main_param": None, "exp_avg": None, "exp_avg_sq": None},  # weights only
)


@dataclass(frozen=True)
class Transition:
    """Two layouts of one model, the per-device staging budget, and the validated specs."""

    src_doc: dict
    dst_doc: dict
    budget: int
    place: str  # plan_transition's placement: "naive" (rank r on devices[r]) or "auto"
    src: LayoutSpec = field(repr=False, compare=False)
    dst: LayoutSpec = field(repr=False, compare=False)

    @property
    def derive(self) -> bool:
        return self.dst.state.derive_param


def _spec(doc: dict) -> LayoutSpec:
    """The validated spec; a rule the construction missed rejects the example (rare)."""
    try:
        spec = spec_from_dict(doc)
        Layout(spec)
    except DynatrainError:
        assume(False)
        raise  # unreachable: assume(False) raises
    return spec


@st.composite
def transitions(draw: st.DrawFn, moe: bool | None = None, max_world: int = MAX_WORLD,
                pool: tuple[str, ...] = POOL) -> Transition:
    """A source and a destination layout of the same model and state kinds, each of at most
    ``max_world`` ranks (device lists drawn from ``pool``).

    Sometimes the destination derives its params from its main params (``derive_param``), the
    budget is sometimes a few hundred bytes, which forces messages and boxes to split, and
    sometimes the planner also chooses the destination's placement (``place="auto"``).
    """
    model = draw(models(moe))
    state = draw(st.sampled_from(STATES))
    src = draw(layouts(model, pool, max_world))
    dst = draw(layouts(model, pool, max_world))
    if state:
        src["state"] = dict(state)
        dst["state"] = dict(state)
    can_derive = state.get("param", "bf16") != "fp32" and "main_param" not in state
    if can_derive and draw(st.integers(0, 3)) == 0:
        dst["state"] = {**state, "derive_param": True}
    src_spec, dst_spec = _spec(src), _spec(dst)
    budget = draw(st.one_of(st.just(1 << 30), st.integers(256, 4096)))
    # A few hundred bytes against a few hundred KiB of state would take thousands of rounds,
    # and the scheduler's time grows with rounds x messages x retries (tens of seconds): raise
    # the budget so that the busiest rank's state fits in about MAX_ROUNDS rounds (x3: many
    # small tensors, as MLA has, pad messages to alignment and need more rounds than bytes).
    budget = max(budget, -(-3 * max(_rank_bytes(src_spec), _rank_bytes(dst_spec)) // MAX_ROUNDS))
    # --place auto reassigns the destination's devices; it needs every TP group in one node.
    place = "auto" if _tp_groups_fit(dst_spec) and draw(st.integers(0, 3)) == 0 else "naive"
    return Transition(src, dst, budget, place, src_spec, dst_spec)


def _tp_groups_fit(spec: LayoutSpec) -> bool:
    """Whether each node's devices hold whole TP groups, as ``--place auto`` requires."""
    devices, tp = Layout(spec).devices, spec.parallel.tp
    per_node = Counter(d.split(":")[0] for d in devices)
    return sum(n // tp for n in per_node.values()) >= len(devices) // tp


def _rank_bytes(spec: LayoutSpec) -> int:
    """The most state bytes any rank of ``spec`` holds."""
    view = StateView(Layout(spec))
    dtypes = {"buffer": "fp32", **view.kinds}
    return max(sum(s.box.numel * sum(DTYPE_BYTES.get(dtypes.get(k), 8) for k in s.kinds)
                   for s in view.stored(r)) for r in range(view.layout.world))
