"""Checkpoints whose metadata lies about where the chunks are, and files that are links out.

The source checkpoint is ``test_checkpoint_load``'s (its module fixture: a real megatron-core
TP2·DP2 job's ``dist_checkpointing.save``); here its ``.metadata`` is edited:

* **a duplicate and a hole.** One chunk of layer 0's ``linear_fc1`` weight moved onto
  another's region: that region is in two chunks, the one it left (3072 elements) in none,
  and the element count is unchanged. Refused with one ``CheckpointError`` line (exit status
  2) by ``open_checkpoint``, ``dynatrain load`` and ``dynatrain plan`` into a PP2 layout,
  and the library loader for every rank of every layout; a ``Checkpoint`` built in memory
  with the same chunks (past ``open_checkpoint``) is refused by ``plan_load`` for every rank
  that holds the broken region, for a whole load and for a refill (``only=``).
* **any edit** of offsets, sizes, the tensor's shape, duplicated, dropped, swapped or unstored
  chunks and storage lengths (hypothesis): every load is bit-exact (equal to the unedited
  load) or refused with ``CheckpointError``; never a traceback, never silently wrong.
* **links out.** A chunk file, ``.metadata``, ``metadata.json`` or ``common.pt`` that is a link
  resolving outside the checkpoint directory is refused with one line naming it; links that
  stay inside, and a checkpoint directory that is itself a link, load as the real files do.
* **fields of the wrong type.** A ``.metadata`` of allowed classes whose fields hold anything
  (a size of None, a chunk's offsets ``'x'``, a storage entry without a length), a
  ``metadata.json`` nested too deeply or naming its format by a list, an Adam step that is not
  one whole number in [0, 2**63) (NaN, inf, 10**400, None, a two-element tensor), an optimizer
  entry that is not a dict, Megatron-LM's counts that are not whole numbers: one line each.
* **unbounded or blocking reads.** A metadata file over its cap is refused unread; a named
  pipe in place of any file a load reads, even one swapped in after opening, is refused
  without waiting for a writer.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
import pickle
import shutil
import signal
import sys
from argparse import Namespace

import pytest
import torch
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from dynatrain.checkpoint import (CheckpointError, load_checkpoint, load_checkpoint_into,
                                  load_checkpoint_ranks, load_planned, open_checkpoint,
                                  plan_load)
from dynatrain.checkpoint import format as fmt
from dynatrain.checkpoint import megatron_lm as mlm
from dynatrain.checkpoint.format import Checkpoint, Chunk, read_chunk
from dynatrain.checkpoint.load import read_step
from dynatrain.cli import main
from dynatrain.ir.box import Box
from dynatrain.ir.errors import EXIT_BAD_INPUT
from dynatrain.ir.units import format_bytes
from dynatrain.planner.lost import LostEntry, LostState
from matrix import to_spec_dict
from megatron_support import live
# The source job and its checkpoint: test_checkpoint_load's module fixture, built once here too.
from test_checkpoint_load import DSTS, _dst, source  # noqa: F401  (source: a fixture)

FC1 = "decoder.layers.mlp.linear_fc1.weight"
LAYOUTS = ("pp2-dp2-tied", "tp2-pp2-vpp2", "tp1-dp4", "dp4-no-distopt")


def _raw(path: str):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # a genuine file, written by this test's own job


def _write(path: str, md) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _dup_and_hole(md, key: str = FC1) -> None:
    """The chunk at [0, 96, 0] moved onto [0, 0, 0] (same shape, the same element count):
    layer 0's rows 0..47 in two chunks, rows 96..143 (48 x 64 = 3072 elements) in none."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    chunks = md.state_dict_metadata[key].chunks
    i = next(i for i, c in enumerate(chunks) if tuple(c.offsets) == (0, 96, 0))
    assert any(tuple(c.offsets) == (0, 0, 0) for c in chunks)
    chunks[i] = ChunkStorageMetadata(offsets=torch.Size((0, 0, 0)), sizes=chunks[i].sizes)


@pytest.fixture(scope="module")
def corrupt(source: dict, tmp_path_factory) -> str:  # noqa: F811
    path = str(tmp_path_factory.mktemp("corrupt") / "ckpt")
    shutil.copytree(source["full"], path)
    md = _raw(path)
    _dup_and_hole(md)
    _write(path, md)
    return path


def _one_line(info) -> str:
    msg = str(info.value)
    assert "\n" not in msg and info.value.exit_code == EXIT_BAD_INPUT, msg
    return msg


# ---- a duplicate and a hole ------------------------------------------------------------------


def test_open_checkpoint_refuses_a_duplicate_and_a_hole(corrupt: str) -> None:
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(corrupt)
    msg = _one_line(info)
    assert f"{FC1}: its chunks do not tile the tensor [4, 192, 64]" in msg, msg
    assert "element [0, 0, 0] is in two chunks" in msg, msg


def test_cli_load_and_plan_into_pp2_refuse_it(corrupt: str, tmp_path, capsys) -> None:
    dst = tmp_path / "dst.yaml"
    dst.write_text(yaml.safe_dump(to_spec_dict(DSTS["pp2-dp2-tied"])))
    for cmd in ("load", "plan"):
        assert main([cmd, corrupt, str(dst)]) == EXIT_BAD_INPUT, cmd
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, (cmd, out, err)
        assert err.startswith(f"dynatrain: error: checkpoint {corrupt}: {FC1}: its chunks "
                              "do not tile"), err


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_library_loader_refuses_it_for_every_rank(corrupt: str, name: str) -> None:
    layout = _dst(name)[0]
    lost = LostState((LostEntry(FC1, "param", (Box((0, 0, 0), (1, 192, 64)),), 0),))
    for rank in range(len(layout.devices)):
        for load in (lambda: load_checkpoint(corrupt, layout, rank),
                     lambda: load_checkpoint_into(corrupt, layout, rank, None, None),
                     lambda: plan_load(corrupt, layout, [rank], only=lost)):
            with pytest.raises(CheckpointError) as info:
                load()
            assert "do not tile" in _one_line(info)
    with pytest.raises(CheckpointError):
        load_checkpoint_ranks(corrupt, layout)


def _in_memory_dup_and_hole(path: str):
    """The genuine checkpoint opened, then its fc1 chunk at [0, 96, 0] replaced in memory by
    the one at [0, 0, 0] (past ``open_checkpoint``'s check: what a caller may hand over)."""
    ckpt = open_checkpoint(path)
    t = ckpt.tensors[FC1]
    first = next(c for c in t.chunks if c.box.lo == (0, 0, 0))
    chunks = tuple(Chunk(first.box, first.file, first.offset, first.length)
                   if c.box.lo == (0, 96, 0) else c for c in t.chunks)
    assert chunks != t.chunks and sum(c.box.numel for c in chunks) == 4 * 192 * 64
    ckpt.tensors[FC1] = dataclasses.replace(t, chunks=chunks)
    return ckpt


@pytest.mark.parametrize("name", ["pp2-dp2-tied", "tp2-pp2-vpp2"])
def test_plan_load_refuses_regions_its_chunks_do_not_tile(source: dict, name: str) -> None:  # noqa: F811
    """Every rank holding a part of the broken region of layer 0's fc1 is refused (a whole
    load and a refill of that layer); the others load what the genuine checkpoint gives."""
    ckpt = _in_memory_dup_and_hole(source["full"])
    layout, view = _dst(name)
    layer0 = Box((0, 0, 0), (1, 192, 64))
    broken = (Box((0, 0, 0), (1, 48, 64)), Box((0, 96, 0), (1, 144, 64)))  # twice, and none
    refused = 0
    for rank in range(len(layout.devices)):
        holds = any(r.key == FC1 and r.kind == "param" and r.box.meets(b)
                    for r in view.regions(rank) for b in broken)
        if not holds:
            got = load_planned(plan_load(ckpt, layout, [rank]))[rank]
            want = load_checkpoint(source["full"], layout, rank)
            assert all(live.bits_equal(got[k], want[k]) for k in want), rank
            continue
        refused += 1
        for only in (None, [(FC1, "param", layer0)]):
            with pytest.raises(CheckpointError) as info:
                plan_load(ckpt, layout, [rank], only=only)
            msg = _one_line(info)
            assert f"its chunks of {FC1} do not tile" in msg, msg
            assert f"destination rank {rank}" in msg, msg
    assert 0 < refused < len(layout.devices)


# ---- any edit of the metadata: bit-exact or refused ------------------------------------------

# The tensors edited, and each one's kind: a stacked 3-d weight (16 chunks of [1, 48, 64]), its
# Adam moment, and the vocab-split 2-d embedding (2 chunks of [112, 64]).
EDITED = {FC1: "param", f"optimizer.state.exp_avg.{FC1}": "exp_avg",
          "embedding.word_embeddings.weight": "param"}
SHAPES = {FC1: (4, 192, 64), f"optimizer.state.exp_avg.{FC1}": (4, 192, 64),
          "embedding.word_embeddings.weight": (224, 64)}
EDIT_LAYOUTS = ("pp2-dp2-tied", "tp2-pp2-vpp2")
OPS = ("shift", "resize", "duplicate", "drop", "move_onto", "swap", "reorder", "unstore",
       "store_length", "shape")


def _only(layout) -> list:
    """The edited tensors (whole), in the destination's rows: what each load reads."""
    rows = _dst_rows(layout)
    out = []
    for ck, kind in EDITED.items():
        shape = SHAPES[ck]
        if ck.startswith("embedding"):
            shape = (rows,) + shape[1:]
        out.append((ck.removeprefix("optimizer.state.exp_avg."), kind,
                    Box((0,) * len(shape), shape)))
    return out


def _dst_rows(layout) -> int:
    return min(224, layout.padded_vocab)


def _load(path: str, name: str) -> dict:
    layout = _dst(name)[0]
    return load_planned(plan_load(path, layout, only=_only(layout)))


@pytest.fixture(scope="module")
def editable(source: dict, tmp_path_factory) -> dict:  # noqa: F811
    """A copy of the checkpoint whose ``.metadata`` each example rewrites, the genuine
    metadata, and the genuine loads of the edited tensors into each layout."""
    path = str(tmp_path_factory.mktemp("edited") / "ckpt")
    shutil.copytree(source["full"], path)
    return {"path": path, "md": _raw(path),
            "want": {n: _load(source["full"], n) for n in EDIT_LAYOUTS}}


edits = st.lists(st.tuples(st.sampled_from(OPS), st.sampled_from(sorted(EDITED)),
                           st.integers(0, 15), st.integers(0, 15), st.integers(0, 2),
                           st.integers(-64, 64)), min_size=1, max_size=3)


def _apply(md, ops) -> None:
    """Edit ``md`` in place: each op (what, tensor, chunk i, chunk j, dim, delta)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    for what, key, i, j, d, delta in ops:
        tmd = md.state_dict_metadata[key]
        chunks = tmd.chunks
        if not chunks:
            continue
        i, j, d = i % len(chunks), j % len(chunks), d % len(tmd.size)
        c = chunks[i]
        off, size = list(c.offsets), list(c.sizes)
        if what == "shift":
            off[d] += delta
            chunks[i] = ChunkStorageMetadata(torch.Size(off), c.sizes)
        elif what == "resize":
            size[d] += delta
            chunks[i] = ChunkStorageMetadata(c.offsets, torch.Size(size))
        elif what == "duplicate":
            chunks.append(ChunkStorageMetadata(c.offsets, c.sizes))
        elif what == "drop":
            del chunks[i]
        elif what == "move_onto":  # the report's corruption: chunk i onto chunk j's place
            chunks[i] = ChunkStorageMetadata(chunks[j].offsets, c.sizes)
        elif what == "swap":  # places swapped: each place's bytes still found by its offset
            chunks[i], chunks[j] = (ChunkStorageMetadata(chunks[j].offsets, c.sizes),
                                    ChunkStorageMetadata(c.offsets, chunks[j].sizes))
        elif what == "reorder":
            chunks.insert(j, chunks.pop(i))
        elif what == "unstore":
            md.storage_data.pop(MetadataIndex(key, c.offsets), None)
        elif what == "store_length":
            idx = MetadataIndex(key, c.offsets)
            info = md.storage_data.get(idx)
            if info is not None:
                md.storage_data[idx] = dataclasses.replace(info, length=info.length + delta)
        elif what == "shape":
            shape = list(tmd.size)
            shape[d] += delta
            tmd.size = torch.Size(shape)


@settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(ops=edits)
@example(ops=[("move_onto", FC1, 1, 0, 0, 0)])  # the report's duplicate and hole: refused
@example(ops=[("swap", FC1, 0, 1, 0, 0)])  # a real permutation: loads bit-exact
# [0, 0:96] in one chunk whose bytes hold [0, 0:48]: tiles, refused when the chunk is read
@example(ops=[("resize", FC1, 0, 0, 1, 48), ("drop", FC1, 8, 0, 0, 0)])
def test_any_metadata_edit_loads_bit_exact_or_is_refused(editable: dict, ops) -> None:
    """Storage byte offsets are left alone: a chunk's bytes record its shape but not its
    place, so metadata pointing one place at another's bytes of the same shape cannot be told
    from the truth by any reader (DCP's own included). Every other lie is caught: the chunks
    must tile each tensor, and each chunk's bytes must hold a tensor of its metadata's shape."""
    md = copy.deepcopy(editable["md"])
    _apply(md, ops)
    _write(editable["path"], md)
    for name in EDIT_LAYOUTS:
        try:
            got = _load(editable["path"], name)
        except CheckpointError as err:
            assert "\n" not in str(err) and err.exit_code == EXIT_BAD_INPUT, str(err)
            event("refused: " + str(err).split(": ", 2)[-1][:40])
            continue
        event("loaded")
        want = editable["want"][name]
        assert sorted(got) == sorted(want), name
        for rank in want:
            assert sorted(got[rank]) == sorted(want[rank])
            bad = [k for k in want[rank] if not live.bits_equal(got[rank][k], want[rank][k])]
            assert not bad, f"{ops} loaded into {name} rank {rank} differs in {bad[:3]}"


def test_edits_reach_both_outcomes(editable: dict) -> None:
    """Not vacuous: a swap of two places is accepted (and bit-exact, as above), the report's
    duplicate and hole refused, for the very loads the hypothesis test runs."""
    for ops, ok in (([("swap", FC1, 0, 1, 0, 0)], True),
                    ([("move_onto", FC1, 1, 0, 0, 0)], False)):
        md = copy.deepcopy(editable["md"])
        _apply(md, ops)
        assert md.state_dict_metadata[FC1].chunks != editable["md"].state_dict_metadata[FC1].chunks
        _write(editable["path"], md)
        if ok:
            assert _load(editable["path"], EDIT_LAYOUTS[0])
        else:
            with pytest.raises(CheckpointError):
                _load(editable["path"], EDIT_LAYOUTS[0])


# ---- links out of the checkpoint directory ---------------------------------------------------


def _copy(source: dict, tmp_path) -> str:  # noqa: F811
    path = str(tmp_path / "ckpt")
    shutil.copytree(source["full"], path)
    return path


def _refused_link(path: str, name: str, target: str) -> None:
    layout = _dst("tp1-dp4")[0]
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_ranks(path, layout)
    msg = _one_line(info)
    assert msg == (f"checkpoint {path}: {name} is a link to {os.path.realpath(target)}, "
                   "outside the checkpoint directory (refused: a checkpoint's files must be "
                   "inside it)"), msg


def test_refuses_a_chunk_file_linked_out_of_the_directory(source: dict, tmp_path,  # noqa: F811
                                                          capsys) -> None:
    path = _copy(source, tmp_path)
    name = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    os.remove(os.path.join(path, name))
    os.symlink("/etc/passwd", os.path.join(path, name))
    _refused_link(path, name, "/etc/passwd")
    dst = tmp_path / "dst.yaml"
    dst.write_text(yaml.safe_dump(to_spec_dict(DSTS["pp2-dp2-tied"])))
    assert main(["load", path, str(dst)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a link to /etc/passwd, outside" in err, err
    # A relative link climbing out is the same: what counts is where it resolves.
    os.remove(os.path.join(path, name))
    outside = tmp_path / "elsewhere.distcp"
    shutil.copy(os.path.join(source["full"], name), outside)  # the genuine bytes, even
    os.symlink(os.path.join("..", "elsewhere.distcp"), os.path.join(path, name))
    _refused_link(path, name, str(outside))


@pytest.mark.parametrize("name", [".metadata", "metadata.json", "common.pt"])
def test_refuses_metadata_linked_out_of_the_directory(source: dict, tmp_path,  # noqa: F811
                                                      name: str) -> None:
    """The genuine file, moved out and linked back. (megatron-core 0.19 writes no common.pt;
    a common.pt it would read first is then a link to the genuine common state.)"""
    path = _copy(source, tmp_path)
    outside = tmp_path / f"outside{name}"
    if os.path.exists(os.path.join(path, name)):
        shutil.move(os.path.join(path, name), outside)
    else:
        torch.save(open_checkpoint(path).common(), outside)
    os.symlink(outside, os.path.join(path, name))
    _refused_link(path, name, str(outside))


def test_links_inside_and_a_linked_directory_load_as_the_files_do(source: dict,  # noqa: F811
                                                                  tmp_path) -> None:
    path = _copy(source, tmp_path)
    os.makedirs(os.path.join(path, "store"))
    for name in sorted(f for f in os.listdir(path) if f.endswith(".distcp")):
        shutil.move(os.path.join(path, name), os.path.join(path, "store", name))
        os.symlink(os.path.join("store", name), os.path.join(path, name))
    linked_dir = str(tmp_path / "linked")
    os.symlink(path, linked_dir)
    layout = _dst("tp1-dp4")[0]
    want = load_checkpoint_ranks(source["full"], layout)
    for where in (path, linked_dir):
        got = load_checkpoint_ranks(where, layout)
        for rank in want:
            assert all(live.bits_equal(got[rank][k], want[rank][k]) for k in want[rank])
    assert open_checkpoint(linked_dir).root == os.path.realpath(path)


# ---- metadata fields of the wrong type -------------------------------------------------------


def _fc1_storage(md):
    """The storage index key of fc1's first chunk."""
    return next(i for i in md.storage_data if i.fqn == FC1 and i.offset is not None)


def _rekeyed(md, offset) -> None:
    """fc1's first storage entry under an index whose offset is ``offset``."""
    idx = _fc1_storage(md)
    info = md.storage_data.pop(idx)
    object.__setattr__(idx, "offset", offset)  # (a frozen dataclass: as a pickle sets it)
    md.storage_data[idx] = info


# Each: an edit of the genuine .metadata that keeps to the allowed classes but sets a field to a
# value of the wrong type, and the words of the one line refusing it (which were a traceback).
WRONG_FIELDS = {
    "size-none": (lambda md: setattr(md.state_dict_metadata[FC1], "size", None),
                  f".metadata entry {FC1}: size None is not a list of whole numbers"),
    "size-str": (lambda md: setattr(md.state_dict_metadata[FC1], "size", ["abc"]),
                 f".metadata entry {FC1}: size ['abc'] is not a list of whole numbers"),
    "size-int-too-long-to-print": (  # repr of an int over 4300 digits raises ValueError
        lambda md: setattr(md.state_dict_metadata[FC1], "size", [10**5000, 192, 64]),
        f".metadata entry {FC1}: size <a list too large to show> is not a list"),
    "chunks-none": (lambda md: setattr(md.state_dict_metadata[FC1], "chunks", None),
                    f".metadata entry {FC1}: chunks None is not a list"),
    "offsets-str": (lambda md: setattr(md.state_dict_metadata[FC1].chunks[0], "offsets", "x"),
                    f".metadata entry {FC1}: chunks[0].offsets 'x' is not a list of whole "
                    "numbers in [0, 2**63), 3 of them (the tensor's rank)"),
    "sizes-of-another-rank": (
        lambda md: setattr(md.state_dict_metadata[FC1].chunks[0], "sizes", torch.Size((1, 48))),
        f".metadata entry {FC1}: chunks[0].sizes torch.Size([1, 48]) is not a list"),
    "properties-none": (lambda md: setattr(md.state_dict_metadata[FC1], "properties", None),
                        f".metadata entry {FC1}: properties.dtype None is not a torch dtype"),
    "storage-offset-str": (lambda md: setattr(md.storage_data[_fc1_storage(md)], "offset", "x"),
                           "storage offset 'x' and length"),
    "storage-without-length": (lambda md: delattr(md.storage_data[_fc1_storage(md)], "length"),
                               "and length None are not a byte range"),
    "storage-transforms-int": (
        lambda md: setattr(md.storage_data[_fc1_storage(md)], "transform_descriptors", 5),
        f"{FC1}: chunk stored with transforms 5"),
    "index-offset-str": (lambda md: _rekeyed(md, ("x",)),
                         f".metadata entry {FC1} (storage index): offset ('x',) is not a list"),
    "no-state-dict": (lambda md: delattr(md, "state_dict_metadata"),
                      ".metadata has no state dict or storage index"),
}


@pytest.mark.parametrize("case", sorted(WRONG_FIELDS))
def test_refuses_metadata_fields_of_the_wrong_type(source: dict, tmp_path,  # noqa: F811
                                                   case: str) -> None:
    edit, words = WRONG_FIELDS[case]
    path = _copy(source, tmp_path)
    md = _raw(path)
    edit(md)
    _write(path, md)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    msg = _one_line(info)
    assert msg.startswith(f"checkpoint {path}: ") and words in msg, msg


def test_cli_refuses_a_field_of_the_wrong_type_in_one_line(source: dict, tmp_path,  # noqa: F811
                                                           capsys) -> None:
    path = _copy(source, tmp_path)
    md = _raw(path)
    md.state_dict_metadata[FC1].size = None
    _write(path, md)
    dst = tmp_path / "dst.yaml"
    dst.write_text(yaml.safe_dump(to_spec_dict(DSTS["tp1-dp4"])))
    assert main(["load", path, str(dst)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{FC1}: size None is not a list" in err, err


# ---- Adam's step and the optimizer entry of the common state ---------------------------------


def _with_optimizer(path: str, optimizer) -> Checkpoint:
    """The checkpoint at ``path`` with a common.pt whose optimizer entry is ``optimizer`` (read
    first by megatron-core 0.16 and 0.19 alike), opened afresh."""
    common = open_checkpoint(path).common()
    torch.save(dict(common, optimizer=optimizer), os.path.join(path, "common.pt"))
    return open_checkpoint(path)


# Each: a step as a param group records it, and the words of the one line refusing it.
BAD_STEPS = [
    (float("nan"), "records Adam step nan: a step must be one whole number in [0, 2**63)"),
    (float("inf"), "records Adam step inf: a step must be"),
    (10**400, "records Adam step 1000"),
    (2**63, "records Adam step 9223372036854775808: a step must be"),  # past int64
    (None, "records Adam step None: a step must be"),
    ("abc", "records Adam step 'abc': a step must be"),
    (torch.tensor([1, 2]), "records an Adam step tensor of 2 elements, not one"),
]


@pytest.mark.parametrize("step, words", BAD_STEPS,
                         ids=["nan", "inf", "10**400", "2**63", "none", "str", "tensor2"])
def test_refuses_a_step_that_is_not_one_whole_number(source: dict, tmp_path,  # noqa: F811
                                                     step, words: str) -> None:
    ckpt = _with_optimizer(_copy(source, tmp_path), {"param_groups": [{"step": step}]})
    with pytest.raises(CheckpointError) as info:
        read_step(ckpt)
    msg = _one_line(info)
    assert msg.startswith(f"checkpoint {ckpt.path}: common.pt ") and words in msg, msg


def test_refuses_an_optimizer_entry_that_is_not_a_dict(source: dict, tmp_path,  # noqa: F811
                                                       capsys) -> None:
    """It loaded silently, with step 0."""
    ckpt = _with_optimizer(_copy(source, tmp_path), "abc")
    with pytest.raises(CheckpointError) as info:
        read_step(ckpt)
    assert _one_line(info) == (f"checkpoint {ckpt.path}: common.pt's optimizer entry is a str, "
                               "not a dict")
    dst = tmp_path / "dst.yaml"
    dst.write_text(yaml.safe_dump(to_spec_dict(DSTS["tp1-dp4"])))
    assert main(["load", ckpt.path, str(dst)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "optimizer entry is a str, not a dict" in err, err


def test_reads_steps_nested_deeply_or_in_a_list_holding_itself(source: dict,  # noqa: F811
                                                               tmp_path) -> None:
    """Both were a RecursionError; a step as a one-element tensor or a whole float is read."""
    path = _copy(source, tmp_path)
    deep: dict = {"step": 5}
    for _ in range(600):  # as deep as torch.save can write on Python 3.12 (its C stack)
        deep = {"state": deep}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 5000))  # to save it (Python 3.11 pickles recursing)
    try:
        ckpt = _with_optimizer(path, {"param_groups": [deep]})
    finally:
        sys.setrecursionlimit(limit)
    # Read with 300 frames to spare: fewer than the nesting, so a walk that recursed per level
    # fails (unpickling and an explicit stack need no frame per level).
    sys.setrecursionlimit(len(inspect.stack(0)) + 300)
    try:
        assert read_step(ckpt) == 5
    finally:
        sys.setrecursionlimit(limit)
    loop: list = [{"step": 6}]
    loop.append(loop)
    assert read_step(_with_optimizer(path, {"param_groups": loop})) == 6
    assert read_step(_with_optimizer(path, {"param_groups": [{"step": torch.tensor(7.0)},
                                                             {"step": 7.0}]})) == 7


# ---- metadata.json that is not what it should be ---------------------------------------------


@pytest.mark.parametrize("text, words", [
    ("[" * 100000 + "]" * 100000, "metadata.json is not JSON (nested too deeply)"),
    ('{"sharded_backend": ["torch_dist"], "sharded_backend_version": 1}',
     "format ['torch_dist'] version 1 is not one DynaTrain reads"),  # unhashable: was TypeError
    ('{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
     '"common_backend": "torch", "common_backend_version": {"v": 1}}',
     "common format 'torch' version {'v': 1} is not one DynaTrain reads"),
], ids=["nested", "format-list", "common-version-object"])
def test_refuses_metadata_json_nested_too_deeply_or_unhashable(source: dict,  # noqa: F811
                                                               tmp_path, text: str,
                                                               words: str) -> None:
    path = _copy(source, tmp_path)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        f.write(text)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    msg = _one_line(info)
    assert msg.startswith(f"checkpoint {path}: {words}"), msg


# ---- files too large to read whole, and files that are not files -----------------------------


@pytest.mark.parametrize("name, cap", [(".metadata", fmt.MAX_METADATA_BYTES),
                                       ("metadata.json", fmt.MAX_FORMAT_BYTES)])
def test_refuses_metadata_over_its_cap_unread(source: dict, tmp_path, name: str,  # noqa: F811
                                              cap: int) -> None:
    """A sparse file one byte over the cap (nothing written to disk): refused by its size,
    not read whole (an 8 GiB one was a MemoryError)."""
    path = _copy(source, tmp_path)
    os.truncate(os.path.join(path, name), cap + 1)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    assert _one_line(info) == (f"checkpoint {path}: {name} is {cap + 1} bytes, over the "
                               f"{format_bytes(cap)} limit for that file (refused unread)")


@contextlib.contextmanager
def _within(seconds: int):
    """Fail, instead of hanging the run, when the body blocks (opening a named pipe for reading
    waits for a writer); SIGALRM interrupts the blocked open in this, the main, thread."""
    def stop(*_) -> None:
        raise TimeoutError(f"still blocked after {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _fifo(path: str, name: str) -> None:
    if os.path.exists(os.path.join(path, name)):
        os.remove(os.path.join(path, name))
    os.mkfifo(os.path.join(path, name))


@pytest.mark.parametrize("name", ["metadata.json", ".metadata", "common.pt", "__0_0.distcp"])
def test_refuses_a_named_pipe_without_opening_it(source: dict, tmp_path,  # noqa: F811
                                                 name: str) -> None:
    """Each file a load reads, a named pipe that no process writes: one line, no wait. (They
    read as missing before; common.pt as a pipe is refused, not taken for absent.)"""
    path = _copy(source, tmp_path)
    _fifo(path, name)
    with _within(60), pytest.raises(CheckpointError) as info:
        load_checkpoint_ranks(path, _dst("tp1-dp4")[0])
    msg = _one_line(info)
    assert msg.startswith(f"checkpoint {path}: ") and msg.endswith(
        f"{name} is a named pipe, not a regular file"), msg


def test_a_chunk_file_swapped_for_a_named_pipe_after_opening_is_refused(  # noqa: F811
        source: dict, tmp_path) -> None:
    """Opened (and its size checked) first, then a pipe when its chunk is read: that read
    blocked forever."""
    path = _copy(source, tmp_path)
    ckpt = open_checkpoint(path)
    chunk = ckpt.tensors[FC1].chunks[0]
    _fifo(path, chunk.file)
    with _within(60), pytest.raises(CheckpointError) as info:
        read_chunk(ckpt, FC1, chunk)
    assert _one_line(info) == (f"checkpoint {path}: chunk file {chunk.file} is a named pipe, "
                               "not a regular file")


# ---- Megatron-LM's training state ------------------------------------------------------------


@pytest.mark.parametrize("common, words", [
    ({"args": Namespace(consumed_train_samples="abc"), "iteration": 4},
     "args.consumed_train_samples 'abc' in its common state is not a whole number >= 0"),
    ({"args": Namespace(consumed_train_samples=None), "iteration": 4},
     "args.consumed_train_samples None"),
    ({"args": Namespace(consumed_train_samples=float("nan")), "iteration": 4},
     "args.consumed_train_samples nan"),
    ({"args": Namespace(consumed_train_samples=-32), "iteration": 4},
     "args.consumed_train_samples -32"),
    ({"args": Namespace(consumed_train_samples=32), "iteration": -1}, "iteration -1"),
], ids=["str", "none", "nan", "negative", "iteration"])
def test_train_state_refuses_counts_that_are_not_whole_numbers(monkeypatch, common: dict,
                                                               words: str) -> None:
    class Fake:
        def common(self) -> dict:
            return common

    monkeypatch.setattr(mlm, "open_checkpoint", lambda path: Fake())
    with pytest.raises(CheckpointError) as info:
        mlm.train_state("ckpt")
    msg = _one_line(info)
    assert msg.startswith("checkpoint ckpt: ") and words in msg, msg
