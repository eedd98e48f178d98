"""Byte sizes as people write them: ``2GiB``, ``512 MiB``, ``1.5e9``, or an int.

A bare number means bytes. Text below ``MIN_BARE_BYTES`` written without a unit is refused:
``--budget 2`` is far more likely "2 GiB" than two bytes, and a two-byte budget cannot move a
single element anyway.
"""

from __future__ import annotations

import math
import re

from .errors import DynatrainError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
MIN_BARE_BYTES = 1024  # a unitless size below this is refused as a likely missing unit
MAX_BYTES = 1 << 60
# A decimal number in ASCII: float() alone also takes '١٢' (Arabic-Indic digits), 'inf', 'nan'.
_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?")


def parse_bytes(size: str | int, field: str = "--budget", *, allow_zero: bool = False) -> int:
    """``'2GiB'``, ``'512MiB'``, ``'1e9'``, ``4096`` -> bytes (int).

    Units: B, K/KiB, M/MiB, G/GiB, T/TiB (powers of 1024) and KB, MB, GB, TB (powers of 1000),
    any case. A bare number means bytes; typed without a unit it must be at least 1024 (an
    ``int`` is taken as bytes whatever its size). Digits are ASCII 0-9 only (Python's float()
    also reads other scripts' digits). ``allow_zero``: zero, in any unit (``0``, ``0GiB``), is
    a size too (a reserve may be nothing; a budget may not).

    Raises:
        DynatrainError: naming ``field``, for anything that is not a positive finite size (or
            zero, with ``allow_zero``).
    """
    if isinstance(size, bool):
        raise DynatrainError(f"{field}: expected a size like 2GiB or 512MiB (got {size!r})")
    if isinstance(size, int):
        if allow_zero and size == 0:
            return 0
        if not 0 < size < MAX_BYTES:
            raise DynatrainError(f"{field}: must be a positive size below 1 EiB (got {size!r})")
        return size  # an int in code is bytes on purpose; only typed text can miss a unit
    if not isinstance(size, str):
        raise DynatrainError(f"{field}: expected a size like 2GiB or 512MiB (got {size!r})")
    t = size.strip().lower().replace(" ", "").replace("_", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if _NUMBER.fullmatch(num) and unit not in _UNITS:
        raise DynatrainError(f"{field}: unknown unit {size.strip()[len(num):][:12]!r}; units "
                             f"are B, K/KiB, M/MiB, G/GiB, T/TiB, KB, MB, GB, TB, sizes below "
                             f"1 EiB (got {size[:40]!r})")
    if not _NUMBER.fullmatch(num):
        raise DynatrainError(f"{field}: expected a size like 2GiB or 512MiB, digits 0-9 "
                             f"(got {size[:40]!r})")
    value = float(num) * _UNITS[unit]
    if allow_zero and value == 0:
        return 0
    if not (math.isfinite(value) and 0 < value < MAX_BYTES) or int(value) < 1:
        raise DynatrainError(f"{field}: must be a positive size below 1 EiB (got {size[:40]!r})")
    if not unit and value < MIN_BARE_BYTES:
        return _bare_refusal(field, size)
    return int(value)


def _bare_refusal(field: str, size: object) -> int:
    raise DynatrainError(f"{field}: {size} without a unit means {size} bytes; write the unit, "
                         f"e.g. {size}GiB or {size}MiB (a bare number means bytes and must be "
                         f"at least {MIN_BARE_BYTES})")


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``; whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def format_seconds(s: float) -> str:
    """A duration in the unit that shows it: ``'1.234 s'``, ``'12.3 ms'``, ``'4.6 us'``,
    ``'0 s'``; below a nanosecond ``'<1 ns'``, and huge ones in scientific notation rather
    than hundreds of digits."""
    if s == 0:
        return "0 s"
    if not math.isfinite(s):
        return f"{s} s"
    a = abs(s)
    if a >= 1e6:
        return f"{s:.3g} s"
    if a >= 1:
        return f"{s:.3f} s"
    if a >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if a >= 1e-6:
        return f"{s * 1e6:.3g} us"
    if a >= 1e-9:
        return f"{s * 1e9:.3g} ns"
    return "<1 ns"
