"""Loading a megatron dist checkpoint into another layout: megatron-core's own load vs DynaTrain's.

A real megatron-core 0.16.1 job (CPU, gloo, 4 processes) trains one step in the source layout
and saves a ``torch_dist`` checkpoint (model + fully_reshardable optimizer, as Megatron-LM
does). Then, for each destination layout, in 4 fresh-state processes:

* **megatron**: ``dist_checkpointing.load`` of the destination job's sharded state dict, then
  ``load_state_dict`` into model and optimizer (``megatron_support.live.load_dist_checkpoint``);
  the job is built beforehand and its build is not timed;
* **dynatrain**: ``dynatrain.checkpoint.load_checkpoint`` of the process's rank: its storage
  read straight from the chunks it needs (then, untimed, compared bit for bit with megatron's
  loaded state through ``extract_state``); **+install**: the same load followed by
  ``install_state`` into a freshly built job (what megatron's number includes).

Each number is the slowest process's, the median of ``--repeat`` runs (page cache warm after
the first). ``python bench/ckpt_load_bench.py [--repeat 3] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # forked workers: keep CUDA out of the parent
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from dynatrain.checkpoint import LoadStats, load_checkpoint, plan_load  # noqa: E402
from dynatrain.ir.layout import Layout  # noqa: E402
from dynatrain.ir.state import view_of  # noqa: E402
from dynatrain.ir.units import format_bytes  # noqa: E402
from matrix import case, to_harness_cfg, to_spec  # noqa: E402
from megatron_support import live  # noqa: E402

MODEL = dict(num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=4,
             ffn_hidden_size=1536, swiglu=True, vocab_size=16000,
             make_vocab_size_divisible_by=128, max_position_embeddings=64)
SRC = case("src tp2-dp2", 4, tp=2, **MODEL)
DSTS = {"pp2-dp2": dict(SRC, tp=1, pp=2), "tp4": dict(SRC, tp=4),
        "tp2-pp2-vpp2": dict(SRC, pp=2, vpp=2)}


def _save(path: str) -> None:
    c = live.resolve(to_harness_cfg(SRC))

    def work(rank: int) -> None:
        live.init_parallel(c)
        job = live.build(c)
        live.train_step(job, 0)
        live.save_dist_checkpoint(job, path)

    live.run_workers(work, 4, timeout=600)


def _measure(name: str, path: str, repeat: int) -> dict:
    from megatron.core import parallel_state as ps

    from dynatrain.runtime.megatron import extract_state, install_state

    cfg = DSTS[name]
    c = live.resolve(to_harness_cfg(cfg))
    layout = Layout(to_spec(cfg))
    rows = plan_load(path, layout).view.vocab_rows
    view = view_of(layout, rows)

    def work(rank: int) -> dict:
        torch.set_num_threads(1)
        live.init_parallel(c)
        out = {"megatron": [], "dynatrain": [], "dynatrain_install": [], "equal": True}
        for _ in range(repeat):
            job = live.build(c, seed=7)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            live.load_dist_checkpoint(job, path)
            out["megatron"].append(time.perf_counter() - t0)
            torch.distributed.barrier()
            stats = LoadStats()
            t0 = time.perf_counter()
            store = load_checkpoint(path, layout, rank, threads=1, stats=stats)
            out["dynatrain"].append(time.perf_counter() - t0)
            theirs = extract_state(view, rank, job.ddps, job.optimizer)
            out["equal"] &= all(live.bits_equal(store[k], theirs[k]) for k in store)
            fresh = live.build(c, seed=8)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            store = load_checkpoint(path, layout, rank, threads=1)
            install_state(view, rank, fresh.ddps, fresh.optimizer, store)
            out["dynatrain_install"].append(time.perf_counter() - t0)
            out["bytes_read"] = stats.bytes_read
            out["bytes_written"] = stats.bytes_written
        ps.destroy_model_parallel()
        return out

    res = live.run_workers(work, 4, timeout=600)
    slowest = {k: [max(r[k][i] for r in res) for i in range(repeat)]
               for k in ("megatron", "dynatrain", "dynatrain_install")}
    med = {k: statistics.median(v) for k, v in slowest.items()}
    return {"destination": name, "megatron_s": med["megatron"], "dynatrain_s": med["dynatrain"],
            "dynatrain_install_s": med["dynatrain_install"],
            "speedup": med["megatron"] / med["dynatrain_install"], "runs": slowest,
            "bit_equal_to_megatron": all(r["equal"] for r in res),
            "bytes_read_max": max(r["bytes_read"] for r in res),
            "bytes_written_max": max(r["bytes_written"] for r in res)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=str(ROOT / "bench/results/ckpt_load_bench.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckpt_load_bench_") as tmp:
        path = os.path.join(tmp, "ckpt")
        os.makedirs(path)
        t0 = time.perf_counter()
        _save(path)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        print(f"source {SRC['name']}: checkpoint {format_bytes(size)} saved in "
              f"{time.perf_counter() - t0:.1f} s")
        rows = []
        for name in DSTS:
            r = _measure(name, path, args.repeat)
            rows.append(r)
            print(f"  -> {name:<14} megatron {r['megatron_s']:.3f} s   dynatrain "
                  f"{r['dynatrain_s']:.3f} s (+install {r['dynatrain_install_s']:.3f} s)   "
                  f"{r['speedup']:.1f}x (with install)   read "
                  f"{format_bytes(r['bytes_read_max'])} per process (max)   bit-equal: "
                  f"{'yes' if r['bit_equal_to_megatron'] else 'NO'}")
    doc = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "torch": torch.__version__}, "checkpoint_bytes": size,
           "model": MODEL, "source": SRC["name"], "repeat": args.repeat, "results": rows}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
