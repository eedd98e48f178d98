"""Transformer Engine's delayed-scaling fp8 state, as a switch reads, writes and re-groups it.

Each TE GEMM module keeps, in ``fp8_meta``, a forward and a backward recipe state holding
``scale`` and ``amax_history`` (TE module/base.py:1106-1175). A checkpoint saves them pickled
in the module's ``_extra_state`` and a reload copies them back (base.py:1354-1480); a switch
moves the four tensors as IR state (``BufferDef.fp8_meta``) and writes them the way that
reload does, without any pickle: the plain ``fp8_meta`` values first, then the recipe, then
``init_fp8_meta_tensors`` and the copies (``prepare_module``).

TE also registers every delayed-scaling module, once, in process-global buffers keyed by the
autocast's recipe and amax-reduction group (TE quantization.py:501-565, 714-727), and reduces
all registered keys at every autocast exit. A switch replaces megatron's groups, so those
registrations must go: ``forget_groups`` resets TE's global state and makes the modules that
keep training register again with the new group on their next forward.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch

FP8_TENSORS = {"scale_fwd": ("scaling_fwd", "scale"),
               "amax_history_fwd": ("scaling_fwd", "amax_history"),
               "scale_bwd": ("scaling_bwd", "scale"),
               "amax_history_bwd": ("scaling_bwd", "amax_history")}


def _delayed(state: Any) -> bool:
    return hasattr(state, "scale") and hasattr(state, "amax_history")


def has_delayed_state(module: torch.nn.Module) -> bool:
    """Whether a TE module holds delayed-scaling tensors (after an fp8 forward or a load)."""
    meta = getattr(module, "fp8_meta", None)
    return isinstance(meta, dict) and _delayed(meta.get("scaling_fwd"))


def live_tensor(module: torch.nn.Module, which: str) -> torch.Tensor | None:
    """The module's own ``which`` tensor (``FP8_TENSORS``), None before it has any."""
    if not has_delayed_state(module):
        return None
    direction, attr = FP8_TENSORS[which]
    return getattr(module.fp8_meta[direction], attr)


def initial_tensor(which: str, shape: tuple[int, ...],
                   device: torch.device | None = None) -> torch.Tensor:
    """What TE allocates first: scales 1, amax histories 0 (TE quantization.py:1436-1442)."""
    return (torch.ones(shape, device=device) if which.startswith("scale")
            else torch.zeros(shape, device=device))


def prepare_module(module: torch.nn.Module) -> None:
    """Give a (freshly built) TE module its delayed-scaling tensors the way ``set_extra_state``
    does (TE base.py:1457-1480): the plain values, the recipe, then the recipe state. The
    recipe is megatron's own for the module's config (M16 fp8_utils.py:536-594)."""
    from megatron.core.fp8_utils import get_fp8_recipe

    recipe = get_fp8_recipe(module.config)
    repr(recipe)  # TE >= 2.18 caches the repr on first use, as the running job's recipe has it
    fmt = recipe.fp8_format.value
    module.fp8_meta.update({"fp8_checkpoint": True, "num_gemms": 1,
                            "fp8_max_fwd": fmt.max_fwd, "fp8_max_bwd": fmt.max_bwd})
    module.fp8_meta["recipe"] = recipe
    module.init_fp8_meta_tensors(recipe)


def check_folded(module: torch.nn.Module, name: str) -> None:
    """Refuse to read amaxes recorded since the last scale update (row 0 of a history): they
    are per rank until the next reduction (an evaluation forward leaves them), so no replica
    holds what every other would need."""
    from ...ir.errors import LayoutError

    for direction in ("scaling_fwd", "scaling_bwd"):
        if bool(torch.any(module.fp8_meta[direction].amax_history[0] != 0)):
            raise LayoutError(f"{name}: fp8 amaxes recorded since the last scale update (an "
                              "evaluation forward?) are not reduced yet; switch after the next "
                              "training iteration")


def forget_groups(model_chunks: Iterable[torch.nn.Module] = ()) -> None:
    """Drop TE's global fp8 registrations (their groups are gone) and make the TE modules of
    ``model_chunks``, which keep training, register again with the new group on their next
    forward (``init_fp8_metadata`` then runs in full, keeping the recipe state's tensors)."""
    # Only a TE the job already imported (TE >= 2.8 names the module quantization, older fp8).
    te = sys.modules.get("transformer_engine.pytorch.quantization") or \
        sys.modules.get("transformer_engine.pytorch.fp8")
    if te is None:
        return  # no Transformer Engine in this process, no fp8 state
    te.FP8GlobalStateManager.reset()
    for chunk in model_chunks:
        for m in chunk.modules():
            if has_delayed_state(m):
                m.fp8_meta.pop("buffer_index_and_autocast_key", None)
                m.fast_setattr("fp8_initialized", False)
