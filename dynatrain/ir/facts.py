"""Per-rank facts in the terms megatron-core reports them, for one-to-one comparison.

``rank_facts`` gives a rank's coordinates and groups, every checkpoint ShardedTensor its model
chunks would emit (key, global shape and offset, local shape, axis fragmentations, replica id),
its DDP buffers (bucket bounds, per-parameter ranges) and its DistributedOptimizer ranges.
``dynatrain layout --json`` prints exactly this.
"""

from __future__ import annotations

from typing import Any

from .layout import Layout
from .model import chunk_extra_states
from .shard import Shard


def replica_id(layout: Layout, rank: int, sh: Shard) -> list[int]:
    """Megatron's replica id: (tied copy, TP replica, data-parallel replica)."""
    c = layout.coords(rank)
    p = sh.param
    if p.expert:
        tp_rep = c.etp if p.split is None else 0
        return [0, tp_rep, c.edp]
    tp_rep = c.tp if p.split is None else 0
    return [1 if p.tied_copy else 0, tp_rep, c.dp_cp]


def param_facts(layout: Layout, rank: int) -> list[dict[str, Any]]:
    out = []
    for cs in layout.rank_shards(rank):
        for sh in cs.shards:
            npre = len(sh.param.prepend)
            for piece in sh.pieces:
                out.append({
                    "chunk": cs.chunk.vp,
                    "key": sh.param.key,
                    "param_name": sh.param.name,
                    "global_shape": list(sh.global_shape),
                    "global_offset": list(piece.box.lo),
                    "local_shape": list(piece.box.shape[npre:]),
                    "axis_fragmentations": list(sh.fragments),
                    "replica_id": replica_id(layout, rank, sh),
                    "prepend_axis_num": npre,
                    "param_local_row_offset": piece.local_offset[0],
                })
        c = layout.coords(rank)
        for b in cs.buffers:  # replicated over TP and DP, like a norm weight
            if b.fp8_meta:  # inside the module's _extra_state object, not a ShardedTensor
                continue
            pre = [i for i, _ in b.prepend]
            out.append({
                "chunk": cs.chunk.vp, "key": b.key, "buffer_name": b.name,
                "global_shape": [s for _, s in b.prepend] + list(b.shape),
                "global_offset": pre + [0] * len(b.shape), "local_shape": list(b.shape),
                "axis_fragmentations": [s for _, s in b.prepend] + [1] * len(b.shape),
                "replica_id": [0, c.tp, c.dp_cp], "prepend_axis_num": len(pre),
                "param_local_row_offset": 0,
            })
    return out


def buffer_facts(layout: Layout, rank: int) -> list[dict[str, Any]]:
    out = []
    for b in layout.rank_buffers(rank):
        out.append({
            "chunk": b.chunk, "is_expert": b.is_expert, "param_dtype": b.dtype,
            "numel": b.numel, "numel_unpadded": b.numel_unpadded,
            "data_parallel_world_size": b.dp_size,
            "buckets": [list(x) for x in b.buckets],
            "param_index_map": {p.name: [p.start, p.end] for p in b.params},
            "bucket_params": [[p.name for p in b.params if p.bucket == i]
                              for i in range(len(b.buckets))],
        })
    return out


def optimizer_facts(layout: Layout, rank: int) -> list[dict[str, Any]] | None:
    if not layout.parallel.use_distributed_optimizer:
        return None
    out = []
    for b, owned in layout.rank_owned(rank):
        for o in owned:
            out.append({
                "chunk": b.chunk, "is_expert": b.is_expert, "bucket": o.bucket,
                "param_name": o.name, "gbuf_world": list(o.gbuf_world),
                "gbuf_local": list(o.gbuf_local), "param": list(o.param),
            })
    return out


def extra_state_facts(layout: Layout, rank: int) -> list[dict[str, Any]]:
    """The checkpoint ShardedObjects of ``rank``'s TE modules (their ``_extra_state``).

    Replica id (0, TP rank, DP rank) with the module's own groups: ETP and expert-DP for
    experts (M16 transformer/utils.py:120-126; extensions/transformer_engine.py:1789-1798).
    """
    c, p = layout.coords(rank), layout.parallel
    out = []
    for ch in layout.chunks(c.pp):
        for d in chunk_extra_states(layout.model, p.ep, c.ep, ch.layers, ch.post_process,
                                    megatron_core=layout.spec.megatron_core):
            out.append({
                "chunk": ch.vp, "key": d.key,
                "global_shape": [s for _, s in d.prepend] or [1],
                "global_offset": [i for i, _ in d.prepend] or [0],
                "replica_id": [0, c.etp, c.edp] if d.expert else [0, c.tp, c.dp_cp],
            })
    return out


def rank_facts(layout: Layout, rank: int) -> dict[str, Any]:
    """Everything megatron-core would report about ``rank``, as plain JSON-able data."""
    return {
        "rank": rank,
        "device": layout.devices[rank],
        "padded_vocab_size": layout.padded_vocab,
        "coords": {k: v for k, v in layout.coords(rank).as_dict().items() if k != "rank"},
        "groups": {k: list(v) for k, v in layout.mesh.groups(rank).items()},
        "params": param_facts(layout, rank),
        "buffers": buffer_facts(layout, rank),
        "optimizer": optimizer_facts(layout, rank),
    }
