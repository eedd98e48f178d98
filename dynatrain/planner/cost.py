"""Topology and the alpha-beta cost model: predicted time per round and its lower bound.

A device has separate links inside its node (NVLink) and across nodes (its NIC), each with a
per-direction bandwidth, plus local copy bandwidth for data that stays on the device. A round
takes the latency plus the time of its busiest link; the lower bound of a whole plan is the same
computed over all its bytes at once (no schedule can beat the busiest device's links).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..ir.errors import SpecError
from .plan import Message, Plan, Round
from .sources import node_of


class Topology(BaseModel):
    """Link speeds in GB/s (1e9 bytes per second, per direction) and latency in microseconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = "h100-8xnvlink-8x400g"
    intra_node_GBps: float = Field(450.0, gt=0)  # NVLink 4: 900 GB/s bidirectional
    inter_node_GBps: float = Field(50.0, gt=0)  # one 400 Gb/s NIC per GPU
    local_copy_GBps: float = Field(1500.0, gt=0)  # device-to-device copy within HBM
    latency_us: float = Field(20.0, ge=0)  # per round: launch + synchronization
    # Device memory (GB) that live state plus staging must fit in; None leaves it unchecked.
    memory_GB: float | None = Field(80.0, gt=0)


H100 = Topology()
PRESETS = {"h100": H100, "h800": Topology(name="h800-8xnvlink-8x400g", intra_node_GBps=200.0)}


def load_topology(source: str) -> Topology:
    """A preset name (h100, h800) or a YAML file with Topology's fields."""
    if source in PRESETS:
        return PRESETS[source]
    try:
        raw = yaml.safe_load(Path(source).read_text(encoding="utf-8"))
        return Topology.model_validate(raw)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        raise SpecError("--topology", "must be h100, h800 or a readable YAML file", source) from None
    except ValidationError as err:
        e = err.errors(include_url=False)[0]
        raise SpecError("topology." + ".".join(map(str, e["loc"])), e["msg"], e.get("input")) from None


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


def link_bytes(messages: list[Message] | tuple[Message, ...]) -> dict[str, LinkBytes]:
    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for m in messages:
        n = m.nbytes
        if m.local:
            acc[m.src_device][4] += n
        elif node_of(m.src_device) == node_of(m.dst_device):
            acc[m.src_device][0] += n
            acc[m.dst_device][1] += n
        else:
            acc[m.src_device][2] += n
            acc[m.dst_device][3] += n
    return {d: LinkBytes(*v) for d, v in acc.items()}


def round_seconds(rnd: Round, topo: Topology) -> float:
    per_dev = link_bytes(rnd.messages)
    busiest = max((lb.seconds(topo) for lb in per_dev.values()), default=0.0)
    return topo.latency_us * 1e-6 + busiest


def predicted_seconds(plan: Plan, topo: Topology) -> float:
    return sum(round_seconds(r, topo) for r in plan.rounds)


def lower_bound_seconds(plan: Plan, topo: Topology) -> float:
    per_dev = link_bytes(list(plan.messages()))
    busiest = max((lb.seconds(topo) for lb in per_dev.values()), default=0.0)
    return (topo.latency_us * 1e-6 if busiest else 0.0) + busiest
