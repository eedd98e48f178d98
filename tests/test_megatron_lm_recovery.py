"""A node dies inside Megatron-LM's own ``train()`` under ``dynatrain.megatron_lm.pretrain``,
and the job trains on without a restart.

Four gloo processes ("two nodes of two GPUs") train a tiny GPT in TP2 DP2 with the distributed
optimizer (each optimizer shard exists once), saving a ``torch_dist`` checkpoint every two
iterations. In iteration 5's forward pass both processes of node1 are killed with everything
they started (SIGKILL). The survivors, blocked in the gradient reduce-scatter with them, get
the error out of ``train()``; DynaTrain's driver recovers live on node0 (the survivors agree
who is gone, switch to the top layout of ``suggest`` on the devices left and read exactly the
lost optimizer shards from the checkpoint of iteration 4, the step they hold) and enters
``train()`` again. Oracle: Megatron-LM's own restart from that checkpoint, ``--load``ed into the
survivors' layout on two processes: every rank's state (params, main params, Adam moments and
steps, scheduler, consumed samples) equals it bit for bit, and the next iterations' losses are
equal.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

if importlib.util.find_spec("megatron.training") is None:
    pytest.skip(f"megatron-core {importlib.metadata.version('megatron-core')}'s wheel has no "
                "megatron.training (Megatron-LM's loop ships with 0.19)", allow_module_level=True)

import torch  # noqa: E402

from dynatrain.megatron_lm import LiveOptions  # noqa: E402
from megatron_support import lm  # noqa: E402

BASE = ("--num-layers", "2", "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable",
        "--untie-embeddings-and-output-weights")
ITERS = 7
DIES_AT = 4  # node1 dies in iteration 5 (curr_iteration 4), after the checkpoint of iteration 4


def test_a_node_dies_inside_train_and_the_job_trains_on(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    live = lm.run_pretrain(
        lm.argv(tp=2, iters=ITERS, extra=BASE + ("--save", ckpt, "--save-interval", "2")),
        world=4, timeout=600, die={2: DIES_AT, 3: DIES_AT},
        options=LiveOptions(requests=False, gpus_per_node=2, timeout=60, heartbeat=0.5))
    assert live[2] is None and live[3] is None
    survivors = live[:2]
    for rec in survivors:
        assert rec.iteration == ITERS
        assert sorted(rec.at_train) == [0, DIES_AT], sorted(rec.at_train)
    tp, pp, dp = survivors[0].at_train[DIES_AT]["layout"]
    assert tp * pp * dp == 2
    restart = lm.run_pretrain(lm.argv(tp=tp, pp=pp, iters=ITERS, load=ckpt, extra=BASE + (
        "--ckpt-step", str(DIES_AT))), world=2, timeout=600)
    for rank, (mine, ref) in enumerate(zip(survivors, restart)):
        a, b = mine.at_train[DIES_AT], ref.at_train[DIES_AT]
        assert a["layout"] == b["layout"] == (tp, pp, dp)
        assert a["consumed"] == b["consumed"] == DIES_AT * lm.GLOBAL_BATCH
        assert a["scheduler"] == b["scheduler"]
        assert sorted(a["state"]) == sorted(b["state"])
        diff = [n for n in a["state"] if not torch.equal(a["state"][n], b["state"][n])]
        assert diff == [], f"rank {rank}: {diff[:5]}"
        nxt = {i: mine.losses[i] for i in range(DIES_AT + 1, ITERS + 1) if i in mine.losses}
        assert nxt == {i: ref.losses[i] for i in nxt}
    assert any(DIES_AT + 1 in rec.losses for rec in survivors)
