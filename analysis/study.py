"""What a sweep shows: tables over the runs of a study, read from their run directories.

A study is a list of runs, each a run directory and the label it has on every axis of the
grid. `parse_table` checks the grid's `table:` section against the axes; `tabulate` writes
rows x columns of each metric (mean ± std over the remaining axes) and the per-run
comparison of `emulate report`.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from .output import mean_std, metric_header, rich_table, write_table
from .report import write_comparison
from .rundir import Run, RunDirError, is_finished, load_run


class StudyError(Exception):
    """A bad `table:` section or an unreadable run (one line for the user)."""


@dataclass(frozen=True)
class TableSpec:
    rows: str
    columns: str | None
    metrics: list[str]


@dataclass(frozen=True)
class StudyRun:
    """One run of the study: its directory and its label on every axis."""
    path: Path
    labels: dict[str, str]


def parse_table(spec, axes: dict[str, list[str]], where: str) -> TableSpec:
    """The `table:` section of a grid file, checked against the grid's axes (axis -> its labels, in order)."""
    if not isinstance(spec, dict) or set(spec) - {"rows", "columns", "metric"}:
        raise StudyError(f"{where}: table: expected a mapping of rows, columns and metric")
    plain = [axis for axis in axes if axis != "seed"] or list(axes)
    rows = spec.get("rows", plain[0])
    columns = spec.get("columns", next((a for a in plain if a != rows), None))
    for role, axis in (("rows", rows), ("columns", columns)):
        if axis is not None and axis not in axes:
            raise StudyError(f"{where}: table: {role} {axis!r} is not an axis of the grid ({', '.join(axes)})")
    if rows == columns:
        raise StudyError(f"{where}: table: rows and columns must be different axes")
    metric = spec.get("metric", "test_acc")
    metrics = metric if isinstance(metric, list) else [metric]
    if not metrics or not all(isinstance(m, str) and m for m in metrics):
        raise StudyError(f"{where}: table: metric must be a name or a list of names")
    return TableSpec(rows, columns, metrics)


def _value(run: Run, metric: str) -> float:
    value = run.summary["final"].get(metric, run.summary.get(metric))
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def paper_table(spec: TableSpec, axes: dict[str, list[str]], runs: list[StudyRun], finished: dict[Path, Run],
                metric: str):
    """rows x columns of `metric`: mean ± std over the runs of each cell; formatted and raw rows."""
    column_labels = axes[spec.columns] if spec.columns else [metric_header(metric)]
    cells: dict[tuple[str, str], list[float]] = {}
    for study_run in runs:
        run = finished.get(study_run.path)
        value = math.nan if run is None else _value(run, metric)
        if not math.isnan(value):
            column = study_run.labels[spec.columns] if spec.columns else column_labels[0]
            cells.setdefault((study_run.labels[spec.rows], column), []).append(value)
    shown, raw = [], []
    for row in axes[spec.rows]:
        shown_row, raw_row = [row], [row]
        for column in column_labels:
            values = cells.get((row, column), [])
            mean = statistics.fmean(values) if values else math.nan
            std = statistics.stdev(values) if len(values) > 1 else None
            shown_row.append(mean_std(metric, mean, std))
            raw_row += [mean, math.nan if std is None else std, len(values)]
        shown.append(shown_row)
        raw.append(raw_row)
    headers = [spec.rows, *column_labels]
    csv_headers = [spec.rows, *(f"{c} {part}" for c in column_labels for part in ("mean", "std", "runs"))]
    return headers, shown, csv_headers, raw


def tabulate(out: Path, spec: TableSpec, axes: dict[str, list[str]], runs: list[StudyRun],
             console: Console) -> list[Path]:
    """Every table of the study into `out`, shown on `console`; the files written."""
    finished = {}
    for study_run in runs:
        if is_finished(study_run.path):
            try:
                finished[study_run.path] = load_run(study_run.path)
            except RunDirError as exc:
                raise StudyError(str(exc)) from None
    written = []
    spread = [axis for axis in axes if axis not in (spec.rows, spec.columns)]
    for metric in spec.metrics:
        headers, shown, csv_headers, raw = paper_table(spec, axes, runs, finished, metric)
        written += write_table(out / f"table_{metric}", headers, shown, csv_headers, raw)
        over = f"mean ± std over {', '.join(spread)}" if spread else "one run per cell"
        shape = f"{spec.rows} × {spec.columns}" if spec.columns else spec.rows
        console.print(rich_table(f"{metric_header(metric)}: {shape} ({over})", headers, shown))
    if finished:
        written += write_comparison(list(finished.values()), out / "runs")[1]
    return written
