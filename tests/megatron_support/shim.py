"""Test-only CPU shim for megatron-core 0.16.1 and 0.19.2 (gloo; torch's CPU build, or on Python
3.12 PyPI's CUDA build on a machine without a GPU). 0.19.2 needs no mapping beyond 0.16.1's: the
parity, bridge and live-switch tests pass under it with this shim as is.

Megatron hard-codes CUDA in a few construction paths: buffers/params allocated on
``torch.cuda.current_device()`` or ``device="cuda"``, ``weight.data.cuda()`` for the tied
embedding copy, ``tensor.type() == "torch.cuda.BFloat16Tensor"`` checks in the optimizers,
and ``torch.cuda.Stream``/``current_stream`` handles. Inside :func:`cpu_shim`:

* every ``device=`` argument (and ``Tensor.to``'s positional device) that names CUDA becomes cpu,
* ``Tensor.cuda()`` is the identity, ``Tensor.type()`` reports ``torch.cuda.<X>Tensor``,
* ``torch.cuda.current_device`` returns ``"cpu"``; streams/synchronize/empty_cache are no-ops.

Only meant for forked test workers: it patches the ``torch.cuda`` module globally until exit.
"""

import contextlib
import types

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return (isinstance(dev, str) and dev.startswith("cuda")) or (isinstance(dev, int) and not isinstance(dev, bool))


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and out.startswith("torch."):
            out = out if out.startswith("torch.cuda.") else "torch.cuda." + out[len("torch."):]
        return out


class _NullStream:
    """Stand-in for torch.cuda.Stream / current_stream(): every method is a no-op."""

    def __init__(self, *a, **k):
        pass

    def __getattr__(self, name):
        return lambda *a, **k: None


@contextlib.contextmanager
def cpu_shim():
    """Map megatron's CUDA calls to cpu for the duration of the block (see module doc)."""
    noop = lambda *a, **k: None  # noqa: E731
    patches = {
        "current_device": lambda: "cpu",
        "current_stream": lambda *a, **k: _NullStream(),
        "default_stream": lambda *a, **k: _NullStream(),
        "Stream": _NullStream,
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "synchronize": noop,
        "empty_cache": noop,
        "nvtx": types.SimpleNamespace(range_push=noop, range_pop=noop, mark=noop),
    }
    saved = {k: getattr(torch.cuda, k) for k in patches}
    for k, v in patches.items():
        setattr(torch.cuda, k, v)
    try:
        with _CudaToCpuMode():
            yield
    finally:
        for k, v in saved.items():
            setattr(torch.cuda, k, v)
