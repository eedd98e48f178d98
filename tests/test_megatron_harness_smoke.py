"""Smoke tests for the megatron-core ground-truth harness (tests/megatron_support).

They build real megatron-core 0.16.1 models on CPU (forked gloo workers) and check that the
facts are internally consistent: checkpoint shards tile their global tensors, DDP buckets
partition the buffers, and DistributedOptimizer shards cover every parameter exactly once.
"""

import math
import time
from collections import defaultdict

import pytest

pytest.importorskip("megatron.core")

try:
    from tests.megatron_support import harness
    from tests.megatron_support import MegatronBuildError, mcore_rejects, megatron_facts
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from megatron_support import harness
    from megatron_support import MegatronBuildError, mcore_rejects, megatron_facts

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=200)


def _check_tiling(facts):
    """For every checkpoint key, the main replicas (replica_id all 0) tile the global tensor."""
    pieces = defaultdict(list)
    shapes = {}
    for f in facts:
        for p in f["params"]:
            assert p["param_name"] or p["buffer_name"], p
            shapes.setdefault(p["key"], p["global_shape"])
            assert shapes[p["key"]] == p["global_shape"], p["key"]
            if all(r == 0 for r in p["replica_id"]):
                pieces[p["key"]].append(p)
    assert set(pieces) == set(shapes), "some key has no main replica"
    for key, ps in pieces.items():
        offsets = {tuple(p["global_offset"]) for p in ps}
        assert len(offsets) == len(ps), f"{key}: two main replicas at the same offset"
        covered = sum(math.prod(p["local_shape"]) for p in ps)
        assert covered == math.prod(shapes[key]), f"{key}: {covered} != {shapes[key]}"


def _check_buffers_and_optimizer(facts):
    for f in facts:
        numels = {(p["chunk"], p["name"]): math.prod(p["shape"]) for p in f["named_parameters"]}
        for buf in f["buffers"]:
            buckets = buf["buckets"]
            assert buckets[0][0] == 0 and buckets[-1][1] == buf["numel"]
            for (s0, e0), (s1, _) in zip(buckets, buckets[1:]):
                assert s0 < e0 == s1, buckets
            spans = sorted(buf["param_index_map"].values())
            for (s0, e0), (s1, _) in zip(spans, spans[1:]):
                assert e0 <= s1
            for name, (s, e) in buf["param_index_map"].items():
                assert e - s == numels[(buf["chunk"], name)]
                bs, be = buckets[buf["param_bucket"][name]]
                assert bs <= s < e <= be
        for o in f["optimizer"] or []:
            assert o["main_param_numel"] == o["param"][1] - o["param"][0]
    # Across the data-parallel shards of one buffer, every parameter is owned exactly once.
    if facts[0]["optimizer"] is None:
        return
    owned = defaultdict(int)  # (group of ranks, chunk, buffer, param) -> elements
    for f in facts:
        for o in f["optimizer"]:
            grp = "intra_edp" if o["is_expert"] else "intra_dp_cp"
            k = (tuple(f["groups"][grp]), o["chunk"], o["buffer"], o["param_name"])
            owned[k] += o["param"][1] - o["param"][0]
    for f in facts:
        for bi, buf in enumerate(f["buffers"]):
            grp = tuple(f["groups"]["intra_edp" if buf["is_expert"] else "intra_dp_cp"])
            assert len(grp) == buf["data_parallel_world_size"]
            for name, (s, e) in buf["param_index_map"].items():
                assert owned[(grp, buf["chunk"], bi, name)] == e - s, name


def test_tp2_swiglu_gqa_distributed_optimizer():
    t0 = time.monotonic()
    cfg = dict(TINY, num_query_groups=2, swiglu=True, tp=2)
    facts = megatron_facts(cfg, 4)
    assert time.monotonic() - t0 < 10
    assert [f["rank"] for f in facts] == [0, 1, 2, 3]
    assert all(f["padded_vocab_size"] == 256 for f in facts)
    assert facts[1]["coords"]["tp"] == 1 and facts[2]["coords"]["dp"] == 1
    assert facts[0]["groups"]["tp"] == [0, 1] and facts[0]["groups"]["dp"] == [0, 2]
    _check_tiling(facts)
    _check_buffers_and_optimizer(facts)
    # TP2 shards of linear_qkv concatenate (dim 0) to the global [ng*(np/ng+2)*hn, H] shape.
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    shapes = [next(p["shape"] for p in facts[r]["named_parameters"] if p["name"] == name) for r in (0, 1)]
    assert shapes[0][0] + shapes[1][0] == 2 * (4 // 2 + 2) * 16 and shapes[0][1] == 64
    # SwiGLU fc1 is saved as two factory pieces per rank: gate rows at offset 0, up rows after.
    fc1 = [p for p in facts[1]["params"] if p["param_name"] == "decoder.layers.0.mlp.linear_fc1.weight"]
    assert sorted(p["param_local_row_offset"] for p in fc1) == [0, 64]
    assert sorted(p["global_offset"][1] for p in fc1) == [64, 192]


def test_pp2_vpp2_tied_embeddings_and_buckets():
    facts = megatron_facts(dict(TINY, num_layers=4, pp=2, vpp=2, bucket_size=1000), 2)
    assert [c["layer_numbers"] for c in facts[0]["chunks"]] == [[1], [3]]
    assert [c["layer_numbers"] for c in facts[1]["chunks"]] == [[2], [4]]
    assert facts[0]["groups"]["embedding"] == [0, 1]
    _check_tiling(facts)
    _check_buffers_and_optimizer(facts)
    # pp0/chunk0 honours bucket_size (several buckets); the other chunk does not.
    b0 = [b for b in facts[0]["buffers"] if b["chunk"] == 0][0]
    assert len(b0["buckets"]) > 2
    # The last stage's tied output layer is a checkpoint replica of the word embeddings.
    out = [p for p in facts[1]["params"] if p["param_name"] == "output_layer.weight"]
    assert len(out) == 1 and out[0]["key"] == "embedding.word_embeddings.weight"
    assert out[0]["replica_id"][0] == 1
    last = [b for b in facts[1]["buffers"] if b["chunk"] == 1][0]
    assert ["output_layer.weight"] in last["bucket_params"]  # shared embedding: own bucket


def test_moe_ep2_shared_expert_expert_bias():
    cfg = dict(TINY, swiglu=True, num_moe_experts=4, moe_ffn_hidden_size=32, ep=2, etp=1, tp=2,
               moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=64)
    facts = megatron_facts(cfg, 4)
    _check_tiling(facts)
    _check_buffers_and_optimizer(facts)
    f = facts[1]
    assert f["coords"]["ep"] == 1 and f["groups"]["edp"] == [1, 3]
    assert [b["is_expert"] for b in f["buffers"]] == [False, True]
    bias = [p for p in f["params"] if p["buffer_name"]]
    assert bias and all(p["key"].endswith("router.expert_bias") for p in bias)
    experts = [p for p in f["params"] if p["key"] == "decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert {p["global_offset"][1] for p in experts} == {2, 3}  # ep rank 1 owns experts 2, 3


def test_megatron_rejection_is_reported():
    msg = mcore_rejects(dict(TINY, tp=3), 3)
    assert msg is not None and "num_attention_heads" in msg
    assert mcore_rejects(dict(TINY), 1) is None


def test_worker_failure_on_one_rank_propagates(monkeypatch):
    real = harness._build_and_extract

    def failing(rank, c):
        if rank == 1:
            raise ValueError("boom on rank 1")
        return real(rank, c)

    monkeypatch.setattr(harness, "_build_and_extract", failing)
    t0 = time.monotonic()
    with pytest.raises(MegatronBuildError) as ei:
        megatron_facts(dict(TINY), 2)
    assert time.monotonic() - t0 < 30
    assert ei.value.rank == 1 and "boom on rank 1" in ei.value.message
    assert "Traceback" in ei.value.worker_traceback


def test_hung_worker_times_out(monkeypatch):
    monkeypatch.setattr(harness, "_build_and_extract", lambda rank, c: time.sleep(60))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        megatron_facts(dict(TINY), 2, timeout=1.0)
    assert time.monotonic() - t0 < 10


def test_unknown_cfg_key_is_refused():
    with pytest.raises(ValueError, match="unknown cfg keys"):
        megatron_facts(dict(TINY, tensor_parallel=2), 2)
