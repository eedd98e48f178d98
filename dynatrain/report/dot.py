"""Graphviz DOT text of a plan's rounds and messages, for reading small plans by eye.

One cluster per round holds a node per device that sends or receives in it (``device@rN``) and
an edge per message, labelled with its size and transfer count: a message between devices is a
solid edge, a local copy (a device to itself) a dashed self-loop. The graph label counts both
apart, in the words the plan summary uses ("10 messages between devices + 4 local copies"), and
a legend line says what each edge style is. A chain of round anchors, one per cluster, shows the
order in which rounds run. The text is meant for ``dot -Tsvg``; large plans are refused rather
than drawn as a hairball, and ``check_dot_size`` refuses them before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..ir.errors import DynatrainError
from ..ir.units import format_bytes
from ..planner.plan import Message, Plan

DOT_SUFFIXES = (".dot", ".gv")
MAX_DOT_MESSAGES = 500  # every message is an edge to lay out; beyond this dot draws a hairball
LEGEND = "solid edge: message between devices; dashed self-loop: local copy on one device"

# Same text as ``format_bytes``; kept under this name for existing callers.
human_bytes = format_bytes


@dataclass(frozen=True, slots=True)
class MessageCounts:
    """A plan's messages, split the way every report counts them.

    ``between_devices``: messages whose source and destination devices differ (what
    ``plan.stats["messages"]`` counts); ``local_copies``: messages from a device to itself.
    """

    between_devices: int
    local_copies: int

    @classmethod
    def of(cls, messages) -> "MessageCounts":
        """Count an iterable of ``Message`` (a plan's, or one round's)."""
        local = remote = 0
        for m in messages:
            if m.local:
                local += 1
            else:
                remote += 1
        return cls(remote, local)

    @property
    def total(self) -> int:
        return self.between_devices + self.local_copies

    def __str__(self) -> str:  # "10 messages between devices + 4 local copies"
        return count_label(self.between_devices, self.local_copies)


def count_label(between_devices: int, local_copies: int) -> str:
    """``"10 messages between devices + 4 local copies"``, singular where the count is 1."""
    msgs = "message" if between_devices == 1 else "messages"
    copies = "copy" if local_copies == 1 else "copies"
    return f"{between_devices} {msgs} between devices + {local_copies} local {copies}"


def message_counts(plan: Plan) -> MessageCounts:
    """Messages between devices and local copies of ``plan``, over all rounds."""
    return MessageCounts.of(plan.messages())


def check_dot_size(plan: Plan, max_messages: int = MAX_DOT_MESSAGES) -> None:
    """Refuse, in one line, a plan too large to draw; cheap, so call it before writing anything.

    Raises:
        DynatrainError: the plan has more than ``max_messages`` messages (local copies count:
            each is an edge to lay out).
    """
    counts = message_counts(plan)
    if counts.total > max_messages:
        raise DynatrainError(f"--dot: the plan has {counts.total} messages ({counts}); --dot "
                             f"draws plans of at most {max_messages} messages")


def check_dot_world(src_devices, dst_devices, max_messages: int = MAX_DOT_MESSAGES) -> None:
    """Refuse, before planning, a switch whose plan is surely too large to draw: every
    destination device receives its state in at least one message or local copy, and every
    source device that leaves sends at least one.

    Raises:
        DynatrainError: that lower bound is above ``max_messages``.
    """
    dst = set(dst_devices)
    least = len(dst) + len(set(src_devices) - dst)
    if least > max_messages:
        raise DynatrainError(f"--dot: a switch over {least} devices has at least {least} "
                             f"messages; --dot draws plans of at most {max_messages} messages")


def check_dot_path(path: str | Path) -> Path:
    """The output path, refused in one line unless it ends in ``.dot``/``.gv`` in a directory
    that exists (cheap: the CLI calls it before writing any output)."""
    p = Path(path)
    if p.suffix.lower() not in DOT_SUFFIXES:
        raise DynatrainError(f"--dot: the output must end in .dot or .gv (got {str(p)!r})")
    if p.is_dir() or not p.parent.is_dir():
        why = "it is a directory" if p.is_dir() else "no such directory"
        raise DynatrainError(f"--dot: cannot write {str(p)!r} ({why})")
    return p


def quote(text: str) -> str:
    """A DOT double-quoted ID: any string, including ``"``, ``\\`` and newlines, is safe."""
    body = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{body}"'


def _edge_label(m: Message) -> str:
    n = len(m.transfers)
    # "\n" is DOT's centred line break inside a label; quote() would escape it, so build raw.
    return (f'"{format_bytes(m.nbytes)}\\n{n} transfer{"" if n == 1 else "s"}'
            f'{" (local copy)" if m.local else ""}"')


def plan_to_dot(plan: Plan, max_messages: int = MAX_DOT_MESSAGES) -> str:
    """Render ``plan`` as a Graphviz digraph: one cluster per round, one edge per message.

    Every message counts toward ``max_messages``, local copies included, since each one is an
    edge to lay out. Edge labels give each message's bytes and transfers (the records the plan
    file and ``--text`` list for it).

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
    check_dot_size(plan, max_messages)
    counts = message_counts(plan)
    moved = sum(m.nbytes for m in plan.messages() if not m.local)
    local = sum(m.nbytes for m in plan.messages() if m.local)
    rounds = len(plan.rounds)
    # "\n" joins the lines after quoting (quote() would escape a newline into a literal one).
    title = "\\n".join(quote(line)[1:-1] for line in (
        f"{plan.src_name} -> {plan.dst_name}: {rounds} round{'' if rounds == 1 else 's'}",
        f"{counts} ({format_bytes(moved)} moved between devices, {format_bytes(local)} copied "
        "locally)",
        LEGEND))
    out = [
        f"digraph {quote('plan')} {{",
        f'  graph [label="{title}", labelloc=t, rankdir=LR, compound=true, '
        f"fontname={quote('Helvetica')}];",
        f"  node [shape=box, fontsize=10, fontname={quote('Helvetica')}];",
        "  edge [fontsize=9];",
    ]
    for i, rnd in enumerate(plan.rounds):
        out.append(f"  subgraph {quote(f'cluster_r{i}')} {{")
        label = (f"round {i}: {MessageCounts.of(rnd.messages)}, "
                 f"{format_bytes(sum(m.nbytes for m in rnd.messages))}")
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


def write_dot(plan: Plan, path: str | Path, max_messages: int = MAX_DOT_MESSAGES) -> None:
    """Write ``plan_to_dot(plan, max_messages)`` to ``path`` (suffix ``.dot`` or ``.gv``).

    Checks the path and the plan's size (``check_dot_path``, ``check_dot_size``) before it
    draws, so a refused plan leaves no file behind.

    Raises:
        DynatrainError: wrong suffix, too many messages, or the file cannot be written.
    """
    p = check_dot_path(path)
    text = plan_to_dot(plan, max_messages)
    try:
        p.write_text(text, encoding="utf-8")
    except OSError as err:
        raise DynatrainError(f"--dot: cannot write {str(p)!r} ({err.strerror or err})") from None
