"""Reading a Megatron-LM job into a TE spec: ``transformer_impl`` (Megatron-LM's default is
``transformer_engine``), ``moe_grouped_gemm`` and the legacy grouped GEMM, and
``sequence_parallel`` (read, no layout fact: tests/test_te_layout.py)."""

from __future__ import annotations

import pytest

from dynatrain.ir.errors import SpecError
from dynatrain.ir.from_job import IGNORED, MAPPED, UNSUPPORTED, read_megatron
from dynatrain.ir.layout import Layout

ARGS = dict(num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
            group_query_attention=True, num_query_groups=4, swiglu=True,
            normalization="RMSNorm", position_embedding_type="rope", vocab_size=1000,
            bf16=True, use_distributed_optimizer=True, tensor_model_parallel_size=2,
            sequence_parallel=True, add_bias_linear=False)
MOE_ARGS = dict(ARGS, num_experts=8, moe_ffn_hidden_size=128, expert_model_parallel_size=4,
                expert_tensor_parallel_size=1, moe_grouped_gemm=True)
W = {"nodes": 1, "gpus_per_node": 8}


def test_transformer_engine_is_the_default_and_is_read() -> None:
    job = read_megatron(ARGS, W)
    assert job.spec.model.transformer_impl == "transformer_engine" and job.unknown == ()
    assert read_megatron(dict(ARGS, transformer_impl="local"), W).spec.model.transformer_impl \
        == "local"


def test_grouped_gemm_experts_are_read() -> None:
    m = read_megatron(MOE_ARGS, W).spec.model
    assert (m.transformer_impl, m.moe_grouped_gemm, m.num_moe_experts) == (
        "transformer_engine", True, 8)


@pytest.mark.parametrize("change, start", [
    ({"moe_use_legacy_grouped_gemm": True},
     "moe_use_legacy_grouped_gemm: is not supported by DynaTrain yet"),
    ({"transformer_impl": "local"}, "moe_grouped_gemm: needs transformer_impl=transformer_engine"),
    ({"transformer_impl": "inference_optimized"}, "transformer_impl: "),
])
def test_unmodelled_expert_layouts_are_refused_in_one_line(change: dict, start: str) -> None:
    with pytest.raises(SpecError) as err:
        read_megatron(dict(MOE_ARGS, **change), W)
    assert str(err.value).startswith(start) and "\n" not in str(err.value)


def test_sequence_parallel_is_read_and_changes_no_layout_fact() -> None:
    """--sequence-parallel goes into parallel.sequence_parallel (off at TP 1, as validate_args
    turns it off); it changes no layout fact (tests/test_te_layout.py)."""
    assert {"transformer_impl", "moe_grouped_gemm", "sequence_parallel"} <= MAPPED
    assert not {"transformer_impl", "moe_grouped_gemm", "sequence_parallel"} & (
        UNSUPPORTED.keys() | IGNORED)
    a = read_megatron(ARGS, W).spec
    b = read_megatron(dict(ARGS, sequence_parallel=False), W).spec
    assert (a.parallel.sequence_parallel, b.parallel.sequence_parallel) == (True, False)
    assert a.model_copy(update={"parallel": b.parallel}) == b
    la, lb = Layout(a), Layout(b)
    assert all(la.rank_shards(r) == lb.rank_shards(r) and la.rank_buffers(r) == lb.rank_buffers(r)
               for r in range(la.world))
    tp1 = read_megatron(dict(ARGS, tensor_model_parallel_size=1), W).spec
    assert tp1.parallel.sequence_parallel is False
    with pytest.raises(SpecError) as err:
        read_megatron(dict(ARGS, sequence_parallel="yes"), W)
    assert str(err.value).startswith("sequence_parallel: ")
