"""The human summary of a planned switch: what `dynatrain plan` and ``dynatrain.summarize`` print.

Every number says what it counts: bytes moved against the least any plan moves for the same
placement, messages between devices apart from local copies, the memory check with what it
counts, and time split into the bandwidth model's wire time and the fixed costs a switch pays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..ir.layout import Layout
from ..ir.units import format_bytes, format_seconds
from ..planner.cost import predicted_downtime
from ..planner.derive_cost import derived_param_gather

if TYPE_CHECKING:
    from ..api import PlannedSwitch


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 round``, ``2 rounds``."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def grid(layout: Layout) -> str:
    """``tp8 pp4 dp4`` (plus vpp, cp, the expert grid and the optimizer when they apply)."""
    p, m = layout.parallel, layout.model
    out = f"tp{p.tp} pp{p.pp}" + (f" vpp{p.vpp}" if p.vpp else "") + (
        f" cp{p.cp}" if p.cp > 1 else "") + f" dp{layout.dp}"
    if m.num_moe_experts:
        out += f" ep{p.ep} etp{p.expert_tp} edp{layout.edp}"
    return out + ("" if p.use_distributed_optimizer else " (no dist-opt)")


def summary_lines(switch: PlannedSwitch, biggest: int = 5) -> list[str]:
    """The summary, line by line."""
    plan, src, dst = switch.plan, switch.src, switch.dst
    st = plan.stats
    local_copies = (len(plan.classes.local) if plan.classes is not None
                    else sum(1 for m in plan.messages() if m.local))
    new = len(set(dst.devices) - set(src.devices))
    leaving = len(set(src.devices) - set(dst.devices))
    lines = [
        f"{plan.src_name}  ->  {plan.dst_name}",
        f"  src     {grid(src):<32} {plural(src.world, 'device')}",
        f"  dst     {grid(dst):<32} {plural(dst.world, 'device')} ({new} new, {leaving} leaving)",
        *_failure_lines(st),
        *_placement_lines(st, new or leaving),
        _moved_line(st),
        f"  local   {format_bytes(st['bytes_local'])} copied on the same device "
        f"({plural(local_copies, 'local copy', 'local copies')})",
        f"  sends   {plural(st['messages'], 'message')} between devices in "
        f"{plural(st['rounds'], 'round')}, peak staging {format_bytes(st['peak_staging_bytes'])}"
        f" per device (budget {format_bytes(st['budget_bytes'])})",
        *_derive_lines(switch),
        *_memory_lines(switch),
        *_time_lines(switch),
        f"  planned in {st['plan_seconds']:.2f} s ({_transfers(st)}), "
        f"verified in {st.get('verify_seconds', 0.0):.2f} s "
        f"(coverage, sources, expert owners, deadlock, memory)",
    ]
    moved_by_key = _moved_by_key(plan)
    if moved_by_key:
        lines.append("  biggest movers (bytes sent between devices)")
        for key, n in sorted(moved_by_key.items(), key=lambda kv: (-kv[1], kv[0]))[:biggest]:
            lines.append(f"    {format_bytes(n):>10}  {key}")
    return lines


def _moved_by_key(plan) -> dict[str, int]:
    """Bytes sent between devices per checkpoint key (a plan kept as classes: each class's
    chunks once, times its members that cross devices)."""
    out: dict[str, int] = {}
    if plan.classes is not None:
        for c in plan.classes.classes:
            times = sum(1 for m in c.members if m.src_device != m.dst_device)
            for ch in c.chunks:
                for t in ch:
                    out[t.key] = out.get(t.key, 0) + t.nbytes * times
        return out
    for m in plan.messages():
        if not m.local:
            for t in m.transfers:
                out[t.key] = out.get(t.key, 0) + t.nbytes
    return out


def _failure_lines(st: dict) -> list[str]:
    failed = st.get("failed") or []
    if not failed:
        return []
    lines = [f"  failed  {plural(len(failed), 'device')} ({failed[0]} .. {failed[-1]}): "
             "nothing is read from them"]
    if st.get("lost"):
        from ..planner.lost import LostState

        lines.append(f"  lost    {LostState.from_json(st['lost']).summary()}; not moved "
                     "(--allow-lost): refill it from a checkpoint")
    return lines


def _transfers(st: dict) -> str:
    # A transfer is one record of the plan (as in its JSON, --text and `verify`); a part is
    # what the planner picked a sender for, before big parts were cut to message size.
    text = plural(st["transfers"], "transfer")
    if "parts" in st and st["parts"] != st["transfers"]:
        text += f"; {plural(st['parts'], 'part')} before cutting into round chunks"
    return text


def _moved_line(st: dict) -> str:
    moved, lb = st["bytes_moved"], st["bytes_lower_bound"]
    # The lower bound is what must change device under this placement of the destination
    # ranks: another placement can need less (``--place auto``).
    if moved == lb:
        verdict = "the least any plan moves for this placement"
    else:
        verdict = f"{moved / max(lb, 1):.3f}x the least for this placement, {format_bytes(lb)}"
    return f"  moved   {format_bytes(moved)} between devices ({verdict})"


def _placement_lines(st: dict, world_changes: int) -> list[str]:
    if "naive_bytes_moved" in st:
        naive, moved = st["naive_bytes_moved"], st["bytes_moved"]
        same_time = abs(st["naive_predicted_seconds"] - st["predicted_seconds"]) <= (
            0.01 * st["predicted_seconds"])
        time_note = (" (the busiest link carries as much either way)" if same_time else "")
        return [f"  place   auto (TP groups kept in nodes): {format_bytes(naive - moved)} less "
                f"than rank r on device r ({format_bytes(naive)}); wire time "
                f"{format_seconds(st['predicted_seconds'])} vs "
                f"{format_seconds(st['naive_predicted_seconds'])}"
                + time_note]
    if world_changes:
        return ["  place   naive (rank r on device r); --place auto may move fewer bytes"]
    return []


def _derive_lines(switch: PlannedSwitch) -> list[str]:
    if not switch.plan.derived:
        return []
    g = derived_param_gather(switch.dst, switch.topology)
    if not g.total_bytes:
        return [f"  derive  {', '.join(switch.plan.derived)}: not sent; each destination rank "
                "casts its main params (no distributed optimizer: nothing to gather)"]
    return [f"  derive  {', '.join(switch.plan.derived)}: not sent; each destination rank casts "
            f"the main params it owns, then all-gathers the rest over DP: "
            f"{format_bytes(g.total_bytes)} in all, {format_bytes(g.max_device_bytes)} into the "
            f"busiest device, {format_seconds(g.seconds)} wire time"
            + (" over the network" if g.crosses_nodes else " over NVLink")]


def _memory_lines(switch: PlannedSwitch) -> list[str]:
    st = switch.plan.stats
    if "peak_live_bytes" not in st:
        return ["  memory  device memory not checked (the topology gives no memory_GB)"]
    live, reserve = st["peak_live_bytes"], st["reserve_bytes"]
    reserve_text = (f" + reserve {format_bytes(reserve)} = {format_bytes(live + reserve)}"
                    if reserve else " + no reserve for activations, allocator and "
                    "communicators (--reserve)")
    # memory_GB is decimal (80 GB = 80e9 bytes); every size here is binary (GiB = 2**30 bytes).
    gb = switch.topology.memory_GB
    source = f", memory_GB {gb:g} = {gb:g}e9 bytes" if gb is not None else ""
    return [f"  memory  peak {format_bytes(live)} per device while switching (source + "
            f"destination state + staging){reserve_text} of {format_bytes(st['capacity_bytes'])}"
            f" device memory ({switch.topology.name}{source}; headroom "
            f"{format_bytes(st['headroom_bytes'])})"]


def _time_lines(switch: PlannedSwitch) -> list[str]:
    return [f"  time    {predicted_downtime(switch.plan, switch.topology).describe()}"]
