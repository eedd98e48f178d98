"""The IR against megatron-core itself: real models built on CPU under gloo, compared one to one.

For every configuration of the matrix, every rank's facts from ``dynatrain.ir.facts`` must equal
what the installed megatron-core reports (CI: 0.16.1 on Python 3.11, 0.19.2 on 3.12; a spec
means the installed version by default): coordinates and groups, each checkpoint ShardedTensor
(key, global shape/offset, local shape, fragmentations, replica id, the parameter it views and
where in it), ``named_parameters()`` order and shapes, DDP buffers (bucket bounds, per-parameter
ranges) and the DistributedOptimizer's per-rank ranges. Layouts that differ between versions:
``test_versions_parity.py``.
"""

from __future__ import annotations

import pytest

from dynatrain.ir.facts import rank_facts
from dynatrain.ir.layout import Layout
from matrix import CASES, to_harness_cfg, to_spec

harness = pytest.importorskip("megatron_support.harness")


def _sharded_key(rec: dict) -> tuple:
    return (rec["chunk"], rec["key"], tuple(rec["global_offset"]))


def _norm_sharded(rec: dict) -> dict:
    keep = ("global_shape", "local_shape", "axis_fragmentations", "replica_id", "param_name",
            "param_local_row_offset", "buffer_name")
    return {k: (list(rec[k]) if isinstance(rec.get(k), (list, tuple)) else rec.get(k))
            for k in keep}


def _named(layout: Layout, rank: int) -> list[tuple]:
    return [(cs.chunk.vp, sh.param.name, list(sh.local_shape))
            for cs in layout.rank_shards(rank) for sh in cs.shards]


def _opt(recs: list[dict] | None) -> set[tuple] | None:
    if recs is None:
        return None
    return {(r["chunk"], r["is_expert"], r["bucket"], r["param_name"], tuple(r["gbuf_world"]),
             tuple(r["gbuf_local"]), tuple(r["param"])) for r in recs}


def _buffers(recs: list[dict]) -> list[dict]:
    keep = ("chunk", "is_expert", "numel", "numel_unpadded", "data_parallel_world_size",
            "buckets", "param_index_map", "bucket_params")
    return [{k: r[k] for k in keep} for r in recs]


def compare_rank(layout: Layout, rank: int, real: dict) -> list[str]:
    """Every difference between the IR and megatron-core for one rank, as readable lines."""
    ours = rank_facts(layout, rank)
    diffs = []
    if ours["padded_vocab_size"] != real["padded_vocab_size"]:
        diffs.append(f"padded vocab {ours['padded_vocab_size']} != {real['padded_vocab_size']}")
    for k, v in ours["coords"].items():
        if real["coords"].get(k) != v:
            diffs.append(f"coord {k}: ours {v}, megatron {real['coords'].get(k)}")
    for k, v in ours["groups"].items():
        if k in real["groups"] and sorted(real["groups"][k]) != v:
            diffs.append(f"group {k}: ours {v}, megatron {sorted(real['groups'][k])}")
    want_named = [(p["chunk"], p["name"], list(p["shape"])) for p in real["named_parameters"]]
    if _named(layout, rank) != want_named:
        diffs.append(f"named_parameters: ours {_named(layout, rank)}\n   megatron {want_named}")
    real_sh = {_sharded_key(r): _norm_sharded(r) for r in real["params"]}
    our_sh = {_sharded_key(r): _norm_sharded(r) for r in ours["params"]}
    for k in sorted(set(real_sh) | set(our_sh), key=str):
        if real_sh.get(k) != our_sh.get(k):
            diffs.append(f"sharded {k}: ours {our_sh.get(k)}, megatron {real_sh.get(k)}")
    if _buffers(ours["buffers"]) != _buffers(real["buffers"]):
        diffs.append(f"buffers: ours {_buffers(ours['buffers'])}\n   megatron "
                     f"{_buffers(real['buffers'])}")
    if _opt(ours["optimizer"]) != _opt(real["optimizer"]):
        a, b = _opt(ours["optimizer"]) or set(), _opt(real["optimizer"]) or set()
        diffs.append(f"optimizer ranges: only ours {sorted(a - b)[:4]}, only megatron "
                     f"{sorted(b - a)[:4]}")
    return diffs


@pytest.mark.parametrize("cfg", CASES, ids=[c["name"] for c in CASES])
def test_ir_matches_megatron(cfg: dict) -> None:
    layout = Layout(to_spec(cfg))
    real = harness.megatron_facts(to_harness_cfg(cfg), cfg["world"])
    assert len(real) == layout.world
    diffs = [f"rank {r}: {d}" for r in range(layout.world) for d in compare_rank(layout, r,
                                                                                  real[r])]
    assert not diffs, "\n".join(diffs[:12])


def test_comparison_catches_a_wrong_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison is not vacuous: an IR that forgets the 64-element alignment, or that
    assigns the wrong TP degree, is reported on every rank."""
    cfg = next(c for c in CASES if c["name"] == "tp3-nonpow2")  # 48-wide: alignment matters
    real = harness.megatron_facts(to_harness_cfg(cfg), cfg["world"])
    wrong_tp = Layout(to_spec({**cfg, "tp": 1}))
    assert all(compare_rank(wrong_tp, r, real[r]) for r in range(wrong_tp.world))

    import dynatrain.ir.layout as layout_mod

    original = layout_mod.layout_buffer

    def unaligned(chunk, is_expert, dtype, params, dp_size, bucket_size, dist_opt):
        return original.__wrapped__(chunk, is_expert, dtype, params, dp_size, bucket_size, False)

    monkeypatch.setattr(layout_mod, "layout_buffer", unaligned)
    layout = Layout(to_spec(cfg))
    for r in range(layout.world):
        diffs = compare_rank(layout, r, real[r])
        assert any(d.startswith("buffers") for d in diffs), diffs
        assert any(d.startswith("optimizer ranges") for d in diffs)
