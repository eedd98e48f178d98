"""``planner.sums.sum_by_index`` against ``np.add.at``: exact int64 per-index sums, through
``bincount`` while the total stays below 2**52 and ``add.at`` beyond (where float64 would round)."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from dynatrain.planner.sums import sum_by_index


def _reference(index: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((n, *values.shape[1:]), np.int64)
    np.add.at(out, index, values)
    return out


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), rows=st.integers(0, 200), cols=st.integers(0, 9),
       top=st.sampled_from([1, 2**20, 2**45, 2**58]), seed=st.integers(0, 2**32 - 1))
def test_sums_match_add_at(n: int, rows: int, cols: int, top: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    index = rng.integers(0, n, rows)
    shape = (rows,) if cols == 0 else (rows, cols)
    values = rng.integers(0, top, shape, dtype=np.int64)
    got = sum_by_index(index, values, n)
    assert got.dtype == np.int64
    assert np.array_equal(got, _reference(index, values, n))


def test_sums_beyond_float_precision_stay_exact() -> None:
    """2**53 + 1 is no float64: the float path would return 2**53."""
    index = np.array([0, 0, 1])
    values = np.array([2**53, 1, 3], np.int64)
    assert sum_by_index(index, values, 2).tolist() == [2**53 + 1, 3]
