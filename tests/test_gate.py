"""Property gate: every plan between two random valid layouts of a random model is bit-exact.

Hypothesis draws a small model (dense or MoE), two layouts of it across every parallel
dimension and world shape (tests/strategies.py) and a staging budget. The plan must pass the
verifier, reproduce every destination rank's storage bit for bit in the numpy simulator, move
exactly the bytes that must cross devices, and stage no more than the budget. The example
count comes from the hypothesis profile (tests/conftest.py: ``ci`` by default, ``deep`` with
DYNATRAIN_HYPOTHESIS=deep). ``test_strategy_reaches`` keeps the strategy honest: each
dimension the gate claims to cover must come up among the examples it draws.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import Phase, event, find, given, note, settings
from hypothesis import strategies as st

from dynatrain.ir.layout import Layout
from dynatrain.ir.state import transition_views
from dynatrain.planner.pipeline import plan_transition
from dynatrain.verify.check import verify

from oracle import assert_plan_exact
from strategies import Transition, transitions


def _events(t: Transition) -> None:
    """Label the example so ``--hypothesis-show-statistics`` shows what the run covered."""
    for side, spec in (("src", t.src), ("dst", t.dst)):
        p, w = spec.parallel, spec.world
        event(f"{side} tp={p.tp} pp={p.pp} vpp={p.vpp or 1} cp={p.cp}")
        if spec.model.num_moe_experts:
            event(f"{side} ep={p.ep} etp={p.expert_tp}")
        event(f"{side} " + ("devices list" if w.devices is not None else "nodes x gpus"))
    event("moe" if t.src.model.num_moe_experts else "dense")
    event(f"transformer_impl={t.src.model.transformer_impl}"
          + (" grouped gemm" if t.src.model.moe_grouped_gemm else ""))
    event("derive_param" if t.derive else "params sent")
    event(f"place={t.place}")
    event("budget 1GiB" if t.budget == 1 << 30 else
          "budget <= 4KiB" if t.budget <= 4096 else "budget scaled to the state")
    p = t.dst.parallel
    for flag, on in (("uneven pp", p.decoder_first_pipeline_num_layers is not None
                      or p.decoder_last_pipeline_num_layers is not None),
                     ("accounted pp", p.account_for_embedding_in_pipeline_split
                      or p.account_for_loss_in_pipeline_split),
                     ("no distopt", not p.use_distributed_optimizer),
                     ("distopt instances > 1", p.num_distributed_optimizer_instances > 1),
                     ("buckets", p.bucket_size is not None),
                     ("non-default order", p.order != "tp-cp-ep-dp-pp"),
                     ("pp layout string", p.pipeline_model_parallel_layout is not None),
                     ("pad busbw", p.pad_buckets_for_high_nccl_busbw)):
        if on:
            event(f"dst {flag}")


@given(t=transitions(), seed=st.integers(0, 2**32 - 1))
def test_random_transition_is_verified_and_bit_exact(t: Transition, seed: int) -> None:
    """The simulator is the oracle: any layout pair Megatron accepts must come out exact."""
    note(f"src = {t.src_doc!r}")
    note(f"dst = {t.dst_doc!r}")
    note(f"budget = {t.budget}, place = {t.place!r}")
    _events(t)
    check_exact(t, seed)


def check_exact(t: Transition, seed: int) -> None:
    """Plan, verify and simulate ``t``; every destination shard must equal the reference."""
    src, dst = Layout(t.src), Layout(t.dst)
    plan = plan_transition(src, dst, t.budget, place=t.place)
    report = verify(plan, src, dst)
    assert report.ok, str(report)
    s, d = transition_views(src, dst)
    rng = np.random.default_rng(seed)
    tensors = {tk: rng.standard_normal(lt.shape).astype(np.float32)
               for tk, lt in s.tensors().items()}
    if t.derive:  # Megatron's invariant at a step boundary: param == cast(main_param)
        for key, kind in list(tensors):
            if kind == "param":
                tensors[(key, kind)] = tensors[(key, "main_param")]
    assert_plan_exact(plan, s, d, tensors, t.budget)


def _grows(t: Transition) -> bool:
    return set(Layout(t.src).devices) < set(Layout(t.dst).devices)


def _shrinks(t: Transition) -> bool:
    return set(Layout(t.dst).devices) < set(Layout(t.src).devices)


def _both(pred):
    return lambda t: pred(t.src) or pred(t.dst)


# What the gate is meant to cover; each must come up among the first examples the strategy
# draws, so a change that quietly narrows the strategy fails here instead of passing the gate.
COVERAGE = {
    "tp non-power-of-two": _both(lambda s: s.parallel.tp in (3, 6)),
    "tp change": lambda t: t.src.parallel.tp != t.dst.parallel.tp,
    "pp uneven": _both(lambda s: s.parallel.decoder_first_pipeline_num_layers is not None
                       or s.parallel.decoder_last_pipeline_num_layers is not None),
    "pp accounted": _both(lambda s: s.parallel.account_for_embedding_in_pipeline_split),
    "vpp": _both(lambda s: s.parallel.vpp is not None),
    "cp": _both(lambda s: s.parallel.cp > 1),
    "ep": _both(lambda s: s.parallel.ep > 1),
    "etp != tp": _both(lambda s: s.model.num_moe_experts and s.parallel.expert_tp != s.parallel.tp),
    "distopt off -> on": lambda t: not t.src.parallel.use_distributed_optimizer
    and t.dst.parallel.use_distributed_optimizer,
    "distopt instances": _both(lambda s: s.parallel.num_distributed_optimizer_instances > 1),
    "small buckets": _both(lambda s: s.parallel.overlap_grad_reduce
                           and (s.parallel.bucket_size or 1 << 30) < 1000),
    "order": _both(lambda s: s.parallel.order != "tp-cp-ep-dp-pp"),
    "pp layout string": _both(lambda s: s.parallel.pipeline_model_parallel_layout is not None),
    "transformer engine": _both(lambda s: s.model.transformer_impl == "transformer_engine"),
    "te grouped gemm": _both(lambda s: s.model.moe_grouped_gemm),
    "pad busbw": _both(lambda s: s.parallel.pad_buckets_for_high_nccl_busbw
                       and s.parallel.use_distributed_optimizer),
    "device list": _both(lambda s: s.world.devices is not None),
    "grow": _grows,
    "shrink": _shrinks,
    "gqa": _both(lambda s: 1 < s.model.groups < s.model.num_attention_heads),
    "mqa tp > groups": _both(lambda s: s.model.groups == 1 and s.parallel.tp > 1),
    "vocab padding": _both(lambda s: s.model.vocab_size % (
        s.model.make_vocab_size_divisible_by * s.parallel.tp) != 0),
    "untied swiglu": _both(lambda s: s.model.untie_embeddings_and_output_weights
                           and s.model.swiglu),
    "moe expert bias + shared": _both(lambda s: s.model.moe_router_enable_expert_bias
                                      and s.model.moe_shared_expert_intermediate_size),
    "moe per-layer keys": _both(lambda s: s.model.num_moe_experts
                                and not s.model.homogeneous_layers),
    "mla": _both(lambda s: s.model.multi_latent_attention),
    "mla with q lora, tp > 1": _both(lambda s: s.model.multi_latent_attention
                                     and s.model.q_lora_rank is not None and s.parallel.tp > 1),
    "attention sinks": _both(lambda s: s.model.softmax_type == "learnable"),
    "fp8 delayed": _both(lambda s: s.model.fp8_delayed),
    "fp8 stateless recipe": _both(lambda s: s.model.fp8 is not None and not s.model.fp8_delayed),
    "mtp": _both(lambda s: bool(s.model.mtp_num_layers) and s.parallel.pp > 1),
    "mtp in a layout string": _both(lambda s: "m" in (s.parallel.pipeline_model_parallel_layout
                                                       or "")),
    "derive_param": lambda t: t.derive,
    "budget <= 4KiB": lambda t: t.budget <= 4096,
    "place auto": lambda t: t.place == "auto",
}


@pytest.mark.parametrize("name", COVERAGE)
def test_strategy_reaches(name: str) -> None:
    """The gate only proves what its strategy draws: each dimension must actually come up,
    and the example that shows it must itself be exact. So every dimension is checked bit for
    bit on every run, whatever the random gate's example count (``ci`` keeps that count low
    enough for the suite's time; ``deep`` draws thousands)."""
    t = find(transitions(), COVERAGE[name], settings=settings(
        max_examples=400, phases=[Phase.generate], database=None, derandomize=True,
        deadline=None))
    check_exact(t, seed=len(name))
