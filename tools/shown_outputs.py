"""Check, and rewrite from fresh runs, the command outputs the documentation shows.

A *shown output* is a ```text block of a page (README.md, docs/*.md, bench/*.md,
examples/*.md) whose first line is ``$ dynatrain ...``. Each ``$ `` line of the block is a
command, the lines after it (up to the next ``$ `` line) what it prints, stdout and stderr
together as a terminal shows them. The command runs in a fresh temporary folder holding links
to the repository's top-level entries (so ``specs/...`` resolves and files it writes go
nowhere), as ``python -m dynatrain.cli`` with this checkout first on ``PYTHONPATH``.

    python tools/shown_outputs.py            # check every shown output; exit 1 with a diff
    python tools/shown_outputs.py --write    # rerun every shown command, write what it printed
    python tools/shown_outputs.py README.md  # only these pages

Commands a block may run: ``dynatrain ARGS``, ``python FILE ARGS`` (a script of this
repository, run by this interpreter) and ``echo $?`` (the previous command's exit status).
Anything else, pipes and redirections included, is refused: a block shows what a user types.

Only run-dependent numbers are masked when comparing (``TIMINGS`` below: seconds measured by
the command and the bandwidths derived from them); every other character must match.
A line ``...`` (indented or not) in a command's output elides the lines between the ones
shown before and after it: those must be the first and last lines of the output, and at
least one line must be left out. ``--write`` keeps as many lines before and after it.

``dynatrain_commands`` lists the ``dynatrain`` command lines of ```bash blocks, for the test
that parses them with the CLI's own argument parser.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = "```"
PROMPT = "$ "
ELISION = "..."
COMMAND_TIMEOUT_S = 600

# Numbers a run measures rather than computes. ``{T}`` is one such number, with the spaces
# before it (a padded column widens when the time does).
_T = r"(\s*\d+(?:\.\d+)?)"
TIMINGS = tuple(re.compile(p.replace("{T}", _T)) for p in (
    r"(?:planned|verified|computed) in{T} s",                   # plan, plan --device, layout
    r"verify_slice: \w+ \({T} s\)",                             # plan --device
    r"time(\s*\d+(?:\.\d+)? (?:s|ms|us|ns)) \(slowest process\);{T} GB/s over",  # run-plan
    r"moved \(all devices\),{T} s,{T} GB/s so far",             # run-plan's progress
    r"switch committed: \d+ rounds in{T} s .*:{T} GB/s through",  # run-plan's last log line
    r"(?:proved|FAILED.*){T} s$",                               # prove
    r"in{T} s \(peak .* in flight\)",                           # load
))


def mask(line: str) -> str:
    """``line`` with every run-dependent number replaced by ``<t>``."""
    for pattern in TIMINGS:
        def repl(m: re.Match[str]) -> str:
            out, at = [], m.start()
            for g in range(1, (m.lastindex or 0) + 1):
                out += [m.string[at:m.start(g)], " <t>"]
                at = m.end(g)
            return "".join(out) + m.string[at:m.end()]
        line = pattern.sub(repl, line)
    return line.rstrip()


@dataclass(frozen=True)
class Step:
    """One ``$`` command of a block and the output lines shown under it."""

    command: str
    shown: tuple[str, ...]


@dataclass(frozen=True)
class Block:
    """A shown output: the page, the line numbers of its fences (0-based), its steps."""

    page: Path
    start: int  # the line of the opening fence
    end: int  # the line of the closing fence
    steps: tuple[Step, ...]

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.start + 2}"


def pages() -> list[Path]:
    """Every page whose shown outputs are kept true."""
    found = [ROOT / "README.md"]
    for folder in ("docs", "bench", "examples"):
        found += sorted((ROOT / folder).glob("*.md"))
    return [p for p in found if p.is_file()]


def fenced(lines: list[str], lang: str) -> list[tuple[int, int]]:
    """(opening, closing) line numbers of every ``lang`` fenced block."""
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip().startswith(FENCE):
            opening = lines[i].strip()[len(FENCE):].strip()
            j = i + 1
            while j < len(lines) and lines[j].strip() != FENCE:
                j += 1
            if opening == lang:
                out.append((i, j))
            i = j + 1
        else:
            i += 1
    return out


def blocks(page: Path) -> list[Block]:
    """The shown outputs of a page."""
    lines = page.read_text(encoding="utf-8").split("\n")
    out = []
    for start, end in fenced(lines, "text"):
        body = lines[start + 1:end]
        if not body or not body[0].startswith(PROMPT + "dynatrain "):
            continue
        steps: list[Step] = []
        for line in body:
            if line.startswith(PROMPT):
                steps.append(Step(line[len(PROMPT):], ()))
            else:
                steps[-1] = Step(steps[-1].command, steps[-1].shown + (line,))
        out.append(Block(page, start, end, tuple(steps)))
    return out


class ShownError(Exception):
    """A block that cannot be run as written (an unsupported command, two elisions)."""


def _argv(command: str, workdir: Path) -> list[str] | None:
    """The argv that runs ``command``, or None for ``echo $?``."""
    words = shlex.split(command, comments=True)
    if words == ["echo", "$?"]:
        return None
    if any(w in ("|", "||", "&&", ";", ">", ">>", "<", "2>&1", "&") for w in words):
        raise ShownError(f"{command!r}: shown commands are single commands, no shell syntax")
    if words and words[0] == "dynatrain":
        return [sys.executable, "-m", "dynatrain.cli", *words[1:]]
    if len(words) >= 2 and words[0] == "python" and (workdir / words[1]).is_file():
        return [sys.executable, *words[1:]]
    raise ShownError(f"{command!r}: a shown command is `dynatrain ...`, `python FILE ...` "
                     f"(a file of this repository) or `echo $?`")


def run_block(block: Block) -> list[list[str]]:
    """Run every step of ``block`` in a fresh folder; each step's output lines."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",  # stdout and stderr interleave as typed
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("COLUMNS", None)
    outputs, status = [], 0
    with tempfile.TemporaryDirectory(prefix="shown_outputs_") as tmp:
        work = Path(tmp)
        for entry in ROOT.iterdir():
            if not entry.name.startswith("."):
                (work / entry.name).symlink_to(entry)
        for step in block.steps:
            argv = _argv(step.command, work)
            if argv is None:
                outputs.append([str(status)])
                continue
            done = subprocess.run(argv, cwd=work, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=COMMAND_TIMEOUT_S, check=False)
            status = done.returncode
            text = done.stdout.decode("utf-8", errors="replace").replace(tmp, "<tmp>")
            outputs.append([line.rstrip() for line in text.rstrip("\n").split("\n")]
                           if text.strip() else [])
    return outputs


def _split(shown: tuple[str, ...], where: str) -> tuple[list[str], list[str] | None]:
    """The shown lines before and after the elision (None: no elision)."""
    cut = [i for i, line in enumerate(shown) if line.strip() == ELISION]
    if len(cut) > 1:
        raise ShownError(f"{where}: at most one `...` line per command")
    if not cut:
        return list(shown), None
    return list(shown[:cut[0]]), list(shown[cut[0] + 1:])


def expected(step: Step, actual: list[str], where: str) -> list[str]:
    """What ``step`` should show given its ``actual`` output: the same elision, fresh lines."""
    head, tail = _split(step.shown, where)
    if tail is None:
        return actual
    if len(actual) <= len(head) + len(tail):  # nothing left to elide: show it all
        return actual
    dots = next(line for line in step.shown if line.strip() == ELISION)
    return actual[:len(head)] + [dots] + actual[len(actual) - len(tail):]


def differences(block: Block, outputs: list[list[str]]) -> list[str]:
    """A unified diff (timings masked) of what ``block`` shows against ``outputs``."""
    diff: list[str] = []
    for step, actual in zip(block.steps, outputs):
        want = [mask(x) for x in expected(step, actual, block.where)]
        shown = [mask(x) for x in step.shown]
        if want != shown:
            diff += list(difflib.unified_diff(shown, want, f"shown: $ {step.command}",
                                              "run", lineterm="", n=2))
    return diff


def rewritten(block: Block, outputs: list[list[str]]) -> list[str]:
    """The block's body with every step's output taken from ``outputs``."""
    body = []
    for step, actual in zip(block.steps, outputs):
        body += [PROMPT + step.command, *expected(step, actual, block.where)]
    return body


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pages", nargs="*", type=Path, help="pages to check (default: all)")
    ap.add_argument("--write", action="store_true",
                    help="rewrite every shown output from a fresh run of its commands")
    args = ap.parse_args(argv)
    todo = [p.resolve() for p in args.pages] or pages()
    failed = 0
    for page in todo:
        found = blocks(page)
        lines = page.read_text(encoding="utf-8").split("\n")
        for block in reversed(found):  # from the end, so earlier line numbers stay put
            try:
                outputs = run_block(block)
                diff = differences(block, outputs)
            except (ShownError, subprocess.TimeoutExpired) as err:
                print(f"{block.where}: {err}")
                failed += 1
                continue
            if not diff:
                print(f"{block.where}: ok")
                continue
            if args.write:
                lines[block.start + 1:block.end] = rewritten(block, outputs)
                print(f"{block.where}: rewritten")
            else:
                print(f"{block.where}: differs from a fresh run")
                print("\n".join("    " + d for d in diff))
                failed += 1
        if args.write:
            page.write_text("\n".join(lines), encoding="utf-8")
    return 1 if failed else 0


def dynatrain_commands(page: Path) -> list[tuple[int, list[str]]]:
    """(line number, argv after ``dynatrain``) of every ``dynatrain`` command in ```bash blocks.

    Continuation lines are joined, comments dropped, and a line is cut at ``&&``, ``||``,
    ``;`` and ``|``, so ``cd x && dynatrain plan A B`` yields ``[plan, A, B]``.
    """
    lines = page.read_text(encoding="utf-8").split("\n")
    found = []
    for start, end in fenced(lines, "bash"):
        i = start + 1
        while i < end:
            at, text = i, lines[i]
            while text.endswith("\\") and i + 1 < end:
                i += 1
                text = text[:-1] + " " + lines[i]
            i += 1
            lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            command: list[str] = []
            for word in [*lexer, ";"]:
                if word and set(word) <= set(";&|"):
                    if command and command[0] == "dynatrain":
                        found.append((at + 1, command[1:]))
                    command = []
                else:
                    command.append(word)
    return found


if __name__ == "__main__":
    sys.exit(main())
