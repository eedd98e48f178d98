"""Hostile input to ``dynatrain spec --from-args/--from-hf``: each is refused in one
``SpecError`` line naming the field, never a traceback, hang or unbounded read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynatrain.ir.errors import SpecError
from dynatrain.ir.from_job import read_megatron
from dynatrain.ir.hf_config import MAX_CONFIG_BYTES, model_from_hf_config, read_json_object

ROOT = Path(__file__).resolve().parents[1]

# A tiny TP2 job on 4 GPUs (the audit's args_ok.json).
ARGS = dict(
    num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=8,
    num_query_groups=4, group_query_attention=True, padded_vocab_size=1024, vocab_size=1000,
    make_vocab_size_divisible_by=64, max_position_embeddings=256, swiglu=True,
    normalization="RMSNorm", position_embedding_type="rope",
    untie_embeddings_and_output_weights=True, tensor_model_parallel_size=2,
    pipeline_model_parallel_size=1, world_size=4, use_distributed_optimizer=True, bf16=True,
    transformer_impl="local",
)
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1000,
}


# ---- 1. a parallel size given as null ----

@pytest.mark.parametrize("arg", ["tensor_model_parallel_size", "pipeline_model_parallel_size",
                                 "context_parallel_size", "expert_model_parallel_size"])
def test_a_null_parallel_size_is_refused_naming_it(arg) -> None:
    # Megatron-LM has no None for these (validate_args multiplies them); tp=None was a
    # KeyError ('etp') and pp=None silently became PP 1.
    with pytest.raises(SpecError) as err:
        read_megatron({**ARGS, arg: None}, {"nodes": 1, "gpus_per_node": 4})
    assert str(err.value) == (f"{arg}: must be a positive integer, not null (Megatron-LM's "
                              "default is 1)")


def test_a_null_expert_tensor_parallel_size_means_tp() -> None:
    # validate_args sets ETP = TP when it is None: the spec's default says the same.
    world = {"nodes": 1, "gpus_per_node": 4}
    spec = read_megatron({**ARGS, "expert_tensor_parallel_size": None}, world).spec
    assert spec.parallel == read_megatron(ARGS, world).spec.parallel


# ---- 2. architectures / model_type that are not strings ----

@pytest.mark.parametrize("archs", [[[1]], [{}], [None], "LlamaForCausalLM", {}, 5, [1, 2]])
def test_architectures_must_be_a_list_of_strings(archs) -> None:
    with pytest.raises(SpecError) as err:
        model_from_hf_config({**LLAMA, "architectures": archs})
    assert str(err.value).startswith("config.architectures: must be a list of class names "
                                     'such as ["LlamaForCausalLM"] (got ')


@pytest.mark.parametrize("model_type", [[1], {}, ["llama"], 5, True])
def test_model_type_must_be_a_string(model_type) -> None:
    cfg = {k: v for k, v in LLAMA.items() if k != "architectures"}
    with pytest.raises(SpecError) as err:
        model_from_hf_config({**cfg, "model_type": model_type})
    assert str(err.value).startswith("config.model_type: must be a string such as llama (got ")


def test_no_architectures_and_no_model_type_is_refused() -> None:
    cfg = {k: v for k, v in LLAMA.items() if k not in ("architectures", "model_type")}
    with pytest.raises(SpecError, match=r"^config\.architectures: is required \(or "
                                        r"model_type\); known: LlamaForCausalLM"):
        model_from_hf_config(cfg)


def test_model_type_alone_still_names_the_architecture() -> None:
    cfg = {k: v for k, v in LLAMA.items() if k != "architectures"}
    assert model_from_hf_config(cfg) == model_from_hf_config(LLAMA)


# ---- 3. reading the file: bounded, never waiting on a pipe ----

def test_a_config_file_is_read_as_its_json_object(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA), encoding="utf-8")
    assert read_json_object(path, "config keys") == LLAMA


def test_dev_zero_is_refused_after_the_cap() -> None:
    with pytest.raises(SpecError) as err:
        read_json_object("/dev/zero", "argument names")
    assert str(err.value) == ("/dev/zero: must be at most 16 MiB (a config or argument dump "
                              "is a few KiB)")


def test_a_file_over_the_cap_is_refused(tmp_path) -> None:
    path = tmp_path / "big.json"
    with open(path, "wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)  # sparse: no disk, no time
    with pytest.raises(SpecError, match="must be at most 16 MiB"):
        read_json_object(path, "config keys")


def test_a_named_pipe_nobody_writes_is_not_waited_on(tmp_path) -> None:
    # Opening a FIFO blocks until a writer comes; read_bounded opens it without blocking, so
    # it reads as empty. In a subprocess: a regression hangs and the timeout fails the test.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = ("from dynatrain.ir.hf_config import read_json_object\n"
            "from dynatrain.ir.errors import SpecError\n"
            f"try: read_json_object({str(fifo)!r}, 'argument names')\n"
            "except SpecError as err: print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.stdout.startswith(f"{fifo}: not JSON ("), out.stderr


@pytest.mark.parametrize("data, words", [
    (b"", "not JSON ("),
    (b"{", "not JSON ("),
    (b"\xff\xfe{}", "not UTF-8 (byte 0)"),
    (b"[" * 100_000, "not JSON ("),  # nested past the parser's recursion limit
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (b"[1, 2]", "must be a JSON object of argument names (got list)"),
])
def test_malformed_files_are_refused_in_one_line(tmp_path, data, words) -> None:
    path = tmp_path / "args.json"
    path.write_bytes(data)
    with pytest.raises(SpecError) as err:
        read_json_object(path, "argument names")
    line = str(err.value)
    assert line.startswith(f"{path}: {words}") and "\n" not in line


@pytest.mark.parametrize("make", ["missing", "directory"])
def test_unreadable_paths_are_refused(tmp_path, make) -> None:
    path = tmp_path / "x.json"
    if make == "directory":
        path.mkdir()
    with pytest.raises(SpecError, match=r"x\.json: cannot read \("):
        read_json_object(path, "argument names")
