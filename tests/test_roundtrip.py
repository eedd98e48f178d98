"""Numeric round trip through the IR: random global tensors -> per-rank storage -> reassembled.

The per-rank storage is filled from the IR's regions, then checked against an independent numpy
oracle of Megatron's TP split (``np.split``; SwiGLU as ``[gate_r; up_r]``; vocab padded with
zero rows) and of the DistributedOptimizer shard (``param.view(-1)[start:end]``). Reassembling
all ranks' regions must give the global tensors back bit for bit, and every element must be held.
"""

from __future__ import annotations

import numpy as np
import pytest

from dynatrain.ir.layout import Layout
from dynatrain.ir.state import BufferSlot, FlatSlot, ParamSlot, StateView
from matrix import CASES, to_spec


def _globals(view: StateView, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {tk: rng.standard_normal(t.shape).astype(np.float32) if t.shape else
            np.float32(rng.standard_normal()) for tk, t in view.tensors().items()}


def _oracle_local(layout: Layout, rank: int, sh, full: np.ndarray) -> np.ndarray:
    """Megatron's TP shard of ``full`` (the unsplit param, vocab already padded)."""
    p, c = sh.param, layout.coords(rank)
    if p.split is None:
        return full
    group = p.split.group
    size = layout.parallel.tp if group == "tp" else layout.parallel.expert_tp
    r = c.tp if group == "tp" else c.etp
    if p.split.glu:
        gate, up = np.split(full, 2, axis=0)
        return np.concatenate([np.split(gate, size)[r], np.split(up, size)[r]], axis=0)
    return np.split(full, size, axis=p.split.dim)[r]


def _unsplit(layout: Layout, sh, g: np.ndarray) -> np.ndarray:
    """The full (TP-unsplit, vocab-padded) parameter out of its logical global tensor."""
    full = g[tuple(i for i, _ in sh.param.prepend)]
    if sh.param.split is not None and sh.param.split.vocab:
        pad = layout.padded_vocab - full.shape[0]
        full = np.concatenate([full, np.zeros((pad,) + full.shape[1:], full.dtype)])
    return full


@pytest.mark.parametrize("cfg", CASES, ids=[c["name"] for c in CASES])
def test_round_trip_bit_exact(cfg: dict) -> None:
    layout = Layout(to_spec(cfg))
    view = StateView(layout)
    glob = _globals(view, seed=len(cfg["name"]))
    back = {tk: np.full_like(np.asarray(g), np.nan) for tk, g in glob.items()}
    dist = layout.parallel.use_distributed_optimizer
    for rank in range(layout.world):
        shards = {(cs.chunk.vp, sh.param.name): sh for cs in layout.rank_shards(rank)
                  for sh in cs.shards}
        owned = {(b.chunk, o.name): o.param for b, rs in layout.rank_owned(rank) for o in rs}
        store: dict = {}
        regions = view.regions(rank)
        for reg in regions:  # scatter: global -> local storage, through the IR only
            g = np.asarray(glob[(reg.key, reg.kind)])
            data = g[tuple(slice(l, h) for l, h in zip(reg.box.lo, reg.box.hi))]
            s = reg.slot
            if isinstance(s, ParamSlot):
                sh = shards[(s.chunk, s.name)]
                arr = store.setdefault((reg.kind, s.chunk, s.name),
                                       np.zeros(sh.local_shape, np.float32))
                npre = len(sh.param.prepend)
                local = data.reshape(data.shape[npre:])
                arr[tuple(slice(o, o + n) for o, n in zip(s.local_offset, local.shape))] = local
            elif isinstance(s, FlatSlot):
                a, b = owned[(s.chunk, s.name)]
                arr = store.setdefault((reg.kind, s.chunk, s.name), np.full(b - a, np.nan,
                                                                            np.float32))
                arr[s.offset:s.offset + data.size] = data.reshape(-1)
            else:
                assert isinstance(s, BufferSlot)
                store[(reg.kind, s.chunk, s.name)] = np.array(data, copy=True)
        # Oracle: every local tensor equals Megatron's split of the global tensor.
        for (vp, name), sh in shards.items():
            full = _unsplit(layout, sh, glob[(sh.param.key, "param")])
            want = _oracle_local(layout, rank, sh, full)
            assert want.shape == sh.local_shape
            np.testing.assert_array_equal(store[("param", vp, name)].view(np.uint32),
                                          want.view(np.uint32), err_msg=name)
            if not dist:
                ofull = _unsplit(layout, sh, glob[(sh.param.key, "exp_avg")])
                np.testing.assert_array_equal(store[("exp_avg", vp, name)],
                                              _oracle_local(layout, rank, sh, ofull))
            elif (vp, name) in owned:
                a, b = owned[(vp, name)]
                ofull = _unsplit(layout, sh, glob[(sh.param.key, "exp_avg_sq")])
                want_flat = _oracle_local(layout, rank, sh, ofull).reshape(-1)[a:b]
                ones = np.ones_like(glob[(sh.param.key, "exp_avg_sq")])
                data = _oracle_local(layout, rank, sh, _unsplit(layout, sh, ones)).reshape(-1)
                real = data[a:b] == 1  # vocab padding rows carry no optimizer state
                got = store[("exp_avg_sq", vp, name)]
                assert np.isnan(got[~real]).all()
                np.testing.assert_array_equal(got[real].view(np.uint32),
                                              want_flat[real].view(np.uint32))
        for reg in regions:  # gather: local storage -> global, through the IR only
            s, sl = reg.slot, tuple(slice(l, h) for l, h in zip(reg.box.lo, reg.box.hi))
            arr = store[(reg.kind, s.chunk, s.name)]
            if isinstance(s, ParamSlot):
                shape = reg.box.shape[len(reg.box.shape) - arr.ndim:]
                part = arr[tuple(slice(o, o + n) for o, n in zip(s.local_offset, shape))]
            elif isinstance(s, FlatSlot):
                part = arr[s.offset:s.offset + reg.box.numel]
            else:
                part = arr
            if reg.box.shape == ():
                back[(reg.key, reg.kind)] = np.float32(part)
            else:
                back[(reg.key, reg.kind)][sl] = np.asarray(part).reshape(reg.box.shape)
    for tk, g in glob.items():
        np.testing.assert_array_equal(np.asarray(back[tk]).view(np.uint32),
                                      np.asarray(g).view(np.uint32), err_msg=str(tk))


@pytest.mark.parametrize("name", ["tp2-dp2", "cp2-tp2", "moe-ep2-etp1-tp2", "buckets-small"])
def test_optimizer_state_is_sharded_once_per_dp_group(name: str) -> None:
    """Within each data-parallel(-with-context) group every element the group's params cover is
    owned by exactly one rank's optimizer shard; params themselves are replicated over DP."""
    layout = Layout(to_spec(next(c for c in CASES if c["name"] == name)))
    view = StateView(layout)
    shapes = {tk: t.shape for tk, t in view.tensors().items()}
    groups = {layout.mesh.groups(r)["dp_cp"] for r in range(layout.world)}
    expert_keys = {sh.param.key for r in range(layout.world) for cs in layout.rank_shards(r)
                   for sh in cs.shards if layout.expert_in_own_buffer(sh.param)}
    for group in groups:
        held = {k: np.zeros(s, np.int32) for (k, kind), s in shapes.items() if kind == "param"}
        owned = {k: np.zeros_like(v) for k, v in held.items()}
        for rank in group:
            for reg in view.regions(rank):
                sl = tuple(slice(l, h) for l, h in zip(reg.box.lo, reg.box.hi))
                if reg.kind == "param" and rank == group[0]:
                    held[reg.key][sl] += 1
                elif reg.kind == "main_param":
                    owned[reg.key][sl] += 1
        for key in held:
            if key in expert_keys:
                continue  # expert buffers shard over expert-DP, checked below
            np.testing.assert_array_equal(owned[key], held[key], err_msg=key)
    egroups = {layout.mesh.groups(r)["edp"] for r in range(layout.world)}
    for group in egroups if expert_keys else ():
        for key in expert_keys:
            held = np.zeros(shapes[(key, "param")], np.int32)
            owned = np.zeros_like(held)
            for rank in group:
                for reg in view.regions(rank):
                    if reg.key != key:
                        continue
                    sl = tuple(slice(l, h) for l, h in zip(reg.box.lo, reg.box.hi))
                    if reg.kind == "param" and rank == group[0]:
                        held[sl] += 1
                    elif reg.kind == "main_param":
                        owned[sl] += 1
            assert held.max() == 1
            np.testing.assert_array_equal(owned, held, err_msg=key)
