"""Megatron-LM's own training loop (``megatron.training.pretrain``) on CPU under
``dynatrain.runtime.megatron.cpu.megatron_lm_cpu``: two gloo processes train a tiny GPT with TP2
for 4 iterations and save a ``torch_dist`` checkpoint; a second run ``--load``s it.

Checks that the loop really ran (``train`` returned iteration 4, every iteration logged a finite
loss, the same on both TP ranks, and training moved the model), that ``--save`` wrote iteration
4, and that the loaded model and optimizer (bf16 params, fp32 main params, Adam moments and
steps) equal the saved ones bit for bit, and differ from a fresh initialisation.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math

import pytest

if importlib.util.find_spec("megatron.training") is None:
    pytest.skip(f"megatron-core {importlib.metadata.version('megatron-core')}'s wheel has no "
                "megatron.training", allow_module_level=True)

import torch  # noqa: E402

from megatron_support import lm  # noqa: E402

ITERS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("mlm") / "ckpt")
    saved = lm.run_pretrain(lm.argv(tp=2, iters=ITERS, save=ckpt), world=2)
    loaded = lm.run_pretrain(lm.argv(tp=2, iters=ITERS, load=ckpt), world=2)
    return ckpt, saved, loaded


def test_pretrain_trains_the_iterations(runs):
    _, saved, _ = runs
    for rec in saved:
        assert rec.iteration == ITERS
        assert rec.args["consumed_train_samples"] == ITERS * lm.GLOBAL_BATCH
        assert rec.args["tensor_model_parallel_size"] == 2 and rec.args["data_parallel_size"] == 1
        assert sorted(rec.losses) == list(range(1, ITERS + 1))
        assert all(math.isfinite(v) for v in rec.losses.values())
    # TP ranks hold the same loss; Adam at lr 3e-3 lowers it within 4 steps.
    assert saved[0].losses == saved[1].losses
    assert saved[0].losses[ITERS] < saved[0].losses[1] - 0.1
    moved = [k for k in saved[0].loaded if not torch.equal(saved[0].final[k], saved[0].loaded[k])]
    assert any(k.startswith("model0.") for k in moved)


def test_save_writes_the_last_iteration(runs):
    ckpt, _, _ = runs
    import os

    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(ITERS)
    files = os.listdir(os.path.join(ckpt, f"iter_{ITERS:07d}"))
    assert "metadata.json" in files and ".metadata" in files  # torch_dist format


def test_load_restores_the_saved_state(runs):
    _, saved, loaded = runs
    for before, after in zip(saved, loaded):
        assert after.iteration == ITERS  # resumed at the saved iteration: nothing left to train
        assert after.losses == {}
        assert after.args["consumed_train_samples"] == ITERS * lm.GLOBAL_BATCH
        assert sorted(after.loaded) == sorted(before.final)
        assert any(k.endswith(".exp_avg") for k in before.final)
        diff = [k for k in before.final if not torch.equal(before.final[k], after.loaded[k])]
        assert diff == []
        # The load is not a fresh initialisation that happens to match.
        assert any(not torch.equal(before.loaded[k], after.loaded[k])
                   for k in before.loaded if k.startswith("model0."))
