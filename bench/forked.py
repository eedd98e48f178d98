"""What every bench's forked worker process does around its work: its own process group (the
bench kills the group, and with it any process the worker started), its traceback written to a
file the bench reports, and its process group destroyed on the way out."""

from __future__ import annotations

import gc
import os
import traceback
from collections.abc import Callable


def run_forked(target: Callable[..., object], args: tuple, error_path: str) -> None:
    """Run ``target(*args)`` in a forked worker; on any error write its traceback to
    ``error_path`` and exit 1."""
    import torch.distributed as dist

    # What the bench imported stays out of the worker's cycle collections (gc docs: fork
    # without exec): not rescanned, its pages not copied by the collector writing to them.
    gc.freeze()
    os.setpgid(0, 0)
    try:
        target(*args)
    except BaseException:  # noqa: BLE001 — the bench reports it
        with open(error_path, "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
