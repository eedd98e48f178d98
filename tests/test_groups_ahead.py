"""Megatron's process groups of a switch's destination, made while the job trains
(``runtime.megatron.groups_ahead``): recording them leaves megatron's parallel state as it was;
the groups made in the background are exactly the ones megatron makes itself (same ranks for
every group megatron hands out) and carry collectives; megatron asking for other groups than
recorded is refused; and a live same-devices switch takes them ready-made and still equals
megatron's own reload bit for bit (``test_live_switcher``, ``test_te_live`` run with the
default ``groups_ahead=True``; the example's in-place switch reports how many it took).

Four forked gloo processes: TP2·DP2 with gloo twins, switching to PP2·EP2 and to CP2·TP2;
and, where devices leave, to TP2 on two of the four (the destination's world made ahead inside
the job's and promoted to the default group).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from dynatrain.runtime.megatron.groups_ahead import (GroupsAhead, joinworld, record, subworld,
                                                     supported, switch_order)
from megatron_support import live

SRC = dict(tensor_model_parallel_size=2, create_gloo_process_groups=True)
DESTINATIONS = [
    dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2,
         create_gloo_process_groups=True),
    dict(context_parallel_size=2, tensor_model_parallel_size=2, create_gloo_process_groups=True),
]
GETTERS = {
    "tp": ps.get_tensor_model_parallel_group,
    "pp": ps.get_pipeline_model_parallel_group,
    "dp": lambda: ps.get_data_parallel_group(),
    "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
    "dp_gloo": lambda: ps.get_data_parallel_group_gloo(),
    "cp": ps.get_context_parallel_group,
    "mp": ps.get_model_parallel_group,
    "embedding": ps.get_embedding_group,
    "ep": ps.get_expert_model_parallel_group,
    "etp": ps.get_expert_tensor_parallel_group,
    "edp": ps.get_expert_data_parallel_group,
}


def _groups() -> dict[str, tuple[int, ...]]:
    """Each of megatron's groups (that this process is in) by the ranks it holds."""
    out = {}
    for name, get in GETTERS.items():
        g = get()
        out[name] = tuple(dist.get_process_group_ranks(g)) if g is not None else None
    return out


def _sum_over(group) -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t, group=group)
    return float(t.item())


def _work(rank: int) -> dict:
    ps.initialize_model_parallel(**SRC)
    out: dict = {"supported": supported(SRC), "cases": []}
    for dst in DESTINATIONS:
        before, tp = _groups(), ps.get_tensor_model_parallel_group()
        ahead = GroupsAhead(dst)
        # The job trains on in its own groups while the destination's are being made.
        during = _sum_over(ps.get_tensor_model_parallel_group())
        kept = _groups() == before and ps.get_tensor_model_parallel_group() is tp
        ready = ahead.ready(60)
        ps.destroy_model_parallel()
        taken = ahead.initialize()
        ahead_groups = _groups()
        sums = (_sum_over(ps.get_tensor_model_parallel_group()),
                _sum_over(ps.get_data_parallel_group_gloo()))
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(**dst)  # megatron's own groups, made now
        own = _groups()
        own_sums = (_sum_over(ps.get_tensor_model_parallel_group()),
                    _sum_over(ps.get_data_parallel_group_gloo()))
        out["cases"].append({"calls": len(ahead.calls), "taken": taken, "ready": ready,
                             "kept": kept, "during": during, "equal": ahead_groups == own,
                             "sums": sums == own_sums, "groups": ahead_groups})
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(**SRC)
    # Megatron asking for other groups than recorded is refused, before any is handed out
    # for the wrong call.
    wrong = GroupsAhead(DESTINATIONS[0])
    wrong.ready(60)
    wrong.init = dict(DESTINATIONS[1])
    ps.destroy_model_parallel()
    try:
        wrong.initialize()
        out["wrong"] = None
    except RuntimeError as err:
        out["wrong"] = str(err)
    ps.destroy_model_parallel()
    # Recording alone touches no group: as many groups exist before as after.
    ps.initialize_model_parallel(**SRC)
    n = len(dist.distributed_c10d._world.pg_map)
    record(DESTINATIONS[0])
    out["no_new_groups"] = len(dist.distributed_c10d._world.pg_map) == n
    return out


def test_groups_made_ahead_are_megatrons_own() -> None:
    got = live.run_workers(_work, 4, timeout=240)
    for r in got:
        assert r["supported"] and r["no_new_groups"], r
        for case in r["cases"]:
            assert case["ready"] and case["kept"] and case["equal"] and case["sums"], case
            assert case["taken"] == case["calls"] > 10, case
            assert case["during"] == 3.0 or case["during"] == 7.0  # TP2 of ranks 0+1 / 2+3
        assert "differs from the recorded one" in r["wrong"], r["wrong"]
    # Both destinations really are other groups than the source's.
    assert got[0]["cases"][0]["groups"]["pp"] == (0, 2)
    assert got[0]["cases"][1]["groups"]["cp"] == (0, 2)


DEVICES = tuple(f"node0:gpu{i}" for i in range(4))
STAY = (DEVICES[1], DEVICES[2])  # ranks 1 and 2 of the job: 0 and 1 of the destination
LEFT_DST = dict(tensor_model_parallel_size=2, create_gloo_process_groups=True)


def _leave_work(rank: int) -> dict:
    ps.initialize_model_parallel(**SRC)
    me = DEVICES[rank]
    world = subworld(DEVICES, STAY, me, timeout=30)
    ahead = GroupsAhead(LEFT_DST, world)
    during = _sum_over(ps.get_tensor_model_parallel_group())  # trains on meanwhile
    ready = ahead.ready(60)
    out: dict = {"ready": ready, "during": during, "world_rank": world.rank}
    ps.destroy_model_parallel()
    if world.rank is None:  # leaves: gives the job's world up
        dist.destroy_process_group()
        return out
    # A build ahead runs with the destination's world as the default group, put back after;
    # one that makes groups of its own is refused (they would be numbered in the wrong world).
    with ahead.entered():
        out["inside"] = (dist.get_rank(), dist.get_world_size(),
                         dist.get_process_group_ranks(ahead.world_group))
    out["outside"] = (dist.get_rank(), dist.get_world_size(),
                      dist.get_process_group_ranks(ahead.world_group))
    try:
        with ahead.entered():
            dist.new_group([0, 1])
        out["own_groups"] = None
    except RuntimeError as err:
        out["own_groups"] = str(err)
    out["after_refusal"] = (dist.get_rank(), dist.get_world_size())
    out.update(_promoted(ahead, LEFT_DST))
    return out


def _sums() -> tuple[float, ...]:
    """Sums over the new world, megatron's TP group and its DP gloo twin."""
    return (_sum_over(None), _sum_over(ps.get_tensor_model_parallel_group()),
            _sum_over(ps.get_data_parallel_group_gloo()))


def _promoted(ahead: GroupsAhead, dst: dict, later: tuple[int, ...] = ()) -> dict:
    """Promote the destination's world made ahead, take megatron's groups from it, then
    compare with the groups megatron makes itself in that world (after a group of ``later``
    made there the way torch names groups)."""
    ahead.promote()
    out = {"world": (dist.get_rank(), dist.get_world_size()),
           "registered": len(dist.distributed_c10d._world.pg_map),
           "kept": 1 + sum(isinstance(g, dist.ProcessGroup) for g in ahead.groups),
           "taken": ahead.initialize(), "calls": len(ahead.calls),
           "groups": _groups(), "sums": _sums()}
    if later:  # every process of the world makes it, as torch wants
        group = dist.new_group(list(later))
        out["later"] = _sum_over(group) if dist.get_rank() in later else None
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(**dst)  # megatron's own, made now in the new world
    out["own"], out["own_sums"] = _groups(), _sums()
    return out


def test_a_world_where_devices_leave_is_made_ahead_and_promoted() -> None:
    got = live.run_workers(_leave_work, 4, timeout=240)
    assert [r["world_rank"] for r in got] == [None, 0, 1, None]
    for r in got:
        assert r["ready"] and r["during"] in (3.0, 7.0), r
    for rank, r in ((0, got[1]), (1, got[2])):
        assert r["inside"] == (rank, 2, [0, 1]) and r["outside"] == (rank + 1, 4, [1, 2]), r
        assert "made process groups of its own" in r["own_groups"], r["own_groups"]
        assert r["after_refusal"] == (rank + 1, 4), r
        # The default group is the destination's world; nothing of the old world is left.
        assert r["world"] == (rank, 2) and r["registered"] == r["kept"], r
        assert r["taken"] == r["calls"] > 10, r
        # megatron's groups, renumbered to the new world, are the ones it makes itself there,
        # and carry collectives (ranks 0 + 1 of the new world: 1 + 2 = 3).
        assert r["groups"] == r["own"] and r["groups"]["tp"] == (0, 1), r["groups"]
        assert r["sums"] == r["own_sums"] == (3.0, 3.0, 1.0 + rank), r


JOB = DEVICES[:2]  # the job runs on two; gpu2-3 are spares without a group, joining
JOIN_DST = dict(tensor_model_parallel_size=2, create_gloo_process_groups=True)


def _join_work(rank: int) -> dict:
    import datetime

    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    if rank < 2:  # the job's own world
        dist.init_process_group("gloo", store=dist.PrefixStore("job/", store), rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=60))
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
    # A switch that does not take them (a process without them, a cancelled switch) destroys
    # them again, on the job's processes and on the joiners.
    registered = len(dist.distributed_c10d._world.pg_map)
    dropped = GroupsAhead(JOIN_DST, joinworld(JOB, DEVICES, DEVICES[rank], "ahead/g0", store,
                                              timeout=30))
    made = dropped.ready(60) and len(dist.distributed_c10d._world.pg_map) > registered + 10
    dropped.discard()
    discarded = made and len(dist.distributed_c10d._world.pg_map) == registered
    world = joinworld(JOB, DEVICES, DEVICES[rank], "ahead/g1", store, timeout=30)
    ahead = GroupsAhead(JOIN_DST, world)
    during = _sum_over(None) if rank < 2 else None  # the job trains on meanwhile
    out: dict = {"ready": ahead.ready(60), "during": during, "discarded": discarded}
    if rank < 2:
        ps.destroy_model_parallel()
    # torch names later groups alike everywhere (the joiners' count was not the job's).
    out.update(_promoted(ahead, JOIN_DST, later=(1, 2)))
    return out


def test_a_world_where_devices_join_is_made_ahead_beside_the_jobs() -> None:
    got = live.run_workers(_join_work, 4, timeout=240)
    assert [r["during"] for r in got] == [3.0, 3.0, None, None]
    for rank, r in enumerate(got):
        assert r["discarded"] and r["ready"] and r["world"] == (rank, 4), r
        assert r["registered"] == r["kept"], r  # nothing of the job's old world is left
        assert r["taken"] == r["calls"] > 10, r
        assert r["groups"] == r["own"] and r["groups"]["tp"] == ((0, 1) if rank < 2
                                                                  else (2, 3)), r["groups"]
        assert r["sums"] == r["own_sums"] == (10.0, 3.0 if rank < 2 else 7.0,
                                              4.0 + 2 * (rank % 2)), r
    assert [r["later"] for r in got] == [None, 5.0, 5.0, None]


def test_a_joinworld_holds_the_whole_job_and_more(monkeypatch) -> None:
    w = joinworld(JOB, DEVICES, DEVICES[3], "ahead/g1", None, timeout=5)
    assert w is not None and (w.size, w.rank, w.union, w.union_rank) == (4, 3, 4, 3)
    assert not w.leaves
    # gpu0 leaves while gpu2-3 join: the switch's world holds the destination's processes
    # first, then gpu0; gpu0 has no destination rank.
    assert switch_order(JOB, DEVICES[1:]) == (*DEVICES[1:], DEVICES[0])
    w = joinworld(JOB, DEVICES[1:], DEVICES[1], "n", None, timeout=5)
    assert w is not None and (w.size, w.rank, w.union, w.union_rank) == (3, 0, 4, 0) and w.leaves
    w = joinworld(JOB, DEVICES[1:], DEVICES[0], "n", None, timeout=5)
    assert w is not None and (w.size, w.rank, w.union, w.union_rank) == (3, None, 4, 3)
    assert joinworld(JOB, DEVICES[1:], "node1:gpu0", "n", None, timeout=5) is None  # not in it
    # A joiner first: ranks are the destination's (the switch runs in that order).
    w = joinworld(JOB, (DEVICES[2], *JOB), JOB[0], "n", None, timeout=5)
    assert w is not None and (w.size, w.rank) == (3, 1)
    assert joinworld(JOB, JOB, DEVICES[0], "n", None, timeout=5) is None  # nobody joins


def test_a_subworld_is_only_devices_leaving_in_the_same_order(monkeypatch) -> None:
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    w = subworld(DEVICES, STAY, DEVICES[1], timeout=5)
    assert w is not None and (w.ranks, w.rank) == ((1, 2), 0)
    assert subworld(DEVICES, STAY[::-1], DEVICES[1], timeout=5) is None  # another order
    assert subworld(DEVICES, DEVICES, DEVICES[1], timeout=5) is None  # nobody leaves
    assert subworld(DEVICES, (DEVICES[1], "node1:gpu0"), DEVICES[1], timeout=5) is None  # joins
    assert subworld(DEVICES, STAY, DEVICES[2], timeout=5) is None  # rank 1 is not gpu2


@pytest.mark.parametrize("backend", ["nccl"])
def test_not_on_nccl(backend, monkeypatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: backend)
    assert not supported({})
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    assert supported({}) and not supported({"sharp_enabled_group": "dp"})
