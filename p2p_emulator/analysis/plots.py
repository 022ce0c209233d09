"""PNG plots of a run directory, written to RUN_DIR/plots at the end of every run, and the overlay of several runs
(`emulate report`).

- `<metric>_vs_round.png`, `<metric>_vs_time.png`, `<metric>_vs_bytes.png`: the run's
  main metric (test_acc, else e.g. gossip's error) against the round, the emulated time
  (when the last node ended the round) and the bytes all nodes sent so far. Up to
  MAX_NODE_LINES nodes: the mean over nodes with a ±std band, and every node faint (on
  the time axis at its own clock). Beyond: the median with a band from the 10th to the
  90th percentile over nodes, and the WORST_NODES nodes with the worst last value
  (lowest accuracy, highest error or loss) as thin lines named in the legend. A node
  that reported nothing in a round (e.g. no test samples) is left out of that round;
- `link_bytes_matrix.png`: bytes sent on each directed link (src x dst); beyond
  MAX_MATRIX_SIDE nodes, summed over blocks of consecutive node ids;
- `link_bytes_topology.png`: the graph, each edge as wide as the bytes it carried; not
  drawn beyond MAX_TOPOLOGY_NODES nodes, where no layout is legible (and the spring
  layout costs O(N^2)): the matrix shows the same bytes;
- `availability.png` (churn: availability.jsonl): when each node was up, as the
  fraction of each time bin it was up; beyond MAX_MATRIX_SIDE nodes, per block of nodes;
- `accuracy_vs_time.png`, `accuracy_vs_bytes.png` (--eval-every-seconds: samples.jsonl):
  the sampled test accuracy (another sampled metric: `sampled_<metric>_vs_...`) against
  the emulated time of each tick and the bytes all nodes had sent by then, drawn over nodes
  as the per-round curves are; a node's model is scored at the same instants whether the
  protocol is synchronous or not, so the curves of both compare;
- `idle_fraction.png` (summary.json's node_time): a bar per node (beyond MAX_MATRIX_SIDE
  nodes, per block of nodes: their mean) of the share of the run its main loop waited
  idle, with the mean over nodes;
- and the figures of the installed analysis extensions (extensions.py), such as the
  protocols' own: `learned_graph.png` and `cluster_graph.png` (MAPL, L2C), `utility.png` (FedLinked).

Whatever the number of nodes, a figure holds a bounded number of artists and no array
beyond MAX_MATRIX_SIDE x AVAILABILITY_BINS cells besides the run's own per-node data (drawing.py).
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import networkx as nx
import numpy as np
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator

from .drawing import (AXES, SPREAD, Figures, band, block_sizes, cell_sums, draw_nodes, label_axes, label_nodes,
                      many_nodes, mean_x, new_figure, node_block, node_image, save, usable_axes)
from .extensions import FigureMaker, extension_figures
from .rundir import Curves, Run, RunDirError, higher_is_better, read_run

MAX_TOPOLOGY_NODES = 300
AVAILABILITY_BINS = 400
UPTIME = LinearSegmentedColormap.from_list("uptime", ["tab:red", "#b5deb5"])  # down .. up


def _metric_figure(run: Run, curves: Curves, axis: str, note: str = "") -> Figure:
    fig = new_figure()
    ax = fig.add_subplot()
    draw_nodes(ax, curves, axis, higher_is_better(curves.metric))
    label_axes(ax, axis, curves.metric)
    ax.set_title(f"{run.name}: {run.protocol} on {run.topology}{note}", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def metric_figures(run: Run) -> Figures:
    """The main metric against every x-axis the run has."""
    curves = run.curves()
    if curves is None:
        return
    for axis in usable_axes(curves):
        yield f"{curves.metric}_vs_{axis}.png", _metric_figure(run, curves, axis)


def link_rows(run: Run) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Node count, and each links.csv row's src, dst and bytes sent."""
    rows = [(row["src"], row["dst"], row["bytes_sent"]) for row in run.links or ()]
    src, dst, sent = np.array(rows, dtype=np.int64).reshape(-1, 3).T
    n = max(run.num_nodes, int(src.max(initial=-1)) + 1, int(dst.max(initial=-1)) + 1)
    return n, src, dst, sent


def link_cells(n: int, src: np.ndarray, dst: np.ndarray, sent: np.ndarray) -> tuple[int, np.ma.MaskedArray]:
    """Nodes per block, and bytes sent per (source, destination) block, masked where there is no link."""
    block = node_block(n)
    rows, cols, shape = src // block, dst // block, (math.ceil(n / block),) * 2
    linked = cell_sums(rows, cols, np.ones(len(src)), shape) > 0  # a link that carried 0 bytes is not blank
    return block, np.ma.masked_array(cell_sums(rows, cols, sent.astype(float), shape), ~linked)


def _link_matrix(run: Run, n: int, src: np.ndarray, dst: np.ndarray, sent: np.ndarray) -> Figure:
    block, total = link_cells(n, src, dst, sent)
    fig = new_figure(5.6, 4.8)
    ax = fig.add_subplot()
    image = node_image(ax, total, block, cmap="viridis")
    fig.colorbar(image, ax=ax, label="bytes sent" if block == 1 else "bytes sent, summed over the block",
                 format=EngFormatter(unit="B"))
    label_nodes(ax, n, block, "destination", "source")
    ax.set_title(f"{run.name}: bytes per link (blank: no link)", fontsize=9)
    return fig


def _layout(graph: nx.Graph) -> dict:
    # Dense graphs read best on a circle; sparse ones (rings, tori) as the spring layout unfolds them
    # (too slow beyond a few hundred nodes, where no layout is legible anyway).
    if not 3 <= graph.number_of_nodes() <= 200 or nx.density(graph) > 0.3:
        return nx.circular_layout(graph)
    return nx.spring_layout(graph, seed=0)


def _topology(run: Run, n: int, src: np.ndarray, dst: np.ndarray, sent: np.ndarray) -> Figure:
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    for s, d, size in zip(src.tolist(), dst.tolist(), sent.tolist()):
        if graph.has_edge(s, d):
            graph[s][d]["bytes"] += size
        else:
            graph.add_edge(s, d, bytes=size)
    pos = _layout(graph)
    heaviest = max((b for _, _, b in graph.edges(data="bytes")), default=0) or 1
    fig = new_figure(5.6, 5.2)
    ax = fig.add_subplot()
    widths = [0.2 + 6 * b / heaviest for _, _, b in graph.edges(data="bytes")]
    nx.draw_networkx_edges(graph, pos, ax=ax, width=widths, edge_color="C0", alpha=0.7)
    nx.draw_networkx_nodes(graph, pos, ax=ax, node_size=max(20, 300 - 3 * n), node_color="C1")
    if n <= 40:
        nx.draw_networkx_labels(graph, pos, ax=ax, font_size=7)
    ax.set_axis_off()
    ax.set_title(f"{run.name}: topology, edge width ∝ bytes (max {EngFormatter(unit='B', places=1)(heaviest)})",
                 fontsize=9)
    return fig


def link_figures(run: Run) -> Figures:
    """Bytes per directed link, as a matrix and (up to MAX_TOPOLOGY_NODES nodes) on the topology."""
    n, src, dst, sent = link_rows(run)
    if not sent.any():  # no links.csv, or nothing sent (local training)
        return
    yield "link_bytes_matrix.png", _link_matrix(run, n, src, dst, sent)
    if n <= MAX_TOPOLOGY_NODES:
        yield "link_bytes_topology.png", _topology(run, n, src, dst, sent)


def _integral_at(edges: np.ndarray, blocks: np.ndarray, times: np.ndarray, side: int) -> np.ndarray:
    """(side, len(edges)): per block, the sum over `times` before each edge e of (e - time)."""
    shape = (side, len(edges) + 1)
    after = np.searchsorted(edges, times, side="right")  # the first edge past each time
    count = np.cumsum(cell_sums(blocks, after, np.ones(len(times)), shape), axis=1)[:, :-1]
    total = np.cumsum(cell_sums(blocks, after, times, shape), axis=1)[:, :-1]
    return edges * count - total


def _uptime(rows: list[dict], n: int, end: float, block: int) -> np.ndarray:
    """(blocks, AVAILABILITY_BINS): the fraction of each block's node-time up in each time bin.

    A spell down from d to u covers clip(e - d, 0, u - d) seconds before time e, which is
    (e - d)+ - (e - u)+: summed over spells at the bin edges, then differenced, it gives the
    time down per bin without a spell x bin array.
    """
    side = math.ceil(n / block)
    edges = np.linspace(0, end, AVAILABILITY_BINS + 1)
    blocks = np.array([int(r["node"]) // block for r in rows])
    down = np.clip([float(r["t_down"]) for r in rows], 0, end)
    up = np.clip([end if r.get("t_up") is None else float(r["t_up"]) for r in rows], down, end)
    seconds_down = np.diff(_integral_at(edges, blocks, down, side) - _integral_at(edges, blocks, up, side), axis=1)
    return np.clip(1 - seconds_down / (np.diff(edges) * block_sizes(n, block)[:, None]), 0, 1)


def uptime(run: Run) -> tuple[np.ndarray, float, int] | None:
    """With churn: the fraction of each time bin each node (or block of nodes) was up, the end of the last bin
    and the nodes per block; None without availability.jsonl."""
    rows = [r for r in run.stream("availability") or () if "node" in r and "t_down" in r]
    if not rows:
        return None
    ends = [run.emulated_seconds, *(float(r["t_up"]) for r in rows if r.get("t_up") is not None)]
    end = max(e for e in ends if not math.isnan(e))
    if end <= 0:
        return None
    n = max([run.num_nodes, *(int(r["node"]) + 1 for r in rows)])
    block = node_block(n)
    return _uptime(rows, n, end, block), end, block


def availability_figures(run: Run) -> Figures:
    """With churn: the share of each time bin each node (or block of nodes) was up."""
    cells = uptime(run)
    if cells is None:
        return
    up, end, block = cells
    fig = new_figure(7.0, min(max(2.5, 0.22 * len(up) + 1.2), 8.0))
    ax = fig.add_subplot()
    image = ax.imshow(up, cmap=UPTIME, vmin=0, vmax=1, aspect="auto", interpolation="nearest", origin="lower",
                      extent=(0, end, -0.5, len(up) * block - 0.5))
    fig.colorbar(image, ax=ax, label="fraction of the time up")
    ax.set_xlabel("emulated time (s)")
    ax.set_ylabel("node" if block == 1 else f"node, blocks of {block}")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{run.name}: node availability (green up, red down)", fontsize=9)
    yield "availability.png", fig


def sampled_name(metric: str) -> str:
    """The stem of the figures of a sampled metric: `accuracy` for test_acc."""
    return "accuracy" if metric == "test_acc" else f"sampled_{metric}"


def _sampled_axes(curves: Curves) -> list[str]:
    """The time axis, and bytes when the run sent any."""
    return [axis for axis in usable_axes(curves) if axis != "round"]


def sampled_figures(run: Run) -> Figures:
    """With samples (--eval-every-seconds): the sampled metric against emulated time and bytes sent."""
    curves = run.curves(axis="time")
    if curves is None:
        return
    every = run.config.get("eval_every_seconds")
    sampled = f", scored every {every:g} s" if isinstance(every, (int, float)) else ""
    for axis in _sampled_axes(curves):
        yield f"{sampled_name(curves.metric)}_vs_{axis}.png", _metric_figure(run, curves, axis, sampled)


def idle_figures(run: Run) -> Figures:
    """With node_time: each node's idle fraction (per block of nodes beyond MAX_MATRIX_SIDE), and the mean."""
    fractions = np.array([float(v) if isinstance(v, (int, float)) else np.nan
                          for v in (run.node_time or {}).get("idle_fraction") or ()])
    if not fractions.size or np.all(np.isnan(fractions)):
        return
    n = len(fractions)
    block = node_block(n)
    starts = np.arange(0, n, block)
    heights = np.add.reduceat(np.nan_to_num(fractions), starts) / np.maximum(
        1, np.add.reduceat(~np.isnan(fractions), starts))
    fig = new_figure(max(4.0, min(9.0, 2.5 + 0.12 * len(starts))), 3.6)
    ax = fig.add_subplot()
    ax.bar(starts + (block - 1) / 2, heights, width=0.8 * block, color="C0")
    mean = float(np.nanmean(fractions))
    ax.axhline(mean, color="C3", linewidth=1, label=f"mean over nodes {mean:.3f}")
    ax.set_ylim(0, 1)
    ax.set_xlabel("node" if block == 1 else f"node, blocks of {block} (their mean)")
    ax.set_ylabel("idle fraction of the run")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title(f"{run.name}: {run.protocol}, time each node's loop waited idle", fontsize=9)
    yield "idle_fraction.png", fig


PLOTS = (metric_figures, link_figures, availability_figures, sampled_figures, idle_figures)


def figure_makers() -> tuple[FigureMaker, ...]:
    """What plot_run draws: the built-in plots, then the installed extensions' figures."""
    return (*PLOTS, *extension_figures())


def plot_run(out_dir: Path, partial: bool = False) -> list[Path]:
    """Write every plot that applies to the run at `out_dir` under out_dir/plots; the paths written.

    A plot whose optional input is missing is skipped; a plot that fails is
    skipped with a warning, so a finished run never fails for its plots. With
    `partial`, an incomplete run is plotted too, its titles marked incomplete.
    """
    try:
        run = read_run(out_dir, partial)
    except RunDirError as exc:
        warnings.warn(f"no plots: {exc}")
        return []
    plots = Path(out_dir) / "plots"
    plots.mkdir(exist_ok=True)
    written = []
    for figures in figure_makers():
        try:
            for name, fig in figures(run):
                written.append(save(fig, plots / name))
        except Exception as exc:  # noqa: BLE001 - a plot is a by-product; the run's data is already written
            warnings.warn(f"plot {getattr(figures, '__name__', figures)} skipped: {type(exc).__name__}: {exc}")
    return written


def overlay_figures(runs: list[Run]) -> Figures:
    """One figure per metric and x-axis with every run's centre and band over nodes as a labelled line;
    median and 10–90% when a run has more than MAX_NODE_LINES nodes, else mean ± std. Runs with samples
    (--eval-every-seconds) also get the sampled metric against emulated time and bytes (`accuracy_vs_time.png`)."""
    by_metric: dict[str, list[tuple[Run, Curves]]] = {}
    sampled: dict[str, list[tuple[Run, Curves]]] = {}
    for run in runs:
        curves = run.curves()
        if curves is not None:
            by_metric.setdefault(curves.metric, []).append((run, curves))
        curves = run.curves(axis="time")
        if curves is not None:
            sampled.setdefault(curves.metric, []).append((run, curves))
    for metric, group in by_metric.items():
        yield from _overlays(group, metric, AXES, f"{metric}_vs_{{axis}}.png")
    for metric, group in sampled.items():
        yield from _overlays(group, metric, ("time", "bytes"), f"{sampled_name(metric)}_vs_{{axis}}.png")


def _overlays(group: list[tuple[Run, Curves]], metric: str, axes, name: str) -> Figures:
    many = any(many_nodes(c) for _, c in group)
    for axis in axes:
        drawn = [(run, c) for run, c in group if axis in usable_axes(c)]
        if not drawn:
            continue
        fig = new_figure(7.0, 4.4)
        ax = fig.add_subplot()
        for k, (run, curves) in enumerate(drawn):
            band(ax, mean_x(curves, axis), curves, many, f"C{k % 10}", linewidth=1.8, label=run.name)
        finals = [c.cumulative_bytes[-1] for _, c in drawn] if axis == "bytes" else []
        if finals and max(finals) > 20 * min(finals):  # runs far apart in bytes: linear would squash the cheap ones
            ax.set_xscale("log")  # before label_axes: setting the scale resets the tick formatter
        label_axes(ax, axis, f"{metric} ({SPREAD[many]})")
        ax.legend(fontsize=7)
        yield name.format(axis=axis), fig


def overlay_plots(runs: list[Run], out: Path) -> list[Path]:
    """Write overlay_figures into `out`; the paths written."""
    return [save(fig, out / name) for name, fig in overlay_figures(runs)]
