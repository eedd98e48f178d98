"""The IR's Transformer Engine layouts against megatron-core's own TE spec, built over the CPU
TE stand-in (tests/te_standin) under gloo, compared rank by rank.

Per configuration and rank: everything ``tests/test_megatron_parity.compare_rank`` compares
(coordinates, groups, ``named_parameters()`` order and shapes, every checkpoint ShardedTensor,
DDP buffers and buckets, DistributedOptimizer ranges), plus every ``_extra_state``
ShardedObject (key, global shape and offset, replica id), whose data must be the empty uint8
tensor fp8-off TE saves, and which a save/load round trip through megatron leaves unchanged
(so a switch re-initialising it, as ``ir/state.py`` does, equals megatron's reload). ``FAST``
runs by default, with 30 random jobs using multi-latent attention or attention sinks drawn by the
gate's strategies; all ``CASES`` (43) behind ``slow``.
"""

from __future__ import annotations

import re

import pytest

from dynatrain.ir.facts import extra_state_facts
from dynatrain.ir.layout import Layout
from dynatrain.ir import versions
from dynatrain.ir.errors import SpecError
from dynatrain.ir.from_job import read_megatron
from te_cases import (CASES, CPU_INIT, FAST, default_request, random_cases, to_te_harness_cfg,
                      to_te_spec)

mcore = pytest.importorskip("megatron.core")
te = pytest.importorskip("megatron_support.te")
from test_megatron_parity import compare_rank

MCORE = tuple(int(x) for x in mcore.__version__.split(".")[:2])


def _objects(recs: list[dict]) -> dict[tuple, tuple]:
    return {(r["chunk"], r["key"], tuple(r["global_offset"])):
            (tuple(r["global_shape"]), tuple(r["replica_id"])) for r in recs}


def compare_te_rank(layout: Layout, rank: int, real: dict) -> list[str]:
    """``compare_rank`` plus the TE modules' ``_extra_state`` objects."""
    diffs = compare_rank(layout, rank, real)
    objs = real["probes"][0]["objects"]
    reload = real["probes"][0]["reload"]
    ours_objs = extra_state_facts(layout, rank)
    # A rank of empty pipeline stages (layout strings) holds no TE module to reload.
    if reload["changed"] or (not reload["modules"] and ours_objs):
        diffs.append(f"reloading _extra_state changed TE modules: {reload}")
    bad = [o["dict_key"] for o in objs if (o["data_dtype"], o["data_numel"]) != ("torch.uint8", 0)]
    if bad:
        diffs.append(f"non-empty _extra_state (fp8 is off): {bad[:4]}")
    ours, theirs = _objects(ours_objs), _objects(objs)
    if len(theirs) != len(objs):
        diffs.append("two _extra_state objects share a (chunk, key, offset)")
    if ours != theirs:
        a, b = set(ours.items()), set(theirs.items())
        diffs.append(f"_extra_state: only ours {sorted(a - b)[:3]}, only megatron "
                     f"{sorted(b - a)[:3]}")
    return diffs


def _check(cases: list[dict], results: list | None = None) -> None:
    if results is None:
        results = te.te_facts([(to_te_harness_cfg(c), c["world"]) for c in cases])
    failures = []
    for cfg, real in zip(cases, results):
        if isinstance(real, dict):
            failures.append(f"{cfg['name']}: megatron rejected it: {real['error']}")
            continue
        layout = Layout(to_te_spec(cfg))
        assert len(real) == layout.world
        failures += [f"{cfg['name']} rank {r}: {d}" for r in range(layout.world)
                     for d in compare_te_rank(layout, r, real[r])]
    names = sorted({f.split(" ")[0] for f in failures})
    assert not failures, f"{len(names)} configs differ: {names}\n" + "\n".join(
        f[:600] for f in failures[:12])


def test_te_fast_matrix_matches_megatron() -> None:
    _check(FAST, te.te_facts(default_request())[:len(FAST)])


def test_random_mla_and_sink_jobs_match_megatron() -> None:
    """30 random TE jobs with multi-latent attention, attention sinks or MTP (dense and MoE, any
    layout the gate draws up to 4 ranks) equal megatron-core on every rank."""
    cases = random_cases()
    assert len(cases) >= 30
    assert sum(bool(c.get("multi_latent_attention")) for c in cases) >= 10
    assert sum(c.get("softmax_type") == "learnable" for c in cases) >= 4
    assert sum(bool(c.get("mtp_num_layers")) for c in cases) >= 5
    start = len(default_request()) - len(cases) - 1
    _check(cases, te.te_facts(default_request())[start:start + len(cases)])


def test_cpu_initialised_expert_biases_follow_the_version() -> None:
    """With use_cpu_initialization, megatron-core 0.16 puts sequential TE experts' biases in the
    dense DDP buffer (averaged across EP ranks holding other experts): reading such a job is
    refused on 0.16, and on 0.19 (which marks them again) the IR equals megatron."""
    real = te.te_facts(default_request())[-1]
    version = versions.normalize(mcore.__version__)
    dense = {name for r in real for b in r["buffers"] if not b["is_expert"]
             for name in b["param_index_map"]}
    expert_biases = {n for n in dense if "local_experts" in n and n.endswith(".bias")}
    args = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                vocab_size=100, max_position_embeddings=64, num_experts=4,
                moe_ffn_hidden_size=32, expert_model_parallel_size=2, add_bias_linear=True,
                use_distributed_optimizer=True, bf16=True, use_cpu_initialization=True)
    w = {"nodes": 1, "gpus_per_node": 2}
    if versions.series(version).te_cpu_init_dense_expert_bias:
        assert expert_biases, "megatron-core 0.16 kept the expert biases in the expert buffer"
        with pytest.raises(SpecError) as err:
            read_megatron(args, w, megatron_core=version)
        assert str(err.value).startswith("use_cpu_initialization: is not supported")
    else:
        assert not expert_biases
        read_megatron(args, w, megatron_core=version)
        _check([CPU_INIT], [real])
    # Without it (or with grouped experts) the job reads on either version.
    read_megatron(dict(args, use_cpu_initialization=None), w, megatron_core=version)
    read_megatron(dict(args, moe_grouped_gemm=True), w, megatron_core=version)


def _te_attrs(cfg: dict, name: str) -> tuple | None:
    """(tensor_model_parallel, partition_dim, partition_stride) a TE-owned weight or norm
    param must carry after megatron's wrappers ran; None for params TE does not own."""
    glu = 2 if cfg.get("swiglu") else 1
    if re.search(r"(layer_norm_(weight|bias)|layernorm\.(weight|bias))$", name):
        return (False, -1, 1)  # TE norms set only sequence_parallel (layernorm_linear.py:1653)
    expert = re.search(r"\.experts\.(local_experts\.\d+\.)?(linear_fc\d)\.weight\d*$", name)
    if expert and MCORE >= (0, 19):
        # 0.19 rewrites expert TP attributes: dim 1 for row, else 0, stride 1 even for GLU fc1
        # (M19 extensions/transformer_engine.py:91-123)
        return (True, 1 if expert.group(2) == "linear_fc2" else 0, 1)
    if re.search(r"\.experts\.linear_fc\d\.(weight|bias)\d+$", name):
        return (False, -1, 1)  # TE 2.20 GroupedLinear: no TP attributes (grouped_linear.py:1978)
    m = re.search(r"\.(linear_qkv|linear_proj|linear_fc1|linear_fc2)\.weight$", name)
    if m is None:
        return None
    fc = m.group(1)
    stride = glu if fc == "linear_fc1" else 1  # megatron sets partition_stride (ext:988, 849)
    explicit = ".local_experts." in name and (cfg.get("ep", 1) > 1 or
                                               (cfg.get("etp") or cfg.get("tp", 1)) > 1)
    # Linear sets dim 1 for row mode, else 0 (linear.py:1857-1862); megatron hands expert
    # linears to TE with parallel_mode None when it does their communication itself.
    row = fc in ("linear_proj", "linear_fc2") and not explicit
    return (True, 1 if row else 0, stride)


def test_te_parameters_carry_te_attributes() -> None:
    """dtype (params_dtype: bf16) and the TP attributes of every TE-owned parameter, as TE's
    reset_parameters and megatron's wrappers set them."""
    checked = 0
    for cfg, real in zip(FAST, te.te_facts(default_request())):
        for p in real[0]["named_parameters"]:
            assert p["dtype"] == "torch.bfloat16", (cfg["name"], p["name"])
            want = _te_attrs(cfg, p["name"])
            if want is not None:
                got = (p["tensor_model_parallel"], p["partition_dim"], p["partition_stride"])
                assert got == want, (cfg["name"], p["name"])
                checked += 1
    assert checked > 100


def test_comparison_catches_the_local_layout() -> None:
    """Not vacuous: the local spec's layout of the same model (input norm first, pre-MLP norm
    on its own, sequential expert names) differs from megatron's TE build on every rank."""
    for cfg, real in zip(FAST, te.te_facts(default_request())):
        spec = to_te_spec(cfg)
        local = Layout(spec.model_copy(update={"model": spec.model.model_copy(update={
            "transformer_impl": "local", "moe_grouped_gemm": False})}))
        for r in range(local.world):
            diffs = compare_te_rank(local, r, real[r])
            assert any(d.startswith("named_parameters") for d in diffs), (cfg["name"], r)
            assert any(d.startswith("_extra_state") for d in diffs)


@pytest.mark.slow
def test_te_full_matrix_matches_megatron() -> None:
    assert len(CASES) >= 30
    _check(CASES)
