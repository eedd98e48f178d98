"""End-to-end check of a switch: every destination box holds the bytes its source sent.

The planner's plan is proven before it runs; this checks the run itself (packing, wire, unpacking,
local copies, a corrupting link) inside the real job, where no reference state exists. Each
transfer gets a fingerprint of its bytes on the source, from the source storage, and on the
destination, from the destination storage after the last round. One all-reduce gathers the
source fingerprints (each transfer has one source, every other process adds zeros); each
destination compares its own. A mismatch is voted, so the switch aborts everywhere with the
source untouched.

Definition. A transfer's bytes come as segments (one per state kind and stacked member, the
same segments, in the same order and of the same sizes, on both ends: the wire pieces rely on
it). Concatenate them, each in the row-major order of its view, into one byte string
``x[0..n)`` and read every byte as an unsigned integer 0..255. The fingerprint is::

    (sum x[i], sum (i + 1) * x[i])  modulo the prime p = 2**31 - 1

A changed byte moves the first sum (by 1..255, never a multiple of p); two different bytes that
trade places, or a byte or segment moved by fewer than p positions, move the second. It detects
accidents, not adversaries. Only the bytes and their order count: how a segment is laid out in
memory, cut into segments or into tiles does not change the value.

On CPU (a gloo switch: every process of it on CPU) a transfer's check is instead its *word
sums* (``word_sums``): each segment's bytes padded with zeros to a multiple of 8, concatenated and
read as little-endian unsigned 64-bit words ``w[i]``, give ``(sum w[i], sum (i + 1) * w[i])``
modulo 2**64. A 64-bit word needs no cast: a run of words is read in place as int64 (two's
complement adds wrap exactly as unsigned ones do, the same bits) and summed by torch's
vectorized reductions by rows and columns, as the tiles above, a slice of about
``CACHED_BYTES`` at a time so that the column pass rereads it from cache, several times the
speed of ``zlib.crc32`` here (``bench/fingerprint_bench.py``). Any one changed word moves the
first sum; two words that differ by ``d`` and trade places ``k`` apart move the second unless
``k * d`` is a multiple of 2**64. A view whose rows are whole aligned words is read in place;
any other is copied block by block (at most ``BLOCK_BYTES``) into one contiguous buffer first.

Computation of the sums: exact integer arithmetic, one read of every byte, no copy of a whole segment (a
local segment can be a large share of a parameter, more than the staging budget). A segment's
view is canonicalized (size-1 dims dropped, contiguous neighbours merged) into rows of
``length`` contiguous bytes, row ``j`` holding positions ``start + j * length + [0, length)``;
a contiguous run is read as rows of ``ROW_BYTES``. Each tile (a few rows by a few columns) gives
its byte sum ``a``, ``u = sum_r r * rowsum_r`` and ``v = sum_c c * colsum_c`` (rows and columns
counted from the tile's first byte, at position ``pos``), and so its share of the second sum,
``(pos + 1) * a + length * u + v``: no per-byte positions, no float. On CUDA one Triton kernel
per segment (a contiguous run: two) computes every tile's sums in one pass; torch's integer
reductions would first write the bytes out as int32 or int64, several times the traffic.
Elsewhere, and for views of more than three dims, torch computes the same sums per block of at
most ``BLOCK_BYTES``. The tiles of every transfer a process sends or receives are reduced
modulo p and summed per transfer at once, and read back with one host synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

try:  # optional: without Triton the torch path computes the same values
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

from ..planner.plan import Plan, Transfer
from .storage import ByteViews

PRIME = (1 << 31) - 1
# torch path: bytes cast to int32 at once (4x this in memory); 255 * 2**22 < 2**31 keeps every
# row and column sum of a block exact in int32
BLOCK_BYTES = 1 << 22
ROW_BYTES = 1 << 10  # a contiguous run is read as rows of this many bytes
TILE_BYTES = 1 << 14  # Triton: bytes per program (rows x columns, both powers of two)
MAX_TILE_COLUMNS = 1 << 10
_ARANGE: dict[torch.device, torch.Tensor] = {}  # 0, 1, 2, ... as int64, per device


def fingerprint(views: list[torch.Tensor], on: torch.device) -> torch.Tensor:
    """The fingerprint of segments ``views`` (uint8 views, in order), as int64 [2].

    Example:
        >>> fingerprint([torch.tensor([1, 2], dtype=torch.uint8)], torch.device("cpu")).tolist()
        [3, 5]
    """
    sums = _Sums(on)
    sums.add(0, views)
    return sums.total(1)[0]


class _Sums:
    """Tile sums of many fingerprints, combined modulo p once for all of them.

    A tile's row is ``(a, u, v, pos, pitch)``: its byte sum, ``sum_r r * rowsum_r`` and
    ``sum_c c * colsum_c`` (rows and columns counted from the tile's first byte), that byte's
    position in the transfer, and the distance in positions between the tile's rows."""

    def __init__(self, on: torch.device) -> None:
        self.on = on
        self.parts: list[torch.Tensor] = []  # int64 [tiles, 5] each
        self.owners: list[int] = []  # the fingerprint each part belongs to
        self.counts: list[int] = []  # its number of tiles

    def add(self, index: int, views: list[torch.Tensor]) -> None:
        """Add the tiles of the segments ``views`` to fingerprint ``index``."""
        start = 0  # position of the segment's first byte in the transfer
        for v in views:
            if v.numel():
                for part in _segment(_canonical(v), start):
                    self.parts.append(part)
                    self.owners.append(index)
                    self.counts.append(part.shape[0])
            start += v.numel()

    def total(self, n: int) -> torch.Tensor:
        """Fingerprints ``0..n`` as int64 [n, 2] (zeros where none was added)."""
        out = torch.zeros((n, 2), dtype=torch.int64, device=self.on)
        if not self.parts:
            return out
        a, u, v, pos, pitch = (torch.cat([p.to(self.on) for p in self.parts]) % PRIME).unbind(1)
        # a tile's share of sum (i + 1) x[i]: (pos + 1) a + pitch u + v, every product < 2**62
        b = ((pos + 1) % PRIME * a % PRIME + pitch * u % PRIME + v) % PRIME
        owner = torch.repeat_interleave(torch.tensor(self.owners),
                                        torch.tensor(self.counts)).to(self.on)
        out.index_add_(0, owner, torch.stack([a, b], 1))  # each < p: exact below 2**32 tiles
        return out % PRIME


def _canonical(v: torch.Tensor) -> torch.Tensor:
    """``v`` (same bytes, same row-major order) with size-1 dims dropped, neighbours that are
    contiguous with each other merged, and a last dim of stride 1."""
    shape: list[int] = []
    strides: list[int] = []
    for size, stride in zip(v.shape, v.stride()):
        if size == 1:
            continue
        if shape and strides[-1] == size * stride:
            shape[-1] *= size
            strides[-1] = stride
        else:
            shape.append(size)
            strides.append(stride)
    if not shape or strides[-1] != 1:  # single bytes as rows of length 1
        shape.append(1)
        strides.append(1)
    return v.as_strided(shape, strides, v.storage_offset())


def _segment(x: torch.Tensor, start: int) -> Iterator[torch.Tensor]:
    """Tile sums of canonical view ``x``, whose first byte sits at ``start``."""
    if triton is not None and x.dim() <= 3 and _on_triton(x):
        yield from _triton_tiles(x, start)
        return
    for block, pos, pitch in _blocks(x, start):
        yield _torch_tile(block, pos, pitch)


def _on_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernel reads ``x`` (tests run it on CPU under TRITON_INTERPRET=1)."""
    return x.is_cuda


# ----- torch: blocks of at most BLOCK_BYTES, each copied to int32 --------------------------------

def _blocks(x: torch.Tensor, pos: int) -> Iterator[tuple[torch.Tensor, int, int]]:
    """``x`` cut into (block, position of its first byte, logical distance between its rows):
    a few large blocks, never a loop over rows unless a row exceeds ``BLOCK_BYTES``."""
    if x.dim() == 1:  # a contiguous run: rows of ROW_BYTES, then the rest
        n = x.numel()
        body = n - n % ROW_BYTES
        step = max(ROW_BYTES, BLOCK_BYTES - BLOCK_BYTES % ROW_BYTES)
        for s in range(0, body, step):
            yield x[s:min(body, s + step)].view(-1, ROW_BYTES), pos + s, ROW_BYTES
        if body < n:
            yield x[body:].view(1, -1), pos + body, n - body
        return
    if x.numel() <= BLOCK_BYTES:
        yield x, pos, x.shape[-1]
        return
    slab = x[0].numel()
    if slab > BLOCK_BYTES:  # each slab on its own (a few: each is more than a block)
        for i in range(x.shape[0]):
            yield from _blocks(x[i], pos + i * slab)
        return
    k = BLOCK_BYTES // slab
    for i in range(0, x.shape[0], k):
        yield x[i:i + k], pos + i * slab, x.shape[-1]


def _torch_tile(block: torch.Tensor, pos: int, pitch: int) -> torch.Tensor:
    """Tile sums of one block (rows ``pitch`` positions apart) as int64 [1, 5]."""
    width = block.shape[-1]
    # at most 4 * BLOCK_BYTES; row-major even where the view's strides are permuted
    y = block.to(torch.int32, memory_format=torch.contiguous_format).view(-1, width)
    rows = y.sum(1, dtype=torch.int32).to(torch.int64)  # int32 in: no hidden cast copy
    cols = y.sum(0, dtype=torch.int32).to(torch.int64)
    u = (rows * _arange(rows.numel(), rows.device)).sum()  # < 2**8 * 2**22 * 2**22
    v = (cols * _arange(width, cols.device)).sum()
    return torch.stack([rows.sum(), u, v, rows.new_tensor(pos), rows.new_tensor(pitch)])[None]


def _arange(n: int, on: torch.device) -> torch.Tensor:
    have = _ARANGE.get(on)
    if have is None or have.numel() < n:
        have = _ARANGE[on] = torch.arange(max(n, ROW_BYTES), dtype=torch.int64, device=on)
    return have[:n]


# ----- Triton: one kernel per segment, one read of every byte ----------------------------------

def _triton_tiles(x: torch.Tensor, start: int) -> Iterator[torch.Tensor]:
    """Tile sums of canonical ``x`` (1 to 3 dims), int64 [tiles, 5] per kernel launch: one, or
    for a contiguous run two (its rows of ``ROW_BYTES``, then the short rest)."""
    if x.dim() == 1:
        n = x.numel()
        body = n - n % ROW_BYTES
        if body:
            yield _launch(x, start, body // ROW_BYTES, 1, ROW_BYTES, 0, ROW_BYTES)
        if body < n:
            yield _launch(x[body:], start + body, 1, 1, ROW_BYTES, 0, n - body)
    elif x.dim() == 2:
        yield _launch(x, start, x.shape[0], 1, x.stride(0), 0, x.shape[1])
    else:
        yield _launch(x, start, x.shape[0] * x.shape[1], x.shape[1], x.stride(0),
                      x.stride(1), x.shape[2])


def _launch(x: torch.Tensor, start: int, rows: int, inner: int, s_outer: int,
            s_inner: int, length: int) -> torch.Tensor:
    # Triton specializes arguments equal to 1 and multiples of 16: a 2-D view with 16-byte
    # aligned rows (the usual bf16/fp32 box) is read in 16-byte loads.
    columns = min(MAX_TILE_COLUMNS, max(16, 1 << (length - 1).bit_length()))
    col_tiles = -(-length // columns)
    tiles = -(-rows // (TILE_BYTES // columns)) * col_tiles
    out = torch.empty((tiles, 5), dtype=torch.int64, device=x.device)
    _tile_sums[(tiles,)](x, out, rows, inner, s_outer, s_inner, length, start, col_tiles,
                         BR=TILE_BYTES // columns, BC=columns)
    return out


if triton is not None:
    @triton.jit
    def _tile_sums(x_ptr, out_ptr, rows, inner, s_outer, s_inner, length, start, col_tiles,
                   BR: tl.constexpr, BC: tl.constexpr):
        # Row j of the view starts at (j // inner) * s_outer + (j % inner) * s_inner and holds
        # logical positions start + j * length + [0, length). Modular reduction is left to the
        # caller, once for all tiles: here only one read and integer sums.
        pid = tl.program_id(0)
        row0 = (pid // col_tiles).to(tl.int64) * BR
        col0 = (pid % col_tiles).to(tl.int64) * BC
        r = tl.arange(0, BR)
        c = tl.arange(0, BC)
        j = row0 + r
        offsets = (j // inner) * s_outer + (j % inner) * s_inner
        k = col0 + c
        mask = (j[:, None] < rows) & (k[None, :] < length)
        x = tl.load(x_ptr + offsets[:, None] + k[None, :], mask=mask, other=0).to(tl.int32)
        row_sums = tl.sum(x, axis=1)  # <= 255 * BC
        col_sums = tl.sum(x, axis=0)  # <= 255 * BR
        out = out_ptr + pid.to(tl.int64) * 5
        tl.store(out, tl.sum(row_sums.to(tl.int64), axis=0))
        tl.store(out + 1, tl.sum(row_sums.to(tl.int64) * r, axis=0))
        tl.store(out + 2, tl.sum(col_sums.to(tl.int64) * c, axis=0))
        tl.store(out + 3, start + row0 * length + col0)  # the tile's first byte
        tl.store(out + 4, col0 - col0 + length)  # int64, even where length is the constant 1


# ----- CPU: word sums ----------------------------------------------------------------------------

LITTLE_ENDIAN = np.dtype("<u8").isnative  # words are read in the host's order: this one's
MASK64 = (1 << 64) - 1
ROW_WORDS = 1 << 12  # a contiguous run is read as rows of this many words (32 KiB)
CACHED_BYTES = 1 << 20  # words summed by rows, then by columns, a slice of about this at a time
MIN_SLAB_BYTES = 1 << 16  # a 3-D view with smaller 2-D slabs is copied in blocks instead


def word_sums(views: list[torch.Tensor]) -> tuple[int, int]:
    """Word sums of segments ``views`` (uint8 CPU views), the CPU check of a transfer.

    Each segment's row-major bytes, padded with zeros to a multiple of 8, concatenated and read
    as little-endian unsigned 64-bit words ``w[0..N)``; returns ``(sum w[i], sum (i + 1) * w[i])``
    modulo 2**64.

    Example:
        >>> word_sums([torch.tensor([1, 2], dtype=torch.uint8)])
        (513, 513)
    """
    acc = _WordSums()
    for v in views:
        if v.numel():
            acc.segment(_canonical(v))
    return acc.a & MASK64, acc.b & MASK64


class _WordSums:
    """Running word sums: ``pos`` words so far; ``carry``: bytes of a word not yet complete
    (a copied block's length need not be a multiple of 8)."""

    def __init__(self) -> None:
        self.a = self.b = self.pos = 0
        self.carry = b""
        self.scratch: torch.Tensor | None = None

    def segment(self, x: torch.Tensor) -> None:
        """Add canonical view ``x`` (its bytes padded to whole words)."""
        if x.dim() == 3 and x[0].numel() >= MIN_SLAB_BYTES and _word_viewable(x):
            for slab in x:
                self._matrix(_words(slab))
            return
        if x.dim() <= 2 and _word_viewable(x):
            self._matrix(_words(x))
            return
        if x.dim() == 1 and x.data_ptr() % 8 == 0:  # a run with a short rest
            body = x.numel() - x.numel() % 8
            self._matrix(_words(x[:body]))
            self.carry = x[body:].numpy().tobytes()
        else:  # copied block by block, row-major, after the carried bytes
            for block, _, _ in _blocks(x, 0):
                self._copied(block)
        if self.carry:  # the segment's last word, padded with zeros
            self._matrix(_words(torch.frombuffer(bytearray(self.carry.ljust(8, b"\0")),
                                                 dtype=torch.uint8)))
            self.carry = b""

    def _copied(self, block: torch.Tensor) -> None:
        c, m = len(self.carry), block.numel()
        if self.scratch is None or self.scratch.numel() < c + m:
            self.scratch = torch.empty(max(c + m, min(BLOCK_BYTES, 1 << 16)) + 8,
                                       dtype=torch.uint8)
        buf = self.scratch
        if c:
            buf[:c] = torch.frombuffer(bytearray(self.carry), dtype=torch.uint8)
        buf[c:c + m].view(block.shape).copy_(block)
        n = (c + m) - (c + m) % 8
        if n:
            self._matrix(_words(buf[:n]))
        self.carry = buf[n:c + m].numpy().tobytes()

    def _matrix(self, w: torch.Tensor) -> None:
        """Add words ``w`` (int64, 1-D, or 2-D read row by row) at positions ``pos``,
        ``pos + 1``, ...

        Word ``(r, c)`` sits at ``i = pos + r * cols + c``, so ``sum (i + 1) w`` is
        ``(pos + 1) a + cols * sum_r r rowsum_r + sum_c c colsum_c``: a handful of torch calls
        per slice (on a busy host their overhead rivals the sums), every step modulo 2**64."""
        if w.dim() == 1:
            body = w.numel() - w.numel() % ROW_WORDS
            if body:
                self._matrix(w[:body].view(-1, ROW_WORDS))
            if body < w.numel():
                tail = w[body:]
                a = int(tail.sum())
                self.a += a
                self.b += (self.pos + 1) * a + int(torch.dot(_index(tail.numel()), tail))
                self.pos += tail.numel()
            return
        rows, cols = w.shape
        if not w.numel():
            return
        if cols > ROW_WORDS and rows > 1:  # long rows: one at a time, each cut into rows
            for row in w:
                self._matrix(row)
            return
        step = max(1, CACHED_BYTES // (8 * cols))
        if rows > step:  # the column sums reread a slice while it is still in cache
            for r in range(0, rows, step):
                self._matrix(w[r:r + step])
            return
        row_sums = w.sum(1)
        a = int(row_sums.sum())
        self.a += a
        self.b += ((self.pos + 1) * a + cols * int(torch.dot(_index(rows), row_sums))
                   + int(torch.dot(_index(cols), w.sum(0))))
        self.pos += rows * cols


_INDEX = torch.arange(ROW_WORDS, dtype=torch.int64)


def _index(n: int) -> torch.Tensor:
    """0, 1, ..., n - 1 as int64 (a view of one cached tensor)."""
    global _INDEX
    if _INDEX.numel() < n:
        _INDEX = torch.arange(n, dtype=torch.int64)
    return _INDEX[:n]


def _word_viewable(x: torch.Tensor) -> bool:
    """Whether canonical ``x`` reads as whole aligned words in place: rows of a multiple of 8
    bytes, every row starting on an 8-byte boundary."""
    return (x.data_ptr() % 8 == 0 and x.shape[-1] % 8 == 0
            and all(s % 8 == 0 for s in x.stride()[:-1]))


def _words(x: torch.Tensor) -> torch.Tensor:
    """``x`` (word-viewable) as 64-bit words (int64: the same bits), in place. The words are
    little-endian by definition: on a big-endian host their bytes are swapped first."""
    w = x.view(torch.int64)
    return w if LITTLE_ENDIAN else torch.from_numpy(w.numpy().byteswap())


# ----- the check of a switch -------------------------------------------------------------------

def _transfers(plan: Plan) -> Iterator[tuple[int, str, str, Transfer]]:
    """(index, source device, destination device, transfer) in plan order: the same on every
    process."""
    k = 0
    for rnd in plan.rounds:
        for m in rnd.messages:
            for t in m.transfers:
                yield k, m.src_device, m.dst_device, t
                k += 1


def compare_transfers(plan: Plan, device: str, src: ByteViews | None, dst: ByteViews | None,
                      pg: dist.ProcessGroup, on: torch.device, timeout: float,
                      wait: Callable) -> list[str]:
    """Compare every transfer this device received with what its source sent.

    Every process of the switch calls it after the last round (it runs one all-reduce). The
    fingerprints of all transfers this device sends or receives are reduced together and read
    back once.

    Returns:
        One line per transfer that differs (empty: all arrived intact).
    """
    n = max(1, sum(len(m.transfers) for rnd in plan.rounds for m in rnd.messages))
    if on.type == "cpu":
        return _compare_words(plan, device, src, dst, pg, n, timeout, wait)
    sums = _Sums(on)
    mine: list[tuple[int, Transfer]] = []  # received: fingerprint n + i is mine[i]'s
    for k, src_device, dst_device, t in _transfers(plan):
        if src_device == device:
            sums.add(k, src(t.kinds, t.src_slot, t.src_anchor, t.box))
        if dst_device == device:
            sums.add(n + len(mine), dst(t.kinds, t.dst_slot, t.dst_anchor, t.box))
            mine.append((k, t))
    both = sums.total(n + len(mine))
    table = both[:n].contiguous()
    wait(dist.all_reduce(table, group=pg, async_op=True), timeout)
    if not mine:
        return []
    differs = (both[n:] != table[[k for k, _ in mine]]).any(1).tolist()
    return [_differs(k, t) for (k, t), bad in zip(mine, differs) if bad]


def _compare_words(plan: Plan, device: str, src: ByteViews | None, dst: ByteViews | None,
                   pg: dist.ProcessGroup, n: int, timeout: float, wait: Callable) -> list[str]:
    """``compare_transfers`` on CPU: each transfer's word sums, and a 1 its source writes, so
    that a transfer no source wrote (or two wrote) never matches, not even all-zero bytes."""
    table = torch.zeros((n, 3), dtype=torch.int64)
    mine: list[tuple[int, Transfer, list[int]]] = []
    for k, src_device, dst_device, t in _transfers(plan):
        if src_device == device:
            table[k] = torch.tensor([*map(_signed, word_sums(
                src(t.kinds, t.src_slot, t.src_anchor, t.box))), 1])
        if dst_device == device:
            got = word_sums(dst(t.kinds, t.dst_slot, t.dst_anchor, t.box))
            mine.append((k, t, [*map(_signed, got), 1]))
    wait(dist.all_reduce(table, group=pg, async_op=True), timeout)
    sent = table.tolist()
    return [_differs(k, t) for k, t, got in mine if sent[k] != got]


def _signed(x: int) -> int:
    """``x`` (0 <= x < 2**64) as the int64 with the same bits: sums travel in int64 tables."""
    return x - (1 << 64) if x >> 63 else x


def _differs(k: int, t: Transfer) -> str:
    return (f"transfer {k} ({'+'.join(t.kinds)} of {_name(t.dst_slot)} {list(t.box.lo)}.."
            f"{list(t.box.hi)} from source rank {t.src_rank}) differs at destination rank "
            f"{t.dst_rank}")


def _name(slot) -> str:
    names = getattr(slot, "names", None)  # a stacked family: its first and last member
    return f"{names[0]}..{names[-1]}" if names else slot.name
