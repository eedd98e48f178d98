"""Transfer fingerprints: exactly the documented formula, independent of how the bytes are cut
into views, and moved by any changed or displaced byte."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynatrain.runtime import fingerprint as fp

CPU = torch.device("cpu")


def _reference(data: bytes) -> list[int]:
    """The documented formula in plain Python integers."""
    return [sum(data) % fp.PRIME, sum((i + 1) * b for i, b in enumerate(data)) % fp.PRIME]


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=700), cuts=st.lists(st.integers(0, 700), max_size=5))
def test_fingerprint_is_the_formula_however_the_bytes_are_cut(data: bytes, cuts: list[int]
                                                                ) -> None:
    whole = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    pieces = [whole[a:b] for a, b in zip(bounds, bounds[1:])]
    assert fp.fingerprint([whole], CPU).tolist() == _reference(data)
    assert fp.fingerprint(pieces, CPU).tolist() == _reference(data)


def test_large_and_strided_views_match_the_formula(monkeypatch) -> None:
    monkeypatch.setattr(fp, "CHUNK", 1000)  # several chunks, none a multiple of ROW
    gen = torch.Generator().manual_seed(3)
    grid = torch.randint(0, 256, (37, 130), dtype=torch.uint8, generator=gen)
    strided = grid[:, 7:101]  # rows of 94 bytes, 130 apart
    assert not strided.is_contiguous()
    assert fp.fingerprint([strided], CPU).tolist() == _reference(bytes(strided.flatten().tolist()))


def test_a_changed_or_displaced_byte_moves_the_fingerprint() -> None:
    gen = torch.Generator().manual_seed(4)
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=gen)
    base = fp.fingerprint([data], CPU)
    flipped = data.clone()
    flipped[1234] ^= 1
    assert fp.fingerprint([flipped], CPU)[0] != base[0]
    swapped = data.clone()
    i, j = 10, 4000
    while swapped[i] == swapped[j]:
        j += 1
    swapped[i], swapped[j] = data[j].item(), data[i].item()
    moved = fp.fingerprint([swapped], CPU)
    assert moved[0] == base[0] and moved[1] != base[1]
