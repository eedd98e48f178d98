"""Every benchmark in ``bench/`` runs in its shortest form and writes what it claims.

Each runs as a subprocess (as a user runs it) and its JSON is checked: the checkpoint load is
bit-equal to megatron's own on every destination, the runtime's staging stays within its budget,
the fixed-cost calibration's predictions are finite positive ratios, the fingerprint and pack
benches measured what they list, and the recovery bench recovered each way it names (nothing
re-read by an exchange, at most the lost bytes by a refill, everything by a rollback), and the
goodput bench met every event of its trace each way (a failure without notice: from buddy
copies live, from a periodic checkpoint otherwise), in the layouts each way goes to, and the
one-device live switch equals megatron's view of its source. Timings
are not asserted (they belong to the benches).
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
    "goodput_bench": ["--trace", "short", "--startup", "8", "--global-batch", "6", "--out"],
    "one_device_switch": ["--device", "cpu", "--out"],
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
            # made ahead and used (the bench exits non-zero where a switch did not use it)
            assert case["switch_prepared_seconds"] and min(case["switch_prepared_seconds"]) > 0
            assert case["prepare_seconds"] > 0 and min(case["raw_local_seconds"]) > 0
    elif name == "calibrate_fixed_costs":
        ratios = doc["predicted_over_measured"]
        assert ratios and all(math.isfinite(r) and r > 0 for r in ratios)
    elif name == "fingerprint_bench":
        assert doc["rows"] and all(r["bytes"] == 16 << 20 and r["new_seconds"] > 0
                                   for r in doc["rows"])
        # On CPU also the check a gloo switch runs (word sums) beside the CRC-32 it replaced.
        assert all(r["word_sums_seconds"] > 0 and r["crc32_seconds"] > 0 for r in doc["rows"])
    elif name == "plan_bench":
        (row,) = doc["headline"]
        assert row["verified"] and row["label"].startswith("GPT-OSS-120B")
        assert row["bytes_moved"] == row["bytes_lower_bound"] > 0
        assert 1.0 <= row["time_ratio"] < 1.5 and row["plan_seconds"] > 0
    elif name == "recovery_bench":
        ways = {m["way"]: m for m in doc["measured"]}
        assert sorted(ways) == ["buddy", "exchange", "refill", "rollback"]
        assert ways["exchange"]["lost_bytes"] == 0 and ways["exchange"]["reread_bytes"] == 0
        assert 0 < ways["refill"]["reread_bytes"] <= ways["refill"]["lost_bytes"]
        assert ways["rollback"]["reread_bytes"] > ways["rollback"]["lost_bytes"] > 0
        # The failure struck iteration 3: exchange and refill keep the 2 finished ones, the
        # rollback goes back to its checkpoint of iteration 1.
        assert [ways[w]["resumed_at_iteration"] for w in ("exchange", "refill", "rollback")] \
            == [2, 2, 1]
        # Buddy copies: no checkpoint read; every lost byte came from the copies, and the job
        # went on from its last finished iteration (six: three timed without copies, three
        # with).
        b = ways["buddy"]
        assert b["reread_bytes"] == 0 and b["from_copies_bytes"] == b["lost_bytes"] > 0, b
        assert b["resumed_at_iteration"] == 6, b
        c = b["copies"]
        assert c["step_s"] > 0 and c["step_with_copy_s"] > 0 and c["copy_parts_s"]["copy"] > 0
        assert c["copy_host_bytes"] > 0 and c["state_bytes"] > 0
        assert all(m["release"] > 0 and m["downtime"] > 0 for m in ways.values())
        assert doc["model"] and all((r["lost_bytes"] == 0) == (r["instances"] == 2)
                                    for r in doc["model"])
    elif name == "goodput_bench":
        ways = {w["way"]: w for w in doc["ways"]}
        assert sorted(ways) == ["checkpoint", "dp-only", "live"]
        for w in ways.values():
            # Every event met, each iteration counted once unless a failure lost it (the bench
            # checks the numbering), the first layout's 8 devices back at the end.
            assert [(e["what"], e["done"]) for e in w["events"]] == [
                ("notice", True), ("back", True), ("fail", True), ("back", True)], \
                (w["way"], w["events"])
            assert all(e["iterations_lost"] == 0 and e["downtime_s"] > 0
                       for e in w["events"] if e["what"] != "fail")
            assert w["events"][-1]["devices"] == 8 and w["iterations"] > 0
            assert 0 < w["effective_training_time_ratio"] <= 1.05
            assert isinstance(w["events"][0]["met_deadline"], bool)
        fail = {k: w["events"][2] for k, w in ways.items()}
        # A failure without notice: live and dp-only recover from the buddy copies (no
        # checkpoint; at most the iteration it cut short, should the copies predate it); the
        # checkpoint way restarts from its newest periodic save, losing what came after it.
        assert fail["live"]["recovered_by"] == fail["dp-only"]["recovered_by"] == "buddy"
        assert fail["live"]["iterations_lost"] <= 1 and fail["dp-only"]["iterations_lost"] <= 1
        assert fail["checkpoint"]["recovered_by"].startswith("restart at iteration")
        assert 0 <= fail["checkpoint"]["iterations_lost"] <= doc["save_every"]
        assert (fail["live"]["devices"], fail["checkpoint"]["devices"],
                fail["dp-only"]["devices"]) == (6, 6, 4)
        assert "detect" in fail["live"]["phases_s"] and "load" in fail["checkpoint"]["phases_s"]
        notice = {k: w["events"][0] for k, w in ways.items()}
        # The notice: live and checkpoint-restart go to suggest's layout on the 6 devices that
        # stay; data-parallel elasticity keeps the one replica without node3 (4 devices).
        assert notice["live"]["devices"] == notice["checkpoint"]["devices"] == 6
        assert notice["live"]["layout"] == notice["checkpoint"]["layout"]
        assert (notice["dp-only"]["devices"], notice["dp-only"]["layout"]) == (4, "tp2-pp2-dp1")
        assert set(notice["checkpoint"]["phases_s"]) >= {"save", "build", "load"}
        assert "exchange" in notice["live"]["phases_s"]
        assert Path(doc["plot"]).is_file()
        # The model at scale (bench/goodput_model.py, which goodput_bench runs): every preset
        # at every scale, each way a ratio in [0, 1]; forming
        # the world ahead never costs goodput.
        assert len(doc["model"]) == 9
        for row in doc["model"]:
            assert all(0 <= row[w]["ratio"] <= 1 for w in ("live", "live-ahead", "checkpoint",
                                                            "dp-only")), row
            assert row["live"]["downtime_per_failure_s"] < \
                row["checkpoint"]["downtime_per_failure_s"]
            assert row["live-ahead"]["ratio"] >= row["live"]["ratio"]
    elif name == "pack_bench":
        assert doc["pieces_packed"] > 0 and doc["pieces_unpacked"] > 0
    elif name == "one_device_switch":
        # Both switches equal megatron's view of the source, built ahead (the CPU's memory is
        # not checked), and the run trained on with the losses of one that never switched.
        assert [(s["from"], s["built_ahead"]) for s in doc["switches"]] == [
            ("distributed optimizer", True), ("non-distributed optimizer", True)]
        assert all(s["tensors_compared"] > 0 and "build" not in s["phases_s"]
                   and "exchange" in s["phases_s"] for s in doc["switches"])
        assert len(doc["losses"]) == 6 and doc["backend"] == "gloo"


@pytest.mark.parametrize("name", sorted(SHORT))
def test_bench_short_run(name, tmp_path):
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *SHORT[name],
                          str(out)], capture_output=True, text=True,
                         timeout=600 if name == "goodput_bench" else 400, env=env,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"wrote {out}" in run.stdout
    _claims(name, json.loads(out.read_text()))
