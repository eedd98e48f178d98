"""Pack/unpack benchmark: the runtime's staging path against a plain copy on one device.

One process, no network. It takes the runtime bench's TP2·DP2 → TP4 switch (about 600 MiB of
state on 4 ranks), builds one device's source and destination storage on ``--device`` (``cuda``
on a GPU machine, else ``cpu``), prepares every round of that device with every wire piece
staged (``exchange.DIRECT_MIN_BYTES`` raised: all moved bytes go through the pack/unpack path),
and times, best of the repeats:

- pack: every staged send of every round copied from the source storage views into the arena,
  as ``run_round`` does (``exchange._pack``);
- unpack: every staged receive copied from the arena into the destination storage views
  (``exchange._unpack``);
- local: the device's local copies, view to view;
- copy: one plain contiguous ``copy_`` of as many bytes, the device's own copy bandwidth.

Bandwidth counts each byte once (bytes moved / seconds); the ratios are pack and unpack
bandwidth over plain copy bandwidth. On CUDA the regions are timed with CUDA events after a
synchronize. Run ``python bench/pack_bench.py [--device cuda]``; it prints a table and writes
``bench/results/pack_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runtime_bench as rb  # noqa: E402  (the same model, cases and specs)

from dynatrain.ir.layout import Layout  # noqa: E402
from dynatrain.ir.loader import spec_from_dict  # noqa: E402
from dynatrain.ir.state import transition_views  # noqa: E402
from dynatrain.planner.pipeline import plan_transition  # noqa: E402
from dynatrain.runtime import exchange  # noqa: E402
from dynatrain.runtime.executor import process_devices  # noqa: E402
from dynatrain.runtime.storage import (ByteViews, allocate, fill_from_global,  # noqa: E402
                                       random_global)

DEFAULT_OUT = rb.ROOT / "bench" / "results" / "pack_bench.json"
CASE = "tp2-dp2 -> tp4"


def _timer(device: torch.device) -> Callable[[Callable[[], None], int], float]:
    """Best seconds of ``repeats`` runs of ``fn`` on ``device`` (CUDA events on a GPU)."""
    def best(fn: Callable[[], None], repeats: int) -> float:
        fn()  # warm: allocator, caches
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return min(times)
    return best


def run(device: torch.device, repeats: int, which: int) -> dict[str, Any]:
    src_par, dst_par = rb.CASES[CASE]
    sv, dv = transition_views(Layout(spec_from_dict(rb._spec(rb._label(src_par), **src_par))),
                              Layout(spec_from_dict(rb._spec(rb._label(dst_par), **dst_par))))
    plan = plan_transition(sv.layout, dv.layout, 64 << 20)
    devices = process_devices(plan)
    name = devices[which]
    tensors = random_global(sv, rb.SEED)
    sr, dr = plan.src_devices.index(name), plan.dst_devices.index(name)
    src = {k: t.to(device) for k, t in fill_from_global(sv, sr, tensors).items()}
    dst = allocate(dv, dr, device)
    exchange_min = exchange.DIRECT_MIN_BYTES
    exchange.DIRECT_MIN_BYTES = 1 << 62  # every piece staged: all moved bytes packed
    try:
        local = exchange.spread_local(plan.rounds, name, sr, dr)
        works = [exchange.prepare_round(i, rnd, name, sr, dr, ByteViews(src), ByteViews(dst),
                                        devices, local[i]) for i, rnd in enumerate(plan.rounds)]
    finally:
        exchange.DIRECT_MIN_BYTES = exchange_min
    sends = [p for w in works for p in w.sends]
    recvs = [p for w in works for p in w.recvs]
    pairs = [pair for w in works for pair in w.local_views()]
    sent, received = sum(p.nbytes for p in sends), sum(p.nbytes for p in recvs)
    local_bytes = sum(s.numel() for s, _ in pairs)
    arena = torch.empty(max(sent, received, 1), dtype=torch.uint8, device=device)
    for pieces in (sends, recvs):  # each piece its own slice of the arena
        off = 0
        for p in pieces:
            p.wire = arena[off:off + p.nbytes]
            off += p.nbytes
    arena.random_(0, 256)  # what "arrived": unpack copies it into the destination views
    plain_src = torch.randint(0, 256, (max(sent, received),), dtype=torch.uint8, device=device)
    plain_dst = torch.empty_like(plain_src)
    best = _timer(device)
    pack = best(lambda: [exchange._pack(p) for p in sends], repeats)
    unpack = best(lambda: [exchange._unpack(p) for p in recvs], repeats)
    local_s = best(lambda: [d.copy_(s) for s, d in pairs], repeats) if pairs else 0.0
    copy = best(lambda: plain_dst.copy_(plain_src), repeats)
    copy_gbps = plain_src.numel() / copy / 1e9
    out = {
        "case": CASE, "device": str(device), "process_device": name,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "pieces_packed": len(sends), "pieces_unpacked": len(recvs),
        "local_copies": len(pairs), "bytes_packed": sent, "bytes_unpacked": received,
        "bytes_local": local_bytes,
        "pack_seconds": pack, "unpack_seconds": unpack, "local_seconds": local_s,
        "copy_seconds": copy, "copy_bytes": plain_src.numel(),
        "pack_GBps": sent / pack / 1e9, "unpack_GBps": received / unpack / 1e9,
        "local_GBps": local_bytes / local_s / 1e9 if local_s else None,
        "copy_GBps": copy_gbps,
    }
    out["pack_vs_copy"] = out["pack_GBps"] / copy_gbps
    out["unpack_vs_copy"] = out["unpack_GBps"] / copy_gbps
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda or cpu (default: cuda when there is a GPU)")
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats, best taken (10)")
    ap.add_argument("--process", type=int, default=1,
                    help="which of the switch's 4 devices to take (default 1: it packs most)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON file ({DEFAULT_OUT})")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # one process's share, as in a switch
    r = run(device, args.repeats, args.process)
    print(f"{r['case']}, {r['process_device']} on {r['device_name'] or r['device']}")
    print(f"{'path':<8} {'MiB':>7} {'pieces':>6} {'GB/s':>7} {'vs copy':>7}")
    for path, mib, n, gbps in (
            ("pack", r["bytes_packed"], r["pieces_packed"], r["pack_GBps"]),
            ("unpack", r["bytes_unpacked"], r["pieces_unpacked"], r["unpack_GBps"]),
            ("local", r["bytes_local"], r["local_copies"], r["local_GBps"] or 0.0),
            ("copy", r["copy_bytes"], 1, r["copy_GBps"])):
        print(f"{path:<8} {mib / (1 << 20):7.1f} {n:6d} {gbps:7.2f} {gbps / r['copy_GBps']:6.2f}x")
    r["environment"] = rb.environment()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
