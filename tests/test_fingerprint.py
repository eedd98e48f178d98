"""Transfer fingerprints: exactly the documented formula, independent of how a segment is laid
out in memory or cut into blocks and tiles, the same on the torch path, the Triton kernel and
CUDA, and moved by any changed or displaced byte or segment; on CPU, the word sums of the same
bytes (their own formula, exact however a view is read)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynatrain.runtime import fingerprint as fp

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]


def _reference(segments: list[bytes]) -> list[int]:
    """The documented formula in plain Python integers: the segments' bytes concatenated, as
    unsigned integers x[i]; (sum x[i], sum (i + 1) * x[i]) modulo 2**31 - 1."""
    data = b"".join(segments)
    return [sum(data) % fp.PRIME, sum((i + 1) * x for i, x in enumerate(data)) % fp.PRIME]


def _bytes(v: torch.Tensor) -> bytes:
    return bytes(v.flatten().tolist())


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)


def _odd_views(gen: torch.Generator) -> list[torch.Tensor]:
    """Strided, 3-D, odd-addressed, permuted and multi-row views of random bytes."""
    grid = torch.randint(0, 256, (37, 130), dtype=torch.uint8, generator=gen)
    cube = torch.randint(0, 256, (5, 9, 41), dtype=torch.uint8, generator=gen)
    run = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=gen)
    return [grid[:, 7:100],  # rows of 93 bytes, 130 apart
            cube[1:4, :, 3:40],  # three dims that do not merge
            grid.view(-1)[1:2001],  # an odd address, a contiguous run with a short rest
            grid[3:20, 5:9].t(),  # permuted: the last stride is not 1
            cube[2:3, 4:5, :].unsqueeze(0),  # size-1 dims around a row
            run]


@settings(max_examples=60, deadline=None)
@given(segments=st.lists(st.binary(max_size=300), max_size=4),
       sizes=st.sampled_from([(8, 2), (64, 16), (1 << 22, 1 << 10)]))
def test_fingerprint_is_the_formula_for_any_block_size(segments: list[bytes],
                                                       sizes: tuple[int, int]) -> None:
    views = [_tensor(d) for d in segments]
    block, row = sizes  # many blocks per segment: the same value
    with mock.patch.object(fp, "BLOCK_BYTES", block), mock.patch.object(fp, "ROW_BYTES", row):
        assert fp.fingerprint(views, CPU).tolist() == _reference(segments)


@settings(max_examples=60, deadline=None)
@given(shape=st.tuples(st.integers(1, 6), st.integers(1, 7), st.integers(1, 40)),
       lo=st.tuples(st.integers(0, 5), st.integers(0, 6), st.integers(0, 39)),
       step=st.integers(1, 3), seed=st.integers(0, 2**16), block=st.sampled_from([16, 100, 4096]))
def test_strided_views_are_the_formula_over_their_row_major_bytes(
        shape: tuple[int, int, int], lo: tuple[int, int, int], step: int, seed: int,
        block: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    view = base[lo[0] % shape[0]:, lo[1] % shape[1]::step, lo[2] % shape[2]:]
    want = _reference([_bytes(view), _bytes(base)])
    with mock.patch.object(fp, "BLOCK_BYTES", block), mock.patch.object(fp, "ROW_BYTES", 8):
        assert fp.fingerprint([view, base], CPU).tolist() == want


def test_odd_views_match_the_formula() -> None:
    views = _odd_views(torch.Generator().manual_seed(3))
    assert not views[0].is_contiguous() and not views[1].is_contiguous()
    assert views[2].data_ptr() % 2 and views[3].stride(-1) != 1
    assert fp.fingerprint(views, CPU).tolist() == _reference([_bytes(v) for v in views])


def _word_reference(segments: list[bytes]) -> tuple[int, int]:
    """The CPU check's documented formula in plain Python integers: each segment padded with
    zeros to a multiple of 8 bytes, concatenated, read as little-endian 64-bit words w[i];
    (sum w[i], sum (i + 1) * w[i]) modulo 2**64."""
    words: list[int] = []
    for d in segments:
        d += bytes(-len(d) % 8)
        words += [int.from_bytes(d[i:i + 8], "little") for i in range(0, len(d), 8)]
    mask = (1 << 64) - 1
    return sum(words) & mask, sum((i + 1) * w for i, w in enumerate(words)) & mask


def _word_views(gen: torch.Generator) -> list[torch.Tensor]:
    """Views the CPU check reads in place (aligned rows of whole words, 3-D slabs) or copies
    (odd widths and addresses, permuted, more than three dims), beside ``_odd_views``."""
    grid = torch.randint(0, 256, (37, 136), dtype=torch.uint8, generator=gen)
    cube = torch.randint(0, 256, (5, 9, 48), dtype=torch.uint8, generator=gen)
    run = torch.randint(0, 256, (50_000,), dtype=torch.uint8, generator=gen)
    return [grid[:, 8:96],  # aligned rows of 11 words, 17 apart: in place
            cube[1:4, :, 8:40],  # aligned 3-D: slab by slab
            run, run[8:49_995],  # aligned runs, one with a short rest
            grid.view(-1)[3:2001],  # an odd address: copied
            torch.randint(0, 256, (2, 3, 4, 8), dtype=torch.uint8, generator=gen)[:, :, 1:3],
            *_odd_views(gen)]


@settings(max_examples=40, deadline=None)
@given(shape=st.tuples(st.integers(1, 6), st.integers(1, 7), st.integers(1, 40)),
       lo=st.tuples(st.integers(0, 5), st.integers(0, 6), st.integers(0, 39)),
       step=st.integers(1, 3), seed=st.integers(0, 2**16),
       sizes=st.sampled_from([(16, 8, 2, 16), (100, 8, 3, 64), (4096, 16, 4096, 1 << 16)]))
def test_the_cpu_word_sums_are_the_formula_however_read(
        shape: tuple[int, int, int], lo: tuple[int, int, int], step: int, seed: int,
        sizes: tuple[int, int, int, int]) -> None:
    # compare_transfers on CPU: whatever the strides, alignment and dims, read in place or
    # copied in blocks of any size, in rows of any width: the same two sums.
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    view = base[lo[0] % shape[0]:, lo[1] % shape[1]::step, lo[2] % shape[2]:]
    views = [view, base, *_word_views(gen)]
    block, row, row_words, slab = sizes
    with mock.patch.object(fp, "BLOCK_BYTES", block), mock.patch.object(fp, "ROW_BYTES", row), \
            mock.patch.object(fp, "ROW_WORDS", row_words), \
            mock.patch.object(fp, "MIN_SLAB_BYTES", slab):
        assert fp.word_sums(views) == _word_reference([_bytes(v) for v in views])


def test_the_cpu_word_sums_move_with_any_change_or_displacement() -> None:
    gen = torch.Generator().manual_seed(9)
    views = _word_views(gen)
    want = fp.word_sums(views)
    grid = views[0].clone()
    grid[[3, 4]] = grid[[4, 3]]  # two rows trade places
    assert fp.word_sums([grid, *views[1:]]) != want
    flipped = views[2].clone()
    flipped[40_000] ^= 1  # one bit
    assert fp.word_sums([*views[:2], flipped, *views[3:]]) != want
    assert fp.word_sums(views[1:] + views[:1]) != want  # segments in another order
    zeros = torch.zeros(24, dtype=torch.uint8)
    # padding is per segment: a segment's bytes never slide into the next one's words
    assert fp.word_sums([zeros[:5], views[2]]) != fp.word_sums([zeros[:13], views[2]])


def test_segments_larger_than_a_block_are_read_in_bounded_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A local segment can exceed the staging budget: never converted whole, only block by
    # block, and the blocks are few (no loop over rows that fit a block together).
    monkeypatch.setattr(fp, "BLOCK_BYTES", 512)
    monkeypatch.setattr(fp, "ROW_BYTES", 64)
    seen: list[int] = []
    tile = fp._torch_tile
    monkeypatch.setattr(fp, "_torch_tile", lambda b, pos, pitch: seen.append(b.numel())
                        or tile(b, pos, pitch))
    gen = torch.Generator().manual_seed(5)
    matrix = torch.randint(0, 256, (300, 40), dtype=torch.uint8, generator=gen)[:, 3:33]
    wide = torch.randint(0, 256, (3, 2000), dtype=torch.uint8, generator=gen)[:, 1:1999]
    run = torch.randint(0, 256, (10_007,), dtype=torch.uint8, generator=gen)
    views = [matrix, wide, run]
    assert fp.fingerprint(views, CPU).tolist() == _reference([_bytes(v) for v in views])
    total = sum(v.numel() for v in views)
    assert max(seen) <= 512 and sum(seen) == total
    assert len(seen) <= 2 * total // 512 + 8  # ~ bytes / block, not one per row


def test_extremes_are_exact() -> None:
    # All bytes 0xFF, a block as large as the bound: the largest row and column sums.
    full = torch.full((fp.BLOCK_BYTES,), 255, dtype=torch.uint8)
    n = full.numel()
    want = [255 * n % fp.PRIME, 255 * n * (n + 1) // 2 % fp.PRIME]
    assert fp.fingerprint([full], CPU).tolist() == want
    rows = torch.full((fp.BLOCK_BYTES // 8, 16), 255, dtype=torch.uint8)[:, :8]  # most rows
    assert fp.fingerprint([rows], CPU).tolist() == want
    # A tile far into a huge transfer: products of positions and sums stay exact modulo p.
    sums = fp._Sums(CPU)
    m, pos = 1000, (1 << 45) + 12345
    sums.parts.append(torch.tensor([[255 * m, 0, 255 * m * (m - 1) // 2, pos, m]]))
    sums.owners.append(0)
    sums.counts.append(1)
    want = [255 * m % fp.PRIME, sum((pos + i + 1) * 255 for i in range(m)) % fp.PRIME]
    assert sums.total(1).tolist() == [want]


def test_a_changed_or_displaced_byte_or_segment_moves_the_fingerprint() -> None:
    gen = torch.Generator().manual_seed(4)
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=gen)
    base = fp.fingerprint([data], CPU)
    flipped = data.clone()
    flipped[1234] ^= 1
    assert fp.fingerprint([flipped], CPU)[0] != base[0]
    moved = data.clone()  # two different bytes trade places: same sum, other positions
    moved[10], moved[4000] = data[4000], data[10]
    assert data[10] != data[4000]
    got = fp.fingerprint([moved], CPU)
    assert got[0] == base[0] and got[1] != base[1]
    a, b = data[:100], data[100:300]
    assert fp.fingerprint([a, b], CPU)[1] != fp.fingerprint([b, a], CPU)[1]
    strided = data.view(50, 100)[:, 10:90]  # a strided row displaced by one byte
    shifted = strided.clone()
    shifted[7] = torch.roll(strided[7], 1)
    assert fp.fingerprint([shifted], CPU)[1] != fp.fingerprint([strided], CPU)[1]


def test_many_transfers_are_summed_apart() -> None:
    # compare_transfers adds every transfer of a process to one _Sums: each keeps its own.
    gen = torch.Generator().manual_seed(6)
    views = _odd_views(gen)
    sums = fp._Sums(CPU)
    for i, v in enumerate(views):
        sums.add(2 * i, [v, views[0]])
    got = sums.total(2 * len(views)).tolist()
    for i, v in enumerate(views):
        assert got[2 * i] == _reference([_bytes(v), _bytes(views[0])])
        assert got[2 * i + 1] == [0, 0]


_TRITON_SCRIPT = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from test_fingerprint import _odd_views, _bytes, _reference
from dynatrain.runtime import fingerprint as fp
fp._on_triton = lambda x: True  # CPU tensors through the interpreted kernel
assert type(fp._tile_sums).__name__ == "InterpretedFunction"
views = _odd_views(torch.Generator().manual_seed(7))
ff = torch.full((2100, 2048), 255, dtype=torch.uint8)
views += [ff[:, :16], ff[:40, 5:1029], ff.view(-1)[:3 * fp.ROW_BYTES + 5]]  # full tiles
cases = [[fp.fingerprint(views, torch.device("cpu")).tolist(),
          _reference([_bytes(v) for v in views])]]
for v in views:
    cases.append([fp.fingerprint([v], torch.device("cpu")).tolist(), _reference([_bytes(v)])])
print(json.dumps(cases))
"""


def test_the_triton_kernel_is_the_formula() -> None:
    # The kernel that runs on CUDA, interpreted on CPU (TRITON_INTERPRET must be set before
    # triton is imported: a fresh process).
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, str(ROOT / "tests")], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    cases = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(cases) == 10
    for got, want in cases:
        assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_and_cuda_agree() -> None:
    gen = torch.Generator().manual_seed(8)
    views = _odd_views(gen)
    big = torch.randint(0, 256, (3, 5 << 20), dtype=torch.uint8, generator=gen)
    views += [big[:, 7:(5 << 20) - 1], big.view(-1)[3:], torch.full((1 << 23,), 255,
                                                                    dtype=torch.uint8)]
    cuda = torch.device("cuda", torch.cuda.current_device())
    on_cuda = []
    for v in views:  # the same strides and offsets on the device
        base = v.as_strided((v.untyped_storage().nbytes(),), (1,), 0).to(cuda)
        on_cuda.append(base.as_strided(v.shape, v.stride(), v.storage_offset()))
    want = fp.fingerprint(views, CPU).tolist()
    assert fp.fingerprint(on_cuda, cuda).tolist() == want
    for v, c in zip(views, on_cuda):
        assert fp.fingerprint([c], cuda).tolist() == fp.fingerprint([v], CPU).tolist()
