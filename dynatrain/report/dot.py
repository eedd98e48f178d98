"""Graphviz DOT text of a plan's rounds and messages, for reading small plans by eye.

One cluster per round holds a node per device that sends or receives in it (``device@rN``) and
an edge per message, labelled with its size and transfer count; local copies are dashed
self-loops. A chain of round anchors, one per cluster, shows the order in which rounds run. The
text is meant for ``dot -Tsvg``; large plans are refused rather than drawn as a hairball.
"""

from __future__ import annotations

from pathlib import Path

from ..ir.errors import DynatrainError
from ..planner.plan import Message, Plan

DOT_SUFFIXES = (".dot", ".gv")


def human_bytes(n: float) -> str:
    """Binary-unit size for labels: ``512 B``, ``12.5 MiB``, ``1.2 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def quote(text: str) -> str:
    """A DOT double-quoted ID: any string, including ``"``, ``\\`` and newlines, is safe."""
    body = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{body}"'


def _edge_label(m: Message) -> str:
    n = len(m.transfers)
    # "\n" is DOT's centred line break inside a label; quote() would escape it, so build raw.
    return (f'"{human_bytes(m.nbytes)}\\n{n} transfer{"" if n == 1 else "s"}'
            f'{" (local)" if m.local else ""}"')


def plan_to_dot(plan: Plan, max_messages: int = 500) -> str:
    """Render ``plan`` as a Graphviz digraph: one cluster per round, one edge per message.

    Every message counts toward ``max_messages``, local copies included, since each one is an
    edge to lay out.

    Args:
        plan: the plan to draw.
        max_messages: refuse plans with more messages than this.

    Returns:
        DOT source text ending in a newline.

    Raises:
        DynatrainError: the plan has more than ``max_messages`` messages.

    Example:
        >>> text = plan_to_dot(plan)            # doctest: +SKIP
        >>> Path("plan.dot").write_text(text)   # then: dot -Tsvg plan.dot > plan.svg
    """
    total = sum(len(r.messages) for r in plan.rounds)
    if total > max_messages:
        raise DynatrainError(f"plan has {total} messages; --dot is for plans with at most "
                             f"{max_messages}")
    title = (f"{plan.src_name} -> {plan.dst_name}: {len(plan.rounds)} rounds, {total} messages, "
             f"{human_bytes(sum(m.nbytes for m in plan.messages() if not m.local))} moved")
    out = [
        f"digraph {quote('plan')} {{",
        f"  graph [label={quote(title)}, labelloc=t, rankdir=LR, compound=true, "
        f"fontname={quote('Helvetica')}];",
        f"  node [shape=box, fontsize=10, fontname={quote('Helvetica')}];",
        "  edge [fontsize=9];",
    ]
    for i, rnd in enumerate(plan.rounds):
        nbytes = sum(m.nbytes for m in rnd.messages)
        out.append(f"  subgraph {quote(f'cluster_r{i}')} {{")
        label = f"round {i}: {len(rnd.messages)} messages, {human_bytes(nbytes)}"
        out.append(f"    label={quote(label)};")
        out.append(f"    {quote(f'round{i}')} [shape=plaintext, label={quote(f'round {i}')}];")
        seen: dict[str, None] = {}  # devices in first-use order, so output is deterministic
        for m in rnd.messages:
            seen.setdefault(m.src_device)
            seen.setdefault(m.dst_device)
        for dev in seen:
            out.append(f"    {quote(f'{dev}@r{i}')} [label={quote(dev)}];")
        for m in rnd.messages:
            style = ", style=dashed" if m.local else ""
            out.append(f"    {quote(f'{m.src_device}@r{i}')} -> {quote(f'{m.dst_device}@r{i}')} "
                       f"[label={_edge_label(m)}{style}];")
        out.append("  }")
    # Order: anchor of round i -> anchor of round i+1 (bold, unlabelled, not a message).
    for i in range(len(plan.rounds) - 1):
        out.append(f"  {quote(f'round{i}')} -> {quote(f'round{i + 1}')} "
                   f"[style=bold, color=gray40, ltail={quote(f'cluster_r{i}')}, "
                   f"lhead={quote(f'cluster_r{i + 1}')}];")
    out.append("}")
    return "\n".join(out) + "\n"


def write_dot(plan: Plan, path: str | Path, max_messages: int = 500) -> None:
    """Write ``plan_to_dot(plan, max_messages)`` to ``path`` (suffix ``.dot`` or ``.gv``).

    Raises:
        DynatrainError: wrong suffix, too many messages, or the file cannot be written.
    """
    p = Path(path)
    if p.suffix.lower() not in DOT_SUFFIXES:
        raise DynatrainError(f"--dot: the output must end in .dot or .gv (got {str(p)!r})")
    text = plan_to_dot(plan, max_messages)
    try:
        p.write_text(text, encoding="utf-8")
    except OSError as err:
        raise DynatrainError(f"--dot: cannot write {str(p)!r} ({err.strerror or err})") from None
