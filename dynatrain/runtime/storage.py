"""Per-rank local storage of training state as torch tensors in the state's real dtypes.

The storage model is exactly ``dynatrain.verify.simulate``'s (the numpy oracle): one tensor per
(state kind, slot kind, chunk, name). A ``ParamSlot`` stores the TP-local parameter (its local
shape), a ``FlatSlot`` the DistributedOptimizer's contiguous shard of one parameter (its owned
length) and a ``BufferSlot`` the module buffer (its box shape). Fresh storage is zero-filled, so
padding (vocab padding rows, padding inside an optimizer shard) stays zero as Megatron leaves it.
Unlike the oracle, every tensor has the dtype its ``LogicalTensor`` declares: bf16/fp16/fp32 per
state kind, fp32 for buffers (expert_bias) and int64 for Adam's step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch

from ..ir.box import Box
from ..ir.errors import LayoutError
from ..ir.state import BufferSlot, FlatSlot, ParamSlot, Slot, StateView

Storage = dict[tuple, torch.Tensor]  # per rank: (kind, slot kind, chunk, name) -> tensor

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "int64": torch.int64,
}


def slot_key(kind: str, slot: Slot) -> tuple:
    """The storage key of ``slot`` for state ``kind`` (the oracle's key, so stores compare)."""
    return (kind, type(slot).__name__, slot.chunk, slot.name)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an IR dtype name (``bf16``, ``fp16``, ``fp32``, ``int64``)."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise LayoutError(f"IR dtype must be one of {sorted(TORCH_DTYPES)}. Got {name!r}") from None


def allocate(view: StateView, rank: int) -> Storage:
    """Zero-filled local storage of ``rank`` (the layout of ``simulate.allocate``, real dtypes).

    Args:
        view: the state view of the layout.
        rank: the rank in ``view.layout``.

    Example:
        >>> store = allocate(StateView(Layout(spec)), 0)  # doctest: +SKIP
    """
    L = view.layout
    tensors = view.tensors()
    shapes = {(cs.chunk.vp, sh.param.name): sh.local_shape for cs in L.rank_shards(rank)
              for sh in cs.shards}
    lengths = {(b.chunk, o.name): o.param[1] - o.param[0] for b, owned in L.rank_owned(rank)
               for o in owned}
    store: Storage = {}
    for reg in view.regions(rank):
        k = slot_key(reg.kind, reg.slot)
        dtype = torch_dtype(tensors[(reg.key, reg.kind)].dtype)
        have = store.get(k)
        if have is not None:
            # Several logical tensors may share one slot; they must agree on its dtype.
            if have.dtype != dtype:
                raise LayoutError(f"slot {k} holds {have.dtype} and {dtype} (from {reg.key})")
            continue
        s = reg.slot
        if isinstance(s, ParamSlot):
            shape = shapes[(s.chunk, s.name)]
        elif isinstance(s, FlatSlot):
            shape = (lengths[(s.chunk, s.name)],)
        else:
            shape = reg.box.shape
        store[k] = torch.zeros(shape, dtype=dtype)
    return store


def region(store: Mapping[tuple, torch.Tensor], kind: str, slot: Slot, anchor: Box
           ) -> torch.Tensor:
    """A view (never a copy) of ``anchor``'s elements inside the storage of ``slot``.

    Raises:
        LayoutError: the slot's storage cannot show ``anchor`` as a view.
    """
    t = store[slot_key(kind, slot)]
    try:
        if isinstance(slot, ParamSlot):
            # Leading anchor dims beyond the local tensor's are the size-1 stacking axes.
            local = anchor.shape[len(anchor.shape) - t.dim():]
            sl = tuple(slice(o, o + n) for o, n in zip(slot.local_offset, local))
            return t[sl].view(anchor.shape)
        if isinstance(slot, FlatSlot):
            return t[slot.offset:slot.offset + math.prod(anchor.shape)].view(anchor.shape)
        if isinstance(slot, BufferSlot):
            return t.view(anchor.shape)
    except RuntimeError as err:  # .view refuses what would need a copy
        raise LayoutError(f"slot {slot} cannot view anchor {anchor} of its storage "
                          f"{tuple(t.shape)}: {err}") from None
    raise LayoutError(f"unknown slot type {type(slot).__name__}")


def within(box: Box, anchor: Box) -> tuple[slice, ...]:
    """Index of ``box`` inside a view of ``anchor`` (both in global coordinates)."""
    return tuple(slice(l - a, h - a) for l, h, a in zip(box.lo, box.hi, anchor.lo))


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a uint8 view (no copy): the last dim grows by the element size.

    Packing goes through bytes rather than typed views of the staging buffer, because one
    message mixes dtypes (bf16 next to fp32) and a typed view needs an aligned offset.
    """
    if t.dim() == 0:
        t = t.view(1)
    if t.dtype == torch.uint8:
        return t
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        raise LayoutError(f"cannot view a tensor with last stride {t.stride(-1)} as bytes")
    if t.shape[-1] == 1 and t.stride(-1) != 1:
        t = t.as_strided(t.shape, t.stride()[:-1] + (1,))  # a size-1 dim's stride is free
    return t.view(torch.uint8)


def fill_from_global(view: StateView, rank: int,
                     tensors: Mapping[tuple[str, str], torch.Tensor]) -> Storage:
    """Storage of ``rank`` filled from global (logical) tensors, as ``simulate.materialize``.

    Args:
        view: the layout's state view.
        rank: the rank whose storage to build.
        tensors: every logical tensor by (key, kind), in its IR dtype (bit-exact copies need
            it: a bf16 param must be given as bf16, not as the fp32 it was drawn from).

    Raises:
        LayoutError: a tensor is missing or has the wrong dtype or shape.
    """
    store = allocate(view, rank)
    specs = view.tensors()
    for reg in view.regions(rank):
        want = specs[(reg.key, reg.kind)]
        g = tensors.get((reg.key, reg.kind))
        if g is None:
            raise LayoutError(f"no global tensor for {reg.key} [{reg.kind}]")
        if g.dtype != torch_dtype(want.dtype) or tuple(g.shape) != want.shape:
            raise LayoutError(f"{reg.key} [{reg.kind}] must be {want.dtype} {list(want.shape)}. "
                              f"Got {g.dtype} {list(g.shape)}")
        sl = tuple(slice(l, h) for l, h in zip(reg.box.lo, reg.box.hi))
        region(store, reg.kind, reg.slot, reg.box).copy_(g[sl])
    return store


def random_global(view: StateView, seed: int) -> dict[tuple[str, str], torch.Tensor]:
    """Random global tensors for every logical tensor of ``view``, in the real dtypes.

    Floats are drawn in fp32 and cast (so bf16 params round like Megatron's); the step is a
    small int64. Deterministic in ``seed``, so separate processes draw the same tensors.
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for tk, t in sorted(view.tensors().items()):
        dtype = torch_dtype(t.dtype)
        if dtype == torch.int64:
            out[tk] = torch.randint(1, 1 << 20, t.shape, generator=gen, dtype=torch.int64)
        else:
            out[tk] = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(dtype)
    return out


def checksums(store: Mapping[tuple, torch.Tensor]) -> dict[tuple, str]:
    """Per tensor, a blake2b digest of its dtype, shape and bytes (proves state is unchanged)."""
    out = {}
    for k, t in sorted(store.items(), key=lambda kv: repr(kv[0])):
        h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=16)
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        out[k] = h.hexdigest()
    return out


def storage_bytes(store: Mapping[tuple, torch.Tensor]) -> int:
    """Bytes held by ``store``'s tensors."""
    return sum(t.numel() * t.element_size() for t in store.values())
