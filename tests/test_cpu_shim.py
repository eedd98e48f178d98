"""``dynatrain.runtime.megatron.cpu``: what the CPU shims change inside their block, that they
change nothing on a machine with CUDA unless forced, and that everything is restored on exit
(megatron's own runs under them are in the megatron test files)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dynatrain.runtime.megatron import cpu

CUDA_NAMES = ("current_device", "current_stream", "default_stream", "Stream", "stream",
              "synchronize", "empty_cache", "nvtx")
LOOP_CUDA_NAMES = ("device_count", "set_device", "get_rng_state", "get_device_properties")


def _cuda_attrs(names) -> dict:
    return {n: getattr(torch.cuda, n) for n in names}


def test_cpu_shim_maps_cuda_to_cpu_and_restores():
    before = _cuda_attrs(CUDA_NAMES)
    with cpu.cpu_shim(force=True):
        t = torch.zeros(3, device="cuda")
        assert t.device.type == "cpu"
        assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.ones(2).to("cuda:0").device.type == "cpu"
        assert t.cuda() is t
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert torch.cuda.current_device() == "cpu"
        torch.cuda.current_stream().wait_stream(torch.cuda.Stream())  # no-ops
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            pass
        # torch._dynamo's rule map refuses one function object under two torch.cuda names.
        objs = [getattr(torch.cuda, n) for n in CUDA_NAMES]
        assert len({id(o) for o in objs}) == len(objs)
    assert _cuda_attrs(CUDA_NAMES) == before
    assert torch.zeros(1).type() == "torch.FloatTensor"  # the mode is gone


def test_cpu_shim_restores_after_an_error():
    before = _cuda_attrs(CUDA_NAMES)
    with pytest.raises(ValueError, match="inside"):
        with cpu.cpu_shim(force=True):
            raise ValueError("inside")
    assert _cuda_attrs(CUDA_NAMES) == before
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_shims_do_nothing_with_cuda_unless_forced(monkeypatch):
    monkeypatch.setattr(cpu, "cuda_available", lambda: True)
    before = _cuda_attrs(CUDA_NAMES + LOOP_CUDA_NAMES)
    with cpu.cpu_shim():
        assert _cuda_attrs(CUDA_NAMES) == {n: before[n] for n in CUDA_NAMES}
        assert torch.zeros(1).type() == "torch.FloatTensor"
    with cpu.megatron_lm_cpu():
        assert _cuda_attrs(CUDA_NAMES + LOOP_CUDA_NAMES) == before
    assert cpu.backend() == "nccl"
    with cpu.cpu_shim(force=True):
        assert torch.cuda.current_device() == "cpu"


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                    reason="megatron-core 0.16.1's wheel has no megatron.training")
def test_megatron_lm_cpu_patches_the_loop_and_restores():
    from megatron.core.datasets import utils as dataset_utils
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.training import training

    names = CUDA_NAMES + LOOP_CUDA_NAMES
    before = _cuda_attrs(names)
    random_get = torch.cuda.random.get_rng_state
    loop = (training.initialize_megatron, training.set_jit_fusion_options,
            dataset_utils.compile_helpers)
    with cpu.megatron_lm_cpu(force=True):
        assert torch.cuda.device_count() == 1
        assert torch.cuda.get_device_properties(0).major == 0
        torch.cuda.set_device(0)  # a no-op, not a CUDA initialisation
        assert torch.equal(torch.cuda.get_rng_state(), torch.get_rng_state())
        assert torch.equal(torch.cuda.random.get_rng_state(), torch.get_rng_state())
        assert training.initialize_megatron.keywords == {"allow_no_cuda": True}
        assert training.initialize_megatron.func is loop[0]
        assert dataset_utils.compile_helpers() is None
        assert training.set_jit_fusion_options(tp_size=2) is None
        assert torch.zeros(1, device="cuda").device.type == "cpu"  # cpu_shim is part of it
        # The dist-checkpoint writer's results queue comes from a fork-context Manager.
        assert filesystem_async._results_queue is not None
    assert _cuda_attrs(names) == before
    assert torch.cuda.random.get_rng_state is random_get
    assert (training.initialize_megatron, training.set_jit_fusion_options,
            dataset_utils.compile_helpers) == loop


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is not None,
                    reason="this megatron-core's wheel ships megatron.training")
def test_megatron_lm_cpu_without_megatron_training_says_so():
    before = _cuda_attrs(CUDA_NAMES + LOOP_CUDA_NAMES)
    with pytest.raises(ImportError, match="megatron_lm_cpu needs megatron.training"):
        with cpu.megatron_lm_cpu(force=True):
            pass
    assert _cuda_attrs(CUDA_NAMES + LOOP_CUDA_NAMES) == before
