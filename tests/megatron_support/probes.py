"""Optional extra measurements taken inside the harness workers (cfg key ``probes``).

``megatron_facts(dict(cfg, probes=[...]), world_size)`` runs, on every rank and in the given
order, each requested probe after the model, DDP and optimizer are built (still inside the CPU
shim), and adds ``facts["probes"]``: one JSON-able result per requested probe, same order. A probe
is named by a string or by a dict ``{"name": ..., **kwargs}``. Without ``probes`` nothing here
runs and the facts are unchanged.

Probes run on all ranks (some use collectives), so every rank must request the same list.
Like the rest of the harness, they only read megatron's own objects or drive megatron's own code
paths; synthetic inputs (weights, gradients, tokens) are spelled out in each probe's doc.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import traceback
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dynatrain.runtime.megatron.cpu import fork_results_queue
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

__all__ = ["PROBES", "run_probes"]


@dataclass
class ProbeContext:
    c: dict  # resolved harness cfg
    gpts: list  # GPTModel per chunk
    ddps: list  # DistributedDataParallel per chunk (module = Float16Module(gpt))
    optimizer: Any  # what get_megatron_optimizer returned


PROBES: dict[str, Callable[..., Any]] = {}


def _probe(fn):
    PROBES[fn.__name__] = fn
    return fn


def run_probes(ctx: ProbeContext, requested: list) -> list:
    out = []
    for item in requested:
        if isinstance(item, str):
            name, kwargs = item, {}
        else:
            kwargs = dict(item)
            name = kwargs.pop("name")
        if name not in PROBES:
            raise ValueError(f"unknown probe {name!r}; known: {sorted(PROBES)}")
        out.append(PROBES[name](ctx, **kwargs))
    return out


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def _ints(x) -> list[int]:
    return [int(v) for v in x]


def _sha(t: torch.Tensor) -> str:
    """Bit-exact digest of a tensor's values (dtype-preserving)."""
    t = t.detach().contiguous().cpu()
    raw = t.view(torch.int16) if t.element_size() == 2 else t
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _dist_opts(optimizer) -> list[DistributedOptimizer]:
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(o, DistributedOptimizer) and not o.is_stub_optimizer]


def _model_sharded_state_dict(ctx: ProbeContext) -> dict:
    from megatron_support.harness import sharded_metadata  # (imports probes)

    md = sharded_metadata(ctx.c)
    if len(ctx.gpts) == 1:
        return ctx.gpts[0].sharded_state_dict(metadata=md)
    return {f"model{i}": g.sharded_state_dict(metadata=md) for i, g in enumerate(ctx.gpts)}


def _leaves(sd, factory=None):
    """(leaf, factory key) for every ShardedTensor/ShardedObject of a nested state dict;
    factories are built."""
    if isinstance(sd, dict):
        for v in sd.values():
            yield from _leaves(v, factory)
    elif isinstance(sd, (list, tuple)):
        for v in sd:
            yield from _leaves(v, factory)
    elif isinstance(sd, ShardedTensorFactory):
        yield from _leaves(sd.build(), sd.key)
    elif isinstance(sd, (ShardedTensor, ShardedObject)):
        yield sd, factory


def _jsonable(x):
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.dtype):
        return str(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    return repr(x)


def _describe_leaf(leaf, factory) -> dict:
    rid = leaf.replica_id
    rid = _ints(rid) if isinstance(rid, (tuple, list)) else [int(rid)]
    if isinstance(leaf, ShardedObject):
        return {"kind": "object", "key": leaf.key, "replica_id": rid, "data": _jsonable(leaf.data)}
    fr = leaf.flattened_range
    return {
        "kind": "tensor",
        "key": leaf.key,
        "factory_key": factory,
        "global_shape": _ints(leaf.global_shape),
        "global_offset": _ints(leaf.global_offset),
        "local_shape": _ints(leaf.local_shape),
        "replica_id": rid,
        "allow_shape_mismatch": bool(leaf.allow_shape_mismatch),
        "flattened_range": None if fr is None else [int(fr.start), int(fr.stop)],
        "dtype": str(leaf.dtype),
    }


def _owner_range(opt: DistributedOptimizer, p: torch.nn.Parameter):
    """This rank's [start, end) of p.view(-1) in `opt`'s shard, or None."""
    for per_dtype in opt.gbuf_ranges:
        for bucket_ranges in per_dtype.values():
            for rng in bucket_ranges:
                if p in rng["param_map"]:
                    r = rng["param_map"][p]["param"]
                    return [int(r.start), int(r.end)]
    return None


# ------------------------------------------------------------------------------------------
# probes
# ------------------------------------------------------------------------------------------


@_probe
def optimizer_sharded_state_dict(ctx: ProbeContext, sharding_type: str | None,
                                 is_loading: bool = True, metadata: dict | None = None,
                                 init_states: bool = True) -> dict:
    """Call ``optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, metadata)`` with
    ``metadata['distrib_optim_sharding_type'] = sharding_type`` (left out when None, i.e.
    megatron's own default) and describe every ShardedTensor / ShardedObject it returns.
    ``is_loading=True`` (the load path) needs no collectives; the save path of
    'fully_reshardable' all-gathers over DP. ``init_states``: first give an optimizer that has no Adam state
    yet its states via megatron's ``_init_optimizer_states_with_dummy_values`` (torch Adam, used
    without Apex/TE, has none before its first step and ``state_dict()`` asserts on that).
    Returns ``{"error": "Type: message", "traceback": ...}`` if megatron raises."""
    md = dict(metadata or {})
    if sharding_type is not None:
        md["distrib_optim_sharding_type"] = sharding_type
    for opt in _dist_opts(ctx.optimizer):
        if init_states and len(opt.optimizer.state) == 0:
            # Without Apex/TE the torch Adam has no state (and no 'step') before its first step,
            # and DistributedOptimizer.state_dict() asserts on it; megatron's own initializer
            # runs one zero-grad step of the inner optimizer.
            opt._init_optimizer_states_with_dummy_values()
    model_sd = _model_sharded_state_dict(ctx)
    try:
        sd = ctx.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=md)
        leaves = [_describe_leaf(leaf, fk) for leaf, fk in _leaves(sd)]
    except Exception as e:  # noqa: BLE001 - the error is the fact being measured
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    return {
        "leaves": leaves,
        "data_parallel_group_idx": [int(o.data_parallel_group_idx)
                                    for o in _dist_opts(ctx.optimizer)],
        "per_bucket_numel_unpadded": [_jsonable(o.per_bucket_numel_unpadded)
                                      for o in _dist_opts(ctx.optimizer)],
    }


@_probe
def forward_loss(ctx: ProbeContext, vocab_size: int, tokens: list, labels: list,
                 seed: int = 0, vocab_std: float = 0.1, other_std: float = 0.05) -> dict:
    """Overwrite the weights with padding-independent values, then run megatron's own forward
    (Float16Module(GPTModel), explicit causal mask) with and without labels (pp == 1 only).

    Weights: row v < vocab_size of the word embeddings (and of an untied output layer) is row v
    of ``randn(vocab_size, H, generator=seed) * vocab_std``, padding rows v >= vocab_size are 0;
    every other >= 2-D parameter is ``randn(local shape, generator=crc32(name)*16 + tp_rank) *
    other_std``; 1-D weights are 1, biases 0. So two builds that differ only in vocab padding
    hold the same real weights. Returns this rank's loss [b, s] (megatron's vocab-parallel cross
    entropy), its logits [b, s, Vp/T] and the global column where its logits start."""
    assert len(ctx.gpts) == 1 and ctx.c["pp"] == 1, "forward_loss supports pp == 1 only"
    gpt, model = ctx.gpts[0], ctx.ddps[0].module
    tp_rank = ps.get_tensor_model_parallel_rank()
    hidden = gpt.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    real = torch.randn(vocab_size, hidden, generator=gen) * vocab_std
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                rows = p.shape[0]
                lo, hi = tp_rank * rows, min((tp_rank + 1) * rows, vocab_size)
                full = torch.zeros(rows, hidden)
                if hi > lo:
                    full[: hi - lo] = real[lo:hi]
                p.copy_(full)
            elif p.dim() >= 2:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 16 + tp_rank)
                p.copy_(torch.randn(tuple(p.shape), generator=g) * other_std)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
    ids = torch.tensor(tokens, dtype=torch.long)
    b, s = ids.shape
    pos = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous()
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
    model.eval()
    with torch.no_grad():
        loss = model(ids, pos, mask, labels=torch.tensor(labels, dtype=torch.long))
        logits = model(ids, pos, mask)
    return {
        "tp_rank": tp_rank,
        "vocab_start": tp_rank * int(logits.shape[-1]),
        "logits_shape": _ints(logits.shape),
        "logits": logits.float().tolist(),
        "loss": loss.float().tolist(),
    }


@_probe
def embedding_copies(ctx: ProbeContext) -> list[dict]:
    """For every word-embedding / output-layer weight on this rank: bit-exact digest of the
    model param, its ``shared``/``shared_embedding`` flags, and for each DistributedOptimizer
    holding a shard of it: the shard's range in ``p.view(-1)`` and digests of the fp32 main
    param and of every Adam state tensor that exists."""
    out = []
    for ci, gpt in enumerate(ctx.gpts):
        for name, p in gpt.named_parameters():
            if name not in ("embedding.word_embeddings.weight", "output_layer.weight"):
                continue
            rec = {
                "chunk": ci, "name": name, "shape": _ints(p.shape), "sha256": _sha(p),
                "abs_sum": float(p.detach().float().abs().sum()),
                "shared": bool(getattr(p, "shared", False)),
                "shared_embedding": bool(getattr(p, "shared_embedding", False)),
                "shards": [],
            }
            for opt in _dist_opts(ctx.optimizer):
                rng = _owner_range(opt, p)
                if rng is None:
                    continue
                tensors = opt._get_main_param_and_optimizer_states(p)
                rec["shards"].append({
                    "param_range": rng,
                    "model_slice_sha256": _sha(p.detach().view(-1)[rng[0]:rng[1]].float()),
                    **{f"{k}_sha256": _sha(v) for k, v in tensors.items()
                       if isinstance(v, torch.Tensor) and v.dim() > 0},
                })
            out.append(rec)
    return out


@_probe
def train_step(ctx: ProbeContext, tokens: list, labels: list, lr: float | None = None) -> dict:
    """One real training iteration the way Megatron-LM's ``train_step`` does it: zero grad
    buffers, ``get_forward_backward_func()`` (1F1B over the pp group; one micro-batch of
    ``tokens``/``labels``, explicit causal mask, loss = mean token loss) with
    ``finalize_model_grads`` (DP reduce-scatter, embedding-group grad all-reduce, ...), then
    ``optimizer.step()``. Returns the losses the last stage saw and the step's success flag."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ids = torch.tensor(tokens, dtype=torch.long)
    lab = torch.tensor(labels, dtype=torch.long)
    b, s = ids.shape
    pos = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous()
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
    config = ctx.gpts[0].config
    config.finalize_model_grads_func = finalize_model_grads
    if lr is not None:
        for opt in getattr(ctx.optimizer, "chained_optimizers", [ctx.optimizer]):
            for g in opt.param_groups:
                g["lr"] = lr

    def forward_step(data_iterator, model):
        out = model(ids, pos, mask, labels=lab)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    for m in ctx.ddps:
        m.train()
        m.zero_grad_buffer()
    ctx.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=ctx.ddps,
        num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=False,
    )
    ok, grad_norm, _ = ctx.optimizer.step()
    return {"ok": bool(ok), "grad_norm": None if grad_norm is None else float(grad_norm),
            "losses": [float(d["loss"]) for d in losses]}


@_probe
def expert_grad_reduce(ctx: ProbeContext) -> list[dict]:
    """Drive megatron's own DDP gradient reduction with synthetic per-rank gradients: every
    expert parameter's ``main_grad`` is filled with ``etp_rank + 1`` on this rank, every other
    ``main_grad`` with 0, then ``ddp.finish_grad_sync()`` (reduce-scatter / all-reduce over the
    group of each buffer). For every expert param slice this rank's DistributedOptimizer owns,
    report the distinct reduced values there (the values the optimizer would step with)."""
    etp_rank = ps.get_expert_tensor_parallel_rank()
    name_of = {}
    for ci, gpt in enumerate(ctx.gpts):
        for n, p in gpt.named_parameters():
            name_of[id(p)] = (ci, n)
    for ddp in ctx.ddps:
        ddp.zero_grad_buffer()
        for p in ddp.module.parameters():
            if p.requires_grad:
                is_expert = ".experts." in name_of[id(p)][1]
                p.main_grad.fill_(float(etp_rank + 1) if is_expert else 0.0)
    for ddp in ctx.ddps:
        ddp.finish_grad_sync()
    out = []
    for opt in _dist_opts(ctx.optimizer):
        for ddp in ctx.ddps:
            for p in ddp.module.parameters():
                ci, n = name_of[id(p)]
                if ".experts." not in n:
                    continue
                rng = _owner_range(opt, p)
                if rng is None or rng[1] == rng[0]:
                    continue
                vals = torch.unique(p.main_grad.view(-1)[rng[0]:rng[1]]).tolist()
                out.append({"chunk": ci, "param_name": n, "param_range": rng,
                            "own_value": float(etp_rank + 1), "reduced_values": vals})
    return out


@contextlib.contextmanager
def _may_have_children():
    """The harness workers are daemonic, but megatron's torch_dist save starts a multiprocessing
    Manager (for its write-results queue) and forks writer processes; allow that for the
    duration of the save. The Manager is started with fork instead of megatron's spawn (a
    spawned interpreter costs seconds); it only carries the writers' results back."""
    proc = multiprocessing.current_process()
    was = proc._config.get("daemon")
    proc._config["daemon"] = False
    try:
        fork_results_queue()
        yield
    finally:
        proc._config["daemon"] = was


def _vocab_params(ctx: ProbeContext):
    for ci, gpt in enumerate(ctx.gpts):
        for name, p in gpt.named_parameters():
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                yield ci, name, p


@_probe
def dist_ckpt_save(ctx: ProbeContext, path: str, sharding_type: str = "fully_reshardable",
                   exp_avg: float = 1.0, exp_avg_sq: float = 2.0) -> dict:
    """Save model + optimizer with ``dist_checkpointing.save`` (default torch_dist strategy) the
    way Megatron-LM does: ``{"model": model sharded sd, "optimizer":
    optimizer.sharded_state_dict(model sd, metadata={'distrib_optim_sharding_type': ...})}``.
    Before saving, every existing ``exp_avg`` / ``exp_avg_sq`` shard is set to the given
    constants (after megatron's dummy-state initialisation), so a later load can tell saved
    state from zero-filled state."""
    from megatron.core import dist_checkpointing

    for opt in _dist_opts(ctx.optimizer):
        if len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()
        for state in opt.optimizer.state.values():
            state["exp_avg"].fill_(exp_avg)
            state["exp_avg_sq"].fill_(exp_avg_sq)
    md = {"distrib_optim_sharding_type": sharding_type}
    model_sd = _model_sharded_state_dict(ctx)
    sd = {"model": model_sd,
          "optimizer": ctx.optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=md)}
    with _may_have_children():
        dist_checkpointing.save(sd, path)
    return {"saved": True}


@_probe
def dist_ckpt_load(ctx: ProbeContext, path: str, sharding_type: str = "fully_reshardable",
                   keys_containing: str = "word_embeddings") -> list:
    """Load a checkpoint written by ``dist_ckpt_save`` (possibly from another layout or vocab
    padding) with ``dist_checkpointing.load`` into the state dict Megatron-LM's load builds
    (``{"model": ..., "optimizer": optimizer.sharded_state_dict(model sd, is_loading=True,
    metadata)}``) and report, for every loaded tensor whose checkpoint key contains
    ``keys_containing``, its key, this rank's global row offset and, per local row, the
    distinct loaded values (at most 4). The loaded tensors are reported as
    ``dist_checkpointing.load`` returns them, before ``optimizer.load_state_dict`` (which,
    without Apex/TE, fails in 0.16.1 on the torch-Adam ``step`` state)."""
    from megatron.core import dist_checkpointing

    for opt in _dist_opts(ctx.optimizer):
        if len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()
    md = {"distrib_optim_sharding_type": sharding_type}
    model_sd = _model_sharded_state_dict(ctx)
    sd = {"model": model_sd,
          "optimizer": ctx.optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=md)}
    wanted = []  # (path in the nested dict, ShardedTensor)

    def walk(node, where):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, where + (k,))
        elif isinstance(node, ShardedTensor) and keys_containing in node.key:
            wanted.append((where, node.key, _ints(node.global_offset),
                           bool(node.allow_shape_mismatch)))

    walk(sd, ())
    loaded = dist_checkpointing.load(sd, path)
    out = []
    for where, key, offset, mismatch in wanted:
        t = loaded
        for k in where:
            t = t[k]
        t = t.detach().float()
        out.append({
            "key": key, "global_offset": offset, "allow_shape_mismatch": mismatch,
            "shape": _ints(t.shape),
            "row_values": [torch.unique(t[i]).tolist()[:4] for i in range(t.shape[0])],
        })
    return out
