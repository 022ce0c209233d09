"""A run's charts for the watch page (watch.py), drawn by Plotly from the run directory as it stands.

Each chart is a plotly Figure under a stable id, so the page redraws it in place:

- `metric-round`, `metric-time`: the main metric (test_acc, else e.g. gossip's error) against the
  round and the emulated time at which the round's last node ended it, as its centre over nodes with
  a band (mean ± std; beyond MAX_NODE_LINES nodes the median and 10–90%, as the PNG plots draw it);
- `sampled-time` (--eval-every-seconds): the sampled metric against the emulated time of each tick;
- `bytes-time`: the bytes all nodes sent, summed up to each round's end;
- `links`: bytes sent on each directed link (src x dst; blocks of nodes beyond MAX_MATRIX_SIDE);
- `availability` (churn): the fraction of each time bin each node was up.

The charts hold no more points than the PNG plots: bands over nodes, not a line per node.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from .drawing import AXES, SPREAD, many_nodes, mean_x, spread, usable_axes
from .plots import link_cells, link_rows, uptime
from .rundir import Curves, Run

TEMPLATE = "none"  # Plotly.js's own look; a named template costs 30 ms a chart to build
HEIGHT = 330  # pixels: two charts side by side on a laptop's screen


def _layout(title: str, xlabel: str, ylabel: str) -> dict:
    return dict(title=dict(text=title, font_size=13), xaxis_title=xlabel, yaxis_title=ylabel, template=TEMPLATE,
                height=HEIGHT, margin=dict(l=60, r=20, t=40, b=45), legend=dict(orientation="h", y=-0.25))


def _listed(values: np.ndarray) -> list:
    """Plain numbers with None for NaN: the page and its tests read them as they are."""
    return [None if np.isnan(v) else float(v) for v in np.asarray(values, dtype=float)]


def band_chart(curves: Curves, axis: str, title: str) -> go.Figure:
    """The metric's centre over nodes with its band, against `axis` (a key of drawing.AXES)."""
    many = many_nodes(curves)
    centre, low, high = spread(curves, many)
    x = _listed(mean_x(curves, axis))
    fig = go.Figure([
        go.Scatter(x=x, y=_listed(high), mode="lines", line_width=0, showlegend=False, hoverinfo="skip"),
        go.Scatter(x=x, y=_listed(low), mode="lines", line_width=0, fill="tonexty", fillcolor="rgba(31,119,180,0.2)",
                   showlegend=False, hoverinfo="skip"),
        go.Scatter(x=x, y=_listed(centre), mode="lines+markers", line_color="rgb(31,119,180)", marker_size=4,
                   name=SPREAD[many]),
    ])
    fig.update_layout(**_layout(title, AXES[axis], curves.metric))
    return fig


def metric_charts(run: Run) -> dict[str, go.Figure]:
    """The main metric against the round and the emulated time, and bytes against the emulated time."""
    curves = run.curves()
    if curves is None:
        return {}
    axes = usable_axes(curves)
    charts = {f"metric-{axis}": band_chart(curves, axis, f"{curves.metric} against {AXES[axis]}")
              for axis in ("round", "time") if axis in axes}
    if "time" in axes and "bytes" in axes:
        fig = go.Figure([go.Scatter(x=_listed(curves.round_end), y=_listed(curves.cumulative_bytes),
                                    mode="lines+markers", marker_size=4, name="bytes sent")])
        fig.update_layout(**_layout("bytes sent by all nodes, up to each round's end", AXES["time"], "bytes"))
        fig.update_yaxes(tickformat="~s", ticksuffix="B")
        charts["bytes-time"] = fig
    return charts


def sampled_chart(run: Run) -> dict[str, go.Figure]:
    """--eval-every-seconds: the sampled metric against each tick's emulated time."""
    curves = run.curves(axis="time")
    if curves is None:
        return {}
    return {"sampled-time": band_chart(curves, "time", f"{curves.metric}, scored every "
                                                       f"{run.config.get('eval_every_seconds', '?')} s")}


def link_chart(run: Run) -> dict[str, go.Figure]:
    """Bytes sent on each directed link so far (links.csv is rewritten every few seconds of the run)."""
    n, src, dst, sent = link_rows(run)
    if not sent.any():
        return {}
    block, cells = link_cells(n, src, dst, sent)
    ids = list(range(0, n, block))
    z = [[None if masked else float(value) for value, masked in zip(row, mask)]
         for row, mask in zip(cells.data, np.ma.getmaskarray(cells))]
    fig = go.Figure(go.Heatmap(z=z, x=ids, y=ids, colorscale="Viridis", colorbar_title="bytes",
                               hovertemplate="%{y} → %{x}: %{z:.3s}B<extra></extra>"))
    per_block = "" if block == 1 else f" (blocks of {block} nodes, summed)"
    fig.update_layout(**_layout(f"bytes per link{per_block}; blank: no link", "destination", "source"))
    fig.update_yaxes(autorange="reversed")
    return {"links": fig}


def availability_chart(run: Run) -> dict[str, go.Figure]:
    """Churn: when each node (or block of nodes) was up."""
    cells = uptime(run)
    if cells is None:
        return {}
    up, end, block = cells
    bins = up.shape[1]
    fig = go.Figure(go.Heatmap(z=up.tolist(), x=((np.arange(bins) + 0.5) * end / bins).tolist(),
                               y=list(range(0, up.shape[0] * block, block)), zmin=0, zmax=1,
                               colorscale=[[0, "#d62728"], [1, "#b5deb5"]], colorbar_title="up"))
    fig.update_layout(**_layout("node availability (green up, red down)", AXES["time"],
                                "node" if block == 1 else f"node, blocks of {block}"))
    return {"availability": fig}


CHARTS = (metric_charts, sampled_chart, link_chart, availability_chart)


def warm_up() -> None:
    """Build one chart of each kind: Plotly loads its validators when first used (about half a second), which would
    otherwise count as a drawing's time in the watch server's pacing."""
    fig = go.Figure([go.Scatter(x=[0], y=[0], fill="tonexty"), go.Heatmap(z=[[0]])])
    fig.update_layout(**_layout("", "", ""))
    fig.update_yaxes(tickformat="~s", autorange="reversed")
    fig.to_json()


def charts(run: Run) -> dict[str, go.Figure]:
    """Every chart the run has input for, by id."""
    return {name: fig for make in CHARTS for name, fig in make(run).items()}
