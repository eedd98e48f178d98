"""``bench/gpu_checks.py``, the one command for every GPU check: without CUDA it lists every
check as not run with the reason and exits 0; on a (simulated) CUDA machine a test that pytest
skipped counts as failed, a bench's JSON is kept, and a failed check gives exit status 1. The
tests it names exist and skip without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_checks as gc  # noqa: E402


def test_without_cuda_every_check_is_listed_as_not_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.json"
    assert gc.main(["--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["device"] is None
    assert [c["name"] for c in doc["checks"]] == [*gc.TESTS, *gc.BENCHES]
    assert all(c["status"] == "not run" and c["why"] == "no CUDA device" for c in doc["checks"])
    assert "two-rank NCCL switch" in doc["not_checkable"]


def test_on_cuda_a_skip_is_a_failure_and_bench_results_are_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "simulated GPU")

    def run(argv, timeout):
        if argv[1:3] == ["-m", "pytest"]:
            report = Path(next(a for a in argv if a.startswith("--junitxml="))[11:])
            skipped = "<skipped/>" if "fingerprint" in argv[-1] else ""
            report.write_text(f"<testsuites><testsuite><testcase name='t'>{skipped}"
                              "</testcase></testsuite></testsuites>")
        else:
            Path(argv[argv.index("--out") + 1]).write_text(json.dumps({"rows": [1]}))
        return {"status": "passed", "seconds": 0.5}

    monkeypatch.setattr(gc, "_run", run)
    out = tmp_path / "gpu.json"
    assert gc.main(["--out", str(out)]) == 1
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert checks[gc.TESTS[0]]["status"] == "passed"
    assert checks[gc.TESTS[1]]["status"] == "failed" and "skipped" in checks[gc.TESTS[1]]["why"]
    assert checks["pack_bench"]["result"] == {"rows": [1]}


def test_the_named_tests_exist_and_need_cuda() -> None:
    for node in gc.TESTS:
        path, name = node.split("::")
        text = (ROOT / path).read_text()
        at = text.index(f"def {name}(")
        assert "torch.cuda.is_available()" in text[max(0, at - 200):at], node
    for name in gc.BENCHES:
        assert (ROOT / "bench" / f"{name}.py").is_file()


def test_the_nccl_probe_without_cuda_says_so_in_one_line() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "nccl_abort_probe.py")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT)))
    assert run.returncode == 2
    assert run.stderr.strip() == "nccl_abort_probe: this machine has no CUDA device"


def test_only_runs_the_checks_named_and_refuses_an_unknown_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.json"
    assert gc.main(["--out", str(out), "--only", "one_device_switch"]) == 0
    assert [c["name"] for c in json.loads(out.read_text())["checks"]] == ["one_device_switch"]
    assert gc.main(["--out", str(out), "--only", "no_such_check"]) == 2
    assert capsys.readouterr().err.startswith("--only: no_such_check is no check of this script")


def test_the_one_device_switch_asked_for_cuda_without_it_says_so_in_one_line() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "one_device_switch.py"),
                          "--device", "cuda"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env=dict(os.environ, CUDA_VISIBLE_DEVICES="",
                                            PYTHONPATH=str(ROOT)))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == ("--device cuda: this machine has no CUDA "
                                                   "device"), run.stderr[-500:]
