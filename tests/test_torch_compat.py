"""The runtime uses no torch API newer than the oldest torch megatron-core supports (2.6).

GPU containers ship torch 2.11, which has no ``dist.all_gather_single``: a switch whose commit
vote needed it aborted at its last step there. The local run below hides the newer name.
"""

from __future__ import annotations

import torch.distributed as dist

import dynatrain as dt


def test_a_switch_commits_without_all_gather_single(monkeypatch) -> None:
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    switch = dt.plan("specs/tiny-gpt/tp2-dp2.yaml", "specs/tiny-gpt/pp2-dp2.yaml", budget="1MiB")
    results = dt.run_local(switch, seed=2, timeout=60)  # forked: the processes inherit the patch
    assert all(not r["errors"] and "report" in r for r in results), results
