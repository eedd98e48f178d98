"""The forked-worker harness (``megatron_support.live.run_workers``) starts its workers once
more only when their own gloo group failed to connect, before the test's function ran; a
failure inside the function is reported, never retried."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_support import live


def test_a_group_that_failed_to_connect_is_formed_again(tmp_path, monkeypatch) -> None:
    failed = tmp_path / "failed"
    real = dist.init_process_group

    def flaky(*args, **kwargs):
        # The first worker to get here, in the first start only, fails to connect; which one
        # it is and whether its peer reaches here before being stopped is left to the race.
        try:
            with open(failed, "x"):
                pass
        except FileExistsError:
            return real(*args, **kwargs)
        raise RuntimeError("Gloo connectFullMesh failed (injected)")

    monkeypatch.setattr(dist, "init_process_group", flaky)  # forked workers inherit it
    assert live.run_workers(lambda rank: rank * 10, 2, timeout=60) == [0, 10]
    assert failed.exists()  # the first start did fail, so the answer came from the second


def test_a_failure_in_the_function_is_not_retried(tmp_path) -> None:
    runs = tmp_path / "runs"

    def fn(rank: int) -> None:
        with open(runs, "a") as f:
            f.write("x")
        dist.barrier()  # both have run before either fails (a failure stops its peer)
        raise ValueError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        live.run_workers(fn, 2, timeout=60)
    assert len(runs.read_text()) == 2
