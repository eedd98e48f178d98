"""Who sends how much to whom: a plan's device-to-device traffic matrix and its PNG heatmap.

Rows are source devices and columns destination devices, over the union of both sides in
``device_order``: by node, then by GPU, comparing the numbers in names as numbers (``node9``
before ``node10``). Local copies (a device to itself) are on the diagonal, so the matrix sums
to ``bytes_moved + bytes_local`` and its off-diagonal part to ``bytes_moved``. The colour bar is
logarithmic with ticks at powers of two labelled in binary units (``1.0 MiB``, ``1.0 GiB``), and
a legend says that white cells carry no traffic. matplotlib is imported only when a heatmap is
drawn, so planning never pays for it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..ir.errors import DynatrainError
from ..ir.units import format_bytes
from ..planner.plan import Plan

# Above this many devices a side, cells are summed in square blocks so each block gets at least
# a pixel and no sparse traffic is lost to image downsampling.
MAX_CELLS = 512
FIGSIZE_IN = (9, 8)  # width, height
DPI = 120
MAX_COLOR_TICKS = 8
NO_TRAFFIC = "white: no traffic"


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


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


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


def byte_ticks(lo: float, hi: float, max_ticks: int = MAX_COLOR_TICKS) -> list[float]:
    """Colour-bar ticks for a log scale from ``lo`` to ``hi`` bytes: powers of two, labelled
    exactly by ``format_bytes``.

    Every k-th power of two in the range, k the smallest step that keeps at most ``max_ticks``
    ticks, aligned so that 1 KiB, 1 MiB and 1 GiB are among them when k divides 10. A range with
    fewer than two powers of two gets its two ends instead.

    Example:
        >>> [format_bytes(t) for t in byte_ticks(1000, 3 << 30)]
        ['1.0 KiB', '32.0 KiB', '1.0 MiB', '32.0 MiB', '1.0 GiB']
    """
    lo = max(lo, 1.0)  # LogNorm may start below one byte (a one-valued matrix); ticks do not
    first, last = math.ceil(math.log2(lo)), math.floor(math.log2(hi))
    if last - first < 1:
        return sorted({float(lo), float(hi)})
    step = next(k for k in (1, 2, 5, 10, 20, 30, 40) if (last - first) // k + 1 <= max_ticks)
    start = first + (-first) % step
    return [float(2**e) for e in range(start, last + 1, step)]


def check_heatmap_path(path: str | Path) -> Path:
    """The output path, refused in one line unless it ends in ``.png`` in a directory that
    exists (cheap: the CLI calls it before writing any output)."""
    p = Path(path)
    if p.suffix.lower() != ".png":
        raise DynatrainError(f"--heatmap: the output must end in .png (got {str(p)!r})")
    if p.is_dir() or not p.parent.is_dir():
        why = "it is a directory" if p.is_dir() else "no such directory"
        raise DynatrainError(f"--heatmap: cannot write {str(p)!r} ({why})")
    return p


def heatmap_figure(plan: Plan):
    """The traffic matrix as a matplotlib ``Figure`` (what ``write_heatmap`` saves).

    Cells are coloured on a log scale; zero cells are left white and the legend under the
    matrix says so. The colour bar's ticks are powers of two in binary units. Lines mark node
    boundaries (every k-th node when there are more than 32 nodes, matching the labelled
    ticks). For more than ``MAX_CELLS`` devices, square blocks of devices are summed into one
    cell (the colour bar says how many); axes stay in device coordinates.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

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
        norm = LogNorm(vmin=lo if lo < hi else hi / 2, vmax=hi)
    else:
        norm = LogNorm(vmin=1, vmax=2)  # empty plan: an all-white image with a valid scale
    img = ax.imshow(shown, norm=norm, cmap="viridis", interpolation="nearest",
                    extent=(0, n, n, 0), aspect="equal")
    where = f" per {block}x{block} devices" if block > 1 else ""
    bar = fig.colorbar(img, ax=ax, shrink=0.8,
                       label=f"bytes sent{where} (log scale)" if shown.count() else
                       "no traffic in this plan")
    if shown.count():
        bar.ax.yaxis.set_major_locator(FixedLocator(byte_ticks(norm.vmin, norm.vmax)))
        bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(v)))
    else:
        bar.ax.yaxis.set_major_locator(NullLocator())
    bar.ax.yaxis.set_minor_locator(NullLocator())  # unlabelled decade ticks only add noise
    fig.legend(handles=[Patch(facecolor="white", edgecolor="0.4", label=NO_TRAFFIC)],
               loc="outside lower center", fontsize=8, frameon=False)

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
                 f"{format_bytes(moved)} moved between devices, {format_bytes(local)} local "
                 f"(diagonal), {_plural(len(plan.rounds), 'round')}, {_plural(n, 'device')}",
                 fontsize=10)
    return fig


def write_heatmap(plan: Plan, path: str | Path | BinaryIO) -> None:
    """Draw ``heatmap_figure(plan)`` to a PNG file.

    Args:
        plan: the plan to draw.
        path: output file, which must end in ``.png``, or an open binary stream.

    Raises:
        DynatrainError: the suffix is not ``.png`` or the file cannot be written.

    Example:
        >>> write_heatmap(plan, "/tmp/traffic.png")  # doctest: +SKIP
    """
    # Fail before the (slow) drawing when the path clearly cannot be written.
    p = path if hasattr(path, "write") else check_heatmap_path(path)
    fig = heatmap_figure(plan)
    try:
        fig.savefig(p, format="png")
    except OSError as err:
        why = err.strerror or err
        shown = "-" if hasattr(p, "write") else str(p)
        raise DynatrainError(f"--heatmap: cannot write {shown!r} ({why})") from None
