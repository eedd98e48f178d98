"""Topology, the alpha-beta wire model and the predicted downtime of a switch.

A device has separate links inside its node (NVLink) and across nodes (its NIC), each with a
per-direction bandwidth, plus local copy bandwidth for data that stays on the device. In the
wire model a round takes the latency plus the time of its busiest link; the lower bound of a
whole plan is the same computed over all its bytes at once (no schedule can beat the busiest
device's links). The scheduler optimises this wire time.

A switch also pays costs that do not depend on its bytes: once per switch the runtime binds
the storage, prepares the first round, meets at a start barrier (NCCL) and votes to commit;
every round adds the runtime's own posting and synchronization. ``predicted_downtime`` adds
these fixed costs (the topology's ``switch_fixed_s`` and ``round_fixed_us``) to the wire time.
It predicts the executor's ``switch`` call; a live switch also forms process groups and builds
the destination job, which no topology field models.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..ir.errors import SpecError
from ..ir.strict import DuplicateKeyError, read_bounded, safe_load
from ..ir.units import format_seconds
from .plan import Message, Plan
from .sources import node_of
from .sums import sum_by_index


MIN_GBPS, MAX_GBPS = 1e-3, 1e6  # a topology's link speeds, GB/s


class Topology(BaseModel):
    """Link speeds, latency and a switch's fixed costs on one kind of cluster.

    Speeds are GB/s (1e9 bytes per second, per direction), from 0.001 to 1e6. Every number
    must be finite and in its range (docs/topology.md lists them).

    Attributes:
        name: what summaries call it (a YAML file without ``name`` is named after the file).
        intra_node_GBps / inter_node_GBps / local_copy_GBps: link and copy speeds.
        latency_us: wire model, per round: launching the round and its first byte.
        switch_fixed_s: once per switch, whatever it moves: binding storage and preparing the
            first round, the start barrier (NCCL) and the commit vote (an all-gather).
        round_fixed_us: per round, beyond ``latency_us``: the runtime posting the round's
            operations and waiting for its slowest peer.
        memory_GB: device memory that live state plus staging must fit in (None: unchecked).
        first_touch_GBps: how fast a switch that allocates its destination storage gets it
            ready to write, per device (zeroed, its pages mapped): paid only where the switch
            allocates it (``predicted_downtime(..., allocates=True)``, what ``run-plan`` runs
            in freshly started processes); a live switch writes into the destination it built
            ahead. None: at ``local_copy_GBps``.
        allocate_fixed_s: once, where the switch allocates its destination: what such a
            switch in fresh processes pays beyond the bytes (first use of the connections and
            code paths).
    """

    # strict: YAML's true is not 1 GB, nor "3" three GB/s
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)
    # Ranges: wide enough for any real link (1 MB/s to 1 PB/s, latency up to a second), narrow
    # enough that no figure printed from them runs to hundreds of digits.
    name: str = Field("h100-8xnvlink-8x400g", min_length=1, max_length=100)
    intra_node_GBps: float = Field(450.0, ge=MIN_GBPS, le=MAX_GBPS)  # NVLink 4: 900 GB/s both ways
    inter_node_GBps: float = Field(50.0, ge=MIN_GBPS, le=MAX_GBPS)  # one 400 Gb/s NIC per GPU
    local_copy_GBps: float = Field(1500.0, ge=MIN_GBPS, le=MAX_GBPS)  # copy within HBM
    latency_us: float = Field(20.0, ge=0, le=1e6)  # per round: launch + first byte
    # NCCL fixed costs: assumed, not measured (no multi-GPU host has been lent to this work).
    # Start barrier and vote on warm communicators take well under 1 ms each even at 128
    # ranks; the host work before round 0 (binding, first round's views: thousands of
    # transfers in Python) and the skew between processes at the vote are tens of ms.
    switch_fixed_s: float = Field(0.05, ge=0, le=3600)
    # A round posts its few hundred wire pieces as one NCCL group from Python (~5 us each).
    round_fixed_us: float = Field(1000.0, ge=0, le=1e7)
    memory_GB: float | None = Field(80.0, ge=1e-9, le=1e6)  # from one byte
    # GPU: the caching allocator's memory is mapped already; zeroing runs at copy speed.
    first_touch_GBps: float | None = Field(None, ge=MIN_GBPS, le=MAX_GBPS)
    allocate_fixed_s: float = Field(0.0, ge=0, le=3600)

    @field_validator("name")
    @classmethod
    def _one_line(cls, v: str) -> str:
        if any(ord(c) < 32 or ord(c) == 127 for c in v):  # a newline would split the summary
            raise ValueError("must be one line of printable text (no control characters)")
        return v


H100 = Topology()
# gloo CPU processes on this machine, calibrated by bench/calibrate_fixed_costs.py: 38 switches
# of 4 processes (tiny GPT, 4x/8x wider and runtime_bench's 40M model moving ~130 MiB per
# busiest link, 1 to 363 rounds), each into preallocated storage in processes that switched
# before (as a live switch) and allocating it in fresh processes (as ``dynatrain run-plan``),
# the fastest of 2 repeats each, on this 2-core host, fitted on relative errors: the
# per-switch part, the per-round part and the link speed on the first, allocate_fixed_s and
# first_touch_GBps on what the others take beyond. Predicted over measured downtime: median
# 0.93, 10-90% 0.75-1.25, range 0.66-1.50, 71 of the 76 within 0.7-1.4x
# (docs/benchmarks.md). A round costs ~3 ms here because 4 processes take turns on 2 cores
# at every round's synchronization. Loopback TCP is one "node"; the fit cannot split network
# latency from the runtime's per-round cost, so all of it is round_fixed_us. local_copy_GBps
# is assumed (one thread's memcpy; local copies overlap the exchange).
GLOO_LOCAL = Topology(name="gloo-local", intra_node_GBps=0.745, inter_node_GBps=0.745,
                      local_copy_GBps=3.0, latency_us=0.0, switch_fixed_s=0.0139,
                      round_fixed_us=2783.0, memory_GB=None, first_touch_GBps=1.064,
                      allocate_fixed_s=0.0110)
PRESETS = {"h100": H100, "h800": Topology(name="h800-8xnvlink-8x400g", intra_node_GBps=200.0),
           "gloo-local": GLOO_LOCAL}


MAX_TOPOLOGY_BYTES = 1 << 16  # a topology file holds a dozen numbers


def load_topology(source: str) -> Topology:
    """A preset name (``PRESETS``: h100, h800, gloo-local) or a YAML file of Topology's fields.

    A file without ``name`` is named after the file (``mytopo.yaml`` -> ``mytopo``).

    Raises:
        SpecError: naming the field and the rule, for an unreadable file, an unknown field or
            a value out of range (negative, zero speed, inf or nan).
    """
    if source in PRESETS:
        return PRESETS[source]
    names = ", ".join(PRESETS)
    try:
        data = read_bounded(source, MAX_TOPOLOGY_BYTES)  # /dev/zero, a pipe: never whole
    except (OSError, ValueError):
        raise SpecError("--topology", f"must be {names} or a readable YAML file",
                        source) from None
    if len(data) > MAX_TOPOLOGY_BYTES:
        raise SpecError("--topology", f"a topology file must be at most {MAX_TOPOLOGY_BYTES} "
                        "bytes", source)
    try:
        raw = safe_load(data.decode("utf-8"))
    except DuplicateKeyError as err:
        raise SpecError("--topology", f"{source}: {err}") from None
    except (ValueError, yaml.YAMLError, RecursionError, LookupError, AttributeError,
            TypeError):  # what PyYAML's safe constructors raise on malformed scalars
        raise SpecError("--topology", f"must be {names} or a readable YAML file",
                        source) from None
    if not isinstance(raw, dict):
        raise SpecError("--topology", "must be a YAML mapping of topology fields", source)
    if "name" not in raw:
        raw = {**raw, "name": Path(source).stem}  # never the default preset's name
    try:
        return Topology.model_validate(raw)
    except ValidationError as err:
        e = err.errors(include_url=False)[0]
        field = "topology." + ".".join(map(str, e["loc"]))
        raise SpecError(field, e["msg"].removeprefix("Value error, "), e.get("input")) from None


@dataclass(frozen=True, slots=True)
class LinkBytes:
    """Bytes one device moves over each of its links."""

    intra_out: int = 0
    intra_in: int = 0
    inter_out: int = 0
    inter_in: int = 0
    local: int = 0

    def seconds(self, topo: Topology) -> float:
        return max(
            max(self.intra_out, self.intra_in) / (topo.intra_node_GBps * 1e9),
            max(self.inter_out, self.inter_in) / (topo.inter_node_GBps * 1e9),
            self.local / (topo.local_copy_GBps * 1e9),
        )


def link_bytes(messages: Iterable[Message]) -> dict[str, LinkBytes]:
    """Per device, the bytes ``messages`` move over each of its links."""
    return _link_bytes((m.nbytes, m.src_device, m.dst_device) for m in messages)


@dataclass(frozen=True)
class LinkTable:
    """Per round, ``link_bytes`` as numbers: ``bytes[r][d]`` holds device ``devices[d]``'s
    five ``LinkBytes`` fields (int64, exact) and ``present[r][d]`` whether it moves
    anything in round r. The cost model reads it with numpy: the 98304-GPU plan has a
    million (device, round) entries, and one ``LinkBytes`` each took seconds to build and
    read for every figure."""

    devices: tuple[str, ...]
    bytes: tuple[np.ndarray, ...]
    present: tuple[np.ndarray, ...]

    @classmethod
    def of(cls, rounds: Iterable[dict[str, LinkBytes]]) -> "LinkTable":
        """From ``link_bytes`` of each round."""
        rounds = list(rounds)
        index: dict[str, int] = {}
        for per in rounds:
            for d in per:
                index.setdefault(d, len(index))
        n = len(index)
        table, present = [], []
        for per in rounds:
            b = np.zeros((n, 5), np.int64)
            p = np.zeros(n, bool)
            rows = [index[d] for d in per]
            if rows:
                b[rows] = [[lb.intra_out, lb.intra_in, lb.inter_out, lb.inter_in, lb.local]
                           for lb in per.values()]
                p[rows] = True
            table.append(b)
            present.append(p)
        return cls(tuple(index), tuple(table), tuple(present))

    def dicts(self) -> tuple[dict[str, LinkBytes], ...]:
        """Each round's ``link_bytes`` (devices that move anything, in ``devices`` order)."""
        out = []
        for b, p in zip(self.bytes, self.present):
            rows = np.flatnonzero(p).tolist()
            out.append({self.devices[d]: LinkBytes(*v) for d, v in zip(rows, b[p].tolist())})
        return tuple(out)

    def busiest(self, topo: Topology) -> list[float]:
        """Per round, the seconds of its busiest device (``LinkBytes.seconds``; 0.0 when
        nothing moves)."""
        return [_busiest_rows(b[p], topo) for b, p in zip(self.bytes, self.present)]

    def total_busiest(self, topo: Topology) -> float:
        """The busiest device over the whole plan: ``busiest`` of every round's bytes summed
        (``total_link_bytes``)."""
        if not self.bytes:
            return 0.0
        present = np.logical_or.reduce(self.present)
        return _busiest_rows(sum(self.bytes)[present], topo)

    def staging_peak(self) -> int:
        """The most bytes one device stages in one round (``staging_peak`` of every round)."""
        return max((int(b[p, :4].sum(axis=1).max()) for b, p in zip(self.bytes, self.present)
                    if p.any()), default=0)


def _busiest_rows(rows: np.ndarray, topo: Topology) -> float:
    """``max(lb.seconds(topo))`` over rows of ``LinkBytes`` fields, the same floats: each
    int64 is below 2**53, so it converts exactly, as Python's int / float does."""
    if not len(rows):
        return 0.0
    f = rows.astype(np.float64)
    s = np.maximum(np.maximum(np.maximum(f[:, 0], f[:, 1]) / (topo.intra_node_GBps * 1e9),
                              np.maximum(f[:, 2], f[:, 3]) / (topo.inter_node_GBps * 1e9)),
                   f[:, 4] / (topo.local_copy_GBps * 1e9))
    return float(s.max())


def class_link_table(body) -> LinkTable:
    """The ``LinkTable`` of a ``classes.ClassRounds``, from its classes' chunk sizes and
    members (no message is built; numpy sums the millions of them, exactly)."""
    sized = body.sized
    node_ids: dict[str, int] = {}
    node = np.array([node_ids.setdefault(node_of(d), len(node_ids)) for d in sized.devices],
                    dtype=np.int64)
    n_dev = len(sized.devices)
    cross = sized.src != sized.dst
    intra = cross & (node[sized.src] == node[sized.dst])
    inter = cross & ~intra
    table, shown = [], []
    for r in range(body.rounds):
        b = sized.sizes[sized.klass, r]
        live = sized.counts[sized.klass, r] > 0
        cols = [_sum_at(sized.src, b, live & intra, n_dev), _sum_at(sized.dst, b, live & intra, n_dev),
                _sum_at(sized.src, b, live & inter, n_dev), _sum_at(sized.dst, b, live & inter, n_dev),
                _sum_at(sized.src, b, live & ~cross, n_dev)]
        present = np.zeros(n_dev, dtype=bool)
        present[sized.src[live]] = True
        present[sized.dst[live]] = True
        if r == 0 and len(sized.local):
            cols[4] += _sum_at(sized.local, sized.local_bytes, sized.local_counts > 0, n_dev)
            present[sized.local[sized.local_counts > 0]] = True
        table.append(np.stack(cols, axis=1).astype(np.int64, copy=False))
        shown.append(present)
    return LinkTable(tuple(sized.devices), tuple(table), tuple(shown))


def _sum_at(where: np.ndarray, values: np.ndarray, mask: np.ndarray, n: int) -> np.ndarray:
    """Per index of ``where[mask]``, the sum of ``values[mask]`` (int64, exact)."""
    return sum_by_index(where[mask], values[mask], n)


def _link_bytes(sized: Iterable[tuple[int, str, str]]) -> dict[str, LinkBytes]:
    acc: dict[str, list[int]] = {}
    node: dict[str, str] = {}  # node_of per device: asked twice per message otherwise

    def row(d: str) -> list[int]:
        r = acc.get(d)
        if r is None:
            r = acc[d] = [0, 0, 0, 0, 0]
            node[d] = node_of(d)
        return r

    for n, s, d in sized:
        rs = row(s)
        if s == d:
            rs[4] += n
            continue
        rd = row(d)
        if node[s] == node[d]:
            rs[0] += n
            rd[1] += n
        else:
            rs[2] += n
            rd[3] += n
    return {d: LinkBytes(*v) for d, v in acc.items()}


def total_link_bytes(plan: Plan) -> dict[str, LinkBytes]:
    """``link_bytes`` of the whole plan: the sum of its rounds' (``Plan.round_links``)."""
    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for per in plan.round_links:
        for d, lb in per.items():
            a = acc[d]
            a[0] += lb.intra_out
            a[1] += lb.intra_in
            a[2] += lb.inter_out
            a[3] += lb.inter_in
            a[4] += lb.local
    return {d: LinkBytes(*v) for d, v in acc.items()}


def predicted_seconds(plan: Plan, topo: Topology) -> float:
    return sum(topo.latency_us * 1e-6 + b for b in plan.link_table.busiest(topo))


def lower_bound_seconds(plan: Plan, topo: Topology) -> float:
    busiest = plan.link_table.total_busiest(topo)
    return (topo.latency_us * 1e-6 if busiest else 0.0) + busiest


@dataclass(frozen=True, slots=True)
class Downtime:
    """A switch's predicted downtime: the wire model plus the runtime's fixed costs.

    Attributes:
        topology: the topology's name.
        rounds: the plan's rounds.
        wire_seconds: ``predicted_seconds``: per round, latency plus its busiest link.
        lower_bound_seconds: ``lower_bound_seconds``: no schedule's wire time is below it.
        switch_fixed_seconds: ``switch_fixed_s``, once.
        round_fixed_seconds: ``rounds`` times ``round_fixed_us``.
        derived: the plan's derived kinds (their rebuild after the rounds is not modelled).
        first_touch_seconds: where the switch allocates its destination storage,
            ``allocate_fixed_s`` plus the busiest device's destination bytes at
            ``first_touch_GBps``; 0 where it writes into storage that exists (a live switch's
            destination built ahead).
    """

    topology: str
    rounds: int
    wire_seconds: float
    lower_bound_seconds: float
    switch_fixed_seconds: float
    round_fixed_seconds: float
    derived: tuple[str, ...] = ()
    first_touch_seconds: float = 0.0

    @property
    def fixed_seconds(self) -> float:
        return self.switch_fixed_seconds + self.round_fixed_seconds

    @property
    def total_seconds(self) -> float:
        return self.wire_seconds + self.fixed_seconds + self.first_touch_seconds

    def excludes(self) -> tuple[str, ...]:
        """What the prediction leaves out: costs outside the executor's ``switch`` call."""
        out = ("building the destination job", "forming process groups")
        return out + (("deriving params",) if self.derived else ())

    def describe(self) -> str:
        """One line: wire, fixed parts and total, and what is excluded.

        Example:
            >>> predicted_downtime(plan, H100).describe()  # doctest: +SKIP
            'wire 0.148 s on h100-8xnvlink-8x400g (bandwidth model; lower bound 0.144 s, \
1.03x) + fixed ~0.057 s (setup, start barrier and commit vote 0.050 s; 7 round syncs \
0.007 s) = ~0.205 s downtime predicted; excludes building the destination job, forming \
process groups'
        """
        lb, f = self.lower_bound_seconds, format_seconds
        ratio = f", {self.wire_seconds / lb:.2f}x" if lb > 0 else ""
        return (f"wire {f(self.wire_seconds)} on {self.topology} (bandwidth model; lower "
                f"bound {f(lb)}{ratio}) + fixed ~{f(self.fixed_seconds)} (setup, "
                f"start barrier and commit vote {f(self.switch_fixed_seconds)}; "
                f"{self.rounds} round sync{'' if self.rounds == 1 else 's'} "
                f"{f(self.round_fixed_seconds)})"
                + (f" + allocating the destination ~{f(self.first_touch_seconds)}"
                   if self.first_touch_seconds else "")
                + f" = ~{f(self.total_seconds)} downtime predicted; excludes "
                + ", ".join(self.excludes()))

    def as_dict(self) -> dict:
        """Plain data for JSON summaries (seconds; ``excludes`` as a list)."""
        return {"topology": self.topology, "rounds": self.rounds,
                "wire_seconds": self.wire_seconds,
                "lower_bound_seconds": self.lower_bound_seconds,
                "switch_fixed_seconds": self.switch_fixed_seconds,
                "round_fixed_seconds": self.round_fixed_seconds,
                "fixed_seconds": self.fixed_seconds,
                "first_touch_seconds": self.first_touch_seconds,
                "total_seconds": self.total_seconds,
                "excludes": list(self.excludes())}


def predicted_downtime(plan: Plan, topo: Topology, allocates: bool = False) -> Downtime:
    """The downtime ``plan`` is predicted to cost on ``topo``: wire time plus fixed costs,
    plus, where the switch ``allocates`` its destination storage (``dynatrain run-plan``;
    not a live switch, whose destination exists), getting that storage ready.

    Example:
        >>> d = predicted_downtime(plan, PRESETS["gloo-local"])  # doctest: +SKIP
        >>> d.total_seconds == d.wire_seconds + d.fixed_seconds  # doctest: +SKIP
        True
    """
    n = len(plan.rounds)
    touch = 0.0
    if allocates:
        rate = topo.first_touch_GBps or topo.local_copy_GBps
        touch = (topo.allocate_fixed_s
                 + max(destination_bytes(plan).values(), default=0) / (rate * 1e9))
    return Downtime(topo.name, n, predicted_seconds(plan, topo), lower_bound_seconds(plan, topo),
                    topo.switch_fixed_s, n * topo.round_fixed_us * 1e-6, plan.derived, touch)


def destination_bytes(plan: Plan) -> dict[str, int]:
    """Per destination device, the bytes the plan writes into its storage (received and
    copied locally): its destination state, less what no source holds (padding)."""
    out: dict[str, int] = {}
    for rnd in plan.rounds:
        for m in rnd.messages:
            out[m.dst_device] = out.get(m.dst_device, 0) + m.nbytes
    return out
