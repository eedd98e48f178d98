"""Deadlock freedom: every device's message order within a round admits one global order.

Model: a round runs its messages as rendezvous; a device runs the messages it sends or receives
one after another in its listed order, and a message runs when both its devices reach it (the
strictest runtime; one free of deadlock here is free of it with buffered sends too). So every
message must be listed exactly once by each of its devices, and the wait-for graph (an edge from
each message to the next one of the same device) must be acyclic: then a topological order is a
global order in which every send meets its receive. An order that only goes forward through
``messages`` is acyclic by construction; other rounds are checked with networkx.
"""

from __future__ import annotations


from ..planner.plan import Plan, Round
from .data import Emit
from .report import Violation


def check_deadlock(plan: Plan, emit: Emit) -> int:
    """Emit a violation per round whose device orders are inconsistent or cyclic.

    Returns the number of rounds checked.

    A plan kept as classes (``planner.classes``) has no order of its own: every round runs
    its messages in one global sequence (``plan.message_order``), which cannot deadlock.
    """
    if plan.classes is not None:
        return len(plan.rounds)
    for r, rnd in enumerate(plan.rounds):
        order = rnd.device_order()
        if _check_listing(r, rnd, order, emit) and not _forward(order):
            _check_cycle(r, rnd, order, emit)
    return len(plan.rounds)


def _check_listing(r: int, rnd: Round, order: dict[str, tuple[int, ...]], emit: Emit) -> bool:
    """Each message listed once by each of its devices and by no other; True if so."""
    msgs = rnd.messages
    n = len(msgs)
    ok = True
    # How many times each message is listed by its sender and by its receiver (a local copy:
    # its one device counts as the sender).
    by_src, by_dst = [0] * n, [0] * n
    for dev, ix in order.items():
        for i in ix:
            if not 0 <= i < n:
                emit(Violation("deadlock", f"round {r}: {dev} runs message {i}, but the round has "
                               f"{n}", devices=(dev,), witness=((r, i),)))
                ok = False
                continue
            m = msgs[i]
            if dev == m.src_device:
                by_src[i] += 1
            elif dev == m.dst_device:
                by_dst[i] += 1
            else:
                emit(Violation("deadlock", f"round {r}: {dev} runs message {i} "
                               f"({m.src_device} -> {m.dst_device}), which is not its own",
                               devices=(dev,), witness=((r, i),)))
                ok = False
    for i, m in enumerate(msgs):
        if by_src[i] == 1 and (by_dst[i] == 1 or m.src_device == m.dst_device):
            continue
        for dev, times in ((m.src_device, by_src[i]), (m.dst_device, by_dst[i]))[
                :1 if m.src_device == m.dst_device else 2]:
            if times != 1:
                side = "send" if dev == m.src_device else "receive"
                emit(Violation("deadlock", f"round {r}: {dev} runs the {side} of message {i} "
                               f"({m.src_device} -> {m.dst_device}) {times} times, not once"
                               + (": its peer waits forever" if times == 0 else ""),
                               devices=(m.src_device, m.dst_device), witness=((r, i),)))
                ok = False
    return ok


def _forward(order: dict[str, tuple[int, ...]]) -> bool:
    return all(a < b for ix in order.values() for a, b in zip(ix, ix[1:]))


def _check_cycle(r: int, rnd: Round, order: dict[str, tuple[int, ...]], emit: Emit) -> None:
    import networkx as nx  # here: only rounds out of forward order need it; its import is slow

    g = nx.DiGraph()
    g.add_nodes_from(range(len(rnd.messages)))
    for ix in order.values():
        g.add_edges_from(zip(ix, ix[1:]))
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return
    nodes = [a for a, _ in cycle]
    devices = tuple(dict.fromkeys(d for i in nodes for d in (rnd.messages[i].src_device,
                                                             rnd.messages[i].dst_device)))
    path = " -> ".join(f"#{i} ({rnd.messages[i].src_device}->{rnd.messages[i].dst_device})"
                       for i in nodes)
    emit(Violation("deadlock", f"round {r}: messages wait on each other in a cycle: {path} -> "
                   f"#{nodes[0]}", devices=devices, witness=tuple((r, i) for i in nodes)))
