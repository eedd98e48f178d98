"""Who sends how much to whom: a plan's device-to-device traffic matrix and its PNG heatmap.

Rows are source devices and columns destination devices, over the union of both sides in
``device_order``: by node, then by GPU, comparing the numbers in names as numbers (``node9``
before ``node10``). Local copies (a device to itself) are on the diagonal, so the matrix sums
to ``bytes_moved + bytes_local`` and its off-diagonal part to ``bytes_moved``. matplotlib is
imported only when a heatmap is drawn, so planning never pays for it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from ..ir.errors import DynatrainError
from ..planner.plan import Plan
from .dot import human_bytes

# Above this many devices a side, cells are summed in square blocks so each block gets at least
# a pixel and no sparse traffic is lost to image downsampling.
MAX_CELLS = 512
FIGSIZE_IN = (9, 8)  # width, height
DPI = 120


def _natural(text: str) -> list[str | int]:
    # re.split with a group alternates str, int, str, ...; equal positions hold equal types.
    return [int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", text))]


def device_key(device: str) -> tuple[list[str | int], list[str | int]]:
    """Sort key: node (the part before ``:``), then the rest, numbers compared numerically."""
    node, _, rest = device.partition(":")
    return _natural(node), _natural(rest)


def device_order(plan: Plan) -> list[str]:
    """Every source and destination device of ``plan`` once, in ``device_key`` order."""
    return sorted(set(plan.src_devices) | set(plan.dst_devices), key=device_key)


def _accumulate(plan: Plan, index: dict[str, int], size: int, block: int) -> np.ndarray:
    out = np.zeros((size, size), dtype=np.int64)
    for m in plan.messages():
        out[index[m.src_device] // block, index[m.dst_device] // block] += m.nbytes
    return out


def traffic_matrix(plan: Plan) -> tuple[list[str], np.ndarray]:
    """Bytes each source device sends to each destination device, local copies on the diagonal.

    Args:
        plan: the plan to summarise.

    Returns:
        ``(devices, matrix)``: ``devices`` in ``device_order``; ``matrix[i, j]`` (int64) is the
        total bytes of messages from ``devices[i]`` to ``devices[j]`` over all rounds.

    Example:
        >>> devices, m = traffic_matrix(plan)  # doctest: +SKIP
        >>> int(m.sum()) == plan.stats["bytes_moved"] + plan.stats["bytes_local"]
        True
    """
    devices = device_order(plan)
    index = {d: i for i, d in enumerate(devices)}
    return devices, _accumulate(plan, index, len(devices), 1)


def _plain(text: str) -> str:
    # matplotlib reads "$...$" as mathtext (and raises on unknown commands); names are not math.
    return text.replace("$", r"\$")


def _node_spans(devices: list[str]) -> list[tuple[str, int, int]]:
    """(node, first index, end index) of each run of devices on the same node."""
    spans: list[tuple[str, int, int]] = []
    for i, d in enumerate(devices):
        node = d.partition(":")[0]
        if spans and spans[-1][0] == node:
            spans[-1] = (node, spans[-1][1], i + 1)
        else:
            spans.append((node, i, i + 1))
    return spans


def _node_step(spans: list[tuple[str, int, int]]) -> int:
    # At most ~32 node labels and boundary lines; more turn the picture grey.
    return max(1, math.ceil(len(spans) / 32))


def _ticks(devices: list[str]) -> tuple[list[float], list[str]]:
    if len(devices) <= 32:
        return [i + 0.5 for i in range(len(devices))], devices
    spans = _node_spans(devices)
    shown = spans[:: _node_step(spans)]
    return [(a + b) / 2 for _, a, b in shown], [n for n, _, _ in shown]


def write_heatmap(plan: Plan, path: str | Path) -> None:
    """Draw the traffic matrix as a log-coloured PNG heatmap with node boundaries.

    Zero cells are left white. Lines mark node boundaries (every k-th node when there are more
    than 32 nodes, matching the labelled ticks). For more than ``MAX_CELLS`` devices, square
    blocks of devices are summed into one cell (the colour bar says how many); axes stay in
    device coordinates.

    Args:
        plan: the plan to draw.
        path: output file; must end in ``.png``.

    Raises:
        DynatrainError: the suffix is not ``.png`` or the file cannot be written.

    Example:
        >>> write_heatmap(plan, "/tmp/traffic.png")  # doctest: +SKIP
    """
    p = Path(path)
    if p.suffix.lower() != ".png":
        raise DynatrainError(f"--heatmap: the output must end in .png (got {str(p)!r})")
    # Fail before the (slow) drawing when the path clearly cannot be written.
    if p.is_dir() or not p.parent.is_dir():
        why = "it is a directory" if p.is_dir() else "no such directory"
        raise DynatrainError(f"--heatmap: cannot write {str(p)!r} ({why})")

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    devices = device_order(plan)
    n = len(devices)
    block = max(1, math.ceil(n / MAX_CELLS))
    cells = math.ceil(n / block) if n else 0
    grid = _accumulate(plan, {d: i for i, d in enumerate(devices)}, cells, block)
    local = int(np.trace(grid)) if block == 1 else sum(m.nbytes for m in plan.messages()
                                                       if m.local)
    moved = int(grid.sum()) - local

    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    shown = np.ma.masked_equal(grid, 0)
    if shown.count():
        lo, hi = float(shown.min()), float(shown.max())
        norm = LogNorm(vmin=lo if lo < hi else hi / 10, vmax=hi)
    else:
        norm = LogNorm(vmin=1, vmax=10)  # empty plan: an all-white image with a valid scale
    img = ax.imshow(shown, norm=norm, cmap="viridis", interpolation="nearest",
                    extent=(0, n, n, 0), aspect="equal")
    fig.colorbar(img, ax=ax, label="bytes" + (f" per {block}x{block} devices" if block > 1 else ""),
                 shrink=0.8)

    spans = _node_spans(devices)
    bounds = [a for _, a, _ in spans[:: _node_step(spans)][1:]]
    if bounds:
        ax.hlines(bounds, 0, n, colors="0.6", linewidths=0.6)
        ax.vlines(bounds, 0, n, colors="0.6", linewidths=0.6)
    pos, labels = _ticks(devices)
    small = 6 if len(labels) > 16 else 8
    labels = [_plain(t) for t in labels]
    ax.set_xticks(pos, labels, rotation=90, fontsize=small)
    ax.set_yticks(pos, labels, fontsize=small)
    ax.set_xlabel("destination device")
    ax.set_ylabel("source device")
    ax.set_title(f"{_plain(plan.src_name)} -> {_plain(plan.dst_name)}\n"
                 f"{human_bytes(moved)} moved between devices, {human_bytes(local)} local "
                 f"(diagonal), {len(plan.rounds)} rounds, {n} devices", fontsize=10)
    try:
        fig.savefig(p, format="png")
    except OSError as err:
        why = err.strerror or err
        raise DynatrainError(f"--heatmap: cannot write {str(p)!r} ({why})") from None
