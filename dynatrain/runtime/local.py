"""Run a plan's switch on this machine: one CPU process per device, gloo, random state.

``run_local`` forks one process per device of the switch (``process_devices(plan)``; fork is
~0.2 s where spawn re-imports torch for seconds). Every process draws the same global tensors
from ``seed`` (with Megatron's invariant param == cast(main_param) when the plan derives the
params), builds the storage of its source rank from them, runs ``switch``, and compares the
destination storage byte for byte with the storage built directly from the same tensors for
its destination rank. Processes meet through a file store in a temporary directory (no
network port) and report through JSON files (no pickles). Process 0 logs each round to the
``dynatrain.runtime`` logger when ``progress`` is set.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from ..ir.errors import DynatrainError
from ..ir.state import StateView
from ..planner.plan import Plan
from .executor import SwitchAborted, process_devices, switch
from .storage import fill_from_global, random_global, storage_bytes, torch_dtype


@dataclass(frozen=True)
class _Job:
    """What a forked process needs; inherited through fork, never pickled."""

    plan: Plan
    src: StateView
    dst: StateView
    devices: tuple[str, ...]
    out: Path
    seed: int
    timeout: float
    progress: bool
    check_transfers: bool


def global_state(view: StateView, seed: int, derived: bool) -> dict:
    """The random global tensors a local run starts from (the same in every process)."""
    tensors = random_global(view, seed)
    if derived:  # at a step boundary Megatron's params are the cast of its main params
        pdtype = torch_dtype(view.kinds["param"])
        for key, kind in list(tensors):
            if kind == "param":
                tensors[(key, kind)] = tensors[(key, "main_param")].to(pdtype)
    return tensors


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _worker(idx: int, job: _Job) -> None:
    torch.set_num_threads(1)  # one process per device on a few cores
    device = job.devices[idx]
    res: dict = {"device": device, "errors": [], "checked": 0}
    try:
        if job.progress and idx == 0:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("  %(message)s"))
            log = logging.getLogger("dynatrain.runtime")
            log.addHandler(handler)
            log.setLevel(logging.INFO)
        dist.init_process_group("gloo", init_method=f"file://{job.out}/store", rank=idx,
                                world_size=len(job.devices),
                                timeout=datetime.timedelta(seconds=job.timeout))
        plan = job.plan
        tensors = global_state(job.src, job.seed, bool(plan.derived))
        src = None
        if device in plan.src_devices:
            src = fill_from_global(job.src, plan.src_devices.index(device), tensors)
        dist.barrier()
        t0 = time.perf_counter()
        dst, report = switch(plan, job.src, job.dst, device, src, timeout=job.timeout,
                             check_transfers=job.check_transfers)
        dist.barrier()
        res["seconds"] = time.perf_counter() - t0
        res["report"] = {k: v for k, v in report.items() if k != "per_round"}
        if device in plan.dst_devices:
            rank = plan.dst_devices.index(device)
            want = fill_from_global(job.dst, rank, tensors)
            if dst is None or dst.keys() != want.keys():
                res["errors"].append(f"{device}: destination rank {rank} has other tensors "
                                     "than its layout")
            else:
                for k, w in want.items():
                    g = dst[k]
                    if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(
                            _bits(g), _bits(w)):
                        res["errors"].append(f"{device}: destination rank {rank}: {k} differs")
                res["checked"] = len(want)
                res["dst_bytes"] = storage_bytes(dst)
        dist.destroy_process_group()
    except SwitchAborted as err:
        res["errors"].append(str(err))
    except BaseException:  # noqa: BLE001 — reported to the parent
        res["errors"].append(f"{device} crashed:\n{traceback.format_exc()}")
    (job.out / f"result{idx}.json").write_text(json.dumps(res), encoding="utf-8")


def run_local(plan: Plan, src: StateView, dst: StateView, *, seed: int = 0,
              timeout: float = 60.0, progress: bool = False,
              check_transfers: bool = False) -> list[dict]:
    """Run ``plan`` in one local process per device; each process's result, in device order.

    A result holds ``device``, ``errors`` (empty when its destination is bit-exact and the
    switch committed), ``checked`` (destination tensors compared), ``seconds`` (the switch,
    barrier to barrier) and ``report`` (``SwitchReport.as_dict`` without its per-round list).

    Raises:
        DynatrainError: the processes did not all finish within the time they may need.
    """
    devices = process_devices(plan)
    with tempfile.TemporaryDirectory(prefix="dynatrain-run-") as tmpdir:
        job = _Job(plan, src, dst, devices, Path(tmpdir), seed, timeout, progress,
                   check_transfers)
        ctx = tmp.start_processes(_worker, args=(job,), nprocs=len(devices), join=False,
                                  start_method="fork")
        # Every wait of the switch may take ``timeout``: rounds, derive, vote, plus setup.
        limit = timeout * (len(plan.rounds) + 4) + 120
        deadline = time.monotonic() + limit
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise DynatrainError(f"run-plan: the local processes did not finish "
                                         f"within {limit:.0f} s")
        except tmp.ProcessRaisedException as err:  # a worker died outside its own handler
            raise DynatrainError(f"run-plan: a local process failed: "
                                 f"{str(err).strip().splitlines()[-1]}") from None
        except tmp.ProcessExitedException as err:
            raise DynatrainError(f"run-plan: a local process exited: {err}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for i, d in enumerate(devices):
            path = job.out / f"result{i}.json"
            if not path.exists():
                results.append({"device": d, "errors": [f"{d}: reported nothing"], "checked": 0})
            else:
                results.append(json.loads(path.read_text(encoding="utf-8")))
    return results
