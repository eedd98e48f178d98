"""``dynatrain`` command line: inspect layouts, plan, verify and run switches between them.

``run-plan`` runs a switch on this machine: one CPU process per device, random state, the
destination checked bit for bit.

Bad input prints one line naming the field and the rule, and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Sequence

from .ir.errors import DynatrainError
from .ir.facts import rank_facts
from .ir.layout import Layout
from .ir.loader import load_spec, spec_from_dict, spec_to_dict
from .ir.summary import bytes_by_kind, largest_tensors, logical_parameter_count
from .verify.check import verify
from .verify.report import VerificationError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's own convention)
        self.exit(2, f"dynatrain: error: {message}\n")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _write(path: str, text: str, option: str = "--json") -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        raise DynatrainError(f"{option}: cannot write {path!r} ({err.strerror or err})") from None


def _parse_ranks(text: str | None, world: int) -> list[int]:
    if text is None:
        return list(range(world))
    ranks: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        # ASCII digits only, and short: str.isdigit() also accepts '²', which int() refuses.
        if not re.fullmatch(r"[0-9]{1,9}", lo.strip()) or (
                hi and not re.fullmatch(r"[0-9]{1,9}", hi.strip())):
            raise DynatrainError(f"--ranks: expected e.g. 0,3,8-15 (got {text[:40]!r})")
        a, b = int(lo), int(hi) if hi else int(lo)
        if not 0 <= a <= b < world:
            raise DynatrainError(f"--ranks: ranks must lie in [0, {world}) (got {part!r})")
        ranks.extend(range(a, b + 1))
    return ranks


def cmd_layout(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    layout = Layout(load_spec(args.spec))
    if args.ranks is not None and not args.json:
        raise DynatrainError("--ranks: only applies with --json")
    if args.json:
        ranks = _parse_ranks(args.ranks, layout.world)
        doc = {"format": "dynatrain.layout/1", "spec": args.spec, "world": layout.world,
               "ranks": [rank_facts(layout, r) for r in ranks]}
        text = json.dumps(doc, separators=(",", ":"))
        if args.json == "-":
            sys.stdout.write(text + "\n")
        else:
            _write(args.json, text)
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
        "  stages  " + " | ".join(
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


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1e9' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num) * _UNITS[unit]
    except (ValueError, KeyError):
        raise DynatrainError(f"--budget: expected a size like 2GiB or 512MiB (got {text!r})") from None
    if not 0 < value < 1 << 60:
        raise DynatrainError(f"--budget: must be positive (got {text!r})")
    return int(value)


def _grid(layout: Layout) -> str:
    p, m = layout.parallel, layout.model
    out = f"tp{p.tp} pp{p.pp}" + (f" vpp{p.vpp}" if p.vpp else "") + (
        f" cp{p.cp}" if p.cp > 1 else "") + f" dp{layout.dp}"
    if m.num_moe_experts:
        out += f" ep{p.ep} etp{p.expert_tp} edp{layout.edp}"
    return out + ("" if p.use_distributed_optimizer else " (no dist-opt)")


def cmd_plan(args: argparse.Namespace) -> int:
    from .planner.cost import load_topology
    from .planner.pipeline import plan_transition
    from .planner.serialize import plan_to_json

    src, dst = Layout(load_spec(args.src)), Layout(load_spec(args.dst))
    topo = load_topology(args.topology)
    plan = plan_transition(src, dst, parse_bytes(args.budget), topo, place=args.place)
    report = verify(plan, src, dst, topo, parse_bytes(args.budget))
    st = plan.stats
    st["verify_seconds"] = report.seconds
    if "peak_live_bytes" in report.checked:  # the topology gives a device memory capacity
        st["peak_live_bytes"] = report.checked["peak_live_bytes"]
    if not report.ok:  # never emit a plan that fails: say why, rule by rule
        print(report, file=sys.stderr)
        raise VerificationError(report)
    if args.json:
        doc = plan_to_json(plan, spec_to_dict(src.spec), spec_to_dict(dst.spec, plan.dst_devices))
        _write(args.json, json.dumps(doc, separators=(",", ":")), "--json")
    if args.heatmap:
        from .report.heatmap import write_heatmap

        write_heatmap(plan, args.heatmap)
    if args.dot:
        from .report.dot import write_dot

        write_dot(plan, args.dot)
    if args.text:
        from .planner.text import plan_to_text

        text = plan_to_text(plan)
        if args.text == "-":
            sys.stdout.write(text)
            return 0
        _write(args.text, text, "--text")
    moved_by_key: dict[str, int] = {}
    for m in plan.messages():
        if not m.local:
            for t in m.transfers:
                moved_by_key[t.key] = moved_by_key.get(t.key, 0) + t.nbytes
    lb = st["bytes_lower_bound"]
    ratio = st["predicted_seconds"] / st["lower_bound_seconds"] if st["lower_bound_seconds"] else 1.0
    lines = [
        f"{plan.src_name}  ->  {plan.dst_name}",
        f"  src     {_grid(src):<32} {src.world} devices",
        f"  dst     {_grid(dst):<32} {dst.world} devices"
        f" ({len(set(dst.devices) - set(src.devices))} new,"
        f" {len(set(src.devices) - set(dst.devices))} leaving)",
        f"  moved   {_fmt_bytes(st['bytes_moved'])} (lower bound {_fmt_bytes(lb)}"
        + (", optimal)" if st["bytes_moved"] == lb else f", {st['bytes_moved'] / max(lb, 1):.3f}x)"),
        f"  local   {_fmt_bytes(st['bytes_local'])} copied on the same device",
        f"  sends   {st['messages']} messages in {st['rounds']} rounds, "
        f"peak staging {_fmt_bytes(st['peak_staging_bytes'])} per device "
        f"(budget {_fmt_bytes(st['budget_bytes'])})",
        *([f"  memory  peak {_fmt_bytes(st['peak_live_bytes'])} per device while "
           f"switching (source and destination state plus staging; "
           f"{_fmt_bytes(int(topo.memory_GB * 1e9))} per device)"]
          if "peak_live_bytes" in st else []),
        f"  time    {st['predicted_seconds']:.3f} s predicted on {st['topology']} "
        f"(lower bound {st['lower_bound_seconds']:.3f} s, {ratio:.2f}x)",
        f"  planned in {st['plan_seconds']:.2f} s ({st['transfers']} transfers), verified in "
        f"{report.seconds:.2f} s (coverage, sources, expert owners, deadlock, memory)",
    ]
    if "naive_bytes_moved" in st:
        naive = st["naive_bytes_moved"]
        lines.insert(4, f"  place   auto: TP groups kept in nodes; moves "
                        f"{_fmt_bytes(naive - st['bytes_moved'])} less than rank r on device r "
                        f"({_fmt_bytes(naive)}, {st['naive_predicted_seconds']:.3f} s predicted)")
    if plan.derived:
        lines.insert(5, f"  derive  {', '.join(plan.derived)}: not sent; each destination rank "
                        "casts its main params, then all-gathers over DP (state.derive_param)")
    lines.append("  biggest movers")
    for key, n in sorted(moved_by_key.items(), key=lambda kv: (-kv[1], kv[0]))[:5]:
        lines.append(f"    {_fmt_bytes(n):>10}  {key}")
    if args.per_device:
        lines.extend(_per_device_table(plan))
    print("\n".join(lines))
    return 0


def _per_device_table(plan) -> list[str]:
    """Every device: bytes in and out over NVLink and the network, local copies, busy time."""
    from .planner.cost import link_bytes
    from .report.heatmap import device_order

    per = link_bytes(list(plan.messages()))
    rank_of_src = {d: r for r, d in enumerate(plan.src_devices)}
    rank_of_dst = {d: r for r, d in enumerate(plan.dst_devices)}
    devices = device_order(plan)
    out = ["  per device            src  dst   nvl out    nvl in   net out    net in     local"]
    for d in devices:
        lb = per.get(d)
        cols = [lb.intra_out, lb.intra_in, lb.inter_out, lb.inter_in, lb.local] if lb else [0] * 5
        out.append(f"    {d:<18} {rank_of_src.get(d, '-'):>4} {rank_of_dst.get(d, '-'):>4} "
                   + " ".join(f"{_fmt_bytes(c):>9}" for c in cols))
    return out


MAX_PLAN_BYTES = 1 << 31  # a plan file larger than this is refused, not read


def cmd_verify(args: argparse.Namespace) -> int:
    from .planner.cost import load_topology
    from .planner.serialize import plan_from_json

    try:
        with open(args.plan, "rb") as f:
            data = f.read(MAX_PLAN_BYTES + 1)
    except OSError as err:
        raise DynatrainError(f"{args.plan}: cannot read ({err.strerror or err})") from None
    if len(data) > MAX_PLAN_BYTES:
        raise DynatrainError(f"{args.plan}: a plan file must be at most {MAX_PLAN_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as err:
        raise DynatrainError(f"{args.plan}: not JSON ({str(err).splitlines()[0][:80]})") from None
    plan = plan_from_json(doc)
    specs = []
    for side, path in (("src", args.src), ("dst", args.dst)):
        if path is not None:
            specs.append(load_spec(path))
        elif isinstance(doc.get(f"{side}_spec"), dict):
            specs.append(spec_from_dict(doc[f"{side}_spec"], f"{args.plan}: {side}_spec"))
        else:
            raise DynatrainError(f"{args.plan}: no {side}_spec in the plan; pass --{side} SPEC")
    budget = parse_bytes(args.budget) if args.budget is not None else None
    report = verify(plan, Layout(specs[0]), Layout(specs[1]), load_topology(args.topology), budget)
    print(report)
    return 0 if report.ok else 1


MAX_LOCAL_PROCESSES = 64  # --processes cannot go above this
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "int64": 8}


def _available_memory() -> int | None:
    """Bytes of memory the kernel says are available (Linux), else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cmd_run_plan(args: argparse.Namespace) -> int:
    from .ir.state import transition_views
    from .ir.summary import bytes_by_kind
    from .planner.pipeline import plan_transition

    if not 1 <= args.processes <= MAX_LOCAL_PROCESSES:
        raise DynatrainError(f"--processes: must be between 1 and {MAX_LOCAL_PROCESSES} "
                             f"(got {args.processes})")
    if args.timeout <= 0:
        raise DynatrainError(f"--timeout: must be positive seconds (got {args.timeout})")
    src, dst = Layout(load_spec(args.src)), Layout(load_spec(args.dst))
    devices = sorted(set(src.devices) | set(dst.devices))
    if len(devices) > args.processes:
        raise DynatrainError(f"run-plan: the switch spans {len(devices)} devices, too many to "
                             f"run as local processes (at most {args.processes}, --processes); "
                             f"try smaller specs, e.g. specs/tiny-gpt/")
    # Every process draws the whole logical state, then builds its ranks: refuse what will not
    # fit rather than let the machine swap or kill processes.
    sv, dv = transition_views(src, dst)  # with the vocab padding rows the switch carries
    logical = sum(t.numel * _DTYPE_BYTES.get(t.dtype, 8) for t in sv.tensors().values())
    ranks = sum(k.total_bytes for k in bytes_by_kind(src)) + 2 * sum(
        k.total_bytes for k in bytes_by_kind(dst))
    need = len(devices) * logical + ranks
    avail = _available_memory()
    if avail is not None and need > avail // 2:
        raise DynatrainError(f"run-plan: running this switch locally needs about "
                             f"{_fmt_bytes(need)} of memory, more than half of the "
                             f"{_fmt_bytes(avail)} available; try smaller specs")
    budget = parse_bytes(args.budget)
    plan = plan_transition(src, dst, budget)
    report = verify(plan, src, dst, None, budget)
    if not report.ok:
        print(report, file=sys.stderr)
        raise VerificationError(report)

    from .runtime.local import run_local

    results = run_local(plan, sv, dv, seed=args.seed, timeout=args.timeout,
                        progress=not args.quiet, check_transfers=args.check_transfers)
    errors = [e for r in results for e in r["errors"]]
    st = plan.stats
    lines = [f"{plan.src_name}  ->  {plan.dst_name}",
             f"  processes {len(devices)} local (gloo), one per device; seed {args.seed}"]
    if any("report" not in r for r in results):
        print("\n".join(lines + ["  switch    did not commit"]))
        for e in errors[:5]:
            print(f"  {e.splitlines()[0]}", file=sys.stderr)
        return 1
    moved = sum(r["report"]["bytes_sent"] for r in results)
    seconds = max(r["seconds"] for r in results)
    peak = max(r["report"]["peak_staging_bytes"] for r in results)
    checked = sum(r["checked"] for r in results)
    lines += [
        f"  moved     {_fmt_bytes(moved)} in {len(plan.rounds)} round(s), "
        f"{st['messages']} messages; {_fmt_bytes(st['bytes_local'])} copied locally",
        f"  time      {seconds:.3f} s (slowest process), {moved / seconds / 1e9:.2f} GB/s achieved",
        f"  staging   peak {_fmt_bytes(peak)} per device (planned "
        f"{_fmt_bytes(st['peak_staging_bytes'])}, budget {_fmt_bytes(budget)})",
        f"  bit-exact: {'no' if errors else 'yes'} ({checked} destination tensors on "
        f"{len(plan.dst_devices)} ranks checked against the state built directly)",
    ]
    if args.check_transfers:
        check = max(r["report"]["check_seconds"] for r in results)
        lines.append(f"  transfers every fingerprint matched at both ends inside the switch "
                     f"({check:.3f} s)")
    print("\n".join(lines))
    for e in errors[:5]:
        print(f"  {e.splitlines()[0]}", file=sys.stderr)
    if args.json:
        doc = {"src": plan.src_name, "dst": plan.dst_name, "seed": args.seed,
               "bit_exact": not errors, "seconds": seconds, "plan": st,
               "processes": results}
        _write(args.json, json.dumps(doc, indent=1) + "\n", "--json")
    return 1 if errors else 0


def cmd_prove(args: argparse.Namespace) -> int:
    from .verify.lemmas import LEMMAS, prove

    names = args.lemma or list(LEMMAS)
    unknown = [n for n in names if n not in LEMMAS]
    if unknown:
        raise DynatrainError(f"prove: no lemma {unknown[0]!r} (known: {', '.join(LEMMAS)})")
    failed = 0
    for name in names:
        r = prove(name)
        failed += not r.proved
        verdict = "proved" if r.proved else (
            f"FAILED, counterexample {r.counterexample}" if r.counterexample else "FAILED (timeout)")
        print(f"  {name:<30} {verdict:<10} {r.seconds:6.3f} s")
    print(f"{len(names) - failed} of {len(names)} lemmas proved for all sizes and ranks (z3)")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="dynatrain", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    lay = sub.add_parser("layout", help="summarize a layout spec, or dump per-rank facts")
    lay.add_argument("spec")
    lay.add_argument("--json", metavar="FILE", help="write per-rank facts as JSON ('-': stdout)")
    lay.add_argument("--ranks", help="with --json: only these ranks, e.g. 0,3,8-15")
    lay.set_defaults(func=cmd_layout)
    pl = sub.add_parser("plan", help="plan a switch from one layout to another")
    pl.add_argument("src")
    pl.add_argument("dst")
    pl.add_argument("--budget", default="2GiB", help="staging memory per device (default 2GiB)")
    pl.add_argument("--topology", default="h100", help="h100, h800 or a topology YAML file")
    pl.add_argument("--json", metavar="FILE", help="write the plan and its summary as JSON")
    pl.add_argument("--text", metavar="FILE",
                    help="write every round, message and transfer as text ('-': stdout only)")
    pl.add_argument("--heatmap", metavar="FILE.png",
                    help="draw the device x device traffic matrix with node boundaries")
    pl.add_argument("--dot", metavar="FILE.dot",
                    help="write the round/message graph (Graphviz) of a small plan")
    pl.add_argument("--place", choices=("naive", "auto"), default="naive",
                    help="auto: choose which device runs each destination rank (TP groups kept "
                         "inside nodes) to move the fewest bytes; naive: rank r on the r-th device")
    pl.add_argument("--per-device", action="store_true",
                    help="also print every device's traffic per link")
    pl.set_defaults(func=cmd_plan)
    ve = sub.add_parser("verify", help="re-verify a saved plan (exit 1 if it breaks a rule)")
    ve.add_argument("plan", metavar="PLAN.json")
    ve.add_argument("--src", metavar="SPEC", help="source spec (default: the one in the plan)")
    ve.add_argument("--dst", metavar="SPEC",
                    help="destination spec (default: the one in the plan, with its placement)")
    ve.add_argument("--budget", help="staging memory per device to hold the plan to "
                                     "(default: the budget the plan declares)")
    ve.add_argument("--topology", default="h100",
                    help="h100, h800 or a topology YAML file (device memory capacity)")
    ve.set_defaults(func=cmd_verify)
    rp = sub.add_parser("run-plan", help="run a switch here: one CPU process per device, "
                                         "random state, checked bit for bit")
    rp.add_argument("src")
    rp.add_argument("dst")
    rp.add_argument("--processes", type=int, default=16,
                    help="the most local processes to start, one per device (default 16)")
    rp.add_argument("--budget", default="2GiB", help="staging memory per device (default 2GiB)")
    rp.add_argument("--seed", type=int, default=0, help="seed of the random state (default 0)")
    rp.add_argument("--timeout", type=float, default=60.0,
                    help="seconds any one wait for peers may take (default 60)")
    rp.add_argument("--quiet", action="store_true", help="no per-round progress on stderr")
    rp.add_argument("--json", metavar="FILE",
                    help="write every process's switch report (bytes, rounds, seconds per "
                         "round, bandwidth, staging) and the plan's summary as JSON")
    rp.add_argument("--check-transfers", action="store_true",
                    help="inside the switch, compare a fingerprint of every transfer at its "
                         "destination with its source's before committing (the check a real "
                         "job can run without a reference state)")
    rp.set_defaults(func=cmd_run_plan)
    pr = sub.add_parser("prove", help="prove with z3 the region arithmetic plans rely on")
    pr.add_argument("lemma", nargs="*", help="lemma names (default: all)")
    pr.set_defaults(func=cmd_prove)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except DynatrainError as err:
        print(f"dynatrain: error: {err}", file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
