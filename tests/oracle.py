"""The simulator oracle the plan tests share: a plan's destination, bit for bit.

``assert_plan_exact`` runs a plan through the numpy simulator from global tensors and compares
every destination rank's storage, bit for bit, with the storage built directly from the same
tensors; it also holds the plan to its byte lower bound and its staging budget.
"""

from __future__ import annotations

import numpy as np

from dynatrain.ir.state import StateView
from dynatrain.planner.plan import Plan
from dynatrain.planner.schedule import peak_staging
from dynatrain.verify.simulate import Storage, execute, materialize


def assert_same_storages(got: list[Storage], want: list[Storage]) -> None:
    """Every rank holds the same tensors with the same bits."""
    assert len(got) == len(want)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), f"rank {rank}: storage keys differ"
        for k in w:
            a, b = g[k].view(np.uint32), w[k].view(np.uint32)
            if not np.array_equal(a, b):  # the fast test; numpy's report names the elements
                np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} {k}")


def assert_plan_exact(plan: Plan, src: StateView, dst: StateView, tensors: dict,
                      budget: int | None = None) -> None:
    """``plan`` rebuilds ``dst`` from ``src`` bit for bit; with ``budget``, it also moves only
    the lower bound of bytes and stages within the budget in every round."""
    got = execute(plan, materialize(src, tensors), dst)
    assert len(got) == dst.layout.world
    assert_same_storages(got, materialize(dst, tensors))
    if budget is not None:
        assert plan.stats["bytes_moved"] == plan.stats["bytes_lower_bound"]
        for rnd in plan.rounds:
            assert max(peak_staging(rnd).values(), default=0) <= budget
