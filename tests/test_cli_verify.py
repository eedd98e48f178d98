"""`dynatrain verify PLAN.json`: self-contained re-verification of saved or hand-edited plans."""

from __future__ import annotations

import json

import yaml

from dynatrain.cli import main
from dynatrain.ir.loader import spec_to_dict
from test_plan_simulate import MOE, spec


def _save_plan(tmp_path, capsys, *extra: str) -> dict:
    src, dst = tmp_path / "src.yaml", tmp_path / "dst.yaml"
    src.write_text(yaml.safe_dump(spec_to_dict(spec(MOE, 4, tp=2, ep=2))))
    dst.write_text(yaml.safe_dump(spec_to_dict(spec(MOE, 8, tp=2, ep=2, pp=2))))
    out = tmp_path / "plan.json"
    assert main(["plan", str(src), str(dst), "--json", str(out), *extra]) == 0
    assert "verified in" in capsys.readouterr().out
    return json.loads(out.read_text())


def _verify(tmp_path, doc: dict, *extra: str) -> int:
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc))
    return main(["verify", str(path), *extra])


def test_saved_plan_verifies_on_its_own(tmp_path, capsys) -> None:
    doc = _save_plan(tmp_path, capsys, "--place", "auto")
    assert doc["format"] == "dynatrain.plan/3" and doc["summary"]["verify_seconds"] > 0
    assert doc["dst_spec"]["world"]["devices"] == doc["dst_devices"]
    assert _verify(tmp_path, doc) == 0
    assert capsys.readouterr().out.startswith("verified: coverage, source, expert")


def test_hand_edited_plan_fails_with_rule_and_witness(tmp_path, capsys) -> None:
    doc = _save_plan(tmp_path, capsys)
    msg = next(m for r in doc["rounds"] for m in r if m["src_device"] != m["dst_device"])
    key, kinds, box, _, dst_rank = msg["transfers"][0][:5]
    msg["transfers"][0][1] = ["exp_avg"] if kinds != ["exp_avg"] else ["exp_avg_sq"]
    assert _verify(tmp_path, doc) == 1
    out = capsys.readouterr().out
    assert out.startswith("verification failed")
    assert f"coverage: {key}[{', '.join(map(str, box[0]))}]" in out
    assert f"destination rank {dst_rank}" in out


def test_old_format_without_specs_needs_them_on_the_command_line(tmp_path, capsys) -> None:
    doc = _save_plan(tmp_path, capsys)
    old = {k: v for k, v in doc.items() if k not in ("src_spec", "dst_spec", "order", "slots")}
    old["format"] = "dynatrain.plan/1"
    for r in old["rounds"]:  # /1 gave each slot in place
        for m in r:
            for t in m["transfers"]:
                t[5], t[7] = doc["slots"][t[5]], doc["slots"][t[7]]
    assert _verify(tmp_path, old) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no src_spec" in err[0] and "--src" in err[0]
    assert _verify(tmp_path, old, "--src", str(tmp_path / "src.yaml"),
                   "--dst", str(tmp_path / "dst.yaml")) == 0


def test_unreadable_plans_are_one_line_exit_2(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    for text, words in (("{", "not JSON"), ('{"format": "x"}', "not a dynatrain.plan/3"),
                        ('{"format": "dynatrain.plan/3", "rounds": 3}', "malformed")):
        bad.write_text(text)
        assert main(["verify", str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert main(["verify", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_plan_cannot_raise_its_own_budget(tmp_path, capsys) -> None:
    doc = _save_plan(tmp_path, capsys, "--budget", "4KiB")
    doc["budget_bytes"] = 1 << 30
    merged = [m for r in doc["rounds"] for m in r]  # every message in one round: over 4 KiB
    doc["rounds"], doc["order"] = [merged], []
    assert _verify(tmp_path, doc) == 0  # within the 1 GiB the edited plan declares
    capsys.readouterr()
    assert _verify(tmp_path, doc, "--budget", "4KiB") == 1
    assert "over the 4.0 KiB budget" in capsys.readouterr().out


def test_prove_lists_each_lemma_and_exits_0(capsys) -> None:
    assert main(["prove", "even_split_tiles", "expert_owner_unique"]) == 0
    out = capsys.readouterr().out
    assert "even_split_tiles" in out and "2 of 2 lemmas proved" in out
    assert main(["prove", "no_such_lemma"]) == 2
    assert "no lemma 'no_such_lemma'" in capsys.readouterr().err


# ---- a plan checked against layouts it is not about, and saved slices -----------------------

TINY_SRC, TINY_DST = "specs/tiny-gpt/pp2-dp2.yaml", "specs/tiny-gpt/tp2-dp2.yaml"
EIGHT_B = "specs/llama3.1-8b/tp2-dp4.yaml"


def _tiny_plan(tmp_path, capsys) -> str:
    out = tmp_path / "tiny.json"
    assert main(["plan", TINY_SRC, TINY_DST, "--json", str(out)]) == 0
    capsys.readouterr()
    return str(out)


def _one_error(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dynatrain: error: "), err
    assert "Slot(" not in out + err
    return lines[0]


def test_src_or_dst_of_another_model_is_bad_input_naming_the_field(tmp_path, capsys) -> None:
    plan = _tiny_plan(tmp_path, capsys)
    assert main(["verify", plan, "--src", EIGHT_B]) == 2
    line = _one_error(capsys)
    assert "--src:" in line and "model.num_layers is 32, the plan's is 4" in line, line
    assert main(["verify", plan, "--dst", EIGHT_B]) == 2
    assert "--dst:" in _one_error(capsys)


def test_src_of_the_same_model_with_other_ranks_is_bad_input(tmp_path, capsys) -> None:
    plan = _tiny_plan(tmp_path, capsys)
    other = tmp_path / "wide.yaml"
    doc = yaml.safe_load(open(TINY_SRC).read())
    doc["world"] = {"nodes": 1, "gpus_per_node": 8}
    doc["parallel"] = {**doc.get("parallel", {}), "pp": 2}
    other.write_text(yaml.safe_dump(doc))
    assert main(["verify", plan, "--src", str(other)]) == 2
    assert "has 8 ranks; the plan's src has 4" in _one_error(capsys)


def test_violations_name_slots_in_the_text_notation(tmp_path, capsys) -> None:
    doc = json.loads(open(_tiny_plan(tmp_path, capsys)).read())
    # Move one transfer's source region outside what its source rank stores.
    t = next(t for rnd in doc["rounds"] for m in rnd for t in m["transfers"]
             if doc["slots"][t[5]][0] == "param")
    t[6] = [[x + 10**6 for x in t[6][0]], [x + 10**6 for x in t[6][1]]]
    assert _verify(tmp_path, doc) == 1
    out = capsys.readouterr().out
    assert "no region" in out and "Slot(" not in out and " in c" in out, out


def test_a_saved_slice_verifies(tmp_path, capsys) -> None:
    path = tmp_path / "slice.json"
    assert main(["plan", TINY_SRC, TINY_DST, "--device", "node0:gpu1", "--json",
                 str(path)]) == 0
    capsys.readouterr()
    assert main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("slice of node0:gpu1") and "verified:" in out
    doc = json.loads(path.read_text())
    # Shrink a region the device receives by one row (bytes to match): a coverage hole.
    t = next(t for rnd in doc["plan"]["rounds"] for m in rnd if m["dst_device"] == "node0:gpu1"
             for t in m["transfers"] if t[2][1][0] - t[2][0][0] >= 2)
    rows = t[2][1][0] - t[2][0][0]
    t[2][1][0] -= 1
    t[9] = t[9] // rows * (rows - 1)
    assert _verify(tmp_path, doc) == 1
    out = capsys.readouterr().out
    assert "verification failed" in out and "coverage" in out, out
    doc["summary"]["device"] = "node9:gpu9"
    assert _verify(tmp_path, doc) == 2
    assert "summary.device 'node9:gpu9' is in neither side" in _one_error(capsys)
