"""Bad input to ``dynatrain layout`` exits 2 with one ``dynatrain: error:`` line and no traceback.

Most cases run ``dynatrain.cli.main`` in-process; a few run the real ``python -m dynatrain.cli``
in a subprocess, so what a user's terminal shows (stderr, exit status) is checked as is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynatrain.cli import main

ROOT = Path(__file__).resolve().parent.parent
VALID = ROOT / "specs" / "llama3.1-8b" / "tp2-dp4.yaml"  # 8 ranks
INVALID_SPEC = ("model: llama3.1-8b\nparallel: {tp: 3}\nworld: {nodes: 1, gpus_per_node: 8}\n")
BOMB = "".join(f"m{i}: &m{i} {{<<: [*m{i - 1}, *m{i - 1}]}}\n" if i else "m0: &m0 {a: 1}\n"
               for i in range(40)) + "model: *m39\n"


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """``main(argv)`` in-process: (exit status, stdout, stderr); argparse's exits count too."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def run_process(args: list[str]) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "dynatrain.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    return proc.returncode, proc.stdout, proc.stderr


def assert_one_error_line(code: int, out: str, err: str, fragment: str = "") -> str:
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and "Traceback" not in out, err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), repr(err)
    assert lines[0].startswith("dynatrain: error: "), repr(err)
    assert fragment in lines[0], repr(err)
    return lines[0]


@pytest.fixture
def files(tmp_path):
    """Spec files of every kind of wrong, by name."""
    made = {
        "invalid-spec.yaml": INVALID_SPEC,
        "not-yaml.yaml": "model: [llama3.1-8b\nworld: {nodes: 1,, gpus_per_node: 8\n",
        "not-a-mapping.yaml": "- model\n- world\n",
        "empty.yaml": "",
        "unknown-field.yaml": "model: llama3.1-8b\nworld: {nodes: 1, gpus_per_node: 8}\ntp: 2\n",
        "wrong-type.yaml": "model: llama3.1-8b\nworld: {nodes: one, gpus_per_node: 8}\n",
        "python-tag.yaml": "!!python/object/apply:os.system ['echo hi']\n",
        "merge-bomb.yaml": BOMB,
        "a\nb.yaml": "[not yaml",  # a newline in the file name must not split the line
    }
    for name, text in made.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00model")
    (tmp_path / "a-directory.yaml").mkdir()
    return tmp_path


CASES = [
    ("missing.yaml", "cannot read the spec file"),
    ("a-directory.yaml", "cannot read the spec file"),
    ("binary.yaml", "not UTF-8"),
    ("not-yaml.yaml", "not-yaml.yaml: is not valid YAML at line"),
    ("not-a-mapping.yaml", "a spec must be a mapping"),
    ("empty.yaml", "a spec must be a mapping"),
    ("invalid-spec.yaml", "parallel.tp: must divide num_attention_heads=32 (got 3)"),
    ("unknown-field.yaml", "tp: unknown field"),
    ("wrong-type.yaml", "world.nodes: Input should be a valid integer"),
    ("python-tag.yaml", "unsafe YAML tag !!python/object/apply:os.system refused"),
    ("merge-bomb.yaml", "merge keys"),
    ("a\nb.yaml", "'a\\nb.yaml': is not valid YAML"),
]


@pytest.mark.parametrize("name,fragment", CASES, ids=[c[0].replace("\n", "-nl-") for c in CASES])
def test_bad_spec_in_process(files, capsys, name, fragment):
    assert_one_error_line(*run_main(["layout", str(files / name)], capsys), fragment)


@pytest.mark.parametrize("ranks,fragment", [
    ("x", "--ranks: expected e.g. 0,3,8-15"),
    ("", "--ranks"),
    ("1,,2", "--ranks"),
    ("-1", "--ranks"),
    ("5-3", "'5-3': the range is reversed; ranges run low-high (3-5)"),
    ("0-8", "'0-8': ranks must be below the world size 8 (0-7)"),
    ("8", "'8': ranks must be below the world size 8 (0-7)"),
    ("99999999999", "ranks must be below the world size 8"),
    ("\u0663", "digits 0-9"),  # ARABIC-INDIC DIGIT THREE
    ("0,0", "--ranks: rank 0 is given twice"),
    ("1-4,3", "--ranks: rank 3 is given twice"),
])
def test_bad_ranks_in_process(capsys, ranks, fragment):
    code, out, err = run_main(["layout", str(VALID), "--json", "-", f"--ranks={ranks}"], capsys)
    assert_one_error_line(code, out, err, fragment)
    assert out == ""


@pytest.mark.parametrize("ranks", ["\u00b2", "9" * 5000])
def test_odd_digit_ranks_in_process(capsys, ranks):
    assert_one_error_line(*run_main(["layout", str(VALID), "--json", "-", f"--ranks={ranks}"],
                                    capsys), "--ranks")


def test_unwritable_json_in_process(tmp_path, capsys):
    target = tmp_path / "no-such-dir" / "facts.json"
    assert_one_error_line(*run_main(["layout", str(VALID), "--json", str(target)], capsys))


# (No arguments at all prints the usage with every command: tests/test_cli_plan.py.)
@pytest.mark.parametrize("argv", [["layout"], ["nonsense"], ["layout", str(VALID), "--bad"]])
def test_bad_arguments_in_process(capsys, argv):
    assert_one_error_line(*run_main(argv, capsys))


def test_valid_spec_in_process(capsys):
    code, out, err = run_main(["layout", str(VALID)], capsys)
    assert code == 0 and err == ""
    assert "world   8 ranks" in out


def test_valid_spec_json_ranks_in_process(capsys):
    code, out, err = run_main(["layout", str(VALID), "--json", "-", "--ranks", "0,3,6-7"], capsys)
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["world"] == 8 and [r["rank"] for r in doc["ranks"]] == [0, 3, 6, 7]


@pytest.mark.parametrize("name", ["specs/llama3.1-70b/tp4-pp4-vpp5-dp8.yaml",
                                  "specs/mixtral-8x22b/tp4-pp4-ep8.yaml",
                                  "specs/qwen3-30b-a3b/tp2-pp2-ep4.yaml"])
def test_shipped_specs_in_process(capsys, name):
    code, out, err = run_main(["layout", str(ROOT / name)], capsys)
    assert code == 0 and err == "", err


# ---- the real command, in a subprocess -------------------------------------------------------

@pytest.mark.parametrize("name,fragment", [
    ("missing.yaml", "cannot read the spec file"),
    ("a-directory.yaml", "cannot read the spec file"),
    ("not-yaml.yaml", "is not valid YAML"),
    ("invalid-spec.yaml", "parallel.tp: must divide num_attention_heads=32 (got 3)"),
    ("python-tag.yaml", "unsafe YAML tag !!python/object/apply:os.system refused"),
])
def test_bad_spec_subprocess(files, name, fragment):
    assert_one_error_line(*run_process(["layout", str(files / name)]), fragment)


def test_bad_ranks_subprocess():
    code, out, err = run_process(["layout", str(VALID), "--json", "-", "--ranks", "3-1"])
    assert_one_error_line(code, out, err, "--ranks")


def test_valid_spec_subprocess():
    code, out, err = run_process(["layout", str(VALID)])
    assert code == 0, err
    assert "Traceback" not in err and "world   8 ranks" in out


def test_ranks_without_json_is_refused(capsys):
    assert main(["layout", "specs/llama3.1-8b/tp2-dp4.yaml", "--ranks", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dynatrain: error: --ranks: only applies with --json"]


# ---- YAML tags: refused as such, not called "not valid YAML" ----------------------------------

@pytest.mark.parametrize("text,line", [
    ("!!python/object/apply:os.system ['echo hi']\n",
     "python-tag.yaml: unsafe YAML tag !!python/object/apply:os.system refused at line 1 "
     "(specs are plain data)"),
    ("model: llama3.1-8b\nparallel: {tp: !!python/object:builtins.int {}}\n"
     "world: {nodes: 1, gpus_per_node: 8}\n",
     "python-tag.yaml: unsafe YAML tag !!python/object:builtins.int refused at line 2 "
     "(specs are plain data)"),
    ("%TAG !p! tag:yaml.org,2002:python/\n--- !p!name:os.system\n",
     "python-tag.yaml: unsafe YAML tag !!python/name:os.system refused at line 2 "
     "(specs are plain data)"),
    ("model: !custom llama3.1-8b\nworld: {nodes: 1, gpus_per_node: 8}\n",
     "python-tag.yaml: unknown YAML tag !custom refused at line 1 (specs are plain data)"),
])
def test_yaml_tags_are_refused_by_name(tmp_path, capsys, text, line):
    path = tmp_path / "python-tag.yaml"
    path.write_text(text, encoding="utf-8")
    got = assert_one_error_line(*run_main(["layout", str(path)], capsys))
    assert got == "dynatrain: error: " + line
    assert "not valid YAML" not in got


def test_a_named_pipe_nobody_writes_is_read_as_empty_not_waited_on(tmp_path):
    # Opening a FIFO for reading blocks until a writer comes: every input is opened without
    # blocking (``ir.strict.read_bounded``), so an unwritten pipe reads as empty. (In a
    # subprocess: a regression hangs, and the subprocess's timeout fails the test.)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    tiny = str(ROOT / "specs" / "tiny-gpt" / "tp2-dp2.yaml")
    for argv, fragment in [(["layout", str(fifo)], "fifo: a spec must be a mapping"),
                           (["verify", str(fifo)], f"{fifo}: not JSON"),
                           (["plan", tiny, tiny, "--topology", str(fifo)], "--topology: ")]:
        assert_one_error_line(*run_process(argv), fragment)


def test_a_pipe_with_a_writer_is_read_as_a_file() -> None:
    # ``dynatrain layout <(cat spec.yaml)``: the shell's pipe, with its writer, reads as usual.
    spec = (ROOT / "specs" / "tiny-gpt" / "tp2-dp2.yaml").read_bytes()
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "dynatrain.cli", "layout", f"/dev/fd/{r}"],
                            pass_fds=(r,), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT, text=True)
    os.close(r)
    os.write(w, spec)
    os.close(w)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "tiny-gpt" in out, err


def test_an_alias_bomb_in_a_topology_file_is_refused_at_once(tmp_path, capsys):
    # A few hundred bytes of nested aliases name 9**9 strings: the refusal quotes a bounded
    # repr of the value (the full one took minutes and gigabytes).
    levels = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n"
                     for p, c in zip("abcdefgh", "bcdefghi"))
    (tmp_path / "bomb.yaml").write_text("a: &a [x, x, x, x, x, x, x, x, x]\n" + levels
                                        + "name: *i\n")
    tiny = str(ROOT / "specs" / "tiny-gpt" / "tp2-dp2.yaml")
    line = assert_one_error_line(*run_main(["plan", tiny, tiny, "--topology",
                                            str(tmp_path / "bomb.yaml")], capsys),
                                 "topology.name: ")
    assert len(line) < 300, line


def test_an_error_quotes_an_int_too_large_to_print() -> None:
    # repr() of an int over 4300 digits raises: the message says what it is instead
    from dynatrain.ir.errors import SpecError
    assert str(SpecError("model.hidden_size", "too large", 10**5000)) == (
        "model.hidden_size: too large (got <a int too large to show>)")
