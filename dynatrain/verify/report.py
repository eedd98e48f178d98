"""What the verifier found: violations of named rules, each with a witness.

A witness is concrete evidence a person can check by hand: for the data rules (coverage, source,
expert) one coordinate of the logical tensor that is wrong; for deadlock the cycle of messages
that wait on each other; for memory the round, device and bytes over the limit (one violation
per kind of overflow, for the worst device, with the others counted and listed).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.errors import EXIT_VERIFY_FAILED, DynatrainError

RULES = ("coverage", "source", "expert", "deadlock", "memory")
RULE_TEXT = {
    "coverage": "every destination element is written exactly once",
    "source": "every transfer reads what its sending device holds",
    "expert": "each expert has one owner per expert-data-parallel replica and only it receives",
    "deadlock": "every device runs its messages in an order with no cycle of waits",
    "memory": "staging stays within the budget, state plus staging plus reserve within device "
              "memory",
}


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule instance.

    ``witness``: for coverage/source/expert, a coordinate in tensor ``key`` (``()`` for a
    scalar such as ``optimizer.step``); for deadlock, the messages of a wait cycle (or the one
    left unmatched) as ``(round, index)`` pairs; for memory, ``(round, bytes, limit)`` of the
    worst device (``devices[0]``; the other devices over follow, truncated), or a coordinate
    when one transfer declares the wrong byte count.
    """

    rule: str
    detail: str
    key: str | None = None
    kind: str | None = None
    ranks: tuple[int, ...] = ()
    devices: tuple[str, ...] = ()
    witness: tuple = ()

    def __str__(self) -> str:
        if not self.key:
            return f"{self.rule}: {self.detail}"
        at = "[" + ", ".join(map(str, self.witness)) + "]"
        return f"{self.rule}: {self.key}{at} [{self.kind}] {self.detail}"


@dataclass(frozen=True)
class VerifyReport:
    """Every violation found (at most ``limit`` kept per rule; ``dropped`` counts the rest)."""

    violations: tuple[Violation, ...]
    checked: dict
    seconds: float
    dropped: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations and not self.dropped

    def rules(self) -> set[str]:
        return {v.rule for v in self.violations}

    def __str__(self) -> str:
        if self.ok:
            return (f"verified: {', '.join(RULES)} hold "
                    f"({self.checked.get('transfers', 0)} transfers, {self.seconds:.2f} s)")
        lines = [f"verification failed: {len(self.violations) + self.dropped} violation(s)"]
        lines += [f"  {v}" for v in self.violations]
        if self.dropped:
            lines.append(f"  ... and {self.dropped} more")
        return "\n".join(lines)


class VerificationError(DynatrainError):
    """A plan broke at least one rule; ``report`` holds every violation."""

    exit_code = EXIT_VERIFY_FAILED

    def __init__(self, report: VerifyReport) -> None:
        self.report = report
        first = report.violations[0] if report.violations else None
        more = len(report.violations) + report.dropped - 1
        super().__init__(f"plan fails verification: {first}"
                         + (f" (and {more} more)" if more > 0 else ""))


class Collector:
    """Receives violations (``emit``), keeping at most ``limit`` per rule and counting the
    rest, and turns them into a ``VerifyReport`` (``report``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept: list[Violation] = []
        self.per_rule: dict[str, int] = {}

    def emit(self, v: Violation) -> None:
        n = self.per_rule[v.rule] = self.per_rule.get(v.rule, 0) + 1
        if n <= self.limit:
            self.kept.append(v)

    def report(self, checked: dict, seconds: float) -> VerifyReport:
        dropped = sum(max(0, n - self.limit) for n in self.per_rule.values())
        return VerifyReport(tuple(self.kept), checked, seconds, dropped)
