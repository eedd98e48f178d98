"""Every benchmark in ``bench/`` runs in its shortest form and writes what it claims.

Each runs as a subprocess (as a user runs it) and its JSON is checked: the checkpoint load is
bit-equal to megatron's own on every destination, the runtime's staging stays within its budget,
the fixed-cost calibration's predictions are finite positive ratios, the fingerprint and pack
benches measured what they list, and the recovery bench recovered each way it names (nothing
re-read by an exchange, at most the lost bytes by a refill, everything by a rollback). Timings are not asserted (they belong to the benches).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 12):
    pytest.skip("the benches run in the Python 3.11 section (time budget of the 3.12 section)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
SHORT = {
    "fingerprint_bench": ["--sizes", "16", "--repeats", "1", "--no-old", "--out"],
    "pack_bench": ["--layers", "1", "--repeats", "1", "--out"],
    "runtime_bench": ["--quick", "--repeats", "1", "--no-megatron", "--out"],
    "calibrate_fixed_costs": ["--quick", "--repeats", "1", "--out"],
    "ckpt_load_bench": ["--repeat", "1", "--json"],
    "recovery_bench": ["--repeat", "1", "--out"],
    "plan_bench": ["--only", "GPT-OSS", "--out"],  # the full bench plans 1000s of GPUs
}


def _claims(name: str, doc: dict) -> None:
    if name == "ckpt_load_bench":
        assert doc["results"] and all(r["bit_equal_to_megatron"] for r in doc["results"])
    elif name == "runtime_bench":
        assert doc["cases"]
        for case in doc["cases"]:
            assert 0 < case["peak_staging_bytes"] <= case["budget_bytes"], case["case"]
            assert case["bytes_moved"] > 0
            assert math.isfinite(case["predicted_over_first"]) and case["predicted_over_first"] > 0
    elif name == "calibrate_fixed_costs":
        ratios = doc["predicted_over_measured"]
        assert ratios and all(math.isfinite(r) and r > 0 for r in ratios)
    elif name == "fingerprint_bench":
        assert doc["rows"] and all(r["bytes"] == 16 << 20 and r["new_seconds"] > 0
                                   for r in doc["rows"])
    elif name == "plan_bench":
        (row,) = doc["headline"]
        assert row["verified"] and row["label"].startswith("GPT-OSS-120B")
        assert row["bytes_moved"] == row["bytes_lower_bound"] > 0
        assert 1.0 <= row["time_ratio"] < 1.5 and row["plan_seconds"] > 0
    elif name == "recovery_bench":
        ways = {m["way"]: m for m in doc["measured"]}
        assert sorted(ways) == ["exchange", "refill", "rollback"]
        assert ways["exchange"]["lost_bytes"] == 0 and ways["exchange"]["reread_bytes"] == 0
        assert 0 < ways["refill"]["reread_bytes"] <= ways["refill"]["lost_bytes"]
        assert ways["rollback"]["reread_bytes"] > ways["rollback"]["lost_bytes"] > 0
        # The failure struck iteration 3: exchange and refill keep the 2 finished ones, the
        # rollback goes back to its checkpoint of iteration 1.
        assert [ways[w]["resumed_at_iteration"] for w in ("exchange", "refill", "rollback")] \
            == [2, 2, 1]
        assert all(m["release"] > 0 and m["downtime"] > 0 for m in ways.values())
        assert doc["model"] and all((r["lost_bytes"] == 0) == (r["instances"] == 2)
                                    for r in doc["model"])
    elif name == "pack_bench":
        assert doc["pieces_packed"] > 0 and doc["pieces_unpacked"] > 0


@pytest.mark.parametrize("name", sorted(SHORT))
def test_bench_short_run(name, tmp_path):
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *SHORT[name],
                          str(out)], capture_output=True, text=True, timeout=400, env=env,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"wrote {out}" in run.stdout
    _claims(name, json.loads(out.read_text()))
