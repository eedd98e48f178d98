"""The Python API: the handful of calls a user needs, the same checks as the CLI.

    >>> import dynatrain as dt
    >>> src = dt.load_layout("specs/llama3.1-70b/tp8-pp4-dp4.yaml")
    >>> dst = dt.load_layout("specs/llama3.1-70b/tp8-pp8-dp2.yaml")
    >>> switch = dt.plan(src, dst, budget="2GiB")        # planned and verified
    >>> print(dt.summarize(switch))                       # what `dynatrain plan` prints
    >>> dt.save_plan(switch, "plan.json")                 # `dynatrain verify plan.json` reads it
    >>> dt.verify_switch(dt.load_plan("plan.json")).ok
    True

``suggest`` ranks the layouts that fit a set of devices. ``run_local`` runs a small switch
here (one CPU process per device, gloo); ``LiveSwitcher`` switches a running Megatron job. Both
need torch and are imported only when used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, TextIO

from .ir.errors import DynatrainError
from .ir.layout import Layout
from .ir.loader import load_spec, spec_from_dict, spec_to_dict
from .ir.spec import LayoutSpec
from .ir.strict import DuplicateKeyError, json_loads, read_bounded
from .ir.units import parse_bytes
from .planner.cost import Topology, load_topology, predicted_downtime
from .planner.pipeline import plan_transition
from .planner.plan import Plan
from .planner.serialize import plan_from_json, write_plan_json
from .verify.check import verify as _verify
from .verify.report import VerificationError, VerifyReport

DEFAULT_BUDGET = "2GiB"
MAX_PLAN_BYTES = 1 << 31  # a plan file larger than this is refused, not read


@dataclass(frozen=True)
class PlannedSwitch:
    """A plan with everything needed to check, describe, save or run it.

    ``report`` is the verification the plan passed (None for a plan read from a file and not
    verified yet). ``reserve_bytes``: device memory the job itself needs besides its state,
    counted by the memory check.
    """

    plan: Plan
    src: Layout
    dst: Layout
    topology: Topology
    budget_bytes: int
    reserve_bytes: int = 0
    report: VerifyReport | None = field(default=None, compare=False)
    device: str | None = None  # a saved slice (``plan --device D --json``): D; else None

    @property
    def stats(self) -> dict:
        """The plan's summary numbers (``bytes_moved``, ``rounds``, ``predicted_seconds``...)."""
        return self.plan.stats


def load_layout(spec: str | os.PathLike[str] | dict | LayoutSpec | Layout) -> Layout:
    """A layout from a spec file path, a spec document (dict) or a parsed ``LayoutSpec``."""
    if isinstance(spec, Layout):
        return spec
    if isinstance(spec, LayoutSpec):
        return Layout(spec)
    if isinstance(spec, dict):
        return Layout(spec_from_dict(spec))
    return Layout(load_spec(spec))


def _topology(topology: str | Topology | None) -> Topology | None:
    return topology if topology is None or isinstance(topology, Topology) else load_topology(
        topology)


def plan(src: Any, dst: Any, *, budget: str | int = DEFAULT_BUDGET,
         topology: str | Topology = "h100", place: str = "naive",
         reserve: str | int = 0, failed: str | Any = (),
         allow_lost: bool = False) -> PlannedSwitch:
    """Plan and verify the switch from ``src`` to ``dst`` (layouts, spec paths or documents).

    ``budget``: staging memory per device, in any unit ("2GiB", "512MiB", or bytes as an int).
    ``reserve``: device memory the job needs besides its state (activations, allocator cache,
    communicator buffers), counted by the memory check. ``place="auto"`` chooses which device
    runs each destination rank to move the fewest bytes. ``failed``: source devices that are
    gone without notice (a list, or text such as ``"node3,node5:gpu2"``; a node means all its
    devices): the plan takes everything from surviving holders.

    Raises:
        StateLost: some state the destination needs has no surviving copy (``.lost`` names
            every tensor, kind and range); with ``allow_lost`` the plan moves what survives
            instead and ``stats["lost"]`` holds the report.
        VerificationError: the plan breaks a rule (it is never returned).
        DynatrainError: bad input (names the field).
    """
    s, d = load_layout(src), load_layout(dst)
    budget_bytes = parse_bytes(budget, "budget")
    reserve_bytes = _reserve(reserve)
    topo = _topology(topology)
    gone = failed_devices(failed, s) if failed else frozenset()
    p = plan_transition(s, d, budget_bytes, topo, place=place, failed=gone,
                        allow_lost=allow_lost)
    # predicted_seconds stays the wire time the scheduler minimises; downtime adds fixed costs.
    p.stats["predicted_downtime"] = predicted_downtime(p, topo).as_dict()
    report = _verify(p, s, d, topo, budget_bytes, reserve_bytes=reserve_bytes)
    _record(p, report)
    if not report.ok:
        raise VerificationError(report)
    return PlannedSwitch(p, s, d, topo, budget_bytes, reserve_bytes, report)


def failed_devices(failed: str | Any, src: Layout) -> frozenset[str]:
    """The source devices ``failed`` names: text in ``--devices``'s syntax (``node3``,
    ``node12-15``, ``node0:gpu0-7``; ``ir.devices``) or a list of device and node names."""
    from .ir.devices import parse_device_list
    from .planner.lost import expand_failed

    if isinstance(failed, str):
        w = src.spec.world
        failed = parse_device_list(failed, "--failed", gpus_per_node=w.gpus_per_node,
                                   listed=w.devices, max_devices=len(src.devices),
                                   bound="all the source layout has")
    return expand_failed(failed, src.devices)


def verify_switch(switch: PlannedSwitch, *, topology: str | Topology | None = None,
           budget: str | int | None = None, reserve: str | int | None = None) -> VerifyReport:
    """Verify a plan with the checks ``dynatrain plan`` and ``dynatrain verify`` run: the five
    rules, the staging budget and device memory (state plus staging plus the reserve).
    A saved slice (``switch.device`` set) gets the checks ``plan --device`` runs: the rules as
    they concern that device, and its staging within the budget (no device memory check,
    which needs every device's state).

    ``topology``/``budget``/``reserve`` override the switch's own (a budget above the plan's
    declared one is not a way to pass). Returns the report; it does not raise on violations.
    """
    topo = switch.topology if topology is None else _topology(topology)
    budget_bytes = switch.budget_bytes if budget is None else parse_bytes(budget, "budget")
    reserve_bytes = switch.reserve_bytes if reserve is None else _reserve(reserve)
    if switch.device is not None:  # a slice: the checks plan --device ran on it
        from .verify.slice import verify_slice

        return verify_slice(switch.plan, switch.src, switch.dst, switch.device, budget_bytes)
    report = _verify(switch.plan, switch.src, switch.dst, topo, budget_bytes,
                     reserve_bytes=reserve_bytes)
    _record(switch.plan, report)
    return report


def summarize(switch: PlannedSwitch) -> str:
    """The human summary ``dynatrain plan`` prints (moved bytes, rounds, memory, time)."""
    from .report.summary import summary_lines

    return "\n".join(summary_lines(switch))


def save_plan(switch: PlannedSwitch, path: str | os.PathLike[str] | TextIO) -> None:
    """Write the plan as ``dynatrain.plan/3`` JSON with both specs embedded (self-contained),
    to a file path or an open text stream (``sys.stdout``)."""
    specs = (spec_to_dict(switch.src.spec), spec_to_dict(switch.dst.spec, switch.plan.dst_devices))
    if hasattr(path, "write"):
        write_plan_json(switch.plan, path, *specs)
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            write_plan_json(switch.plan, f, *specs)
    except OSError as err:
        raise DynatrainError(f"{os.fspath(path)}: cannot write ({err.strerror or err})") from None


SLICE_FORMAT = "dynatrain.slice/1"  # ``dynatrain plan A B --device D --json``
_SLICE_KEYS = ("format", "summary", "violations", "plan")


def load_plan(path: str | os.PathLike[str], *, src: Any = None, dst: Any = None,
              topology: str | Topology = "h100", budget: str | int | None = None,
              reserve: str | int = 0) -> PlannedSwitch:
    """Read a plan file back, with the specs it embeds (or ``src``/``dst`` given here).

    A saved slice (``dynatrain.slice/1``, one device's part) reads back too, with ``device``
    set: ``verify_switch`` then checks it as ``plan --device`` did. A given ``src``/``dst``
    must be a layout of the plan's model and state kinds with as many ranks as the plan's
    side; else the plan is not about it, and that is refused (bad input), not reported as
    violations.

    The result is not verified: call ``verify_switch`` on it. Raises ``DynatrainError`` (one line)
    on a file that is missing, too large, not JSON or not a well-formed plan.
    """
    name = os.fspath(path)
    try:
        data = read_bounded(path, MAX_PLAN_BYTES)
    except OSError as err:
        raise DynatrainError(f"{name}: cannot read ({err.strerror or err})") from None
    if len(data) > MAX_PLAN_BYTES:
        raise DynatrainError(f"{name}: a plan file must be at most {MAX_PLAN_BYTES} bytes")
    try:
        doc = json_loads(data)
    except DuplicateKeyError as err:
        raise DynatrainError(f"{name}: {err}") from None
    except (ValueError, RecursionError) as err:
        raise DynatrainError(f"{name}: not JSON ({str(err).splitlines()[0][:80]})") from None
    device = None
    if isinstance(doc, dict) and doc.get("format") == SLICE_FORMAT:
        device, doc = _slice_document(doc, name)
    p = plan_from_json(doc)
    layouts = []
    for side, given, devices in (("src", src, p.src_devices), ("dst", dst, p.dst_devices)):
        embedded = doc.get(f"{side}_spec")
        if isinstance(embedded, dict):
            embedded = spec_from_dict(embedded, f"{name}: {side}_spec")
        if given is not None:
            layout = load_layout(given)
            _same_model(side, layout, embedded, len(devices), given)
            layouts.append(layout)
        elif isinstance(embedded, LayoutSpec):
            layouts.append(Layout(embedded))
        else:
            raise DynatrainError(f"{name}: no {side}_spec in the plan; pass --{side} SPEC")
    if device is not None and device not in p.src_devices + p.dst_devices:
        raise DynatrainError(f"{name}: summary.device {device!r} is in neither side of the "
                             "slice's plan")
    budget_bytes = p.budget_bytes if budget is None else parse_bytes(budget, "budget")
    return PlannedSwitch(p, layouts[0], layouts[1], _topology(topology), budget_bytes,
                         _reserve(reserve), device=device)


def _slice_document(doc: dict, name: str) -> tuple[str, Any]:
    """(device, plan document) of a saved slice, its few keys checked."""
    for k in doc:
        if k not in _SLICE_KEYS:
            raise DynatrainError(f"{name}: unknown key {str(k)[:40]!r} in a {SLICE_FORMAT} "
                                 f"document; the keys are {', '.join(_SLICE_KEYS)}")
    summary = doc.get("summary")
    if not isinstance(summary, dict) or not isinstance(summary.get("device"), str):
        raise DynatrainError(f"{name}: summary.device must name the slice's device (a "
                             f"{SLICE_FORMAT} document, from plan --device D --json)")
    if not isinstance(doc.get("plan"), dict):
        raise DynatrainError(f"{name}: plan must be the slice's plan document (an object)")
    return summary["device"], doc["plan"]


def _same_model(side: str, layout: Layout, embedded: LayoutSpec | None, ranks: int,
                given: Any) -> None:
    """Refuse a ``--src``/``--dst`` layout the plan cannot be about, naming what differs."""
    shown = os.fspath(given) if isinstance(given, (str, os.PathLike)) else "the given layout"
    if embedded is not None:
        for section in ("model", "state"):
            mine, theirs = getattr(layout.spec, section), getattr(embedded, section)
            for f in type(mine).model_fields:
                a, b = getattr(mine, f), getattr(theirs, f)
                if a != b:
                    raise DynatrainError(
                        f"--{side}: {shown} is not a layout of the plan's {side} {section}: "
                        f"{section}.{f} is {_brief(a)}, the plan's is {_brief(b)}")
    if layout.world != ranks:
        raise DynatrainError(f"--{side}: {shown} has {layout.world} ranks; the plan's {side} "
                             f"has {ranks}")


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def run_local(switch: PlannedSwitch, *, seed: int = 0, timeout: float = 60.0,
              progress: bool = False, check_transfers: bool = False) -> list[dict]:
    """Run the switch on this machine, one CPU process per device (gloo), from random state,
    and compare every destination tensor bit for bit. Each process's result, device order.
    Needs torch; meant for small specs (e.g. ``specs/tiny-gpt``)."""
    from .ir.state import transition_views
    from .runtime.local import run_local as _run

    sv, dv = transition_views(switch.src, switch.dst)
    return _run(switch.plan, sv, dv, seed=seed, timeout=timeout, progress=progress,
                check_transfers=check_transfers)


def suggest(src: Any, devices: str | list[str], *, reserve: str | int = 0, top: int = 5,
            topology: str | Topology = "h100", budget: str | int = DEFAULT_BUDGET,
            failed: Any = ()):
    """The layouts of ``src``'s model that fit ``devices`` (a list, or text such as
    ``"node0:gpu0-5,node1"``), state plus ``reserve`` within device memory, ranked by the
    predicted downtime of switching to them from ``src`` (``Suggestions``; ``.ranked[0]`` is
    the best, ``.to_text()`` the table). ``failed``: source devices that are gone (their
    state is taken from survivors; each suggestion says what no survivor holds)."""
    from .planner.suggest import parse_devices
    from .planner.suggest import suggest as _suggest

    layout = load_layout(src)
    devs = parse_devices(devices, layout.spec) if isinstance(devices, str) else list(devices)
    return _suggest(layout, devs, reserve_bytes=_reserve(reserve), top=top,
                    topology=_topology(topology), budget_bytes=parse_bytes(budget, "budget"),
                    failed=tuple(failed))


def _reserve(reserve: str | int) -> int:
    return parse_bytes(reserve, "reserve", allow_zero=True)


def _record(p: Plan, report: VerifyReport) -> None:
    """Put what verification measured into the plan's stats, as the CLI's JSON has it."""
    p.stats["verify_seconds"] = report.seconds
    for key in ("peak_live_bytes", "reserve_bytes", "capacity_bytes", "headroom_bytes"):
        if key in report.checked:
            p.stats[key] = report.checked[key]
