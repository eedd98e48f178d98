"""A node dies inside Megatron-LM's own ``train()`` under ``dynatrain.megatron_lm.pretrain``,
and the job trains on without a restart.

Four gloo processes ("two nodes of two GPUs") train a tiny GPT in TP2 DP2 with the distributed
optimizer (each optimizer shard exists once), saving a ``torch_dist`` checkpoint every two
iterations. In the forward pass of iteration 5 both processes of node1 are killed with
everything they started (SIGKILL); in iteration 6 they are stopped instead (SIGSTOP: a hung
node, its sockets open, released only by the groups' timeout: ``LiveOptions(
collective_timeout=10)`` against Megatron-LM's 30 minutes). The survivors, blocked in the
gradient reduce-scatter with them, get the error out of ``train()``; DynaTrain's driver recovers live on node0 (the
survivors agree who is gone, switch to the top layout of ``suggest`` on the devices left and
read exactly the lost optimizer shards from the checkpoint of iteration 4, the step they hold;
or, a step past it, roll back in place to it) and enters ``train()`` again. Oracle: Megatron-LM's
own restart from that checkpoint, ``--load``ed into the survivors' layout on two processes:
every rank's state (params, main params, Adam moments and steps, scheduler, consumed samples)
equals it bit for bit, and the next iterations' losses are equal. Without a checkpoint, the
lost state ends every survivor with one line and exit status 3. With buddy copies
(``LiveOptions(buddy=True)``) node0 restores the step of iteration 4 from them instead, no
checkpoint read.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import re
import signal

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
CKPT_AT = 4  # the newest checkpoint when node1 dies (saved every two iterations)
OPTIONS = LiveOptions(requests=False, gpus_per_node=2, timeout=60, heartbeat=0.5)


# (iteration in whose forward pass node1 dies (0-based), how, how the survivors go on): in
# iteration 5 they hold the checkpoint's step and refill the lost shards from it; in iteration
# 6 they hold step 5, the checkpoint step 4: every survivor rolls back in place to it and
# trains iteration 5 again. The stopped node is released by a 10 s collective timeout: with
# Megatron-LM's --distributed-timeout-minutes 30 alone the run would outlast the test's limit.
#
# With buddy copies (``LiveOptions(buddy=True)``) the same death in iteration 5 is recovered
# from node1's copies on node0, no checkpoint read: the checkpoint of iteration 4 is then the
# test's oracle only.
@pytest.mark.parametrize("dies_at, how, mode", [
    pytest.param(4, signal.SIGKILL, "refill", id="killed-refill"),
    pytest.param(5, signal.SIGSTOP, "rollback", id="stopped-rollback"),
    pytest.param(4, signal.SIGKILL, "buddy", id="killed-buddy")])
def test_a_node_dies_inside_train_and_the_job_trains_on(tmp_path, capfd, dies_at, how, mode):
    ckpt = str(tmp_path / "ckpt")
    options, extra = OPTIONS, ()
    if mode == "buddy":
        options = dataclasses.replace(OPTIONS, buddy=True)
    if how == signal.SIGSTOP:
        options = dataclasses.replace(OPTIONS, collective_timeout=10.0)
        extra = ("--distributed-timeout-minutes", "30")
    live = lm.run_pretrain(
        lm.argv(tp=2, iters=ITERS, extra=BASE + extra + ("--save", ckpt, "--save-interval", "2")),
        world=4, timeout=600, die={2: dies_at, 3: dies_at}, how=how, options=options)
    assert live[2] is None and live[3] is None
    line = [x for x in capfd.readouterr().out.splitlines() if x.startswith("dynatrain: ")]
    assert line and line[0].startswith("dynatrain: node1:gpu0, node1:gpu1 failed (") and \
        f"recovered by {mode} on 2 devices" in line[0] and \
        f"training on from iteration {CKPT_AT}; the error came " in line[0] and \
        "; downtime from the error " in line[0] and \
        ("reload" if mode == "rollback" else "refill") in line[0], line
    stalled = float(re.search(r"the error came ([0-9.]+) s after", line[0]).group(1))
    if how == signal.SIGSTOP:  # released by the 10 s collective timeout, not by a death
        assert 10.0 <= stalled < 60.0, line[0]
    survivors = live[:2]
    for rec in survivors:
        assert rec.iteration == ITERS
        assert sorted(rec.at_train) == [0, CKPT_AT], sorted(rec.at_train)
    tp, pp, dp = survivors[0].at_train[CKPT_AT]["layout"]
    assert tp * pp * dp == 2
    restart = lm.run_pretrain(lm.argv(tp=tp, pp=pp, iters=ITERS, load=ckpt, extra=BASE + (
        "--ckpt-step", str(CKPT_AT))), world=2, timeout=600)
    for rank, (mine, ref) in enumerate(zip(survivors, restart)):
        a, b = mine.at_train[CKPT_AT], ref.at_train[CKPT_AT]
        assert a["layout"] == b["layout"] == (tp, pp, dp)
        assert a["consumed"] == b["consumed"] == CKPT_AT * lm.GLOBAL_BATCH
        assert a["scheduler"] == b["scheduler"]
        assert sorted(a["state"]) == sorted(b["state"])
        diff = [n for n in a["state"] if not torch.equal(a["state"][n], b["state"][n])]
        assert diff == [], f"rank {rank}: {diff[:5]}"
        nxt = {i: mine.losses[i] for i in range(CKPT_AT + 1, ITERS + 1) if i in mine.losses}
        assert nxt == {i: ref.losses[i] for i in nxt}
    assert any(CKPT_AT + 1 in rec.losses for rec in survivors)


def test_state_lost_without_a_checkpoint_ends_with_one_line_and_status_3(capfd):
    """No --save: the optimizer shards node1 held exist nowhere else; every survivor ends with
    one line naming what is lost, exit status 3."""
    with pytest.raises(RuntimeError) as err:
        lm.run_pretrain(lm.argv(tp=2, iters=ITERS, extra=BASE), world=4, timeout=300,
                        die={2: 4, 3: 4}, options=OPTIONS)
    assert "SystemExit: 3" in str(err.value), str(err.value)[:500]
    lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith("dynatrain: ")]
    assert lines and all("recovery failed" in x and "lost" in x for x in lines), lines


@pytest.mark.parametrize("bad", [0, -1.0, True, "10", float("nan")])
def test_a_collective_timeout_that_is_no_number_of_seconds_is_one_line(bad):
    from dynatrain.ir.errors import DynatrainError
    from dynatrain.runtime.megatron.lm import seconds_option

    with pytest.raises(DynatrainError, match=r"^collective_timeout: seconds > 0 \(got "):
        seconds_option("collective_timeout", bad)
    assert seconds_option("collective_timeout", 10) == 10.0
    assert seconds_option("collective_timeout", None) is None
