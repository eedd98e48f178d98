"""Megatron-LM's checkpoints as a live recovery reads them (``dynatrain.checkpoint.megatron_lm``)
and the allow-list its common state is unpickled through (``checkpoint.format._load_plain``).

* ``newest``: the tracker names the newest finished iteration; none, ``release``, a tracker that
  holds no iteration (one line), a named directory that is missing, and one that is a link out
  of ``--save`` (refused).
* The allow-list: ``argparse.Namespace`` and megatron's enums (what Megatron-LM's ``args`` hold)
  unpickle; an enum of another module, or any other class, is refused by name.
* ``train_state`` of a checkpoint megatron-core saved without Megatron-LM's loop: one line.
  Real Megatron-LM checkpoints are read in ``tests/test_megatron_lm_recovery.py``.
"""

from __future__ import annotations

import argparse
import http
import io
import os

import pytest
import torch

from dynatrain.checkpoint import CheckpointError
from dynatrain.checkpoint import megatron_lm as mlm
from dynatrain.checkpoint.format import _load_plain


def _save_dir(tmp_path, tracker: str | None, *iters: str):
    save = tmp_path / "save"
    save.mkdir(parents=True)
    for name in iters:
        (save / name).mkdir()
    if tracker is not None:
        (save / mlm.TRACKER).write_text(tracker)
    return save


def test_newest_is_what_the_tracker_names(tmp_path) -> None:
    save = _save_dir(tmp_path, "4\n", "iter_0000002", "iter_0000004")
    assert mlm.newest(save) == os.path.join(os.path.realpath(save), "iter_0000004")


def test_newest_release_and_none(tmp_path) -> None:
    assert mlm.newest(_save_dir(tmp_path / "a", None, "iter_0000002")) is None
    rel = _save_dir(tmp_path / "b", "release", "release")
    assert mlm.newest(rel).endswith("release")
    assert mlm.newest(_save_dir(tmp_path / "c", "6", "iter_0000004")) is None  # not there


@pytest.mark.parametrize("text", ["six", "-2", ""])
def test_newest_refuses_a_tracker_without_an_iteration(tmp_path, text) -> None:
    with pytest.raises(CheckpointError, match=f"{mlm.TRACKER} holds"):
        mlm.newest(_save_dir(tmp_path, text))


def test_newest_refuses_a_link_out_of_save(tmp_path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    save = _save_dir(tmp_path, "8")
    os.symlink(outside, save / "iter_0000008")
    with pytest.raises(CheckpointError, match="outside"):
        mlm.newest(save)


def _pickled(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_megatron_lm_args_unpickle_through_the_allow_list() -> None:
    from megatron.core.enums import ModelType

    args = argparse.Namespace(consumed_train_samples=32, model_type=ModelType.encoder_or_decoder)
    got = _load_plain("ckpt", "common.pt", _pickled({"args": args, "iteration": 4}))
    assert got["iteration"] == 4 and got["args"] == args


@pytest.mark.parametrize("obj, name", [
    ({"status": http.HTTPStatus.OK}, "http.HTTPStatus"),
    ({"f": io.StringIO}, "_io.StringIO"),
])
def test_other_classes_are_refused_by_name(obj, name) -> None:
    with pytest.raises(CheckpointError, match=f"common.pt refuses to unpickle {name}"):
        _load_plain("ckpt", "common.pt", _pickled(obj))


def test_train_state_of_a_checkpoint_without_megatron_lm_args(tmp_path, monkeypatch) -> None:
    class Fake:
        def common(self):
            return {"optimizer": {}}

    monkeypatch.setattr(mlm, "open_checkpoint", lambda path: Fake())
    with pytest.raises(CheckpointError, match="not saved by Megatron-LM"):
        mlm.train_state(str(tmp_path))
