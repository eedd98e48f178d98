"""Test support for world-changing live switches: processes that come and go, megatron jobs that
keep their global batch across a DP change.

``run_processes(fns, late=...)`` forks one process per entry of ``fns`` at once and one per
entry of ``late`` when its trigger key appears in the shared store (a process started later,
that joins the job through the store: a new rendezvous). No process group is formed for them:
each ``fn(store)`` forms its own through ``dynatrain``'s ``Rendezvous``. Every result is written
with ``torch.save`` and returned by name.

``Trainer`` builds real megatron jobs (``live.build``) for layout specs, as ``MegatronJob``s
with megatron's LR scheduler, and trains them with a **fixed global batch**: each iteration
consumes ``global_batch`` samples; DP rank ``d`` takes samples ``consumed + m * dp + d`` for its
micro-batches ``m < global_batch / dp`` (megatron's pretraining sampler order), each sample
drawn from its own global index only. A DP change therefore changes the micro-batches per rank,
never the samples of an iteration or the averaged gradient (megatron divides each micro-batch
loss by their number and averages gradients over DP).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from dynatrain.runtime.megatron import MegatronJob

from . import live
from dynatrain.runtime.megatron.cpu import cpu_shim

SEQ = live.SEQ


# ---- processes --------------------------------------------------------------------------------


def run_processes(fns: dict[str, Callable[[dist.Store], Any]], *,
                  late: dict[str, tuple[str, Callable[[dist.Store], Any]]] | None = None,
                  timeout: float = 240.0, may_die: tuple[str, ...] = (),
                  started: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Run ``fns[name](store)`` in forked processes, and ``late[name] = (key, fn)`` once ``key``
    is set in the store; return every process's result by name (``may_die``: processes that
    may end killed by SIGKILL, without a result). ``started`` runs once ``fns`` are forked:
    start a test's own threads there (a fork while another thread holds a lock can leave the
    child waiting on it forever)."""
    if dist.is_initialized() or ps.model_parallel_is_initialized():
        raise RuntimeError("run_processes needs a parent without a process group")
    late = dict(late or {})
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="mcore_elastic_") as tmpdir:
        path = os.path.join(tmpdir, "store")
        store = dist.FileStore(path, -1)
        procs: dict[str, Any] = {}

        def start(name: str, fn: Callable) -> None:
            procs[name] = ctx.Process(target=_process, args=(name, fn, path, tmpdir), name=name)
            procs[name].start()

        try:
            for name, fn in fns.items():
                start(name, fn)
            if started is not None:
                started()
            deadline = time.monotonic() + timeout
            while True:
                for name, (key, fn) in list(late.items()):
                    if store.check([f"test/{key}"]):
                        del late[name]
                        start(name, fn)
                # One reading of every exit status: a process that ends between two readings
                # would count as neither killed nor still running.
                codes = {n: p.exitcode for n, p in procs.items()}
                killed = {n for n, c in codes.items() if n in may_die and c == -signal.SIGKILL}
                failed = {n: c for n, c in codes.items() if c not in (None, 0) and n not in killed}
                if failed:
                    raise _error(tmpdir, failed)
                if all(c == 0 or n in killed for n, c in codes.items()):
                    if late:
                        raise RuntimeError(f"never started: {sorted(late)}")
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"processes did not finish within {timeout:.0f} s: "
                                       f"{[n for n, c in codes.items() if c is None]}")
                time.sleep(0.05)
        finally:
            for p in procs.values():
                try:  # the process and what it started (megatron's checkpoint writers)
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.join(timeout=5)
        return {n: torch.load(os.path.join(tmpdir, f"{n}.pt"), weights_only=False)
                for n in procs if n not in killed}


def trigger(store: dist.Store, key: str) -> None:
    """Start the ``late`` process waiting for ``key``."""
    store.set(f"test/{key}", "1")


def _process(name: str, fn: Callable, path: str, tmpdir: str) -> None:
    os.setpgid(0, 0)  # its own process group: the parent ends it with all its children
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out_path = os.path.join(tmpdir, f"{name}.pt")
    try:
        store = dist.FileStore(path, -1)
        with cpu_shim(force=True):
            out = fn(store)
        torch.save(out, out_path + ".tmp")
        os.replace(out_path + ".tmp", out_path)
    except BaseException as e:  # noqa: BLE001 - report, then fail the process
        with open(os.path.join(tmpdir, f"{name}.error.json"), "w") as f:
            json.dump({"message": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()}, f)
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _error(tmpdir: str, codes: dict[str, int]) -> RuntimeError:
    """The first failed process's own report, else each one's exit status (a negative one:
    the signal that ended it)."""
    for n in codes:
        path = os.path.join(tmpdir, f"{n}.error.json")
        if os.path.exists(path):
            with open(path) as f:
                e = json.load(f)
            return RuntimeError(f"{n}: {e['message']}\n{e['traceback']}")
    return RuntimeError(f"processes failed without a report (exit status by process): {codes}")


# ---- jobs with a fixed global batch -----------------------------------------------------------


def megatron_lm_config(cfg: dict) -> dict:
    """A harness config resolved with Megatron-LM's pipeline p2p defaults: with VPP it overlaps
    p2p (``overlap_p2p_comm``) instead of batching it. Batched, PP2's two directions go to one
    peer in one batch and megatron's order swaps activations with gradients: training in
    PP2·VPP2 then diverges from PP2 after the first micro-batches (measured here)."""
    c = live.resolve(cfg)
    if c["vpp"] is not None:
        c["transformer_config_overrides"] = {**(c["transformer_config_overrides"] or {}),
                                             "overlap_p2p_comm": True, "batch_p2p_comm": False}
    return c


def scheduler(optimizer) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=live.LR, min_lr=live.LR / 10, lr_warmup_steps=2,
        lr_decay_steps=20, lr_decay_style="cosine", start_wd=0.01, end_wd=0.05,
        wd_incr_steps=20, wd_incr_style="linear")


@dataclass
class Trainer:
    """Builds and trains jobs for the layout specs it was given (by spec name)."""

    configs: dict[str, dict]  # spec name -> resolved harness config
    global_batch: int
    builds: int = 0

    def build(self, spec) -> MegatronJob:
        """``LiveSwitcher``'s ``build``: a fresh job (other weights each time) + scheduler."""
        self.builds += 1
        c = self.configs[spec.name]
        j = live.build(c, seed=c["seed"] + 7 * self.builds)
        job = MegatronJob(j.ddps, j.optimizer, scheduler(j.optimizer))
        job.cfg = c  # type: ignore[attr-defined]
        return job

    def harness_job(self, job: MegatronJob) -> live.Job:
        return live.Job(job.cfg, [d.module.module for d in job.model_chunks],  # type: ignore
                        job.model_chunks, job.optimizer)

    def micro_batches(self) -> int:
        dp = ps.get_data_parallel_world_size()
        if self.global_batch % dp:
            raise ValueError(f"global batch {self.global_batch} is not a multiple of DP {dp}")
        return self.global_batch // dp

    def _batches(self, job: MegatronJob) -> list[tuple[torch.Tensor, torch.Tensor]]:
        dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        out = []
        for m in range(self.micro_batches()):
            g = torch.Generator().manual_seed(job.consumed_samples + m * dp + d)
            seq = torch.randint(0, job.cfg["vocab_size"], (1, SEQ + 1), generator=g)  # type: ignore
            out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
        return out

    def step(self, job: MegatronJob, forward_only: bool = False) -> dict:
        """One iteration on the next global batch (``forward_only``: its loss, no update).

        Returns this rank's micro-batch losses and, on the last pipeline stage, the global
        batch's mean loss (summed over DP in a fixed order, so every rank sees the same)."""
        batches = self._batches(job)
        nmb = len(batches)
        pos = torch.arange(SEQ).unsqueeze(0)
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)

        def forward_step(data_iterator, model):
            ids, labels = next(data_iterator)
            out = model(ids, pos, mask, labels=labels)

            def loss_func(output):
                loss = output.float().mean()
                # A copy: megatron divides the loss by the micro-batch count in place.
                return loss, {"loss": loss.detach().clone()}

            return out, loss_func

        chunks = len(job.model_chunks)
        data = [iter(batches) for _ in range(chunks)] if chunks > 1 else iter(batches)
        for m in job.model_chunks:
            m.train()
            m.zero_grad_buffer()
        job.optimizer.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=job.model_chunks,
            num_microbatches=nmb, seq_length=SEQ, micro_batch_size=1,
            forward_only=forward_only)
        losses = [float(d["loss"]) for d in out]
        result: dict = {"losses": losses, "micro_batches": nmb, "global_loss": None}
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            mine = torch.tensor([sum(losses)], dtype=torch.float64)
            got = [torch.zeros_like(mine) for _ in range(ps.get_data_parallel_world_size())]
            dist.all_gather(got, mine, group=ps.get_data_parallel_group())
            result["global_loss"] = sum(float(g) for g in got) / self.global_batch
        if not forward_only:
            ok, _, _ = job.optimizer.step()
            assert ok, "optimizer step failed"
            job.scheduler.step(increment=1)
            job.iteration += 1
            job.consumed_samples += self.global_batch
        return result

    def state(self, job: MegatronJob) -> dict:
        """megatron's own view of everything the rank holds, plus lr/wd of every group."""
        out = live.native_state(self.harness_job(job))
        opts = getattr(job.optimizer, "chained_optimizers", None) or [job.optimizer]
        for i, opt in enumerate(opts):
            for g, group in enumerate(opt.param_groups):
                out[f"opt{i}.group{g}.lr_wd"] = (group["lr"], group["weight_decay"])
        out["iteration"] = job.iteration
        out["consumed_samples"] = job.consumed_samples
        return out

    def save(self, job: MegatronJob, path: str) -> None:
        """megatron's dist-checkpoint of the job, plus (from rank 0, as Megatron-LM keeps it
        in the checkpoint's common state) the scheduler state, iteration and samples."""
        os.makedirs(path, exist_ok=True)
        live.save_dist_checkpoint(self.harness_job(job), path)
        if dist.get_rank() == 0:
            common = {"scheduler": job.scheduler.state_dict(), "iteration": job.iteration,
                      "consumed_samples": job.consumed_samples}
            with open(os.path.join(path, "common_train_state.json"), "w") as f:
                json.dump(common, f)
        dist.barrier()

    def reference(self, spec, path: str) -> MegatronJob:
        """A fresh job for ``spec`` loaded from ``save``'s checkpoint at ``path``: what a
        checkpoint-based switch restores."""
        ref = self.build(spec)
        live.load_dist_checkpoint(self.harness_job(ref), path)
        with open(os.path.join(path, "common_train_state.json")) as f:
            common = json.load(f)
        ref.scheduler.load_state_dict(common["scheduler"])
        ref.iteration, ref.consumed_samples = common["iteration"], common["consumed_samples"]
        return ref
