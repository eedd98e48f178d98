"""Runtime benchmark: a real switch across gloo processes against raw p2p, DCP and Megatron.

One run, one machine, one state. For each case (a Llama-like model whose training state is
about 600 MiB over its ranks, switched between layouts of 4 processes) the script plans the
switch in the parent, draws the global tensors once and forks one process per device. Every
process builds its source storage from those tensors, then, interleaved repeat by repeat so
that every method sees the same machine load:

- raw: the plan's own messages (same pairs, sizes and rounds) exchanged between the same
  processes from preallocated, pre-touched buffers, once with blocking ``send``/``recv`` in the
  plan's per-device order and once with ``batch_isend_irecv`` per round (gloo has no
  coalescing: that is isend/irecv per message); no packing, no unpacking, no local copies;
  and once more per round with the round's local bytes (the plan's messages from a device to
  itself) copied as one contiguous copy each while the batch runs: the least work the plan
  asks of a device, raw p2p plus its local copies (``raw+local``);
- switch: ``dynatrain.runtime.executor.switch`` end to end (binding, preparing every round,
  local copies, packing, exchange, unpacking, commit vote) into preallocated destination
  storage (``dst_store``, as DCP loads into an allocated state dict), and once more allocating
  its destination itself; once more into preallocated storage with the process's part made
  ahead (``prepare_exchange``, untimed: what a live switch does, whose build ahead makes it
  while the job trains), so the call runs only the rounds and the vote; all are checked bit
  for bit against the storage built directly from the global tensors; and once more with
  ``check_transfers`` (fingerprints of every transfer compared before the vote);
- dcp: the same state resharded through ``torch.distributed.checkpoint``: every source rank
  saves its boxes to a directory on tmpfs (``/dev/shm``), then every destination rank loads
  its boxes from it into preallocated storage; the loaded storage is checked bit for bit.

Then, unless ``--quick``, each case runs once more as real megatron-core jobs (the test
harness ``tests/megatron_support/live.py``: GPTModel, DDP, DistributedOptimizer, one training
step): Megatron-LM's own resharding path, ``dist_checkpointing`` save (fully reshardable
optimizer state) then load into a fresh job of the destination layout, against DynaTrain's
path on the same job: ``extract_state``, ``switch``, ``install_state`` into a fresh job; both
destination jobs must agree bit for bit.

Each case also prints the downtime DynaTrain predicts for its switch on the ``gloo-local``
preset (``predicted_downtime``: wire model plus fixed costs, calibrated by
``bench/calibrate_fixed_costs.py``) next to the measured one, both ways the calibration
measures: into preallocated storage (against the best switch into ``dst_store``), and
allocating its destination (``allocates=True``: getting the storage ready is added; against
the process's first allocating switch, whose destination's pages are new as in every
calibration switch: a process's later ones reuse freed memory). It also prints the fixed parts
the switch reports (setup, vote).

Effective bandwidth is the bytes the plan moves between devices divided by wall seconds
(barrier to barrier, best of the repeats). Run ``python bench/runtime_bench.py [--quick]``;
it prints a table and writes ``bench/results/runtime_bench.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A CPU benchmark under gloo whose workers are forked: run as a script, it hides GPUs before torch
# loads, so that nothing (megatron's import, DCP) initialises CUDA in the parent and breaks the
# forks. (pack_bench imports this module for its cases and keeps its GPU.)
if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.state import StateView, transition_views
from dynatrain.planner.cost import PRESETS, predicted_downtime
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.plan import Plan
from dynatrain.runtime.executor import process_devices, switch
from dynatrain.runtime.prepared import prepare_exchange
from dynatrain.runtime.storage import (Storage, allocate, fill_from_global, random_global,
                                       region, storage_bytes, torch_dtype)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "runtime_bench.json"
MIB = 1 << 20
SEED = 7

# Llama-like (GQA, SwiGLU, RMSNorm, RoPE, untied embeddings), 40 M parameters, in Megatron's
# argument names (a spec's model mapping; the megatron harness builds the same model). With
# bf16 params, fp32 main params and two fp32 Adam moments the state over 4 ranks is ~600 MiB.
# The vocabulary needs no padding at TP 1..4, so every layout holds the same logical tensors.
MODEL: dict[str, Any] = {"num_layers": 8, "hidden_size": 512, "ffn_hidden_size": 1408,
                         "num_attention_heads": 8, "num_query_groups": 2, "vocab_size": 16384,
                         "make_vocab_size_divisible_by": 128, "max_position_embeddings": 64,
                         "swiglu": True, "normalization": "RMSNorm",
                         "position_embedding_type": "rope",
                         "untie_embeddings_and_output_weights": True}
WORLD = 4  # processes (devices) of every case


def _spec(name: str, **parallel: int) -> dict[str, Any]:
    return {"name": f"Llama-like 40M, {name}", "model": MODEL, "parallel": parallel,
            "world": {"nodes": 1, "gpus_per_node": WORLD}}


# name -> (source parallel config, destination parallel config)
CASES: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "tp2-dp2 -> tp4": ({"tp": 2}, {"tp": 4}),
    "tp2-dp2 -> tp2-pp2": ({"tp": 2}, {"tp": 2, "pp": 2}),
}


def _label(par: dict[str, int]) -> str:
    dp = WORLD // (par.get("tp", 1) * par.get("pp", 1))
    return " ".join(f"{k.upper()}{v}" for k, v in par.items()) + (f" DP{dp}" if dp > 1 else "")


QUICK_CASES = ("tp2-dp2 -> tp4",)


@dataclass(frozen=True)
class Job:
    """What a forked worker needs; inherited through fork, never pickled."""

    name: str
    plan: Plan
    src: StateView
    dst: StateView
    devices: tuple[str, ...]
    tensors: dict
    out: Path
    ckpt_dir: Path
    repeats: int


# ---- raw point to point ---------------------------------------------------------------------

def _raw_ops(job: Job, device: str, local: bool = False
             ) -> list[list[tuple[str, int, torch.Tensor, int]]]:
    """Per round, this device's remote messages in its plan order: (op, peer, buffer, tag);
    with ``local``, its local messages too, as ("copy", -1, (source, destination), -1).

    Buffers are allocated and written once here, so the timed exchanges pay no page faults.
    """
    rounds = []
    for rnd in job.plan.rounds:
        ops = []
        for mi in rnd.device_order().get(device, ()):
            m = rnd.messages[mi]
            if m.local:
                if local:
                    ops.append(("copy", -1, (torch.ones(m.nbytes, dtype=torch.uint8),
                                             torch.zeros(m.nbytes, dtype=torch.uint8)), -1))
                continue
            buf = torch.ones(m.nbytes, dtype=torch.uint8)
            if m.src_device == device:
                ops.append(("send", job.devices.index(m.dst_device), buf, mi))
            else:
                ops.append(("recv", job.devices.index(m.src_device), buf, mi))
        rounds.append(ops)
    return rounds


def _raw_sendrecv(rounds: list) -> None:
    for ops in rounds:
        for op, peer, buf, tag in ops:
            if op == "send":
                dist.send(buf, dst=peer, tag=tag)
            else:
                dist.recv(buf, src=peer, tag=tag)


def _raw_batch(rounds: list) -> None:
    for ops in rounds:
        p2p = [dist.P2POp(dist.isend if op == "send" else dist.irecv, buf, peer=peer, tag=tag)
               for op, peer, buf, tag in ops if op != "copy"]
        works = dist.batch_isend_irecv(p2p) if p2p else []
        for op, _, bufs, _ in ops:
            if op == "copy":  # while the round's messages move, as the switch copies
                bufs[1].copy_(bufs[0])
        for w in works:
            w.wait()


# ---- PyTorch DCP ----------------------------------------------------------------------------

class _Boxes(torch.Tensor):
    """A logical tensor as DCP sees one rank of it: its global size plus the boxes it holds.

    It implements the checkpoint protocol DTensor implements (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``), so DCP's default planners save each
    box as a chunk (deduplicating DP replicas) and plan resharding reads into the boxes a
    destination rank holds, replicas included (``ShardedTensor`` must tile the tensor once,
    which replicated layernorms and DP replicas do not). Reads land in the storage views in
    place. A metadata-only wrapper: no op runs on it.
    """

    @staticmethod
    def __new__(cls, size: tuple[int, ...], dtype: torch.dtype, boxes: list) -> "_Boxes":
        return torch.Tensor._make_wrapper_subclass(cls, size, dtype=dtype, device="cpu")

    def __init__(self, size: tuple[int, ...], dtype: torch.dtype, boxes: list) -> None:
        self._boxes = {tuple(box.lo): t for box, t in boxes}

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        raise NotImplementedError(f"_Boxes does not run {func}")

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata,
                                                           MetadataIndex, TensorProperties)
        from torch.distributed.checkpoint.planner import (TensorWriteData, WriteItem,
                                                          WriteItemType)

        return [WriteItem(index=MetadataIndex(fqn, torch.Size(lo)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(lo), t.shape),
                              properties=TensorProperties.create_from_tensor(t),
                              size=self.shape))
                for lo, t in self._boxes.items()]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(lo), t.shape) for lo, t in self._boxes.items()]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self._boxes[tuple(index.offset)]


def _state_dict(view: StateView, rank: int, store: Storage, save: bool) -> dict[str, Any]:
    """``store`` as a DCP state dict: one ``_Boxes`` per logical tensor and state kind.

    Saving skips the non-primary copy of a tied embedding (the primary one is saved).
    """
    specs = view.tensors()
    parts: dict[tuple[str, str], list] = {}
    for reg in view.regions(rank):
        if save and not reg.primary:
            continue
        parts.setdefault((reg.key, reg.kind), []).append(
            (reg.box, region(store, reg.kind, reg.slot, reg.box)))
    sd: dict[str, Any] = {}
    for (key, kind), boxes in sorted(parts.items()):
        lt = specs[(key, kind)]
        if lt.shape == ():  # Adam's step: a plain replicated tensor
            sd[f"{key}/{kind}"] = boxes[0][1]
        else:
            sd[f"{key}/{kind}"] = _Boxes(lt.shape, torch_dtype(lt.dtype), boxes)
    return sd


def _dcp_once(job: Job, src: Storage | None, src_rank: int | None, dst_rank: int | None
              ) -> tuple[float, float, Storage | None, int]:
    """Save the source state, load it into allocated (touched) destination storage.

    Returns (save seconds, load seconds, the loaded storage, checkpoint bytes on process 0).
    Building the state dicts and the destination is not timed.
    """
    import torch.distributed.checkpoint as dcp

    path = job.ckpt_dir / "dcp"
    save_sd = _state_dict(job.src, src_rank, src, True) if src is not None else {}
    dst = _touched(job.dst, dst_rank)
    load_sd = _state_dict(job.dst, dst_rank, dst, False) if dst is not None else {}
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(save_sd, storage_writer=dcp.FileSystemWriter(str(path)))
    dist.barrier()
    t1 = time.perf_counter()
    # A process without a destination rank still joins the load's collectives.
    dcp.load(load_sd, storage_reader=dcp.FileSystemReader(str(path)))
    dist.barrier()
    t2 = time.perf_counter()
    size = sum(f.stat().st_size for f in path.iterdir()) if dist.get_rank() == 0 else 0
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path)
    return t1 - t0, t2 - t1, dst, size


# ---- megatron-core: dist-checkpoint reshard vs the live switch -----------------------------

def _megatron_live(name: str, budget: int) -> dict[str, Any]:
    """Real megatron-core jobs: dist-checkpoint save -> load against extract, switch, install.

    Runs in the test harness's forked gloo workers (``tests/megatron_support/live.py``, its CPU
    shim included): build the source job and train one step (so Adam's state exists), save it
    with ``dist_checkpointing`` to tmpfs; DynaTrain: ``extract_state`` (views of the job's own
    tensors), ``switch`` (allocating its destination), rebuild megatron's parallel state for the
    destination, ``install_state`` into a fresh job; Megatron: load the checkpoint into another
    fresh job. Building jobs is not timed. Both destination jobs must match bit for bit.
    """
    sys.path.insert(0, str(ROOT / "tests"))
    from megatron.core import parallel_state as ps
    from megatron_support import live

    from dynatrain.runtime.megatron import extract_state, install_state

    src_par, dst_par = CASES[name]

    def cfg(par: dict[str, int]) -> dict[str, Any]:
        c = {**MODEL, **par}
        c["seq_length"] = c.pop("max_position_embeddings")
        return live.resolve(c)

    sv, dv = transition_views(Layout(spec_from_dict(_spec(_label(src_par), **src_par))),
                              Layout(spec_from_dict(_spec(_label(dst_par), **dst_par))))
    plan = plan_transition(sv.layout, dv.layout, budget)
    devices = process_devices(plan)
    ca, cb = cfg(src_par), cfg(dst_par)
    warnings.simplefilter("ignore")  # megatron's and DCP's deprecation notes, in every worker
    with tempfile.TemporaryDirectory(prefix="dynatrain-mcore-", dir="/dev/shm") as ckpt:

        def work(rank: int) -> dict[str, Any]:
            def timed(fn):
                dist.barrier()
                t0 = time.perf_counter()
                out = fn()
                dist.barrier()
                return time.perf_counter() - t0, out

            live.init_parallel(ca)
            job = live.build(ca)
            live.train_step(job, 0)
            out: dict[str, Any] = {}
            out["save"] = timed(lambda: live.save_dist_checkpoint(job, ckpt))[0]
            out["extract"], src = timed(
                lambda: extract_state(sv, rank, job.ddps, job.optimizer))
            out["switch"], (dst, _) = timed(
                lambda: switch(plan, sv, dv, devices[rank], src, timeout=120.0))
            ps.destroy_model_parallel()
            live.init_parallel(cb)
            switched = live.build(cb, seed=cb["seed"] + 17)
            out["install"] = timed(
                lambda: install_state(dv, rank, switched.ddps, switched.optimizer, dst))[0]
            ref = live.build(cb, seed=cb["seed"] + 29)
            out["load"] = timed(lambda: live.load_dist_checkpoint(ref, ckpt))[0]
            out["diffs"] = live.native_diffs(live.native_state(ref),
                                             live.native_state(switched))[:3]
            return out

        results = live.run_workers(work, WORLD, timeout=1200)
    bad = [d for r in results for d in r["diffs"]]
    if bad:
        raise SystemExit(f"{name}: the switched megatron job differs from the reload: {bad[:3]}")
    worst = {k: max(r[k] for r in results) for k in ("save", "load", "extract", "switch",
                                                      "install")}
    ours = worst["extract"] + worst["switch"] + worst["install"]
    return {"megatron_save_seconds": worst["save"], "megatron_load_seconds": worst["load"],
            "megatron_seconds": worst["save"] + worst["load"],
            "live_extract_seconds": worst["extract"], "live_switch_seconds": worst["switch"],
            "live_install_seconds": worst["install"], "live_seconds": ours,
            "speedup_vs_megatron": (worst["save"] + worst["load"]) / ours,
            "megatron_bit_exact": True}


# ---- the worker -----------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _mismatches(got: Storage | None, want: Storage | None) -> list[str]:
    if (got is None) != (want is None):
        return ["destination storage present on the wrong process"]
    if got is None:
        return []
    if got.keys() != want.keys():
        return ["destination keys differ"]
    return [f"{k} differs" for k, w in want.items()
            if got[k].dtype != w.dtype or got[k].shape != w.shape
            or not torch.equal(_bits(got[k]), _bits(w))]


def _touched(view: StateView, rank: int | None) -> Storage | None:
    """Destination storage allocated and written once (its pages mapped), as a model's
    parameters and optimizer state are: what DCP loads into, and the switch's ``dst_store``."""
    if rank is None:
        return None
    store = allocate(view, rank)
    for t in store.values():
        t.fill_(0)
    return store


def _timed(fn, cpu: list[float] | None = None) -> tuple[float, Any]:
    """Wall seconds of ``fn`` barrier to barrier; appends this process's CPU seconds (every
    thread: gloo's included) to ``cpu`` if given."""
    dist.barrier()
    c0 = time.process_time()
    t0 = time.perf_counter()
    out = fn()
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    dist.barrier()
    return time.perf_counter() - t0, out


def _worker(idx: int, job: Job) -> None:
    torch.set_num_threads(1)  # 4 processes share 2 cores
    device = job.devices[idx]
    res: dict[str, Any] = {"device": device, "errors": []}
    for k in ("raw_sendrecv", "raw_batch", "switch", "switch_alloc", "dcp_save", "dcp_load",
              "raw_batch_cpu", "switch_cpu", "switch_checked", "switch_prepared",
              "switch_prepared_cpu", "prepare", "raw_local"):
        res[k] = []
    try:
        dist.init_process_group("gloo", init_method=f"file://{job.out}/store", rank=idx,
                                world_size=len(job.devices), timeout=datetime.timedelta(600))
        plan = job.plan
        src_rank = plan.src_devices.index(device) if device in plan.src_devices else None
        dst_rank = plan.dst_devices.index(device) if device in plan.dst_devices else None
        src = fill_from_global(job.src, src_rank, job.tensors) if src_rank is not None else None
        want = fill_from_global(job.dst, dst_rank, job.tensors) if dst_rank is not None else None
        res["src_bytes"] = storage_bytes(src) if src is not None else 0
        res["dst_bytes"] = storage_bytes(want) if want is not None else 0
        rounds = _raw_ops(job, device)
        with_local = _raw_ops(job, device, local=True)
        _timed(lambda: _raw_batch(rounds))  # warm the connections between every pair
        _timed(lambda: _raw_batch(with_local))
        for rep in range(job.repeats):
            res["raw_sendrecv"].append(_timed(lambda: _raw_sendrecv(rounds))[0])
            res["raw_batch"].append(_timed(lambda: _raw_batch(rounds), res["raw_batch_cpu"])[0])
            res["raw_local"].append(_timed(lambda: _raw_batch(with_local))[0])
            seconds, (dst, report) = _timed(
                lambda: switch(plan, job.src, job.dst, device, src, timeout=120.0))
            res["switch_alloc"].append(seconds)
            if rep == 0:
                res["errors"] += [f"switch: {e}" for e in _mismatches(dst, want)]
            del dst
            given = _touched(job.dst, dst_rank)
            seconds, (dst, report) = _timed(
                lambda: switch(plan, job.src, job.dst, device, src, timeout=120.0,
                               dst_store=given), res["switch_cpu"])
            res["switch"].append(seconds)
            if rep == 0:
                res["errors"] += [f"switch into dst_store: {e}" for e in _mismatches(dst, want)]
                res["report"] = {k: v for k, v in report.items() if k != "per_round"}
            del dst, given
            given = _touched(job.dst, dst_rank)
            ahead = prepare_exchange(plan, job.src, job.dst, device, src, given)
            res["prepare"].append(ahead.seconds)
            seconds, (dst, report) = _timed(
                lambda: switch(plan, job.src, job.dst, device, src, timeout=120.0,
                               dst_store=given, prepared=ahead), res["switch_prepared_cpu"])
            res["switch_prepared"].append(seconds)
            if not report["prepared_ahead"]:
                res["errors"].append(f"the exchange made ahead was not used: "
                                     f"{report['prepared_why']}")
            if rep == 0:
                res["errors"] += [f"prepared switch: {e}" for e in _mismatches(dst, want)]
            del dst, given, ahead
            given = _touched(job.dst, dst_rank)
            seconds, (dst, report) = _timed(
                lambda: switch(plan, job.src, job.dst, device, src, timeout=120.0,
                               dst_store=given, check_transfers=True))
            res["switch_checked"].append(seconds); res.setdefault("chk", []).append((report["check_seconds"], report["check_beside_seconds"], report["total_seconds"]))
            if rep == 0:
                res["errors"] += [f"checked switch: {e}" for e in _mismatches(dst, want)]
            del dst, given
        _dcp_once(job, src, src_rank, dst_rank)  # warm, untimed, as raw p2p is: the first
        # save and load pay DCP's one-time setup (measured: up to twice as slow)
        for rep in range(max(1, job.repeats // 2)):
            save_s, load_s, dst, size = _dcp_once(job, src, src_rank, dst_rank)
            res["dcp_save"].append(save_s)
            res["dcp_load"].append(load_s)
            if rep == 0:
                res["errors"] += [f"dcp: {e}" for e in _mismatches(dst, want)]
                res["dcp_checkpoint_bytes"] = size
            del dst
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 — reported to the parent
        res["errors"].append(f"{device} crashed:\n{traceback.format_exc()}")
    (job.out / f"result{idx}.json").write_text(json.dumps(res), encoding="utf-8")


# ---- the parent -----------------------------------------------------------------------------

def _megatron_available() -> tuple[bool, str]:
    try:
        sys.path.insert(0, str(ROOT / "tests"))
        import megatron.core.dist_checkpointing  # noqa: F401
        import megatron_support.live  # noqa: F401  (megatron is imported before the fork)
    except Exception as err:  # noqa: BLE001
        return False, f"megatron-core or its test harness does not import ({type(err).__name__}: " \
                      f"{str(err).splitlines()[0][:200]})"
    return True, ""


def run_case(name: str, budget: int, repeats: int) -> dict[str, Any]:
    """Plan one case, fork its processes, gather and reduce their measurements."""
    src_par, dst_par = CASES[name]
    sv, dv = transition_views(Layout(spec_from_dict(_spec(_label(src_par), **src_par))),
                              Layout(spec_from_dict(_spec(_label(dst_par), **dst_par))))
    plan = plan_transition(sv.layout, dv.layout, budget)
    tensors = random_global(sv, SEED)
    devices = process_devices(plan)
    with tempfile.TemporaryDirectory(prefix="dynatrain-bench-") as out, \
            tempfile.TemporaryDirectory(prefix="dynatrain-ckpt-", dir="/dev/shm") as ckpt:
        job = Job(name, plan, sv, dv, devices, tensors, Path(out), Path(ckpt), repeats)
        t0 = time.perf_counter()
        ctx = tmp.start_processes(_worker, args=(job,), nprocs=len(devices), join=False,
                                  start_method="fork")
        try:
            while not ctx.join(timeout=0.5):
                if time.perf_counter() - t0 > 1800:
                    raise SystemExit(f"{name}: workers did not finish in 30 minutes")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = [json.loads((Path(out) / f"result{i}.json").read_text(encoding="utf-8"))
                   for i in range(len(devices))]
    errors = [e for r in results for e in r["errors"]]
    if errors:
        raise SystemExit(f"{name}: " + "\n".join(errors))
    return _reduce(name, plan, results)


def _per_repeat(results: list[dict], field: str) -> list[float]:
    """Wall seconds per repeat: the slowest process (they are barrier to barrier anyway)."""
    return [max(vals) for vals in zip(*(r[field] for r in results))]


def _reduce(name: str, plan: Plan, results: list[dict]) -> dict[str, Any]:
    for r in results: print("CHK", r["device"], [tuple(round(v, 3) for v in x) for x in r["chk"]])
    moved = plan.stats["bytes_moved"]
    sent = sum(r["report"]["bytes_sent"] for r in results)
    if sent != moved:
        raise SystemExit(f"{name}: the switch sent {sent} bytes, the plan moves {moved}")
    raw_sr = _per_repeat(results, "raw_sendrecv")
    raw_b = _per_repeat(results, "raw_batch")
    sw = _per_repeat(results, "switch")
    sw_alloc = _per_repeat(results, "switch_alloc")
    sw_checked = _per_repeat(results, "switch_checked")
    sw_prep = _per_repeat(results, "switch_prepared")
    raw_local = _per_repeat(results, "raw_local")
    dcp_save, dcp_load = _per_repeat(results, "dcp_save"), _per_repeat(results, "dcp_load")
    dcp = [a + b for a, b in zip(dcp_save, dcp_load)]
    # CPU seconds per repeat, summed over the processes: on a host with fewer cores than
    # processes the wall time follows the CPU work, so this says where the time goes.
    raw_cpu = [sum(v) for v in zip(*(r["raw_batch_cpu"] for r in results))]
    sw_cpu = [sum(v) for v in zip(*(r["switch_cpu"] for r in results))]
    prep_cpu = [sum(v) for v in zip(*(r["switch_prepared_cpu"] for r in results))]
    cores = os.cpu_count() or 1
    raw_best = min(min(raw_sr), min(raw_b))
    predicted = predicted_downtime(plan, PRESETS["gloo-local"])
    predicted_alloc = predicted_downtime(plan, PRESETS["gloo-local"], allocates=True)
    reports = [r["report"] for r in results]
    raw_med = statistics.median(min(a, b) for a, b in zip(raw_sr, raw_b))
    return {
        "case": name, "src": plan.src_name, "dst": plan.dst_name,
        "processes": len(results), "rounds": len(plan.rounds),
        "messages": sum(1 for m in plan.messages() if not m.local),
        "bytes_moved": moved, "bytes_local": plan.stats["bytes_local"],
        "state_bytes_src": sum(r["src_bytes"] for r in results),
        "state_bytes_dst": sum(r["dst_bytes"] for r in results),
        "raw_sendrecv_seconds": raw_sr, "raw_batch_seconds": raw_b,
        "switch_seconds": sw, "switch_alloc_seconds": sw_alloc,
        "raw_sendrecv_GBps": moved / min(raw_sr) / 1e9,
        "raw_batch_GBps": moved / min(raw_b) / 1e9,
        "raw_p2p_GBps": moved / raw_best / 1e9,
        "raw_p2p_method": "send/recv" if min(raw_sr) <= min(raw_b) else "batch_isend_irecv",
        "switch_GBps": moved / min(sw) / 1e9,
        "switch_alloc_GBps": moved / min(sw_alloc) / 1e9,
        "switch_vs_raw_p2p_ratio": raw_best / min(sw),
        "switch_vs_raw_p2p_median_ratio": raw_med / statistics.median(sw),
        "switch_alloc_vs_raw_p2p_ratio": raw_best / min(sw_alloc),
        # Made ahead (prepare_exchange, as a live switch's build ahead does): the call runs
        # the rounds and the vote only.
        "switch_prepared_seconds": sw_prep,
        "switch_prepared_GBps": moved / min(sw_prep) / 1e9,
        "switch_prepared_vs_raw_p2p_ratio": raw_best / min(sw_prep),
        "switch_prepared_vs_raw_p2p_median_ratio": raw_med / statistics.median(sw_prep),
        "switch_prepared_cpu_seconds": prep_cpu,
        # Against the least work the plan asks: raw p2p plus each round's local bytes copied.
        "raw_local_seconds": raw_local,
        "switch_prepared_vs_raw_local_ratio": min(raw_local) / min(sw_prep),
        "switch_prepared_vs_raw_cpu_ratio": (statistics.median(prep_cpu)
                                             / statistics.median(raw_cpu)),
        "prepare_seconds": max(max(r["prepare"]) for r in results),
        "switch_checked_seconds": sw_checked,
        # check_transfers: fingerprints of every transfer at both ends before the vote
        "check_transfers_cost_ratio": min(sw_checked) / min(sw),
        "raw_batch_cpu_seconds": raw_cpu, "switch_cpu_seconds": sw_cpu,
        "switch_vs_raw_cpu_ratio": statistics.median(sw_cpu) / statistics.median(raw_cpu),
        "raw_batch_cores_busy": statistics.median(c / w / cores for c, w in zip(raw_cpu, raw_b)),
        "switch_cores_busy": statistics.median(c / w / cores for c, w in zip(sw_cpu, sw)),
        "dcp_save_seconds": dcp_save, "dcp_load_seconds": dcp_load,
        "dcp_seconds": min(dcp), "dcp_checkpoint_bytes": results[0].get("dcp_checkpoint_bytes"),
        "speedup_vs_dcp": min(dcp) / min(sw),
        # The most any gloo-based switch could gain over DCP here: DCP's seconds over raw p2p's.
        "dcp_vs_raw_p2p_ratio": min(dcp) / raw_best,
        "speedup_alloc_vs_dcp": min(dcp) / min(sw_alloc),
        "peak_staging_bytes": max(r["report"]["peak_staging_bytes"] for r in results),
        "planned_peak_staging_bytes": plan.stats["peak_staging_bytes"],
        "budget_bytes": plan.budget_bytes,
        "switch_report_process0": results[0]["report"],
        # Predicted (gloo-local preset) against measured downtime: into preallocated storage
        # against the best switch into dst_store; allocating against the process's first
        # allocating switch (its destination's pages are new; later ones reuse freed memory,
        # and the calibration's switches are all such first ones). The measured fixed part as
        # the calibration takes it: slowest setup, fastest vote.
        "predicted_downtime": predicted.as_dict(),
        "predicted_over_measured": predicted.total_seconds / min(sw),
        "predicted_over_measured_median": predicted.total_seconds / statistics.median(sw),
        "predicted_allocating_downtime": predicted_alloc.as_dict(),
        "predicted_over_first": predicted_alloc.total_seconds / sw_alloc[0],
        "measured_fixed_seconds": (max(r["setup_seconds"] for r in reports)
                                   + min(r["vote_seconds"] for r in reports)),
    }


def environment() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    return dict(python=sys.version.split()[0], torch=torch.__version__, cpus=os.cpu_count(),
                loadavg_at_start=os.getloadavg(), machine=platform.platform(), git=commit)


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'case':<19} {'moved':>7} {'rnd':>3} {'raw s/r':>7} {'raw bat':>7} {'switch':>7} "
            f"{'ratio':>5} {'alloc':>5} {'ahead':>5} {'switch s':>8} {'DCP s':>6} {'x DCP':>6} "
            f"{'mcore s':>7} {'live s':>6} {'x mcore':>7} {'staging/budget':>15} "
            f"{'alloc s':>7} {'pred s':>6} {'fixed':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mc = (f"{r['megatron_seconds']:7.2f} {r['live_seconds']:6.2f} "
              f"{r['speedup_vs_megatron']:6.1f}x" if "megatron_seconds" in r
              else f"{'-':>7} {'-':>6} {'-':>7}")
        lines.append(
            f"{r['case']:<19} {r['bytes_moved'] / MIB:4.0f}MiB {r['rounds']:>3} "
            f"{r['raw_sendrecv_GBps']:5.2f}GB {r['raw_batch_GBps']:5.2f}GB "
            f"{r['switch_GBps']:5.2f}GB {r['switch_vs_raw_p2p_ratio']:4.2f}x "
            f"{r['switch_alloc_vs_raw_p2p_ratio']:4.2f}x "
            f"{r['switch_prepared_vs_raw_p2p_ratio']:4.2f}x {min(r['switch_seconds']):8.3f} "
            f"{r['dcp_seconds']:6.2f} {r['speedup_vs_dcp']:5.1f}x {mc} "
            f"{r['peak_staging_bytes'] / MIB:5.1f}/{r['budget_bytes'] / MIB:.0f}MiB "
            f"{min(r['switch_alloc_seconds']):7.3f} "
            f"{r['predicted_downtime']['total_seconds']:6.3f} "
            f"{r['measured_fixed_seconds']:.3f}/{r['predicted_downtime']['fixed_seconds']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="one case, 3 repeats, no megatron (about 30 s)")
    ap.add_argument("--budget", default=64 * MIB, type=int,
                    help="staging budget per device in bytes (default 64 MiB)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats of raw and switch (5)")
    ap.add_argument("--no-megatron", action="store_true", help="skip the megatron-core part")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON file ({DEFAULT_OUT})")
    args = ap.parse_args(argv)
    names = QUICK_CASES if args.quick else tuple(CASES)
    repeats = 3 if args.quick else args.repeats
    megatron, why = (False, "--quick or --no-megatron") if (
        args.quick or args.no_megatron) else _megatron_available()
    if not megatron:
        print(f"megatron-core part skipped: {why}")

    t0 = time.perf_counter()
    result: dict[str, Any] = {"environment": environment(), "repeats": repeats}
    rows = [run_case(n, args.budget, repeats) for n in names]
    if megatron:  # after the plain cases: their processes are gone, megatron's start clean
        for row in rows:
            row.update(_megatron_live(row["case"], args.budget))
    result["cases"] = rows
    # Headline: the worst case of each figure.
    result["switch_vs_raw_p2p_ratio"] = min(r["switch_vs_raw_p2p_ratio"] for r in rows)
    result["switch_alloc_vs_raw_p2p_ratio"] = min(r["switch_alloc_vs_raw_p2p_ratio"]
                                                  for r in rows)
    result["switch_prepared_vs_raw_p2p_ratio"] = min(r["switch_prepared_vs_raw_p2p_ratio"]
                                                     for r in rows)
    result["speedup_vs_dcp"] = min(r["speedup_vs_dcp"] for r in rows)
    result["peak_staging_bytes"] = max(r["peak_staging_bytes"] for r in rows)
    result["budget_bytes"] = args.budget
    result["raw_p2p_GBps"] = min(r["raw_p2p_GBps"] for r in rows)
    result["switch_GBps"] = min(r["switch_GBps"] for r in rows)
    if megatron:
        result["speedup_vs_megatron"] = min(r["speedup_vs_megatron"] for r in rows)
    else:
        result["megatron_skipped"] = why
    result["wall_seconds"] = time.perf_counter() - t0
    result["environment"]["loadavg_at_end"] = os.getloadavg()
    print(_table(rows))
    print(f"worst case: switch {result['switch_vs_raw_p2p_ratio']:.2f}x raw p2p "
          f"({result['switch_prepared_vs_raw_p2p_ratio']:.2f}x made ahead, "
          f"{result['switch_alloc_vs_raw_p2p_ratio']:.2f}x allocating its destination), "
          f"{result['speedup_vs_dcp']:.1f}x faster than DCP (raw p2p: "
          f"{min(r['dcp_vs_raw_p2p_ratio'] for r in rows):.1f}x)"
          + (f", {result['speedup_vs_megatron']:.1f}x faster than megatron dist-ckpt"
             if megatron else "")
          + f"; staging {result['peak_staging_bytes'] / MIB:.1f} MiB of "
          f"{args.budget / MIB:.0f} MiB; wall {result['wall_seconds']:.0f} s, load "
          f"{os.getloadavg()[0]:.2f}")
    for r in rows:
        print(f"{r['case']}: the switch used {r['switch_vs_raw_cpu_ratio']:.2f}x the CPU time "
              f"of raw p2p (medians; made ahead {r['switch_prepared_vs_raw_cpu_ratio']:.2f}x, "
              f"making it took {r['prepare_seconds'] * 1e3:.0f} ms at most; made ahead, it ran at "
              f"{r['switch_prepared_vs_raw_local_ratio']:.2f}x raw p2p plus the plan's local "
              f"copies); the cores were {r['raw_batch_cores_busy']:.0%} busy "
              f"during raw p2p, {r['switch_cores_busy']:.0%} during the switch; with "
              f"check_transfers the switch took {r['check_transfers_cost_ratio']:.1f}x as long; "
              f"predicted / measured downtime {r['predicted_over_measured']:.2f} (into "
              f"preallocated storage, best), {r['predicted_over_first']:.2f} (the first switch "
              f"allocating its destination, {r['switch_alloc_seconds'][0]:.3f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
