"""PNG plots of a run directory, written to RUN_DIR/plots at the end of every run.

- `<metric>_vs_round.png`, `<metric>_vs_time.png`, `<metric>_vs_bytes.png`: the run's
  main metric (test_acc, else e.g. gossip's error), mean over nodes with a ±std band
  and every node faint, against the round, the emulated time (the mean at the time the
  last node ended the round, each node at its own) and the bytes all nodes sent so far;
- `link_bytes_matrix.png`: bytes sent on each directed link (src x dst);
- `link_bytes_topology.png`: the graph, each edge as wide as the bytes it carried;
- `learned_graph.png` (mapl, l2c: graph.jsonl): the mixing matrix W after warm-up,
  half-way and at the end;
- `cluster_graph.png` (mapl with a clustered partition): the weight each node puts
  on its own cluster, and the mean similarity c_ij within and across clusters;
- `availability.png` (churn: availability.jsonl): when each node was up.

Figures are built without pyplot (no global figure registry, no display: PNGs go
through the Agg canvas), so nothing stays open once a plot is written.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import networkx as nx
import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator

from .rundir import Curves, Run, RunDirError, load_run

DPI = 110
AXES = {  # x-axis name -> label
    "round": "round",
    "time": "emulated time (s)",
    "bytes": "bytes sent, all nodes",
}


def _figure(width: float = 6.4, height: float = 4.0) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    return path


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


def _band(ax, x, curves: Curves, color: str, **line) -> None:
    """The mean over nodes (dots when there are too few rounds for a line) with a ±std band."""
    mean, std = curves.mean, curves.std
    ax.plot(x, mean, color=color, marker="o" if len(x) < 3 else None, **line)
    ax.fill_between(x, mean - std, mean + std, alpha=0.2, color=color, linewidth=0)


def metric_plots(run: Run, plots: Path) -> list[Path]:
    curves = run.curves()
    if curves is None:
        return []
    written = []
    for axis in _usable_axes(curves):
        fig = _figure()
        ax = fig.add_subplot()
        nodes = np.stack([_node_x(curves, axis), curves.values], axis=-1)  # (N, R, 2): one line per node
        ax.add_collection(LineCollection(nodes, colors="grey", alpha=0.35, linewidths=0.7, label="each node"),
                          autolim=True)
        _band(ax, _mean_x(curves, axis), curves, "C0", linewidth=2, label="mean ± std over nodes")
        _label_axes(ax, axis, curves.metric)
        ax.set_title(f"{run.name}: {run.protocol} on {run.topology}", fontsize=9)
        ax.legend(fontsize=8)
        written.append(_save(fig, plots / f"{curves.metric}_vs_{axis}.png"))
    return written


def _link_bytes(run: Run) -> tuple[int, dict[tuple[int, int], int]]:
    sent = {(row["src"], row["dst"]): row["bytes_sent"] for row in run.links or ()}
    n = max([run.num_nodes, *(max(pair) + 1 for pair in sent)])
    return n, sent


def _tick_nodes(ax, n: int) -> None:
    if n <= 16:
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def link_plots(run: Run, plots: Path) -> list[Path]:
    n, sent = _link_bytes(run)
    if not any(sent.values()):  # no links.csv, or nothing sent (local training)
        return []
    matrix = np.ma.masked_all((n, n))
    for (src, dst), size in sent.items():
        matrix[src, dst] = size
    fig = _figure(5.6, 4.8)
    ax = fig.add_subplot()
    image = ax.imshow(matrix, cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="bytes sent", format=EngFormatter(unit="B"))
    ax.set_xlabel("destination")
    ax.set_ylabel("source")
    _tick_nodes(ax, n)
    ax.set_title(f"{run.name}: bytes per link (blank: no link)", fontsize=9)
    return [_save(fig, plots / "link_bytes_matrix.png"), _topology_plot(run, n, sent, plots)]


def _layout(graph: nx.Graph) -> dict:
    # Dense graphs read best on a circle; sparse ones (rings, tori) as the spring layout unfolds them
    # (too slow beyond a few hundred nodes, where no layout is legible anyway).
    if not 3 <= graph.number_of_nodes() <= 200 or nx.density(graph) > 0.3:
        return nx.circular_layout(graph)
    return nx.spring_layout(graph, seed=0)


def _topology_plot(run: Run, n: int, sent: dict[tuple[int, int], int], plots: Path) -> Path:
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    for (src, dst), size in sent.items():
        if graph.has_edge(src, dst):
            graph[src][dst]["bytes"] += size
        else:
            graph.add_edge(src, dst, bytes=size)
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
    return _save(fig, plots / "link_bytes_topology.png")


def weight_matrices(rows: list[dict], n: int) -> dict[int, np.ndarray]:
    """graph.jsonl rows -> round -> W (row i: node i's weights; absent entries 0)."""
    matrices: dict[int, np.ndarray] = {}
    for row in rows:
        rnd, i = int(row["round"]), int(row["node"])
        w = matrices.setdefault(rnd, np.zeros((n, n)))
        for j, weight in row["weights"].items():
            w[i, int(j)] = weight
    return dict(sorted(matrices.items()))


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


def learned_graph_plot(run: Run, plots: Path) -> list[Path]:
    rows = run.stream("graph")
    if not rows:
        return []
    n = max([run.num_nodes, *(int(r["node"]) + 1 for r in rows),
             *(int(j) + 1 for r in rows for j in r["weights"])])
    matrices = weight_matrices(rows, n)
    shown = snapshot_rounds(rows)
    top = max(float(matrices[r].max()) for r in shown) or 1.0
    fig = _figure(4.2 * len(shown) + 0.8, 4.2)
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    for ax, rnd in zip(axes, shown):
        image = ax.imshow(matrices[rnd], cmap="magma_r", vmin=0, vmax=top, interpolation="nearest")
        ax.set_title(f"round {rnd}", fontsize=9)
        ax.set_xlabel("j (neighbour)")
        _tick_nodes(ax, n)
    axes[0].set_ylabel("i (node)")
    fig.colorbar(image, ax=list(axes), label="w_ij")
    fig.suptitle(f"{run.name}: learned collaboration graph W ({run.protocol})", fontsize=10)
    return [_save(fig, plots / "learned_graph.png")]


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


def cluster_plot(run: Run, plots: Path) -> list[Path]:
    """Left: the weight each node puts on its own cluster; right: mean c_ij within and across clusters."""
    rows, clusters, mass = run.stream("graph"), run.clusters, run.curves("within_cluster")
    if not rows or clusters is None or mass is None or np.all(np.isnan(mass.values)):
        return []
    fig = _figure(10.0, 4.0)
    left, right = fig.subplots(1, 2)
    nodes = np.stack([_node_x(mass, "round"), mass.values], axis=-1)
    left.add_collection(LineCollection(nodes, colors="grey", alpha=0.35, linewidths=0.7, label="each node"),
                        autolim=True)
    _band(left, mass.rounds, mass, "C0", linewidth=2, label="mean ± std over nodes")
    _label_axes(left, "round", "weight on own cluster (w_ii included)")
    left.set_ylim(-0.02, 1.02)
    left.legend(fontsize=8)
    for (side, (rounds, mean)), color in zip(cluster_similarity(rows, clusters).items(), ("C2", "C3")):
        right.plot(rounds, mean, color=color, marker="o" if len(rounds) < 3 else None, label=f"{side} (while linked)")
    _label_axes(right, "round", "mean similarity c_ij")
    right.legend(fontsize=8)
    fig.suptitle(f"{run.name}: graph learning against the partition's clusters ({run.protocol})", fontsize=10)
    return [_save(fig, plots / "cluster_graph.png")]


def availability_plot(run: Run, plots: Path) -> list[Path]:
    rows = [r for r in run.stream("availability") or () if "node" in r and "t_down" in r]
    if not rows:
        return []
    ends = [run.emulated_seconds, *(float(r["t_up"]) for r in rows if r.get("t_up") is not None)]
    end = max(e for e in ends if not math.isnan(e))
    n = max([run.num_nodes, *(int(r["node"]) + 1 for r in rows)])
    fig = _figure(7.0, max(2.5, 0.22 * n + 1.2))
    ax = fig.add_subplot()
    for i in range(n):
        ax.broken_barh([(0, end)], (i - 0.4, 0.8), color="tab:green", alpha=0.35, linewidth=0)
    for row in rows:
        down = float(row["t_down"])
        up = end if row.get("t_up") is None else float(row["t_up"])
        ax.broken_barh([(down, up - down)], (int(row["node"]) - 0.4, 0.8), color="tab:red", linewidth=0)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlim(0, end)
    ax.set_xlabel("emulated time (s)")
    ax.set_ylabel("node")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{run.name}: node availability (green up, red down)", fontsize=9)
    return [_save(fig, plots / "availability.png")]


PLOTS = (metric_plots, link_plots, learned_graph_plot, cluster_plot, availability_plot)


def plot_run(out_dir: Path) -> list[Path]:
    """Write every plot that applies to the run at `out_dir` under out_dir/plots; the paths written.

    A plot whose optional input is missing is skipped; a plot that fails is
    skipped with a warning, so a finished run never fails for its plots.
    """
    try:
        run = load_run(out_dir)
    except RunDirError as exc:
        warnings.warn(f"no plots: {exc}")
        return []
    plots = Path(out_dir) / "plots"
    plots.mkdir(exist_ok=True)
    written = []
    for plot in PLOTS:
        try:
            written += plot(run, plots)
        except Exception as exc:  # noqa: BLE001 - a plot is a by-product; the run's data is already written
            warnings.warn(f"plot {plot.__name__} skipped: {type(exc).__name__}: {exc}")
    return written


def overlay_plots(runs: list[Run], out: Path) -> list[Path]:
    """One figure per metric and x-axis with every run's mean (± std band) as a labelled line."""
    by_metric: dict[str, list[tuple[Run, Curves]]] = {}
    for run in runs:
        curves = run.curves()
        if curves is not None:
            by_metric.setdefault(curves.metric, []).append((run, curves))
    written = []
    for metric, group in by_metric.items():
        for axis in AXES:
            drawn = [(run, c) for run, c in group if axis in _usable_axes(c)]
            if not drawn:
                continue
            fig = _figure(7.0, 4.4)
            ax = fig.add_subplot()
            for k, (run, curves) in enumerate(drawn):
                _band(ax, _mean_x(curves, axis), curves, f"C{k % 10}", linewidth=1.8, label=run.name)
            finals = [c.cumulative_bytes[-1] for _, c in drawn] if axis == "bytes" else []
            if finals and max(finals) > 20 * min(finals):  # runs far apart in bytes: linear would squash the cheap ones
                ax.set_xscale("log")  # before _label_axes: setting the scale resets the tick formatter
            _label_axes(ax, axis, f"{metric} (mean ± std over nodes)")
            ax.legend(fontsize=7)
            written.append(_save(fig, out / f"{metric}_vs_{axis}.png"))
    return written
