"""Megatron-LM's own training loop with live layout switches: change one import.

    from dynatrain.megatron_lm import pretrain      # was: from megatron.training import pretrain

``pretrain`` takes the arguments of the installed Megatron-LM's ``pretrain`` and runs the same
program; layouts switch live between iterations, on a schedule (``LiveOptions``) or when asked
from outside (``dynatrain switch --store MASTER_ADDR:MASTER_PORT dst.yaml``). See
``docs/megatron-lm.md`` and ``dynatrain.runtime.megatron.lm``.
"""

from __future__ import annotations

from typing import Any

from .runtime.megatron.lm import LiveOptions, MegatronLMState, drive

__all__ = ["LiveOptions", "MegatronLMState", "pretrain"]


def pretrain(*args: Any, dynatrain: LiveOptions | None = None, **kwargs: Any) -> None:
    """Megatron-LM's ``pretrain`` with live layout switches.

    Takes exactly the arguments of the installed ``megatron.training.pretrain`` (megatron-core
    0.19: ``cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func,
    model_provider=None, ...``) plus ``dynatrain=LiveOptions(...)``.

    Raises:
        DynatrainError: one line for an argument or a Megatron-LM feature it does not support.
    """
    from .checkpoint import megatron_lm as ckpt
    from .runtime.megatron.lm import Checkpoints
    from .verify.check import check

    drive(args, kwargs, dynatrain or LiveOptions(), check,
          Checkpoints(ckpt.newest, ckpt.refill, ckpt.train_state))
