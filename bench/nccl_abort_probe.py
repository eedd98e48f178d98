"""Does DynaTrain's watchdog release a collective that waits on a peer that never answers? (NCCL)

    python bench/nccl_abort_probe.py             # on a machine with a CUDA GPU (~1 minute)
    python bench/nccl_abort_probe.py --out FILE  # JSON elsewhere (default bench/results/)

One GPU cannot host two NCCL ranks, so the dead peer of a running collective cannot be staged
here. What one GPU can stage is the other way a peer goes missing: after a switch or a
recovery every process forms new groups, and NCCL creates a group's communicator at its first
collective; a peer that died in between leaves the others blocked in the communicator's
creation. Each case runs in its own process: rank 0 of a two-rank NCCL group (rank 1 never
comes) enters an all-reduce; DynaTrain's ``Watchdog`` declares the missing device stale after
``--abort-at`` seconds and calls ``abort_all_groups`` (torch's ``_abort_process_group``); or,
without the watchdog, the group's own timeout is short. The case reports whether the
all-reduce came back, raising, and how long after the abort (or its start), or that it was
still blocked when the case was killed (``--limit`` seconds).

Cases: torch's default (blocking communicator creation) and non-blocking creation
(``TORCH_NCCL_USE_COMM_NONBLOCKING=1``, NCCL's ``config.blocking = 0``), each with the
watchdog's abort and with a 5 s group timeout instead.
Exit status: 0 the probe ran (whatever it found), 1 a case failed to run, 2 no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_checks import _pythonpath  # noqa: E402  (this checkout first, then carried packages)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "nccl_abort_probe.json"
NONBLOCKING = {"TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}
# name -> (environment, abort by the watchdog, the group's timeout in seconds)
CASES = {
    "blocking creation (torch's default), watchdog abort": ({}, True, 600),
    "non-blocking creation, watchdog abort": (NONBLOCKING, True, 600),
    "blocking creation, group timeout 5 s, no abort": ({}, False, 5),
    "non-blocking creation, group timeout 5 s, no abort": (NONBLOCKING, False, 5),
}

CASE = """
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from dynatrain.runtime.megatron.watchdog import Watchdog
torch.cuda.set_device(0)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=2,
                        timeout=datetime.timedelta(seconds={timeout}))
t0 = time.monotonic()
print(json.dumps({{"event": "entering"}}), flush=True)
wd = Watchdog(lambda: ["node0:gpu0", "node0:gpu1"] if {abort} else [],
              lambda devices: {{"node0:gpu1"}} if time.monotonic() - t0 > {abort_at} else set(),
              poll=0.1)
x = torch.ones(1, device="cuda")
try:
    dist.all_reduce(x)
    torch.cuda.synchronize()
    outcome = "completed"
except Exception as err:  # what a released collective raises
    outcome = f"raised {{type(err).__name__}}: {{str(err).splitlines()[0][:200]}}"
done = time.monotonic()
fired = wd.fired[1] if wd.fired else None
print(json.dumps({{"event": "returned", "outcome": outcome, "after_start_s": done - t0,
                  "after_abort_s": None if fired is None else done - fired}}), flush=True)
os._exit(0)  # destructors of an aborted group may block
"""


def run_case(env: dict[str, str], abort: bool, timeout: float, abort_at: float,
             limit: float) -> dict:
    t0 = time.perf_counter()
    code = CASE.format(abort=abort, abort_at=abort_at, timeout=timeout)
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                              capture_output=True, text=True, timeout=limit,
                              env=dict(os.environ, PYTHONPATH=_pythonpath(), **env))
        out, err, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        code = None
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    returned = [e for e in events if e["event"] == "returned"]
    case = {"env": env, "abort": abort, "group_timeout_s": timeout,
            "seconds": time.perf_counter() - t0}
    if returned:
        case.update(released=True, outcome=returned[0]["outcome"],
                    after_abort_s=returned[0]["after_abort_s"],
                    after_start_s=returned[0]["after_start_s"])
    elif events:  # it entered the all-reduce and never came back
        case.update(released=False, outcome=f"still blocked when killed after {limit:.0f} s"
                    if code is None else f"exit status {code}", stderr=err[-1500:])
    else:
        case.update(released=None, outcome=f"did not run (exit status {code})",
                    stderr=err[-1500:])
    return case


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--abort-at", type=float, default=2.0, help="seconds until the abort (2)")
    ap.add_argument("--limit", type=float, default=25.0, help="seconds a case may take (25)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON file ({DEFAULT_OUT})")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("nccl_abort_probe: this machine has no CUDA device", file=sys.stderr)
        return 2
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())),
           "python": platform.python_version(), "abort_at_s": args.abort_at,
           "limit_s": args.limit, "cases": {}}
    for name, (env, abort, timeout) in CASES.items():
        doc["cases"][name] = case = run_case(env, abort, timeout, args.abort_at, args.limit)
        after, start = case.get("after_abort_s"), case.get("after_start_s")
        print(f"{name}: {case['outcome']}"
              + (f" ({after:.2f} s after the abort)" if after is not None else
                 f" ({start:.2f} s after it entered)" if start is not None else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 1 if any(c["released"] is None for c in doc["cases"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
