"""Pack/unpack benchmark: the runtime's staging path against a plain copy on one device.

One process, no network. It takes one device of a switch, builds its source and destination
storage on ``--device`` (``cuda`` on a GPU machine, else ``cpu``), prepares every round of that
device with every wire piece staged (``exchange.DIRECT_MIN_BYTES`` raised: all moved bytes go
through the pack/unpack path), and times, best of the repeats, each path two ways, *old* (one
``narrow``/``view``/``copy_`` per view, what the runtime did before ``CopyTable``) and *new*
(each round's ``CopyTable`` run once: a few Triton launches on CUDA, merged ``copy_`` on CPU):

- pack: every staged send of every round copied from the source storage views into the arena;
- unpack: every staged receive copied from the arena into the destination storage views;
- local: the device's local copies, view to view (old: views made in the round, as before);
- copy: one plain contiguous ``copy_`` of as many bytes, the device's own copy bandwidth;
- fixed cost per round: one table run with no copy, and with one 64-byte copy (mean).

Cases (``--case``): ``small`` is the runtime bench's TP2·DP2 → TP4 switch (about 600 MiB of
state on 4 ranks); ``70b`` is one device of the shipped Llama-3.1-70B TP8·PP4·DP4 → TP8·PP8·DP2
switch (``specs/llama3.1-70b/``, 2 GiB staging budget), the device that moves the most bytes.
At 80 layers a rank holds GiBs of state; ``--layers N`` (a multiple of 8) scales the model
down to fit a small machine (the source is filled with random bytes, not drawn from global
tensors). Bandwidth counts each byte once; the ratios are bandwidth over plain copy bandwidth.
On CUDA the regions are timed with CUDA events after a synchronize. Run
``python bench/pack_bench.py [--device cuda] [--case 70b --layers 16]``; it prints a table and
writes ``bench/results/pack_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runtime_bench as rb  # noqa: E402  (the same model, cases and specs)

from dynatrain.ir.layout import Layout  # noqa: E402
from dynatrain.ir.loader import spec_from_dict  # noqa: E402
from dynatrain.ir.state import transition_views  # noqa: E402
from dynatrain.planner.pipeline import plan_transition  # noqa: E402
from dynatrain.runtime import exchange  # noqa: E402
from dynatrain.runtime.copytable import CopyTable  # noqa: E402
from dynatrain.runtime.executor import process_devices  # noqa: E402
from dynatrain.runtime.storage import (ByteViews, allocate, fill_from_global,  # noqa: E402
                                       random_global)

DEFAULT_OUT = rb.ROOT / "bench" / "results" / "pack_bench.json"
SMALL = "tp2-dp2 -> tp4"
SPECS_70B = rb.ROOT / "specs" / "llama3.1-70b"


def _timer(device: torch.device) -> Callable[[Callable[[], None], int], float]:
    """Best seconds of ``repeats`` runs of ``fn`` on ``device`` (CUDA events on a GPU)."""
    def best(fn: Callable[[], None], repeats: int) -> float:
        fn()  # warm: allocator, caches, kernel compilation
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


def _mean_seconds(device: torch.device, fn: Callable[[], None], n: int = 2000) -> float:
    """Mean seconds of ``fn`` over ``n`` back-to-back runs (host and device)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / n


def _old_pack(p: exchange.Piece) -> None:
    """The pre-table pack: one narrow, view and copy_ per view."""
    off = 0
    for v in p.views:
        n = v.numel()
        p.wire.narrow(0, off, n).view(v.shape).copy_(v)
        off += n


def _old_unpack(p: exchange.Piece) -> None:
    off = 0
    for v in p.views:
        n = v.numel()
        v.copy_(p.wire.narrow(0, off, n).view(v.shape))
        off += n


def _small_case(device: torch.device):
    src_par, dst_par = rb.CASES[SMALL]
    sv, dv = transition_views(Layout(spec_from_dict(rb._spec(rb._label(src_par), **src_par))),
                              Layout(spec_from_dict(rb._spec(rb._label(dst_par), **dst_par))))
    plan = plan_transition(sv.layout, dv.layout, 64 << 20)
    return sv, dv, plan, lambda view, rank: {
        k: t.to(device) for k, t in fill_from_global(view, rank, random_global(sv, rb.SEED)
                                                     ).items()}


def _70b_case(device: torch.device, layers: int):
    def spec(name: str) -> dict:
        raw = yaml.safe_load((SPECS_70B / name).read_text(encoding="utf-8"))
        raw["model"] = {"preset": raw["model"], "num_layers": layers}
        return raw
    sv, dv = transition_views(Layout(spec_from_dict(spec("tp8-pp4-dp4.yaml"))),
                              Layout(spec_from_dict(spec("tp8-pp8-dp2.yaml"))))
    plan = plan_transition(sv.layout, dv.layout, 2 << 30)

    def source(view, rank):  # random bytes: the copies do not care what they move
        store = allocate(view, rank, device)
        for t in store.values():
            t.view(-1).view(torch.uint8).random_(0, 256)
        return store
    return sv, dv, plan, source


def _busiest(plan, devices: tuple[str, ...]) -> int:
    """Index of the device that sends, receives and copies the most bytes."""
    load = dict.fromkeys(devices, 0)
    for m in plan.messages():
        load[m.src_device] += m.nbytes
        if not m.local:
            load[m.dst_device] += m.nbytes
    return devices.index(max(devices, key=lambda d: (load[d], -devices.index(d))))


def run(device: torch.device, repeats: int, which: int | None, case: str = "small",
        layers: int = 8) -> dict[str, Any]:
    sv, dv, plan, source = _small_case(device) if case == "small" else _70b_case(device, layers)
    devices = process_devices(plan)
    which = (1 if case == "small" else _busiest(plan, devices)) if which is None else which
    name = devices[which]
    sr, dr = plan.src_devices.index(name), plan.dst_devices.index(name)
    src = source(sv, sr)
    dst = allocate(dv, dr, device)
    exchange_min = exchange.DIRECT_MIN_BYTES
    exchange.DIRECT_MIN_BYTES = 1 << 62  # every piece staged: all moved bytes packed
    try:
        local = exchange.spread_local(plan.rounds, name, sr, dr)
        t0 = time.perf_counter()
        works = [exchange.prepare_round(i, rnd, name, sr, dr, ByteViews(src), ByteViews(dst),
                                        devices, local[i]) for i, rnd in enumerate(plan.rounds)]
        prepare_s = time.perf_counter() - t0
    finally:
        exchange.DIRECT_MIN_BYTES = exchange_min
    sends = [p for w in works for p in w.sends]
    recvs = [p for w in works for p in w.recvs]
    sent, received = sum(p.nbytes for p in sends), sum(p.nbytes for p in recvs)
    local_bytes = sum(w.copies.nbytes for w in works)
    arena = torch.empty(max(sent, received, 1), dtype=torch.uint8, device=device)
    for side in ("send", "recv"):  # each round's staged pieces one after the other
        off = 0
        for w in works:
            start = off
            for p in (w.sends if side == "send" else w.recvs):
                p.wire = arena[off:off + p.nbytes]
                off += p.nbytes
            region = arena[start:off]
            if side == "send":
                w.send_region = region
            else:
                w.recv_region = region
    arena.random_(0, 256)  # what "arrived": unpack copies it into the destination views
    plain_src = torch.randint(0, 256, (max(sent, received, local_bytes, 1),), dtype=torch.uint8,
                              device=device)
    plain_dst = torch.empty_like(plain_src)
    best = _timer(device)

    def old_local() -> None:
        for w in works:
            for s, d in w.local_views():
                d.copy_(s)
    times = {
        "pack_old": best(lambda: [_old_pack(p) for p in sends], repeats),
        "pack_new": best(lambda: [w.pack.run(w.send_region) for w in works], repeats),
        "unpack_old": best(lambda: [_old_unpack(p) for p in recvs], repeats),
        "unpack_new": best(lambda: [w.unpack.run(w.recv_region) for w in works], repeats),
        "local_old": best(old_local, repeats) if local_bytes else 0.0,
        "local_new": best(lambda: [w.copies.run() for w in works], repeats)
        if local_bytes else 0.0,
        "copy": best(lambda: plain_dst.copy_(plain_src), repeats),
    }
    copy_gbps = plain_src.numel() / times["copy"] / 1e9
    tiny_src = torch.arange(64, dtype=torch.uint8, device=device)
    tiny_dst = torch.empty(64, dtype=torch.uint8, device=device)
    empty, one = CopyTable([[]]), CopyTable([[(tiny_src, tiny_dst)]])
    t0 = time.perf_counter()
    for w in works:  # the tables alone, again, from the same views
        CopyTable([[(v, 0) for v in p.views] for p in w.sends if not p.direct])
        CopyTable([[(0, v) for v in p.views] for p in w.recvs if not p.direct])
        CopyTable([list(w.local_views())])
    tables_s = time.perf_counter() - t0
    out: dict[str, Any] = {
        "case": SMALL if case == "small" else f"llama3.1-70b tp8-pp4-dp4 -> tp8-pp8-dp2, "
                                              f"{layers} layers",
        "device": str(device), "process_device": name,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "kernel": bool(works[0].pack.kernel) if works else False,
        "rounds": len(works), "pieces_packed": len(sends), "pieces_unpacked": len(recvs),
        "views_packed": sum(len(p.views) for p in sends),
        "views_unpacked": sum(len(p.views) for p in recvs),
        "copies_packed": sum(len(w.pack) for w in works),
        "copies_unpacked": sum(len(w.unpack) for w in works),
        "local_copies": sum(w.copies.copies for w in works),
        "bytes_packed": sent, "bytes_unpacked": received, "bytes_local": local_bytes,
        "copy_bytes": plain_src.numel(), "copy_GBps": copy_gbps,
        "seconds": times, "prepare_seconds": prepare_s, "table_build_seconds": tables_s,
        "fixed_seconds_empty_table": _mean_seconds(device, empty.run),
        "fixed_seconds_one_copy": _mean_seconds(device, one.run),
        "fixed_seconds_one_copy_old": _mean_seconds(device, lambda: tiny_dst.copy_(tiny_src)),
    }
    for path, nbytes in (("pack", sent), ("unpack", received), ("local", local_bytes)):
        for how in ("old", "new"):
            s = times[f"{path}_{how}"]
            gbps = nbytes / s / 1e9 if s else None
            out[f"{path}_{how}_GBps"] = gbps
            out[f"{path}_{how}_vs_copy"] = gbps / copy_gbps if gbps else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda, cuda:N or cpu (default: cuda when there is a GPU)")
    ap.add_argument("--case", choices=("small", "70b"), default="small",
                    help="small: TP2·DP2 → TP4 (default); 70b: one device of the Llama-3.1-70B "
                         "TP8·PP4·DP4 → TP8·PP8·DP2 switch")
    ap.add_argument("--layers", type=int, default=8,
                    help="70b: decoder layers, a multiple of 8 (80: the real model; default 8)")
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats, best taken (10)")
    ap.add_argument("--process", type=int, default=None,
                    help="which device of the switch to take (default: small 1, it packs "
                         "most; 70b the device that moves the most bytes)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON file ({DEFAULT_OUT})")
    args = ap.parse_args(argv)
    if args.case == "70b" and (args.layers < 8 or args.layers % 8):
        ap.error(f"--layers must be a positive multiple of 8 (PP8 stages). Got {args.layers}")
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # set_device needs an index: "cuda" is the current one
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # one process's share, as in a switch
    r = run(device, args.repeats, args.process, args.case, args.layers)
    print(f"{r['case']}, {r['process_device']} on {r['device_name'] or r['device']}, "
          f"{r['rounds']} rounds, table kernel: {'yes' if r['kernel'] else 'no'}")
    print(f"{'path':<7} {'MiB':>8} {'views':>6} {'copies':>6} {'old GB/s':>8} {'new GB/s':>8} "
          f"{'old/copy':>8} {'new/copy':>8}")
    for path, nbytes, views, copies in (
            ("pack", r["bytes_packed"], r["views_packed"], r["copies_packed"]),
            ("unpack", r["bytes_unpacked"], r["views_unpacked"], r["copies_unpacked"]),
            ("local", r["bytes_local"], r["local_copies"], r["local_copies"])):
        old, new = r[f"{path}_old_GBps"] or 0.0, r[f"{path}_new_GBps"] or 0.0
        print(f"{path:<7} {nbytes / (1 << 20):8.1f} {views:6d} {copies:6d} {old:8.2f} {new:8.2f} {old / r['copy_GBps']:7.2f}x "
              f"{new / r['copy_GBps']:7.2f}x")
    print(f"{'copy':<7} {r['copy_bytes'] / (1 << 20):8.1f} {1:6d} {1:6d} {r['copy_GBps']:8.2f}")
    print(f"fixed cost per table run: {r['fixed_seconds_empty_table'] * 1e6:.1f} us empty, "
          f"{r['fixed_seconds_one_copy'] * 1e6:.1f} us with one 64-byte copy (a bare copy_: "
          f"{r['fixed_seconds_one_copy_old'] * 1e6:.1f} us); tables built in "
          f"{r['table_build_seconds'] * 1e3:.1f} ms of {r['prepare_seconds'] * 1e3:.1f} ms "
          f"preparing {r['rounds']} rounds")
    r["environment"] = rb.environment()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
