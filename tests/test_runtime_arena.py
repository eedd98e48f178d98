"""The staging arena: a round's staged pieces plus the next round's sends packed ahead, never
more than the budget, and packed bytes equal to the views they were packed from.

Rounds here are built by hand (pieces over one source tensor), so each budget decision is
exercised on purpose: packing ahead allowed, refused, and a refused round after an allowed one,
whose own staging must not sit on top of buffers kept from earlier rounds.
"""

from __future__ import annotations

import torch

from dynatrain.runtime.exchange import Arena, Piece, RoundWork

SOURCE = torch.arange(4096, dtype=torch.int32).view(torch.uint8)  # distinct bytes


def _round(index: int, staged_sends: list[int], staged_recvs: int) -> RoundWork:
    """A round whose sends pack slices of ``SOURCE`` (two views each) and which receives
    ``staged_recvs`` staged bytes."""
    sends, off = [], 0
    for n in staged_sends:
        views = [SOURCE[off:off + n // 2], SOURCE[off + 1000:off + 1000 + n - n // 2]]
        sends.append(Piece(1, len(sends), n, views, False))
        off += n
    recvs = [Piece(1, 0, staged_recvs, [torch.empty(staged_recvs, dtype=torch.uint8)], False)]
    staging = sum(staged_sends) + staged_recvs
    return RoundWork(index, recvs, sends, [], None, None, sum(staged_sends), staged_recvs, 0,
                     staging, staging)


def _packed_right(work: RoundWork) -> bool:
    return all(torch.equal(p.wire, torch.cat(p.views)) for p in work.sends)


def test_next_round_is_packed_ahead_when_it_fits() -> None:
    arena = Arena(budget=1000)
    first, second = _round(0, [100], 500), _round(1, [200, 100], 100)
    arena.carve(first)
    assert arena.pack_ahead(second) == 300 and second.packed_ahead == 300
    assert all(p.ahead for p in second.sends) and _packed_right(second)
    arena.carve(second)  # keeps the packed wires, stages only the receive
    assert _packed_right(second) and second.recvs[0].wire.numel() == 100
    assert arena.peak <= 1000


def test_packing_ahead_is_refused_beyond_the_budget() -> None:
    arena = Arena(budget=1000)
    first, second = _round(0, [300], 600), _round(1, [200], 100)
    arena.carve(first)  # holds 900: 200 more would be 1100
    assert arena.pack_ahead(second) == 0 and not any(p.ahead for p in second.sends)
    arena.carve(second)
    assert arena.peak == 900


def test_a_refused_round_does_not_stage_on_top_of_earlier_buffers() -> None:
    arena = Arena(budget=1000)
    r0, r1, r2 = _round(0, [100], 500), _round(1, [300], 0), _round(2, [100], 800)
    arena.carve(r0)
    assert arena.pack_ahead(r1) == 300  # 600 + 300 fits
    arena.carve(r1)
    assert arena.pack_ahead(r2) == 0  # 900 of its own staging next to r1's 300: refused
    arena.carve(r2)  # r1's sends completed: its buffer makes room
    assert not any(p.ahead for p in r2.sends)  # r2 packs its sends itself, in the round
    assert all(p.wire.numel() == p.nbytes for p in r2.sends + r2.recvs)
    assert arena.peak <= 1000 and arena.held() == 900


def test_without_a_budget_every_next_round_is_packed_ahead() -> None:
    arena = Arena()
    work = _round(0, [10], 10)
    nxt = _round(1, [4000], 0)
    arena.carve(work)
    assert arena.pack_ahead(nxt) == 4000 and _packed_right(nxt)
