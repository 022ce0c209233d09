"""A study's figures (`emulate sweep`, p2p_emulator/analysis/study.py): per metric, each cell's curve by round
(and, for runs with samples.jsonl, by emulated time) and each run's final value against the bytes it sent, with
the Pareto front."""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from .drawing import label_axes, new_figure, save
from .rundir import Curves, higher_is_better


def over_runs(curves: list[Curves]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The curves' x (rounds, or on the time axis the ticks' emulated times), and per x the mean and the sample std
    over runs of each run's mean over nodes (0: one run); only the x some run has a value at (with --eval-every K,
    the scored rounds), so the line joins them."""
    xs = np.unique(np.concatenate([c.x for c in curves]))
    means = np.full((len(curves), len(xs)), np.nan)
    for i, c in enumerate(curves):
        means[i, np.searchsorted(xs, c.x)] = c.mean
    values = np.ma.masked_invalid(means)
    scored = ~np.ma.getmaskarray(values).all(axis=0)
    return (xs[scored], values.mean(axis=0).filled(np.nan)[scored],
            values.std(axis=0, ddof=1).filled(0.0)[scored])


def pareto_front(cost: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Indices of the points that no other point beats with at most their cost and a higher value, by cost."""
    order = np.lexsort((-value, cost))  # by cost; at one cost, the best value first
    best = np.maximum.accumulate(value[order])
    return order[np.r_[True, best[1:] > best[:-1]]]


def _round_panels(metric: str, panels: dict[str, dict[str, list[Curves]]], colours: dict[str, str | tuple],
                  axis: str = "round") -> Figure:
    width = min(len(panels), 4)
    height = math.ceil(len(panels) / width)
    fig = new_figure(3.4 * width + 2.0, 2.8 * height + 0.6)
    axes = fig.subplots(height, width, squeeze=False, sharey=True).ravel()
    for ax, (column, rows) in zip(axes, panels.items()):
        for row, curves in rows.items():
            rounds, mean, std = over_runs(curves)
            ax.plot(rounds, mean, color=colours[row], marker="o" if len(rounds) < 3 else None)
            ax.fill_between(rounds, mean - std, mean + std, color=colours[row], alpha=0.2, linewidth=0)
        label_axes(ax, axis, metric)
        ax.set_title(column, fontsize=9)
    for ax in axes[len(panels):]:
        ax.set_axis_off()
    drawn = [row for row in colours if any(row in rows for rows in panels.values())]
    fig.legend([Line2D([], [], color=colours[row]) for row in drawn], drawn, loc="outside right upper", fontsize=8)
    by = "by round" if axis == "round" else "against emulated time"
    fig.suptitle(f"{metric}: mean over nodes {by}; mean ± std over each cell's runs", fontsize=10)
    return fig


Finals = dict[str, dict[str, list[tuple[float, float]]]]  # colour -> cell -> (bytes, final value) per run


def _frontier(metric: str, finals: Finals, colours: dict[str, str | tuple]) -> Figure:
    """Every run's point; where a cell has several runs (seeds), also their mean, labelled with the cell."""
    fig = new_figure(7.0, 4.4)
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
    label_axes(ax, "bytes", f"final {metric}")
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
                finals: dict[str, Finals], timed: dict[str, dict[str, dict[str, list[Curves]]]] | None = None
                ) -> list[Path]:
    """Per metric (the runs' main one): `<metric>_by_round.png`, a panel per column of the table (metric -> column ->
    row -> the runs' curves) with a line per row, a colour per row in the order of `rows`; and
    `<metric>_frontier.png`, every run's final value against its bytes (metric -> series -> cell -> points), a
    colour per series in the order of `series`. Per metric of `timed` (the runs' sampled curves, as `panels`):
    `<metric>_by_time.png`, as by round against emulated time. A plot that fails is skipped with a warning: the
    tables are written."""
    folder.mkdir(exist_ok=True)
    drawings = []
    for metric in panels:
        drawings += [(f"{metric}_by_round.png", lambda metric=metric: _round_panels(metric, panels[metric],
                                                                                     _colours(rows))),
                     (f"{metric}_frontier.png", lambda metric=metric: _frontier(metric, finals[metric],
                                                                                _colours(series)))]
    for metric in timed or {}:
        drawings.append((f"{metric}_by_time.png",
                         lambda metric=metric: _round_panels(metric, timed[metric], _colours(rows), "time")))
    written = []
    for name, draw in drawings:
        try:
            written.append(save(draw(), folder / name))
        except Exception as exc:  # noqa: BLE001 - a plot is a by-product of the study
            warnings.warn(f"plot {name} skipped: {type(exc).__name__}: {exc}")
    return written
