"""A process of the job that is killed takes its dist-checkpoint Manager with it.

``fork_results_queue`` forks megatron's dist-checkpoint results Manager after the job's
process groups exist, so the Manager holds copies of the job's sockets. Were it to outlive a
``kill -9`` of its process, the peers would never see the connection close: a death would look
like a hang. It must die with the process that started it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time


def _start_manager_then_wait(conn) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from dynatrain.runtime.megatron import cpu

    # A fresh process: not the queue of a Manager that this test worker (the parent) started
    # for an earlier test.
    filesystem_async._results_queue = cpu._MANAGER = None
    cpu.fork_results_queue()
    conn.send(cpu._MANAGER._process.pid)
    time.sleep(600)  # until killed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


def test_the_results_manager_dies_with_a_killed_process() -> None:
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_start_manager_then_wait, args=(there,))
    proc.start()
    manager = None
    try:
        assert here.poll(120), "the process did not start its Manager"
        manager = here.recv()
        assert _alive(manager)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        deadline = time.monotonic() + 10
        while _alive(manager) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(manager), "the Manager outlived the killed process"
    finally:
        if proc.is_alive():
            proc.kill()
        if manager is not None and _alive(manager):  # an orphan would hold pytest's pipes
            os.kill(manager, signal.SIGKILL)
