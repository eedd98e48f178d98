"""Merging abutting pieces into one region: only where one translation maps both, and a flat
shard only where the merged block is one row-major run."""

from __future__ import annotations

from dynatrain.ir.box import Box
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.state import FlatSlot, ParamSlot, StateView, merge_adjacent

GLU = dict(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16,
           vocab_size=32, make_vocab_size_divisible_by=4, swiglu=True, max_position_embeddings=4)


def _view(**par) -> StateView:
    return StateView(Layout(spec_from_dict({"model": GLU, "parallel": par,
                                            "world": {"nodes": 1, "gpus_per_node": 2}})))


def test_unsplit_swiglu_is_one_region_and_split_swiglu_two() -> None:
    fc1 = "decoder.layers.mlp.linear_fc1.weight"
    whole = [s for s in _view(use_distributed_optimizer=False).stored(0) if s.key == fc1]
    assert [(s.box, s.slot.local_offset) for s in whole] == [(Box((0, 0, 0), (1, 32, 8)), (0, 0))]
    split = [s for s in _view(tp=2).stored(1) if s.key == fc1 and isinstance(s.slot, ParamSlot)]
    assert [(s.box, s.slot.local_offset) for s in split] == [
        (Box((0, 8, 0), (1, 16, 8)), (0, 0)), (Box((0, 24, 0), (1, 32, 8)), (8, 0))]


def test_flat_shard_across_gate_and_up_is_one_run() -> None:
    # DP4 at TP1: rank 1's DistributedOptimizer shard of fc1 is rows 12:32, gate rows 12:16
    # then up rows 16:32, end to end in the flat shard: one region.
    fc1 = "decoder.layers.mlp.linear_fc1.weight"
    view = StateView(Layout(spec_from_dict({"model": GLU, "parallel": {},
                                            "world": {"nodes": 1, "gpus_per_node": 4}})))
    flat = [s for s in view.stored(1) if s.key == fc1 and isinstance(s.slot, FlatSlot)]
    assert [(s.box, s.slot.offset) for s in flat] == [(Box((0, 12, 0), (1, 32, 8)), 0)]


def test_merge_needs_one_translation_and_a_row_major_run() -> None:
    left, right = ((0, 0), Box((0, 0), (2, 2))), ((0, 2), Box((0, 2), (2, 4)))
    assert merge_adjacent([left, right], 0) == [((0, 0), Box((0, 0), (2, 4)))]
    # Columns 0:4 of an 8-wide flat tensor are not one run: a flat slot keeps two regions.
    assert merge_adjacent([left, right], 0, flat_shape=(2, 8)) == [left, right]
    assert merge_adjacent([left, right], 0, flat_shape=(2, 4)) == [((0, 0), Box((0, 0), (2, 4)))]
    # Abutting globally but not locally (TP's [gate_r; up_r]): no merge.
    assert merge_adjacent([left, ((0, 3), Box((0, 2), (2, 4)))], 0) == [left, ((0, 3),
                                                                              Box((0, 2), (2, 4)))]
    # Different prepended (layer) coordinates: no merge.
    a, b = ((0,), Box((0, 0), (1, 4))), ((4,), Box((1, 4), (2, 8)))
    assert merge_adjacent([a, b], 1) == [a, b]
