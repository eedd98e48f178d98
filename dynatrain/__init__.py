"""DynaTrain: live parallel-layout switching for Megatron-core training.

The public API (see ``dynatrain.api`` for an example)::

    load_layout(spec)                 a layout from a spec file, document or LayoutSpec
    plan(src, dst, budget="2GiB")     plan and verify a switch -> PlannedSwitch
                                      (failed="node3": only from surviving devices)
    verify_switch(switch)             the CLI's checks again -> VerifyReport
    summarize(switch)                 the summary `dynatrain plan` prints
    save_plan(switch, path)           plan JSON with both specs embedded
    load_plan(path)                   read it back -> PlannedSwitch (unverified)
    suggest(src, devices)             layouts that fit these devices, ranked by switch time
    run_local(switch)                 run a small switch here, checked bit for bit (torch)
    LiveSwitcher                      switch a running Megatron job (torch, megatron-core)
    spec_from_megatron(args, world)   a spec from Megatron-LM's args or a TransformerConfig
    spec_from_hf_config(cfg, ...)     a spec from a HuggingFace config.json
    load_checkpoint(dir, layout, r)   a megatron dist checkpoint into any layout (torch)
    parse_bytes("2GiB")               sizes in any unit

Errors: ``DynatrainError`` (``exit_code`` 2, bad input), ``VerificationError`` (1),
``StateLost`` (3, ``.lost`` names what no surviving device holds), ``SwitchAborted`` (4,
source state intact).
"""

from __future__ import annotations

from typing import Any

# (``verify_switch``, not ``verify``: that name is the ``dynatrain.verify`` subpackage's.)
from .api import (PlannedSwitch, load_layout, load_plan, plan, run_local, save_plan, suggest,
                  summarize, verify_switch)
from .ir.errors import DynatrainError, SpecError
from .ir.layout import Layout
from .ir.units import parse_bytes
from .ir.from_job import spec_from_megatron
from .ir.hf_config import spec_from_hf_config
from .planner.lost import LostState, StateLost, expand_failed
from .verify.report import VerificationError, VerifyReport

__all__ = ["DynatrainError", "Layout", "LiveSwitcher", "LostState", "PlannedSwitch", "SpecError",
           "StateLost", "SwitchAborted", "VerificationError", "VerifyReport", "expand_failed",
           "load_layout", "load_plan",
           "load_checkpoint", "load_checkpoint_into", "parse_bytes", "plan", "plan_load",
           "run_local", "save_plan", "spec_from_hf_config", "spec_from_megatron", "suggest",
           "summarize", "verify_switch", "CheckpointError"]


def __getattr__(name: str) -> Any:
    # torch-backed names load on first use: `import dynatrain` stays torch-free.
    if name == "LiveSwitcher":
        from .runtime.megatron.live import LiveSwitcher

        return LiveSwitcher
    if name in ("load_checkpoint", "load_checkpoint_into", "plan_load", "CheckpointError"):
        from . import checkpoint

        return getattr(checkpoint, name)
    if name == "SwitchAborted":
        from .runtime.executor import SwitchAborted

        return SwitchAborted
    raise AttributeError(f"module 'dynatrain' has no attribute {name!r}")
