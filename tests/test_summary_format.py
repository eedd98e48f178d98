"""``format_count``: counts of things for people, in scale words that cannot be read as bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec
from dynatrain.ir.summary import format_count, logical_parameter_count

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("n,text", [
    (0, "0"),
    (834, "834"),
    (999, "999"),
    (1000, "1.0 thousand"),
    (12_345, "12.3 thousand"),
    (999_949, "999.9 thousand"),
    (999_999, "1.0 million"),  # rounds up into the next scale, never "1000.0 thousand"
    (1_234_567, "1.2 million"),
    (70_553_706_496, "70.6 billion"),
    (999_999_999_999, "1.0 trillion"),
    (1_500_000_000_000, "1.5 trillion"),
    (10**15, "1000.0 trillion"),  # the largest scale grows instead of running out
    (-1500, "-1.5 thousand"),
])
def test_format_count(n: int, text: str) -> None:
    assert format_count(n) == text


@pytest.mark.parametrize("bad", [1.5, "12", None, True])
def test_format_count_needs_an_int(bad: object) -> None:
    with pytest.raises(TypeError, match="format_count needs an int"):
        format_count(bad)  # type: ignore[arg-type]


def test_tiny_model_is_not_zero() -> None:
    """The shipped tiny model: "0.00 B" before, now its count in thousands or millions."""
    n = logical_parameter_count(Layout(load_spec(ROOT / "specs" / "tiny-gpt" / "tp2-dp2.yaml")))
    text = format_count(n)
    assert 0 < n < 10**9 and not text.startswith("0")
    assert text.endswith((" thousand", " million"))
