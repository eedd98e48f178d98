"""The runtime allocates beside the state it is given: staging, destination and vote tensors
follow the storage's device (CUDA under NCCL), so one code path serves GPUs and CPUs.

No GPU here: the ``meta`` device stands in for "not the CPU" (tensors without data)."""

from __future__ import annotations

import torch

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.state import StateView
from dynatrain.runtime.exchange import Arena
from dynatrain.planner.pipeline import plan_transition
from dynatrain.runtime.executor import on_one_device, process_devices, tensor_device
from dynatrain.runtime.storage import allocate, storage_layout

TINY = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
            vocab_size=30, make_vocab_size_divisible_by=4, max_position_embeddings=8)
META = torch.device("meta")


def _view() -> StateView:
    return StateView(Layout(spec_from_dict({"model": TINY, "parallel": {"tp": 2},
                                            "world": {"nodes": 1, "gpus_per_node": 2}})))


def test_state_decides_where_the_switch_allocates() -> None:
    view = _view()
    on_meta = allocate(view, 0, META)
    assert on_meta and all(t.device == META for t in on_meta.values())
    assert {k: (tuple(t.shape), t.dtype) for k, t in on_meta.items()} == storage_layout(view, 0)
    # A source storage decides; else the destination storage; the group only when neither.
    assert tensor_device(on_meta, None, None) == META
    assert tensor_device(None, on_meta, None) == META
    assert tensor_device(allocate(view, 1), on_meta, None) == torch.device("cpu")


def test_a_storage_tensor_off_the_process_device_is_named() -> None:
    """One tensor elsewhere (the CPU step of a CUDA job, found on an H200) is refused by key
    before anything moves, not inside Triton."""
    view = _view()
    on_meta = allocate(view, 0, META)
    on_one_device(META, ("source", on_meta), ("destination", None))  # all on one: passes
    key = sorted(on_meta, key=repr)[0]
    mixed = {k: (torch.zeros(v.shape, dtype=v.dtype) if k == key else v)
             for k, v in on_meta.items()}
    try:
        on_one_device(META, ("source", on_meta), ("destination", mixed))
    except ValueError as err:
        assert str(err).startswith(f"destination storage {key} is on cpu, the rest of this "
                                   "process's storage on meta"), err
    else:
        raise AssertionError("a CPU tensor among meta storage passed")


def test_staging_arena_lives_on_the_state_device() -> None:
    assert Arena(META).buf.device == META
    assert Arena().buf.device == torch.device("cpu")


def test_process_order_is_the_jobs_rank_order_then_new_devices() -> None:
    # 12 nodes: sorted names would put node10 before node2, so process i would not be rank i.
    def layout(nodes: int, **par) -> Layout:
        return Layout(spec_from_dict({"model": TINY, "parallel": par,
                                      "world": {"nodes": nodes, "gpus_per_node": 1}}))
    a, b = layout(12, tp=2), layout(12, tp=2, pp=2)
    assert process_devices(plan_transition(a, b, 1 << 20)) == a.devices
    grow = layout(14, tp=2)
    assert process_devices(plan_transition(a, grow, 1 << 20)) == a.devices + grow.devices[12:]
    assert process_devices(plan_transition(grow, a, 1 << 20)) == grow.devices
