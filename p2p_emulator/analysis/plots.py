"""PNG plots of a run directory, written to RUN_DIR/plots at the end of every run.

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
- `learned_graph.png` (mapl, l2c: graph.jsonl): the mixing matrix W after warm-up,
  half-way and at the end; beyond MAX_MATRIX_SIDE nodes, the mean w_ij over blocks;
- `cluster_graph.png` (mapl with a clustered partition): the weight each node puts
  on its own cluster (drawn as the metric is; the worst nodes put the least), and the
  mean similarity c_ij within and across clusters;
- `availability.png` (churn: availability.jsonl): when each node was up, as the
  fraction of each time bin it was up; beyond MAX_MATRIX_SIDE nodes, per block of nodes.

Whatever the number of nodes, a figure holds a bounded number of artists and no array
beyond MAX_MATRIX_SIDE x AVAILABILITY_BINS cells besides the run's own per-node data.
Figures are built without pyplot (no global figure registry, no display: PNGs go
through the Agg canvas), so nothing stays open once a plot is written.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Iterator

import matplotlib
import networkx as nx
import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import EngFormatter, MaxNLocator

from .rundir import Curves, Run, RunDirError, higher_is_better, load_run

DPI = 110
AXES = {  # x-axis name -> label
    "round": "round",
    "time": "emulated time (s)",
    "bytes": "bytes sent, all nodes",
}
MAX_NODE_LINES = 32  # beyond: percentiles over nodes and only the worst nodes' lines
WORST_NODES = 3
MAX_MATRIX_SIDE = 200  # rows and columns of a node x node image; beyond, blocks of nodes
MAX_TOPOLOGY_NODES = 300
AVAILABILITY_BINS = 400
SPREAD = {False: "mean ± std over nodes", True: "median, 10–90% of nodes"}  # by "beyond MAX_NODE_LINES"
UPTIME = LinearSegmentedColormap.from_list("uptime", ["tab:red", "#b5deb5"])  # down .. up

Figures = Iterator[tuple[str, Figure]]  # file name, figure


def _figure(width: float = 6.4, height: float = 4.0) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    return path


def _many(curves: Curves) -> bool:
    return curves.values.shape[0] > MAX_NODE_LINES


def _mean_x(curves: Curves, axis: str) -> np.ndarray:
    return {"round": curves.rounds, "time": curves.round_end, "bytes": curves.cumulative_bytes}[axis]


def _node_x(curves: Curves, axis: str) -> np.ndarray:
    """x of each node's points, (N, R): on the time axis, the node's own clock."""
    if axis == "time":
        return curves.times
    return np.broadcast_to(_mean_x(curves, axis), curves.values.shape)


def _usable_axes(curves: Curves) -> list[str]:
    """Time and bytes axes only when the run has times and sent something."""
    usable = ["round"]
    if not np.all(np.isnan(curves.round_end)):
        usable.append("time")
    if curves.cumulative_bytes.size and curves.cumulative_bytes[-1] > 0:
        usable.append("bytes")
    return usable


def _label_axes(ax, axis: str, metric: str) -> None:
    ax.set_xlabel(AXES[axis])
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    if axis == "bytes":
        ax.xaxis.set_major_formatter(EngFormatter(unit="B"))
    if axis == "round":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _spread(curves: Curves, many: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Centre, low and high over nodes: mean ± std, or with many nodes the median and 10th and 90th percentiles
    (a std band says little about a skewed crowd)."""
    if many:
        return curves.percentile(50), curves.percentile(10), curves.percentile(90)
    mean, std = curves.mean, curves.std
    return mean, mean - std, mean + std


def _band(ax, x, curves: Curves, many: bool, color: str, **line) -> None:
    """The centre over nodes (dots when there are too few rounds for a line) with its band."""
    centre, low, high = _spread(curves, many)
    ax.plot(x, centre, color=color, marker="o" if len(x) < 3 else None, **line)
    ax.fill_between(x, low, high, alpha=0.2, color=color, linewidth=0)


def worst_nodes(curves: Curves, higher_better: bool, count: int = WORST_NODES) -> list[int]:
    """The `count` nodes whose last reported value is worst; a node that never reported is not ranked."""
    reported = ~np.isnan(curves.values)
    last = curves.values.shape[1] - 1 - np.argmax(reported[:, ::-1], axis=1)
    final = curves.values[np.arange(len(last)), last]  # NaN for a node that never reported
    order = np.argsort(final if higher_better else -final, kind="stable")  # NaN sorts last
    return [int(i) for i in order[:count] if not np.isnan(final[i])]


def _nodes(ax, curves: Curves, axis: str, higher_better: bool) -> None:
    """The spread over nodes with every node faint, or with many nodes only the worst ones, named."""
    many = _many(curves)
    if not many:
        lines = np.stack([_node_x(curves, axis), curves.values], axis=-1)  # (N, R, 2): one line per node
        ax.add_collection(LineCollection(lines, colors="grey", alpha=0.35, linewidths=0.7, label="each node"),
                          autolim=True)
    _band(ax, _mean_x(curves, axis), curves, many, "C0", linewidth=2, label=SPREAD[many])
    if many:
        x = _node_x(curves, axis)
        for k, i in enumerate(worst_nodes(curves, higher_better)):
            ax.plot(x[i], curves.values[i], color=f"C{k + 1}", linewidth=0.8, label=f"worst: node {i}")


def _metric_figure(run: Run, curves: Curves, axis: str) -> Figure:
    fig = _figure()
    ax = fig.add_subplot()
    _nodes(ax, curves, axis, higher_is_better(curves.metric))
    _label_axes(ax, axis, curves.metric)
    ax.set_title(f"{run.name}: {run.protocol} on {run.topology}", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def metric_figures(run: Run) -> Figures:
    curves = run.curves()
    if curves is None:
        return
    for axis in _usable_axes(curves):
        yield f"{curves.metric}_vs_{axis}.png", _metric_figure(run, curves, axis)


def _block(n: int) -> int:
    """Nodes per row or column of a node x node image: one, or as many as keep it within MAX_MATRIX_SIDE."""
    return max(1, math.ceil(n / MAX_MATRIX_SIDE))


def _block_sizes(n: int, block: int) -> np.ndarray:
    return np.diff(np.minimum(np.arange(0, n + block, block), n))


def _cell_sums(rows: np.ndarray, cols: np.ndarray, weights: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Sum of `weights` per (row, col) cell, without any array larger than `shape`."""
    flat = np.bincount(rows * shape[1] + cols, weights=weights, minlength=shape[0] * shape[1])
    return flat.reshape(shape)


def _node_image(ax, cells: np.ndarray, block: int, **style):
    """`cells` (blocks x blocks) drawn over node ids: block k spans nodes k*block .. (k+1)*block - 1."""
    edge = cells.shape[0] * block - 0.5
    return ax.imshow(cells, interpolation="nearest", extent=(-0.5, edge, edge, -0.5), **style)


def _label_nodes(ax, n: int, block: int, xlabel: str, ylabel: str) -> None:
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


def _links(run: Run) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Node count, and each links.csv row's src, dst and bytes sent."""
    rows = [(row["src"], row["dst"], row["bytes_sent"]) for row in run.links or ()]
    src, dst, sent = np.array(rows, dtype=np.int64).reshape(-1, 3).T
    n = max(run.num_nodes, int(src.max(initial=-1)) + 1, int(dst.max(initial=-1)) + 1)
    return n, src, dst, sent


def _link_matrix(run: Run, n: int, src: np.ndarray, dst: np.ndarray, sent: np.ndarray) -> Figure:
    block = _block(n)
    rows, cols, shape = src // block, dst // block, (math.ceil(n / block),) * 2
    linked = _cell_sums(rows, cols, np.ones(len(src)), shape) > 0  # a link that carried 0 bytes is not blank
    total = np.ma.masked_array(_cell_sums(rows, cols, sent.astype(float), shape), ~linked)
    fig = _figure(5.6, 4.8)
    ax = fig.add_subplot()
    image = _node_image(ax, total, block, cmap="viridis")
    fig.colorbar(image, ax=ax, label="bytes sent" if block == 1 else "bytes sent, summed over the block",
                 format=EngFormatter(unit="B"))
    _label_nodes(ax, n, block, "destination", "source")
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
    fig = _figure(5.6, 5.2)
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
    n, src, dst, sent = _links(run)
    if not sent.any():  # no links.csv, or nothing sent (local training)
        return
    yield "link_bytes_matrix.png", _link_matrix(run, n, src, dst, sent)
    if n <= MAX_TOPOLOGY_NODES:
        yield "link_bytes_topology.png", _topology(run, n, src, dst, sent)


def weight_matrices(rows: list[dict], n: int, rounds: list[int], block: int = 1) -> dict[int, np.ndarray]:
    """graph.jsonl rows -> round -> W, for `rounds` (row i: node i's weights; absent entries 0);
    with block > 1, the mean w_ij over each block x block cell."""
    side = math.ceil(n / block)
    sizes = _block_sizes(n, block)
    matrices = {}
    for rnd in rounds:
        entries = [(int(row["node"]), int(j), float(w)) for row in rows if int(row["round"]) == rnd
                   for j, w in row["weights"].items()]
        i, j, w = np.array(entries, dtype=float).reshape(-1, 3).T
        sums = _cell_sums(i.astype(int) // block, j.astype(int) // block, w, (side, side))
        matrices[rnd] = sums / np.outer(sizes, sizes)
    return matrices


def _even(weights: dict) -> bool:
    """A node spreads its weight evenly over the nodes it records a weight for."""
    values = list(weights.values())
    return not values or max(values) - min(values) <= 1e-6


def snapshot_rounds(rows: list[dict]) -> list[int]:
    """The first round after warm-up (some node's weights uneven; else the first round), the middle and the last."""
    rounds = sorted({int(row["round"]) for row in rows})
    learned = min((int(row["round"]) for row in rows if not _even(row["weights"])), default=rounds[0])
    later = [r for r in rounds if r >= learned]
    return sorted({learned, later[len(later) // 2], later[-1]})


def learned_graph_figures(run: Run) -> Figures:
    rows = run.stream("graph")
    if not rows:
        return
    n = max([run.num_nodes, *(int(r["node"]) + 1 for r in rows),
             *(int(j) + 1 for r in rows for j in r["weights"])])
    shown, block = snapshot_rounds(rows), _block(n)
    matrices = weight_matrices(rows, n, shown, block)
    top = max(float(m.max()) for m in matrices.values()) or 1.0
    fig = _figure(4.2 * len(shown) + 0.8, 4.2)
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    for ax, rnd in zip(axes, shown):
        image = _node_image(ax, matrices[rnd], block, cmap="magma_r", vmin=0, vmax=top)
        ax.set_title(f"round {rnd}", fontsize=9)
        _label_nodes(ax, n, block, "j (neighbour)", "i (node)" if ax is axes[0] else "")
    fig.colorbar(image, ax=list(axes), label="w_ij" if block == 1 else "w_ij, mean over the block")
    fig.suptitle(f"{run.name}: learned collaboration graph W ({run.protocol})", fontsize=10)
    yield "learned_graph.png", fig


def cluster_similarity(rows: list[dict], clusters: dict[int, int]) -> dict[str, tuple[list[int], list[float]]]:
    """graph.jsonl rows -> {"within cluster": (rounds, mean c_ij), "across clusters": (...)} over the rounds
    in which nodes learned the graph (rows with similarities)."""
    pairs: dict[str, dict[int, list[float]]] = {"within cluster": {}, "across clusters": {}}
    for row in rows:
        i = int(row["node"])
        for j, c in (row.get("similarity") or {}).items():
            side = "within cluster" if clusters.get(int(j)) == clusters.get(i) else "across clusters"
            pairs[side].setdefault(int(row["round"]), []).append(float(c))
    return {side: (sorted(by), [float(np.mean(by[r])) for r in sorted(by)]) for side, by in pairs.items()}


def cluster_figures(run: Run) -> Figures:
    """Left: the weight each node puts on its own cluster; right: mean c_ij within and across clusters."""
    rows, clusters = run.stream("graph"), run.clusters
    if not rows or clusters is None:
        return
    mass = run.curves("within_cluster")
    if mass is None or np.all(np.isnan(mass.values)):
        return
    fig = _figure(10.0, 4.0)
    left, right = fig.subplots(1, 2)
    _nodes(left, mass, "round", higher_better=True)
    _label_axes(left, "round", "weight on own cluster (w_ii included)")
    left.set_ylim(-0.02, 1.02)
    left.legend(fontsize=8)
    for (side, (rounds, mean)), color in zip(cluster_similarity(rows, clusters).items(), ("C2", "C3")):
        right.plot(rounds, mean, color=color, marker="o" if len(rounds) < 3 else None, label=f"{side} (while linked)")
    _label_axes(right, "round", "mean similarity c_ij")
    right.legend(fontsize=8)
    fig.suptitle(f"{run.name}: graph learning against the partition's clusters ({run.protocol})", fontsize=10)
    yield "cluster_graph.png", fig


def utility_matrices(rows: list[dict], n: int) -> dict[int, np.ndarray]:
    """utility.jsonl rows -> round -> A, row j holding j's column (A[j, k] = A_kj: how useful k is to j);
    NaN where j heard nothing from k."""
    matrices: dict[int, np.ndarray] = {}
    for row in rows:
        matrix = matrices.setdefault(int(row["round"]), np.full((n, n), np.nan))
        for k, a in row["utility"].items():
            matrix[int(row["client"]), int(k)] = float(a)
    return matrices


def utility_figures(run: Run) -> Figures:
    """FedLinked's cross-utility A as heatmaps: the first round, two between and the last."""
    rows = run.stream("utility")
    if not rows:
        return
    n = max([run.num_nodes, *(int(r["client"]) + 1 for r in rows), *(int(k) + 1 for r in rows for k in r["utility"])])
    matrices = utility_matrices(rows, n)
    rounds = sorted(matrices)
    shown = sorted({rounds[round(q * (len(rounds) - 1))] for q in (0, 1 / 3, 2 / 3, 1)})
    values = np.concatenate([matrices[r][np.isfinite(matrices[r])] for r in shown])
    if not values.size:
        return
    fig = _figure(4.2 * len(shown) + 0.8, 4.2)
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    for ax, rnd in zip(axes, shown):
        image = _node_image(ax, matrices[rnd], 1, cmap="viridis", vmin=values.min(), vmax=values.max())
        ax.set_title(f"round {rnd}", fontsize=9)
        _label_nodes(ax, n, 1, "k (whose representations)", "j (whose target)" if ax is axes[0] else "")
    fig.colorbar(image, ax=list(axes), label="A_kj")
    fig.suptitle(f"{run.name}: cross-utility A over rounds ({run.protocol})", fontsize=10)
    yield "utility.png", fig


def _integral_at(edges: np.ndarray, blocks: np.ndarray, times: np.ndarray, side: int) -> np.ndarray:
    """(side, len(edges)): per block, the sum over `times` before each edge e of (e - time)."""
    shape = (side, len(edges) + 1)
    after = np.searchsorted(edges, times, side="right")  # the first edge past each time
    count = np.cumsum(_cell_sums(blocks, after, np.ones(len(times)), shape), axis=1)[:, :-1]
    total = np.cumsum(_cell_sums(blocks, after, times, shape), axis=1)[:, :-1]
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
    return np.clip(1 - seconds_down / (np.diff(edges) * _block_sizes(n, block)[:, None]), 0, 1)


def availability_figures(run: Run) -> Figures:
    rows = [r for r in run.stream("availability") or () if "node" in r and "t_down" in r]
    if not rows:
        return
    ends = [run.emulated_seconds, *(float(r["t_up"]) for r in rows if r.get("t_up") is not None)]
    end = max(e for e in ends if not math.isnan(e))
    if end <= 0:
        return
    n = max([run.num_nodes, *(int(r["node"]) + 1 for r in rows)])
    block = _block(n)
    up = _uptime(rows, n, end, block)
    fig = _figure(7.0, min(max(2.5, 0.22 * len(up) + 1.2), 8.0))
    ax = fig.add_subplot()
    image = ax.imshow(up, cmap=UPTIME, vmin=0, vmax=1, aspect="auto", interpolation="nearest", origin="lower",
                      extent=(0, end, -0.5, len(up) * block - 0.5))
    fig.colorbar(image, ax=ax, label="fraction of the time up")
    ax.set_xlabel("emulated time (s)")
    ax.set_ylabel("node" if block == 1 else f"node, blocks of {block}")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{run.name}: node availability (green up, red down)", fontsize=9)
    yield "availability.png", fig


PLOTS = (metric_figures, link_figures, learned_graph_figures, cluster_figures, utility_figures, availability_figures)


def plot_run(out_dir: Path, partial: bool = False) -> list[Path]:
    """Write every plot that applies to the run at `out_dir` under out_dir/plots; the paths written.

    A plot whose optional input is missing is skipped; a plot that fails is
    skipped with a warning, so a finished run never fails for its plots. With
    `partial`, an incomplete run is plotted too, its titles marked incomplete.
    """
    try:
        run = load_run(out_dir, partial)
    except RunDirError as exc:
        warnings.warn(f"no plots: {exc}")
        return []
    plots = Path(out_dir) / "plots"
    plots.mkdir(exist_ok=True)
    written = []
    for figures in PLOTS:
        try:
            for name, fig in figures(run):
                written.append(_save(fig, plots / name))
        except Exception as exc:  # noqa: BLE001 - a plot is a by-product; the run's data is already written
            warnings.warn(f"plot {figures.__name__} skipped: {type(exc).__name__}: {exc}")
    return written


def overlay_figures(runs: list[Run]) -> Figures:
    """One figure per metric and x-axis with every run's centre and band over nodes as a labelled line;
    median and 10–90% when a run has more than MAX_NODE_LINES nodes, else mean ± std."""
    by_metric: dict[str, list[tuple[Run, Curves]]] = {}
    for run in runs:
        curves = run.curves()
        if curves is not None:
            by_metric.setdefault(curves.metric, []).append((run, curves))
    for metric, group in by_metric.items():
        many = any(_many(c) for _, c in group)
        for axis in AXES:
            drawn = [(run, c) for run, c in group if axis in _usable_axes(c)]
            if not drawn:
                continue
            fig = _figure(7.0, 4.4)
            ax = fig.add_subplot()
            for k, (run, curves) in enumerate(drawn):
                _band(ax, _mean_x(curves, axis), curves, many, f"C{k % 10}", linewidth=1.8, label=run.name)
            finals = [c.cumulative_bytes[-1] for _, c in drawn] if axis == "bytes" else []
            if finals and max(finals) > 20 * min(finals):  # runs far apart in bytes: linear would squash the cheap ones
                ax.set_xscale("log")  # before _label_axes: setting the scale resets the tick formatter
            _label_axes(ax, axis, f"{metric} ({SPREAD[many]})")
            ax.legend(fontsize=7)
            yield f"{metric}_vs_{axis}.png", fig


def overlay_plots(runs: list[Run], out: Path) -> list[Path]:
    return [_save(fig, out / name) for name, fig in overlay_figures(runs)]


# -- a study's figures (emulate sweep: p2p_emulator/analysis/study.py) ----------------------------------------------


def over_runs(curves: list[Curves]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rounds, and per round the mean and the sample std over runs of each run's mean over nodes (0: one run);
    only the rounds some run has a value in (with --eval-every K, the scored ones), so the line joins them."""
    rounds = np.unique(np.concatenate([c.rounds for c in curves]))
    means = np.full((len(curves), len(rounds)), np.nan)
    for i, c in enumerate(curves):
        means[i, np.searchsorted(rounds, c.rounds)] = c.mean
    values = np.ma.masked_invalid(means)
    scored = ~np.ma.getmaskarray(values).all(axis=0)
    return (rounds[scored], values.mean(axis=0).filled(np.nan)[scored],
            values.std(axis=0, ddof=1).filled(0.0)[scored])


def pareto_front(cost: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Indices of the points that no other point beats with at most their cost and a higher value, by cost."""
    order = np.lexsort((-value, cost))  # by cost; at one cost, the best value first
    best = np.maximum.accumulate(value[order])
    return order[np.r_[True, best[1:] > best[:-1]]]


def _round_panels(metric: str, panels: dict[str, dict[str, list[Curves]]], colours: dict[str, str | tuple]) -> Figure:
    width = min(len(panels), 4)
    height = math.ceil(len(panels) / width)
    fig = _figure(3.4 * width + 2.0, 2.8 * height + 0.6)
    axes = fig.subplots(height, width, squeeze=False, sharey=True).ravel()
    for ax, (column, rows) in zip(axes, panels.items()):
        for row, curves in rows.items():
            rounds, mean, std = over_runs(curves)
            ax.plot(rounds, mean, color=colours[row], marker="o" if len(rounds) < 3 else None)
            ax.fill_between(rounds, mean - std, mean + std, color=colours[row], alpha=0.2, linewidth=0)
        _label_axes(ax, "round", metric)
        ax.set_title(column, fontsize=9)
    for ax in axes[len(panels):]:
        ax.set_axis_off()
    drawn = [row for row in colours if any(row in rows for rows in panels.values())]
    fig.legend([Line2D([], [], color=colours[row]) for row in drawn], drawn, loc="outside right upper", fontsize=8)
    fig.suptitle(f"{metric}: mean over nodes by round; mean ± std over each cell's runs", fontsize=10)
    return fig


Finals = dict[str, dict[str, list[tuple[float, float]]]]  # colour -> cell -> (bytes, final value) per run


def _frontier(metric: str, finals: Finals, colours: dict[str, str | tuple]) -> Figure:
    """Every run's point; where a cell has several runs (seeds), also their mean, labelled with the cell."""
    fig = _figure(7.0, 4.4)
    ax = fig.add_subplot()
    repeated = any(len(points) > 1 for cells in finals.values() for points in cells.values())
    for colour, cells in finals.items():
        cost, value = np.array([p for points in cells.values() for p in points]).T
        ax.scatter(cost, value, color=colours[colour], s=10 if repeated else 18, alpha=0.4 if repeated else 1,
                   label=None if repeated else colour)
        if repeated:
            _cell_means(ax, cells, colours[colour], colour)
    cost, value = np.array([p for cells in finals.values() for points in cells.values() for p in points]).T
    usable = np.flatnonzero(np.isfinite(cost) & np.isfinite(value))
    sign = 1 if higher_is_better(metric) else -1
    front = usable[pareto_front(cost[usable], sign * value[usable])]
    ax.plot(cost[front], value[front], drawstyle="steps-post", color="black", linewidth=1, label="Pareto front")
    paid = cost[usable][cost[usable] > 0]
    if paid.size and paid.max() > 20 * paid.min():  # runs far apart in bytes: linear would squash the cheap ones
        if paid.size < usable.size:  # a run that sent nothing stays on the axis
            ax.set_xscale("symlog", linthresh=paid.min())
        else:
            ax.set_xscale("log")
    _label_axes(ax, "bytes", f"final {metric}")
    what = "a faint point per run, a diamond per cell: its runs' mean" if repeated else "a point per run"
    ax.set_title(f"final {metric} against bytes sent: {what}", fontsize=9)
    ax.legend(fontsize=7)
    return fig


def _cell_means(ax, cells: dict[str, list[tuple[float, float]]], colour, label: str) -> None:
    means = {cell: np.nanmean(np.array(points), axis=0) for cell, points in cells.items()}
    cost, value = np.array(list(means.values())).T
    ax.scatter(cost, value, color=colour, marker="D", s=36, edgecolors="black", linewidths=0.5, label=label)
    for cell, (x, y) in means.items():
        if cell:
            ax.annotate(cell, (x, y), xytext=(4, 3), textcoords="offset points", fontsize=6, color=colour)


def _colours(keys: list[str]) -> dict[str, str | tuple]:
    """matplotlib's 10 default colours while they suffice, then tab20's: no two keys share one up to 20."""
    return {key: f"C{k}" if len(keys) <= 10 else matplotlib.colormaps["tab20"](k % 20) for k, key in enumerate(keys)}


def study_plots(folder: Path, rows: list[str], series: list[str], panels: dict[str, dict[str, dict[str, list[Curves]]]],
                finals: dict[str, Finals]) -> list[Path]:
    """Per metric (the runs' main one): `<metric>_by_round.png`, a panel per column of the table (metric -> column ->
    row -> the runs' curves) with a line per row, a colour per row in the order of `rows`; and
    `<metric>_frontier.png`, every run's final value against its bytes (metric -> series -> cell -> points), a
    colour per series in the order of `series`. A plot that fails is skipped with a warning: the tables are
    written."""
    folder.mkdir(exist_ok=True)
    written = []
    for metric in panels:
        for name, draw in ((f"{metric}_by_round.png", lambda: _round_panels(metric, panels[metric], _colours(rows))),
                           (f"{metric}_frontier.png", lambda: _frontier(metric, finals[metric], _colours(series)))):
            try:
                written.append(_save(draw(), folder / name))
            except Exception as exc:  # noqa: BLE001 - a plot is a by-product of the study
                warnings.warn(f"plot {name} skipped: {type(exc).__name__}: {exc}")
    return written
