"""Read and write one rank's live Megatron-core training state as the IR's local storage.

``extract_state`` binds every storage tensor the IR expects on a rank (``storage.allocate``'s
keys, shapes and dtypes) to the tensor of the running job that holds it: the bf16 module
parameter (which, with the distributed optimizer, is a view of the DDP param buffer), the fp32
main parameter, Adam's exp_avg/exp_avg_sq (the DistributedOptimizer's flat shard of each
parameter, or whole TP-local tensors without it; with the precision-aware optimizer TE
FusedAdam's own master and bf16/fp32 moments), the router's expert_bias buffer, TE's fp8
delayed-scaling tensors and Adam's step. It returns views of those tensors, never copies,
except for the step (an int64 scalar read from the optimizer), an expert_bias still in the bf16
that ``Float16Module`` cast it to before the first forward (megatron's router restores fp32
itself on the next forward) and the initial fp8 scales (1) and histories (0) of a TE module
that has not run an fp8 forward yet.

``install_state`` writes a storage into the model chunks and optimizer of the same layout in
place, so megatron's own references (DDP param buffer, ``param.main_param``, the inner
optimizer's param groups) keep pointing at the installed values and training continues on them.

Every binding is checked against the IR before anything is read or written: parameter names and
local shapes per chunk, dtypes, and, with the distributed optimizer, each parameter's range in
the optimizer's shard (``DistributedOptimizer._get_model_param_range_map``) against the IR's.
A job that the spec does not describe raises ``LayoutError`` naming the first difference.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...ir.errors import LayoutError
from ...ir.state import BufferSlot, StateView, view_of
from ..storage import Storage, slot_key, storage_layout
from . import te_fp8

STEP_KEY = slot_key("step", BufferSlot(-1, "step"))
_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, slots=True)
class SlotSpec:
    """Shape and dtype of one storage tensor of a rank (what ``storage.allocate`` makes)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def storage_spec(view: StateView, rank: int) -> dict[tuple, SlotSpec]:
    """Every storage key of ``rank`` with its shape and dtype, without allocating anything."""
    return {k: SlotSpec(shape, dtype) for k, (shape, dtype) in storage_layout(view, rank).items()}


@dataclass
class _Bound:
    """One rank's live objects, keyed the way the IR names them."""

    params: dict[tuple[int, str], torch.nn.Parameter] = field(default_factory=dict)
    buffers: dict[tuple[int, str], tuple[torch.nn.Module, str]] = field(default_factory=dict)
    # (chunk, name) -> (TE module, one of te_fp8.FP8_TENSORS): delayed-scaling fp8 state
    fp8: dict[tuple[int, str], tuple[torch.nn.Module, str]] = field(default_factory=dict)
    # (chunk, name) -> (leaf megatron optimizer, its fp32 main param for this parameter, the
    # inner optimizer's key for the parameter's Adam state: the main param itself, or with the
    # precision-aware optimizer the bf16 shard whose FusedAdam state holds the master)
    mains: dict[tuple[int, str], tuple[Any, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)
    optimizers: list = field(default_factory=list)

    def buffer(self, chunk: int, name: str) -> torch.Tensor:
        module, attr = self.buffers[(chunk, name)]
        return getattr(module, attr)


def _leaf_optimizers(optimizer: Any) -> list:
    leaves = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    return [o for o in leaves if not getattr(o, "is_stub_optimizer", False)]


def _chunk_modules(model_chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    from megatron.core.utils import unwrap_model

    return list(unwrap_model(list(model_chunks)))


def _job_device(model_chunks: Sequence[torch.nn.Module]) -> torch.device:
    """Where the job's state lives (its first parameter's device). The storage tensors made
    here (the step, zeros for state the job does not hold yet) go there too: the executor
    copies one device's storage with one kernel table, which reads only that device."""
    for chunk in model_chunks:
        for p in chunk.parameters():
            return p.device
    return torch.device("cpu")


def _bind(view: StateView, rank: int, model_chunks: Sequence[torch.nn.Module],
          optimizer: Any) -> _Bound:
    L = view.layout
    chunks = L.rank_shards(rank)
    modules = _chunk_modules(model_chunks)
    if len(modules) != len(chunks):
        raise LayoutError(f"rank {rank}: the layout has {len(chunks)} model chunk(s), the job "
                          f"passed {len(modules)}")
    b = _Bound()
    where: dict[int, tuple[int, str]] = {}  # id(param) -> (chunk, name)
    for cs, module in zip(chunks, modules):
        vp = cs.chunk.vp
        live = {n: p for n, p in module.named_parameters()}
        want = {sh.param.name: sh.local_shape for sh in cs.shards}
        if set(live) != set(want):
            extra, missing = sorted(set(live) - set(want)), sorted(set(want) - set(live))
            raise LayoutError(f"rank {rank} chunk {vp}: the model's parameters differ from the "
                              f"layout's: only in the model {extra[:3]}, only in the layout "
                              f"{missing[:3]}")
        for name, shape in want.items():
            p = live[name]
            if tuple(p.shape) != shape:
                raise LayoutError(f"rank {rank} chunk {vp}: {name} has local shape "
                                  f"{list(p.shape)}, the layout says {list(shape)}")
            b.params[(vp, name)] = p
            where[id(p)] = (vp, name)
        buffers = dict(module.named_buffers())
        for d in cs.buffers:
            if d.fp8_meta:
                continue
            if buffers.get(d.name) is None:
                raise LayoutError(f"rank {rank} chunk {vp}: the model has no buffer {d.name}")
            owner, _, attr = d.name.rpartition(".")
            b.buffers[(vp, d.name)] = (module.get_submodule(owner), attr)
        _bind_fp8(rank, vp, module, [d for d in cs.buffers if d.fp8_meta], b)
    if len(view.kinds) > 1:
        b.optimizers = _leaf_optimizers(optimizer)
        for opt in b.optimizers:
            _check_precision_aware(rank, opt)
        if L.parallel.use_distributed_optimizer:
            _bind_distributed(L, rank, b, where)
        else:
            _bind_replicated(rank, b, where)
    return b


def _bind_fp8(rank: int, vp: int, module: torch.nn.Module, defs: list, b: _Bound) -> None:
    """Bind the delayed-scaling fp8 tensors the layout names to the TE modules holding them,
    and refuse a job whose modules keep such state where the layout has none. TE's core
    attention is left out: with fp8_dpa off (refused when reading a job) it never quantizes,
    and megatron does not save its state (M16 extensions/transformer_engine.py:1436-1455), so
    a reload rebuilds it, as a switch does."""
    want: dict[str, list] = {}
    for d in defs:
        owner, _, which = d.name.partition("._extra_state.")
        want.setdefault(owner, []).append((d.name, which))
    for path, sub in module.named_modules():
        if te_fp8.has_delayed_state(sub) and path not in want and \
                not path.endswith("core_attention"):
            raise LayoutError(f"rank {rank} chunk {vp}: {path} keeps fp8 delayed-scaling state "
                              "the layout does not have (is the spec's fp8 set?)")
    for owner, tensors in want.items():
        try:
            te = module.get_submodule(owner)
        except AttributeError:
            te = None
        if not hasattr(te, "init_fp8_meta_tensors"):
            raise LayoutError(f"rank {rank} chunk {vp}: the model has no Transformer Engine "
                              f"module {owner} for its fp8 state")
        for name, which in tensors:
            b.fp8[(vp, name)] = (te, which)


def _bind_distributed(L, rank: int, b: _Bound, where: dict) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    want = {(buf.chunk, o.name): o.param for buf, owned in L.rank_owned(rank) for o in owned}
    for opt in b.optimizers:
        if not isinstance(opt, DistributedOptimizer):
            raise LayoutError(f"rank {rank}: the layout uses the distributed optimizer, the job "
                              f"runs {type(opt).__name__}")
        for p in opt.model_param_gbuf_map:
            key = where.get(id(p))
            if key is None:
                raise LayoutError(f"rank {rank}: the optimizer holds a parameter of shape "
                                  f"{list(p.shape)} that is not in the model chunks passed")
            r = opt._get_model_param_range_map(p)["param"]
            if want.get(key) != (r.start, r.end):
                raise LayoutError(f"rank {rank}: the optimizer owns [{r.start}, {r.end}) of "
                                  f"chunk {key[0]} {key[1]}, the layout says {want.get(key)}")
            b.mains[key] = _main_of(opt, p)
    if missing := sorted(set(want) - set(b.mains)):
        raise LayoutError(f"rank {rank}: the layout gives this rank's optimizer a shard of "
                          f"{missing[:3]}, the job's optimizer has none")


def _precision_aware(opt: Any) -> bool:
    """TE FusedAdam holds the master params (``master_weights``): megatron's precision-aware
    optimizer without fp8 params or with delayed scaling (M16 optimizer/__init__.py:365-387)."""
    return bool(getattr(getattr(opt, "config", None),
                        "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))


def _any_precision_aware(opt: Any) -> bool:
    """TE FusedAdam keeps the moments in the configured dtypes (with fp8 recipes other than
    delayed and fp32 masters, megatron still holds the masters itself)."""
    return bool(getattr(getattr(opt, "config", None), "use_precision_aware_optimizer", False))


def _check_precision_aware(rank: int, opt: Any) -> None:
    """The precision-aware states the bridge reads and writes in place: fp32 masters and
    fp32/bf16 moments. Int16 remainders are not masters (a master is the pair with the bf16
    param), and fp16/fp8 states are scaled by factors TE does not save."""
    if not _any_precision_aware(opt):
        return
    inner = opt.optimizer
    if getattr(inner, "store_param_remainders", False):
        raise LayoutError(f"rank {rank}: TE FusedAdam keeps the master params as int16 "
                          "remainders of the bf16 params (store_param_remainders), which "
                          "DynaTrain does not carry yet")
    dtypes = getattr(inner, "name_to_dtype_map", {})
    bad = {k: str(v) for k, v in dtypes.items()
           if v not in (torch.float32, torch.bfloat16) or (k == "master_param"
                                                           and v != torch.float32)}
    if bad:
        raise LayoutError(f"rank {rank}: TE FusedAdam states {bad} are scaled per tensor by "
                          "factors it does not save; DynaTrain carries fp32/bf16 moments and "
                          "fp32 masters")


def _main_of(opt: Any, p: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(optimizer, fp32 main param, its Adam state's key) for model param ``p``. With the
    precision-aware optimizer the inner optimizer steps the bf16 shard of the DDP param buffer
    and keeps the master in ``state[shard]["master_param"]`` (M16 optimizer/distrib_optimizer.py:
    406-449, 883-909), created by TE's own initializer when absent."""
    if not _precision_aware(opt):
        main = opt._get_main_param_and_optimizer_states(p)["param"]
        return opt, main, main
    group, index = opt.model_param_group_index_map[p]
    shard = opt.optimizer.param_groups[group]["params"][index]
    state = opt.optimizer.state[shard]
    if "master_param" not in state:
        opt.optimizer.initialize_state(shard, False)
    return opt, state["master_param"], shard


def _bind_replicated(rank: int, b: _Bound, where: dict) -> None:
    for opt in b.optimizers:
        if not hasattr(opt, "fp32_from_float16_groups"):
            raise LayoutError(f"rank {rank}: expected megatron's Float16OptimizerWithFloat16Params"
                              f" (bf16 params, fp32 main params), got {type(opt).__name__}")
        if any(opt.fp32_from_fp32_groups):
            raise LayoutError(f"rank {rank}: the job has fp32 model parameters; the layout's "
                              "params are all in the spec's param dtype")
        for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            for p, main in zip(models, mains):
                key = where.get(id(p))
                if key is None:
                    raise LayoutError(f"rank {rank}: the optimizer holds a parameter of shape "
                                      f"{list(p.shape)} that is not in the model chunks passed")
                b.mains[key] = (opt, main, main)
    if missing := sorted(set(b.params) - set(b.mains)):
        raise LayoutError(f"rank {rank}: no optimizer holds {missing[:3]}")


# ---- Adam's step ----------------------------------------------------------------------------


def _per_param_step(inner: Any) -> bool:
    """torch's Adam keeps the step per parameter; Apex/TE FusedAdam keeps it per param group."""
    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def read_step(optimizer: Any) -> int:
    """Adam's step count, the same for every parameter of every optimizer (0 before any step).

    Raises:
        LayoutError: the optimizers disagree on the step.
    """
    steps = set()
    for opt in _leaf_optimizers(optimizer):
        inner = opt.optimizer
        if _per_param_step(inner):
            steps.update(float(s["step"]) for s in inner.state.values() if "step" in s)
        else:
            steps.update(float(g["step"]) for g in inner.param_groups
                         if g["params"] and "step" in g)
    if len(steps) > 1:
        raise LayoutError(f"the optimizers disagree on Adam's step: {sorted(steps)}")
    step = steps.pop() if steps else 0.0
    if step != int(step):
        raise LayoutError(f"Adam's step must be a whole number (got {step})")
    return int(step)


def _write_step(opt: Any, step: int) -> None:
    inner = opt.optimizer
    if _per_param_step(inner):
        for group in inner.param_groups:
            for p in group["params"]:
                old = inner.state[p].get("step")
                # One tensor per parameter: torch's Adam increments each in place.
                inner.state[p]["step"] = (torch.tensor(float(step)) if old is None
                                          else torch.full_like(old, float(step)))
    else:
        for group in inner.param_groups:
            group["step"] = step


def _ensure_moments(opt: Any) -> None:
    """Give every main param its Adam moments (megatron's own initializer: zeros)."""
    inner = opt.optimizer
    if _any_precision_aware(opt):
        # TE's own initializer (moments zero, master = the param); megatron's init_state_fn
        # calls it with one argument, which TE >= 2.1 rejects (M16 optimizer/__init__.py:391-399).
        for g in inner.param_groups:
            for p in g["params"]:
                if len(inner.state[p]) == 0:
                    inner.initialize_state(p, False)  # remainders: refused above
        return
    if any(len(inner.state[p]) == 0 or not all(k in inner.state[p] for k in _MOMENTS)
           for g in inner.param_groups for p in g["params"]):
        if opt.init_state_fn is None:
            raise LayoutError(f"{type(inner).__name__} has no Adam state initializer")
        opt.init_state_fn(inner, opt.config)


# ---- extract / install ----------------------------------------------------------------------


def _live(b: _Bound, key: tuple) -> torch.Tensor | None:
    """The live tensor behind storage ``key`` (None for a moment Adam has not created yet)."""
    kind, _, chunk, name = key
    if kind == "param":
        return b.params[(chunk, name)].detach()
    if kind == "buffer" and (chunk, name) in b.fp8:
        return te_fp8.live_tensor(*b.fp8[(chunk, name)])
    if kind == "buffer":
        return b.buffer(chunk, name).detach()
    opt, main, owner = b.mains[(chunk, name)]
    if kind == "main_param":
        return main.detach()
    return opt.optimizer.state[owner].get(kind)


def extract_state(view: StateView, rank: int, model_chunks: Sequence[torch.nn.Module],
                  optimizer: Any) -> Storage:
    """The live state of ``rank`` as IR storage: views of the job's own tensors.

    Args:
        view: the state view of the layout the job runs.
        rank: this process's rank in that layout.
        model_chunks: the rank's model chunks in virtual-pipeline order (GPTModel, or wrapped
            in Float16Module / DistributedDataParallel).
        optimizer: what ``get_megatron_optimizer`` returned for those chunks.

    Returns:
        Storage with exactly ``storage.allocate(view, rank)``'s keys, shapes and dtypes. The
        tensors alias the job's state (read them only); before the first optimizer step the
        moments are zeros and the step is 0, the state Adam starts from.

    Raises:
        LayoutError: the job does not run the layout of ``view``.

    Example:
        >>> store = extract_state(view_of(Layout(spec)), rank, ddp_chunks, opt)  # doctest: +SKIP
    """
    b = _bind(view, rank, model_chunks, optimizer)
    device = _job_device(model_chunks)
    for (chunk, name), (te, _) in b.fp8.items():
        if te_fp8.has_delayed_state(te):
            te_fp8.check_folded(te, name)
    store: Storage = {}
    for key, spec in storage_spec(view, rank).items():
        if key == STEP_KEY:
            t = torch.tensor(read_step(optimizer), dtype=torch.int64, device=device)
        else:
            t = _live(b, key)
            if t is None and key[0] == "buffer" and (key[2], key[3]) in b.fp8:
                t = te_fp8.initial_tensor(b.fp8[(key[2], key[3])][1], spec.shape,
                                           device)  # no fp8 yet
            elif t is None:
                t = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
            elif key[0] == "buffer" and t.dtype != spec.dtype:
                t = t.to(spec.dtype)  # expert_bias still in Float16Module's bf16: exact
            if t.numel() != math.prod(spec.shape) or t.dtype != spec.dtype:
                raise LayoutError(f"rank {rank}: {key} is {t.dtype} {list(t.shape)} in the job, "
                                  f"the layout says {spec.dtype} {list(spec.shape)}")
            t = t.view(spec.shape)
        store[key] = t
    return store


def install_state(view: StateView, rank: int, model_chunks: Sequence[torch.nn.Module],
                  optimizer: Any, storage: Mapping[tuple, torch.Tensor]) -> None:
    """Write ``storage`` into the rank's model chunks and optimizer, in place.

    The model chunks and optimizer must be built for the layout of ``view`` (freshly, or
    already training); afterwards they hold exactly ``storage``: module params (and so the DDP
    param buffer they view), fp32 main params, Adam moments and step, expert_bias. Vocab
    padding rows take the storage's values (zeros in a storage the executor built).

    Args:
        view, rank, model_chunks, optimizer: as for ``extract_state``.
        storage: the rank's storage (``storage.allocate``'s keys, shapes and dtypes).

    Raises:
        LayoutError: the storage or the job does not match the layout; nothing is written.

    Example:
        >>> install_state(view, rank, ddp_chunks, opt, dst_store)  # doctest: +SKIP
    """
    specs = storage_spec(view, rank)
    if set(storage) != set(specs):
        extra, missing = set(storage) - set(specs), set(specs) - set(storage)
        raise LayoutError(f"rank {rank}: the storage does not match the layout: extra "
                          f"{sorted(extra, key=repr)[:3]}, missing {sorted(missing, key=repr)[:3]}")
    for key, spec in specs.items():
        t = storage[key]
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise LayoutError(f"rank {rank}: storage {key} is {t.dtype} {list(t.shape)}, the "
                              f"layout says {spec.dtype} {list(spec.shape)}")
    with torch.no_grad():
        bound = _writable(view, rank, model_chunks, optimizer)
        _zero_unheld(view, rank, model_chunks, optimizer, bound)
        for key, dst in bound.items():
            if key != STEP_KEY:
                dst.copy_(storage[key])
        if STEP_KEY in specs:
            install_step(optimizer, storage)


def _writable(view: StateView, rank: int, model_chunks: Sequence[torch.nn.Module],
              optimizer: Any) -> Storage:
    """Views of the job's own tensors, one per storage key, that writes go through to: Adam's
    moments are created (zeros) and an expert_bias still in bf16 is made fp32 first. The step
    is a new int64 scalar (``install_step`` writes it into the optimizer)."""
    b = _bind(view, rank, model_chunks, optimizer)
    for opt in b.optimizers:
        _ensure_moments(opt)
    for te in {id(te): te for te, _ in b.fp8.values()}.values():
        if not te_fp8.has_delayed_state(te):
            te_fp8.prepare_module(te)  # as TE's set_extra_state allocates them
    out: Storage = {}
    device = _job_device(model_chunks)
    for key, spec in storage_spec(view, rank).items():
        if key == STEP_KEY:
            out[key] = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
            continue
        if key[0] == "buffer" and (key[2], key[3]) in b.buffers:
            module, attr = b.buffers[(key[2], key[3])]
            live = getattr(module, attr)
            if live.dtype != spec.dtype:  # as the router's _maintain_float32_expert_bias
                live.data = live.data.to(spec.dtype)
        dst = _live(b, key)
        if dst is None or dst.numel() != math.prod(spec.shape) or dst.dtype != spec.dtype:
            got = None if dst is None else f"{dst.dtype} {list(dst.shape)}"
            raise LayoutError(f"rank {rank}: cannot install {key} into the job's {got}")
        out[key] = dst.view(spec.shape)
    return out


def bind_state(view: StateView, rank: int, model_chunks: Sequence[torch.nn.Module],
               optimizer: Any) -> Storage:
    """The rank's storage as zero-filled views of a freshly built job's own tensors.

    Switching into it (``executor.switch(..., dst_store=...)``) installs the state in place:
    no second copy of the state is allocated and nothing is copied afterwards, except the
    step (``install_step``). Zero-filled as the executor's own destination storage is, so
    what the switch does not write (new vocab padding rows) ends up as with
    ``install_state``. The job's values are overwritten at once: bind only a job built for
    the purpose.

    Raises:
        LayoutError: the job does not run the layout of ``view``.
    """
    with torch.no_grad():
        store = _writable(view, rank, model_chunks, optimizer)
        _zero_unheld(view, rank, model_chunks, optimizer, store)
        for t in store.values():
            t.zero_()
    return store


def _zero_unheld(view: StateView, rank: int, model_chunks: Sequence[torch.nn.Module],
                 optimizer: Any, held: Mapping[tuple, torch.Tensor]) -> None:
    """Zero the rank's tensors that hold only vocab padding rows past ``view.vocab_rows``
    (no storage key: the switch writes nothing there). A checkpoint reload zero-fills the
    rows past the saved padded vocabulary (megatron-core's ``allow_shape_mismatch`` load), in
    params, fp32 main params and Adam moments alike; so does a switch."""
    layout = view.layout
    if view.vocab_rows == layout.padded_vocab:
        return
    full = view_of(layout, layout.padded_vocab)
    for key, t in _writable(full, rank, model_chunks, optimizer).items():
        if key != STEP_KEY and key not in held:
            t.zero_()


def install_step(optimizer: Any, storage: Mapping[tuple, torch.Tensor]) -> None:
    """Write the storage's Adam step into every leaf optimizer (a no-op without one)."""
    if STEP_KEY in storage:
        for opt in _leaf_optimizers(optimizer):
            _write_step(opt, int(storage[STEP_KEY]))


__all__ = ["STEP_KEY", "SlotSpec", "bind_state", "extract_state", "install_state",
           "install_step", "read_step", "storage_spec"]
