"""Which layout next: the valid layouts of a model on given devices, ranked by switch time.

``suggest(src, devices)`` runs four steps, each bounded:

1. enumerate tp, pp, vpp, cp, ep and etp over divisors (dp derived), keeping the source's other
   settings, and build each through the spec rules (``spec_from_dict``; a ``SpecError`` is an
   invalid layout); layouts whose TP or expert-TP groups span nodes are dropped too;
2. memory: the state each device holds, computed per pipeline stage from one layer of each
   kind (``_profile``) instead of per rank, plus the user's reserve, within device memory;
3. a cheap proxy, the bytes no device already holds (overlaps of layers, TP slices, experts
   and optimizer shards), orders the layouts that fit;
4. only the ``top`` by the proxy are planned (``plan_transition``) and ranked by predicted
   downtime (``predicted_downtime``): planning costs 0.1-2 s each on big models.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import product
from typing import Any

from ..ir.buffers import experts_in_own_buffer
from ..ir.devices import parse_device_list
from ..ir.errors import DynatrainError, SpecError
from ..ir.layout import DTYPE_BYTES, Layout
from ..ir.loader import spec_from_dict, spec_to_dict
from ..ir.model import ModelConfig, chunk_params
from ..ir.shard import shard
from ..ir.spec import DEVICE_ID, LayoutSpec
from ..ir.state import OPTIMIZER_KINDS
from ..ir.units import format_bytes
from .buddy import cover
from .cost import H100, Topology, predicted_downtime
from .pipeline import plan_transition
from .sources import node_of

MAX_CANDIDATES = 4096  # parallel configurations tried at most (each costs a spec validation)
VPP_CHOICES = (None, 2, 4)  # plus the source's own vpp
DEFAULT_TOP = 5
DEFAULT_BUDGET_BYTES = 2 << 30
_ALIGN = 64  # the DistributedOptimizer starts each param on a multiple of 64 elements


# ---- results -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Suggestion:
    """One layout that fits, planned from the current one.

    Attributes:
        spec: the layout (its ``world`` is the device list).
        grid: ``tp2 pp2 dp2 ep4 etp1``.
        bytes_moved: bytes the plan sends between devices.
        estimated_bytes_moved: the proxy that chose it for planning.
        predicted_seconds: predicted downtime (wire time plus the switch's fixed costs).
        wire_seconds: the wire model's part of it.
        rounds: the plan's rounds.
        peak_state_bytes: state on the fullest device: exact for params, an upper bound for
            DistributedOptimizer shards (bucket padding counted at its most).
        bytes_lost: state no surviving device holds (None when no device failed or the planner
            cannot say).
    """

    spec: LayoutSpec
    grid: str
    bytes_moved: int
    estimated_bytes_moved: int
    predicted_seconds: float
    wire_seconds: float
    rounds: int
    peak_state_bytes: int
    bytes_lost: int | None = None


@dataclass(frozen=True, slots=True)
class Suggestions:
    """The ranked suggestions and what happened to the other layouts.

    ``considered`` = ``invalid`` + ``tp_across_nodes`` + ``too_big_for_memory`` + ``fitting``;
    the ``top`` of the fitting ones by estimated bytes were planned and ranked.
    """

    source: str
    devices: tuple[str, ...]
    ranked: tuple[Suggestion, ...]
    considered: int
    invalid: int
    tp_across_nodes: int
    too_big_for_memory: int
    fitting: int
    capacity_bytes: int | None
    reserve_bytes: int
    smallest_state_bytes: int | None  # the least any valid layout puts on a device
    unplannable: int = 0
    truncated: bool = False
    notes: tuple[str, ...] = ()

    def why_empty(self) -> str | None:
        """One sentence when nothing is suggested, else None."""
        if self.ranked:
            return None
        if self.smallest_state_bytes is None:
            return (f"no valid layout of this model on {_devices(len(self.devices))} "
                    "(every parallel configuration breaks a spec rule or splits TP across nodes)")
        if self.capacity_bytes is not None and self.smallest_state_bytes > self.capacity_bytes:
            return (f"the model cannot fit on {_devices(len(self.devices))}: the smallest layout "
                    f"holds {format_bytes(self.smallest_state_bytes)} of state per device, over "
                    f"the {format_bytes(self.capacity_bytes)} of device memory")
        if self.too_big_for_memory and not self.fitting:
            return (f"nothing fits with a reserve of {format_bytes(self.reserve_bytes)}: the "
                    f"smallest layout holds {format_bytes(self.smallest_state_bytes)} of state "
                    f"per device, and both together exceed "
                    f"{format_bytes(self.capacity_bytes or 0)}")
        return f"none of the {self.fitting} fitting layouts could be planned"

    def to_text(self) -> str:
        """A header, the counts, then one table row per suggestion, best first."""
        cap = ("unchecked" if self.capacity_bytes is None
               else f"{format_bytes(self.capacity_bytes)} per device")
        lines = [f"{self.source}  ->  {_devices(len(self.devices))} ({self.devices[0]} .. "
                 f"{self.devices[-1]}), reserve {format_bytes(self.reserve_bytes)}, "
                 f"memory {cap}",
                 f"  considered {self.considered} layouts{' (capped)' if self.truncated else ''}: "
                 f"{self.invalid} invalid, {self.tp_across_nodes} with TP across nodes, "
                 f"{self.too_big_for_memory} too big for memory, {self.fitting} fit; planned "
                 f"{len(self.ranked) + self.unplannable} moving the fewest bytes (estimated)"]
        lines += [f"  note: {n}" for n in self.notes]
        if not self.ranked:
            lines.append(f"  nothing to suggest: {self.why_empty()}")
            return "\n".join(lines)
        lines.append(f"  {'#':>2}  {'layout':<26} {'moved':>11} {'downtime':>10} {'wire':>9} "
                     f"{'rounds':>6} {'state/device':>13} {'lost':>11}")
        for i, s in enumerate(self.ranked, 1):
            lost = "-" if s.bytes_lost is None else format_bytes(s.bytes_lost)
            lines.append(f"  {i:>2}  {s.grid:<26} {format_bytes(s.bytes_moved):>11} "
                         f"{s.predicted_seconds:>8.3f} s {s.wire_seconds:>7.3f} s {s.rounds:>6} "
                         f"{format_bytes(s.peak_state_bytes):>13} {lost:>11}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """Plain data (format ``dynatrain.suggest/1``); each suggestion embeds its spec."""
        return {
            "format": "dynatrain.suggest/1", "source": self.source,
            "devices": list(self.devices), "reserve_bytes": self.reserve_bytes,
            "capacity_bytes": self.capacity_bytes, "considered": self.considered,
            "invalid": self.invalid, "tp_across_nodes": self.tp_across_nodes,
            "too_big_for_memory": self.too_big_for_memory, "fitting": self.fitting,
            "unplannable": self.unplannable, "truncated": self.truncated,
            "smallest_state_bytes": self.smallest_state_bytes, "why_empty": self.why_empty(),
            "notes": list(self.notes),
            "suggestions": [{
                "grid": s.grid, "spec": spec_to_dict(s.spec), "bytes_moved": s.bytes_moved,
                "estimated_bytes_moved": s.estimated_bytes_moved,
                "predicted_seconds": s.predicted_seconds, "wire_seconds": s.wire_seconds,
                "rounds": s.rounds, "peak_state_bytes": s.peak_state_bytes,
                "bytes_lost": s.bytes_lost} for s in self.ranked],
        }


# ---- devices -----------------------------------------------------------------------------------

# --devices names at most this many: suggest plans its top candidates in full, and 2048
# devices already take about a minute on a 2-core host (512: 9 s); more would run for minutes.
MAX_SUGGEST_DEVICES = 2048


def parse_devices(text: str, spec: LayoutSpec | None = None) -> list[str]:
    """A compact device list: ``node0:gpu0-5,node1:gpu0-7``, ``node2`` (every gpu of node 2,
    as many as the source spec's ``gpus_per_node``, or the node's devices in its device list),
    ``node0-3`` (several whole nodes), ``node4:gpu3`` (one device): ``ir.devices``'s parser,
    the one ``--failed`` uses too, bounded at ``MAX_SUGGEST_DEVICES``.

    Raises:
        DynatrainError: one line naming ``--devices``, for empty, malformed or repeated names,
            reversed ranges, a gpu beyond the spec's ``gpus_per_node``, or too many devices.

    Example:
        >>> parse_devices("node0:gpu0-1,node1:gpu3")
        ['node0:gpu0', 'node0:gpu1', 'node1:gpu3']
    """
    w = spec.world if spec is not None else None
    return parse_device_list(text, "--devices",
                             gpus_per_node=w.gpus_per_node if w is not None else None,
                             listed=w.devices if w is not None else None,
                             max_devices=MAX_SUGGEST_DEVICES)


# ---- enumeration -------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _configs(spec: LayoutSpec, world: int, max_tp: int) -> Iterable[dict[str, Any]]:
    """Parallel settings to try, the source's own first; dp follows from the world."""
    p, m = spec.parallel, spec.model
    cps = (p.cp,) if p.cp == 1 else (p.cp, 1)  # keep 1 unless the source uses cp
    vpps = tuple(dict.fromkeys((p.vpp, *VPP_CHOICES)))
    experts = m.num_moe_experts
    eps = [e for e in _divisors(experts) if e <= world] if experts else [1]
    first = {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp, "ep": p.ep, "etp": p.etp}
    yield first
    for cp, tp in product(cps, _divisors(world)):
        if tp > max_tp or world % (cp * tp):
            continue
        for pp, vpp in product(_divisors(world // (cp * tp)), vpps):
            if vpp is not None and pp == 1:
                continue
            for ep in eps:
                for etp in (dict.fromkeys((tp, 1)) if experts else (None,)):
                    c = {"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "ep": ep, "etp": etp}
                    if c != first:
                        yield c


def candidate_layouts(spec: LayoutSpec, devices: Sequence[str]) -> list[LayoutSpec]:
    """Every valid layout of ``spec``'s model on exactly ``devices``, rank r on devices[r].

    Tries tp, pp (divisors of the world), vpp (none, 2, 4 and the source's), cp (the source's,
    and 1), ep (divisors of the expert count) and etp (1 or tp); keeps the source's other
    settings (optimizer, state kinds, buckets, order, DistributedOptimizer instances where the
    data-parallel size allows, else fewer; uneven first/last stages only at the
    source's pp). The spec rules decide validity; TP and expert-TP groups must stay within a
    node. At most ``MAX_CANDIDATES`` configurations are tried, the source's first.

    Example:
        >>> [s.parallel.tp for s in candidate_layouts(spec, devices)][:1]  # doctest: +SKIP
        [2]
    """
    return _enumerate(spec, tuple(devices))[0]


def _enumerate(spec: LayoutSpec, devices: tuple[str, ...]
               ) -> tuple[list[LayoutSpec], int, int, int, bool]:
    """(valid specs, considered, invalid, TP across nodes, truncated)."""
    per_node: dict[str, int] = {}
    for d in devices:
        per_node[node_of(d)] = per_node.get(node_of(d), 0) + 1
    doc = spec_to_dict(spec, devices)
    model_name = (spec.name or "").split(" on ")[0] or None
    out: list[LayoutSpec] = []
    considered, invalid, across, truncated = 0, 0, 0, False
    seen: set[tuple] = set()
    for c in _configs(spec, len(devices), max(per_node.values())):
        # etp None means etp = tp: the same layout, tried once
        key = tuple(c[k] for k in ("tp", "pp", "vpp", "cp", "ep")) + (c["etp"] or c["tp"],)
        if key in seen:
            continue
        seen.add(key)
        if considered == MAX_CANDIDATES:
            truncated = True
            break
        considered += 1
        par = {k: v for k, v in doc["parallel"].items() if k not in c}
        if c["pp"] != spec.parallel.pp:  # uneven stages are set for the source's pp only
            par.pop("decoder_first_pipeline_num_layers", None)
            par.pop("decoder_last_pipeline_num_layers", None)
        if c["pp"] != spec.parallel.pp or c.get("vpp") != spec.parallel.vpp:
            par.pop("pipeline_model_parallel_layout", None)  # its stages fix pp and vpp
        par.update({k: v for k, v in c.items() if v is not None})
        cand = _with_most_instances(doc, par)
        if cand is None:
            invalid += 1
            continue
        if not _groups_within_nodes(Layout(cand)):
            across += 1
            continue
        grid = grid_text(cand)
        named = cand.model_copy(update={"name": f"{model_name} {grid}" if model_name else grid})
        out.append(named)
    return out, considered, invalid, across, truncated


def _with_most_instances(doc: dict, par: dict) -> LayoutSpec | None:
    """The candidate with as many DistributedOptimizer instances as the source keeps (each
    one a full copy of the optimizer state: the redundancy a failure is recovered from without
    a checkpoint), fewer where its data-parallel size does not divide; None: invalid."""
    key = "num_distributed_optimizer_instances"
    most = int(par.get(key, 1))
    for inst in (n for n in range(most, 0, -1) if most % n == 0):
        try:
            return spec_from_dict({**doc, "parallel": {**par, key: inst} if most > 1 else par},
                                  "candidate")
        except SpecError:
            continue
    return None


def _groups_within_nodes(layout: Layout) -> bool:
    """Every TP and expert-TP group on one node (its NVLink domain)."""
    mesh, devs = layout.mesh, layout.devices
    for grid in (mesh.dense, mesh.expert):
        if grid.sizes[grid.order.index("tp")] == 1:
            continue
        seen: set[int] = set()
        for r in range(layout.world):
            if r in seen:
                continue
            group = grid.group(r, ("tp",))
            seen.update(group)
            if len({node_of(devs[g]) for g in group}) > 1:
                return False
    return True


def grid_text(spec: LayoutSpec) -> str:
    """``tp2 pp2 vpp2 cp2 dp2 ep4 etp1``: the parallel sizes, trivial vpp/cp/ep left out."""
    p, lay = spec.parallel, Layout(spec)
    text = f"tp{p.tp} pp{p.pp}" + (f" vpp{p.vpp}" if p.vpp else "")
    text += (f" cp{p.cp}" if p.cp > 1 else "") + f" dp{lay.dp}"
    if spec.model.num_moe_experts:
        text += f" ep{p.ep} etp{p.expert_tp}"
    return text


# ---- memory: what one rank of each stage holds -------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Elems:
    """Local elements one rank holds of one layer (or of a chunk's embedding/output parts)."""

    dense_split: int = 0  # split over TP (this rank's slice)
    dense_repl: int = 0  # whole on every TP rank (norms, router)
    expert_split: int = 0  # the rank's E/ep experts, each split over expert TP
    expert_repl: int = 0
    dense_params: int = 0  # parameter counts, for the DistributedOptimizer's padding bound
    expert_params: int = 0
    buffers: int = 0  # fp32 state buffers (router expert_bias)

    def __add__(self, o: "_Elems") -> "_Elems":
        return _Elems(*(a + b for a, b in zip(_fields(self), _fields(o))))

    def scaled(self, k: int) -> "_Elems":
        return _Elems(*(a * k for a in _fields(self)))

    @property
    def dense(self) -> int:
        return self.dense_split + self.dense_repl

    @property
    def expert(self) -> int:
        return self.expert_split + self.expert_repl


def _fields(e: _Elems) -> tuple[int, ...]:
    return (e.dense_split, e.dense_repl, e.expert_split, e.expert_repl, e.dense_params,
            e.expert_params, e.buffers)


@lru_cache(maxsize=1024)
def _part(m: ModelConfig, tp: int, ep: int, etp: int, layer: int | None, pre: bool, post: bool,
          pipelined: bool, megatron_core: str) -> _Elems:
    """One layer's elements on one rank (``layer`` None: only the pre/post-process parts).

    Every layer of one kind (dense or MoE) holds the same sizes, so one stands for all.
    """
    defs, bufs = chunk_params(m, tp, ep, 0, () if layer is None else (layer,), pre, post,
                              pipelined, megatron_core=megatron_core)
    acc = [0] * 7
    for d in defs:
        ways = etp if d.expert else tp
        n = math.prod(shard(d, 0, ways).local_shape) if d.split else math.prod(d.shape)
        acc[(2 if d.expert else 0) + (0 if d.split else 1)] += n
        acc[5 if d.expert else 4] += 1
    acc[6] = sum(math.prod(b.shape) for b in bufs)
    return _Elems(*acc)


class _Footprint:
    """Per pipeline stage, the elements one of its ranks holds, and the bytes that makes.

    Ranks of one stage hold equally much: TP slices, expert sets and optimizer shards are even.
    Params are exact; a DistributedOptimizer shard is bounded above by counting every param's
    64-element alignment and every bucket's padding to lcm(D, 128) at its most.
    """

    def __init__(self, spec: LayoutSpec) -> None:
        self.spec = spec
        self.layout = lay = Layout(spec)  # lazy: builds no shards until asked
        m, p, st = spec.model, spec.parallel, spec.state
        self.moe = m.moe_pattern()
        self.param_bytes = 0 if st.derive_param else DTYPE_BYTES[st.param]
        self.opt_bytes = sum(DTYPE_BYTES[getattr(st, k)] for k in OPTIMIZER_KINDS
                             if getattr(st, k) is not None)
        self.sharded = p.use_distributed_optimizer and self.opt_bytes > 0
        inst = p.num_distributed_optimizer_instances
        self.dense_dp, self.expert_dp = lay.dp * p.cp // inst, lay.edp // inst
        self.kind = {flag: self._layer_kind(flag) for flag in set(self.moe)}
        self.pre_post = {(a, b): _part(m, p.tp, p.ep, p.expert_tp, None, a, b, p.pp > 1,
                                       self.spec.megatron_core)
                         for a in (False, True) for b in (False, True)}
        # With MTP the decoder's final norm sits with the last decoder layer, wherever it is
        # (model.has_final_norm), not with the post-process parts.
        k = 2 if m.normalization == "LayerNorm" else 1
        self.final_norm = _Elems(dense_repl=k * m.hidden_size, dense_params=k)
        self.stages = [[self._chunk(c) for c in lay.chunks(pp)] for pp in range(p.pp)]
        self.stage_bytes = [self._bytes(chunks) for chunks in self.stages]

    def _layer_kind(self, moe: bool) -> _Elems:
        p = self.spec.parallel
        first = self.moe.index(moe)
        return _part(self.spec.model, p.tp, p.ep, p.expert_tp, first, False, False, p.pp > 1,
                     self.spec.megatron_core)

    def _chunk(self, c: Any) -> _Elems:
        n_moe = sum(self.moe[i] for i in c.layers)
        out = self.pre_post[(c.pre_process, c.post_process)]
        if n_moe:
            out = out + self.kind[True].scaled(n_moe)
        if len(c.layers) > n_moe:
            out = out + self.kind[False].scaled(len(c.layers) - n_moe)
        m = self.spec.model
        if m.mtp_num_layers and m.num_layers - 1 in c.layers:
            out = out + self.final_norm
        return out

    def opt_elems(self, chunks: list[_Elems], bound: bool) -> int:
        """Optimizer elements per rank: its shard of each chunk's dense and expert buffer."""
        if not self.sharded:
            return sum(c.dense + c.expert for c in chunks)
        # else experts sit in the dense buffer (EP = 1, and on 0.16 also ETP != TP)
        own_expert_buffer = _own_expert_buffer(self.spec)
        total = 0
        for c in chunks:
            if own_expert_buffer:
                total += _shard(c.dense, c.dense_params, self.dense_dp, bound)
                total += _shard(c.expert, c.expert_params, self.expert_dp, bound)
            else:
                total += _shard(c.dense + c.expert, c.dense_params + c.expert_params,
                                self.dense_dp, bound)
        return total

    def _bytes(self, chunks: list[_Elems]) -> int:
        params = sum(c.dense + c.expert for c in chunks)
        step = 8 if self.opt_bytes else 0
        return (params * DTYPE_BYTES[self.spec.state.param]
                + self.opt_elems(chunks, True) * self.opt_bytes
                + sum(c.buffers for c in chunks) * 4 + step)

    @property
    def peak_bytes(self) -> int:
        return max(self.stage_bytes)


def _shard(n: int, params: int, dp: int, bound: bool) -> int:
    if not n:
        return 0
    pad = params * (_ALIGN - 1 + math.lcm(dp, 128) - 1) if bound else 0
    return -(-(n + pad) // dp)


def _overlap(a: int, na: int, b: int, nb: int) -> float:
    """Share of slice ``b`` of ``nb`` that slice ``a`` of ``na`` covers."""
    lo, hi = max(a / na, b / nb), min((a + 1) / na, (b + 1) / nb)
    return max(0.0, hi - lo) * nb


# ---- the proxy: bytes no device already holds ---------------------------------------------------


def estimated_bytes_moved(src: _Footprint, dst: _Footprint, failed: frozenset[str]) -> int:
    """Bytes the destination needs that the same device does not hold in the source.

    Per device: layers both stages build, times the overlap of their TP slices, expert sets,
    expert-TP slices and optimizer shard positions. Exact for params when only dp or pp
    changes; an estimate otherwise (positions in reordered buffers are taken as aligned).
    """
    src_rank = {d: r for r, d in enumerate(src.layout.devices) if d not in failed}
    cache: dict[tuple, float] = {}
    need = 0.0
    for r, dev in enumerate(dst.layout.devices):
        cd = dst.layout.coords(r)
        chunks = dst.stages[cd.pp]
        params = sum(c.dense + c.expert for c in chunks)
        need += params * dst.param_bytes + dst.opt_elems(chunks, False) * dst.opt_bytes
        s = src_rank.get(dev)
        if s is None:
            continue
        cs = src.layout.coords(s)
        opt_s = (src.layout.optimizer_rank(s, False), src.layout.optimizer_rank(s, True))
        opt_d = (dst.layout.optimizer_rank(r, False), dst.layout.optimizer_rank(r, True))
        key = (cs.pp, cs.tp, cs.ep, cs.etp, opt_s, cd.pp, cd.tp, cd.ep, cd.etp, opt_d)
        if key not in cache:
            cache[key] = _kept(src, dst, cs, cd, opt_s, opt_d)
        need -= cache[key]
    return max(0, round(need))


def _kept(src: _Footprint, dst: _Footprint, cs: Any, cd: Any, opt_s: tuple[int, int],
          opt_d: tuple[int, int]) -> float:
    """Bytes of destination rank ``cd``'s state that source rank ``cs`` already holds
    (``opt_*``: their (dense, expert) positions in the optimizer shard groups)."""
    sp, dp_ = src.spec.parallel, dst.spec.parallel
    tp = _overlap(cs.tp, sp.tp, cd.tp, dp_.tp)
    ep = _overlap(cs.ep, sp.ep, cd.ep, dp_.ep)
    etp = _overlap(cs.etp, sp.expert_tp, cd.etp, dp_.expert_tp)
    s_chunks, d_chunks = src.layout.chunks(cs.pp), dst.layout.chunks(cd.pp)
    common = set().union(*(c.layers for c in s_chunks)) & set().union(*(c.layers
                                                                         for c in d_chunks))
    n_moe = sum(dst.moe[i] for i in common)
    kept = _Elems()
    if n_moe:
        kept = kept + dst.kind[True].scaled(n_moe)
    if len(common) > n_moe:
        kept = kept + dst.kind[False].scaled(len(common) - n_moe)
    pre = any(c.pre_process for c in s_chunks) and any(c.pre_process for c in d_chunks)
    post = any(c.post_process for c in s_chunks) and any(c.post_process for c in d_chunks)
    kept = kept + dst.pre_post[(pre, post)]
    dense = kept.dense_split * tp + kept.dense_repl
    expert = (kept.expert_split * etp + kept.expert_repl) * ep
    if not dst.sharded:
        opt = dense + expert
    else:
        def shard_share(i: int, d_dp: int, s_dp: int) -> float:
            # the destination shard's share of its buffer that the source shard also covers
            return (_overlap(opt_s[i], s_dp, opt_d[i], d_dp) if src.sharded else 1.0) / d_dp

        if _own_expert_buffer(dst.spec):  # experts in their own buffer, over expert DP
            opt = (dense * shard_share(0, dst.dense_dp, src.dense_dp)
                   + expert * shard_share(1, dst.expert_dp, src.expert_dp))
        else:
            opt = (dense + expert) * shard_share(0, dst.dense_dp, src.dense_dp)
    return (dense + expert) * dst.param_bytes + opt * dst.opt_bytes


# ---- suggest -----------------------------------------------------------------------------------


def suggest(src: LayoutSpec | Layout, devices: Sequence[str], *, reserve_bytes: int = 0,
            top: int = DEFAULT_TOP, topology: Topology = H100,
            budget_bytes: int = DEFAULT_BUDGET_BYTES, failed: Iterable[str] = ()) -> Suggestions:
    """The layouts of ``src``'s model on ``devices`` that fit, ranked by predicted downtime.

    Args:
        src: the current layout.
        devices: the devices of the next layout, rank r on devices[r] (``parse_devices``).
        reserve_bytes: device memory the job needs besides its state (activations, workspace).
        top: how many layouts (the fewest estimated bytes to move) to plan and rank.
        topology: link speeds, fixed costs and device memory (``memory_GB``; None: unchecked).
        budget_bytes: staging budget of each planned switch.
        failed: source devices that died: they send nothing, and ``devices`` must avoid them.

    Raises:
        DynatrainError: bad devices, reserve, top or failed devices (one line naming it).

    Example:
        >>> s = suggest(load_spec("specs/llama3.1-8b/tp2-dp4.yaml"),  # doctest: +SKIP
        ...             parse_devices("node0:gpu0-5"), reserve_bytes=20 << 30)
        >>> print(s.to_text())  # doctest: +SKIP
    """
    spec = src.spec if isinstance(src, Layout) else src
    devices, failed_set = _checked(spec, devices, reserve_bytes, top, topology, failed)
    capacity = None if topology.memory_GB is None else int(topology.memory_GB * 1e9)
    specs, considered, invalid, across, truncated = _enumerate(spec, devices)
    src_fp = _Footprint(spec)
    fitting: list[tuple[int, str, _Footprint]] = []
    too_big, smallest = 0, None
    for cand in specs:
        fp = _Footprint(cand)
        smallest = fp.peak_bytes if smallest is None else min(smallest, fp.peak_bytes)
        if capacity is not None and fp.peak_bytes + reserve_bytes > capacity:
            too_big += 1
            continue
        fitting.append((estimated_bytes_moved(src_fp, fp, failed_set), grid_text(cand), fp))
    fitting.sort(key=lambda t: (t[0], t[1]))  # ties: by grid text, so the order is stable
    plan_kw, notes = _failure_options(failed_set)
    if failed_set:  # what the same failure would lose with DynaTrain's buddy copies
        notes += (cover(spec, src_fp.layout.devices, failed_set).line(),)
    ranked, unplannable, why = [], 0, ""
    for estimate, grid, fp in fitting[:top]:
        try:
            plan = plan_transition(src_fp.layout, fp.layout, budget_bytes, topology, **plan_kw)
        except DynatrainError as err:
            unplannable += 1  # e.g. a budget too small for this switch
            text = str(err.args[0]) if err.args else str(err)  # (a KeyError's str quotes it)
            why = why or f"{grid}: {text.splitlines()[0] if text else type(err).__name__}"
            continue
        down = predicted_downtime(plan, topology)
        lost = plan.stats.get("lost")
        ranked.append(Suggestion(
            fp.spec, grid, plan.stats["bytes_moved"], estimate, down.total_seconds,
            down.wire_seconds, len(plan.rounds), fp.peak_bytes,
            int(lost["bytes"]) if lost is not None else (0 if "failed" in plan_kw else None)))
    ranked.sort(key=lambda s: (s.predicted_seconds, s.bytes_moved, s.grid))
    if unplannable and ranked:  # (with none ranked, why_empty says so)
        notes += (f"{unplannable} of those {len(fitting[:top])} could not be planned, e.g. "
                  f"{why}",)
    if len(fitting) > top:
        notes += (f"{len(fitting) - top} more layouts fit; --top plans more of them",)
    return Suggestions(spec.name or "source", devices, tuple(ranked), considered, invalid, across,
                       too_big, len(fitting), capacity, reserve_bytes, smallest, unplannable,
                       truncated, notes)


def _checked(spec: LayoutSpec, devices: Sequence[str], reserve: int, top: int,
             topology: Topology, failed: Iterable[str]) -> tuple[tuple[str, ...], frozenset[str]]:
    devs = tuple(devices)
    if not devs:
        raise DynatrainError("--devices: needs at least one device")
    if len(devs) > MAX_SUGGEST_DEVICES:
        raise DynatrainError(f"--devices: {len(devs)} devices; suggest takes at most "
                             f"{MAX_SUGGEST_DEVICES}")
    for d in devs:
        if not isinstance(d, str) or not DEVICE_ID.match(d):
            raise DynatrainError(f"--devices: device ids look like node3:gpu5; {d!r:.40} does not")
    if len(set(devs)) != len(devs):
        raise DynatrainError(f"--devices: {next(d for d in devs if devs.count(d) > 1)} is "
                             "listed twice")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise DynatrainError(f"--top: must be a whole number >= 1 (got {top!r:.40})")
    if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
        raise DynatrainError(f"--reserve: must be a whole number of bytes >= 0 (got "
                             f"{reserve!r:.40})")
    if reserve and topology.memory_GB is None:
        raise DynatrainError(f"--reserve: {format_bytes(reserve)} needs a device memory to count "
                             "against, but the topology gives none (set memory_GB)")
    dead = frozenset(failed)
    src_devices = set(Layout(spec).devices)
    if dead - src_devices:
        raise DynatrainError(f"--failed: {sorted(dead - src_devices)[0]} is not a device of the "
                             "source layout")
    if dead & set(devs):
        raise DynatrainError(f"--devices: {sorted(dead & set(devs))[0]} failed; suggest a layout "
                             "on surviving devices")
    return devs, dead


def _failure_options(failed: frozenset[str]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Keyword arguments telling the planner which devices failed, if it takes them."""
    if not failed:
        return {}, ()
    params = inspect.signature(plan_transition).parameters
    if "failed" in params and "allow_lost" in params:
        # Plan what survives and report what does not, rather than refuse the layout.
        return {"failed": failed, "allow_lost": True}, ()
    return {}, ("this planner does not take failed devices: plans may read from them and "
                "bytes lost are not known",)


def _devices(n: int) -> str:
    return f"{n} device" + ("" if n == 1 else "s")


def _own_expert_buffer(spec: LayoutSpec) -> bool:
    """Whether the spec's megatron-core puts expert params in a DDP buffer of their own."""
    p = spec.parallel
    return experts_in_own_buffer(spec.megatron_core, p.tp, p.ep, p.expert_tp)
