"""Device lists as people type them: ``node0:gpu0-5,node1,node4-7,node9:gpu3``.

One parser for every option that names devices (``suggest --devices``, ``--failed``), so a
form one accepts the other accepts too. An item is a node or a range of nodes, optionally
with ``:gpu`` and a gpu or range of gpus; a whole node means all its gpus (the spec's
``world.gpus_per_node``, or the node's devices in its ``world.devices`` list). Numbers are
ASCII digits 0-9 (``str.isdigit`` and ``re``'s ``\\d`` also take other scripts' digits), ranges
run low to high, and the list is bounded before any name is built, so ``node0-99999999``
is refused at once rather than building millions of names.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .errors import DynatrainError

MAX_NODE = 10**6 - 1  # ``spec.DEVICE_ID``: node < 10**6, gpu < 10**4
MAX_GPU = 10**4 - 1
_ITEM = re.compile(r"node([0-9]+)(?:-([0-9]+))?(?::gpu([0-9]+)(?:-([0-9]+))?)?")
_FORMS = "node0:gpu0-5, node0:gpu3, node2 or node0-3 (digits 0-9)"


def _range(item: str, option: str, what: str, lo: str, hi: str | None, top: int) -> range:
    # Compare lengths before int(): a 5000-digit number is refused, not converted.
    if max(len(lo), len(hi or "")) > len(str(top)) or int(lo) > top or (
            hi is not None and int(hi) > top):
        raise DynatrainError(f"{option}: {item[:40]!r} is out of range: {what} numbers must "
                             f"be at most {top}")
    a, b = int(lo), int(hi if hi is not None else lo)
    if b < a:
        raise DynatrainError(f"{option}: {item[:40]!r}: the {what} range {a}-{b} is reversed; "
                             f"ranges run low-high ({what}{b}-{a})")
    return range(a, b + 1)


def parse_device_list(text: str, option: str, *, gpus_per_node: int | None = None,
                      listed: Sequence[str] | None = None,
                      max_devices: int = MAX_NODE, bound: str | None = None) -> list[str]:
    """The device names ``text`` lists, in order.

    Args:
        text: comma-separated items (see the module docstring).
        option: the option to name in errors (``--devices``, ``--failed``).
        gpus_per_node: the spec's ``world.gpus_per_node``: a whole node has that many gpus,
            and a gpu number at or above it is refused.
        listed: the spec's ``world.devices``: a whole node means its devices listed there.
        max_devices: refuse a list naming more devices than this, before building it.
        bound: what ``max_devices`` is, for the refusal (default: the most ``option`` takes).

    Raises:
        DynatrainError: one line naming ``option`` and what is wrong: a malformed item, a
            reversed range, a number too large, a gpu beyond ``gpus_per_node``, a whole node
            of unknown size, a device listed twice, or too many devices.

    Example:
        >>> parse_device_list("node0:gpu0-1,node1:gpu3", "--devices")
        ['node0:gpu0', 'node0:gpu1', 'node1:gpu3']
    """
    if not isinstance(text, str) or not text.strip():
        raise DynatrainError(f"{option}: expected devices like node0:gpu0-5,node1 (got nothing)")
    bound = bound or f"the most {option} takes"
    per_node: dict[int, list[str]] = {}
    for d in listed or ():
        node, _, _ = d.partition(":")
        per_node.setdefault(int(node.removeprefix("node")), []).append(d)
    plan: list[tuple[str, range, range | None]] = []
    count = 0
    for item in (t.strip() for t in text.split(",")):
        m = _ITEM.fullmatch(item)
        if m is None:
            raise DynatrainError(f"{option}: {item[:40]!r} is not like {_FORMS}")
        nodes = _range(item, option, "node", m.group(1), m.group(2), MAX_NODE)
        gpus = (None if m.group(3) is None
                else _range(item, option, "gpu", m.group(3), m.group(4), MAX_GPU))
        if gpus is not None and gpus_per_node is not None and gpus[-1] >= gpus_per_node:
            raise DynatrainError(
                f"{option}: {item[:40]!r}: gpu{gpus[-1]} is out of range; the spec has "
                f"world.gpus_per_node = {gpus_per_node} (gpu0-{gpus_per_node - 1})")
        if len(nodes) > max_devices:  # before anything walks the nodes
            raise DynatrainError(f"{option}: {item[:40]!r} names more than {max_devices} "
                                 f"devices, {bound}")
        if gpus is not None:
            count += len(nodes) * len(gpus)
        elif gpus_per_node is not None:
            count += len(nodes) * gpus_per_node
        else:
            missing = next((n for n in nodes if n not in per_node), None)
            if missing is not None:
                raise DynatrainError(
                    f"{option}: {item[:40]!r} names a whole node, but the spec does not say how "
                    f"many gpus node{missing} has (no world.gpus_per_node, and world.devices "
                    f"lists none of node{missing}); list them (node{missing}:gpu0-7)")
            count += sum(len(per_node[n]) for n in nodes)
        if count > max_devices:
            raise DynatrainError(f"{option}: {text[:40]!r} names more than {max_devices} "
                                 f"devices, {bound}")
        plan.append((item, nodes, gpus))
    out: list[str] = []
    for _, nodes, gpus in plan:
        for n in nodes:
            if gpus is not None:
                out += [f"node{n}:gpu{g}" for g in gpus]
            elif gpus_per_node is not None:
                out += [f"node{n}:gpu{g}" for g in range(gpus_per_node)]
            else:
                out += per_node[n]
    seen: set[str] = set()
    for d in out:
        if d in seen:
            raise DynatrainError(f"{option}: {d} is listed twice")
        seen.add(d)
    return out
