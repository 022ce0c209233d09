"""graph.jsonl, the collaboration graph MAPL and L2C learn: `learned_graph.png` (W after warm-up, half-way and at
the end; beyond MAX_MATRIX_SIDE nodes, the mean w_ij over blocks), `cluster_graph.png` (MAPL on a partition with
clusters: the weight each node puts on its own cluster, drawn as the metric is, and the mean similarity c_ij
within and across clusters) and the measure `task_identified_round:SHARE`."""
from __future__ import annotations

import heapq
import math
import statistics

import numpy as np

from p2p_emulator.analysis.drawing import (Figures, block_sizes, cell_sums, draw_nodes, label_axes, label_nodes,
                                           new_figure, node_block, node_image)
from p2p_emulator.analysis.extensions import Extension
from p2p_emulator.analysis.measures import Measure, fraction
from p2p_emulator.analysis.rundir import Run


def weight_matrices(rows: list[dict], n: int, rounds: list[int], block: int = 1) -> dict[int, np.ndarray]:
    """graph.jsonl rows -> round -> W, for `rounds` (row i: node i's weights; absent entries 0);
    with block > 1, the mean w_ij over each block x block cell."""
    side = math.ceil(n / block)
    sizes = block_sizes(n, block)
    matrices = {}
    for rnd in rounds:
        entries = [(int(row["node"]), int(j), float(w)) for row in rows if int(row["round"]) == rnd
                   for j, w in row["weights"].items()]
        i, j, w = np.array(entries, dtype=float).reshape(-1, 3).T
        sums = cell_sums(i.astype(int) // block, j.astype(int) // block, w, (side, side))
        matrices[rnd] = sums / np.outer(sizes, sizes)
    return matrices


def _even(weights: dict) -> bool:
    """A node spreads its weight evenly over the nodes it records a weight for."""
    values = list(weights.values())
    return not values or max(values) - min(values) <= 1e-6


def shown_rounds(rows: list[dict]) -> list[int]:
    """The first round after warm-up (some node's weights uneven; else the first round), the middle and the last."""
    rounds = sorted({int(row["round"]) for row in rows})
    learned = min((int(row["round"]) for row in rows if not _even(row["weights"])), default=rounds[0])
    later = [r for r in rounds if r >= learned]
    return sorted({learned, later[len(later) // 2], later[-1]})


def learned_graph_figures(run: Run) -> Figures:
    """W after warm-up, half-way and at the end, side by side on one colour scale."""
    rows = run.stream("graph")
    if not rows:
        return
    n = max([run.num_nodes, *(int(r["node"]) + 1 for r in rows),
             *(int(j) + 1 for r in rows for j in r["weights"])])
    shown, block = shown_rounds(rows), node_block(n)
    matrices = weight_matrices(rows, n, shown, block)
    top = max(float(m.max()) for m in matrices.values()) or 1.0
    fig = new_figure(4.2 * len(shown) + 0.8, 4.2)
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    for ax, rnd in zip(axes, shown):
        image = node_image(ax, matrices[rnd], block, cmap="magma_r", vmin=0, vmax=top)
        ax.set_title(f"round {rnd}", fontsize=9)
        label_nodes(ax, n, block, "j (neighbour)", "i (node)" if ax is axes[0] else "")
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
    fig = new_figure(10.0, 4.0)
    left, right = fig.subplots(1, 2)
    draw_nodes(left, mass, "round", higher_better=True)
    label_axes(left, "round", "weight on own cluster (w_ii included)")
    left.set_ylim(-0.02, 1.02)
    left.legend(fontsize=8)
    for (side, (rounds, mean)), color in zip(cluster_similarity(rows, clusters).items(), ("C2", "C3")):
        right.plot(rounds, mean, color=color, marker="o" if len(rounds) < 3 else None, label=f"{side} (while linked)")
    label_axes(right, "round", "mean similarity c_ij")
    right.legend(fontsize=8)
    fig.suptitle(f"{run.name}: graph learning against the partition's clusters ({run.protocol})", fontsize=10)
    yield "cluster_graph.png", fig


def task_identified_round(run: Run, share: float) -> float:
    """The first round in which `share` of the nodes weigh their same-task peers (partition clusters) above every
    other neighbour (graph.jsonl)."""
    clusters, rows = run.clusters, run.stream("graph")
    if not clusters or not rows:
        return math.nan
    hits: dict[int, list[bool]] = {}
    for row in rows:
        node, weights = row["node"], {int(j): w for j, w in row["weights"].items()}
        others = [j for j in weights if j != node]
        peers = {j for j in others if clusters.get(j) == clusters[node]}
        top = heapq.nlargest(len(peers), others, key=weights.get)
        hits.setdefault(row["round"], []).append(set(top) == peers)
    return next((float(rnd) for rnd, found in sorted(hits.items()) if statistics.fmean(found) >= share), math.nan)


EXTENSION = Extension(
    figures=(learned_graph_figures, cluster_figures),
    measures={"task_identified_round": Measure(task_identified_round, "task_identified_round:SHARE (0 < SHARE <= 1)",
                                               (fraction,))},
)
