"""Run megatron-core, and Megatron-LM's own training loop, on a machine without CUDA (gloo).

DynaTrain itself has no CPU branch; this module is what its examples, its tests and a user's own
CI use to run real megatron jobs on CPU. On a machine with CUDA every function here does nothing
(``backend()`` says ``"nccl"``, ``set_device`` selects the GPU).

* :func:`cpu_shim` -- megatron-core on CPU. Megatron hard-codes CUDA in a few construction paths;
  inside the block:

  - every ``device=`` argument (and ``Tensor.to``'s positional device) naming CUDA becomes cpu,
    ``Tensor.cuda()`` is the identity (buffers and params allocated on
    ``torch.cuda.current_device()`` / ``device="cuda"``; ``weight.data.cuda()`` for the tied
    embedding copy, ``language_model_embedding`` / ``gpt_model``),
  - ``Tensor.type()`` reports ``torch.cuda.<X>Tensor`` (the optimizers' ``param.type() ==
    "torch.cuda.BFloat16Tensor"`` checks, ``optimizer/__init__.py``, ``optimizer.py``),
  - ``torch.cuda.current_device`` returns ``"cpu"``; ``Stream``, ``current_stream``,
    ``default_stream``, ``stream``, ``synchronize``, ``empty_cache`` and ``nvtx`` are no-ops (DDP's
    communication stream, ``distributed_data_parallel.py``; the optimizer's timers).

* :func:`megatron_lm_cpu` -- the above plus what Megatron-LM's loop (``megatron.training.pretrain``
  and ``train``, checked against megatron-core 0.19.2's wheel, which ships ``megatron.training``)
  needs; each patch names the line it answers, in ``megatron/training`` of 0.19.2:

  - ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless ``allow_no_cuda=True``,
    which ``pretrain`` never passes (``initialize.py`` 64): ``training.initialize_megatron`` is
    called with ``allow_no_cuda=True``.
  - With ``torch.cuda.device_count() == 0`` it skips ``mpu.initialize_model_parallel`` and the
    model-parallel RNG tracker (``initialize.py`` 270/358/447): ``device_count`` reports one
    device and ``set_device`` (``initialize.py`` 282) does nothing.
  - ``torch.cuda.get_rng_state`` (and ``torch.cuda.random.get_rng_state``) would initialise
    CUDA: the RNG tracker (``core/tensor_parallel/random.py`` 118/303-306) and the checkpoint's
    ``cuda_rng_state`` (``checkpointing.py`` 417) read the CPU generator's state instead. Torch
    queues CUDA RNG *sets and seeds* until CUDA initialises, which never happens here, so the
    tracker's states are copies of the CPU generator's and its ``fork()`` switches nothing:
    model-parallel regions draw from the CPU generator like the rest (with dropout, TP ranks
    then draw equal masks for their different shards; a CPU run that compares numbers uses no
    dropout).
  - ``validate_args`` reads ``get_device_properties(...).major`` when TP or CP > 1
    (``arguments.py`` 1413-1414, ``utils/common_utils.py`` 504): a device of major version 0,
    which enables no architecture-specific feature. (It then asserts the environment variable
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``, ``arguments.py`` 1437: the launcher sets it, as
    Megatron-LM's scripts do; the shim does not.)
  - ``_compile_dependencies`` runs ``make`` in the wheel's ``core/datasets`` folder, which has
    no Makefile (the wheel ships the prebuilt ``helpers_cpp``) (``initialize.py`` 176): a no-op.
  - ``pretrain`` warms torch.compile'd fusion kernels on CUDA tensors whatever the
    ``--no-*-fusion`` flags (``training.py`` 1117, ``initialize.py`` 473-558): skipped.
  - The dist-checkpoint writer starts a *spawned* multiprocessing Manager for its results queue
    (``core/dist_checkpointing/strategies/filesystem_async.py`` 53-65), whose interpreter would
    run without this shim and costs seconds to start: :func:`fork_results_queue` gives it a
    fork-context queue instead.

  - Loading a ``torch_dist`` checkpoint into the distributed optimizer with torch's own Adam
    (no Apex or Transformer Engine, as on this machine; on GPUs megatron uses their fused Adam,
    whose step is per parameter group): ``sharded_state_dict(is_loading=True)`` first calls
    ``state_dict()``, which asserts one common ``step`` among the inner optimizer's states
    (``core/optimizer/distrib_optimizer.py`` 837-839) and finds none before the first step: the
    states are made first with megatron's own ``_init_optimizer_states_with_dummy_values`` (what
    it does itself for other formats, 1643; every value is then overwritten by the load). And
    ``load_state_dict`` gives every parameter the *same* step tensor (1028-1032), which torch's
    Adam then increments once per parameter per step: each parameter gets its own copy. The
    fully reshardable loader passes no ``step`` (2388-2392) to
    ``_set_main_param_and_optimizer_states``, which copies every tensor of the parameter's
    state, ``step`` included (1217-1225: ``KeyError: 'step'``): the step is set aside while it
    copies the others.

  Notes on the shim's list: megatron-core 0.19.2 imports triton under a guard
  (``core/transformer/custom_layers/batch_invariant_kernels.py`` 16-29), so no triton stub is
  needed; ``fused_kernels.load`` (``nvcc -V``) is not called by 0.19.2's loop.

Every patch is undone when the block exits, with one exception: the results queue installed by
:func:`fork_results_queue` stays (megatron keeps it in a module global for the life of the
process, as it keeps its own spawned one).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["backend", "cpu_shim", "cuda_available", "fork_results_queue", "megatron_lm_cpu",
           "set_device"]


def cuda_available() -> bool:
    """Whether this process sees a CUDA device (then the shims do nothing)."""
    return torch.cuda.is_available()


def backend() -> str:
    """The torch.distributed backend for this machine: nccl with CUDA, gloo without."""
    return "nccl" if cuda_available() else "gloo"


def set_device(local_rank: int) -> None:
    """Select the process's GPU; on CPU, one intra-op thread per process (the processes of a
    job share the cores) and gloo on the loopback interface."""
    if cuda_available():
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


# ---- megatron-core ------------------------------------------------------------------------------


def _is_cuda(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    # A bare int is a CUDA ordinal to torch (``torch.cuda.current_device()`` returns one).
    return (isinstance(dev, str) and dev.startswith("cuda")) or (
        isinstance(dev, int) and not isinstance(dev, bool))


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA devices to cpu in every torch call made inside it (see the module doc)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and \
                out.startswith("torch.") and not out.startswith("torch.cuda."):
            out = "torch.cuda." + out[len("torch."):]
        return out


class _NullStream:
    """Stand-in for ``torch.cuda.Stream`` and what ``current_stream()`` returns: every method is
    a no-op (CPU work is synchronous)."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def __getattr__(self, name: str):
        return lambda *a, **k: None


def _noop(*a: Any, **k: Any) -> None:
    return None


def _null_stream(*a: Any, **k: Any) -> _NullStream:
    return _NullStream()


def _null_context(*a: Any, **k: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _patch(stack: contextlib.ExitStack, owner: Any, name: str, value: Any) -> None:
    """Set ``owner.name = value`` until ``stack`` closes (an attribute that was absent is
    removed again)."""
    missing = object()
    old = getattr(owner, name, missing)
    setattr(owner, name, value)
    if old is missing:
        stack.callback(delattr, owner, name)
    else:
        stack.callback(setattr, owner, name, old)


def _core_patches(stack: contextlib.ExitStack) -> None:
    cuda = torch.cuda
    # Distinct function objects per name: torch._dynamo's rule map refuses one object known
    # under two torch.cuda names.
    for name, value in {
        "current_device": lambda: "cpu",
        "current_stream": _null_stream,
        "default_stream": lambda *a, **k: _NullStream(),
        "Stream": _NullStream,
        "stream": _null_context,
        "synchronize": _noop,
        "empty_cache": lambda *a, **k: None,
        "nvtx": types.SimpleNamespace(range_push=lambda *a, **k: None,
                                      range_pop=lambda *a, **k: None,
                                      mark=lambda *a, **k: None),
    }.items():
        _patch(stack, cuda, name, value)


@contextlib.contextmanager
def cpu_shim(force: bool = False) -> Iterator[None]:
    """Run megatron-core on CPU inside the block; nothing happens on a machine with CUDA unless
    ``force`` (a CPU gloo job on a GPU machine, as the test suite runs its megatron workers).

    Patches the ``torch.cuda`` module (process-wide) until the block exits: meant for a process
    that runs megatron on CPU, not for one that shares torch with CUDA work elsewhere."""
    if cuda_available() and not force:
        yield
        return
    with contextlib.ExitStack() as stack:
        _core_patches(stack)
        stack.enter_context(_CudaToCpu())
        yield


# ---- Megatron-LM's training loop -----------------------------------------------------------------


def fork_results_queue() -> None:
    """Give megatron's dist-checkpoint writer a results queue from a *fork*-context Manager.

    ``filesystem_async`` creates a spawn-context Manager on first use (a fresh interpreter that
    re-imports the main module without this shim, and takes seconds); the queue only carries
    the writer processes' results back. Stays installed for the life of the process, as
    megatron's own does. A daemonic process (``multiprocessing`` workers) may not start the
    Manager: call this from a non-daemonic one, from its main thread.

    A forked Manager inherits the job's sockets (its process groups exist by now): were it to
    outlive a ``kill -9`` of the process, the peers' collectives would see a hang, not a death.
    So it dies with the process that started it (Linux ``PR_SET_PDEATHSIG``)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global _MANAGER
    if filesystem_async._results_queue is None:
        _MANAGER = SyncManager(ctx=multiprocessing.get_context("fork"))
        _MANAGER.start(initializer=_die_with_parent)
        filesystem_async._results_queue = _MANAGER.Queue()


_MANAGER = None  # fork_results_queue's Manager (its ``_process.pid`` for tests)


def _die_with_parent() -> None:
    """In a forked helper process: SIGKILL it when the thread that started it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the helper may outlive its parent
        pass


@functools.cache
def _device_properties() -> types.SimpleNamespace:
    # Major/minor 0: no architecture check in megatron enables a feature for it.
    return types.SimpleNamespace(name="cpu", major=0, minor=0, total_memory=0,
                                 multi_processor_count=1)


def _loop_patches(stack: contextlib.ExitStack) -> None:
    cuda = torch.cuda
    from megatron.core.datasets import utils as dataset_utils

    try:
        from megatron.training import training
    except ImportError as err:
        raise ImportError(f"megatron_lm_cpu needs megatron.training, which megatron-core's wheel "
                          f"ships from 0.19 on: {err}") from err

    _patch(stack, training, "initialize_megatron",
           functools.partial(training.initialize_megatron, allow_no_cuda=True))
    _patch(stack, cuda, "device_count", lambda: 1)
    _patch(stack, cuda, "set_device", lambda *a, **k: None)
    _patch(stack, cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    _patch(stack, cuda.random, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    _patch(stack, cuda, "get_device_properties", lambda *a, **k: _device_properties())
    _patch(stack, dataset_utils, "compile_helpers", lambda: None)
    _patch(stack, training, "set_jit_fusion_options", lambda *a, **k: None)
    _torch_adam_load_patches(stack)
    fork_results_queue()


def _torch_adam_load_patches(stack: contextlib.ExitStack) -> None:
    """Megatron-LM's checkpoint load with torch's Adam (see the module doc)."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    if getattr(dopt, "HAVE_APEX_OR_TE", True):
        return
    cls = dopt.DistributedOptimizer
    state_dict, load_state_dict = cls.state_dict, cls.load_state_dict

    @functools.wraps(state_dict)
    def state_dict_(self):
        if len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        return state_dict(self)

    @functools.wraps(load_state_dict)
    def load_state_dict_(self, sd):
        load_state_dict(self, sd)
        for st in self.optimizer.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()

    set_states = cls._set_main_param_and_optimizer_states

    @functools.wraps(set_states)
    def set_states_(self, model_param, tensors):
        if "step" in tensors:
            return set_states(self, model_param, tensors)
        group, index = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][index]]
        step = state.pop("step", None)
        try:
            return set_states(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    _patch(stack, cls, "state_dict", state_dict_)
    _patch(stack, cls, "load_state_dict", load_state_dict_)
    _patch(stack, cls, "_set_main_param_and_optimizer_states", set_states_)


@contextlib.contextmanager
def megatron_lm_cpu(force: bool = False) -> Iterator[None]:
    """:func:`cpu_shim` plus what Megatron-LM's own loop (``megatron.training``) needs on CPU
    (see the module doc); nothing happens on a machine with CUDA unless ``force``. Imports
    ``megatron.training`` (megatron-core 0.19's wheel ships it; 0.16's does not)."""
    if cuda_available() and not force:
        yield
        return
    with contextlib.ExitStack() as stack:
        _loop_patches(stack)
        stack.enter_context(cpu_shim(force=True))
        yield
