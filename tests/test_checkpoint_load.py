"""A megatron dist checkpoint loaded straight into any layout, bit for bit (issue 20, part 3).

A real megatron-core job (the installed one: 0.16.1 on Python 3.11, 0.19.2 on 3.12; TP2·DP2,
GQA, SwiGLU, vocab 200 padded to 224) trains one step in forked gloo workers and saves a
``torch_dist`` checkpoint with ``dist_checkpointing.save`` (model + fully_reshardable optimizer,
as Megatron-LM does). Then, in this process:

* **load vs an independent oracle.** For each destination layout, ``load_checkpoint_ranks``
  must give every rank exactly the storage the IR assigns it (``storage.fill_from_global``) from
  global tensors assembled from the *source job's* own ``sharded_state_dict`` records: every
  storage tensor equal bit for bit, vocab padding rows the checkpoint lacks left zero.
* **megatron's own reload.** the installed megatron-core's loader, in real TP2·PP2·VPP2 and
  PP2·DP2 jobs, gives the same state as ours (a second, independent reference);
  ``load_checkpoint_into`` a fresh job of the same layout makes megatron's own view of it (module state, DDP buffers,
  optimizer state, step) equal to the megatron-loaded job's, and the next step's losses agree.
* **bounded reads.** One rank reads only the chunks that meet what it holds; chunks in flight
  never exceed the budget (one chunk when the budget is smaller than any chunk).
* **only what was lost.** ``only=`` (a ``LostState`` or boxes) reads just the chunks that meet
  those boxes and writes just them into existing storage; everything else stays as it was.
* **the common state** (Adam's step): ``common.pt`` as 0.16 writes it, the ``common_state``
  entry as 0.19 writes it; both read like megatron's own ``load_common_state_dict``.
* **refusals.** Missing directory, truncated chunk file, ``.metadata`` that would unpickle a
  class outside the allow-list (nothing it names runs), a common state that would unpickle
  one or is missing or malformed, unknown format version, another model, a dp_reshardable
  optimizer: each one ``CheckpointError`` line, exit status 2.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil

import pytest
import torch

from dynatrain.checkpoint import (CheckpointError, LoadStats, base_key, checkpoint_layout_summary,
                                  format_load, load_checkpoint, load_checkpoint_into,
                                  load_checkpoint_ranks, load_planned,
                                  open_checkpoint, plan_load)
from dynatrain.checkpoint.format import COMMON_STATE
from dynatrain.checkpoint.load import read_step
from dynatrain.ir.box import Box
from dynatrain.ir.errors import EXIT_BAD_INPUT
from dynatrain.ir.layout import Layout
from dynatrain.ir.state import StateView, view_of
from dynatrain.planner.lost import LostEntry, LostState
from dynatrain.runtime.megatron import extract_state
from dynatrain.runtime.storage import fill_from_global, random_global, torch_dtype
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.units import format_bytes
from matrix import MOE, case, to_harness_cfg, to_spec, to_spec_dict
from megatron_support import live
from megatron_support.probes import _may_have_children

SRC = case("src-tp2-dp2", 4, tp=2, num_query_groups=2, swiglu=True, num_layers=4,
           vocab_size=200)
SRC_ROWS = 224  # vocab 200 padded to a multiple of 16 * tp2
DSTS = {
    "tp1-dp4": dict(SRC, tp=1),  # 208 padded rows: fewer than the checkpoint's
    "pp2-dp2-tied": dict(SRC, tp=1, pp=2),  # the last stage's embedding copy
    "tp2-pp2-vpp2": dict(SRC, pp=2, vpp=2),
    "tp4-vocab-pad": dict(SRC, tp=4),  # 256 padded rows: 224..255 stay zero
    "dp4-no-distopt": dict(SRC, tp=1, use_distributed_optimizer=False),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict:
    """The source job's checkpoints (fully and dp_reshardable) and its sharded records."""
    root = tmp_path_factory.mktemp("ckpt")
    full, dp = str(root / "full"), str(root / "dp_reshardable")
    os.makedirs(full)
    os.makedirs(dp)
    c = live.resolve(to_harness_cfg(SRC))

    def work(rank: int) -> dict:
        from megatron.core import dist_checkpointing

        live.init_parallel(c)
        job = live.build(c)
        live.train_step(job, 0)
        live.save_dist_checkpoint(job, full)
        model_sd = live._model_sd(job)
        sd = {"model": model_sd, "optimizer": job.optimizer.sharded_state_dict(
            model_sd, is_loading=False, metadata={"distrib_optim_sharding_type": "dp_reshardable"})}
        with _may_have_children():
            dist_checkpointing.save(sd, dp)
        return live.sharded_leaves(job)

    leaves = live.run_workers(work, SRC["world"])
    return {"full": full, "dp": dp, "leaves": leaves}


def _oracle(view: StateView, leaves: list[dict]) -> dict:
    """Logical tensors of ``view`` from the source job's records (never read from the files)."""
    glob, steps = live.assemble(leaves)
    out = {}
    for ckey, t in glob.items():
        key, kind = base_key(ckey)
        if (key, kind) not in view.tensors() and (key, "buffer") in view.tensors():
            kind = "buffer"
        if (key, kind) not in view.tensors():
            continue
        want = view.tensors()[(key, kind)]
        out[(key, kind)] = t[tuple(slice(0, s) for s in want.shape)].clone()
    assert len(steps) == 1, steps
    out[("optimizer.step", "step")] = torch.tensor(int(steps.pop()), dtype=torch.int64)
    missing = set(view.tensors()) - set(out)
    assert not missing, f"the oracle has no {sorted(missing)[:4]}"
    return out


def _dst(name: str) -> tuple[Layout, StateView]:
    layout = Layout(to_spec(DSTS[name]))
    return layout, view_of(layout, min(SRC_ROWS, layout.padded_vocab))


def _diffs(got: dict, want: dict) -> list:
    if set(got) != set(want):
        return [("keys differ", sorted(set(got) ^ set(want), key=repr)[:3])]
    return [k for k in want if not live.bits_equal(got[k], want[k])]


@pytest.mark.parametrize("name", list(DSTS))
def test_load_equals_the_source_state_in_every_layout(source: dict, name: str) -> None:
    layout, view = _dst(name)
    oracle = _oracle(view, source["leaves"])
    stores = load_checkpoint_ranks(source["full"], layout)
    assert sorted(stores) == list(range(len(layout.devices)))
    for rank, store in stores.items():
        want = fill_from_global(view, rank, oracle)
        bad = _diffs(store, want)
        assert not bad, f"{name} rank {rank}: {len(bad)} storage tensors differ, e.g. {bad[:3]}"
        assert int(store[("step", "BufferSlot", -1, "step")]) == 1
    # Not vacuous: one Adam step moved every moment; the bf16 params are the saved ones.
    for (key, kind), t in oracle.items():
        if kind in ("exp_avg", "exp_avg_sq"):
            assert t.abs().sum() > 0, (key, kind)
    if name == "tp4-vocab-pad":  # rows the checkpoint lacks are zero, the rows it has are not
        emb = stores[3][("param", "ParamSlot", 0, "embedding.word_embeddings.weight")]
        assert emb.shape[0] == 64 and emb[:224 - 192].abs().sum() > 0
        assert not emb[224 - 192:].any()


def test_megatron_reload_of_the_same_files_agrees(source: dict) -> None:
    """The installed megatron-core's own dist-checkpoint load of the same files, in real jobs of
    two destination layouts (VPP, tied embedding on PP2), extracted through the bridge: equal
    to ours and to the oracle, bit for bit. (Its reload goes wrong only with multi-bucket
    DistributedOptimizer buffers, which this harness does not build: ``megatron-layout.md``.)"""
    names = ("tp2-pp2-vpp2", "pp2-dp2-tied")
    cfgs = {n: live.resolve(to_harness_cfg(DSTS[n])) for n in names}
    views = {n: _dst(n)[1] for n in names}
    layouts = {n: _dst(n)[0] for n in names}
    from megatron.core import parallel_state as ps

    def work(rank: int) -> dict:
        out = {}
        for n in names:
            live.init_parallel(cfgs[n])
            job = live.build(cfgs[n], seed=99)
            live.load_dist_checkpoint(job, source["full"])
            out[n] = {k: v.detach().clone() for k, v in
                      extract_state(views[n], rank, job.ddps, job.optimizer).items()}
            # The live-job call: a fresh job loaded by DynaTrain equals megatron's, natively.
            fresh = live.build(cfgs[n], seed=98)
            before = len(live.native_diffs(live.native_state(job), live.native_state(fresh)))
            step = load_checkpoint_into(source["full"], layouts[n], rank, fresh.ddps,
                                        fresh.optimizer)
            out[n + ".live"] = (before, step, live.native_diffs(live.native_state(job),
                                                                live.native_state(fresh)))
            out[n + ".losses"] = (live.train_step(job, 1), live.train_step(fresh, 1))
            ps.destroy_model_parallel()
        return out

    theirs = live.run_workers(work, SRC["world"])
    for n in names:
        layout, view = _dst(n)
        oracle = _oracle(view, source["leaves"])
        ours = load_checkpoint_ranks(source["full"], layout)
        for rank in range(len(layout.devices)):
            want = fill_from_global(view, rank, oracle)
            assert not _diffs(ours[rank], want), (n, rank)
            bad = _diffs(theirs[rank][n], ours[rank])
            assert not bad, f"{n} rank {rank}: megatron's reload differs in {bad[:3]}"
            before, step, after = theirs[rank][n + ".live"]
            assert before > 0 and step == 1 and after == [], (n, rank, after[:3])
            mine, megatrons = theirs[rank][n + ".losses"]
            assert mine == megatrons, (n, rank)


def test_one_rank_reads_only_its_chunks_within_the_budget(source: dict) -> None:
    layout, view = _dst("pp2-dp2-tied")
    plan = plan_load(source["full"], layout)
    total = sum(len(t.chunks) for t in plan.ckpt.tensors.values())
    per = plan.per_rank()
    oracle = _oracle(view, source["leaves"])
    biggest = max(c.length for t in plan.ckpt.tensors.values() for c in t.chunks)
    for rank in (0, 3):
        stats = LoadStats()
        store = load_checkpoint(source["full"], layout, rank, budget=1, stats=stats)
        assert not _diffs(store, fill_from_global(view, rank, oracle))
        assert stats.chunks == per[rank]["chunks"] < total
        assert stats.bytes_read == per[rank]["bytes_read"]
        assert stats.peak_in_flight <= biggest  # one chunk at a time under a 1-byte budget
    stats = LoadStats()
    load_checkpoint(source["full"], layout, 0, budget=3 * biggest, threads=4, stats=stats)
    assert biggest <= stats.peak_in_flight <= 3 * biggest


def test_only_what_was_lost_is_read_and_written(source: dict) -> None:
    """``only=``: the parts no survivor holds, written into storage the switch filled."""
    layout, view = _dst("tp1-dp4")
    oracle = _oracle(view, source["leaves"])
    lost = [("embedding.word_embeddings.weight", "exp_avg", Box((10, 0), (150, 64))),
            ("decoder.layers.mlp.linear_fc1.weight", "main_param", Box((1, 0, 0), (2, 192, 64))),
            ("optimizer.step", "step", Box((), ()))]
    plan = plan_load(source["full"], layout, only=lost)
    full = plan_load(source["full"], layout)
    assert 0 < len(plan.pieces) < len(full.pieces) / 4
    as_lost = LostState(tuple(LostEntry(k, kind, (b,), 0) for k, kind, b in lost))
    assert plan_load(source["full"], layout, only=as_lost).pieces == plan.pieces
    drawn = random_global(view, seed=5)  # what the survivors' switch wrote: other values
    stores = {r: fill_from_global(view, r, drawn) for r in range(4)}
    before = {r: {k: t.clone() for k, t in st.items()} for r, st in stores.items()}
    load_planned(plan, stores=stores)
    expected = dict(drawn)
    for key, kind, box in lost:
        t = expected[(key, kind)].clone()
        sl = tuple(slice(l, h) for l, h in zip(box.lo, box.hi))
        t[sl] = oracle[(key, kind)][sl]
        expected[(key, kind)] = t
    changed = 0
    for r in range(4):
        assert not _diffs(stores[r], fill_from_global(view, r, expected)), r
        changed += len(_diffs(stores[r], before[r]))
    assert changed > 0


def test_plan_summary_counts_what_the_load_reads_and_writes(source: dict) -> None:
    layout, view = _dst("tp4-vocab-pad")
    s = plan_load(source["full"], layout).summary()
    specs = view.tensors()
    for rank, r in s["per_rank"].items():
        want = sum(reg.box.numel * torch.empty((), dtype=torch_dtype(specs[(reg.key, reg.kind)]
                                                                        .dtype)).element_size()
                   for reg in view.regions(rank) if reg.kind != "step")
        assert r["bytes_written"] == want, rank
        assert r["files"] and all(f.endswith(".distcp") for f in r["files"])
    assert s["bytes_read"] >= s["bytes_read_once"] > 0 and s["step"] == 1
    assert s["vocab_rows"] == 224 and s["padded_vocab"] == 256
    text = format_load(s, per_device=True)
    assert "vocab rows 224..255 zero" in text and "rank    3" in text
    summ = checkpoint_layout_summary(source["full"])
    assert summ["tensors"]["embedding.word_embeddings.weight"]["shape"] == [224, 64]
    assert set(summ["bytes_by_kind"]) == {"param", "main_param", "exp_avg", "exp_avg_sq"}


MORE = {  # other sources: expert weights and the router's expert_bias; a plain optimizer
    "moe-ep2": (case("moe-ep2", 4, ep=2, swiglu=True, moe_shared_expert_intermediate_size=48,
                     **live.EXPERT_BIAS, **MOE),
                {"ep4": dict(ep=4), "tp2-ep2-etp1": dict(tp=2, ep=2, etp=1),
                 "pp2-ep2": dict(pp=2, ep=2)}),
    "tp2-dp2-no-distopt": (case("no-distopt", 4, tp=2, use_distributed_optimizer=False,
                                untie_embeddings_and_output_weights=True),
                           {"tp1-dp4-distopt": dict(tp=1, use_distributed_optimizer=True),
                            "pp2-tp2": dict(pp=2)}),
}


@pytest.fixture(scope="module")
def more_sources(tmp_path_factory) -> dict:
    """Checkpoints and records of the ``MORE`` sources (one worker run, one job after the
    other)."""
    from megatron.core import parallel_state as ps

    root = tmp_path_factory.mktemp("more")
    paths = {n: str(root / n) for n in MORE}
    for p in paths.values():
        os.makedirs(p)
    cfgs = {n: live.resolve(to_harness_cfg(src)) for n, (src, _) in MORE.items()}

    def work(rank: int) -> dict:
        out = {}
        for n, c in cfgs.items():
            live.init_parallel(c)
            job = live.build(c)
            live.train_step(job, 0)
            live.train_step(job, 1)
            live.save_dist_checkpoint(job, paths[n])
            out[n] = live.sharded_leaves(job)
            ps.destroy_model_parallel()
        return out

    res = live.run_workers(work, 4)
    return {n: (paths[n], [r[n] for r in res]) for n in MORE}


@pytest.mark.parametrize("name", list(MORE))
def test_load_other_sources(more_sources: dict, name: str) -> None:
    src, dsts = MORE[name]
    path, leaves = more_sources[name]
    src_rows = Layout(to_spec(src)).padded_vocab
    for dname, kw in dsts.items():
        layout = Layout(to_spec(dict(src, **kw)))
        view = view_of(layout, min(src_rows, layout.padded_vocab))
        oracle = _oracle(view, leaves)
        for rank, store in load_checkpoint_ranks(path, layout).items():
            bad = _diffs(store, fill_from_global(view, rank, oracle))
            assert not bad, f"{name} -> {dname} rank {rank}: {len(bad)} differ, e.g. {bad[:3]}"
            assert int(store[("step", "BufferSlot", -1, "step")]) == 2
        kinds = {k for _, k in view.tensors()}
        assert ("buffer" in kinds) == name.startswith("moe"), kinds


# ---- refusals: one line, exit status 2, nothing loaded ---------------------------------------


def _refused(path: str, layout: Layout | None = None, match: str = "") -> str:
    layout = layout or _dst("tp1-dp4")[0]
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_ranks(path, layout)
    msg = str(info.value)
    assert "\n" not in msg and info.value.exit_code == EXIT_BAD_INPUT, msg
    assert match in msg, msg
    return msg


def _copy(source: dict, tmp_path) -> str:
    dst = str(tmp_path / "ckpt")
    shutil.copytree(source["full"], dst)
    return dst


def test_refuses_a_missing_directory(tmp_path) -> None:
    _refused(str(tmp_path / "nowhere"), match="no such directory")
    os.makedirs(tmp_path / "empty")
    _refused(str(tmp_path / "empty"), match="no metadata.json")


def test_refuses_a_truncated_chunk_file(source: dict, tmp_path) -> None:
    path = _copy(source, tmp_path)
    name = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    size = os.path.getsize(os.path.join(path, name))
    os.truncate(os.path.join(path, name), size - 100)
    _refused(path, match=f"chunk file {name} is truncated")
    os.remove(os.path.join(path, name))
    _refused(path, match=f"chunk file {name} is missing")


def test_refuses_corrupt_chunk_bytes(source: dict, tmp_path) -> None:
    path = _copy(source, tmp_path)
    chunk = open_checkpoint(path).tensors["decoder.layers.mlp.linear_fc1.weight"].chunks[0]
    with open(os.path.join(path, chunk.file), "r+b") as f:
        f.seek(chunk.offset)
        f.write(b"\0" * 64)  # the chunk's zip header
    _refused(path, match="decoder.layers.mlp.linear_fc1.weight: the chunk at")


def test_refuses_metadata_naming_a_class_outside_the_allow_list(source: dict, tmp_path) -> None:
    path = _copy(source, tmp_path)
    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)  # the genuine file, written by this test's own job
    md.planner_data = Hostile()
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    # The pickle names builtins' open by its module: io.open on Python 3.11, _io.open on 3.12.
    _refused(path, match=f"refuses to unpickle {open.__module__}.open")
    assert not marker.exists()
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(b"\x80\x04garbage")
    _refused(path, match=".metadata is malformed or truncated")


def test_refuses_an_unknown_format_version(source: dict, tmp_path) -> None:
    path = _copy(source, tmp_path)
    meta = os.path.join(path, "metadata.json")
    with open(meta) as f:
        doc = json.load(f)
    with open(meta, "w") as f:
        json.dump(dict(doc, sharded_backend_version=2), f)
    _refused(path, match="format 'torch_dist' version 2 is not one DynaTrain reads")
    with open(meta, "w") as f:
        json.dump(dict(doc, sharded_backend="zarr"), f)
    _refused(path, match="format 'zarr'")


# ---- the common state: common.pt (megatron-core 0.16) or the common_state entry (0.19) ----------


def _installed_series() -> tuple[int, int]:
    from dynatrain.ir.versions import installed, series_key

    return series_key(installed())


def _raw_metadata(path: str):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # a genuine file, written by this test's own job


def _write_metadata(path: str, md) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _point_common_state(path: str, payload: bytes) -> None:
    """Append ``payload`` to a chunk file and make it the ``common_state`` entry's bytes, as
    megatron-core 0.19 stores a ShardedObject (strategies/torch.py:316-320): a bytes entry of
    ``.metadata`` with its file, offset and length."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    name = "__0_0.distcp"
    offset = os.path.getsize(os.path.join(path, name))
    with open(os.path.join(path, name), "ab") as f:
        f.write(payload)
    md = _raw_metadata(path)
    md.state_dict_metadata[COMMON_STATE] = BytesStorageMetadata()
    md.storage_data = {i: v for i, v in md.storage_data.items() if i.fqn != COMMON_STATE}
    md.storage_data[MetadataIndex(COMMON_STATE)] = _StorageInfo(name, offset, len(payload))
    _write_metadata(path, md)


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _relaid(source: dict, tmp_path, where: str) -> str:
    """A copy of the source checkpoint with its common state laid out as megatron-core 0.16
    (``where="common.pt"``: metadata.json names the torch common backend, ``common.pt``) or 0.19
    (``"common_state"``: neither, the ``common_state`` bytes entry) writes it; the tensors and
    the common state itself unchanged. The installed megatron-core writes one of the two; this
    gives the reader the other layout too."""
    path = str(tmp_path / f"relaid-{where}")
    shutil.copytree(source["full"], path)
    common = open_checkpoint(path).common()
    meta = os.path.join(path, "metadata.json")
    with open(meta) as f:
        doc = {k: v for k, v in json.load(f).items() if not k.startswith("common_backend")}
    if where == "common.pt":
        doc.update(common_backend="torch", common_backend_version=1)
        torch.save(common, os.path.join(path, "common.pt"))
        md = _raw_metadata(path)
        md.state_dict_metadata.pop(COMMON_STATE, None)
        md.storage_data = {i: v for i, v in md.storage_data.items() if i.fqn != COMMON_STATE}
        _write_metadata(path, md)
    else:
        if os.path.exists(os.path.join(path, "common.pt")):
            os.remove(os.path.join(path, "common.pt"))
        _point_common_state(path, _saved([common]))
    with open(meta, "w") as f:
        json.dump(doc, f)
    return path


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and live.bits_equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k])
                                                                    for k in a)
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    return type(a) is type(b) and a == b


def test_common_state_is_where_the_installed_megatron_keeps_it(source: dict) -> None:
    """megatron-core 0.16 writes common.pt and names it in metadata.json; 0.19 writes neither
    and saves the common state as the ``common_state`` ShardedObject (0.19.2
    dist_checkpointing/serialization.py:439-445, core.py:22-34). Either way DynaTrain reads
    what megatron's own ``load_common_state_dict`` reads, and the step in it."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    path = source["full"]
    with open(os.path.join(path, "metadata.json")) as f:
        doc = json.load(f)
    has_pt = os.path.isfile(os.path.join(path, "common.pt"))
    ckpt = open_checkpoint(path)
    entry = COMMON_STATE in _raw_metadata(path).state_dict_metadata
    if _installed_series() == (0, 16):
        assert (doc.get("common_backend"), doc.get("common_backend_version")) == ("torch", 1)
        assert has_pt and not entry and ckpt.common_state is None
    else:
        assert _installed_series() == (0, 19)
        assert "common_backend" not in doc and "common_backend_version" not in doc
        assert not has_pt and entry and ckpt.common_state is not None
        assert ckpt.common_state.file in ckpt.files
    assert _same(ckpt.common(), load_common_state_dict(path))
    assert read_step(ckpt) == 1


@pytest.mark.parametrize("where", ["common.pt", "common_state"])
def test_reads_either_common_state_layout(source: dict, tmp_path, where: str) -> None:
    """Both layouts load the same state, bit for bit (one of them is the installed
    megatron-core's own files, the other relaid from them). megatron-core 0.19 reads both
    (a common.pt first: serialization.py:200-237); 0.16 reads only common.pt."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    path = _relaid(source, tmp_path, where)
    ckpt = open_checkpoint(path)
    assert (ckpt.common_state is None) == (where == "common.pt")
    real = open_checkpoint(source["full"]).common()
    assert _same(ckpt.common(), real)
    if where == "common.pt" or _installed_series() >= (0, 19):
        assert _same(load_common_state_dict(path), real)
    layout = _dst("tp1-dp4")[0]
    want = load_checkpoint_ranks(source["full"], layout)
    got = load_checkpoint_ranks(path, layout)
    for rank in want:
        assert not _diffs(got[rank], want[rank]), rank
        assert int(got[rank][("step", "BufferSlot", -1, "step")]) == 1


@pytest.mark.parametrize("where", ["common.pt", "common_state"])
def test_refuses_a_bad_common_state(source: dict, tmp_path, where: str) -> None:
    """A common state that would unpickle a class torch's weights_only loader does not allow
    (nothing it names runs), that is missing, truncated or not what megatron saves: one line."""
    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = _relaid(source, tmp_path, where)
    if where == "common.pt":
        torch.save({"optimizer": Hostile()}, os.path.join(path, "common.pt"))
        _refused(path, match=f"common.pt refuses to unpickle {open.__module__}.open")
        assert not marker.exists()
        torch.save([{"optimizer": {}}], os.path.join(path, "common.pt"))
        _refused(path, match="common.pt does not hold a dict")
        os.remove(os.path.join(path, "common.pt"))
        _refused(path, match="no common.pt")
        return
    _point_common_state(path, _saved([{"optimizer": Hostile()}]))
    _refused(path, match=f"{COMMON_STATE} refuses to unpickle {open.__module__}.open")
    assert not marker.exists()
    _point_common_state(path, _saved({"optimizer": {}}))  # not megatron's one-element list
    _refused(path, match=f"{COMMON_STATE} holds a dict, not [dict]")
    _point_common_state(path, b"\0" * 64)
    _refused(path, match=f"{COMMON_STATE} cannot be read")
    ckpt = open_checkpoint(path)
    os.truncate(os.path.join(path, ckpt.common_state.file),
                ckpt.common_state.offset + ckpt.common_state.length - 1)
    _refused(path, match=f"chunk file {ckpt.common_state.file} is truncated")
    md = _raw_metadata(path)
    del md.state_dict_metadata[COMMON_STATE]
    _write_metadata(path, md)
    _refused(path, match=f"no common.pt and no {COMMON_STATE} bytes entry in .metadata")


def test_refuses_a_checkpoint_of_another_model(source: dict) -> None:
    deeper = Layout(to_spec(dict(SRC, num_layers=2, tp=1)))
    _refused(source["full"], deeper, match="a checkpoint of another model")
    wider = Layout(to_spec(dict(SRC, ffn_hidden_size=128, tp=1)))
    _refused(source["full"], wider, match="decoder.layers.mlp.linear_fc1.weight")
    other_vocab = Layout(to_spec(dict(SRC, vocab_size=256, tp=1)))
    _refused(source["full"], other_vocab, match="embedding.word_embeddings.weight")
    fp16 = Layout(spec_from_dict(dict(to_spec_dict(dict(SRC, tp=1)),
                                      state={"param": "fp16"})))
    _refused(source["full"], fp16, match="would not be bit-exact")


def test_refuses_a_dp_reshardable_optimizer(source: dict) -> None:
    _refused(source["dp"], match="dp_reshardable")
    assert open_checkpoint(source["dp"]).tensors  # the files themselves read fine


def test_cli_load_and_plan_a_checkpoint(source, tmp_path, capsys) -> None:
    import yaml

    from dynatrain.cli import main

    dst = tmp_path / "dst.yaml"
    dst.write_text(yaml.safe_dump(to_spec_dict(DSTS["pp2-dp2-tied"])))
    assert main(["plan", source["full"], str(dst), "--json", str(tmp_path / "load.json")]) == 0
    planned = capsys.readouterr().out
    assert planned.startswith(f"checkpoint {source['full']}")
    summary = json.loads((tmp_path / "load.json").read_text())
    assert main(["load", source["full"], str(dst), "--budget", "1MiB"]) == 0
    loaded = capsys.readouterr().out
    written = sum(v["bytes_written"] for v in summary["per_rank"].values())
    assert f"{format_bytes(written)} written into every destination rank's storage" in loaded
    assert main(["load", str(tmp_path / "nowhere"), str(dst)]) == 2  # one line, nothing moves
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dynatrain: error: ")
