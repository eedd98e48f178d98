"""DDP param/grad buffers and DistributedOptimizer shard ranges, as megatron-core lays them out.

Rules (megatron-core 0.16.1 ``_ParamAndGradBuffer.__init__`` and ``DistributedOptimizer``):
params are placed in reverse ``named_parameters()`` order; with the distributed optimizer each
param starts on a multiple of 64 elements and each bucket end is padded to lcm(D, 128), or to
lcm(D, 128, 2**16) with ``pad_buckets_for_high_nccl_busbw`` (param_and_grad_buffer.py:638-655); a
bucket closes once it holds ``bucket_size`` elements; a shared-embedding param gets a bucket of
its own.
Bucket [bs, be) is cut into D equal ranges and optimizer rank r owns the r-th.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import lru_cache

from .errors import LayoutError
from .versions import series


@dataclass(frozen=True, slots=True)
class BufferParam:
    """A parameter's place in a buffer: ``[start, end)`` in elements, and its bucket."""

    name: str
    start: int
    end: int
    bucket: int


@dataclass(frozen=True, slots=True)
class BufferLayout:
    """One DDP buffer of one model chunk."""

    chunk: int
    is_expert: bool
    dtype: str
    dp_size: int  # D: ranks that shard this buffer's optimizer state
    numel: int
    numel_unpadded: int
    buckets: tuple[tuple[int, int], ...]
    params: tuple[BufferParam, ...]  # in placement order (reverse named_parameters order)


@dataclass(frozen=True, slots=True)
class OwnedRange:
    """The part of one parameter that optimizer rank r owns (Megatron's range map)."""

    name: str
    bucket: int
    gbuf_world: tuple[int, int]  # in the whole buffer
    gbuf_local: tuple[int, int]  # in this rank's shard of the bucket
    param: tuple[int, int]  # in ``param.view(-1)`` of the TP-local parameter


@lru_cache(maxsize=1 << 14)
def layout_buffer(
    chunk: int, is_expert: bool, dtype: str, params: tuple[tuple[str, int, bool], ...],
    dp_size: int, bucket_size: int | None, distributed_optimizer: bool, *,
    pad_for_busbw: bool = False,
) -> BufferLayout:
    """Place ``params`` = ((name, numel, shared_embedding), ...) given in named_parameters order.

    ``pad_for_busbw`` is DDP's ``pad_buckets_for_high_nccl_busbw``: like all bucket padding it
    only acts with the distributed optimizer."""
    pad_param = (lambda i: -(-i // 64) * 64) if distributed_optimizer else (lambda i: i)
    div = math.lcm(dp_size, 128, 1 << 16) if pad_for_busbw else math.lcm(dp_size, 128)
    pad_bucket = (lambda i: -(-i // div) * div) if distributed_optimizer else (lambda i: i)
    placed: list[BufferParam] = []
    buckets: list[tuple[int, int]] = []
    unpadded = 0
    start = bucket_start = 0
    in_bucket = 0
    end = 0

    def close(param_end: int) -> int:
        nonlocal bucket_start, in_bucket, unpadded
        unpadded += param_end - bucket_start
        bucket_end = pad_bucket(param_end)
        buckets.append((bucket_start, bucket_end))
        bucket_start, in_bucket = bucket_end, 0
        return bucket_end

    for name, numel, shared in reversed(params):
        start = pad_param(start)
        own_bucket = shared and distributed_optimizer
        if own_bucket and in_bucket:
            start = close(start)
        end = start + numel
        placed.append(BufferParam(name, start, end, len(buckets)))
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            start = close(end)
        else:
            start = end
    if in_bucket:
        close(end)
    numel = buckets[-1][1] if buckets else 0
    return BufferLayout(chunk, is_expert, dtype, dp_size, numel, unpadded, tuple(buckets),
                        tuple(placed))


def owned_ranges(buf: BufferLayout, rank: int) -> tuple[OwnedRange, ...]:
    """What optimizer rank ``rank`` (0 <= rank < D) owns in each bucket of ``buf``."""
    params = buf.params
    return tuple([OwnedRange(params[i].name, params[i].bucket, (a, z), (a - lo, z - lo),
                             (a - params[i].start, z - params[i].start))
                  for i, a, z, lo in owned_spans(buf, rank)])


def owned_spans(buf: BufferLayout, rank: int) -> list[tuple[int, int, int, int]]:
    """``owned_ranges`` as bare numbers: (index into ``buf.params``, start and end of the
    owned part in the whole buffer, start of the rank's shard of that bucket) per range (a
    large MoE buffer has thousands, and most callers keep few of them as objects)."""
    out = []
    params = buf.params  # placed in increasing start: a rank's share is a run of them
    for b, (bs, be) in enumerate(buf.buckets):
        if (be - bs) % buf.dp_size:  # Megatron asserts this too; a floor would drop the tail
            raise LayoutError(f"bucket {b} of {be - bs} elements does not split "
                              f"{buf.dp_size} ways")
        size = (be - bs) // buf.dp_size
        lo, hi = bs + rank * size, bs + (rank + 1) * size
        # The first param ending past lo; buckets hold runs of params, so search them all.
        i = bisect.bisect_right(params, lo, key=_end)
        while i < len(params) and params[i].start < hi:
            p = params[i]
            i += 1
            if p.bucket != b:
                continue
            a, z = max(p.start, lo), min(p.end, hi)
            if a < z:
                out.append((i - 1, a, z, lo))
    return out


def _end(p: BufferParam) -> int:
    return p.end


def experts_in_own_buffer(megatron_core: str, tp: int, ep: int, etp: int) -> bool:
    """Whether expert params sit in DDP's expert buffer (sharded over expert DP) rather than the
    dense one: megatron-core marks them ``allreduce=False`` when EP > 1, and from 0.19 also
    when ETP != TP at EP = 1 (``versions.Series.etp_own_expert_buffer``)."""
    return ep > 1 or (etp != tp and series(megatron_core).etp_own_expert_buffer)
