"""Megatron dist checkpoints (``torch_dist``) as a source of training state.

``load_checkpoint(ckpt_dir, layout, rank)`` fills one destination rank's storage (the layout
``dynatrain.runtime.storage`` allocates, what a switch writes into) straight from the
checkpoint's chunks; ``plan_load`` plans that without reading tensor data (bytes and files per
destination device: ``CheckpointLoad.summary``, ``format_load``); ``checkpoint_layout_summary``
says what a checkpoint holds; ``load_checkpoint_into`` loads a live megatron-core rank;
``plan_load(only=)`` fills just what devices lost. Anything unreadable (missing, truncated,
of another model, of an unknown format version, metadata that would unpickle a class outside
the allow-list, chunks that do not tile a tensor exactly, a file linked out of the directory)
is one ``CheckpointError`` line, exit status 2.
"""

from .format import Checkpoint, CheckpointError, open_checkpoint
from .load import (CheckpointLoad, LoadStats, base_key, checkpoint_layout_summary, format_load,
                   load_checkpoint, load_checkpoint_into, load_checkpoint_ranks,
                   load_planned, plan_load)

__all__ = ["Checkpoint", "CheckpointError", "CheckpointLoad", "LoadStats", "base_key",
           "checkpoint_layout_summary", "format_load", "load_checkpoint", "load_checkpoint_into",
           "load_checkpoint_ranks", "load_planned", "open_checkpoint", "plan_load"]
