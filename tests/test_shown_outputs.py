"""The docs show real outputs, and the command lines they show run.

Every ```text block that starts with ``$ dynatrain`` (README.md, docs/, bench/, examples/) is
rerun and compared with what it shows, only the seconds a command measures masked
(``tools/shown_outputs.py``; ``--write`` there regenerates them). Every ``dynatrain`` command
line of a ```bash block is parsed by the CLI's own parser, and the README's two set-up commands
are the ones ``.ci/run`` runs.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

from dynatrain.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("shown_outputs", ROOT / "tools" / "shown_outputs.py")
shown = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = shown  # dataclasses look their module up there
_spec.loader.exec_module(shown)

BLOCKS = [b for page in shown.pages() for b in shown.blocks(page)]
COMMANDS = [(page, line, argv) for page in shown.pages()
            for line, argv in shown.dynatrain_commands(page)]
# The README's set-up commands, exactly: .ci/run runs the same plan and test command.
INSTALL = ('python3.11 -m venv .venv && . .venv/bin/activate && pip install -q --upgrade pip && '
           'pip install -e ".[dev]" && dynatrain plan specs/llama3.1-70b/tp8-pp4-dp4.yaml '
           'specs/llama3.1-70b/tp8-pp8-dp2.yaml')
TEST = ". .venv/bin/activate && python -m pytest"


def test_the_docs_show_outputs_of_every_flow() -> None:
    # Not vacuous: the README's three flows and the reference pages show real runs.
    commands = {s.command.split()[1] for b in BLOCKS for s in b.steps
                if s.command.startswith("dynatrain ")}
    assert {"plan", "run-plan", "suggest", "layout", "verify", "prove"} <= commands
    assert len({b.page.name for b in BLOCKS}) >= 4


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_shown_output_is_a_fresh_run(block) -> None:
    diff = shown.differences(block, shown.run_block(block))
    assert not diff, (f"{block.where} differs from a fresh run (rewrite it with "
                      f"`python tools/shown_outputs.py --write`):\n" + "\n".join(diff))


def _block(*steps: tuple[str, list[str]]):
    return shown.Block(ROOT / "README.md", 0, 0,
                       tuple(shown.Step(c, tuple(lines)) for c, lines in steps))


def test_only_measured_seconds_are_masked() -> None:
    summary = "  planned in 0.23 s (4592 transfers), verified in 0.08 s (coverage)"
    assert shown.mask(summary) == shown.mask(summary.replace("0.23", "12.71"))
    # Computed figures are not masked: a prediction, a byte count, a message count.
    for line, changed in (
            ("  time    wire 0.145 s on h100 = ~0.202 s downtime predicted", "0.146"),
            ("  moved     13.4 MiB in 8 rounds, 112 messages between devices", "96"),
            ("  staging   peak 1019.9 KiB per device (planned 1019.9 KiB)", "892.0")):
        old = re.search(r"\d+(\.\d+)?(?= (s|KiB|messages)\b)", line).group()
        assert shown.mask(line) != shown.mask(line.replace(old, changed, 1)), line
    run = ("  time      92.3 ms (slowest process); 0.15 GB/s over all devices (bytes moved); "
           "predicted ~70.2 ms on gloo-local")
    assert shown.mask(run) == shown.mask(run.replace("92.3 ms", "1.25 s").replace("0.15", "2"))
    assert shown.mask(run) != shown.mask(run.replace("70.2", "68.2"))
    proved = "  tp_even_split                  proved      0.123 s"
    assert shown.mask(proved) == shown.mask(proved.replace("  0.123", " 10.500"))


def test_a_stale_output_is_reported() -> None:
    block = _block(("dynatrain run-plan a b", ["  moved 13.4 MiB, 112 messages", "  bit-exact: yes"]),
                   ("echo $?", ["0"]))
    fresh = [["  moved 13.4 MiB, 96 messages", "  bit-exact: yes"], ["0"]]
    diff = shown.differences(block, fresh)
    assert "-  moved 13.4 MiB, 112 messages" in diff and "+  moved 13.4 MiB, 96 messages" in diff
    assert shown.differences(block, [fresh[0], ["1"]])  # the exit status is compared too
    assert shown.rewritten(block, fresh) == [
        "$ dynatrain run-plan a b", "  moved 13.4 MiB, 96 messages", "  bit-exact: yes",
        "$ echo $?", "0"]


def test_elision_keeps_the_first_and_last_lines() -> None:
    block = _block(("dynatrain layout s", ["a", "b", "  ...", "z"]))
    assert not shown.differences(block, [["a", "b", "c", "d", "z"]])
    assert shown.differences(block, [["a", "x", "c", "d", "z"]])  # a shown line changed
    assert shown.differences(block, [["a", "b", "c", "d", "y"]])  # the last line changed
    assert shown.differences(block, [["a", "b", "z"]])  # nothing left to elide: show it all
    assert shown.rewritten(block, [["a", "B", "c", "d", "e"]]) == [
        "$ dynatrain layout s", "a", "B", "  ...", "e"]
    with pytest.raises(shown.ShownError, match="one `...`"):
        shown.differences(_block(("dynatrain layout s", ["a", "...", "b", "...", "c"])),
                          [list("abcdefg")])


def test_a_shown_command_is_a_single_command(tmp_path) -> None:
    for command in ("dynatrain plan a b | head", "dynatrain plan a b > out.txt",
                    "cat plan.json", "python no_such_script.py"):
        with pytest.raises(shown.ShownError):
            shown._argv(command, tmp_path)
    assert shown._argv("echo $?", tmp_path) is None
    assert shown._argv("dynatrain prove", tmp_path)[1:] == ["-m", "dynatrain.cli", "prove"]


def test_bash_command_lines_are_found_through_shell_syntax(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```bash\ncd x && dynatrain plan a.yaml b.yaml   # a comment\n"
                    "dynatrain layout \\\n  s.yaml --json - | head\n```\n"
                    "```text\ndynatrain not-bash\n```\n")
    assert shown.dynatrain_commands(page) == [
        (2, ["plan", "a.yaml", "b.yaml"]), (3, ["layout", "s.yaml", "--json", "-"])]


@pytest.mark.parametrize("page,line,argv", COMMANDS,
                         ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in COMMANDS])
def test_bash_dynatrain_command_parses(page, line, argv) -> None:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as err:  # argparse's way of refusing
        pytest.fail(f"{page.name}:{line}: dynatrain {shlex.join(argv)} is refused ({err})")
    assert args.cmd is not None
    for word in argv:  # files of this repository that the command names exist
        if re.match(r"(specs|docs|tests|examples)/", word):
            assert (ROOT / word).exists(), f"{page.name}:{line}: no {word}"


def test_readme_setup_commands_are_the_ones_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Set up"):readme.index("\n## ", readme.index("## Set up") + 1)]
    bash = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert bash == [INSTALL, TEST]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert INSTALL.split(" && ")[-1] in ci  # the plan command, verbatim
    assert "python -m pytest" in ci
    assert any(line.startswith("pip install") and '-e ".[dev]"' in line for line in ci)
    readme_commands = [argv for page, _, argv in COMMANDS if page.name == "README.md"]
    assert INSTALL.split(" && ")[-1].split()[1:] in readme_commands


def test_relative_links_of_the_docs_resolve() -> None:
    missing = []
    for page in shown.pages():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, missing
