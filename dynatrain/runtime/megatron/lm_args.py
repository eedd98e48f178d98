"""The Megatron-LM argument values of a layout: what a layout switch sets on a running job's args.

Megatron-LM keeps the parallel layout in its global ``args`` and reads it again after a switch
(when it rebuilds the model, the optimizer, the microbatch calculator and the data iterators),
and ``validate_args`` derives many of those values once, at start-up, from the command line.
``layout_args(args, spec)`` gives every layout-dependent value for ``spec``, derived the way
Megatron-LM 0.19.2's ``validate_args`` derives it (cited line by line, MT19 =
megatron/training of 0.19.2, M19 = megatron/core of 0.19.2, MT16 = core_v0.16.1's
megatron/training), so that a stale value of the old layout cannot survive a switch.

Round trip: for args ``A`` of a layout X and a spec ``Y`` of the same model,
``dynatrain.ir.from_job.spec_from_megatron(A updated with layout_args(A, Y), Y's world)`` is
``Y``: ``layout_args`` checks this itself and refuses (``SpecError``, one line naming the
field) a spec that the job's args cannot describe (another model, dtypes or pipeline order),
and a layout that Megatron-LM's own checks of the job's other arguments would refuse.

Not set here: ``rank`` (each process's own: ``torch.distributed.get_rank()``, MT19
initialize.py:274) and the batch sizes. A switch keeps ``global_batch_size`` even where
validate_args derived it from the old DP size (micro batch x DP, MT19 arguments.py:684-685):
the training keeps its batch, and a layout whose micro batch x DP does not divide it is
refused, as Megatron-LM's microbatch calculator would refuse it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from ...ir import versions
from ...ir.errors import DynatrainError, SpecError
from ...ir.from_job import read_megatron
from ...ir.layout import Layout
from ...ir.spec import LayoutSpec, ModelConfig

# The two rank orders Megatron-LM's args can ask for (use_tp_pp_dp_mapping: MT19
# initialize.py:388).
_ORDERS = {"tp-cp-ep-dp-pp": False, "tp-cp-ep-pp-dp": True}


def layout_args(args: Any, spec: LayoutSpec) -> dict[str, Any]:
    """The argument values that make a running job's ``args`` describe ``spec``'s layout.

    Args:
        args: the job's Megatron-LM ``args`` (Namespace or mapping of its argument names), as
            ``validate_args`` and the training loop left them.
        spec: the destination layout; the same model (and dtypes) as the job's.

    Returns:
        Argument name -> value, to ``setattr`` on ``args`` before the job is rebuilt: world
        and parallel sizes, the virtual pipeline and pipeline split, sequence parallelism,
        the rank order, the DDP and distributed-optimizer settings of the spec, the padded
        vocabulary (Megatron-LM's own function), for megatron-core 0.19 the generalized TP
        shard counts; ``overlap_p2p_comm``/``align_param_gather`` where validate_args ties
        them to interleaving, and ``vocab_size`` where the job's args lack it (the
        vocabulary the import took from the padded rows, so that they read back the same).

    Raises:
        SpecError: one line naming the field or argument: a spec the args cannot describe
            or a layout Megatron-LM's checks of the job's other arguments refuse.

    Example:
        >>> new = layout_args(args, dst_spec)  # doctest: +SKIP
        >>> for name, value in new.items():  # doctest: +SKIP
        ...     setattr(args, name, value)
    """
    a = dict(args) if isinstance(args, Mapping) else dict(vars(args))
    p, layout = spec.parallel, Layout(spec)
    _check_same_model(a, spec)
    if p.order not in _ORDERS:
        raise SpecError("parallel.order", f"Megatron-LM's args give only {' or '.join(_ORDERS)} "
                        "(use_tp_pp_dp_mapping)", p.order)
    tp, pp, cp = p.tp, p.pp, p.cp
    # No generalized TP: validate_args resolves the shard counts to the TP sizes, GTP 1 (MT19
    # arguments.py:412-420 and 1455-1472; M19 model_parallel_config.py:27-29), and the DP
    # size divides the world by TP x PP x CP x GTP (MT19 arguments.py:421-446).
    out: dict[str, Any] = {
        "world_size": layout.world,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "transformer_pipeline_model_parallel_size": pp,  # MT19 arguments.py:438
        "context_parallel_size": cp,
        "expert_model_parallel_size": p.ep,
        "expert_tensor_parallel_size": p.expert_tp,  # None means TP: MT19 arguments.py:569-570
        "data_parallel_size": layout.world // (tp * pp * cp),
        # validate_args turns it off at TP 1 (MT19 arguments.py:1393-1399).
        "sequence_parallel": p.sequence_parallel and tp > 1,
        "use_tp_pp_dp_mapping": _ORDERS[p.order],
        "decoder_first_pipeline_num_layers": p.decoder_first_pipeline_num_layers,
        "decoder_last_pipeline_num_layers": p.decoder_last_pipeline_num_layers,
        "account_for_embedding_in_pipeline_split": p.account_for_embedding_in_pipeline_split,
        "account_for_loss_in_pipeline_split": p.account_for_loss_in_pipeline_split,
        "use_distributed_optimizer": p.use_distributed_optimizer,
        "num_distributed_optimizer_instances": p.num_distributed_optimizer_instances,
        "overlap_grad_reduce": p.overlap_grad_reduce,
        "ddp_bucket_size": _bucket_size(spec, layout),
        "ddp_pad_buckets_for_high_nccl_busbw": p.pad_buckets_for_high_nccl_busbw,
        "padded_vocab_size": padded_vocab_size(spec.model.vocab_size,
                                               spec.model.make_vocab_size_divisible_by, tp),
    }
    out.update(_pipeline(spec))
    if out["virtual_pipeline_model_parallel_size"] is None:
        # Non-interleaved schedules overlap no P2P and align no param gather (MT19
        # arguments.py:976-979; MT16 arguments.py:583-585).
        out.update(overlap_p2p_comm=False, align_param_gather=False)
    elif a.get("virtual_pipeline_model_parallel_size") is None:
        # The job's layout was not interleaved, so validate_args had turned both off: its
        # args do not say what the job chose. Megatron-LM's defaults, on (MT19 arguments.py:
        # 2965-2967 and 2993-2996, --no-overlap-p2p-communication / --no-align-param-gather;
        # MT16 2232, 2268); an interleaved schedule at PP 2 needs the P2P overlap (:966-975).
        out.update(overlap_p2p_comm=True, align_param_gather=True)
    if versions.series_key(spec.megatron_core) >= (0, 19):
        out.update(tensor_parallel_num_weight_shards=tp, gtp_weight_remat_size=1,
                   expert_tensor_parallel_num_weight_shards=p.expert_tp,
                   expert_gtp_weight_remat_size=1)
    if a.get("vocab_size") is None:
        # The job's args give only the padded rows, which the import took as the vocabulary:
        # name it, so that the new padded_vocab_size reads back as the same vocabulary.
        out["vocab_size"] = spec.model.vocab_size
    _check_megatron_rules({**a, **out})
    _check_round_trip({**a, **out}, spec)
    return out


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """The embedding's rows for a vocabulary at TP ``tp``, by Megatron's own function.

    Megatron-LM 0.19's tokenizer sets ``args.padded_vocab_size`` with megatron-core's
    ``vocab_size_with_padding`` (M19 tokenizers/utils/build_tokenizer.py:124-143); 0.16's with
    ``megatron.training.tokenizer.tokenizer._vocab_size_with_padding`` (MT16 tokenizer.py:
    109-130). Both round ``vocab_size`` up to a multiple of ``divisible_by * tp``.
    """
    ns = SimpleNamespace(make_vocab_size_divisible_by=divisible_by,
                         tensor_model_parallel_size=tp, rank=0)
    try:
        from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    except ImportError:
        try:
            from megatron.training.tokenizer.tokenizer import (
                _vocab_size_with_padding as vocab_size_with_padding,
            )
        except ImportError:
            raise DynatrainError("layout_args needs Megatron-LM (megatron.training) or "
                                 "megatron-core >= 0.17 (megatron.core.tokenizers) to pad the "
                                 "vocabulary") from None
    return int(vocab_size_with_padding(vocab_size, ns, logging_enabled=False))


def _pipeline(spec: LayoutSpec) -> dict[str, Any]:
    """The virtual pipeline's arguments, given as validate_args reads them (MT19 arguments.py:
    896-949): a layout string alone sets VPP to its stages / PP; otherwise
    num_virtual_stages_per_pipeline_rank does (it also works with uneven first/last stages);
    VPP 1 is None."""
    p = spec.parallel
    vpp = p.vpp if p.vpp is not None and p.vpp > 1 else None
    return {
        "pipeline_model_parallel_layout": p.pipeline_model_parallel_layout,
        "num_layers_per_virtual_pipeline_stage": None,
        "num_virtual_stages_per_pipeline_rank": (
            vpp if p.pipeline_model_parallel_layout is None else None),
        "virtual_pipeline_model_parallel_size": vpp,
    }


def _bucket_size(spec: LayoutSpec, layout: Layout) -> int | None:
    """The spec's DDP bucket size in Megatron-LM's terms.

    A spec without one means megatron-core DDP's default, max(40M, 1M x DP) (ir.layout); Megatron-LM
    sizes its default by DP x CP instead (MT19 training.py:1552-1567), so with CP > 1 the
    spec's bucket is given explicitly where the two differ.
    """
    p = spec.parallel
    if p.bucket_size is not None or not p.overlap_grad_reduce:
        return p.bucket_size
    core, lm = (max(40_000_000, 1_000_000 * n) for n in (layout.dp, layout.dp * p.cp))
    return None if core == lm else core


def _check_megatron_rules(a: dict[str, Any]) -> None:
    """validate_args' and the microbatch calculator's checks that tie the job's other
    arguments to the layout (a stale value would fail there after the switch)."""
    tp, pp, cp, dp = (a["tensor_model_parallel_size"], a["pipeline_model_parallel_size"],
                      a["context_parallel_size"], a["data_parallel_size"])
    vpp = a["virtual_pipeline_model_parallel_size"]
    if vpp is not None and not a.get("overlap_p2p_comm") and pp <= 2:
        raise SpecError("parallel.vpp", "Megatron-LM's interleaved schedule needs "
                        "pipeline_model_parallel_size > 2 while the job has overlap_p2p_comm "
                        "off (MT19 arguments.py:966-975)", vpp)
    hierarchical = a.get("hierarchical_context_parallel_sizes")
    if hierarchical and math.prod(hierarchical) != cp:  # MT19 arguments.py:562-564
        raise SpecError("hierarchical_context_parallel_sizes", "must multiply to "
                        f"context_parallel_size={cp}; give the sizes for the new CP",
                        list(hierarchical))
    seq = a.get("seq_length")
    if isinstance(seq, int) and cp > 1 and seq % (2 * cp):  # MT19 arguments.py:1295-1297
        raise SpecError("parallel.cp", f"seq_length={seq} must be a multiple of 2 x "
                        "context_parallel_size", cp)
    if a.get("distribute_saved_activations") and tp == 1:  # MT19 arguments.py:1370-1372
        raise SpecError("parallel.tp", "distribute_saved_activations needs "
                        "tensor_model_parallel_size > 1", tp)
    if a.get("tp_comm_overlap") and not a["sequence_parallel"]:  # MT19 arguments.py:1401-1402
        raise SpecError("parallel.sequence_parallel", "tp_comm_overlap needs sequence "
                        "parallelism (and TP > 1)", a["sequence_parallel"])
    if a.get("overlap_param_gather_with_optimizer_step") and vpp is None:  # MT19 :1032-1038
        raise SpecError("parallel.vpp", "overlap_param_gather_with_optimizer_step needs an "
                        "interleaved (virtual) pipeline", vpp)
    # The microbatch calculator divides the global batch by micro batch x DP (M19
    # num_microbatches_calculator.py:367-388); validate_args the eval batch (MT19 :694-697).
    micro = a.get("micro_batch_size")
    for batch, mbs in (("global_batch_size", micro), ("eval_global_batch_size",
                                                       a.get("eval_micro_batch_size", micro))):
        gbs = a.get(batch)
        fixed = batch != "global_batch_size" or not (
            a.get("rampup_batch_size") or a.get("decrease_batch_size_if_needed")
            or a.get("step_batch_size_schedule"))
        if fixed and isinstance(gbs, int) and isinstance(mbs, int) and mbs > 0 and (
                gbs % (mbs * dp)):
            raise SpecError(batch, f"must be a multiple of micro batch size {mbs} x the "
                            f"layout's data_parallel_size {dp}", gbs)


def _check_same_model(a: dict[str, Any], spec: LayoutSpec) -> None:
    """The job (read in its own layout) must be ``spec``'s model: named by the first field
    that differs, before the new layout's rules would complain about a symptom of it."""
    w = a.get("world_size")
    world = (w, w) if isinstance(w, int) and w > 0 else spec.world.model_dump(exclude_none=True)
    job = read_megatron(a, world, megatron_core=spec.megatron_core).spec.model
    mine, theirs = _model(spec.model), _model(job)
    for field in mine:
        if mine[field] != theirs[field]:
            raise SpecError(f"model.{field}", f"differs from the job's ({theirs[field]!r}): a "
                            "layout switch keeps the job's model", mine[field])


def _check_round_trip(a: dict[str, Any], spec: LayoutSpec) -> None:
    """The job's updated args must read back as ``spec``: else the job is not ``spec``."""
    world = spec.world.model_dump(exclude_none=True)
    got = read_megatron(a, world, megatron_core=spec.megatron_core).spec
    for section, mine, theirs in (("model", _model(spec.model), _model(got.model)),
                                  ("parallel", _parallel(spec), _parallel(got)),
                                  ("state", spec.state.model_dump(exclude={"derive_param"}),
                                   got.state.model_dump(exclude={"derive_param"}))):
        why = ("Megatron-LM's args cannot give it" if section == "parallel"
               else "a layout switch keeps the job's model and dtypes")
        for field in mine:
            if mine[field] != theirs[field]:
                raise SpecError(f"{section}.{field}", f"differs from what the job's args give "
                                f"({theirs[field]!r}): {why}", mine[field])


def _model(m: ModelConfig) -> dict[str, Any]:
    """The model with Megatron's defaults filled in (None and the derived value are one)."""
    doc = m.model_dump(exclude={"moe_layer_freq", "moe_first_dense_layers"})
    doc.update(ffn_hidden_size=m.ffn, kv_channels=m.head_dim, num_query_groups=m.groups,
               moe_ffn_hidden_size=m.moe_ffn if m.num_moe_experts else None,
               moe_pattern=m.moe_pattern())
    return doc


def _parallel(spec: LayoutSpec) -> dict[str, Any]:
    """The parallel config with its defaults resolved as the layout uses them."""
    p, layout = spec.parallel, Layout(spec)
    doc = p.model_dump()
    doc.update(etp=p.expert_tp, vpp=p.vpp if p.vpp != 1 else None,
               sequence_parallel=p.sequence_parallel and p.tp > 1,
               bucket_size=(p.bucket_size or max(40_000_000, 1_000_000 * layout.dp))
               if p.overlap_grad_reduce else None)
    return doc
