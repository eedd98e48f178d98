"""The rules megatron-core 0.16.1 enforces on a layout, checked up front with clear messages.

Each rule names the field it is about. The list also rejects one combination megatron-core 0.16
accepts but silently breaks (EP=1 with ETP != TP under the distributed optimizer, see the layout
notes); 0.19 puts those experts in a buffer of their own, so a spec naming it passes
(``spec.megatron_core``, ``versions.py``).
"""

from __future__ import annotations

from .buffers import experts_in_own_buffer
from .errors import SpecError
from .pipeline import (
    LayoutParseError,
    PipelineSplit,
    layout_problem,
    parse_layout,
    split_problem,
    stage_layers,
)
from .spec import LayoutSpec

MAX_WORLD = 1 << 20


def world_size(spec: LayoutSpec) -> int:
    w = spec.world
    return len(w.devices) if w.devices is not None else (w.nodes or 0) * (w.gpus_per_node or 0)


def pipeline_split(spec: LayoutSpec) -> PipelineSplit:
    p = spec.parallel
    return PipelineSplit(
        num_layers=spec.model.num_layers, pp=p.pp, vpp=p.vpp,
        first=p.decoder_first_pipeline_num_layers, last=p.decoder_last_pipeline_num_layers,
        account_embedding=p.account_for_embedding_in_pipeline_split,
        account_loss=p.account_for_loss_in_pipeline_split,
        layout=None if p.pipeline_model_parallel_layout is None else parse_layout(
            p.pipeline_model_parallel_layout),
    )


def check_rules(spec: LayoutSpec) -> None:
    """Raise ``SpecError`` for the first broken rule."""
    _check_model(spec)
    _check_world(spec)
    _check_parallel(spec)
    _check_pipeline(spec)
    _check_mtp_stage(spec)
    _check_state(spec)


def _check_state(spec: LayoutSpec) -> None:
    st = spec.state
    if st.derive_param:
        _need(st.main_param is not None, "state.derive_param",
              "needs main_param (the copy the param is cast from)", True)
        _need(st.param != "fp32" and st.main_param == "fp32", "state.derive_param",
              "needs a bf16/fp16 param cast from fp32 main params", st.param)


def _need(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise SpecError(field, rule, value)


def _check_model(spec: LayoutSpec) -> None:
    m = spec.model
    _need(m.num_attention_heads % m.groups == 0, "model.num_query_groups",
          f"must divide num_attention_heads={m.num_attention_heads}", m.groups)
    if m.kv_channels is None:  # megatron-core derives hidden // heads, floored (no check)
        _need(m.hidden_size >= m.num_attention_heads, "model.hidden_size",
              f"must be at least num_attention_heads={m.num_attention_heads} when kv_channels "
              "is not set (megatron-core derives kv_channels = hidden_size // heads = 0)",
              m.hidden_size)
    # The local spec's grouped GEMM is megatron's legacy GroupedMLP (one fused weight per
    # layer), a layout the IR does not model; TE's GroupedLinear keeps one weight per expert.
    _need(not m.moe_grouped_gemm or m.transformer_impl == "transformer_engine",
          "model.moe_grouped_gemm", "needs transformer_impl=transformer_engine (the local "
          "spec's grouped GEMM is the legacy GroupedMLP, not modelled)", True)
    _need(not m.moe_grouped_gemm or m.num_moe_experts is not None, "model.moe_grouped_gemm",
          "needs num_moe_experts", True)
    # megatron-core's local DotProductAttention takes no separate key/value head sizes, so
    # building MLA with the local spec fails in megatron itself (both versions).
    _need(not m.multi_latent_attention or m.transformer_impl == "transformer_engine",
          "model.multi_latent_attention", "needs transformer_impl=transformer_engine "
          "(megatron-core's local core attention cannot build multi-latent attention)", True)
    _check_fp8(m)
    if isinstance(m.moe_layer_freq, tuple):
        _need(len(m.moe_layer_freq) == m.num_layers, "model.moe_layer_freq",
              f"a list must have one 0/1 entry per layer (num_layers={m.num_layers})",
              len(m.moe_layer_freq))
    if m.num_moe_experts is None:
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            _need(getattr(m, name) is None, f"model.{name}", "needs num_moe_experts",
                  getattr(m, name))
        _need(not m.moe_router_enable_expert_bias, "model.moe_router_enable_expert_bias",
              "needs num_moe_experts", True)
        _need(not m.moe_first_dense_layers, "model.moe_first_dense_layers",
              "needs num_moe_experts", m.moe_first_dense_layers)
        return
    _need(not m.moe_router_enable_expert_bias or m.moe_router_score_function == "sigmoid",
          "model.moe_router_enable_expert_bias",
          "megatron-core supports the expert bias only with moe_router_score_function=sigmoid",
          m.moe_router_score_function)
    _need(m.moe_router_topk <= m.num_moe_experts, "model.moe_router_topk",
          f"must be at most num_moe_experts={m.num_moe_experts}", m.moe_router_topk)
    _need(m.moe_first_dense_layers < m.num_layers, "model.moe_first_dense_layers",
          f"must leave at least one MoE layer (num_layers={m.num_layers})",
          m.moe_first_dense_layers)
    _need(not (m.moe_shared_expert_intermediate_size and m.add_bias_linear),
          "model.add_bias_linear", "megatron-core's shared experts cannot have biases", True)
    _need(m.moe_shared_expert_intermediate_size is not None or not m.moe_shared_expert_gate,
          "model.moe_shared_expert_gate", "needs moe_shared_expert_intermediate_size", True)


def _check_fp8(m) -> None:
    """fp8 is Transformer Engine's. Delayed scaling is carried per TE GEMM module, and only
    where that state means the same in every layout: megatron MAX-reduces amaxes over all
    TP x DP x CP ranks of a stage (M16 parallel_state.py:1509-1532), so experts on different
    EP ranks share one history slot positionally, and megatron's checkpoint splits a grouped
    linear's state role-major where TE stores it GEMM-major (M16 extensions/
    transformer_engine.py:1553-1641)."""
    if m.fp8 is None:
        return
    _need(m.transformer_impl == "transformer_engine", "model.fp8",
          "needs transformer_impl=transformer_engine (fp8 is Transformer Engine's)", m.fp8)
    if not m.fp8_delayed:
        return
    _need(m.num_moe_experts is None, "model.fp8_recipe",
          "delayed scaling with experts is refused: megatron reduces amaxes across expert-"
          "parallel ranks that hold other experts, so the state depends on the layout",
          m.fp8_recipe)
    _need(not m.mtp_num_layers, "model.fp8_recipe",
          "delayed scaling with MTP layers is not modelled (their own fp8 autocast)",
          m.fp8_recipe)
    _need(m.softmax_type != "learnable", "model.fp8_recipe",
          "delayed scaling with learnable softmax is not modelled (megatron then saves core "
          "attention's fp8 state, which DynaTrain does not carry)", m.fp8_recipe)


def _check_world(spec: LayoutSpec) -> None:
    w = spec.world
    if w.devices is not None:
        _need(w.nodes is None and w.gpus_per_node is None, "world.devices",
              "give either devices or nodes x gpus_per_node, not both", w.devices[:2])
    else:
        _need(w.nodes is not None and w.gpus_per_node is not None, "world",
              "needs nodes and gpus_per_node, or a devices list", None)
    _need(world_size(spec) <= MAX_WORLD, "world", f"at most {MAX_WORLD} devices",
          world_size(spec))
    if w.devices is None:
        last = w.first_node + (w.nodes or 0) - 1
        _need(last < 10**6, "world.first_node", "node ids must stay below 1000000", last)
        _need((w.gpus_per_node or 0) <= 10**4, "world.gpus_per_node", "at most 10000",
              w.gpus_per_node)


def _check_parallel(spec: LayoutSpec) -> None:
    m, p, W = spec.model, spec.parallel, world_size(spec)
    tp, etp = p.tp, p.expert_tp
    _need(m.num_attention_heads % tp == 0, "parallel.tp",
          f"must divide num_attention_heads={m.num_attention_heads}", tp)
    g = m.groups
    _need(g % tp == 0 if g >= tp else tp % g == 0, "parallel.tp",
          f"must divide num_query_groups={g}, or be a multiple of it", tp)
    _need(m.ffn % tp == 0, "parallel.tp", f"must divide ffn_hidden_size={m.ffn}", tp)
    if m.mtp_num_layers:  # eh_proj is column-parallel over the hidden size
        _need(m.hidden_size % tp == 0, "parallel.tp",
              f"must divide hidden_size={m.hidden_size} with mtp_num_layers", tp)
    if m.mtp_num_layers and p.pp > 1:
        # language_module.py:343 (M16) asserts on the MTP stage's unused tied output copy.
        _need(m.untie_embeddings_and_output_weights, "model.mtp_num_layers",
              "with pp > 1 needs untie_embeddings_and_output_weights (megatron-core's "
              "sharded_state_dict refuses the tied output copy on the MTP stage)", m.mtp_num_layers)
        _need(m.position_embedding_type != "learned_absolute", "model.mtp_num_layers",
              "with pp > 1 needs a position embedding other than learned_absolute (the MTP "
              "stage trains its own position table, which megatron-core saves under the first "
              "stage's key: two different tensors as one)", m.mtp_num_layers)
    mp = tp * p.pp * p.cp
    _need(W % mp == 0, "world", f"size must be divisible by tp*pp*cp={mp}", W)
    dp = W // mp
    _need((dp * p.cp) % p.num_distributed_optimizer_instances == 0,
          "parallel.num_distributed_optimizer_instances", f"must divide dp*cp={dp * p.cp}",
          p.num_distributed_optimizer_instances)
    _need(p.num_distributed_optimizer_instances == 1 or p.use_distributed_optimizer,
          "parallel.num_distributed_optimizer_instances", "needs use_distributed_optimizer",
          p.num_distributed_optimizer_instances)
    if m.num_moe_experts is None:
        _need(p.ep == 1, "parallel.ep", "needs a MoE model (num_moe_experts)", p.ep)
        _need(p.etp is None or p.etp == tp, "parallel.etp", "needs a MoE model", p.etp)
        # megatron-core builds the expert grid (which has no cp) for dense models too, and
        # asserts equal DP sizes unless pp is last (parallel_state.py:808-812).
        _need(p.order.endswith("-pp") or p.pp == 1 or p.cp == 1, "parallel.order",
              f"an order not ending in pp needs cp=1 when pp > 1: megatron-core's expert grid "
              f"has no cp and must then have the same DP size (here {dp * p.cp} vs {dp})",
              p.order)
        return
    _need(m.num_moe_experts % p.ep == 0, "parallel.ep",
          f"must divide num_moe_experts={m.num_moe_experts}", p.ep)
    _need(m.moe_ffn % etp == 0, "parallel.etp", f"must divide moe_ffn_hidden_size={m.moe_ffn}",
          etp)
    if m.moe_shared_expert_intermediate_size:
        _need(m.moe_shared_expert_intermediate_size % tp == 0, "parallel.tp",
              "must divide moe_shared_expert_intermediate_size="
              f"{m.moe_shared_expert_intermediate_size}", tp)
    emp = etp * p.ep * p.pp
    _need(W % emp == 0, "world", f"size must be divisible by etp*ep*pp={emp}", W)
    edp = W // emp
    _need(edp % p.num_distributed_optimizer_instances == 0,
          "parallel.num_distributed_optimizer_instances",
          f"must divide the expert data-parallel size {edp}", p.num_distributed_optimizer_instances)
    _need(p.order.endswith("-pp") or p.pp == 1 or edp == dp, "parallel.order",
          f"an order not ending in pp needs expert DP == DP (here {edp} vs {dp})", p.order)
    if not p.order.endswith("-pp") and p.pp > 1:
        _check_same_pp_groups(spec, dp, edp)
    _need(not (m.add_bias_linear and etp != 1), "parallel.etp",
          "MoE with add_bias_linear needs etp=1 in megatron-core", etp)
    # Only where the experts stay in the dense buffer: ep=1, and on 0.19 also etp == tp.
    dense_experts = not experts_in_own_buffer(spec.megatron_core, tp, p.ep, etp)
    _need(not (dense_experts and etp != tp and p.use_distributed_optimizer), "parallel.etp",
          f"etp != tp with ep=1 puts different expert slices at the same dense-buffer offsets "
          f"under the distributed optimizer, so megatron-core {spec.megatron_core} silently "
          "loses optimizer state; use ep>1, etp=tp or megatron-core 0.19 (which keeps these "
          "experts in a buffer of their own)", etp)
    if dense_experts and p.use_distributed_optimizer and p.cp > 1:
        _check_expert_slices_align(spec, dp, edp)


def _check_expert_slices_align(spec: LayoutSpec, dp: int, edp: int) -> None:
    """With ep=1 the experts sit in the dense buffer, which the distributed optimizer shards
    over each dense DP x CP group: its ranks must hold the same expert-TP slice. The expert
    grid has no cp, so an order with cp before tp gives them different slices (the etp != tp
    case again: different slices at the same buffer offsets, optimizer state lost)."""
    from .mesh import Mesh  # local, as in _check_same_pp_groups

    p = spec.parallel
    mesh = Mesh(p.order, tp=p.tp, cp=p.cp, dp=dp, pp=p.pp, ep=p.ep, etp=p.expert_tp, edp=edp)
    seen: set[int] = set()
    for rank in range(mesh.world):
        if rank in seen:
            continue
        group = mesh.dense.group(rank, ("dp", "cp"))
        seen.update(group)
        slices = {mesh.coords(r).etp for r in group}
        _need(len(slices) == 1, "parallel.order",
              f"gives the data-parallel group {list(group)[:8]} different expert-TP slices "
              f"{sorted(slices)} in the dense buffer (ep=1, cp={p.cp}), so megatron-core's "
              "distributed optimizer silently loses optimizer state; put tp before cp in the "
              "order or use ep>1", p.order)


def _check_same_pp_groups(spec: LayoutSpec, dp: int, edp: int) -> None:
    """megatron-core asserts that the dense and expert grids give the same pipeline groups."""
    from .mesh import Mesh  # local: rules stay importable without the mesh for plain checks

    p = spec.parallel
    mesh = Mesh(p.order, tp=p.tp, cp=p.cp, dp=dp, pp=p.pp, ep=p.ep, etp=p.expert_tp, edp=edp)
    for rank in range(mesh.world):
        d, e = mesh.dense.group(rank, ("pp",)), mesh.expert.group(rank, ("pp",))
        _need(d == e, "parallel.order", f"gives rank {rank} the pipeline group {list(d)} in the "
              f"dense grid but {list(e)} in the expert grid; megatron-core requires them equal",
              p.order)


def _check_mtp_stage(spec: LayoutSpec) -> None:
    """An MTP layer takes the spec of the model's last decoder layer, unless its stage builds no
    decoder layer: then Megatron-LM gives an MoE model's MTP layer an MoE spec (MT19 training/
    models/gpt.py:94-130, 387-412). With a dense last layer the model would then change with
    the layout, so that layout is refused."""
    m, p = spec.model, spec.parallel
    if not (m.mtp_num_layers and m.num_moe_experts) or m.moe_pattern()[-1]:
        return
    last = stage_layers(pipeline_split(spec))[p.pp - 1][-1]
    _need(bool(last), "model.mtp_num_layers", "needs a decoder layer on the last stage "
          "when the last decoder layer is dense (Megatron-LM builds an MTP layer without one "
          "as an MoE layer: another model)", m.mtp_num_layers)


def _check_layout(spec: LayoutSpec, text: str) -> None:
    """megatron-core 0.16.1's checks of ``pipeline_model_parallel_layout``
    (transformer_config.py:1307-1357, pipeline_parallel_layer_layout.py:24-150)."""
    p, field = spec.parallel, "parallel.pipeline_model_parallel_layout"
    others = [name for name in ("decoder_first_pipeline_num_layers",
                                "decoder_last_pipeline_num_layers",
                                "account_for_embedding_in_pipeline_split",
                                "account_for_loss_in_pipeline_split")
              if getattr(p, name) not in (None, False)]
    _need(not others, field, f"cannot be combined with {', '.join(others)} (megatron-core "
          "refuses any other pipeline split argument with a layout)", text[:40])
    try:
        stages = parse_layout(text)
    except LayoutParseError as err:
        raise SpecError(field, str(err), text[:40]) from None
    _need(len(stages) % p.pp == 0, field,
          f"has {len(stages)} stages, which must be a multiple of pp={p.pp}", text[:40])
    vpp = len(stages) // p.pp
    _need(p.vpp is None and vpp == 1 or p.vpp == vpp, "parallel.vpp",
          f"conflicts with pipeline_model_parallel_layout, whose {len(stages)} stages over "
          f"pp={p.pp} give vpp={vpp}", p.vpp)
    _need(p.pp > 1 or vpp == 1, field, "with pp=1 must be one stage (more stages are virtual "
          "pipeline chunks, which need pp > 1)", text[:40])
    problem = layout_problem(stages, p.pp, spec.model.num_layers, spec.model.mtp_num_layers)
    _need(problem is None, field, str(problem), text[:40])


def _check_pipeline(spec: LayoutSpec) -> None:
    m, p = spec.model, spec.parallel
    if p.pipeline_model_parallel_layout is not None:
        _check_layout(spec, p.pipeline_model_parallel_layout)
        return
    uneven = p.decoder_first_pipeline_num_layers is not None or (
        p.decoder_last_pipeline_num_layers is not None)
    if p.vpp is not None:
        _need(p.pp > 1, "parallel.vpp", "virtual pipeline needs pp > 1", p.vpp)
    if uneven:
        _need(p.pp > 1, "parallel.decoder_first_pipeline_num_layers", "needs pp > 1", p.pp)
        _need(not (p.account_for_embedding_in_pipeline_split
                   or p.account_for_loss_in_pipeline_split),
              "parallel.account_for_embedding_in_pipeline_split",
              "cannot be combined with decoder_first/last_pipeline_num_layers", True)
        set_ends = (p.decoder_first_pipeline_num_layers is not None) + (
            p.decoder_last_pipeline_num_layers is not None)
        middle = p.pp - set_ends
        rest = m.num_layers - (p.decoder_first_pipeline_num_layers or 0) - (
            p.decoder_last_pipeline_num_layers or 0)
        _need(rest >= 0, "parallel.decoder_first_pipeline_num_layers",
              f"first + last stage layers exceed num_layers={m.num_layers}", rest)
        _need(middle > 0 or rest == 0, "parallel.pp",
              f"{rest} layers are left for no middle stage", p.pp)
        _need(middle == 0 or rest > 0, "parallel.pp",
              f"{middle} middle stages are left with no layers", p.pp)
        if middle > 0:
            _need(rest % middle == 0, "parallel.pp",
                  f"the {rest} layers outside the first/last stage must split evenly over "
                  f"{middle} middle stages", p.pp)
        if p.vpp is not None:
            _need(middle > 0, "parallel.vpp", "uneven pp with vpp needs a middle stage "
                  "(megatron-core 0.16.1 divides by zero otherwise)", p.vpp)
            for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
                v = getattr(p, name)
                _need(v is None or v % p.vpp == 0, f"parallel.{name}",
                      f"must be divisible by vpp={p.vpp}", v)
            _need(middle == 0 or (rest // middle) % p.vpp == 0, "parallel.vpp",
                  f"must divide the {rest // max(middle, 1)} layers of each middle stage", p.vpp)
    else:
        total = m.num_layers + p.account_for_embedding_in_pipeline_split + (
            p.account_for_loss_in_pipeline_split)
        _need(total % p.pp == 0, "parallel.pp",
              f"must divide num_layers={total} (incl. accounted embedding/loss) unless "
              "decoder_first/last_pipeline_num_layers are set", p.pp)
        if p.vpp is not None:
            _need((total // p.pp) % p.vpp == 0, "parallel.vpp",
                  f"must divide the {total // p.pp} layers per pipeline stage", p.vpp)
    problem = split_problem(pipeline_split(spec))
    _need(problem is None, "parallel.pp", str(problem), p.pp)
