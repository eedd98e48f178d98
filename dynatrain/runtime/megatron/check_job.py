"""Check a running Megatron-core job against the layout the IR computes for it, before a switch.

A live switch moves bytes by the IR's picture of the source job. ``check_job`` holds that picture
against what the job itself reports, on one rank, and refuses at the first difference instead of
moving wrong bytes:

* the spec's megatron-core series against the running ``megatron.core.__version__``;
* every checkpoint ShardedTensor of each model chunk's own ``sharded_state_dict()`` (factories
  built; ShardedObjects such as ``_extra_state`` skipped): key, global shape and offset, local
  shape, axis fragmentations and replica id, against ``ir.facts.param_facts``;
* each DDP buffer (dense, then expert, per chunk): per-parameter ``param_index_map`` ranges and
  bucket, bucket bounds and sizes, against ``ir.facts.buffer_facts``;
* the DistributedOptimizer's per-parameter ranges (``gbuf_ranges``: world, local and param
  ranges per bucket), against ``ir.facts.optimizer_facts``.

Only metadata is read: no parameter value is touched, no collective runs. One side effect is
megatron's own: a router's ``_save_to_state_dict`` casts an ``expert_bias`` that
``Float16Module`` left in bf16 back to fp32 (exactly, as the router's next forward does).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ...ir import versions
from ...ir.errors import LayoutError, SpecError
from ...ir.facts import buffer_facts, optimizer_facts, param_facts
from ...ir.layout import Layout


def running_megatron_core() -> str:
    """The version of the megatron-core this process runs (its ``__version__``)."""
    import megatron.core

    return str(megatron.core.__version__)


def check_version(spec_version: str, running: str) -> None:
    """Refuse a spec whose megatron-core series is not the running one's.

    Raises:
        SpecError: on field ``megatron_core``, one line naming both versions.
    """
    try:
        ours, theirs = versions.series_key(spec_version), versions.series_key(running)
    except (ValueError, AttributeError):
        raise SpecError("megatron_core", f"cannot read the running megatron-core version "
                        f"{running!r}") from None
    if ours != theirs:
        raise SpecError("megatron_core", f"the spec's layout rules are for megatron-core "
                        f"{spec_version}, the running job has {running} (another series)")


def check_job(layout: Layout, rank: int, model_chunks: Sequence[torch.nn.Module],
              optimizer: Any, *, running: str | None = None) -> dict[str, int]:
    """Refuse a job whose own metadata differs from what the IR computes for ``rank``.

    Args:
        layout: the layout the job is meant to run.
        rank: this process's rank in it.
        model_chunks: the rank's DDP-wrapped model chunks, in virtual-pipeline order.
        optimizer: what ``get_megatron_optimizer`` returned for them.
        running: the running megatron-core version (default: ``megatron.core.__version__``).

    Returns:
        How many facts were compared: ``sharded_tensors``, ``buffer_params`` (DDP
        ``param_index_map`` entries) and ``optimizer_ranges`` (0 without the distributed
        optimizer).

    Raises:
        SpecError: ``megatron_core`` names another series than the running one.
        LayoutError: the first difference, in one line naming the parameter (its
            ``named_parameters`` name and checkpoint key), what the IR says and what the job
            says.

    Example:
        >>> check_job(Layout(spec), rank, job.model_chunks, job.optimizer)  # doctest: +SKIP
    """
    check_version(layout.spec.megatron_core, running or running_megatron_core())
    from megatron.core.utils import unwrap_model

    modules = list(unwrap_model(list(model_chunks)))
    names = [{id(p): n for n, p in m.named_parameters()} for m in modules]
    keys = _keys(layout, rank)
    return {"sharded_tensors": _check_sharded(layout, rank, modules, names),
            "buffer_params": _check_buffers(layout, rank, list(model_chunks), names, keys),
            "optimizer_ranges": _check_optimizer(layout, rank, optimizer, names, keys)}


# ---- checkpoint metadata ----------------------------------------------------------------------

_SHARDED = ("global_shape", "local_shape", "axis_fragmentations", "replica_id")


def _ints(x: Any) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in x] if isinstance(x, (tuple, list, torch.Size)) else [int(x)]


def _keys(layout: Layout, rank: int) -> dict[tuple[int, str], str]:
    """(chunk, parameter name) -> its checkpoint key, for messages."""
    return {(cs.chunk.vp, sh.param.name): sh.param.key
            for cs in layout.rank_shards(rank) for sh in cs.shards}


def _leaves(sd: Any) -> Iterator[Any]:
    """Every ShardedTensor of a nested sharded state dict (factories built), in order."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
    )

    if isinstance(sd, dict):
        sd = sd.values()
    elif not isinstance(sd, (list, tuple)):
        sd = [sd]
    for v in sd:
        if isinstance(v, (dict, list, tuple)):
            yield from _leaves(v)
        elif isinstance(v, ShardedTensorFactory):
            yield from _leaves(v.build())
        elif isinstance(v, ShardedTensor) and not v.key.endswith("_extra_state"):
            yield v


def _owner(t: torch.Tensor, module: torch.nn.Module) -> str:
    """The name of the parameter or buffer whose memory ``t`` lies in ('?' if none); only for
    messages, so a linear scan is fine."""
    if not isinstance(t, torch.Tensor):
        return "?"
    ptr, lo = t.untyped_storage().data_ptr(), t.storage_offset()
    for name, x in list(module.named_parameters()) + list(module.named_buffers()):
        if x is not None and x.dtype == t.dtype and x.untyped_storage().data_ptr() == ptr \
                and x.storage_offset() <= lo < x.storage_offset() + max(x.numel(), 1):
            return name
    return "?"


def _check_sharded(layout: Layout, rank: int, modules: list, names: list) -> int:
    want: dict[tuple, dict] = {}
    for f in param_facts(layout, rank):
        want[(f["chunk"], f["key"], tuple(f["global_offset"]))] = f
    chunk_of = {cs.chunk.vp: i for i, cs in enumerate(layout.rank_shards(rank))}
    if len(modules) != len(chunk_of):
        raise LayoutError(f"rank {rank}: the layout has {len(chunk_of)} model chunk(s), the job "
                          f"passed {len(modules)}")
    got: dict[tuple, tuple[Any, int]] = {}
    for vp, i in chunk_of.items():
        # An empty metadata, not None: 0.16's GPTModel reads metadata["dp_cp_group"] on an
        # MTP stage without a default (M16 models/gpt/gpt_model.py:842).
        for sh in _leaves(modules[i].sharded_state_dict(metadata={})):
            got[(vp, sh.key, tuple(_ints(sh.global_offset)))] = (sh, i)
    for k, f in want.items():  # in the IR's order: the first differing parameter
        what = f.get("param_name") or f.get("buffer_name")
        where = f"rank {rank} chunk {k[0]} {what} ({k[1]})"
        if k not in got:
            others = sorted(o[2] for o in got if o[:2] == k[:2])
            raise LayoutError(f"{where}: the IR says a ShardedTensor at global offset "
                              f"{list(k[2])}, the job's sharded_state_dict has "
                              f"{[list(o) for o in others] or 'no such key'}")
        sh, _ = got[k]
        job = {"global_shape": _ints(sh.global_shape), "local_shape": _ints(sh.local_shape),
               "axis_fragmentations": _ints(sh.axis_fragmentations),
               "replica_id": _ints(sh.replica_id)}
        for field in _SHARDED:
            if list(f[field]) != job[field]:
                raise LayoutError(f"{where} at offset {list(k[2])}: the IR says {field} "
                                  f"{list(f[field])}, the job says {job[field]}")
    for k in got.keys() - want.keys():
        sh, i = got[k]
        raise LayoutError(f"rank {rank} chunk {k[0]} {_owner(sh.data, modules[i])} ({k[1]}): the"
                          f" job's sharded_state_dict has a ShardedTensor at global offset "
                          f"{list(k[2])}, the IR has none")
    return len(want)


# ---- DDP buffers ------------------------------------------------------------------------------


def _check_buffers(layout: Layout, rank: int, chunks: list, names: list, keys: dict) -> int:
    got: dict[tuple[int, bool], list] = {}
    vps = [cs.chunk.vp for cs in layout.rank_shards(rank)]
    for vp, ddp in zip(vps, chunks):
        if not hasattr(ddp, "buffers") or not hasattr(ddp, "expert_parallel_buffers"):
            raise LayoutError(f"rank {rank} chunk {vp}: the model chunk is a "
                              f"{type(ddp).__name__}, not megatron's DistributedDataParallel")
        got[(vp, False)] = list(ddp.buffers)
        got[(vp, True)] = list(ddp.expert_parallel_buffers)
    want: dict[tuple[int, bool], list] = {k: [] for k in got}
    for f in buffer_facts(layout, rank):
        want.setdefault((f["chunk"], f["is_expert"]), []).append(f)
    for (vp, expert), fs in want.items():
        kind = "expert" if expert else "dense"
        bufs = got.get((vp, expert), [])
        if len(fs) != len(bufs):
            raise LayoutError(f"rank {rank} chunk {vp}: the IR says {len(fs)} {kind} DDP "
                              f"buffer(s), the job has {len(bufs)}")
        for f, buf in zip(fs, bufs):
            _check_buffer(rank, vp, kind, f, buf, names[vps.index(vp)], keys)
    return sum(len(f["param_index_map"]) for fs in want.values() for f in fs)


def _check_buffer(rank: int, vp: int, kind: str, f: dict, buf: Any, names: dict,
                  keys: dict) -> None:
    live = {names.get(id(p), "?"): (int(s), int(e), int(b))
            for p, (s, e, b) in buf.param_index_map.items()}
    want = {n: (s, e, b) for b, ns in enumerate(f["bucket_params"]) for n in ns
            for s, e in [f["param_index_map"][n]]}
    where = f"rank {rank} chunk {vp} {kind} DDP buffer"

    def param(name: str) -> str:
        return f"{name} ({keys.get((vp, name), '?')})"

    for name, (s, e, b) in want.items():
        if name not in live:
            raise LayoutError(f"{where}: {param(name)}: the IR places it at [{s}, {e}) in "
                              f"bucket {b}, the job's buffer does not hold it")
        if live[name] != (s, e, b):
            ls, le, lb = live[name]
            raise LayoutError(f"{where}: {param(name)}: the IR says [{s}, {e}) in bucket {b}, "
                              f"the job says [{ls}, {le}) in bucket {lb}")
    if extra := sorted(live.keys() - want.keys()):
        raise LayoutError(f"{where}: {param(extra[0])}: the job's buffer holds it, the IR "
                          "does not")
    bounds = [[int(a), int(z)] for a, z in buf.bucket_indices]
    for i, (a, z) in enumerate(zip(f["buckets"], bounds)):
        if list(a) != z:
            first = f["bucket_params"][i][0] if f["bucket_params"][i] else "?"
            raise LayoutError(f"{where} bucket {i} (first param {param(first)}): the IR says "
                              f"bounds {list(a)}, the job says {z}")
    for field, ours, theirs in (("buckets", len(f["buckets"]), len(bounds)),
                                ("numel", f["numel"], int(buf.numel)),
                                ("numel_unpadded", f["numel_unpadded"], int(buf.numel_unpadded)),
                                ("data_parallel_world_size", f["data_parallel_world_size"],
                                 int(buf.data_parallel_world_size))):
        if ours != theirs:
            raise LayoutError(f"{where}: the IR says {field} {ours}, the job says {theirs}")


# ---- DistributedOptimizer ---------------------------------------------------------------------


def _check_optimizer(layout: Layout, rank: int, optimizer: Any, names: list,
                     keys: dict) -> int:
    want = optimizer_facts(layout, rank)
    if want is None:
        return 0  # no distributed optimizer: the bridge checks the replicated one's params
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    vps = [cs.chunk.vp for cs in layout.rank_shards(rank)]
    got: dict[tuple[int, str], tuple] = {}
    leaves = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    for opt in leaves:
        if getattr(opt, "is_stub_optimizer", False):
            continue
        if not isinstance(opt, DistributedOptimizer):
            raise LayoutError(f"rank {rank}: the layout uses the distributed optimizer, the job "
                              f"runs {type(opt).__name__}")
        for g, per_dtype in enumerate(opt.gbuf_ranges):
            idx = int(opt.gbuf_idx_to_model_idx_map[g])
            for bucket_ranges in per_dtype.values():
                for b, rng in enumerate(bucket_ranges):
                    for p, r in rng["param_map"].items():
                        got[(vps[idx], names[idx].get(id(p), "?"))] = (
                            b, (r["gbuf_world"].start, r["gbuf_world"].end),
                            (r["gbuf_local"].start, r["gbuf_local"].end),
                            (r["param"].start, r["param"].end))
    seen = set()
    for f in want:
        key = (f["chunk"], f["param_name"])
        seen.add(key)
        ours = (f["bucket"], tuple(f["gbuf_world"]), tuple(f["gbuf_local"]), tuple(f["param"]))
        where = f"rank {rank} chunk {key[0]} {key[1]} ({keys.get(key, '?')})"
        if key not in got:
            raise LayoutError(f"{where}: the IR gives this rank's optimizer {_range(ours)}, the "
                              "job's optimizer holds none of it")
        if got[key] != ours:
            raise LayoutError(f"{where}: the IR gives this rank's optimizer {_range(ours)}, the "
                              f"job's has {_range(got[key])}")
    if extra := sorted(got.keys() - seen):
        raise LayoutError(f"rank {rank} chunk {extra[0][0]} {extra[0][1]} "
                          f"({keys.get(extra[0], '?')}): the job's optimizer "
                          f"holds {_range(got[extra[0]])}, the IR gives this rank none of it")
    return len(want)


def _range(r: tuple) -> str:
    b, world, local, param = r
    return (f"param [{param[0]}, {param[1]}) (bucket {b}, buffer [{world[0]}, {world[1]}), "
            f"shard [{local[0]}, {local[1]}))")


__all__ = ["check_job", "check_version", "running_megatron_core"]
