"""Confirm the [inf] items of docs/megatron-layout.md against real megatron-core on CPU.

The installed one (0.16.1 on Python 3.11, 0.19.2 on 3.12); where the two versions differ (§3:
EP=1 with ETP != TP) the test asserts each version's own behaviour.

Each test builds real megatron objects (forked gloo workers, ``megatron_support.harness``; the
extra measurements come from ``megatron_support.probes``) or calls megatron functions directly,
and asserts the concrete fact the layout notes infer. Section numbers refer to those notes.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest

harness = pytest.importorskip("megatron_support.harness")
megatron_facts = harness.megatron_facts

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
            vocab_size=200, make_vocab_size_divisible_by=16)
TOKENS = [[3, 17, 150, 199, 42, 7, 88, 120]]
LABELS = [[17, 150, 199, 42, 7, 88, 120, 5]]

VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _probe_results(facts: list[dict], i: int) -> list:
    return [f["probes"][i] for f in facts]


# ---------------------------------------------------------------------------------------------
# §1 + §5: one tp2 x dp2 build (untied, so both vocab parameters exist), several probes.
# ---------------------------------------------------------------------------------------------

TP2_PROBES = [
    dict(name="optimizer_sharded_state_dict", sharding_type="fully_reshardable", is_loading=True),
    dict(name="optimizer_sharded_state_dict", sharding_type="fully_reshardable", is_loading=False),
    dict(name="optimizer_sharded_state_dict", sharding_type="fully_sharded_model_space"),
    dict(name="optimizer_sharded_state_dict", sharding_type=None),  # megatron's default
]


@pytest.fixture(scope="module")
def tp2_facts():
    cfg = dict(TINY, tp=2, untie_embeddings_and_output_weights=True, probes=TP2_PROBES)
    return megatron_facts(cfg, 4)


@pytest.mark.parametrize("probe", [0, 1], ids=["load", "save"])
def test_optimizer_state_of_vocab_params_keeps_allow_shape_mismatch(tp2_facts, probe):
    """§1: fully_reshardable optimizer-state ShardedTensors are ``replace(model_sh_ten, ...)``,
    so the embedding/output-layer states carry the model's ``allow_shape_mismatch=True``."""
    for f, res in zip(tp2_facts, _probe_results(tp2_facts, probe)):
        assert "error" not in res, res
        model = {p["key"]: p for p in f["params"]}
        for key in VOCAB_KEYS:
            assert model[key]["allow_shape_mismatch"] is True
        states = {l["key"]: l for l in res["leaves"] if l["key"].startswith("optimizer.state.")}
        for key in VOCAB_KEYS:
            for kind in ("param", "exp_avg", "exp_avg_sq"):
                st = states[f"optimizer.state.{kind}.{key}"]
                assert st["allow_shape_mismatch"] is True, st
                assert st["global_shape"] == [224, 64] == model[key]["global_shape"]
                assert st["global_offset"] == model[key]["global_offset"]
        # The flag is copied per parameter, not set for every optimizer state.
        others = [l for k, l in states.items() if not any(k.endswith(v) for v in VOCAB_KEYS)]
        assert others and not any(l["allow_shape_mismatch"] for l in others)


def test_new_vocab_padding_rows_of_optimizer_state_are_zero_after_load(tmp_path):
    """§1: save model + fully_reshardable optimizer state at Vp=224 (divisible_by 16, tp2), load
    at Vp=256 (divisible_by 64): the loaded exp_avg/exp_avg_sq/param rows 224..255 of the vocab
    params are zero-filled, rows < 224 hold the saved values (exp_avg 1, exp_avg_sq 2)."""
    base = dict(TINY, tp=2, untie_embeddings_and_output_weights=True)
    megatron_facts(dict(base, probes=[dict(name="dist_ckpt_save", path=str(tmp_path))]), 2)
    facts = megatron_facts(dict(base, make_vocab_size_divisible_by=64, probes=[
        dict(name="dist_ckpt_load", path=str(tmp_path), keys_containing="weight")]), 2)
    seen = defaultdict(set)
    for res in _probe_results(facts, 0):
        for t in res:
            key = t["key"]
            if not any(key.endswith(v) for v in VOCAB_KEYS):
                continue
            assert t["allow_shape_mismatch"] and t["shape"] == [128, 64]
            for i, vals in enumerate(t["row_values"]):
                row = t["global_offset"][0] + i
                seen[key].add(row)
                if row >= 224:
                    assert vals == [0.0], (key, row, vals)
                elif ".exp_avg_sq." in key:
                    assert vals == [2.0], (key, row, vals)
                elif ".exp_avg." in key:
                    assert vals == [1.0], (key, row, vals)
                else:  # model weight / fp32 main param: the saved (random-initialised) rows
                    assert vals != [0.0], (key, row, vals)
    for key in VOCAB_KEYS:
        for prefix in ("", "optimizer.state.param.", "optimizer.state.exp_avg.",
                       "optimizer.state.exp_avg_sq."):
            assert seen[prefix + key] == set(range(256)), prefix + key


def test_flattened_range_path_is_dead_through_the_optimizer(tp2_facts):
    """§5: DistributedOptimizer.sharded_state_dict with 'fully_sharded_model_space' (also the
    default when metadata names no sharding type) raises in 0.16.1."""
    for probe in (2, 3):
        for res in _probe_results(tp2_facts, probe):
            assert res.get("error") == (
                "CheckpointingException: ShardedTensor.flattened_range is not supported.")


def test_sharded_tensor_with_flattened_range_is_refused():
    """§5, directly against megatron.core.dist_checkpointing."""
    import torch
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    data = torch.zeros(6)
    kw = dict(key="k", data=data, dtype=data.dtype, local_shape=(2, 6), global_shape=(4, 6),
              global_offset=(0, 0), axis_fragmentations=(2, 1))
    with pytest.raises(CheckpointingException, match="flattened_range is not supported"):
        ShardedTensor(**kw, flattened_range=slice(0, 6))
    ok = ShardedTensor(**dict(kw, data=torch.zeros(2, 6)))  # same metadata without the range
    assert ok.flattened_range is None
    # The flat constructor the error message of from_rank_offsets points to is gone.
    assert not hasattr(ShardedTensor, "from_rank_offsets_flat")
    with pytest.raises(ValueError, match="from_rank_offsets_flat"):
        ShardedTensor.from_rank_offsets("k", torch.zeros(2, 6), (0, 0, 2),
                                        flattened_range=slice(0, 6))


# ---------------------------------------------------------------------------------------------
# §1: padded logits enter the softmax
# ---------------------------------------------------------------------------------------------


def _lse(xs):
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def test_padded_logits_enter_the_softmax():
    """§1: same real weights, padding rows zero, Vp=224 vs Vp=256 (tp2): the output layer
    yields Vp logit columns (padding columns exactly 0), megatron's vocab-parallel cross entropy
    equals log-sum-exp over all Vp columns, so the loss changes with the padding."""
    runs = {}
    for m in (16, 64):
        cfg = dict(TINY, tp=2, make_vocab_size_divisible_by=m, probes=[
            dict(name="forward_loss", vocab_size=200, tokens=TOKENS, labels=LABELS)])
        runs[m] = _probe_results(megatron_facts(cfg, 2), 0)
    full = {}
    for m, vp in ((16, 224), (64, 256)):
        res = sorted(runs[m], key=lambda r: r["vocab_start"])
        assert [r["logits_shape"] for r in res] == [[1, 8, vp // 2]] * 2
        assert res[0]["loss"] == res[1]["loss"]  # the loss is reduced over the TP group
        rows = [res[0]["logits"][0][s] + res[1]["logits"][0][s] for s in range(8)]
        assert all(len(r) == vp for r in rows)
        assert all(x == 0.0 for r in rows for x in r[200:])  # zero padding rows -> logit 0
        for s, r in enumerate(rows):
            z_label = r[LABELS[0][s]]
            assert res[0]["loss"][0][s] == pytest.approx(_lse(r) - z_label, abs=2e-3)
            assert abs(res[0]["loss"][0][s] - (_lse(r[:200]) - z_label)) > 0.02
        full[m] = (rows, res[0]["loss"][0])
    for s in range(8):
        real16, real64 = full[16][0][s][:200], full[64][0][s][:200]
        assert max(abs(a - b) for a, b in zip(real16, real64)) < 2e-2  # same real logits
        # ... yet the loss differs by log((S + 56) / (S + 24)) with S = sum over real exp(z).
        s_real = math.exp(_lse(real16))
        expected = math.log((s_real + 56) / (s_real + 24))
        assert full[64][1][s] - full[16][1][s] == pytest.approx(expected, abs=3e-3)
        assert full[64][1][s] - full[16][1][s] > 0.05


# ---------------------------------------------------------------------------------------------
# §2: tied embeddings with pp > 1
# ---------------------------------------------------------------------------------------------


def test_tied_output_copy_matches_embedding_and_its_optimizer_state():
    """§2: pp2 x dp2, tied. After construction the last stage's output_layer.weight equals the
    first stage's embedding bit for bit, both are flagged shared_embedding, and each copy's
    DistributedOptimizer shard (same ranges over its own DP group) holds the same fp32 main
    param; after one real training step (1F1B + finalize_model_grads + optimizer.step) the two
    copies, main params, exp_avg and exp_avg_sq are still identical."""
    cfg = dict(TINY, pp=2, probes=[
        "embedding_copies",
        dict(name="train_step", tokens=TOKENS, labels=LABELS, lr=1e-2),
        "embedding_copies",
    ])
    facts = megatron_facts(cfg, 4)
    by_dp = defaultdict(dict)
    for f in facts:
        assert f["groups"]["embedding"] == sorted(f["groups"]["pp"])
        for when in (0, 2):
            (rec,) = f["probes"][when]
            by_dp[(when, f["coords"]["dp"])][f["coords"]["pp"]] = rec
        assert f["probes"][1]["ok"]
    for (when, dp), recs in by_dp.items():
        first, last = recs[0], recs[1]
        assert first["name"] == "embedding.word_embeddings.weight" and first["shared_embedding"]
        assert last["name"] == "output_layer.weight" and last["shared_embedding"] and last["shared"]
        assert first["shape"] == last["shape"] == [208, 64]
        assert first["abs_sum"] > 0 and first["sha256"] == last["sha256"]
        (s0,), (s1,) = first["shards"], last["shards"]
        assert s0["param_range"] == s1["param_range"]
        assert s0["param_range"] == [dp * 6656, (dp + 1) * 6656]
        state_keys = {k for k in s0 if k.endswith("_sha256")}
        if when == 2:
            assert {"exp_avg_sha256", "exp_avg_sq_sha256"} <= state_keys
        for k in state_keys:
            assert s0[k] == s1[k], (when, dp, k)
    # The step did change the weights (so the equality after it is not vacuous).
    assert by_dp[(0, 0)][0]["sha256"] != by_dp[(2, 0)][0]["sha256"]


# ---------------------------------------------------------------------------------------------
# §3: local spec, EP=1, ETP != TP, distributed optimizer
# ---------------------------------------------------------------------------------------------

EP1_ETP4 = dict(num_layers=1, hidden_size=48, num_attention_heads=4, ffn_hidden_size=96,
                vocab_size=200, make_vocab_size_divisible_by=16, num_moe_experts=4,
                moe_ffn_hidden_size=20, moe_router_topk=2, ep=1, etp=4)


def _installed_series() -> tuple[int, int]:
    from dynatrain.ir import versions

    return versions.series_key(versions.normalize(pytest.importorskip("megatron.core")
                                                  .__version__))


EP1_ETP4_ENTRY = {"name": "ep1-etp4", "world": 4, "max_position_embeddings": 64, **EP1_ETP4}


def test_ep1_etp_ne_tp_expert_optimizer_state():
    """§3, 4 ranks, dp4, etp4, ep1, against the installed megatron-core.

    0.16: the expert weights (ETP slice = etp rank) sit in the dense buffer, sharded over the
    dense DP group that spans all four slices. Of the 7680 global expert-weight elements only
    1920 have optimizer state on some rank (5760 have none), and the dense-buffer
    reduce-scatter averages gradients of different slices (synthetic grads: slice k
    contributes k+1; the owner gets (1+2+3+4)/4 = 2.5 instead of its own value).

    0.19: expert params leave the dense buffer whenever ETP != TP (M19
    tensor_parallel/layers.py:961-964, 1379-1383): each rank has an expert buffer sharded over
    expert DP (one rank here), so all 7680 elements have optimizer state and each rank's
    reduced gradient is its own slice's, (k+1)/4 with megatron's 1/dp gradient scaling
    (M19 distributed/distributed_data_parallel.py:185-213). DynaTrain's IR of the same spec
    equals megatron's facts on every rank."""
    from matrix import to_harness_cfg

    facts = megatron_facts(dict(to_harness_cfg(EP1_ETP4_ENTRY), probes=["expert_grad_reduce"]),
                           4)
    own_buffer = _installed_series() >= (0, 19)
    total, owned = 0, set()
    for f in facts:
        etp = f["coords"]["etp"]
        assert f["groups"]["dp"] == [0, 1, 2, 3] and f["groups"]["edp"] == [f["rank"]]
        assert sorted(f["groups"]["etp"]) == [0, 1, 2, 3]
        experts = [p for p in f["named_parameters"] if ".experts." in p["name"]]
        assert experts and all(p["is_expert"] == own_buffer for p in experts)
        assert [b["is_expert"] for b in f["buffers"]] == ([False, True] if own_buffer
                                                          else [False])
        total += sum(math.prod(p["shape"]) for p in experts)
        for o in f["optimizer"]:
            if ".experts." in o["param_name"]:
                assert o["is_expert"] == own_buffer
                owned.update((etp, o["param_name"], i) for i in range(*o["param"]))
    assert total == 7680
    reduced = [(f["coords"]["etp"], r) for f in facts for r in f["probes"][0]]
    assert reduced
    if not own_buffer:
        assert len(owned) == 1920 and total - len(owned) == 5760
        for _, r in reduced:
            assert r["reduced_values"] == [2.5] != [r["own_value"]]
        return
    assert len(owned) == total  # every expert element has optimizer state
    for etp, r in reduced:
        assert r["own_value"] == etp + 1 and r["reduced_values"] == [(etp + 1) / 4]
    from dynatrain.ir.layout import Layout
    from dynatrain.ir.loader import spec_from_dict
    from matrix import to_spec_dict
    from test_megatron_parity import compare_rank

    layout = Layout(spec_from_dict(to_spec_dict(EP1_ETP4_ENTRY)))
    diffs = [d for r in range(4) for d in compare_rank(layout, r, facts[r])]
    assert not diffs, diffs[:4]


def test_dynatrain_rejects_ep1_etp_ne_tp_with_distributed_optimizer_on_0_16_only():
    """The refusal protects 0.16 jobs (the state loss above); a 0.19 spec is accepted and laid
    out with the experts in their own buffer; a spec without ``megatron_core`` means the
    installed version, so it is refused exactly where the installed megatron loses the state."""
    from dynatrain.ir.errors import SpecError
    from dynatrain.ir.layout import Layout
    from dynatrain.ir.loader import spec_from_dict
    from matrix import to_spec_dict

    def spec(version: str | None, **kw):
        doc = to_spec_dict(dict(EP1_ETP4_ENTRY, **kw))
        return spec_from_dict(doc if version is None else dict(doc, megatron_core=version))

    with pytest.raises(SpecError) as ei:
        spec("0.16.1")
    assert ei.value.field == "parallel.etp" and ei.value.value == 4
    assert "0.16.1" in str(ei.value)
    # The same model is accepted with etp == tp, or without the distributed optimizer.
    spec("0.16.1", etp=1)
    spec("0.16.1", use_distributed_optimizer=False)
    layout = Layout(spec("0.19.2"))
    assert all(any(b.is_expert for b in layout.rank_buffers(r)) for r in range(4))
    if _installed_series() == (0, 16):
        with pytest.raises(SpecError):
            spec(None)
    else:
        assert spec(None).megatron_core.startswith("0.19.")


# ---------------------------------------------------------------------------------------------
# §5: dp_reshardable (bucket space)
# ---------------------------------------------------------------------------------------------

BUCKET_KEY = ("optimizer.distributed.dp_group_idx_{}.gbuf_idx_{}"
              ".dtype_(torch.bfloat16, torch.float32).bucket_idx_{}.{}")


def test_dp_reshardable_bucket_tensors_have_unpadded_bucket_size():
    """§5: dp3 with several (padded) buckets: every bucket-space ShardedTensor has global shape
    (numel_unpadded of its bucket,), per_bucket_numel_unpadded matches the DDP buckets, and the
    ranks' pieces (params plus intra-bucket padding) tile [0, numel_unpadded) exactly."""
    probe = dict(name="optimizer_sharded_state_dict", sharding_type="dp_reshardable")
    facts = megatron_facts(dict(TINY, bucket_size=4000, probes=[probe]), 3)
    buf = facts[0]["buffers"][0]
    sizes = [e - s for s, e in buf["buckets"]]
    unpadded = buf["bucket_numel_unpadded"]
    assert len(sizes) > 2 and any(u < s for u, s in zip(unpadded, sizes))
    pieces = defaultdict(list)
    for f in facts:
        res = f["probes"][0]
        assert res["per_bucket_numel_unpadded"] == [[{"(torch.bfloat16, torch.float32)": unpadded}]]
        for leaf in res["leaves"]:
            if leaf["kind"] == "tensor":
                pieces[leaf["key"]].append(leaf)
    assert set(pieces) == {BUCKET_KEY.format(0, 0, b, k) for b in range(len(sizes))
                           for k in ("param", "exp_avg", "exp_avg_sq")}
    for key, ps in pieces.items():
        b = int(key.split("bucket_idx_")[1].split(".")[0])
        assert {tuple(p["global_shape"]) for p in ps} == {(unpadded[b],)}
        spans = sorted((p["global_offset"][0], p["global_offset"][0] + p["local_shape"][0])
                       for p in ps)
        assert spans[0][0] == 0 and spans[-1][1] == unpadded[b]
        assert all(e0 == s1 for (_, e0), (s1, _) in zip(spans, spans[1:])), key


def test_dp_reshardable_cannot_see_an_ep_etp_change():
    """§5: the loader's only layout check for dp_reshardable is per_bucket_numel_unpadded (and
    the keys / global shapes). W=4, tp1: EP2/ETP2 and EP4/ETP1 hold different expert slices on
    every rank, yet produce identical keys, global shapes and per-bucket sizes, so such a change
    is not caught at all (the 'at best' of the notes is an upper bound)."""
    probe = dict(name="optimizer_sharded_state_dict", sharding_type="dp_reshardable")
    moe = dict(TINY, num_moe_experts=4, moe_ffn_hidden_size=32, probes=[probe])
    a = megatron_facts(dict(moe, ep=2, etp=2), 4)
    b = megatron_facts(dict(moe, ep=4, etp=1), 4)

    def signature(f):
        res = f["probes"][0]
        shapes = sorted({(l["key"], tuple(l["global_shape"])) for l in res["leaves"]
                         if l["kind"] == "tensor"})
        return res["per_bucket_numel_unpadded"], res["data_parallel_group_idx"], shapes

    def experts_held(f):
        return sorted({(tuple(p["global_offset"]), tuple(p["local_shape"])) for p in f["params"]
                       if p["key"].endswith("experts.experts.linear_fc1.weight")})

    for fa, fb in zip(a, b):
        assert signature(fa) == signature(fb)
        assert experts_held(fa) != experts_held(fb)


# ---------------------------------------------------------------------------------------------
# §7: RNG trackers
# ---------------------------------------------------------------------------------------------


def test_model_parallel_cuda_manual_seed_offsets(monkeypatch):
    """§7: run megatron's real model_parallel_cuda_manual_seed with its real
    CudaRNGStatesTracker, the CUDA generator calls redirected to one CPU generator; every tracked
    state equals a generator seeded with the documented seed."""
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    # Restore megatron's module-level tracker afterwards (later forked tests rely on it).
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", mrandom._CUDA_RNG_STATE_TRACKER)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
                        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    gen = torch.Generator()
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: (seeded.append(s), gen.manual_seed(s)))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **k: gen.get_state())
    monkeypatch.setattr(mrandom, "_set_cuda_rng_state", lambda st, *a, **k: gen.set_state(st))

    def state(seed):
        return torch.Generator().manual_seed(seed).get_state()

    seed, tp, ep, etp = 1234 + 100 * 3, 1, 2, 3
    mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=tp, ep_rank=ep, etp_rank=etp,
                                            force_reset_rng=True)
    states = mrandom.get_cuda_rng_tracker().get_states()
    expected = {"data-parallel-rng": seed, "model-parallel-rng": seed + 2718 + tp,
                "expert-parallel-rng": seed + 1024 + 100 * ep + etp}
    assert set(states) == set(expected)
    for name, s in expected.items():
        assert torch.equal(states[name], state(s)), name
    assert seeded[0] == seed  # the default CUDA generator gets the plain seed

    # The inference tracker the CPU harness uses records nothing.
    mrandom.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, tp_rank=tp,
                                            ep_rank=ep, etp_rank=etp, force_reset_rng=True)
    assert mrandom.get_cuda_rng_tracker().get_states() == {}
