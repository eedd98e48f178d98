"""fp8 global state and autocast (TE ``pytorch/quantization.py``), on CPU.

What persists and moves between steps, as TE has it:
* ``fp8_autocast`` saves the autocast state on entry and restores it on exit
  (quantization.py:1034-1061); entering at depth 0 arms ``is_first_fp8_module``, which the
  first fp8 module's forward consumes (:598-605, :730-770);
* delayed-scaling modules append views of their amax-history row 0, their histories and scales
  to process-global buffers keyed by direction, recipe repr and group identity (:482-565,
  :714-727);
* leaving the outermost autocast with grad enabled reduces and updates the forward buffers
  (:772-782); the first module's backward does the same for the backward buffers.
  ``reduce_and_update_fp8_tensors`` concatenates row 0 of every registered module, MAX-reduces
  it over the group when ``reduce_amax`` and then runs the fused update
  (``amax_and_scale_update``, after common/recipe/delayed_scaling.cu:162-253);
* ``reset`` drops all of it (:437-439).

Nothing here quantizes; ``module/_fp8.py`` does, on CPU, with torch's float8 dtypes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..common.recipe import DelayedScaling, Format, Recipe

_FLT_MAX = torch.finfo(torch.float32).max


@dataclass
class FP8GlobalState:
    """quantization.py:388-412 (the fields the stand-in uses)."""

    fp8_enabled: bool = False
    fp8_calibration: bool = False
    fp8_recipe: Recipe | None = None
    fp8_distributed_group: object = None
    is_first_fp8_module: bool = False
    fp8_graph_capturing: bool = False
    fp8_parameters: bool = False
    autocast_depth: int = 0
    autocast_arguments: dict = field(default_factory=dict)
    global_amax_buffer: dict = field(default_factory=dict)
    global_amax_history_buffer: dict = field(default_factory=dict)
    global_scale_buffer: dict = field(default_factory=dict)


def get_default_fp8_recipe() -> Recipe:
    """quantization.py: DelayedScaling() when none is given."""
    return DelayedScaling()


def get_fp8_max(recipe: Recipe, forward: bool) -> float:
    """HYBRID is E4M3 forward and E5M2 backward (quantization.py:281-313)."""
    fmt = recipe.fp8_format.value
    return float(fmt.max_fwd if forward else fmt.max_bwd)


def get_fp8_torch_dtype(recipe: Recipe, forward: bool) -> torch.dtype:
    if recipe.fp8_format == Format.E4M3 or (recipe.fp8_format == Format.HYBRID and forward):
        return torch.float8_e4m3fn
    return torch.float8_e5m2


class FP8GlobalStateManager:
    """The class-level API megatron-core and TE's modules use (quantization.py:385-940)."""

    quantization_state = FP8GlobalState()

    @classmethod
    def reset(cls) -> None:
        cls.quantization_state = FP8GlobalState()

    @classmethod
    def is_fp8_available(cls) -> tuple[bool, str]:
        return True, ""  # simulated on CPU: quantize-dequantize in module/_fp8.py

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.quantization_state.fp8_enabled

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls.quantization_state.fp8_calibration

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.quantization_state.fp8_parameters

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return False

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return cls.quantization_state.fp8_graph_capturing

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True only the first time it is asked inside one outermost autocast."""
        q = cls.quantization_state
        first, q.is_first_fp8_module = q.is_first_fp8_module, False
        return first

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        q = cls.quantization_state
        return q.fp8_recipe if q.fp8_recipe is not None else get_default_fp8_recipe()

    @classmethod
    def get_fp8_group(cls):
        return cls.quantization_state.fp8_distributed_group

    @staticmethod
    def get_unique_autocast_key(recipe: Recipe | None = None, group=None) -> str:
        """quantization.py:714-727: the recipe's repr and the group's identity."""
        return f"recipe={recipe},group={id(group) if group is not None else None}"

    @classmethod
    def get_key_in_buffer(cls, forward: bool, recipe: Recipe, group) -> str:
        direction = "forward" if forward else "backward"
        return f"{direction}_{cls.get_unique_autocast_key(recipe, group)}"

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: dict) -> None:
        """quantization.py:501-565: register a delayed-scaling module once."""
        if not isinstance(fp8_meta.get("scaling_fwd"), DelayedScalingRecipeState):
            return
        if "buffer_index_and_autocast_key" in fp8_meta:
            return
        q = cls.quantization_state
        fp8_meta["buffer_index_and_autocast_key"] = []
        for forward in (True, False):
            state = fp8_meta["scaling_fwd" if forward else "scaling_bwd"]
            key = cls.get_key_in_buffer(forward, fp8_meta["recipe"], fp8_meta["fp8_group"])
            q.global_amax_buffer.setdefault(key, []).append(state.amax_history[0])
            q.global_amax_history_buffer.setdefault(key, []).append(state.amax_history)
            q.global_scale_buffer.setdefault(key, []).append(state.scale)
            fp8_meta["buffer_index_and_autocast_key"] += [len(q.global_amax_buffer[key]) - 1,
                                                          key]

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """quantization.py:656-711: per buffer key of this direction, concatenate row 0 of
        every registered history, MAX-reduce it over the autocast's group, update."""
        q = cls.quantization_state
        direction = "forward" if forward else "backward"
        for key, amaxes in q.global_amax_buffer.items():
            if not key.startswith(direction + "_") or not amaxes:
                continue
            recipe, group = q.autocast_arguments[key[len(direction) + 1:]]
            reduced = torch.cat(amaxes)
            if (recipe.reduce_amax and torch.distributed.is_initialized()
                    and torch.distributed.get_world_size(group=group) > 1):
                torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX,
                                             group=group)
            fp8_max = get_fp8_max(recipe, forward) * 2.0 ** -recipe.margin
            at = 0
            for hist, scale in zip(q.global_amax_history_buffer[key],
                                   q.global_scale_buffer[key]):
                n = hist.shape[1]
                amax_and_scale_update(reduced[at:at + n], hist, scale, fp8_max,
                                      recipe.amax_compute_algo)
                at += n

    @classmethod
    def autocast_enter(cls, enabled=False, calibrating=False, fp8_recipe=None, fp8_group=None,
                       _graph=False) -> None:
        """quantization.py:730-770."""
        recipe = get_default_fp8_recipe() if fp8_recipe is None else fp8_recipe
        q = cls.quantization_state
        q.autocast_arguments[cls.get_unique_autocast_key(recipe, fp8_group)] = (recipe,
                                                                                fp8_group)
        q.fp8_enabled, q.fp8_calibration = enabled, calibrating
        q.fp8_recipe, q.fp8_distributed_group = recipe, fp8_group
        q.fp8_graph_capturing = _graph
        if q.autocast_depth == 0:
            q.is_first_fp8_module = True
        q.autocast_depth += 1

    @classmethod
    def autocast_exit(cls, enabled: bool, _graph: bool) -> None:
        """quantization.py:772-782."""
        q = cls.quantization_state
        q.autocast_depth -= 1
        if enabled and q.autocast_depth == 0 and not _graph and torch.is_grad_enabled():
            cls.reduce_and_update_fp8_tensors(forward=True)

    @classmethod
    def get_autocast_state(cls) -> tuple:
        q = cls.quantization_state
        return (q.fp8_enabled, q.fp8_calibration, q.fp8_recipe, q.fp8_distributed_group,
                q.is_first_fp8_module, q.fp8_graph_capturing)

    @classmethod
    def set_autocast_state(cls, state: tuple) -> None:
        q = cls.quantization_state
        (q.fp8_enabled, q.fp8_calibration, q.fp8_recipe, q.fp8_distributed_group,
         q.is_first_fp8_module, q.fp8_graph_capturing) = state


def amax_and_scale_update(reduced: torch.Tensor, hist: torch.Tensor, scale: torch.Tensor,
                          scaled_max: float, algo: str) -> None:
    """The fused update of one module's history and scales, in place
    (common/recipe/delayed_scaling.cu:162-253): a column whose reduced amax is 0 keeps its
    history and scale; otherwise the history rolls by one with the reduced amax last and row 0
    cleared, and scale = fp8_max * 2^-margin / amax ("max": over the rolled history,
    "most_recent": the new amax), the old scale kept for a non-finite amax, FLT_MAX for an
    infinite scale."""
    last = torch.where(reduced != 0, reduced, hist[0])
    moved = last != 0
    seen = torch.cat([hist[1:], last[None]])  # what the roll keeps, newest last
    rolled = seen.clone()
    rolled[0] = 0
    new_hist = torch.where(moved.unsqueeze(0), rolled, hist)
    if algo == "most_recent":
        amax = last
    else:  # fmaxf over the kept values: NaN ignored
        amax = torch.where(moved, _fmax_rows(seen), torch.zeros_like(last))
    ok = torch.isfinite(amax) & (amax > 0)
    new_scale = torch.where(ok, torch.tensor(scaled_max, dtype=torch.float32) / amax, scale)
    new_scale = torch.where(torch.isinf(new_scale), torch.full_like(new_scale, _FLT_MAX),
                            new_scale)
    hist.copy_(new_hist)
    scale.copy_(new_scale)


def _fmax_rows(t: torch.Tensor) -> torch.Tensor:
    out = t[0]
    for row in t[1:]:
        out = torch.fmax(out, row)
    return out


@dataclass
class DelayedScalingRecipeState:
    """quantization.py:1397-1451: one direction's scales (ones) and amax history (zeros)."""

    recipe: Recipe
    mode: str
    num_quantizers: int
    scale: torch.Tensor = None
    amax_history: torch.Tensor = None

    def __post_init__(self) -> None:
        if self.scale is None:
            self.scale = torch.ones(self.num_quantizers, dtype=torch.float32)
            self.amax_history = torch.zeros(self.recipe.amax_history_len, self.num_quantizers,
                                            dtype=torch.float32)


@dataclass
class StatelessRecipeState:
    """Current, block and MX scaling: quantizers with no tensors (quantization.py:1454-1655)."""

    recipe: Recipe
    mode: str
    num_quantizers: int


class fp8_autocast:  # noqa: N801  (TE's name)
    """quantization.py:1034-1061: save the autocast state, enter, restore and exit."""

    def __init__(self, enabled: bool = True, calibrating: bool = False, fp8_recipe=None,
                 fp8_group=None, _graph: bool = False) -> None:
        if calibrating:
            raise NotImplementedError("fp8 calibration: not available in the CPU stand-in")
        self._args = (enabled, calibrating, fp8_recipe, fp8_group, _graph)
        self._saved = None

    def __enter__(self):
        self._saved = FP8GlobalStateManager.get_autocast_state()
        FP8GlobalStateManager.autocast_enter(*self._args)
        return self

    def __exit__(self, *exc) -> None:
        try:
            FP8GlobalStateManager.set_autocast_state(self._saved)
            FP8GlobalStateManager.autocast_exit(self._args[0], _graph=self._args[4])
        finally:
            self._saved = None


autocast = fp8_autocast


@contextlib.contextmanager
def fp8_model_init(enabled: bool = False, recipe=None, preserve_high_precision_init_val=False):
    """TE ``quantization.py`` ``fp8_model_init``: parameters created in fp8 when enabled; the
    stand-in has no fp8 parameters, so only the disabled form is accepted."""
    if enabled:
        raise NotImplementedError("the CPU stand-in of Transformer Engine cannot hold fp8 params")
    yield


quantized_model_init = fp8_model_init
