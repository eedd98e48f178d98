"""``FusedAdam`` (TE ``optimizers/fused_adam.py``), fp32 states only, on CPU.

What matters for layouts and checkpoints, as TE has it:
* per-parameter state is ``exp_avg`` and ``exp_avg_sq``, and ``master_param`` with
  ``master_weights`` (megatron asks for it only with the precision-aware optimizer); there is
  no per-parameter ``step`` (fused_adam.py:452-476);
* the step is one Python int per param group, advanced at the top of ``step()`` for every
  group, empty ones included (fused_adam.py:559-583);
* the update is the kernel's, in fp32 with the scalars rounded to fp32 and the bias
  corrections ``float(1 - pow(double(beta), step))`` (common/multi_tensor/adam.cu:580-585,
  123-141).

The precision-aware states megatron asks for are kept as TE keeps them: master weights (fp32,
or as int16 remainders of bf16 params, ``store_param_remainders``; adam.cu:178-292), bf16
moments, gradients in ``decoupled_grad``. fp16/fp8 states (scaled) and the capturable (CUDA
graph) step raise.
"""

from __future__ import annotations

import math

import torch


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


_STATE_DTYPES = (torch.float32, torch.bfloat16)


class FusedAdam(torch.optim.Optimizer):
    """Adam / AdamW with TE FusedAdam's state layout and fp32 arithmetic."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, bias_correction=True,
                 adam_w_mode=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32,
                 exp_avg_sq_dtype=torch.float32, use_decoupled_grad=False,
                 store_param_remainders=False, set_grad_none=None) -> None:
        if amsgrad:  # fused_adam.py:134-135
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        unsupported = {k: v for k, v in dict(
            capturable=capturable, master_weight_dtype=master_weight_dtype,
            exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype).items()
            if v not in (False, *_STATE_DTYPES) or (k == "master_weight_dtype"
                                                    and v != torch.float32)}
        if unsupported:
            raise NotImplementedError(f"CPU stand-in of TE FusedAdam: unsupported {unsupported}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)  # fused_adam.py:165-172
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0  # fused_adam.py:173
        self.capturable = False
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.use_decoupled_grad = use_decoupled_grad
        # fused_adam.py:213-215: remainders only with fp32 masters
        self.store_param_remainders = (store_param_remainders and master_weights
                                       and master_weight_dtype == torch.float32)
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}  # fused_adam.py:199-203

    def _remainders(self, param, state_name: str) -> bool:
        return (self.store_param_remainders and state_name == "master_param"
                and param.dtype == torch.bfloat16)

    def _initialize_state(self, param, state_name: str, zero_buffer: bool,
                          store_param_remainders: bool = False) -> None:
        """fused_adam.py:393-450: int16 zeros for a remainder master, else the state dtype."""
        if store_param_remainders:
            data = torch.zeros_like(param, dtype=torch.int16)
        else:
            data = torch.empty_like(param, dtype=self.name_to_dtype_map[state_name])
            if zero_buffer:
                data.zero_()
        self.state[param][state_name] = data

    def initialize_state(self, param, store_param_remainders=False) -> None:
        """fused_adam.py:452-476: zero moments; with master weights the master starts as the
        param (its remainder as 0)."""
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", zero_buffer=False,
                                   store_param_remainders=store_param_remainders)
            if not store_param_remainders:
                self.set_scaled_state(param, "master_param", param.clone().detach().float())

    def get_unscaled_state(self, param, state_name: str, skip_unscale: bool = False):
        """fused_adam.py:306-352: fp32 (and a remainder master, int16) as the live tensor,
        bf16 as an fp32 copy (or live with ``skip_unscale``)."""
        t = self.state[param][state_name]
        if self.name_to_dtype_map[state_name] == torch.bfloat16 and not skip_unscale:
            return t.float()
        return t

    def set_scaled_state(self, param, state_name: str, unscaled_state) -> None:
        """fused_adam.py:354-391: an fp32 value (int16 for a remainder master) copied into
        (or creating) the state, cast to the state's dtype."""
        if state_name not in self.name_to_dtype_map:  # any other per-parameter key
            raise KeyError(state_name)
        remainders = self._remainders(param, state_name)
        assert unscaled_state.dtype == (torch.int16 if remainders else torch.float32)
        state = self.state[param]
        if state_name not in state:
            self._initialize_state(param, state_name, False, remainders)
        state[state_name].copy_(unscaled_state)

    def load_state_dict(self, state_dict) -> None:
        """fused_adam.py:511-544: torch's load (param groups, their ``step`` included), then
        every per-parameter state set again through ``set_scaled_state``."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        by_id = dict(zip(saved, params))
        for k, v in state_dict["state"].items():
            if k in by_id:
                p = by_id[k]
                self.state[p] = {}
                for name, t in v.items():
                    if t is None:
                        continue
                    self.set_scaled_state(p, name, t if self._remainders(p, name) else t.float())

    def state_dict(self):
        """fused_adam.py:478-509: every state as ``get_unscaled_state`` gives it."""
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        by_id = dict(zip(ids, params))
        for k, v in sd["state"].items():
            sd["state"][k] = {n: self.get_unscaled_state(by_id[k], n) for n in v}
        return sd

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """fused_adam.py:546-889 (no fp8 params): advance every group's step, then the
        kernel's update (adam.cu:123-141; with master weights on the fp32 master, the
        remainder kernel at adam.cu:178-292) on each parameter that has a gradient."""
        if grad_scaler is not None:
            raise NotImplementedError("CPU stand-in of TE FusedAdam: grad_scaler")
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1  # fused_adam.py:566-583
            if not group["params"]:
                continue
            beta1, beta2 = group["betas"]
            step = group["step"]
            b1, b2 = _f32(beta1), _f32(beta2)
            if group["bias_correction"]:  # adam.cu:580-585: pow in double of the fp32 beta
                bc1 = _f32(1.0 - math.pow(float(b1), step))
                bc2 = _f32(1.0 - math.pow(float(b2), step))
            else:
                bc1 = bc2 = _f32(1.0)
            lr, eps, decay = _f32(group["lr"]), _f32(group["eps"]), _f32(group["weight_decay"])
            for p in group["params"]:
                grad = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
                if grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    self.initialize_state(p, self._remainders(p, "master_param"))
                m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()
                if self.master_weights and self._remainders(p, "master_param"):
                    master = _join(p, state["master_param"])
                elif self.master_weights:
                    master = state["master_param"]
                else:
                    master = p.detach().float()
                _adam_update(master, grad, m, v, b1, b2, bc1, bc2, lr, eps, decay,
                             self.adam_w_mode)
                state["exp_avg"].copy_(m)  # RNE into a bf16 state
                state["exp_avg_sq"].copy_(v)
                if self.master_weights and self._remainders(p, "master_param"):
                    _split(master, p, state["master_param"])
                else:
                    p.copy_(master)  # RNE into a bf16 param (adam.cu:145-160)
        return loss


def _join(p: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """adam.cu:178-230: the fp32 master from the bf16 param (high 16 bits) and the int16
    remainder (low 16 bits), the high half one less where the remainder is negative."""
    hi = p.detach().view(torch.int16).to(torch.int32)
    hi = torch.where(rem < 0, hi - 1, hi)
    bits = (hi << 16) | (rem.to(torch.int32) & 0xFFFF)
    return bits.view(torch.float32).clone()


def _split(master: torch.Tensor, p: torch.Tensor, rem: torch.Tensor) -> None:
    """adam.cu:268-292: the high 16 bits, rounded up where the low half is negative as an
    int16, into the bf16 param; the low 16 bits into the remainder."""
    bits = master.view(torch.int32)
    lo = (bits & 0xFFFF).to(torch.int16)
    hi = (bits >> 16) + (lo < 0).to(torch.int32)
    p.detach().view(torch.int16).copy_(hi.to(torch.int16))
    rem.copy_(lo)


def _adam_update(p, grad, m, v, b1, b2, bc1, bc2, lr, eps, decay, mode: int) -> None:
    """One parameter's update in fp32, in place on ``p`` (fp32), ``m`` and ``v``, in the
    kernel's order (adam.cu:123-141)."""
    r_p = p.detach().float()
    r_g = grad.detach().float()
    one = _f32(1.0)
    if mode == 0:  # ADAM_MODE_0: L2 regularisation folded into the gradient
        r_g = r_g + decay * r_p
    m.copy_(b1 * m + (one - b1) * r_g)
    v.copy_(b2 * v + (one - b2) * r_g * r_g)
    denom = torch.sqrt(v / bc2) + eps
    update = (m / bc1) / denom
    if mode == 1:  # ADAM_MODE_1: decoupled weight decay, from the old parameter
        update = update + decay * r_p
    p.copy_(r_p - lr * update)
