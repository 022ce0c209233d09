"""What every figure of the analysis is drawn with, built-in or an extension's.

Figures are built without pyplot (no global figure registry, no display: PNGs go through
the Agg canvas), so nothing stays open once a plot is written. Whatever the number of
nodes, a figure drawn with these holds a bounded number of artists: curves over nodes
become percentiles and the worst nodes' lines beyond MAX_NODE_LINES nodes, and node x node
images are summed or averaged over blocks of nodes beyond MAX_MATRIX_SIDE.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator

from .rundir import MAX_NODE_LINES, Curves

DPI = 110
AXES = {  # x-axis name -> label
    "round": "round",
    "time": "emulated time (s)",
    "bytes": "bytes sent, all nodes",
}
WORST_NODES = 3
MAX_MATRIX_SIDE = 200  # rows and columns of a node x node image; beyond, blocks of nodes
SPREAD = {False: "mean ± std over nodes", True: "median, 10–90% of nodes"}  # by "beyond MAX_NODE_LINES"

Figures = Iterator[tuple[str, Figure]]  # file name, figure


def new_figure(width: float = 6.4, height: float = 4.0) -> Figure:
    """An empty figure of that size in inches, laid out to fit its labels."""
    return Figure(figsize=(width, height), layout="constrained")


def save(fig: Figure, path: Path) -> Path:
    """Write `fig` as a PNG at `path`; the path."""
    fig.savefig(path, dpi=DPI)
    return path


# -- curves over nodes ------------------------------------------------------------------------------------------------


def many_nodes(curves: Curves) -> bool:
    """Too many nodes for a line each: percentiles and the worst nodes instead."""
    return curves.values.shape[0] > MAX_NODE_LINES


def mean_x(curves: Curves, axis: str) -> np.ndarray:
    """The x of the values over nodes, per round, on `axis` (a key of AXES)."""
    return {"round": curves.rounds, "time": curves.round_end, "bytes": curves.cumulative_bytes}[axis]


def _node_x(curves: Curves, axis: str) -> np.ndarray:
    """x of each node's points, (N, R): on the time axis, the node's own clock."""
    if axis == "time":
        return curves.times
    return np.broadcast_to(mean_x(curves, axis), curves.values.shape)


def usable_axes(curves: Curves) -> list[str]:
    """Time and bytes axes only when the run has times and sent something."""
    usable = ["round"]
    if not np.all(np.isnan(curves.round_end)):
        usable.append("time")
    if curves.cumulative_bytes.size and curves.cumulative_bytes[-1] > 0:
        usable.append("bytes")
    return usable


def label_axes(ax, axis: str, metric: str) -> None:
    """Axis labels, a light grid, and ticks that suit `axis` (bytes in units, whole rounds)."""
    ax.set_xlabel(AXES[axis])
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    if axis == "bytes":
        ax.xaxis.set_major_formatter(EngFormatter(unit="B"))
    if axis == "round":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def spread(curves: Curves, many: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Centre, low and high over nodes: mean ± std, or with many nodes the median and 10th and 90th percentiles
    (a std band says little about a skewed crowd)."""
    if many:
        return curves.percentile(50), curves.percentile(10), curves.percentile(90)
    mean, std = curves.mean, curves.std
    return mean, mean - std, mean + std


def band(ax, x, curves: Curves, many: bool, color: str, **line) -> None:
    """The centre over nodes (dots when there are too few rounds for a line) with its band."""
    centre, low, high = spread(curves, many)
    ax.plot(x, centre, color=color, marker="o" if len(x) < 3 else None, **line)
    ax.fill_between(x, low, high, alpha=0.2, color=color, linewidth=0)


def worst_nodes(curves: Curves, higher_better: bool, count: int = WORST_NODES) -> list[int]:
    """The `count` nodes whose last reported value is worst; a node that never reported is not ranked."""
    reported = ~np.isnan(curves.values)
    last = curves.values.shape[1] - 1 - np.argmax(reported[:, ::-1], axis=1)
    final = curves.values[np.arange(len(last)), last]  # NaN for a node that never reported
    order = np.argsort(final if higher_better else -final, kind="stable")  # NaN sorts last
    return [int(i) for i in order[:count] if not np.isnan(final[i])]


def draw_nodes(ax, curves: Curves, axis: str, higher_better: bool) -> None:
    """The spread over nodes with every node faint, or with many nodes only the worst ones, named."""
    many = many_nodes(curves)
    if not many:
        lines = np.stack([_node_x(curves, axis), curves.values], axis=-1)  # (N, R, 2): one line per node
        ax.add_collection(LineCollection(lines, colors="grey", alpha=0.35, linewidths=0.7, label="each node"),
                          autolim=True)
    band(ax, mean_x(curves, axis), curves, many, "C0", linewidth=2, label=SPREAD[many])
    if many:
        x = _node_x(curves, axis)
        for k, i in enumerate(worst_nodes(curves, higher_better)):
            ax.plot(x[i], curves.values[i], color=f"C{k + 1}", linewidth=0.8, label=f"worst: node {i}")


# -- node x node images -----------------------------------------------------------------------------------------------


def node_block(n: int) -> int:
    """Nodes per row or column of a node x node image: one, or as many as keep it within MAX_MATRIX_SIDE."""
    return max(1, math.ceil(n / MAX_MATRIX_SIDE))


def block_sizes(n: int, block: int) -> np.ndarray:
    """How many of the `n` nodes each block holds (the last one may hold fewer)."""
    return np.diff(np.minimum(np.arange(0, n + block, block), n))


def cell_sums(rows: np.ndarray, cols: np.ndarray, weights: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Sum of `weights` per (row, col) cell, without any array larger than `shape`."""
    flat = np.bincount(rows * shape[1] + cols, weights=weights, minlength=shape[0] * shape[1])
    return flat.reshape(shape)


def node_image(ax, cells: np.ndarray, block: int, **style):
    """`cells` (blocks x blocks) drawn over node ids: block k spans nodes k*block .. (k+1)*block - 1."""
    edge = cells.shape[0] * block - 0.5
    return ax.imshow(cells, interpolation="nearest", extent=(-0.5, edge, edge, -0.5), **style)


def label_nodes(ax, n: int, block: int, xlabel: str, ylabel: str) -> None:
    """Axis labels of a node x node image (saying the block size), and node-id ticks that stay legible."""
    per_block = f", blocks of {block}" if block > 1 else ""
    ax.set_xlabel(xlabel + per_block)
    if ylabel:
        ax.set_ylabel(ylabel + per_block)
    if n <= 16:
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
    else:  # few ticks: node ids run to 5 digits
        ax.xaxis.set_major_locator(MaxNLocator(6, integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(6, integer=True))
