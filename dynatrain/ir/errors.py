"""Exception hierarchy shared by every DynaTrain layer.

Every error a user can trigger carries the offending field and a one-line message that names the
rule and the value; the CLI prints ``str(err)`` and exits with the error's ``exit_code``.

Exit statuses, the same for every command:

====  ==============================================================================
0     success
1     a plan breaks a verification rule, or a switch's destination is not bit-exact
2     bad input: a spec, plan file, topology, option or checkpoint
3     state lost: some state has no surviving copy to take it from
4     switch aborted: a process died, timed out or voted no; the source state is intact
====  ==============================================================================
"""

from __future__ import annotations

import reprlib

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_LOST = 3
EXIT_ABORTED = 4


class DynatrainError(Exception):
    """Base class of every error DynaTrain raises on purpose.

    ``exit_code``: the CLI's exit status for it (bad input unless a subclass says otherwise).
    """

    exit_code = EXIT_BAD_INPUT


class SpecError(DynatrainError, ValueError):
    """A layout spec is malformed or breaks a rule megatron-core enforces.

    Attributes:
        field: dotted path of the offending field, e.g. ``parallel.tp``.
        rule: the rule that was broken, in words.
        value: the offending value (may be ``None``).
    """

    def __init__(self, field: str, rule: str, value: object = None) -> None:
        self.field, self.rule, self.value = field, rule, value
        got = "" if value is None else f" (got {shown(value)})"
        super().__init__(f"{field}: {rule}{got}")


class LayoutError(DynatrainError, ValueError):
    """An internal layout computation hit an impossible state (a bug, not bad input)."""


def shown(value: object, limit: int = 80) -> str:
    """``value`` quoted in a one-line message, at most ``limit`` characters.

    reprlib bounds the work too: the full repr of a YAML alias bomb (a few hundred bytes
    naming 9**9 strings) would take minutes and gigabytes before being cut."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int of over 4300 digits has no repr (sys.set_int_max_str_digits)
        return f"<a {type(value).__name__} too large to show>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


_REPR = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 80, 80, 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 8
