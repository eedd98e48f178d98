"""A round's many byte copies described once, as a table, and run in a handful of launches.

A round packs its staged sends into the staging arena, unpacks its staged receives out of it
and copies its local transfers slot to slot: dozens to thousands of small, strided byte views.
Copying them one ``copy_`` at a time costs a Python call, two intermediate views and (on a
GPU) a kernel launch each: measured on an H100, pack ran at 0.034x the device's copy
bandwidth. ``CopyTable`` is built once per round, when the round is prepared, from the
(source, destination) byte-view pairs, and describes every copy as *blocks*: ``rows`` rows of
``row`` bytes, at byte offsets ``src``/``dst`` with row strides ``src_stride``/``dst_stride``.
One side of a table may be the *region*: the slice of the arena the round binds at run time
(the arena grows between rounds, so its address is not known when the table is built); its
offsets are relative to the region's start, the other side's to a fixed anchor storage.

Two ways to run it, chosen by the device:

- CUDA, with Triton installed: one Triton multi-copy kernel launch per alignment class (at
  most four: 8-, 4-, 2- and 1-byte words) over the whole table, blocks split into tiles of at
  most ``TILE_BYTES`` so that the launch fills the GPU. Chosen over precomputed gather/scatter
  indices (``index_select``/``index_copy_``), which read an 8-byte index per element moved:
  at one byte per element that is 9x the traffic of the copy itself. Not yet measured on a
  GPU (none was lent while this was built); the kernel is checked bit for bit on the CPU under
  Triton's interpreter (``TRITON_INTERPRET=1``, ``tests/test_copytable.py``).
- Everywhere else (CPU, or no Triton): one ``copy_`` per merged pair of views, the views made
  once at build time (region views by one ``as_strided`` each at run time). On the CPU a
  large run is a memcpy at the core's bandwidth, and what per-view work remains is less than
  the old path's ``narrow``/``view``/``copy_`` (``bench/pack_bench.py`` compares both).

A table has *parts* (a wire piece each): ``run(region, part=k)`` copies only part ``k``, so
on gloo a piece is posted as soon as it is packed and unpacked as soon as it lands.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from .storage import row_major_strides

try:  # optional: the runtime works without Triton (the torch path)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

TILE_BYTES = 64 << 10  # a program copies at most this much: enough programs to fill a GPU
_BLOCK = 2048  # elements (words) a program moves per loop step
WORDS = (8, 4, 2, 1)  # alignment classes, widest first


@dataclass(frozen=True, slots=True)
class Block:
    """``rows`` rows of ``row`` bytes: source bytes ``src + r * src_stride + c`` go to
    destination bytes ``dst + r * dst_stride + c`` (offsets from the side's anchor)."""

    src: int
    dst: int
    row: int
    rows: int
    src_stride: int
    dst_stride: int

    @property
    def nbytes(self) -> int:
        return self.row * self.rows

    def word(self, src_base: int, dst_base: int) -> int:
        """The widest word (8, 4, 2, 1 bytes) that every address and size of this block is a
        multiple of, given the anchors' addresses."""
        g = 0
        for v in (src_base + self.src, dst_base + self.dst, self.row, self.src_stride,
                  self.dst_stride):
            g = math.gcd(g, v)
        return next(w for w in WORDS if g % w == 0)


def _blocks(shape: tuple[int, ...], src_strides: tuple[int, ...], dst_strides: tuple[int, ...],
            src_off: int, dst_off: int) -> list[Block]:
    """Blocks of one copy of ``shape`` bytes between two strided byte layouts."""
    dims = [(n, s, d) for n, s, d in zip(shape, src_strides, dst_strides) if n != 1]
    if any(n == 0 for n, _, _ in dims):
        return []
    merged: list[tuple[int, int, int]] = []
    for n, s, d in dims:  # merge a dim into the one outside it where both layouts allow
        if merged and merged[-1][1] == s * n and merged[-1][2] == d * n:
            m = merged.pop()
            n = m[0] * n
        merged.append((n, s, d))
    if not merged or merged[-1][1] != 1 or merged[-1][2] != 1:
        merged.append((1, 1, 1))  # rows of one byte (an innermost dim that is not unit)
    row = merged[-1][0]
    rows, ss, ds = merged[-2] if len(merged) > 1 else (1, row, row)
    outer = merged[:-2]
    out = []
    for idx in itertools.product(*(range(n) for n, _, _ in outer)):
        so = src_off + sum(i * s for i, (_, s, _) in zip(idx, outer))
        do = dst_off + sum(i * d for i, (_, _, d) in zip(idx, outer))
        out.append(Block(so, do, row, rows, ss, ds))
    return out


def _tiles(b: Block) -> list[Block]:
    """``b`` cut into tiles of at most ``TILE_BYTES`` (whole rows, or pieces of one row)."""
    if b.nbytes <= TILE_BYTES:
        return [b]
    if b.row >= TILE_BYTES:
        return [Block(b.src + r * b.src_stride + c, b.dst + r * b.dst_stride + c,
                      min(TILE_BYTES, b.row - c), 1, b.row, b.row)
                for r in range(b.rows) for c in range(0, b.row, TILE_BYTES)]
    step = TILE_BYTES // b.row
    return [Block(b.src + r * b.src_stride, b.dst + r * b.dst_stride, b.row,
                  min(step, b.rows - r), b.src_stride, b.dst_stride)
            for r in range(0, b.rows, step)]


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of ``t`` (its anchor)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


class CopyTable:
    """Every copy of a round's pack, unpack or local copies, built once, run in few launches.

    Args:
        pairs: per part, its (source, destination) uint8 views of one shape; a side given as
            ``int`` is an offset into the part's bytes of the region (contiguous bytes there,
            in the other view's shape). The parts lie one after the other in the region, each
            as long as its int sides' copies: part ``k`` starts where part ``k - 1`` ends.
        kernel: run whole-table runs with the Triton kernel (None: when the views are on CUDA
            and Triton is installed; True also on the CPU, under ``TRITON_INTERPRET=1``).

    Example:
        >>> t = CopyTable([[(src_view, dst_view)]])  # doctest: +SKIP
        >>> t.run()
    """

    def __init__(self, pairs: list[list[tuple[torch.Tensor | int, torch.Tensor | int]]],
                 kernel: bool | None = None) -> None:
        self.parts: list[list[tuple]] = []  # per part: (src, dst, shape) merged copies
        self.starts: list[int] = []  # per part: where its bytes start in the region
        region_bytes = 0
        self.nbytes = 0
        self.copies = 0
        device = None
        for part in pairs:
            out: list[tuple] = []
            for s, d in part:
                view = s if isinstance(s, torch.Tensor) else d
                if not isinstance(view, torch.Tensor):
                    raise ValueError("a copy needs at least one view (both sides are region)")
                if view.dtype != torch.uint8:
                    raise ValueError(f"copies are of uint8 byte views. Got {view.dtype}")
                if isinstance(s, torch.Tensor) and isinstance(d, torch.Tensor) and (
                        s.shape != d.shape):
                    raise ValueError(f"source {tuple(s.shape)} and destination "
                                     f"{tuple(d.shape)} differ in shape")
                device = device or view.device
                n = view.numel()
                if n:
                    self.nbytes += n
                    self.copies += 1
                    _append_merged(out, s, d, tuple(view.shape))
            self.starts.append(region_bytes)
            region_bytes += sum(math.prod(shape) for s, d, shape in out
                                if isinstance(s, int) or isinstance(d, int))
            self.parts.append(out)
        self.device = device or torch.device("cpu")
        if kernel is None:
            kernel = self.device.type == "cuda" and triton is not None
        if kernel and triton is None:
            raise RuntimeError("the table kernel needs Triton (pip install triton)")
        self.kernel = kernel
        # Built now, while the round is prepared (ahead of it), not when the copies are due.
        self._launches = self._build_launches() if kernel and len(self) else None

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def run(self, region: torch.Tensor | None = None, part: int | None = None) -> None:
        """Copy every part, or only ``part``.

        Args:
            region: the bytes the int sides index: of every part (a whole run), or of
                ``part`` alone (a run of one part).
            part: the one part to copy (None: all, in a few kernel launches where the table
                has a kernel).
        """
        if part is not None:
            for s, d, shape in self.parts[part]:
                _view(d, shape, region, 0).copy_(_view(s, shape, region, 0))
            return
        if self.kernel and len(self):
            self._run_kernel(region)
            return
        for start, p in zip(self.starts, self.parts):
            for s, d, shape in p:
                _view(d, shape, region, start).copy_(_view(s, shape, region, start))

    # The kernel path: the table as int64 rows, one launch per alignment class.
    def _run_kernel(self, region: torch.Tensor | None) -> None:
        for src_anchor, dst_anchor, table, word in self._launches:
            src = region if src_anchor is None else src_anchor
            dst = region if dst_anchor is None else dst_anchor
            for t in (src, dst):  # the region's alignment is known only now
                while t.data_ptr() % word:
                    word //= 2
            _launch(src, dst, table, word)

    def _build_launches(self) -> list:
        """Group blocks by alignment class; the fixed sides relative to the lowest storage."""
        def anchor(side: int) -> torch.Tensor | None:
            views = [c[side] for p in self.parts for c in p if isinstance(c[side], torch.Tensor)]
            if not views:
                return None
            return _storage_bytes(min(views, key=lambda v: v.untyped_storage().data_ptr()))
        anchors = (anchor(0), anchor(1))
        bases = tuple(0 if a is None else a.data_ptr() for a in anchors)
        by_word: dict[int, list[Block]] = {}
        for start, p in zip(self.starts, self.parts):
            for s, d, shape in p:
                so, ss = _layout(s, shape, bases[0], start)
                do, ds = _layout(d, shape, bases[1], start)
                for b in _blocks(shape, ss, ds, so, do):
                    for t in _tiles(b):
                        by_word.setdefault(t.word(*bases), []).append(t)
        out = []
        for word, blocks in sorted(by_word.items(), reverse=True):
            rows = [(b.src, b.dst, b.row, b.rows, b.src_stride, b.dst_stride) for b in blocks]
            table = torch.tensor(rows, dtype=torch.int64).to(self.device)
            out.append((anchors[0], anchors[1], table, word))
        return out


def _layout(side: torch.Tensor | int, shape: tuple[int, ...], base: int, start: int
            ) -> tuple[int, tuple[int, ...]]:
    """Byte offset from the anchor at ``base`` (or into the region, whose part begins at
    ``start``) and byte strides."""
    if isinstance(side, int):
        return start + side, row_major_strides(shape)
    return side.data_ptr() - base, tuple(side.stride())


def _view(side: torch.Tensor | int, shape: tuple[int, ...], region: torch.Tensor | None,
          start: int) -> torch.Tensor:
    if isinstance(side, int):
        return region.as_strided(shape, row_major_strides(shape),
                                 region.storage_offset() + start + side)
    return side


def _flat(v: torch.Tensor) -> bool:
    return v.is_contiguous()


def _append_merged(out: list[tuple], s, d, shape: tuple[int, ...]) -> None:
    """Append copy (s, d), merged into the last one where both sides continue it contiguously
    (consecutive views of one storage packed next to each other): one ``copy_`` for both."""
    n = math.prod(shape)
    if out:
        ps, pd, pshape = out[-1]
        pn = math.prod(pshape)
        if _continues(ps, pn, s) and _continues(pd, pn, d):
            m = pn + n
            out[-1] = (_grow(ps, m), _grow(pd, m), (m,))
            return
    out.append((s, d, shape))


def _continues(prev, prev_n: int, nxt) -> bool:
    if isinstance(prev, int) or isinstance(nxt, int):
        return isinstance(prev, int) and isinstance(nxt, int) and prev + prev_n == nxt
    return (_flat(prev) and _flat(nxt) and prev.untyped_storage().data_ptr()
            == nxt.untyped_storage().data_ptr()
            and prev.storage_offset() + prev_n == nxt.storage_offset())


def _grow(side, n: int):
    if isinstance(side, int):
        return side
    return side.as_strided((n,), (1,), side.storage_offset())


if triton is not None:
    @triton.jit
    def _copy_blocks(src, dst, table, WORD: tl.constexpr, BLOCK: tl.constexpr):
        # One program per table row (a tile): rows * row bytes, in words of WORD bytes.
        e = table + tl.program_id(0) * 6
        s = tl.load(e) // WORD
        d = tl.load(e + 1) // WORD
        n = tl.load(e + 2) // WORD
        total = n * tl.load(e + 3)
        ss = tl.load(e + 4) // WORD
        ds = tl.load(e + 5) // WORD
        if WORD == 8:
            ty = tl.int64
        elif WORD == 4:
            ty = tl.int32
        elif WORD == 2:
            ty = tl.int16
        else:
            ty = tl.uint8
        sp = src.to(tl.pointer_type(ty))
        dp = dst.to(tl.pointer_type(ty))
        for start in range(0, total, BLOCK):
            i = start + tl.arange(0, BLOCK)
            m = i < total
            r = i // n
            c = i - r * n
            tl.store(dp + (d + r * ds + c), tl.load(sp + (s + r * ss + c), mask=m), mask=m)


_WARM: set[torch.device] = set()  # devices whose kernel this process has compiled


def warm_up(device: torch.device) -> None:
    """Compile the table kernel for ``device`` now, once per process: one specialisation per
    word size with 16-byte aligned pointers (every table whose sides are storages; a staging
    region at another alignment compiles its own at first use). Called while a switch is
    prepared, so that its first copies do not wait for Triton's compiler (0.63 s of a 0.64 s
    exchange in the first switch of ``bench/one_device_switch.py`` on an H200). Nothing off
    CUDA or without Triton."""
    if device.type != "cuda" or triton is None or device in _WARM:
        return
    with torch.cuda.device(device):
        buf = torch.zeros(128, dtype=torch.uint8, device=device)
        for word in (8, 4, 2, 1):
            table = torch.tensor([[0, 0, word, 1, word, word]], dtype=torch.int64, device=device)
            _launch(buf[:64], buf[64:], table, word)
        torch.cuda.synchronize(device)
    _WARM.add(device)


def _launch(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, word: int) -> None:
    _copy_blocks[(table.shape[0],)](src, dst, table, WORD=word, BLOCK=_BLOCK)
