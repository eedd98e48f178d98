"""megatron-core's Transformer Engine specs, built on CPU over the TE stand-in (``tests/te_standin``).

``te_facts(cases)`` returns, for each ``(cfg, world_size)``, the harness's per-rank facts
(``harness.megatron_facts``) for ``dict(cfg, transformer_impl="transformer_engine")``, or
``{"error": "Type: message"}`` when megatron rejects the config. The builds run in one child
interpreter that puts the stand-in on ``sys.path`` before megatron is imported, so megatron
sees TE installed everywhere (its ``HAVE_TE`` flags are import-time), while the test process
itself, and the local-spec tests in it, keep seeing "TE not installed". Each case still forks
its own ``world_size`` gloo workers from that child (the harness's unit of work).

The child also registers the probe ``te_objects`` (always the first probe): ``objects``, every
ShardedObject of each chunk's ``sharded_state_dict()`` (TE's ``_extra_state`` entries) with its
key, global shape/offset, replica id, the dict key it sits under and its data's dtype and size;
and ``reload``, what a save/load round trip of the state dict changes in TE modules' extra
state and fp8 metadata. And ``te_bridge`` (on request, after ``train_step``): the Megatron
bridge's extract/install on the TE job against megatron's own sharded state dicts.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
STANDIN = os.path.join(TESTS, "te_standin")


_MEMO: dict[str, list] = {}


def te_facts(cases: list[tuple[dict, int]], probes: list | None = None,
             timeout: float = 600.0) -> list:
    """Per case, megatron's facts for its TE build (a list per rank) or ``{"error": ...}``.

    ``probes`` (harness probe requests) are added to every case; ``te_objects`` always is
    first. Results are kept per process: test modules that ask for the same list of cases
    share one child (its startup, importing megatron, is most of a small run's cost).
    """
    key = json.dumps([cases, probes], sort_keys=True)
    if key not in _MEMO:
        _MEMO[key] = _shared(key, lambda: _run_child(cases, probes, timeout))
    return _MEMO[key]


def _shared(key: str, compute):
    """``compute()`` once per test run, also across pytest-xdist's workers (test modules on
    other workers ask for the same cases): the first worker computes under a file lock and
    leaves the JSON result for the others. Outside xdist, just ``compute()``."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return compute()
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    base = os.path.join(tempfile.gettempdir(), f"dynatrain-te-{run}-{digest}")
    with open(base + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.path.exists(base + ".json"):
                with open(base + ".json") as f:
                    return json.load(f)
            out = compute()
            with open(base + ".tmp", "w") as f:
                json.dump(out, f)
            os.replace(base + ".tmp", base + ".json")
            return out
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run_child(cases: list[tuple[dict, int]], probes: list | None, timeout: float) -> list:
    return run_child("megatron_support.te", {"cases": cases, "probes": probes or []}, timeout,
                     "TE harness")


def run_child(module: str, doc: dict, timeout: float, what: str):
    """Run ``python -m module in.json out.json`` with the stand-in TE first on its path (never
    on this process's); ``doc`` goes in as JSON and the child's JSON result comes back."""
    with tempfile.TemporaryDirectory(prefix="te_child_") as tmp:
        src, dst = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(src, "w") as f:
            json.dump(doc, f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [STANDIN, TESTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                if p]))
        proc = subprocess.run([sys.executable, "-W", "ignore", "-m", module, src, dst],
                              env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=TESTS, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{what} child failed ({proc.returncode}):\n"
                               f"{proc.stderr[-4000:]}")
        with open(dst) as f:
            return json.load(f)


def _te_objects(ctx) -> list[dict]:
    """Every ShardedObject (TE ``_extra_state``) of each chunk's sharded state dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    out: list[dict] = []

    def walk(node, chunk: int, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, chunk, k)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v, chunk, path)
        elif isinstance(node, ShardedObject):
            data = node.data
            rid = node.replica_id
            out.append({
                "chunk": chunk, "key": node.key, "dict_key": path,
                "global_shape": [int(x) for x in node.global_shape],
                "global_offset": [int(x) for x in node.global_offset],
                "replica_id": [int(x) for x in rid] if isinstance(rid, (tuple, list))
                else [int(rid)],
                "data_dtype": str(getattr(data, "dtype", type(data).__name__)),
                "data_numel": int(data.numel()) if hasattr(data, "numel") else None,
            })

    from megatron_support.harness import sharded_metadata

    md = sharded_metadata(ctx.c)
    for ci, gpt in enumerate(ctx.gpts):
        walk(gpt.sharded_state_dict(metadata=md), ci, "")
    return {"objects": out, "reload": _reload_extra_state(ctx)}


def _reload_extra_state(ctx) -> dict:
    """Megatron's reload of ``_extra_state`` with fp8 off: save every chunk's state dict,
    load it back (torch's ``load_state_dict``, through megatron's grouped-linear merge hook),
    and report whether any TE module's extra state or fp8 metadata changed."""
    import torch
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    from transformer_engine.pytorch.ops import BasicOperation

    modules, changed = 0, []
    for ci, gpt in enumerate(ctx.gpts):
        te_mods = [(n, m) for n, m in gpt.named_modules()
                   if isinstance(m, (TransformerEngineBaseModule, BasicOperation))]
        before = {n: (m.get_extra_state(), dict(getattr(m, "fp8_meta", {}))) for n, m in te_mods}
        gpt.load_state_dict(gpt.state_dict(), strict=True)
        for n, m in te_mods:
            state, meta = m.get_extra_state(), dict(getattr(m, "fp8_meta", {}))
            if not (torch.equal(state, before[n][0]) and state.dtype == before[n][0].dtype
                    and meta == before[n][1]):
                changed.append(f"{ci}:{n}")
        modules += len(te_mods)
    return {"modules": modules, "changed": changed}


def _te_bridge(ctx, spec: dict) -> dict:
    """The Megatron bridge on this rank of a TE job (run after ``train_step``).

    ``extract_state`` must give, region by region and bit for bit, what the IR's storage holds
    when filled from the global tensors megatron itself reports (every rank's model and
    ``fully_reshardable`` optimizer sharded state dicts, gathered over the world: the oracle of
    tests/test_megatron_bridge.py). Then every param, main param and moment is perturbed and
    ``install_state`` of the extracted copy must restore megatron's own view of the state."""
    import torch
    import torch.distributed as dist
    from test_megatron_bridge import _oracle_tensors

    from dynatrain.ir.layout import Layout
    from dynatrain.ir.loader import spec_from_dict
    from dynatrain.ir.state import view_of
    from dynatrain.runtime.megatron import extract_state, install_state
    from dynatrain.runtime.storage import fill_from_global, region
    from megatron_support import live

    view = view_of(Layout(spec_from_dict(spec)))
    rank = dist.get_rank()
    job = live.Job(ctx.c, ctx.gpts, ctx.ddps, ctx.optimizer)
    store = extract_state(view, rank, ctx.ddps, ctx.optimizer)
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, live.sharded_leaves(job))  # test-only, same-process data
    oracle = _oracle_tensors(view, [{"leaves": leaves} for leaves in per_rank])
    expected = fill_from_global(view, rank, oracle)
    bad = [f"{r.kind} {r.key} {r.box}" for r in view.regions(rank)
           if not live.bits_equal(region(store, r.kind, r.slot, r.box),
                                  region(expected, r.kind, r.slot, r.box))]
    copy = {k: v.detach().clone() for k, v in store.items()}
    before = live.native_state(job)
    with torch.no_grad():
        for gpt in ctx.gpts:
            for p in gpt.parameters():
                p.add_(1)
        for opt in getattr(ctx.optimizer, "chained_optimizers", None) or [ctx.optimizer]:
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    p.add_(1)
                    for t in opt.optimizer.state[p].values():
                        if isinstance(t, torch.Tensor) and t.dim() > 0:
                            t.add_(1)
    perturbed = len(live.native_diffs(before, live.native_state(job)))
    install_state(view, rank, ctx.ddps, ctx.optimizer, copy)
    return {"regions": len(view.regions(rank)), "bad": bad[:5], "n_bad": len(bad),
            "perturbed": perturbed,
            "after": live.native_diffs(before, live.native_state(job))[:5]}


def _main(src: str, dst: str) -> None:
    if sys.path[0] != STANDIN:
        sys.path.insert(0, STANDIN)
    import transformer_engine  # noqa: F401  (the stand-in, before megatron)

    from megatron_support import harness, probes

    probes.PROBES["te_objects"] = _te_objects
    probes.PROBES["te_bridge"] = _te_bridge
    with open(src) as f:
        req = json.load(f)
    results = []
    for cfg, world in req["cases"]:
        # GPU initialisation, as training runs it: with use_cpu_initialization megatron's TE
        # wrappers re-create each bias with allreduce=True (M16 extensions/
        # transformer_engine.py:1008-1011, 1109-1112), which moves expert biases into the
        # dense DDP buffer. The shim maps the CUDA device to cpu.
        overrides = {"use_cpu_initialization": False, **(cfg.get("transformer_config_overrides")
                                                          or {})}
        c = dict(cfg, transformer_impl="transformer_engine", transformer_config_overrides=overrides,
                 probes=["te_objects", *req["probes"], *(cfg.get("probes") or [])])
        try:
            results.append(harness.megatron_facts(c, world))
        except harness.MegatronBuildError as e:
            results.append({"error": e.message})
    with open(dst, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
