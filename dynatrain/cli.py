"""``dynatrain`` command line: inspect layouts, plan, verify and run switches between them.

``run-plan`` runs a switch on this machine: one CPU process per device, random state, the
destination checked bit for bit.

Bad input prints one line naming the field and the rule, and exits with status 2. Exit
statuses (``ir/errors.py``): 0 success, 1 a plan breaks a rule or a switch is not bit-exact,
2 bad input, 3 state lost, 4 switch aborted (source state intact).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Iterable, Sequence

from .ir.errors import EXIT_BAD_INPUT, DynatrainError
from .ir.facts import rank_facts
from .ir.layout import Layout
from .ir.loader import load_spec
from .ir.summary import bytes_by_kind, format_count, largest_tensors, logical_parameter_count
from .ir.units import format_bytes, format_seconds, parse_bytes
from .planner.cost import PRESETS as TOPOLOGY_PRESETS
from .planner.suggest import MAX_SUGGEST_DEVICES
from .report.dot import MAX_DOT_MESSAGES
from .report.summary import plural
from .verify.report import VerificationError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's own convention)
        self.exit(2, f"dynatrain: error: {message}\n")


STDOUT = "-"  # every output option: write to standard output instead of a file


def _write(path: str, text: str, option: str = "--json") -> None:
    """``text`` to the file ``path``, or to stdout when ``path`` is ``-``."""
    _write_lines(path, (text,), option)


def _write_lines(path: str, lines: Iterable[str], option: str) -> None:
    """``_write`` for text produced a line at a time (a large plan's ``--text``)."""
    if path == STDOUT:
        sys.stdout.writelines(lines)
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(lines)
    except OSError as err:
        raise DynatrainError(f"{option}: cannot write {path!r} ({err.strerror or err})") from None


def _given(value: str | None, default: str) -> str:
    """An option's value, or ``default`` where it was not given (an empty ``--budget=`` is
    given, and refused as what it is, not taken for the default)."""
    return default if value is None else value


def _check_outputs(args: argparse.Namespace, *options: str) -> bool:
    """Refuse, before any work, output options that cannot all be written: two of them on
    stdout (``-``) or on one file, or a path in no existing directory. True when one of them
    takes stdout (the command then prints that output alone, not its summary)."""
    given = [(o, getattr(args, o.lstrip("-").replace("-", "_"))) for o in options]
    given = [(o, v) for o, v in given if v is not None]
    on_stdout = [o for o, v in given if v == STDOUT]
    if len(on_stdout) > 1:
        raise DynatrainError(f"{on_stdout[1]}: only one output can go to stdout ('-'); "
                             f"{on_stdout[0]} already does")
    files: dict[str, str] = {}  # the same file twice: the second output would replace the first
    for option, path in given:
        if path == STDOUT:
            continue
        same = files.setdefault(os.path.realpath(path), option) if path else option
        if same != option:
            raise DynatrainError(f"{option}: {path!r} is the file {same} writes already; give "
                                 "each output a file of its own")
        if not path or os.path.isdir(path):
            raise DynatrainError(f"{option}: cannot write {path!r} (it is a directory)"
                                 if path else f"{option}: expected a file name or '-'")
        parent = os.path.dirname(path) or "."
        if not os.path.isdir(parent):
            raise DynatrainError(f"{option}: cannot write {path!r} (no such directory "
                                 f"{parent!r})")
    return bool(on_stdout)


def _parse_ranks(text: str | None, world: int) -> list[int]:
    if text is None:
        return list(range(world))
    ranks: list[int] = []
    for part in text.split(","):
        lo, dash, hi = (x.strip() for x in part.partition("-"))
        # ASCII digits only: str.isdigit() and re's \d also accept other scripts' digits.
        if not re.fullmatch(r"[0-9]+", lo) or (dash and not re.fullmatch(r"[0-9]+", hi)):
            raise DynatrainError(f"--ranks: expected e.g. 0,3,8-15, digits 0-9 "
                                 f"(got {part[:40]!r})")
        # Lengths before int(): a 5000-digit rank is refused, not converted.
        if max(len(lo), len(hi)) > len(str(world)) or max(int(lo), int(hi or lo)) >= world:
            raise DynatrainError(f"--ranks: {part[:40]!r}: ranks must be below the world size "
                                 f"{world} (0-{world - 1})")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise DynatrainError(f"--ranks: {part!r}: the range is reversed; ranges run low-high "
                                 f"({b}-{a})")
        ranks.extend(range(a, b + 1))
    if len(set(ranks)) != len(ranks):  # the JSON would list its facts twice
        seen: set[int] = set()
        twice = next(r for r in ranks if r in seen or seen.add(r))
        raise DynatrainError(f"--ranks: rank {twice} is given twice; give each rank once")
    return ranks


def cmd_layout(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    _check_outputs(args, "--json")
    layout = Layout(load_spec(args.spec))
    if args.ranks is not None and not args.json:
        raise DynatrainError("--ranks: only applies with --json")
    if args.json:
        ranks = _parse_ranks(args.ranks, layout.world)
        doc = {"format": "dynatrain.layout/1", "spec": args.spec, "world": layout.world,
               "ranks": [rank_facts(layout, r) for r in ranks]}
        _write(args.json, json.dumps(doc, separators=(",", ":")) + "\n")
        return 0
    kinds = bytes_by_kind(layout)
    p, m = layout.parallel, layout.model
    nodes = sorted({d.split(":")[0] for d in layout.devices})
    lines = [
        f"{layout.spec.name or args.spec}",
        f"  world   {plural(layout.world, 'rank')} on {plural(len(nodes), 'node')} "
        f"({layout.devices[0]} .. {layout.devices[-1]})",
        f"  grid    tp={p.tp} cp={p.cp} dp={layout.dp} pp={p.pp}"
        + (f" vpp={p.vpp}" if p.vpp else "")
        + (f" | ep={p.ep} etp={p.expert_tp} edp={layout.edp}" if m.num_moe_experts else "")
        + f"  order {p.order}",
        f"  model   {m.num_layers} layers, hidden {m.hidden_size}, "
        f"{format_count(logical_parameter_count(layout))} parameters"
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
        lines.append(f"    {k.kind:<11} {k.dtype:<5} {format_bytes(k.min_bytes):>10} .. "
                     f"{format_bytes(k.max_bytes):>10}   {format_bytes(k.total_bytes):>10}")
    lines.append("  largest tensors")
    for key, shape, n in largest_tensors(layout):
        lines.append(f"    {key}  {list(shape)}  {format_count(n)} elements")
    lines.append(f"  computed in {time.perf_counter() - t0:.2f} s")
    print("\n".join(lines))
    return 0


def _reserve(text: str | None) -> int:
    return 0 if text is None else parse_bytes(text, "--reserve", allow_zero=True)


def _failed(text: str | None, spec_path: str):
    """``--failed`` as the set of source devices it names (a node: all its devices)."""
    if text is None:
        return frozenset()
    from .api import failed_devices

    return failed_devices(text, Layout(load_spec(spec_path)))


def _plan_checkpoint_load(args: argparse.Namespace, json_on_stdout: bool) -> int:
    """``dynatrain plan CKPT_DIR dst.yaml``: what loading the checkpoint would read, per device."""
    from .checkpoint import plan_load, format_load

    summary = plan_load(args.src, Layout(load_spec(args.dst))).summary()
    if not json_on_stdout:
        print(format_load(summary, per_device=args.per_device))
    if args.json:
        _write(args.json, json.dumps(summary, default=str) + "\n", "--json")
    return 0


# ``plan``'s options a checkpoint source (``plan CKPT_DIR dst.yaml``) honours: it reports what
# loading would read, and plans no switch.
_CHECKPOINT_OPTIONS = ("--json", "--per-device")


def _checkpoint_options(args: argparse.Namespace) -> None:
    """Refuse, in one line, an option ``plan CKPT_DIR dst`` would otherwise silently ignore."""
    given = {
        "--budget": args.budget is not None, "--topology": args.topology is not None,
        "--reserve": args.reserve is not None, "--text": args.text is not None,
        "--heatmap": args.heatmap is not None, "--dot": args.dot is not None,
        "--place": args.place is not None, "--failed": args.failed is not None,
        "--allow-lost": args.allow_lost, "--device": args.device is not None,
    }
    for option, on in given.items():
        if on:
            raise DynatrainError(f"{option}: not with a checkpoint directory as the source "
                                 f"(it reports what loading reads; it takes only "
                                 f"{' and '.join(_CHECKPOINT_OPTIONS)})")


def cmd_load(args: argparse.Namespace) -> int:
    from .checkpoint import LoadStats, format_load, load_planned, plan_load

    plan = plan_load(args.checkpoint, Layout(load_spec(args.dst)))
    stats = LoadStats()
    load_planned(plan, budget=parse_bytes(args.budget, "--budget"), stats=stats)
    print(format_load(plan.summary()))
    print(f"  loaded  {format_bytes(stats.bytes_read)} read in {stats.chunks} chunks, "
          f"{format_bytes(stats.bytes_written)} written into every destination rank's storage "
          f"in {stats.seconds:.2f} s (peak {format_bytes(stats.peak_in_flight)} in flight)")
    print("  checked only: the loaded storage is discarded and no file is written (a job loads "
          "the checkpoint itself, as this check did)")
    return 0


def cmd_spec(args: argparse.Namespace) -> int:
    from .ir.from_job import read_megatron
    from .ir.hf_config import (parse_assignments, read_hf_config, read_json_object,
                               spec_from_hf_config)
    from .ir.loader import spec_from_dict, spec_to_dict, spec_to_yaml_text

    _check_outputs(args, "--output")
    if (args.from_args is None) == (args.from_hf is None):
        raise DynatrainError("spec: give exactly one of --from-args ARGS.json or --from-hf "
                             "config.json")
    if args.from_args and args.parallel:
        raise DynatrainError("--parallel: not with --from-args (the arguments give the parallel "
                             "sizes: tensor_model_parallel_size, ...)")
    doc = read_json_object(args.from_args or args.from_hf,
                           "argument names" if args.from_args else "config keys")
    if args.from_args:
        world = (parse_assignments(args.world, "--world") if args.world
                 else {"world_size": doc.get("world_size"), "gpus_per_node": 8})
        job = read_megatron(doc, world, name=args.name)
        for line in ([job.warning()] if job.warning() else []) + list(job.notes):
            print(f"dynatrain: note: {line}", file=sys.stderr)
        spec = job.spec
    else:
        if not args.parallel or not args.world:
            raise DynatrainError("--from-hf: also give --parallel tp=8,pp=4 and --world "
                                 "nodes=16,gpus_per_node=8")
        unknown = read_hf_config(doc).unknown
        if unknown:
            print(f"dynatrain: note: config keys not used: {', '.join(sorted(unknown)[:12])}",
                  file=sys.stderr)
        spec = spec_from_hf_config(doc, parse_assignments(args.parallel, "--parallel"),
                                   parse_assignments(args.world, "--world"), name=args.name)
        if args.name is None:  # named like the shipped specs: what runs where, and how
            from .report.summary import grid

            layout = Layout(spec)
            what = doc.get("_name_or_path") or doc.get("model_type") or "model"
            what = os.path.basename(str(what).rstrip("/")) or "model"
            spec = spec_from_dict({**spec_to_dict(spec), "name": f"{what} (HuggingFace config) "
                                   f"on {plural(layout.world, 'GPU')}, {grid(layout).upper()}"})
    _write(args.output or STDOUT, spec_to_yaml_text(spec), "--output")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .api import plan
    from .report.summary import summary_lines

    # Every check that needs no plan comes first: a refusal must not cost a planning.
    on_stdout = _check_outputs(args, "--json", "--text", "--heatmap", "--dot")
    if args.allow_lost and args.failed is None:
        raise DynatrainError("--allow-lost: goes with --failed (without a failed device "
                             "nothing is lost)")
    if os.path.isdir(args.src):  # a megatron dist checkpoint as the source
        _checkpoint_options(args)
        return _plan_checkpoint_load(args, on_stdout)
    if args.device is not None:
        return _plan_device(args, on_stdout)
    if args.heatmap and args.heatmap != STDOUT:
        from .report.heatmap import check_heatmap_path

        check_heatmap_path(args.heatmap)
    if args.dot:
        from .report.dot import check_dot_path, check_dot_world

        if args.dot != STDOUT:
            check_dot_path(args.dot)
        src, dst = Layout(load_spec(args.src)), Layout(load_spec(args.dst))
        check_dot_world(src.devices, dst.devices)

    from .planner.lost import StateLost

    try:
        switch = plan(args.src, args.dst, budget=parse_bytes(_given(args.budget, DEFAULT_BUDGET),
                                                             "--budget"),
                      topology=_given(args.topology, DEFAULT_TOPOLOGY),
                      place=_given(args.place, "naive"),
                      reserve=_reserve(args.reserve),
                      failed=_failed(args.failed, args.src), allow_lost=args.allow_lost)
    except StateLost as lost:  # name every tensor, kind and range no survivor holds; exit 3
        from .planner.buddy import cover

        src_spec = load_spec(args.src)
        buddy = cover(src_spec, Layout(src_spec).devices, lost.lost.failed)
        if args.json != STDOUT:
            print(lost.lost.to_text())
            print(buddy.line())
        if args.json:
            _write(args.json, json.dumps({"format": "dynatrain.lost/1",
                                          "lost": lost.lost.to_json(),
                                          "buddy": buddy.to_json()}) + "\n", "--json")
        raise
    too_big = None
    if args.dot:  # a plan too large to draw: write every other output, then say so (exit 2)
        from .report.dot import check_dot_size

        try:
            check_dot_size(switch.plan)
        except DynatrainError as err:
            too_big = err
    if args.json:
        from .api import save_plan

        try:
            save_plan(switch, sys.stdout if args.json == STDOUT else args.json)
        except DynatrainError as err:  # name the option, as every other output does
            raise DynatrainError(f"--json: {err}") from None
    if args.heatmap:
        from .report.heatmap import write_heatmap

        if args.heatmap == STDOUT:
            sys.stdout.flush()
            write_heatmap(switch.plan, sys.stdout.buffer)
        else:
            write_heatmap(switch.plan, args.heatmap)
    if args.dot and too_big is None:
        from .report.dot import plan_to_dot, write_dot

        if args.dot == STDOUT:
            sys.stdout.write(plan_to_dot(switch.plan))
        else:
            write_dot(switch.plan, args.dot)
    if args.text:
        from .planner.text import plan_text_lines

        _write_lines(args.text, plan_text_lines(switch.plan), "--text")
    if not on_stdout:
        lines = summary_lines(switch)
        if args.per_device:
            lines.extend(_per_device_table(switch.plan))
        print("\n".join(lines))
    if too_big is not None:
        written = [o for o in ("--json", "--text", "--heatmap")
                   if getattr(args, o[2:]) not in (None, STDOUT)]
        raise DynatrainError(f"{too_big}" + (f"; {' and '.join(written)} written"
                                              if written else ""))
    return 0


def _slice_options(args: argparse.Namespace) -> None:
    """Refuse, in one line each, the ``plan`` options a slice (``--device``) cannot honour."""
    why = {
        "--place auto": ("slices take the destination as placed (choosing a placement needs "
                         "every device's traffic)", args.place == "auto"),
        "--failed": ("slices plan from every source holder; plan the whole switch to route "
                     "around failed devices", args.failed is not None),
        "--allow-lost": ("goes with --failed, which slices do not support", args.allow_lost),
        "--reserve": ("a slice's check leaves out the live-memory rule, which needs every "
                      "device's state", _reserve(args.reserve) != 0),
        "--heatmap": ("draws every device's traffic, not one device's", bool(args.heatmap)),
        "--dot": ("draws the whole plan, not one device's part", bool(args.dot)),
        "--per-device": ("lists every device; --device prints one", args.per_device),
    }
    for option, (rule, given) in why.items():
        if given:
            raise DynatrainError(f"{option}: not with --device: {rule}")
    if os.path.isdir(args.src):
        raise DynatrainError("--device: needs two layout specs, not a checkpoint directory")


def _plan_device(args: argparse.Namespace, on_stdout: bool) -> int:
    """``dynatrain plan A B --device D``: D's slice of the plan, computed and checked alone.

    The slice needs the plan's two global numbers (cut unit, rounds). A live job agrees on
    them with all-reduces (``plan_slice(agree=...)``); the CLI has no peers, so it takes them
    from the global plan, which it plans first.
    """
    from .planner.cost import load_topology
    from .planner.pipeline import plan_transition
    from .planner.schedule import peak_staging
    from .planner.slices import plan_slice
    from .verify.slice import verify_slice

    _slice_options(args)
    budget = parse_bytes(_given(args.budget, DEFAULT_BUDGET), "--budget")
    topology = load_topology(_given(args.topology, DEFAULT_TOPOLOGY))
    src, dst = Layout(load_spec(args.src)), Layout(load_spec(args.dst))
    dev = args.device
    if dev not in src.devices and dev not in dst.devices:
        raise DynatrainError(
            f"--device: {dev!r} is in neither layout (source {src.devices[0]} .. "
            f"{src.devices[-1]}, destination {dst.devices[0]} .. {dst.devices[-1]})")
    glob = plan_transition(src, dst, budget, topology)
    unit, rounds = glob.stats["spread"]
    part = plan_slice(src, dst, budget, dev, spread=(unit, rounds))
    report = verify_slice(part, src, dst, dev)
    msgs = list(part.messages())
    sent = [m for m in msgs if not m.local and m.src_device == dev]
    recv = [m for m in msgs if not m.local and m.dst_device == dev]
    local = [m for m in msgs if m.local]
    st = part.stats
    summary = dict(
        device=dev,
        src_rank=src.devices.index(dev) if dev in src.devices else None,
        dst_rank=dst.devices.index(dev) if dev in dst.devices else None,
        rounds=len(part.rounds), unit_bytes=unit,
        messages_sent=len(sent), messages_received=len(recv), local_copies=len(local),
        transfers=st["transfers"],
        bytes_sent=sum(m.nbytes for m in sent), bytes_received=sum(m.nbytes for m in recv),
        bytes_local=sum(m.nbytes for m in local),
        peak_staging_bytes=max((peak_staging(r).get(dev, 0) for r in part.rounds), default=0),
        budget_bytes=budget, slice_seconds=st["slice_seconds"],
        global_plan_seconds=glob.stats["plan_seconds"],
        verified=report.ok, verify_seconds=report.seconds)
    if args.json:
        from .ir.loader import spec_to_dict
        from .planner.serialize import plan_to_json

        doc = {"format": "dynatrain.slice/1", "summary": summary,
               "violations": [str(v) for v in report.violations],
               "plan": plan_to_json(part, spec_to_dict(src.spec),
                                    spec_to_dict(dst.spec, dst.devices))}
        _write(args.json, json.dumps(doc, separators=(",", ":")) + "\n", "--json")
    if args.text:
        from .planner.text import plan_text_lines

        _write_lines(args.text, plan_text_lines(part), "--text")
    if on_stdout:
        return 0 if report.ok else VerificationError.exit_code

    def rank(r: int | None) -> str:
        return "-" if r is None else str(r)

    s = summary
    lines = [
        f"{part.src_name}  ->  {part.dst_name}",
        f"  device    {dev} (source rank {rank(s['src_rank'])}, destination rank "
        f"{rank(s['dst_rank'])})",
        f"  rounds    {rounds} (cut unit {unit} B; unit and rounds from the global plan, "
        f"planned in {s['global_plan_seconds']:.3f} s)",
        f"  messages  {s['messages_sent']} sent, {s['messages_received']} received, "
        f"{plural(s['local_copies'], 'local copy', 'local copies')}; "
        f"{plural(s['transfers'], 'transfer')}",
        f"  bytes     sent {s['bytes_sent']} ({format_bytes(s['bytes_sent'])}), received "
        f"{s['bytes_received']} ({format_bytes(s['bytes_received'])}), local "
        f"{s['bytes_local']} ({format_bytes(s['bytes_local'])})",
        f"  staging   peak {s['peak_staging_bytes']} ({format_bytes(s['peak_staging_bytes'])}) "
        f"on this device, budget {format_bytes(budget)}",
        f"  slice     computed in {s['slice_seconds']:.3f} s",
        f"  verify_slice: {'ok' if report.ok else 'FAILED'} ({report.seconds:.3f} s)",
    ]
    lines += [f"    {v}" for v in report.violations[:10]]
    print("\n".join(lines))
    return 0 if report.ok else VerificationError.exit_code


def _per_device_table(plan) -> list[str]:
    """Every device: bytes in and out over NVLink and the network, local copies, busy time."""
    from .planner.cost import total_link_bytes
    from .report.heatmap import device_order

    per = total_link_bytes(plan)
    rank_of_src = {d: r for r, d in enumerate(plan.src_devices)}
    rank_of_dst = {d: r for r, d in enumerate(plan.dst_devices)}
    devices = device_order(plan)
    out = ["  per device            src  dst   nvl out    nvl in   net out    net in     local"]
    for d in devices:
        lb = per.get(d)
        cols = [lb.intra_out, lb.intra_in, lb.inter_out, lb.inter_in, lb.local] if lb else [0] * 5
        out.append(f"    {d:<18} {rank_of_src.get(d, '-'):>4} {rank_of_dst.get(d, '-'):>4} "
                   + " ".join(f"{format_bytes(c):>9}" for c in cols))
    return out


def cmd_verify(args: argparse.Namespace) -> int:
    from .api import load_plan, verify_switch

    budget = None if args.budget is None else parse_bytes(args.budget, "--budget")
    switch = load_plan(args.plan, src=args.src, dst=args.dst, topology=args.topology,
                       budget=budget, reserve=_reserve(args.reserve))
    if switch.device is not None and _reserve(args.reserve):
        raise DynatrainError("--reserve: not for a saved slice: a slice's check leaves out the "
                             "live-memory rule, which needs every device's state")
    report = verify_switch(switch)
    if switch.device is not None:
        print(f"slice of {switch.device} ({switch.plan.src_name} -> {switch.plan.dst_name}), "
              "checked as plan --device checks it (no device memory check):")
    print(report)
    return 0 if report.ok else VerificationError.exit_code


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
    # gloo logs a failed connection from C++ on stderr, beside the one line the failed switch
    # gets (read when torch loads, with runtime.local below)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    from .ir.state import transition_views
    from .api import plan as plan_switch
    from .planner.cost import PRESETS, predicted_downtime
    from .ir.summary import bytes_by_kind

    on_stdout = _check_outputs(args, "--json")
    if not 1 <= args.processes <= MAX_LOCAL_PROCESSES:
        raise DynatrainError(f"--processes: must be between 1 and {MAX_LOCAL_PROCESSES} "
                             f"(got {args.processes})")
    from .runtime.local import check_run_options

    check_run_options(args.timeout, args.seed)  # before anything is planned or forked
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
                             f"{format_bytes(need)} of memory, more than half of the "
                             f"{format_bytes(avail)} available; try smaller specs")
    budget = parse_bytes(args.budget, "--budget")
    plan = plan_switch(src, dst, budget=budget).plan

    from .runtime.local import run_local

    results = run_local(plan, sv, dv, seed=args.seed, timeout=args.timeout,
                        progress=not args.quiet, check_transfers=args.check_transfers)
    errors = [e for r in results for e in r["errors"]]
    st = plan.stats
    lines = [f"{plan.src_name}  ->  {plan.dst_name}",
             f"  processes {len(devices)} local (gloo), one per device; seed {args.seed}"]
    local = predicted_downtime(plan, PRESETS["gloo-local"], allocates=True)  # run-plan's do
    moved = sum(r["report"]["bytes_sent"] for r in results)
    seconds = max(r["seconds"] for r in results)
    peak = max(r["report"]["peak_staging_bytes"] for r in results)
    checked = sum(r["checked"] for r in results)
    lines += [
        f"  moved     {format_bytes(moved)} in {plural(len(plan.rounds), 'round')}, "
        f"{plural(st['messages'], 'message')} between devices; "
        f"{format_bytes(st['bytes_local'])} copied locally",
        f"  time      {format_seconds(seconds)} (slowest process); "
        f"{moved / seconds / 1e9:.2f} GB/s over all devices (bytes moved between devices over "
        f"the slowest process's time); predicted ~{format_seconds(local.total_seconds)} on "
        f"gloo-local (wire {format_seconds(local.wire_seconds)} + fixed "
        f"{format_seconds(local.fixed_seconds)} + allocating the destination "
        f"{format_seconds(local.first_touch_seconds)})",
        f"  staging   peak {format_bytes(peak)} per device (planned "
        f"{format_bytes(st['peak_staging_bytes'])}, budget {format_bytes(budget)})",
        f"  bit-exact: {'no' if errors else 'yes'} ({checked} destination tensors on "
        f"{len(plan.dst_devices)} ranks checked against the state built directly)",
    ]
    if args.check_transfers:
        check = max(r["report"]["check_seconds"] for r in results)
        lines.append(f"  transfers every fingerprint matched at both ends inside the switch "
                     f"({check:.3f} s)")
    if not on_stdout:
        print("\n".join(lines))
    for e in errors[:5]:
        print(f"  {e.splitlines()[0]}", file=sys.stderr)
    if args.json:
        doc = {"src": plan.src_name, "dst": plan.dst_name, "seed": args.seed,
               "bit_exact": not errors, "seconds": seconds, "plan": st,
               "processes": results}
        _write(args.json, json.dumps(doc, indent=1) + "\n", "--json")
    return 1 if errors else 0


def cmd_suggest(args: argparse.Namespace) -> int:
    from .api import failed_devices
    from .planner.cost import load_topology
    from .planner.suggest import parse_devices, suggest

    on_stdout = _check_outputs(args, "--json")
    spec = load_spec(args.spec)
    devices = parse_devices(args.devices, spec)
    failed = sorted(failed_devices(args.failed, Layout(spec))) if args.failed else ()
    out = suggest(spec, devices, top=args.top, topology=load_topology(args.topology),
                  reserve_bytes=_reserve(args.reserve),
                  budget_bytes=parse_bytes(args.budget, "--budget"), failed=failed)
    if not on_stdout:
        print(out.to_text())
    if args.json:
        _write(args.json, json.dumps(out.to_json(), indent=1) + "\n", "--json")
    return 0


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


def cmd_switch(args: argparse.Namespace) -> int:
    """Ask a running job for a layout through its store; print its answer in one line."""
    # c10d logs every failed connection attempt with a C++ stack trace: the one line of
    # ``connect`` says it (read when torch loads, with the store client's import below).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    from .ir.loader import spec_to_dict

    if not args.timeout > 0 or not args.connect_timeout > 0:
        raise DynatrainError("--timeout, --connect-timeout: must be seconds > 0")
    spec = load_spec(args.dst)
    Layout(spec)  # a layout that does not compile is refused here, not by the job
    # torch comes only with what talks to the store (seconds to import): bad input is
    # answered before it
    from .runtime.megatron.requests import connect, post_request, wait_answer

    store = connect(args.store, args.connect_timeout)
    n = post_request(store, spec_to_dict(spec), source=f"dynatrain switch {args.dst}")
    got = wait_answer(store, n, args.timeout)
    print(f"request {n}: {got.line}")
    return got.exit_code


def cmd_notice(args: argparse.Namespace) -> int:
    """Tell a running job that devices go away; print its answer in one line."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # as ``cmd_switch``
    import math

    from .ir.devices import parse_device_list
    from .ir.loader import spec_from_dict

    if not args.timeout > 0 or not args.connect_timeout > 0:
        raise DynatrainError("--timeout, --connect-timeout: must be seconds > 0")
    if not (math.isfinite(args.deadline) and args.deadline > 0):
        raise DynatrainError(f"--deadline: the seconds until the devices go away must be a "
                             f"number > 0 (got {args.deadline!r})")
    from .runtime.megatron.requests import (  # as cmd_switch
        connect, parse_document, post_notice, wait_answer)

    store = connect(args.store, args.connect_timeout)
    if not store.check(["current"]):
        raise DynatrainError(f"--store {args.store}: no job posts its layout there (is the job "
                             "running with LiveControl, under this prefix?)")
    current = parse_document(store.get("current"), f"--store {args.store}: current")
    if not isinstance(current.get("spec"), dict):
        raise DynatrainError(f"--store {args.store}: current: expected {{'spec': the job's "
                             "layout spec}} (is a job of this version posting there?)")
    world = spec_from_dict(current["spec"]).world
    leaving = parse_device_list(args.leaving, "--leaving", gpus_per_node=world.gpus_per_node,
                                listed=world.devices)
    n = post_notice(store, leaving, args.deadline, source=f"dynatrain notice {args.leaving}")
    got = wait_answer(store, n, args.timeout)
    print(f"request {n}: {got.line}")
    return got.exit_code


DEFAULT_BUDGET = "2GiB"
DEFAULT_TOPOLOGY = "h100"
BUDGET_HELP = ("staging memory per device, e.g. 2GiB or 512MiB (default 2GiB; a bare number "
               "means bytes); a budget so small that the plan would need over 1024 rounds is "
               "refused with the smallest budget that plans")
TOPOLOGY_HELP = (f"{', '.join(TOPOLOGY_PRESETS)} (default {DEFAULT_TOPOLOGY}) or a topology "
                 "YAML file (docs/topology.md)")
STDOUT_HELP = " ('-': stdout, in place of the summary; one output at most)"
RESERVE_HELP = ("device memory the job needs besides its state (activations, allocator cache, "
                "communicator buffers), counted by the memory check, e.g. 20GiB (default 0)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="dynatrain", description="Inspect layouts, plan, verify and run "
                 "switches between them. Exit statuses: 0 success, 1 a plan breaks a rule or a "
                 "switch is not bit-exact, 2 bad input, 3 state lost, 4 switch aborted.")
    sub = ap.add_subparsers(dest="cmd", parser_class=_Parser)
    lay = sub.add_parser("layout", help="summarize a layout spec, or dump per-rank facts")
    lay.add_argument("spec")
    lay.add_argument("--json", metavar="FILE", help="write per-rank facts as JSON" + STDOUT_HELP)
    lay.add_argument("--ranks", help="with --json: only these ranks, e.g. 0,3,8-15")
    lay.set_defaults(func=cmd_layout)
    pl = sub.add_parser("plan", help="plan a switch from one layout to another")
    pl.add_argument("src")
    pl.add_argument("dst")
    # Defaults None: a checkpoint source refuses these options when given (not ignore them).
    pl.add_argument("--budget", help=BUDGET_HELP)
    pl.add_argument("--topology", help=TOPOLOGY_HELP)
    pl.add_argument("--json", metavar="FILE",
                    help="write the plan and its summary as JSON" + STDOUT_HELP)
    pl.add_argument("--text", metavar="FILE",
                    help="write every round, message and transfer as text (docs/plan-text.md)"
                    + STDOUT_HELP)
    pl.add_argument("--heatmap", metavar="FILE.png",
                    help="draw the device x device traffic matrix with node boundaries (PNG)"
                    + STDOUT_HELP)
    pl.add_argument("--dot", metavar="FILE.dot",
                    help=f"write the round/message graph (Graphviz) of a plan of at most "
                         f"{MAX_DOT_MESSAGES} messages; a switch of more devices than that is "
                         f"refused before planning, a larger plan after the other outputs are "
                         f"written (exit 2)" + STDOUT_HELP)
    pl.add_argument("--place", choices=("naive", "auto"),
                    help="auto: choose which device runs each destination rank (TP groups kept "
                         "inside nodes) to move the fewest bytes; naive (default): rank r on "
                         "the r-th device")
    pl.add_argument("--per-device", action="store_true",
                    help="also print every device's traffic per link")
    pl.add_argument("--reserve", help=RESERVE_HELP)
    pl.add_argument("--failed", metavar="DEVICES",
                    help="source devices or nodes that died, in suggest --devices' syntax, e.g. "
                         "node3,node5:gpu2,node0:gpu0-7,node12-15: plan only "
                         "from surviving holders; what no survivor holds is named, exit 3")
    pl.add_argument("--allow-lost", action="store_true",
                    help="with --failed: plan what survives and record what is lost in the "
                         "plan, instead of exiting 3")
    pl.add_argument("--device", metavar="NODE:GPU",
                    help="print only this device's slice of the plan (its sends, receives and "
                         "local copies per round), checked alone by verify_slice; --json and "
                         "--text then hold the slice. A slice needs the plan's cut unit and "
                         "round count: here they come from the global plan, planned first (a "
                         "live job agrees on them with all-reduces instead). Not with --place "
                         "auto, --failed, --reserve, --heatmap, --dot or --per-device")
    pl.set_defaults(func=cmd_plan)
    ve = sub.add_parser("verify", help="re-verify a saved plan or slice (exit 1 if it breaks a "
                                       "rule; 2 if --src/--dst is not of the plan's model)")
    ve.add_argument("plan", metavar="PLAN.json",
                    help="from plan --json, or a slice from plan --device D --json")
    ve.add_argument("--src", metavar="SPEC", help="source spec (default: the one in the plan)")
    ve.add_argument("--dst", metavar="SPEC",
                    help="destination spec (default: the one in the plan, with its placement)")
    ve.add_argument("--budget", help="staging memory per device to hold the plan to "
                                     "(default: the budget the plan declares)")
    ve.add_argument("--topology", default=DEFAULT_TOPOLOGY,
                    help=TOPOLOGY_HELP + " (its memory_GB is the device memory checked)")
    ve.add_argument("--reserve", default="0", help=RESERVE_HELP)
    ve.set_defaults(func=cmd_verify)
    rp = sub.add_parser("run-plan", help="run a switch here: one CPU process per device, "
                                         "random state, checked bit for bit")
    rp.add_argument("src")
    rp.add_argument("dst")
    rp.add_argument("--processes", type=int, default=16,
                    help="the most local processes to start, one per device (default 16)")
    rp.add_argument("--budget", default="2GiB", help=BUDGET_HELP)
    rp.add_argument("--seed", type=int, default=0, help="seed of the random state (default 0)")
    rp.add_argument("--timeout", type=float, default=60.0,
                    help="seconds any one wait for peers may take (default 60)")
    rp.add_argument("--quiet", action="store_true", help="no per-round progress on stderr")
    rp.add_argument("--json", metavar="FILE",
                    help="write every process's switch report (bytes, rounds, seconds per "
                         "round, bandwidth, staging) and the plan's summary as JSON"
                         + STDOUT_HELP)
    rp.add_argument("--check-transfers", action="store_true",
                    help="inside the switch, compare a fingerprint of every transfer at its "
                         "destination with its source's before committing (the check a real "
                         "job can run without a reference state)")
    rp.set_defaults(func=cmd_run_plan)
    su = sub.add_parser("suggest", help="list the layouts of a spec's model that fit a set of "
                                         "devices, ranked by predicted switch time")
    su.add_argument("spec", help="the current layout")
    su.add_argument("--devices", required=True,
                    help="the devices to run on, e.g. node0:gpu0-5,node1,node4-7 (a node: all its "
                         "GPUs; gpu numbers below the spec's gpus_per_node; digits 0-9), at "
                         f"most {MAX_SUGGEST_DEVICES}: suggest plans its best candidates in "
                         "full, which takes about a minute at that size")
    su.add_argument("--reserve", default="0", help=RESERVE_HELP)
    su.add_argument("--top", type=int, default=5,
                    help="plan this many best candidates by bytes to move, rank by time")
    su.add_argument("--budget", default="2GiB", help=BUDGET_HELP)
    su.add_argument("--topology", default=DEFAULT_TOPOLOGY, help=TOPOLOGY_HELP)
    su.add_argument("--failed", help="source devices or nodes that failed, in --devices' syntax, "
                                     "e.g. node3,node5:gpu2,node12-15")
    su.add_argument("--json", metavar="FILE",
                    help="write the ranked layouts with their specs" + STDOUT_HELP)
    su.set_defaults(func=cmd_suggest)
    lo = sub.add_parser("load", help="check that a megatron dist checkpoint (torch_dist) loads "
                                     "into a layout, bit for bit: every destination rank's "
                                     "storage is filled in memory, then discarded (nothing is "
                                     "written)")
    lo.add_argument("checkpoint", metavar="CKPT_DIR")
    lo.add_argument("dst", help="destination layout spec")
    lo.add_argument("--budget", default="2GiB",
                    help="checkpoint chunks in flight at most (default 2GiB)")
    lo.set_defaults(func=cmd_load)
    sp = sub.add_parser("spec", help="write a layout spec from Megatron-LM's arguments or a "
                                     "HuggingFace config.json")
    sp.add_argument("--from-args", metavar="ARGS.json",
                    help="Megatron-LM's parsed arguments as JSON (vars(args))")
    sp.add_argument("--from-hf", metavar="CONFIG.json", help="a HuggingFace config.json")
    sp.add_argument("--parallel", help="with --from-hf: e.g. tp=8,pp=4,ep=8")
    sp.add_argument("--world", help="e.g. nodes=16,gpus_per_node=8 (with --from-args: default "
                                    "the args' world_size on 8 GPUs per node)")
    sp.add_argument("--name", help="the spec's name (default: what the arguments or config say "
                                   "runs where, e.g. 'llama (HuggingFace config) on 8 GPUs, "
                                   "TP2 PP1 DP4')")
    sp.add_argument("-o", "--output", metavar="FILE",
                    help="write the YAML here (default, or '-': stdout)")
    sp.set_defaults(func=cmd_spec)
    pr = sub.add_parser("prove", help="prove with z3 the region arithmetic plans rely on")
    pr.add_argument("lemma", nargs="*", help="lemma names (default: all)")
    pr.set_defaults(func=cmd_prove)
    sw = sub.add_parser("switch", help="ask a running job (LiveControl) for a new layout through "
                                       "its store; exit 0 switched, 2 refused (the job trains on "
                                       "unchanged), 4 failed and rolled back or no answer")
    sw.add_argument("dst", help="the layout spec to switch to")
    sw.add_argument("--store", required=True, metavar="HOST:PORT[/PREFIX]",
                    help="the job's store (under torchrun MASTER_ADDR:MASTER_PORT) and the "
                         "prefix of its rendezvous (default dynatrain)")
    sw.add_argument("--timeout", type=float, default=600.0,
                    help="seconds to wait for the job's answer (default 600)")
    sw.add_argument("--connect-timeout", type=float, default=10.0,
                    help="seconds to wait for the store to answer (default 10)")
    sw.set_defaults(func=cmd_switch)
    no = sub.add_parser("notice", help="tell a running job (LiveControl) that devices go away: "
                                       "it switches to the best layout on the rest before the "
                                       "deadline; exit 0 switched, 2 refused, 4 failed and "
                                       "rolled back or no answer")
    no.add_argument("--leaving", required=True, metavar="DEVICES",
                    help="the devices or nodes that go away, e.g. node3 or node1:gpu4-7")
    no.add_argument("--deadline", required=True, type=float, metavar="SECONDS",
                    help="seconds from now until they are gone")
    no.add_argument("--store", required=True, metavar="HOST:PORT[/PREFIX]",
                    help="the job's store and the prefix of its rendezvous (as for switch)")
    no.add_argument("--timeout", type=float, default=600.0,
                    help="seconds to wait for the job's answer (default 600)")
    no.add_argument("--connect-timeout", type=float, default=10.0,
                    help="seconds to wait for the store to answer (default 10)")
    no.set_defaults(func=cmd_notice)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:  # no command: say what there is, as --help does, and exit 2
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return int(args.func(args))
    except DynatrainError as err:
        print(f"dynatrain: error: {err}", file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:
        return 0


# Commands that only read specs and plan files and write their output before ``main``
# returns. Their process then ends without the interpreter's teardown: freeing the layouts
# the IR caches keep and a last full collection take 0.4 s after the 235B switch's plan (of
# about 3 s in all). Other commands (``run-plan`` forks workers) exit as usual.
QUICK_EXIT = frozenset({"layout", "plan", "verify"})


def entry() -> None:
    """The ``dynatrain`` command: ``main`` on ``sys.argv``, then exit with its status."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv and argv[0] in QUICK_EXIT:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe (`| head`): nothing more to say
                pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
