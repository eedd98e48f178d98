"""A live switch of a real megatron-core job on one device, checked against megatron's own view.

    python bench/one_device_switch.py                  # CUDA if there is a GPU, else CPU (gloo)
    python bench/one_device_switch.py --device cpu     # CPU under the CPU shim, even with a GPU
    python bench/one_device_switch.py --out FILE       # JSON elsewhere (default bench/results/)

One process (NCCL on a GPU, gloo on the CPU) trains ``examples/live_switch_gpt.py``'s MoE model
(``--model dense``: the dense one) and switches twice, from the distributed optimizer to
megatron's non-distributed one and back: the only layout change one device allows, and one
that moves every optimizer byte between megatron's bucket space and its per-parameter state.

* Switch 1 is prepared with a reserve for training larger than the device (``reserve_bytes``):
  on a GPU ``build_ahead`` must refuse, saying the destination and the reserve do not fit in
  what is free, and the switch builds its job itself; on the CPU, which is not checked, it is
  built ahead.
* Switch 2 keeps the default reserve (the CUDA allocator's peak above what the job holds at the
  boundary): built ahead.

Each switch is checked against megatron itself: megatron's own ``sharded_state_dict`` of the
switched job (model and fully reshardable optimizer, as whole tensors, every element covered;
the optimizer steps) must equal the source job's at the boundary bit for bit, the main params'
key renamed (the two optimizers name it differently). The iteration, samples and scheduler
state must be carried, and a build ahead must leave torch's RNG streams as they were. The
switched job trains on, and the run's losses must equal, bit for bit, those of a fresh job of
the first layout trained as long without switching (on a GPU with deterministic kernels). The
table gives each switch's downtime by phase (this process's; one process has nobody to wait
for).

On a GPU it is one of ``bench/gpu_checks.py``'s checks (the CUDA allocator's free-memory check
of a build ahead, megatron on CUDA, the exchange over NCCL); on the CPU the test suite runs it.
Exit status: 0 every check held, 1 one did not (one line says which), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
# The run is compared bit for bit with one that never switched, so its kernels must give one
# answer. On CPUs with AMX or AVX512-BF16, oneDNN's bf16 kernels make megatron's distributed
# and non-distributed optimizers part ways from the third step with the same state (two runs
# that never switched, one per optimizer, measured on a Xeon with amx_bf16: iteration 6's loss
# 6.235421776771545 against 6.23546838760376); capped at AVX2 they agree. Read once, when
# oneDNN starts: before torch is imported. (On a GPU the run sets deterministic kernels.)
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import live_switch_gpt as example  # noqa: E402  (its models, spec(), quiet_library_warnings)
import mcore_job  # noqa: E402

from dynatrain.runtime.megatron import LiveSwitcher, Rendezvous, cpu, parallel_kwargs  # noqa: E402
from dynatrain.verify.check import check  # noqa: E402

DEFAULT_OUT = HERE / "results" / "one_device_switch.json"
DEVICE = "node0:gpu0"
GLOBAL_BATCH, SEQ = 4, 16
ITERATIONS = 2  # trained before the first switch, between the switches, and after the second
TOO_LARGE = 1 << 50  # a reserve no device has (1 PiB)
# Megatron's checkpoint keys of a main (fp32) parameter: the distributed optimizer's fully
# reshardable format and the non-distributed optimizer name them differently (its
# fully_sharded_model_space format, which shares the latter's name, cannot be saved in
# megatron-core 0.19.2: "ShardedTensor.flattened_range is not supported").
MAIN_PARAM = {True: "optimizer.state.param.", False: "optimizer.state.fp32_param."}


class Mismatch(AssertionError):
    """The switched job differs from what megatron or the run without switches says."""


def megatron_view(job) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Megatron's ``sharded_state_dict`` of model and optimizer (fully reshardable) as whole
    tensors on the CPU by checkpoint key, and the optimizer steps it records. On one process
    every element must be covered, and a key held twice must hold the same bits."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    leaves: list[ShardedTensor] = []
    steps: set[float] = set()

    def walk(sd) -> None:
        if isinstance(sd, dict):
            for k, v in sd.items():
                if k in ("step", "common_step") and isinstance(v, (int, float, torch.Tensor)) \
                        and not isinstance(v, bool):
                    steps.add(float(v))
                else:
                    walk(v)
        elif isinstance(sd, (list, tuple)):
            for v in sd:
                walk(v)
        elif isinstance(sd, ShardedTensorFactory):
            walk(sd.build())
        elif isinstance(sd, ShardedTensor):
            leaves.append(sd)

    walk(mcore_job._sharded(job, loading=False))
    out: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for t in leaves:
        if t.key.endswith("_extra_state"):
            continue
        data = t.data.detach().to("cpu")
        if t.key not in out:
            out[t.key] = torch.zeros(t.global_shape, dtype=data.dtype)
            seen[t.key] = torch.zeros(t.global_shape, dtype=torch.bool)
        size = (1,) * t.prepend_axis_num + tuple(data.shape)
        box = tuple(slice(o, o + n) for o, n in zip(t.global_offset, size))
        data = data.reshape(size)
        if seen[t.key][box].any() and not _same_bits(out[t.key][box][seen[t.key][box]],
                                                     data[seen[t.key][box]]):
            raise Mismatch(f"{t.key}: two copies in one process differ")
        out[t.key][box] = data
        seen[t.key][box] = True
    for key, covered in seen.items():
        if not covered.all():
            raise Mismatch(f"{key}: {int((~covered).sum())} elements are in no shard")
    return out, sorted(steps)


def _rng_streams() -> list[torch.Tensor]:
    """torch's CPU stream and, on a GPU, its CUDA stream (a build reseeds both)."""
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state()]
                                      if torch.cuda.is_available() else [])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(ints), b.contiguous().view(ints)))


def compare(before: tuple, switched, rename, when: str) -> int:
    """Raise ``Mismatch`` unless the switched job's megatron view equals ``before`` (the
    source's, keys renamed to the destination's) bit for bit; the number of tensors."""
    (a, steps_a), (b, steps_b) = before, megatron_view(switched)
    a = {rename(k): v for k, v in a.items()}
    if set(a) != set(b):
        raise Mismatch(f"{when}: keys differ: {sorted(set(a) ^ set(b))[:4]}")
    differ = [k for k in a if not _same_bits(a[k], b[k])]
    if differ:
        raise Mismatch(f"{when}: {len(differ)} of {len(a)} tensors differ, e.g. {differ[0]}")
    if steps_a != steps_b:
        raise Mismatch(f"{when}: optimizer steps {steps_a} vs {steps_b}")
    return len(a)


def main_param_key(src, dst):
    """A checkpoint key of a ``src`` job as a ``dst`` job names it."""
    was = MAIN_PARAM[src.parallel.use_distributed_optimizer]
    now = MAIN_PARAM[dst.parallel.use_distributed_optimizer]
    return lambda key: now + key[len(was):] if key.startswith(was) else key


def one_switch(sw: LiveSwitcher, job, src, dst, reserve: int | None) -> tuple:
    """Prepare, build ahead, switch, check against megatron's view of the source; the
    switched job and this switch's record."""
    sw.reserve_bytes = reserve
    sw.prepare(dst).result()
    streams = _rng_streams()
    why = sw.build_ahead(job)  # None: built ahead, its exchange too; else why not
    if not all(torch.equal(x, y) for x, y in zip(streams, _rng_streams())):
        raise Mismatch("the build ahead left torch's RNG streams changed")
    before = megatron_view(job)
    carried = (job.iteration, job.consumed_samples, job.scheduler.state_dict())
    result = sw.switch(job)
    switched = result.job
    tensors = compare(before, switched, main_param_key(src, dst), "after the switch")
    now = (switched.iteration, switched.consumed_samples, switched.scheduler.state_dict())
    if now != carried:
        raise Mismatch(f"iteration, samples or scheduler not carried: {carried} vs {now}")
    return switched, {"built_ahead": bool(result.report.get("built_ahead")),
                      "exchange_made_ahead": bool(result.report.get("prepared_ahead")),
                      "why_not_ahead": why, "tensors_compared": tensors,
                      "downtime_s": result.seconds["downtime"], "phases_s": result.phases(),
                      "build_ahead_s": result.seconds.get("build_ahead")}


def _opt_name(spec) -> str:
    return "distributed optimizer" if spec.parallel.use_distributed_optimizer \
        else "non-distributed optimizer"


def run(model: str, device_kind: str, backend: str) -> dict:
    from megatron.core import parallel_state as ps

    m = example.MODELS[model]
    a = example.spec(m, "do", {}, 1)
    b = example.spec(m, "no-do", {"use_distributed_optimizer": False}, 1)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True,
                          timeout=datetime.timedelta(seconds=120))
    rdzv = Rendezvous(store, backend, prefix="one-device", timeout=120)
    ps.initialize_model_parallel(**parallel_kwargs(a), **mcore_job.init_kwargs())
    job = mcore_job.build_job(a)
    trainer = mcore_job.GlobalBatch(GLOBAL_BATCH, SEQ, example.BASE["vocab_size"])
    sw = LiveSwitcher(a, DEVICE, mcore_job.build_job, check, rendezvous=rdzv, timeout=120,
                      init_kwargs=mcore_job.init_kwargs())
    losses, switches = [], []
    for n, (src, dst, reserve) in enumerate(((a, b, TOO_LARGE), (b, a, None)), start=1):
        for _ in range(ITERATIONS):
            losses.append(trainer.step(job))
        job, record = one_switch(sw, job, src, dst, reserve)
        switches.append({"switch": n, "from": _opt_name(src), "to": _opt_name(dst),
                         "reserve": "1 PiB" if reserve else "default", **record})
    for _ in range(ITERATIONS):
        losses.append(trainer.step(job))
    sw.close()
    # The reference: a fresh job of the first layout (same seed) trained as long, never
    # switched, in a fresh parallel state of that layout.
    del job
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(**parallel_kwargs(a), **mcore_job.init_kwargs())
    ref = mcore_job.build_job(a)
    reference = [trainer.step(ref) for _ in losses]
    if reference != losses:
        raise Mismatch(f"losses {losses} vs never switched {reference}")
    cuda = device_kind == "cuda"
    for s in switches:  # what the device must have decided
        want_ahead = not (cuda and s["reserve"] == "1 PiB")
        if s["built_ahead"] != want_ahead:
            raise Mismatch(f"switch {s['switch']}: built ahead {s['built_ahead']}, expected "
                           f"{want_ahead} ({s['why_not_ahead']})")
        if not want_ahead and "do not fit" not in (s["why_not_ahead"] or ""):
            raise Mismatch(f"switch {s['switch']}: no reason why it was not built ahead")
        if want_ahead == ("build" in s["phases_s"]):
            raise Mismatch(f"switch {s['switch']}: phases {sorted(s['phases_s'])}")
        if s["built_ahead"] and not s["exchange_made_ahead"]:
            raise Mismatch(f"switch {s['switch']}: built ahead, its exchange not made then")
    return {"model": model, "iterations": len(losses), "losses": losses,
            "switches": switches}


def table(doc: dict) -> str:
    lines = [f"{doc['device_name']}: {doc['model']} model, one process ({doc['backend']}), "
             f"{doc['iterations']} iterations"]
    for s in doc["switches"]:
        ahead = ("built ahead, its exchange made ahead" if s["built_ahead"]
                 else f"built at the switch: {s['why_not_ahead']}")
        phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in s["phases_s"].items())
        lines.append(f"switch {s['switch']}: {s['from']} -> {s['to']}, {ahead}")
        lines.append(f"  downtime {s['downtime_s'] * 1e3:.1f} ms ({phases} ms); megatron's "
                     f"view equal to the source's bit for bit ({s['tensors_compared']} "
                     "tensors)")
    lines.append("losses " + " ".join(f"{x:.4f}" for x in doc["losses"])
                 + ": equal to a run that never switched, bit for bit")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="cuda where there is a GPU, else cpu")
    ap.add_argument("--model", choices=sorted(example.MODELS), default="moe")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON file ({DEFAULT_OUT})")
    args = ap.parse_args(argv)
    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        print("--device cuda: this machine has no CUDA device", file=sys.stderr)
        return 2
    example.quiet_library_warnings()
    if kind == "cuda":
        # Two runs give the same bits only with deterministic kernels (the MoE layers'
        # scatter-adds, cuBLAS's workspaces): the comparison with the run that never switched
        # needs them; the switch itself moves bytes either way.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    else:
        cpu.set_device(0)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    t0 = time.perf_counter()
    try:
        with cpu.cpu_shim(force=kind == "cpu"):
            doc = run(args.model, kind, "nccl" if kind == "cuda" else "gloo")
    except Mismatch as err:
        print(f"one_device_switch: {err}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()
    doc.update(device_name=torch.cuda.get_device_name(0) if kind == "cuda" else "CPU",
               backend="nccl" if kind == "cuda" else "gloo", torch=torch.__version__,
               python=platform.python_version(), wall_s=time.perf_counter() - t0)
    print(table(doc))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
