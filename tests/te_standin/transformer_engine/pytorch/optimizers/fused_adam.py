"""``FusedAdam`` (TE ``optimizers/fused_adam.py``), fp32 states only, on CPU.

What matters for layouts and checkpoints, as TE has it:
* per-parameter state is ``exp_avg`` and ``exp_avg_sq`` only (``master_param`` needs
  ``master_weights``, which megatron asks for only with the precision-aware optimizer); there is
  no per-parameter ``step`` (fused_adam.py:452-476);
* the step is one Python int per param group, advanced at the top of ``step()`` for every
  group, empty ones included (fused_adam.py:559-583);
* the update is the kernel's, in fp32 with the scalars rounded to fp32 and the bias
  corrections ``float(1 - pow(double(beta), step))`` (common/multi_tensor/adam.cu:580-585,
  123-141).

Precision-aware states (bf16/fp8 moments, master weights, param remainders) and the
capturable (CUDA graph) step raise: the stand-in has none of them.
"""

from __future__ import annotations

import math

import torch


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


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
            capturable=capturable, master_weights=master_weights,
            use_decoupled_grad=use_decoupled_grad,
            store_param_remainders=store_param_remainders).items() if v}
        unsupported.update({k: v for k, v in dict(
            master_weight_dtype=master_weight_dtype, exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype).items() if v != torch.float32})
        if unsupported:
            raise NotImplementedError(f"CPU stand-in of TE FusedAdam: unsupported {unsupported}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)  # fused_adam.py:165-172
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0  # fused_adam.py:173
        self.capturable = False
        self.master_weights = False
        self.use_decoupled_grad = False
        self.store_param_remainders = False
        self.name_to_dtype_map = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32,
                                  "master_param": torch.float32}

    def initialize_state(self, param, store_param_remainders=False) -> None:
        """fused_adam.py:452-476 with fp32 moments and no master weights."""
        self.state[param]["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
        self.state[param]["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)

    def get_unscaled_state(self, param, state_name: str, skip_unscale: bool = False):
        """fused_adam.py:306-352: an fp32 state is returned as the live tensor."""
        return self.state[param][state_name]

    def set_scaled_state(self, param, state_name: str, unscaled_state) -> None:
        """fused_adam.py:354-391 for fp32 states: copy into (or create) the state tensor."""
        assert unscaled_state.dtype == torch.float32
        if state_name not in self.name_to_dtype_map:  # any other per-parameter key
            raise KeyError(state_name)
        state = self.state[param]
        if state_name not in state:
            state[state_name] = torch.empty_like(param, dtype=torch.float32)
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
                    if t is not None:
                        self.set_scaled_state(p, name, t.float())

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """fused_adam.py:546-889 for fp32 states: advance every group's step, then the
        kernel's update (adam.cu:123-141) on each parameter that has a gradient."""
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
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    self.initialize_state(p)
                _adam_update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], b1, b2, bc1,
                             bc2, lr, eps, decay, self.adam_w_mode)
        return loss


def _adam_update(p, grad, m, v, b1, b2, bc1, bc2, lr, eps, decay, mode: int) -> None:
    """One parameter's update in fp32, in the kernel's order (adam.cu:123-141)."""
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
    p.copy_((r_p - lr * update).to(p.dtype))
