"""``check_job``: a running megatron-core job against the IR's layout, before a live switch.

In forked gloo workers (``megatron_support.live``) a real job (TP 2 x DP 2, GQA, SwiGLU, the
distributed optimizer, one DDP bucket per buffer as megatron builds it without overlap) is built
on CPU. On every rank:

* its own spec passes, and the check compares something (ShardedTensors, DDP buffer params,
  optimizer ranges), in a time that is printed;
* specs that describe another job are refused with the first differing parameter named (its
  ``named_parameters`` name and checkpoint key): DDP buckets of 4000 elements (the job has one
  bucket: the buffer ranges differ), 1 KV group (the job has 2: the checkpoint shapes differ),
  vocab padded to a multiple of 96 x TP (the job pads to 16 x TP);
* a spec of another megatron-core series is refused in one line naming ``megatron_core``;
* a ``LiveSwitcher`` whose source spec says 4000-element buckets refuses ``switch`` with
  ``SwitchFailed`` (caused by the check's ``LayoutError``) on every process; its ``job`` is the
  job passed, bit for bit unchanged (megatron's own view of model, buffers and optimizer).
"""

from __future__ import annotations

import time

import pytest

from dynatrain.ir.errors import EXIT_BAD_INPUT, LayoutError, SpecError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from matrix import case, to_harness_cfg, to_spec, to_spec_dict

live = pytest.importorskip("megatron_support.live")

CFG = case("job", 4, tp=2, num_query_groups=2, swiglu=True, vocab_size=256)
DST = case("dst", 4, pp=2, num_query_groups=2, swiglu=True, vocab_size=256)
WRONG = {  # what the spec says that the job does not do, and what the refusal must name
    "bucket_size": (dict(bucket_size=4000), "DDP buffer"),
    "num_query_groups": (dict(num_query_groups=1), "linear_qkv.weight"),
    "vocab_padding": (dict(make_vocab_size_divisible_by=96), "word_embeddings.weight"),
}


def _other_series(spec) -> str:
    return "0.19.2" if spec.megatron_core.startswith("0.16") else "0.16.1"


def test_check_job_passes_refuses_and_keeps_the_job() -> None:
    from dynatrain.runtime.megatron import LiveSwitcher, MegatronJob, SwitchFailed
    from dynatrain.runtime.megatron.check_job import check_job
    from dynatrain.verify.check import check

    spec = to_spec(CFG)
    layout = Layout(spec)
    wrong = {k: Layout(to_spec(dict(CFG, **kw))) for k, (kw, _) in WRONG.items()}
    doc = to_spec_dict(CFG)
    doc["megatron_core"] = _other_series(spec)
    other_version = Layout(spec_from_dict(doc))
    bad_src = to_spec(dict(CFG, **WRONG["bucket_size"][0]))
    dst = to_spec(DST)
    c = live.resolve(to_harness_cfg(CFG))

    def work(rank: int) -> dict:
        live.init_parallel(c)
        j = live.build(c)
        out: dict = {}
        check_job(layout, rank, j.ddps, j.optimizer)  # warm: imports, lazy megatron state
        t0 = time.perf_counter()
        out["counts"] = check_job(layout, rank, j.ddps, j.optimizer)
        out["seconds"] = time.perf_counter() - t0
        for name, lay in wrong.items():
            try:
                check_job(lay, rank, j.ddps, j.optimizer)
                out[name] = None
            except LayoutError as e:
                out[name] = str(e)
        try:
            check_job(other_version, rank, j.ddps, j.optimizer)
            out["version"] = None
        except SpecError as e:
            out["version"] = (e.field, e.exit_code, str(e))

        def build(s) -> MegatronJob:  # never reached: the check refuses first
            raise AssertionError("the destination was built")

        job = MegatronJob(j.ddps, j.optimizer)
        before = live.native_state(j)
        sw = LiveSwitcher(bad_src, Layout(bad_src).devices[rank], build, check, timeout=60)
        sw.prepare(dst).result()
        try:
            sw.switch(job)
            out["switch"] = None
        except SwitchFailed as e:
            out["switch"] = (type(e.__cause__).__name__, str(e), e.job is job)
        out["untouched"] = live.native_diffs(before, live.native_state(j))
        return out

    results = live.run_workers(work, layout.world)
    for rank, res in enumerate(results):
        counts = res["counts"]
        assert counts["sharded_tensors"] > 0 and counts["buffer_params"] > 0, counts
        assert counts["optimizer_ranges"] > 0, counts
        print(f"rank {rank}: check_job {res['seconds'] * 1e3:.1f} ms ({counts})")
        for name, (_, must_name) in WRONG.items():
            msg = res[name]
            if rank == 0:
                print(f"  {name}: {msg}")
            assert msg and must_name in msg and "\n" not in msg, (name, msg)
            assert "the IR says" in msg and "the job" in msg, (name, msg)
        field, code, msg = res["version"]
        assert field == "megatron_core" and code == EXIT_BAD_INPUT and "\n" not in msg, msg
        assert msg.startswith("megatron_core: "), msg
        cause, msg, same = res["switch"]
        assert cause == "LayoutError" and same, res["switch"]
        assert "DDP buffer" in msg and "the job is untouched" in msg, msg
        assert res["untouched"] == [], res["untouched"][:5]
