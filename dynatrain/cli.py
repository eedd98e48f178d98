"""``dynatrain`` command line: inspect layouts (and, as the planner lands, plans).

Bad input prints one line naming the field and the rule, and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from .ir.errors import DynatrainError
from .ir.facts import rank_facts
from .ir.layout import Layout
from .ir.loader import load_spec
from .ir.summary import bytes_by_kind, largest_tensors, logical_parameter_count


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's own convention)
        self.exit(2, f"dynatrain: error: {message}\n")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _parse_ranks(text: str | None, world: int) -> list[int]:
    if text is None:
        return list(range(world))
    ranks: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if not lo.strip().isdigit() or (hi and not hi.strip().isdigit()):
            raise DynatrainError(f"--ranks: expected e.g. 0,3,8-15 (got {text!r})")
        a, b = int(lo), int(hi) if hi else int(lo)
        if not 0 <= a <= b < world:
            raise DynatrainError(f"--ranks: ranks must lie in [0, {world}) (got {part!r})")
        ranks.extend(range(a, b + 1))
    return ranks


def cmd_layout(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    layout = Layout(load_spec(args.spec))
    if args.json:
        ranks = _parse_ranks(args.ranks, layout.world)
        doc = {"format": "dynatrain.layout/1", "spec": args.spec, "world": layout.world,
               "ranks": [rank_facts(layout, r) for r in ranks]}
        text = json.dumps(doc, separators=(",", ":"))
        if args.json == "-":
            sys.stdout.write(text + "\n")
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text)
        return 0
    kinds = bytes_by_kind(layout)
    p, m = layout.parallel, layout.model
    nodes = sorted({d.split(":")[0] for d in layout.devices})
    lines = [
        f"{layout.spec.name or args.spec}",
        f"  world   {layout.world} ranks on {len(nodes)} nodes "
        f"({layout.devices[0]} .. {layout.devices[-1]})",
        f"  grid    tp={p.tp} cp={p.cp} dp={layout.dp} pp={p.pp}"
        + (f" vpp={p.vpp}" if p.vpp else "")
        + (f" | ep={p.ep} etp={p.expert_tp} edp={layout.edp}" if m.num_moe_experts else "")
        + f"  order {p.order}",
        f"  model   {m.num_layers} layers, hidden {m.hidden_size}, "
        f"{logical_parameter_count(layout) / 1e9:.2f} B parameters"
        + (f", {m.num_moe_experts} experts top-{m.moe_router_topk}" if m.num_moe_experts else "")
        + f", vocab {m.vocab_size} -> {layout.padded_vocab} padded",
        f"  stages  " + " | ".join(
            f"pp{pp}:" + "+".join(str(len(c.layers)) for c in layout.chunks(pp))
            for pp in range(p.pp)),
        f"  optim   {'distributed' if p.use_distributed_optimizer else 'replicated'}"
        f" over dp*cp={layout.dp * p.cp}",
        "  state per rank (min .. max)          total over ranks",
    ]
    for k in kinds:
        lines.append(f"    {k.kind:<11} {k.dtype:<5} {_fmt_bytes(k.min_bytes):>10} .. "
                     f"{_fmt_bytes(k.max_bytes):>10}   {_fmt_bytes(k.total_bytes):>10}")
    lines.append("  largest tensors")
    for key, shape, n in largest_tensors(layout):
        lines.append(f"    {key}  {list(shape)}  {n / 1e6:.1f} M")
    lines.append(f"  computed in {time.perf_counter() - t0:.2f} s")
    print("\n".join(lines))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="dynatrain", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    lay = sub.add_parser("layout", help="summarize a layout spec, or dump per-rank facts")
    lay.add_argument("spec")
    lay.add_argument("--json", metavar="FILE", help="write per-rank facts as JSON ('-': stdout)")
    lay.add_argument("--ranks", help="with --json: only these ranks, e.g. 0,3,8-15")
    lay.set_defaults(func=cmd_layout)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except DynatrainError as err:
        print(f"dynatrain: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
