"""Transfer fingerprints: exactly the documented formula, independent of how a segment is cut
into chunks or laid out in memory, and moved by any changed or displaced byte or segment."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynatrain.runtime import fingerprint as fp
from dynatrain.runtime.storage import row_blocks

CPU = torch.device("cpu")


def _reference(segments: list[bytes]) -> list[int]:
    """The documented formula in plain Python integers."""
    s1 = s2 = 0
    for k, data in enumerate(segments):
        padded = data + b"\0" * (len(data) % 2)
        words = [int.from_bytes(padded[i:i + 2], sys.byteorder, signed=True)
                 for i in range(0, len(padded), 2)]
        a = sum(words)
        b = sum((i + 1) * w for i, w in enumerate(words))
        s1 += a
        s2 += b + (k + 1) * a
    return [s1 % fp.PRIME, s2 % fp.PRIME]


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)


@settings(max_examples=60, deadline=None)
@given(segments=st.lists(st.binary(max_size=300), max_size=4), chunk=st.sampled_from([2, 8, 64]))
def test_fingerprint_is_the_formula_in_any_chunking(segments: list[bytes], chunk: int) -> None:
    views = [_tensor(d) for d in segments]
    assert fp.fingerprint(views, CPU).tolist() == _reference(segments)
    saved = fp.CHUNK
    try:
        fp.CHUNK = chunk  # many chunks per segment: the same value
        assert fp.fingerprint(views, CPU).tolist() == _reference(segments)
    finally:
        fp.CHUNK = saved


@pytest.mark.parametrize("chunk", [64, 1000, 1 << 20])
def test_strided_and_odd_views_match_the_formula(chunk: int, monkeypatch) -> None:
    # Blocks of whole 93-byte rows have odd lengths: their last byte starts the next word.
    monkeypatch.setattr(fp, "CHUNK", chunk)
    gen = torch.Generator().manual_seed(3)
    grid = torch.randint(0, 256, (37, 130), dtype=torch.uint8, generator=gen)
    strided = grid[:, 7:100]  # rows of 93 bytes, 130 apart: odd lengths and addresses
    cube = torch.randint(0, 256, (5, 9, 41), dtype=torch.uint8, generator=gen)[1:4, :, 3:40]
    odd = grid.view(-1)[1:2001]  # starts at an odd address
    assert not strided.is_contiguous() and not cube.is_contiguous() and odd.data_ptr() % 2
    want = _reference([bytes(v.flatten().tolist()) for v in (strided, cube, odd)])
    assert fp.fingerprint([strided, cube, odd], CPU).tolist() == want


@pytest.mark.parametrize("chunk", [64, 1000])
def test_blocks_cover_a_strided_view_in_order_and_stay_small(chunk: int, monkeypatch) -> None:
    # A strided segment is copied block by block, never whole.
    monkeypatch.setattr(fp, "CHUNK", chunk)
    view = torch.arange(40 * 3 * 700, dtype=torch.int32).view(torch.uint8).view(40, 3, 2800)
    view = view[:, 1:, 5:2705]  # rows longer than the chunk: cut inside rows too
    blocks = [b.reshape(-1) for b in row_blocks(view, fp.CHUNK)]
    assert all(b.numel() <= chunk for b in blocks)
    assert torch.equal(torch.cat(blocks), view.reshape(-1))


def test_a_changed_or_displaced_byte_or_segment_moves_the_fingerprint() -> None:
    gen = torch.Generator().manual_seed(4)
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=gen)
    base = fp.fingerprint([data], CPU)
    flipped = data.clone()
    flipped[1234] ^= 1
    assert fp.fingerprint([flipped], CPU)[0] != base[0]
    moved = data.clone()  # two different 16-bit words trade places: same sum, other positions
    moved[10:12], moved[4000:4002] = data[4000:4002], data[10:12]
    assert not torch.equal(data[10:12], data[4000:4002])
    got = fp.fingerprint([moved], CPU)
    assert got[0] == base[0] and got[1] != base[1]
    a, b = data[:100], data[100:300]
    assert fp.fingerprint([a, b], CPU)[1] != fp.fingerprint([b, a], CPU)[1]
