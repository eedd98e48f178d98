"""TE's distributed helpers (TE ``distributed.py``) on CPU: TP attributes, the RNG tracker,
and the autograd-aware collectives the TP-parallel forward passes need (gloo).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

# distributed.py:57-61
_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int) -> None:
    """distributed.py:150-163: set the TP attributes once; a second call raises, as in TE."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise RuntimeError(f"Tensor already has attribute '{attribute}' set. Cannot set "
                               "tensor model parallel attributes on a tensor that already has "
                               "them.")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def get_distributed_world_size(group=None) -> int:
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


class CudaRNGStatesTracker:
    """distributed.py:818-930 with the CPU generator in place of the CUDA one: named RNG
    states, ``add`` seeds one, ``fork`` runs a block under it and restores the default."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise RuntimeError(f"cuda rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"cuda rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


# ---- autograd-aware TP collectives (what TE's column/row linears do around their GEMMs) ----

def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather0(x: torch.Tensor, group) -> torch.Tensor:
    n, x = dist.get_world_size(group=group), x.contiguous()
    # Contiguous receive buffers: empty_like would copy x's strides, and a transposed layout
    # (megatron's [s, b, h] views of [b, s, h]) would scramble what the collective writes.
    parts = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter0(x: torch.Tensor, group) -> torch.Tensor:
    n, r = dist.get_world_size(group=group), dist.get_rank(group=group)
    total = _all_reduce(x, group)  # gloo has no reduce_scatter: reduce, keep this rank's rows
    return total.chunk(n, dim=0)[r].contiguous()


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the input gradient (column-parallel input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (row-parallel output)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromSP(torch.autograd.Function):
    """Sequence-parallel input: all-gather dim 0 forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather0(x, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter0(g, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    """Sequence-parallel output: reduce-scatter dim 0 forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter0(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather0(g, ctx.group), None


def column_input(x: torch.Tensor, group, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    """The input of a column-parallel GEMM (linear.py forward: gather if sequence parallel)."""
    if tp_size == 1:
        return x
    return _GatherFromSP.apply(x, group) if sequence_parallel else _CopyToTP.apply(x, group)


def row_output(y: torch.Tensor, group, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    """The output of a row-parallel GEMM (reduce, or reduce-scatter if sequence parallel)."""
    if tp_size == 1:
        return y
    return _ScatterToSP.apply(y, group) if sequence_parallel else _ReduceFromTP.apply(y, group)


# ---- activation recompute flags (distributed.py:241-286); fp8 is off, so they gate nothing ----

_IN_ACTIVATION_RECOMPUTE_REGION = False
_ACTIVATION_RECOMPUTE_PHASE = False


class activation_recompute_forward(contextlib.AbstractContextManager, contextlib.ContextDecorator):
    """Marks a checkpointed forward (and its recompute phase) while it runs."""

    def __init__(self, activation_recompute: bool = False, recompute_phase: bool = False):
        super().__init__()
        self.activation_recompute = activation_recompute
        self.recompute_phase = recompute_phase

    def __enter__(self):
        global _IN_ACTIVATION_RECOMPUTE_REGION, _ACTIVATION_RECOMPUTE_PHASE
        _IN_ACTIVATION_RECOMPUTE_REGION = self.activation_recompute
        _ACTIVATION_RECOMPUTE_PHASE = self.recompute_phase

    def __exit__(self, *exc_details):
        global _IN_ACTIVATION_RECOMPUTE_REGION, _ACTIVATION_RECOMPUTE_PHASE
        _IN_ACTIVATION_RECOMPUTE_REGION = False
        _ACTIVATION_RECOMPUTE_PHASE = False


def is_fp8_activation_recompute_enabled() -> bool:
    return False  # needs fp8


def in_fp8_activation_recompute_phase() -> bool:
    return _ACTIVATION_RECOMPUTE_PHASE
