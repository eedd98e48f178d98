"""Exception hierarchy shared by every DynaTrain layer.

Every error a user can trigger carries the offending field and a one-line message that names the
rule and the value; the CLI prints ``str(err)`` and exits with status 2.
"""

from __future__ import annotations


class DynatrainError(Exception):
    """Base class of every error DynaTrain raises on purpose."""


class SpecError(DynatrainError, ValueError):
    """A layout spec is malformed or breaks a rule megatron-core enforces.

    Attributes:
        field: dotted path of the offending field, e.g. ``parallel.tp``.
        rule: the rule that was broken, in words.
        value: the offending value (may be ``None``).
    """

    def __init__(self, field: str, rule: str, value: object = None) -> None:
        self.field, self.rule, self.value = field, rule, value
        got = "" if value is None else f" (got {_short(value)})"
        super().__init__(f"{field}: {rule}{got}")


class LayoutError(DynatrainError, ValueError):
    """An internal layout computation hit an impossible state (a bug, not bad input)."""


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
