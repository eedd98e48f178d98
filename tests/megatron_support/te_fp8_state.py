"""fp8 delayed-scaling state of real (stand-in TE) training jobs against the IR.

``te_fp8_state(cfgs)`` runs, in one child interpreter with the TE stand-in on its path (as
``te_live``), each job of ``cfgs`` on forked gloo workers: build it with megatron-core's TE
spec, train two iterations with fp8 delayed scaling, then read every rank's state through the
bridge (``extract_state``). The bridge binds each fp8 tensor the IR names to the TE module that
holds it and refuses a module with delayed-scaling state the IR lacks, so a successful read is
the module-by-module parity of the IR's fp8 state; each rank returns its fp8 values keyed by
logical tensor and box, so the caller can check that every replica holds the same bits, as
megatron's amax reduction makes them and as the IR's replicated placement claims.
"""

from __future__ import annotations

import json
import sys

from .te import STANDIN, run_child

__all__ = ["te_fp8_state"]


def te_fp8_state(cfgs: list[dict], timeout: float = 600.0) -> list[list[dict]]:
    """Per job, per rank: ``{"values": {id: list}, "initial": bool, "modules": int}``."""
    return run_child("megatron_support.te_fp8_state", {"cfgs": cfgs}, timeout, "TE fp8 state")


def _run(cfg: dict) -> list[dict]:
    from te_cases import to_te_spec

    from dynatrain.ir.layout import Layout
    from dynatrain.ir.state import view_of
    from dynatrain.runtime.megatron.bridge import extract_state
    from dynatrain.runtime.storage import slot_key
    from megatron_support import live
    from megatron_support.te_live import _harness_cfg

    spec = to_te_spec(cfg)
    layout = Layout(spec)
    view = view_of(layout)
    c = live.resolve(_harness_cfg(cfg))

    def work(rank: int) -> dict:
        live.init_parallel(c)
        job = live.build(c, seed=c["seed"])
        for it in range(2):
            live.train_step(job, it)
        store = extract_state(view, rank, job.ddps, job.optimizer)
        values = {}
        for r in view.regions(rank):
            if r.kind == "buffer" and "._extra_state." in r.key:
                t = store[slot_key(r.kind, r.slot)]
                values[f"{r.key}@{list(r.box.lo)}"] = t.reshape(-1).tolist()
        return {"values": values, "modules": sum(
            hasattr(m, "fp8_meta") and "scaling_fwd" in m.fp8_meta
            for g in job.gpts for m in g.modules())}

    return live.run_workers(work, layout.world, timeout=240)


def _main(src: str, dst: str) -> None:
    if sys.path[0] != STANDIN:
        sys.path.insert(0, STANDIN)
    import transformer_engine  # noqa: F401  (the stand-in, before megatron)

    with open(src) as f:
        req = json.load(f)
    with open(dst, "w") as f:
        json.dump([_run(cfg) for cfg in req["cfgs"]], f)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
