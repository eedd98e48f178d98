"""Every check that needs a GPU, in one command, with one JSON of what it found.

    python bench/gpu_checks.py                 # on a machine with one CUDA GPU (~5 minutes)
    python bench/gpu_checks.py --out FILE      # JSON elsewhere (default bench/results/)
    python bench/gpu_checks.py --only one_device_switch   # some checks alone

The CPU machines this project is developed on have no GPU, so these are the only runs of the
CUDA code paths; a GPU machine runs this script and the documentation's GPU figures come from
its JSON (``docs/benchmarks.md`` says "not measured" for what it has not measured). It runs,
each as its own process with a time limit:

- tests that skip without CUDA: the one-process NCCL switch with its copy-table kernels
  (local copies through Triton, ``check_transfers``), and the Triton fingerprint against the
  torch path on the same bytes;
- ``pack_bench.py --device cuda --case 70b``: packing and unpacking through the copy tables;
- ``fingerprint_bench.py --device cuda``: the fingerprint kernel's bandwidth against a copy;
- the CUDA allocator's figures a switch's and a build ahead's memory checks read (a test);
- ``one_device_switch.py --device cuda``: a megatron-core job on CUDA switched live twice over
  NCCL (one refused build ahead, one built ahead), bit for bit against megatron's own view,
  then trained on with the losses of a run that never switched;
- ``nccl_abort_probe.py``: whether the watchdog's abort releases a collective waiting on an
  NCCL peer that never came (torch's blocking and non-blocking communicator creation).

What one GPU cannot check is listed in the JSON under ``not_checkable`` with the reason: a
switch between two NCCL ranks (one GPU cannot host two NCCL ranks), the watchdog releasing a
collective whose peer died on a formed communicator, and NCCL groups made ahead of a switch.
The GPU machine needs megatron-core and pydantic beside torch and Triton (``pip install -e .``). Without a CUDA device
every check is reported as not run, with that reason, and the exit status is 0.

Exit status: 0 every check that ran passed, 1 a check failed or ran past its time limit, 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "gpu_checks.json"
TESTS = (  # node ids of the tests that skip without CUDA
    "tests/test_copytable.py::test_one_process_cuda_switch_copies_locally_bit_exact",
    "tests/test_fingerprint.py::test_cpu_and_cuda_agree",
    "tests/test_headroom.py::test_cuda_free_bytes_and_job_reserve_follow_real_allocations",
)
BENCHES = {  # name -> (arguments before --out, seconds allowed)
    "pack_bench": (["--device", "cuda", "--case", "70b"], 240),
    "fingerprint_bench": (["--device", "cuda"], 180),
    "one_device_switch": (["--device", "cuda"], 240),
    "nccl_abort_probe": ([], 150),  # four cases of at most 25 s each
}
NOT_CHECKABLE = {
    "two-rank NCCL switch": "one GPU cannot host two NCCL ranks",
    "watchdog releasing a collective of a formed NCCL communicator whose peer died":
        "needs a second NCCL rank (nccl_abort_probe stages a peer that never came instead)",
    "NCCL groups made ahead of a switch": "groups ahead are gloo-only; NCCL needs two ranks",
}


def _pythonpath() -> str:
    """This checkout first, then whatever the caller's PYTHONPATH holds (carried packages)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def _run(argv: list[str], timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, PYTHONPATH=_pythonpath()))
    except subprocess.TimeoutExpired:
        return {"status": "failed", "why": f"ran past its limit of {timeout:.0f} s",
                "seconds": time.perf_counter() - t0}
    out = {"status": "passed" if done.returncode == 0 else "failed",
           "seconds": time.perf_counter() - t0}
    if done.returncode:
        out["why"] = f"exit status {done.returncode}: {(done.stdout + done.stderr)[-2000:]}"
    return out


def _test(node: str, tmp: Path) -> dict:
    report = tmp / "junit.xml"
    r = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
              f"--junitxml={report}", node], 300)
    if r["status"] == "passed":  # a skip is not a pass: read what pytest did with it
        import xml.etree.ElementTree as ET  # our own pytest's report

        cases = ET.parse(report).getroot().iter("testcase")
        if any(c.find("skipped") is not None for c in cases):
            r.update(status="failed", why="skipped on a machine with a CUDA device")
    return {"name": node, "kind": "test", **r}


def _bench(name: str, tmp: Path) -> dict:
    args, limit = BENCHES[name]
    out = tmp / f"{name}.json"
    r = _run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *args, "--out", str(out)],
             limit)
    if r["status"] == "passed":
        r["result"] = json.loads(out.read_text())
    return {"name": name, "kind": "bench", **r}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON file ({DEFAULT_OUT})")
    ap.add_argument("--only", nargs="+", metavar="CHECK",
                    help="run these checks alone (test node ids or bench names, as listed)")
    args = ap.parse_args(argv)
    every = [*TESTS, *BENCHES]
    unknown = sorted(set(args.only or ()) - set(every))
    if unknown:
        print(f"--only: {unknown[0]} is no check of this script (one of: {', '.join(every)})",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    doc: dict = {"device": torch.cuda.get_device_name(0) if cuda else None,
                 "torch": torch.__version__, "python": platform.python_version(),
                 "checks": [], "not_checkable": dict(NOT_CHECKABLE)}
    names = [n for n in every if not args.only or n in args.only]
    if not cuda:
        doc["checks"] = [{"name": n, "kind": "test" if n in TESTS else "bench",
                          "status": "not run", "why": "no CUDA device"} for n in names]
    else:
        with tempfile.TemporaryDirectory(prefix="gpu_checks_") as tmp:
            for name in names:
                doc["checks"].append(_test(name, Path(tmp)) if name in TESTS
                                     else _bench(name, Path(tmp)))
    doc["wall_seconds"] = time.perf_counter() - t0
    for c in doc["checks"]:
        tail = f" ({c['seconds']:.1f} s)" if "seconds" in c else f": {c['why']}"
        print(f"{c['status']:>8}  {c['name']}{tail}")
    for what, why in NOT_CHECKABLE.items():
        print(f"not checkable on one GPU: {what} ({why})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 1 if any(c["status"] == "failed" for c in doc["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
