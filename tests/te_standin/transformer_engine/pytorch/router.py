"""TE's fused MoE router kernels (``router.py``): megatron-core imports them for TE >= 2.7 but
calls them only with ``moe_router_fusion=True``. The stand-in has no fused kernels; the
unfused torch router computes the same thing, so a fused call is refused with that advice.
"""


def _refuse(*_args, **_kwargs):
    raise NotImplementedError("fused MoE router kernels: not in the CPU stand-in of Transformer "
                              "Engine; set moe_router_fusion=False")


fused_topk_with_score_function = _refuse
fused_compute_score_for_moe_aux_loss = _refuse
fused_moe_aux_loss = _refuse
