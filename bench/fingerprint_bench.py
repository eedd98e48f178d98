"""Transfer fingerprint benchmark: the fingerprint's bandwidth against a plain copy on one device.

For each size (16 MiB, 256 MiB and, on CUDA, 1 GiB) it times, best of the repeats, on
``--device`` (``cuda`` on a GPU machine, else ``cpu``):

- new: ``runtime.fingerprint.fingerprint`` (exact integer tile sums: one Triton kernel per
  segment on CUDA, int32 blocks in torch elsewhere), ending with reading the value back;
- old: the previous definition's code, kept here (16-bit words, float64 sums and dot products
  per 1 MiB chunk, a Python loop over the chunks), for comparison;
- copy: one plain contiguous ``copy_`` of as many bytes, the device's own copy bandwidth;
- on CPU also the check a gloo switch runs instead: ``runtime.fingerprint.word_sums`` (64-bit
  word sums through torch's int64 reductions), and ``zlib.crc32`` of the same bytes (the
  previous CPU check; a strided view copied block by block as it did);

each on a contiguous segment and on a strided one (rows of 8 KiB, 16 KiB apart: half the
columns of a matrix, as a row-parallel slice is). Bandwidth counts each byte once; ``vs copy``
is fingerprint bandwidth over copy bandwidth (the target on CUDA: at least 0.5). On CUDA the
regions are timed with CUDA events after a synchronize. Run ``python bench/fingerprint_bench.py
[--device cuda]``; it prints a table and writes ``bench/results/fingerprint_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import zlib
from pathlib import Path

import torch

from dynatrain.runtime import fingerprint as fp
from dynatrain.runtime.storage import row_blocks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pack_bench import _timer  # noqa: E402  (best of repeats; CUDA events on a GPU)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "fingerprint_bench.json"
MiB = 1 << 20
ROW = 8 << 10  # bytes per row of the strided case


# ----- the previous implementation (git c00e76c), for comparison ---------------------------------

_OLD_CHUNK = 1 << 20
_OLD_POSITIONS: dict[torch.device, torch.Tensor] = {}  # 0, 1, 2, ... as float64, as it cached


def _old_fingerprint(views: list[torch.Tensor], on: torch.device) -> torch.Tensor:
    s1 = torch.zeros((), dtype=torch.int64, device=on)
    s2 = torch.zeros((), dtype=torch.int64, device=on)
    for k, v in enumerate(views):
        a, b = _old_segment(v, on)
        s1 = (s1 + a) % fp.PRIME
        s2 = (s2 + b + ((k + 1) % fp.PRIME) * a) % fp.PRIME
    return torch.stack([s1, s2])


def _old_segment(v: torch.Tensor, on: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.zeros((), dtype=torch.int64, device=on)
    b = torch.zeros((), dtype=torch.int64, device=on)
    pos, carry = 0, None
    for x in (blk.reshape(-1) for blk in row_blocks(v, _OLD_CHUNK)):
        if carry is not None:
            x = torch.cat([carry, x])
        carry = x[-1:].clone() if x.numel() % 2 else None
        if carry is not None:
            x = x[:-1]
        if x.data_ptr() % 2:
            x = x.clone()
        a, b, pos = _old_fold(x, a, b, pos, on)
    if carry is not None:
        a, b, pos = _old_fold(torch.cat([carry, carry.new_zeros(1)]), a, b, pos, on)
    return a, b


def _old_fold(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, pos: int, on: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor, int]:
    if not x.numel():
        return a, b, pos
    w = x.view(torch.int16).to(torch.float64)
    c = w.sum().to(torch.int64) % fp.PRIME
    have = _OLD_POSITIONS.get(on)
    if have is None or have.numel() < w.numel():
        have = _OLD_POSITIONS[on] = torch.arange(max(w.numel(), _OLD_CHUNK // 2 + 1),
                                                 dtype=torch.float64, device=on)
    cw = torch.dot(w, have[:w.numel()]).to(torch.int64) % fp.PRIME
    return (a + c) % fp.PRIME, (b + ((pos + 1) % fp.PRIME) * c + cw) % fp.PRIME, pos + w.numel()


def _crc32(view: torch.Tensor) -> int:
    """The previous CPU check: CRC-32 of the row-major bytes, strided rows copied in blocks."""
    x = fp._canonical(view)
    if x.dim() == 1:
        return zlib.crc32(x.numpy())
    crc = 0
    for block, _, _ in fp._blocks(x, 0):
        crc = zlib.crc32(block.contiguous().numpy(), crc)
    return crc


# ----- the measurement -----------------------------------------------------------------------------

def measure(device: torch.device, sizes: list[int], repeats: int, old: bool) -> list[dict]:
    best = _timer(device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for size in sizes:
        base = torch.randint(0, 256, (2 * size,), dtype=torch.uint8, device=device,
                             generator=gen)
        copy_dst = torch.empty(size, dtype=torch.uint8, device=device)
        cases = {"contiguous": base[:size],
                 "strided": base.view(-1, 2 * ROW)[:, ROW // 2:ROW // 2 + ROW]}
        t_copy = best(lambda: copy_dst.copy_(base[:size]), repeats)
        for name, view in cases.items():
            assert view.numel() == size
            t_new = best(lambda: fp.fingerprint([view], device).tolist(), repeats)
            cpu = {}
            if device.type == "cpu":
                t_words = best(lambda: fp.word_sums([view]), repeats)
                t_crc = best(lambda: _crc32(view), repeats)
                cpu = {"word_sums_seconds": t_words, "word_sums_gbps": size / t_words / 1e9,
                       "word_sums_vs_copy": t_copy / t_words, "crc32_seconds": t_crc,
                       "crc32_gbps": size / t_crc / 1e9}
            t_old = best(lambda: _old_fingerprint([view], device).tolist(), repeats) \
                if old else None
            rows.append({"bytes": size, "layout": name, "new_seconds": t_new,
                         "old_seconds": t_old, "copy_seconds": t_copy,
                         "new_gbps": size / t_new / 1e9,
                         "old_gbps": size / t_old / 1e9 if t_old else None,
                         "copy_gbps": size / t_copy / 1e9,
                         "new_vs_copy": t_copy / t_new,
                         "speedup": t_old / t_new if t_old else None, **cpu})
        del base, copy_dst, cases
    return rows


def _table(rows: list[dict]) -> str:
    out = [f"{'size':>9} {'layout':<11} {'new GB/s':>9} {'old GB/s':>9} {'copy GB/s':>10} "
           f"{'new/copy':>9} {'speedup':>8}"]
    for r in rows:
        old = f"{r['old_gbps']:9.2f}" if r["old_gbps"] else f"{'-':>9}"
        speedup = f"{r['speedup']:7.1f}x" if r["speedup"] else f"{'-':>8}"
        out.append(f"{r['bytes'] // MiB:>5} MiB {r['layout']:<11} {r['new_gbps']:9.2f} {old} "
                   f"{r['copy_gbps']:10.2f} {r['new_vs_copy']:9.3f} {speedup}")
    if "word_sums_gbps" in rows[0]:
        out += ["", f"{'size':>9} {'layout':<11} {'word sums GB/s':>15} {'crc32 GB/s':>11} "
                    f"{'words/copy':>11} {'words/crc32':>12}   (the CPU check of a gloo switch)"]
        for r in rows:
            out.append(f"{r['bytes'] // MiB:>5} MiB {r['layout']:<11} {r['word_sums_gbps']:15.2f} "
                       f"{r['crc32_gbps']:11.2f} {r['word_sums_vs_copy']:11.3f} "
                       f"{r['word_sums_gbps'] / r['crc32_gbps']:11.2f}x")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--sizes", default=None,
                    help="MiB, comma-separated (default 16,256,1024 on CUDA, 16,256 on CPU)")
    ap.add_argument("--repeats", type=int, default=None, help="default 10 on CUDA, 3 on CPU")
    ap.add_argument("--no-old", action="store_true", help="skip the previous implementation")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device.index)
    sizes = [int(s) * MiB for s in (args.sizes or ("16,256,1024" if device.type == "cuda"
                                                    else "16,256")).split(",")]
    repeats = args.repeats or (10 if device.type == "cuda" else 3)
    rows = measure(device, sizes, repeats, not args.no_old)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(f"fingerprint vs copy on {device} ({name}), torch {torch.__version__}, best of "
          f"{repeats}")
    print(_table(rows))
    result = {"device": str(device), "device_name": name, "torch": torch.__version__,
              "triton": getattr(fp.triton, "__version__", None), "repeats": repeats,
              "threads": torch.get_num_threads(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
