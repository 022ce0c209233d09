"""Plots at scale: beyond a few dozen nodes a figure's artists and arrays stop growing with the node count."""
import json
import math
import warnings

import numpy as np
import pytest

from p2p_emulator.analysis import drawing, plots
from p2p_emulator.analysis.rundir import LINK_COLUMNS, RunDirWriter, csv_writer, read_run

ROUNDS = 4


def _metric_rows(n: int, metric: str, silent: set[int], blank: int | None) -> list[dict]:
    """Node i's metric drifts with i (accuracy up, error down); `silent` nodes never report it, every
    fifth node skips it in round 1 and no node reports it in round `blank` (not evaluated)."""
    rows = []
    for rnd in range(ROUNDS):
        for i in range(n):
            value = (0.2 + 0.6 * i / n + 0.05 * rnd) if metric == "test_acc" else (1.0 + i / n) / (rnd + 1)
            reports = i not in silent and not (rnd == 1 and i % 5 == 0) and rnd != blank
            rows.append({"round": rnd, "node": i, "t": 0.01 * (rnd + 1) + 1e-3 * i / n,
                         metric: value if reports else None, "within_cluster": min(1.0, 0.5 + 0.1 * rnd + i / n / 10),
                         "bytes_sent": 100, "msgs_sent": 1})
    return rows


def _links(n: int) -> list[dict]:
    """A ring both ways, each link carrying bytes that grow with its source."""
    return [{"src": i, "dst": (i + step) % n, "msgs_sent": 1, "msgs_delivered": 1, "msgs_dropped": 0,
             "bytes_sent": 100 + i, "bytes_delivered": 100 + i, "dropped_loss": 0, "dropped_offline": 0,
             "dropped_corrupt": 0, "dropped_over_limit": 0, "dropped_link_down": 0,
             "dropped_invalid": 0}
            for i in range(n) for step in (1, -1)]


def _graph(n: int) -> list[dict]:
    """Uniform weights over self and ring neighbours in round 0, then more on the successor."""
    return [{"round": rnd, "node": i, "similarity": {str((i + 1) % n): 0.5} if rnd else {},
             "weights": {str(i): 1 / 3, str((i + 1) % n): 1 / 3 + 0.05 * rnd, str((i - 1) % n): 1 / 3 - 0.05 * rnd}}
            for rnd in range(ROUNDS) for i in range(n)]


def _run_dir(path, n: int, metric: str = "test_acc", silent: set = frozenset(), blank: int | None = None):
    """A finished run of `n` nodes with every optional file: links, graph, partition with clusters, churn."""
    path.mkdir()
    availability = [{"node": i, "t_down": 0.005 * (i % 7), "t_up": None if i % 11 == 0 else 0.03}
                    for i in range(0, n, 3)]
    writer = RunDirWriter(path)
    writer.config({"protocol": "mapl", "topology": "ring", "nodes": n})
    writer.jsonl("metrics.jsonl", _metric_rows(n, metric, silent, blank))
    writer.replace("links.csv", csv_writer(LINK_COLUMNS, ([link[c] for c in LINK_COLUMNS] for link in _links(n))))
    writer.jsonl("availability.jsonl", availability)
    writer.jsonl("graph.jsonl", _graph(n))
    writer.finish({"nodes": n, "emulated_seconds": 0.04, "final": {}})
    (path / "partition.json").write_text(json.dumps({"nodes": [{"node": i, "cluster": i % 2} for i in range(n)]}))
    return path


def _figures(path) -> dict:
    run = read_run(path)
    return {name: fig for figures in plots.figure_makers() for name, fig in figures(run)}


def _artists(fig) -> int:
    """Lines, images, patches and what each collection draws (a LineCollection of one line per node is N)."""
    drawn = sum(max(1, len(c.get_paths()), len(c.get_offsets())) for ax in fig.axes for c in ax.collections)
    return drawn + sum(len(ax.lines) + len(ax.images) + len(ax.patches) for ax in fig.axes)


def test_artists_and_arrays_do_not_grow_with_the_node_count(tmp_path):
    few, many = _figures(_run_dir(tmp_path / "few", 50)), _figures(_run_dir(tmp_path / "many", 500))
    assert set(few) == {"test_acc_vs_round.png", "test_acc_vs_time.png", "test_acc_vs_bytes.png",
                        "link_bytes_matrix.png", "link_bytes_topology.png", "learned_graph.png",
                        "cluster_graph.png", "availability.png"}
    assert set(many) == set(few) - {"link_bytes_topology.png"}  # beyond MAX_TOPOLOGY_NODES: not drawn
    assert {name: _artists(fig) for name, fig in many.items()} == {name: _artists(few[name]) for name in many}
    images = [image.get_array() for fig in many.values() for ax in fig.axes for image in ax.images]
    assert images and max(image.size for image in images) < 500 * 500 / 2  # no image is node x node
    assert max(fig.get_size_inches()[1] for fig in many.values()) <= 8


def test_up_to_max_node_lines_every_node_is_drawn(tmp_path):
    n = drawing.MAX_NODE_LINES
    (collection,) = _figures(_run_dir(tmp_path / "run", n))["test_acc_vs_round.png"].axes[0].collections[:1]
    assert len(collection.get_segments()) == n


@pytest.mark.parametrize("metric,silent,expected", [("test_acc", {0}, [1, 2, 3]), ("error", set(), [499, 498, 497])])
def test_the_worst_nodes_are_named(tmp_path, metric, silent, expected):
    """Lowest accuracy (node 0 never reports one: not ranked), highest error."""
    fig = _figures(_run_dir(tmp_path / "run", 500, metric, silent))[f"{metric}_vs_round.png"]
    labels = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert labels == [drawing.SPREAD[True], *(f"worst: node {i}" for i in expected)]


def test_binned_link_matrix_keeps_every_byte(tmp_path):
    n = 1000
    image = _figures(_run_dir(tmp_path / "run", n))["link_bytes_matrix.png"].axes[0].images[0].get_array()
    assert image.shape == (drawing.MAX_MATRIX_SIDE, drawing.MAX_MATRIX_SIDE)
    assert image.sum() == sum(link["bytes_sent"] for link in _links(n))
    assert image.mask.any()  # blocks far off the ring's diagonal have no link


@pytest.mark.parametrize("n", [8, 60])
def test_silent_nodes_plot_without_a_warning(tmp_path, n):
    """Nodes without test samples report no accuracy; some rounds have none from a node, one none at all."""
    run = _run_dir(tmp_path / "run", n, silent={0, 3, n - 1}, blank=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # plot_run turns a failing plot into a warning: it fails here
        written = {p.name for p in plots.plot_run(run)}
    assert {"test_acc_vs_round.png", "test_acc_vs_time.png", "availability.png"} <= written


def test_overlay_artists_do_not_grow_with_the_node_count(tmp_path):
    counts = []
    for n in (50, 500):
        runs = [read_run(_run_dir(tmp_path / f"{metric}{n}", n, metric)) for metric in ("test_acc", "error")]
        counts.append({name: _artists(fig) for name, fig in plots.overlay_figures(runs)})
    assert counts[0] == counts[1] and len(counts[0]) == 6


def test_uptime_per_bin(tmp_path):
    """Node 0 down over the second half, node 1 always up: one block of 2 nodes is 3/4 up, then 1/2."""
    rows = [{"node": 0, "t_down": 0.5, "t_up": None}]
    up = plots._uptime(rows, 2, 1.0, 2)
    half = plots.AVAILABILITY_BINS // 2
    assert up.shape == (1, plots.AVAILABILITY_BINS)
    assert np.allclose(up[0, :half], 1.0) and np.allclose(up[0, half:], 0.5)
    assert math.isclose(plots._uptime(rows, 2, 1.0, 1)[0].mean(), 0.5)
