"""Megatron-LM's own ``args`` read into specs; ``layout_args``, the values a switch sets on them.

Each case runs Megatron-LM 0.19.2's ``parse_args`` over a command line and ``validate_args``,
as a job's start does, then builds its tokenizer (which sets ``padded_vocab_size``) and sets
the values Megatron-LM's training loop sets while it runs: the live ``args`` a switch driver
inside the loop reads. The name lists are checked against the installed parser and every
``args.X = ...`` in the installed megatron/training, and against core_v0.16.1's names
(tests/fixtures/megatron_lm, made from that tag's source).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import itertools
import os
import sys
import warnings
from argparse import Namespace
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

from dynatrain.ir import versions
from dynatrain.ir.errors import SpecError
from dynatrain.ir.from_job import (
    IGNORED, MAPPED, UNSUPPORTED, UnknownArgumentsWarning, read_megatron, spec_from_megatron,
)
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.model import padded_vocab
from dynatrain.ir.spec import ModelConfig

HAS_LM = importlib.util.find_spec("megatron.training") is not None
needs_lm = pytest.mark.skipif(not HAS_LM, reason="megatron-core 0.16.1's wheel has no "
                              "megatron.training")
KNOWN = MAPPED | UNSUPPORTED.keys() | IGNORED
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "megatron_lm" / "core_v0.16.1_args.txt"

RUN = ("--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 16 "
       "--tokenizer-type NullTokenizer --vocab-size 128")
DENSE = ("--num-layers 8 --hidden-size 128 --num-attention-heads 8 --group-query-attention "
         "--num-query-groups 4 --swiglu --normalization RMSNorm --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --disable-bias-linear --bf16 "
         "--use-distributed-optimizer " + RUN)
MOE = DENSE + " --num-experts 4 --moe-ffn-hidden-size 64 --moe-grouped-gemm"
BARE = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 " + RUN  # Megatron's defaults

# The specs these jobs are. validate_args derives ffn_hidden_size for SwiGLU,
# int(4 * 128 * 2/3 / 64) * 64 = 320, and 4 * 64 = 256 without; kv_channels = hidden / heads
# (MT19 arguments.py:1283-1293). NullTokenizer's 128 tokens are exactly --vocab-size in 0.19.
DENSE_MODEL = dict(num_layers=8, hidden_size=128, num_attention_heads=8, ffn_hidden_size=320,
                   num_query_groups=4, kv_channels=16, vocab_size=128, max_position_embeddings=64,
                   position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                   untie_embeddings_and_output_weights=True, add_bias_linear=False,
                   transformer_impl="transformer_engine")
MOE_MODEL = dict(DENSE_MODEL, num_moe_experts=4, moe_ffn_hidden_size=64, moe_grouped_gemm=True)
BARE_MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                  kv_channels=16, vocab_size=128, max_position_embeddings=64,
                  position_embedding_type="learned_absolute", normalization="LayerNorm",
                  add_bias_linear=True, transformer_impl="transformer_engine")
BF16 = dict(param="bf16", main_param="fp32")
DIST = dict(use_distributed_optimizer=True)

# name: (command line, model, parallel, state); every job runs on 4 GPUs (one node).
CASES = {
    "tp2-dp2": (DENSE + " --tensor-model-parallel-size 2 --sequence-parallel", DENSE_MODEL,
                dict(DIST, tp=2, sequence_parallel=True), BF16),
    "pp2-vpp2-dp2": (DENSE + " --pipeline-model-parallel-size 2 "
                     "--num-layers-per-virtual-pipeline-stage 2", DENSE_MODEL,
                     dict(DIST, pp=2, vpp=2), BF16),
    "cp2-dp2": (DENSE + " --context-parallel-size 2", DENSE_MODEL, dict(DIST, cp=2), BF16),
    "dp4": (DENSE, DENSE_MODEL, DIST, BF16),
    "dp4-defaults": (BARE, BARE_MODEL, dict(use_distributed_optimizer=False),
                     dict(param="fp32", main_param=None)),
    "moe-tp2-ep2-etp1": (MOE + " --tensor-model-parallel-size 2 --expert-model-parallel-size 2 "
                         "--expert-tensor-parallel-size 1", MOE_MODEL,
                         dict(DIST, tp=2, ep=2, etp=1), BF16),
    "moe-ep4-etp1": (MOE + " --expert-model-parallel-size 4", MOE_MODEL, dict(DIST, ep=4), BF16),
    # ETP defaults to TP (MT19 arguments.py:569-570): TP2 x EP2 experts, EDP 1.
    "moe-tp2-ep2": (MOE + " --tensor-model-parallel-size 2 --expert-model-parallel-size 2 "
                    "--sequence-parallel", MOE_MODEL,
                    dict(DIST, tp=2, ep=2, sequence_parallel=True), BF16),
}
WORLD = 4


def _expected(case: str):
    _, model, parallel, state = CASES[case]
    return spec_from_dict({"model": model, "parallel": parallel, "state": state,
                           "world": {"nodes": 1, "gpus_per_node": WORLD},
                           "megatron_core": versions.installed()})


@cache
def _validated(argv: str, world: int) -> Namespace:
    """parse_args + validate_args, as a job's start runs them, on this CPU-only machine.

    validate_args asks for the GPU's architecture when TP or CP > 1 (MT19 arguments.py:
    1413-1414 via utils/common_utils.py:502-504) and for its compute capability with
    --moe-grouped-gemm (:1338-1340); here those two answer an H100's (9, 0), which only
    selects warnings and stream priorities. CUDA_DEVICE_MAX_CONNECTIONS=1 is what it
    requires of TP/CP jobs before Blackwell (:1436-1438).
    """
    from megatron.training import arguments

    env = {"WORLD_SIZE": str(world), "RANK": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    h100 = SimpleNamespace(major=9, minor=0)
    with mock.patch.dict(os.environ, env), \
            mock.patch.object(sys, "argv", ["pretrain_gpt.py", *argv.split()]), \
            mock.patch("torch.cuda.get_device_properties", lambda *a, **k: h100), \
            mock.patch("torch.cuda.get_device_capability", lambda *a, **k: (9, 0)), \
            contextlib.redirect_stdout(io.StringIO()):
        args = arguments.parse_args()
        arguments.validate_args(args)
    return args


def _live(case: str) -> tuple[Namespace, int]:
    """A fresh copy of the case's args as a running job holds them, and the tokenizer's
    vocabulary size."""
    from megatron.core.enums import ModelType
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    args = Namespace(**vars(_validated(CASES[case][0], WORLD)))
    with contextlib.redirect_stdout(io.StringIO()):
        tokenizer = build_tokenizer(args)  # sets padded_vocab_size (build_tokenizer.py:140-143)
    # What Megatron-LM's loop sets (MT19 training.py:1709, 1421, 2170-2226, 4595-4597).
    args.model_type = ModelType.encoder_or_decoder
    args.iteration = args.curr_iteration = 12
    args.num_floating_point_operations_so_far = 3.5e15
    args.do_train, args.do_valid, args.do_test = 1, 1, 0
    args.consumed_train_samples = 12 * args.global_batch_size
    return args, tokenizer.vocab_size


def _read(args, world=(WORLD, WORLD)):
    """spec_from_megatron with unknown names an error, not a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownArgumentsWarning)
        return spec_from_megatron(args, world)


def _unnamed(spec):
    return spec.model_copy(update={"name": None})


def _args_assigned(root: Path) -> dict[str, str]:
    """Every ``args.X = ...`` (and ``setattr(args, "X", ...)``) under ``root``: name -> where."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "args":
                        found.setdefault(t.attr, f"{path.relative_to(root)}:{node.lineno}")
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
                    and node.args and getattr(node.args[0], "id", None) == "args"
                    and isinstance(node.args[1], ast.Constant)):
                found.setdefault(node.args[1].value, f"{path.relative_to(root)}:{node.lineno}")
    return found


@needs_lm
def test_every_name_of_the_installed_megatron_lm_is_classified() -> None:
    """Each argument of the installed parser and each value its training code sets on args
    is read, refused by name or deliberately ignored: none is unknown."""
    import megatron.training
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    dests = {a.dest for a in parser._actions} - {"help"}
    assigned = _args_assigned(Path(megatron.training.__file__).parent)
    assert len(dests) > 700 and {"do_train", "iteration", "model_type"} <= assigned.keys()
    assert sorted(dests - KNOWN) == []
    assert {k: v for k, v in assigned.items() if k not in KNOWN} == {}


def test_core_v0_16_1_names_are_classified() -> None:
    lines = FIXTURE.read_text(encoding="utf-8").splitlines()
    names = [n for n in lines if n and not n.startswith(("#", "["))]
    assert len(names) > 650 and "num_floating_point_operations_so_far" in names
    assert [n for n in names if n not in KNOWN] == []


def test_earlier_names_and_fsdp_only_values_are_known() -> None:
    """norm_epsilon (Megatron-LM's name until 0.16) and 0.19's default FSDP sharding read
    without a word; the FSDP switches themselves stay refused."""
    args = dict(DENSE_MODEL, vocab_size=128, norm_epsilon=1e-6, apply_layernorm_1p=True,
                data_parallel_sharding_strategy="optim_grads_params", iteration=3, do_train=1)
    job = read_megatron(args, (4, 4))
    assert job.unknown == () and job.spec.parallel.tp == 1
    with pytest.raises(SpecError) as err:
        read_megatron({**args, "use_megatron_fsdp": True}, (4, 4))
    assert str(err.value) == ("use_megatron_fsdp: is not supported by DynaTrain yet (Megatron "
                              "FSDP) (got True)")


@needs_lm
@pytest.mark.parametrize("case", sorted(CASES))
def test_live_args_give_the_expected_spec(case: str) -> None:
    args, tokenizer_vocab = _live(case)
    assert args.data_parallel_sharding_strategy == "optim_grads_params"  # 0.19's default
    spec = _read(args)
    assert _unnamed(spec) == _unnamed(_expected(case))
    assert spec.parallel.sequence_parallel is args.sequence_parallel
    # NullTokenizer: exactly --vocab-size tokens, padded as Megatron-LM padded them.
    assert spec.model.vocab_size == tokenizer_vocab == 128
    tp = args.tensor_model_parallel_size
    assert Layout(spec).padded_vocab == args.padded_vocab_size == 128 * tp
    # Before the tokenizer is built (no padded_vocab_size yet): the same spec.
    assert _read(Namespace(**{**vars(args), "padded_vocab_size": None})) == spec


@needs_lm
def test_norm_epsilon_and_sequence_parallel_from_the_command_line() -> None:
    args = _validated(DENSE + " --tensor-model-parallel-size 2 --norm-epsilon 1e-6", WORLD)
    assert (args.layernorm_epsilon, args.sequence_parallel) == (1e-6, False)
    assert _read(args).parallel.sequence_parallel is False
    tp1 = _validated(DENSE + " --sequence-parallel", WORLD)  # validate_args turns it off at TP 1
    assert tp1.sequence_parallel is False and _read(tp1).parallel.sequence_parallel is False


def _pairs() -> list[tuple[str, str]]:
    groups: dict[str, list[str]] = {}
    for name, (_, model, _, _) in CASES.items():
        groups.setdefault(repr(sorted(model.items())), []).append(name)
    return [pair for names in groups.values() for pair in itertools.permutations(names, 2)]


# Where layout_args and validate_args give the same VPP by another argument.
_VPP_SOURCES = {"num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"}


@needs_lm
@pytest.mark.parametrize("src, dst", _pairs())
def test_layout_args_round_trip_and_match_validate_args(src: str, dst: str) -> None:
    """The args of job X updated with layout_args(X, Y) read back as Y; and each value is the
    one Megatron-LM's validate_args (and tokenizer) gave a job started in layout Y."""
    from dynatrain.runtime.megatron.lm_args import layout_args

    args, _ = _live(src)
    want = _expected(dst)
    new = layout_args(args, want)
    for name, value in new.items():
        setattr(args, name, value)
    world = want.world.model_dump(exclude_none=True)
    assert _unnamed(_read(args, world)) == _unnamed(want)
    started, _ = _live(dst)
    assert {k: getattr(started, k) for k in new.keys() - _VPP_SOURCES} == {
        k: v for k, v in new.items() if k not in _VPP_SOURCES}
    assert len(new.keys() - _VPP_SOURCES) >= 25


@needs_lm
def test_stale_generalized_tp_counts_are_rederived() -> None:
    """validate_args resolved the TP2 job's shard count to 2; TP1 with that stale count reads
    as generalized TP (refused). layout_args sets the counts for the new TP."""
    from dynatrain.runtime.megatron.lm_args import layout_args

    args, _ = _live("tp2-dp2")
    assert (args.tensor_parallel_num_weight_shards, args.gtp_weight_remat_size) == (2, 1)
    sizes_only = Namespace(**{**vars(args), "tensor_model_parallel_size": 1,
                              "data_parallel_size": 4, "sequence_parallel": False,
                              "expert_tensor_parallel_size": 1, "padded_vocab_size": 128})
    with pytest.raises(SpecError) as err:
        _read(sizes_only)
    assert str(err.value).startswith("tensor_parallel_num_weight_shards: is not supported by "
                                     "DynaTrain yet (generalized tensor parallelism")
    new = layout_args(args, _expected("dp4"))
    assert {k: new[k] for k in ("tensor_parallel_num_weight_shards", "gtp_weight_remat_size",
                                "expert_tensor_parallel_num_weight_shards",
                                "expert_gtp_weight_remat_size")} == {
        "tensor_parallel_num_weight_shards": 1, "gtp_weight_remat_size": 1,
        "expert_tensor_parallel_num_weight_shards": 1, "expert_gtp_weight_remat_size": 1}


@needs_lm
def test_layout_args_refusals_name_the_field() -> None:
    from dynatrain.runtime.megatron.lm_args import layout_args

    dense, _ = _live("tp2-dp2")
    want = _expected("dp4")
    cases = [
        (dense, _expected("moe-ep4-etp1"), "model.num_moe_experts: differs from the job's "
         "(None): a layout switch keeps the job's model (got 4)"),
        (dense, want.model_copy(update={"state": want.state.model_copy(update={
            "exp_avg": "bf16"})}), "state.exp_avg: differs from what the job's args give "
         "('fp32'): a layout switch keeps the job's model and dtypes (got 'bf16')"),
        (dense, want.model_copy(update={"parallel": want.parallel.model_copy(
            update={"order": "tp-dp-cp-ep-pp"})}), "parallel.order: Megatron-LM's args give "
         "only tp-cp-ep-dp-pp or tp-cp-ep-pp-dp (use_tp_pp_dp_mapping) (got 'tp-dp-cp-ep-pp')"),
        (Namespace(**{**vars(dense), "global_batch_size": 18}), _expected("dp4"),
         "global_batch_size: must be a multiple of micro batch size 1 x the layout's "
         "data_parallel_size 4 (got 18)"),
        (Namespace(**{**vars(_live("cp2-dp2")[0]), "hierarchical_context_parallel_sizes": [2]}),
         want, "hierarchical_context_parallel_sizes: must multiply to context_parallel_size=1; "
         "give the sizes for the new CP (got [2])"),
        # The job chose no P2P overlap for its interleaved schedule: PP 2 cannot interleave.
        (Namespace(**{**vars(_live("pp2-vpp2-dp2")[0]), "overlap_p2p_comm": False}),
         _expected("pp2-vpp2-dp2"), "parallel.vpp: Megatron-LM's interleaved schedule needs "
         "pipeline_model_parallel_size > 2 while the job has overlap_p2p_comm off (MT19 "
         "arguments.py:966-975) (got 2)"),
    ]
    for args, spec, message in cases:
        try:
            layout_args(args, spec)
        except SpecError as err:
            assert str(err) == message
        else:
            pytest.fail(f"not refused: {message}")


@needs_lm
def test_padded_vocab_size_is_megatrons_and_the_irs() -> None:
    """layout_args pads with Megatron's own function; the IR's padded_vocab agrees with it."""
    from dynatrain.runtime.megatron.lm_args import padded_vocab_size

    for vocab, m, tp in itertools.product((1, 127, 128, 129, 50257, 151936), (1, 64, 128),
                                          (1, 2, 4, 8)):
        model = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                            vocab_size=vocab, make_vocab_size_divisible_by=m)
        got = padded_vocab_size(vocab, m, tp)
        assert got == padded_vocab(model, tp) and got % (m * tp) == 0 and 0 <= got - vocab < m * tp


@needs_lm
def test_sequence_parallel_is_off_at_tp1_as_validate_args_turns_it() -> None:
    from dynatrain.runtime.megatron.lm_args import layout_args

    want = _expected("dp4")
    sp = want.model_copy(update={"parallel": want.parallel.model_copy(
        update={"sequence_parallel": True})})
    args, _ = _live("tp2-dp2")
    assert args.sequence_parallel is True
    new = layout_args(args, sp)
    assert new["sequence_parallel"] is False
    started = _validated(DENSE + " --sequence-parallel", WORLD)
    assert new["sequence_parallel"] is started.sequence_parallel


@needs_lm
def test_a_job_without_vocab_size_gets_its_vocabulary_named() -> None:
    """A tokenizer that is not NullTokenizer leaves vocab_size unset: the import takes the
    padded rows (128 at TP 1) as the vocabulary. At TP 2 Megatron pads them to 256; the args
    then name the 128, so that they read back as the same model and not a 256-token one."""
    from dynatrain.runtime.megatron.lm_args import layout_args

    args, _ = _live("dp4")
    args.vocab_size, args.tokenizer_type = None, "HuggingFaceTokenizer"
    job = read_megatron(args, (WORLD, WORLD))
    assert job.spec.model.vocab_size == 128 and job.notes[0].startswith("vocab_size: unknown")
    want = _expected("tp2-dp2")
    new = layout_args(args, want)
    assert (new["padded_vocab_size"], new["vocab_size"]) == (256, 128)
    for name, value in new.items():
        setattr(args, name, value)
    assert _unnamed(_read(args)) == _unnamed(want)
    args.vocab_size = None  # without it, the 256 rows would read as the vocabulary
    assert _read(args).model.vocab_size == 256
