"""What a sweep shows: tables and plots over the runs of a study, read from their run directories.

A study is a list of runs, each a run directory and the label it has on every axis of the
grid. `parse_table` checks the grid's `table:` section against the axes; `tabulate` writes
the tables, the time-to-target table and the plots into the sweep's folder, and the per-run
comparison of `emulate report` (runs.md).

The `table:` section (every key optional):

    rows: method                 # an axis, or a list of axes (a row per combination); default: all but seed
    columns: scenario            # an axis: per metric, table_<metric> of rows x columns. Absent: table.md with
                                 # a column per metric (and table_<metric> with that one column)
    metric: [test_acc, bytes_per_round]      # default test_acc
    relative_to: {bytes_per_round: FedAvg}   # that metric over the FedAvg row's too, column by column
    target: 0.9                  # time_to_target.md: emulated time and bytes until the mean over nodes of
    target_metric: test_acc      #   target_metric (default test_acc) first reaches the target

A cell is the mean ± std over the runs that share its row and column (the other axes,
typically seed). A metric is a key of summary.json, its "final" entry first (test_acc:
the mean over nodes at the last round) and then the top level (bytes_total,
route_agreement, task_identification, ...), or a measure: one of MEASURES or an installed
analysis extension's (extensions.py), some with arguments after colons (bytes_per_round:5-9,
client_acc:0). plots/ gets, per metric the runs log
as their main one, `<metric>_by_round.png` (a panel per column, a line per row: the
mean over the cell's runs of the mean over nodes, with a ± std band over those runs) and
`<metric>_frontier.png` (each run's final value against its total bytes, a colour per
row, the Pareto front drawn).
"""
from __future__ import annotations

import itertools
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rich.console import Console

from .extensions import extension_measures
from .measures import ROUND, Measure, per, round_or_last, round_range, whole_number
from .output import mean_std, metric_header, rich_table, write_table
from .report import write_comparison
from .rundir import Curves, Run, RunDirError, higher_is_better, is_finished, read_run
from .study_plots import study_plots

TABLE_KEYS = ("rows", "columns", "metric", "relative_to", "target", "target_metric")


class StudyError(Exception):
    """A bad `table:` section or an unreadable run (one line for the user)."""


# -- the built-in measures: numbers a run directory gives beyond summary.json ------------------------------------


def summary_value(run: Run, key: str) -> float:
    """summary.json's final `key` (the last round's mean over nodes), else its top-level `key`; NaN if neither."""
    value = run.summary["final"].get(key, run.summary.get(key))
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _round_rows(run: Run, rnd: int | None) -> list[dict]:
    """metrics.jsonl rows of round `rnd`; None: the last round."""
    rnd = max(row["round"] for row in run.metrics) if rnd is None else rnd
    return [row for row in run.metrics if row["round"] == rnd]


def bytes_per_round(run: Run, rounds: range | None = None) -> float:
    if rounds is None:
        return per(summary_value(run, "bytes_total"), summary_value(run, "rounds"))
    return sum(row.get("bytes_sent", 0) for row in run.metrics if row["round"] in rounds) / len(rounds)


def params_sent(run: Run, rounds: range | None = None) -> float:
    """Tensor entries sent by all nodes, over `rounds` or the whole run; NaN for a protocol that logs no params_sent."""
    counts = [row["params_sent"] for row in run.metrics
              if "params_sent" in row and (rounds is None or row["round"] in rounds)]
    return float(sum(counts)) if counts else math.nan


def messages_per_round(run: Run) -> float:
    return per(summary_value(run, "messages_total"), summary_value(run, "rounds"))


def seconds_per_round(run: Run) -> float:
    return per(run.emulated_seconds, summary_value(run, "rounds"))


def kind_messages_per_round(run: Run, kind: str) -> float:
    """Messages of `kind` all nodes sent, per round (messages.jsonl)."""
    return per(run.kinds.get(kind, (0, 0))[0], summary_value(run, "rounds"))


def kind_bytes_per_round(run: Run, kind: str) -> float:
    """Bytes of the messages of `kind` all nodes sent, per round (messages.jsonl)."""
    return per(run.kinds.get(kind, (0, 0))[1], summary_value(run, "rounds"))


def kind_sent(runs: list[Run], kind: str) -> str | None:
    """What keeps the runs from a per-kind measure: a run without messages.jsonl, or a kind that none of them
    sent (misspelt, it would read as 0 in every cell)."""
    untraced = next((run for run in runs if run.kinds is None), None)
    if untraced is not None:
        return f"{untraced.path} has no messages.jsonl: the measure needs runs made with --trace (trace: true)"
    sent = sorted({kind for run in runs for kind in run.kinds})
    if runs and kind not in sent:
        return f"no run sent a message of kind {kind!r} (the runs sent {', '.join(sent) or 'none'})"
    return None


def bytes_per_node(run: Run) -> float:
    return per(summary_value(run, "bytes_total"), summary_value(run, "nodes"))


def bytes_per_message(run: Run, rnd: int | None) -> float:
    rows = _round_rows(run, rnd)
    return per(sum(row.get("bytes_sent", 0) for row in rows), sum(row.get("msgs_sent", 0) for row in rows))


def _accuracies(run: Run) -> dict[int, float]:
    """Node -> test accuracy at the last round, for the nodes that report one."""
    return {row["node"]: row["test_acc"] for row in _round_rows(run, None) if "test_acc" in row}


def honest_acc(run: Run) -> float:
    adversaries = set(run.summary.get("adversaries", []))
    honest = [acc for node, acc in _accuracies(run).items() if node not in adversaries]
    return statistics.fmean(honest) if honest else math.nan


def client_acc(run: Run, k: int) -> float:
    scoring = sorted(_accuracies(run).items())  # a server scores nothing: client k is the k-th node that does
    return scoring[k][1] if k < len(scoring) else math.nan


def offline_share(run: Run) -> float:
    end = run.emulated_seconds
    down = sum(min(end, end if spell.get("t_up") is None else spell["t_up"]) - min(end, spell["t_down"])
               for spell in run.stream("availability") or ())
    return per(down, run.num_nodes * end)


def seconds(text: str) -> float:
    """Emulated seconds, above 0."""
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(text)
    return value


def level(text: str) -> float:
    """A target level of a metric: any finite number."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def metric_name(text: str) -> str:
    """The name of a column of samples.jsonl or metrics.jsonl."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text):
        raise ValueError(text)
    return text


def message_kind(text: str) -> str:
    """A message kind as messages.jsonl names it (secagg.keys)."""
    if not text:
        raise ValueError(text)
    return text


def acc_at(run: Run, at: float) -> float:
    """The mean over nodes of the sampled test_acc at the last tick at or before `at` emulated seconds;
    NaN without samples.jsonl (--eval-every-seconds) or before its first tick."""
    return run.value_at(at, "test_acc")


def _to_target(run: Run, target: float, metric: str, part: int) -> float:
    reached = run.time_to_target(metric, target)
    return math.nan if reached is None else reached[part]


def time_to_target(run: Run, metric: str, target: float) -> tuple[float, float] | None:
    """Emulated seconds and bytes sent (all nodes) until the mean over nodes of `metric` first reaches `target`
    (at least, or at most for a loss or an error); None if it never does: Run.time_to_target, from samples.jsonl
    when the run has samples of `metric`, else at the end of the first round whose mean reaches it."""
    return run.time_to_target(metric, target)


MEASURES = {
    "bytes_per_round": Measure(bytes_per_round, "bytes_per_round or bytes_per_round:FIRST-LAST (rounds, inclusive)",
                               (round_range,), optional=1),
    "params_sent": Measure(params_sent, "params_sent or params_sent:FIRST-LAST (rounds, inclusive)", (round_range,),
                           optional=1),
    "messages_per_round": Measure(messages_per_round, "messages_per_round"),
    "kind_bytes_per_round": Measure(kind_bytes_per_round,
                                    "kind_bytes_per_round:KIND (bytes all nodes sent per round in messages of KIND, "
                                    "messages.jsonl's kind; --trace)", (message_kind,), needs="trace", check=kind_sent),
    "kind_messages_per_round": Measure(kind_messages_per_round,
                                       "kind_messages_per_round:KIND (messages of KIND all nodes sent per round, "
                                       "messages.jsonl's kind; --trace)", (message_kind,), needs="trace",
                                       check=kind_sent),
    "seconds_per_round": Measure(seconds_per_round, "seconds_per_round"),
    "bytes_per_node": Measure(bytes_per_node, "bytes_per_node"),
    "bytes_per_message": Measure(bytes_per_message, f"bytes_per_message:ROUND ({ROUND})", (round_or_last,)),
    "honest_acc": Measure(honest_acc, "honest_acc"),
    "client_acc": Measure(client_acc, "client_acc:K (K from 0: the K-th node reporting test_acc)", (whole_number,)),
    "offline_share": Measure(offline_share, "offline_share"),
    "acc_at": Measure(acc_at, "acc_at:SECONDS (the sampled test_acc at that emulated time; --eval-every-seconds)",
                      (seconds,)),
    "time_to_target": Measure(lambda run, target, metric="test_acc": _to_target(run, target, metric, 0),
                              "time_to_target:X or time_to_target:X:METRIC (emulated seconds until the mean over "
                              "nodes of METRIC, default test_acc, reaches X)", (level, metric_name), optional=1),
    "bytes_to_target": Measure(lambda run, target, metric="test_acc": _to_target(run, target, metric, 1),
                               "bytes_to_target:X or bytes_to_target:X:METRIC (bytes all nodes sent until the mean "
                               "over nodes of METRIC, default test_acc, reaches X)", (level, metric_name), optional=1),
    "idle_fraction": Measure(lambda run: run.idle_fraction, "idle_fraction"),
    "median_staleness": Measure(lambda run: run.median_staleness, "median_staleness"),
}


def measures() -> dict[str, Measure]:
    """Every measure a table may name: the built-in ones, then the installed extensions' (a built-in name wins)."""
    return MEASURES | {name: measure for name, measure in extension_measures().items() if name not in MEASURES}


@dataclass(frozen=True)
class Metric:
    """A table's metric as the grid names it: a summary.json key, or a measure with its arguments."""
    name: str
    measure: Measure | None = None
    arguments: tuple = ()

    def of(self, run: Run) -> float:
        if self.measure is None:
            return summary_value(run, self.name)
        return float(self.measure.compute(run, *self.arguments))

    @property
    def counted(self) -> bool:
        return self.measure is not None and self.measure.counted


def parse_metric(text, where: str) -> Metric:
    if not isinstance(text, str) or not text:
        raise StudyError(f"{where}: table: metric must be a name or a list of names")
    name, *given = text.split(":")
    known = measures()
    measure = known.get(name)
    if measure is None:
        if given:
            raise StudyError(f"{where}: table: metric {text!r}: no measure {name!r} (measures: {', '.join(known)})")
        return Metric(text)
    if not len(measure.arguments) - measure.optional <= len(given) <= len(measure.arguments):
        raise StudyError(f"{where}: table: metric {text!r}: expected {measure.usage}")
    try:
        arguments = tuple(parse(argument) for parse, argument in zip(measure.arguments, given))
    except ValueError:
        raise StudyError(f"{where}: table: metric {text!r}: expected {measure.usage}") from None
    return Metric(text, measure, arguments)


# -- the table: section ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TableSpec:
    rows: tuple[str, ...]
    columns: str | None
    metrics: tuple[Metric, ...]
    relative_to: dict[str, str]  # metric name -> the row label it is divided by
    target: float | None = None
    target_metric: str = "test_acc"


@dataclass(frozen=True)
class StudyRun:
    """One run of the study: its directory and its label on every axis."""
    path: Path
    labels: dict[str, str]


def _axes_named(value, role: str, axes: dict[str, list[str]], where: str) -> tuple[str, ...]:
    names = value if isinstance(value, list) else [value]
    for name in names:
        if name not in axes:
            raise StudyError(f"{where}: table: {role} {name!r} is not an axis of the grid ({', '.join(axes)})")
    if not names or len(set(names)) < len(names):
        raise StudyError(f"{where}: table: {role} must name an axis or a list of different axes")
    return tuple(names)


def _relative_to(value, rows: tuple[str, ...], axes: dict[str, list[str]], metrics: tuple[Metric, ...],
                 where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise StudyError(f"{where}: table: relative_to: expected a mapping of metric to the label of a row")
    if value and len(rows) > 1:
        raise StudyError(f"{where}: table: relative_to needs rows to be one axis")
    names = [m.name for m in metrics]
    for metric, label in value.items():
        if metric not in names:
            raise StudyError(f"{where}: table: relative_to: {metric!r} is not one of the table's metrics "
                             f"({', '.join(names)})")
        if str(label) not in axes[rows[0]]:
            raise StudyError(f"{where}: table: relative_to: {metric}: {label!r} is not a label of {rows[0]} "
                             f"({', '.join(axes[rows[0]])})")
    return {metric: str(label) for metric, label in value.items()}


def _target(spec: dict, where: str) -> tuple[float | None, str]:
    target, metric = spec.get("target"), spec.get("target_metric", "test_acc")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))):
        raise StudyError(f"{where}: table: target: expected a number, got {target!r}")
    if not isinstance(metric, str) or not metric or ":" in metric:
        raise StudyError(f"{where}: table: target_metric: expected the name of a metric in metrics.jsonl")
    return (None if target is None else float(target)), metric


def parse_table(spec, axes: dict[str, list[str]], where: str) -> TableSpec:
    """The `table:` section of a grid file, checked against the grid's axes (axis -> its labels, in order)."""
    if not isinstance(spec, dict) or set(spec) - set(TABLE_KEYS):
        raise StudyError(f"{where}: table: expected a mapping of {', '.join(TABLE_KEYS)}")
    rows = _axes_named(spec.get("rows", [a for a in axes if a != "seed"] or list(axes)), "rows", axes, where)
    columns = spec.get("columns")
    if columns is not None:
        columns = _axes_named(columns, "columns", axes, where)
        if len(columns) > 1:
            raise StudyError(f"{where}: table: columns must name one axis")
        columns = columns[0]
        if columns in rows:
            raise StudyError(f"{where}: table: rows and columns must be different axes")
    metric = spec.get("metric", "test_acc")
    metrics = tuple(parse_metric(m, where) for m in (metric if isinstance(metric, list) else [metric]))
    if not metrics:
        raise StudyError(f"{where}: table: metric must be a name or a list of names")
    relative_to = _relative_to(spec.get("relative_to", {}), rows, axes, metrics, where)
    return TableSpec(rows, columns, metrics, relative_to, *_target(spec, where))


# -- tabulating ----------------------------------------------------------------------------------------

Row = tuple[str, ...]  # a row's label on each of the rows axes


class Study:
    """The finished runs in the table's cells, (row, column label; None without columns), and every metric's
    values there (NaN left out)."""

    def __init__(self, spec: TableSpec, axes: dict[str, list[str]], runs: list[StudyRun]):
        self.spec = spec
        self.cells: dict[tuple[Row, str | None], list[Run]] = {}
        self.finished: list[Run] = []  # in the grid's order
        self.planned: dict[tuple[Row, str | None], int] = {}  # runs the grid has in each cell
        for study_run in runs:
            key = (tuple(study_run.labels[axis] for axis in spec.rows),
                   study_run.labels[spec.columns] if spec.columns else None)
            self.planned[key] = self.planned.get(key, 0) + 1
            if is_finished(study_run.path):
                self.finished.append(_load(study_run.path))
                self.cells.setdefault(key, []).append(self.finished[-1])
        # the combinations that have runs: a grid of sub-grids need not hold every one
        planned_rows = {row for row, _ in self.planned}
        self.rows: list[Row] = [row for row in itertools.product(*(axes[axis] for axis in spec.rows))
                                if row in planned_rows]
        self.columns: list[str | None] = list(axes[spec.columns]) if spec.columns else [None]
        self.values = {metric.name: self._values(metric) for metric in spec.metrics}

    def _values(self, metric: Metric) -> dict[tuple[Row, str | None], list[float]]:
        try:
            check = metric.measure.check if metric.measure is not None else None
            problem = check(self.finished, *metric.arguments) if check is not None else None
            if problem:
                raise StudyError(f"table: metric {metric.name!r}: {problem}")
            return {key: [v for v in map(metric.of, runs) if not math.isnan(v)] for key, runs in self.cells.items()}
        except RunDirError as exc:
            raise StudyError(str(exc)) from None

    def of(self, metric: Metric, row: Row, column: str | None) -> list[float]:
        return self.values[metric.name].get((row, column), [])

    def missing(self, row: Row, column: str | None) -> str:
        """" (2 of 3 runs)" when some of the cell's runs failed or have not finished: the mean is of the others."""
        done, planned = len(self.cells.get((row, column), [])), self.planned.get((row, column), 0)
        return f" ({done} of {planned} runs)" if done < planned else ""


def _load(path: Path) -> Run:
    try:
        return read_run(path)
    except RunDirError as exc:
        raise StudyError(str(exc)) from None


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _std(values: list[float]) -> float | None:
    return statistics.stdev(values) if len(values) > 1 else None


@dataclass(frozen=True)
class Column:
    """A column of a table: its header, its CSV columns, and each row's cell, shown and raw."""
    header: str
    csv: tuple[str, ...]
    cell: Callable[[Row], tuple[str, list]]


def metric_column(study: Study, metric: Metric, column: str | None, header: str, name: str) -> Column:
    def cell(row: Row) -> tuple[str, list]:
        values = study.of(metric, row, column)
        mean, std = _mean(values), _std(values)
        if metric.counted and values:
            shown = f"{sum(values):g}/{len(values)}"
        else:
            shown = mean_std(metric.name, mean, std)
        return shown + study.missing(row, column), [mean, math.nan if std is None else std, len(values)]
    return Column(header, (f"{name} mean", f"{name} std", f"{name} runs"), cell)


def ratio_column(study: Study, metric: Metric, reference: str, column: str | None, header: str) -> Column:
    """The cell's mean over the reference row's, in the same column."""
    def cell(row: Row) -> tuple[str, list]:
        ratio = per(_mean(study.of(metric, row, column)), _mean(study.of(metric, (reference,), column)))
        return ("—" if math.isnan(ratio) else f"{ratio:.3g}"), [ratio]
    return Column(header, (header,), cell)


def target_columns(study: Study, column: str | None) -> list[Column]:
    spec = study.spec
    reached = {row: [time_to_target(run, spec.target_metric, spec.target)
                     for run in study.cells.get((row, column), [])] for row in study.rows}

    def spread(row: Row, part: int, unit: str) -> tuple[str, list]:
        values = [hit[part] for hit in reached[row] if hit is not None]
        mean, std = _mean(values), _std(values)
        shown = mean_std(unit, mean, std) if values else ("not reached" if reached[row] else "—")
        return shown, [mean, math.nan if std is None else std]

    def count(row: Row) -> tuple[str, list]:
        hits = sum(hit is not None for hit in reached[row])
        return f"{hits}/{len(reached[row])}", [hits, len(reached[row])]

    prefix = f"{column}: " if column is not None else ""
    return [Column(f"{prefix}emulated s", (f"{prefix}seconds mean", f"{prefix}seconds std"),
                   lambda row: spread(row, 0, "seconds")),
            Column(f"{prefix}bytes", (f"{prefix}bytes mean", f"{prefix}bytes std"),
                   lambda row: spread(row, 1, "bytes")),
            Column(f"{prefix}reached", (f"{prefix}reached", f"{prefix}runs"), count)]


def write_study_table(stem: Path, study: Study, columns: list[Column]) -> tuple[list[str], list[list[str]], list[Path]]:
    """stem.md and stem.csv: a row per row of the study, its labels then `columns`; the headers, shown rows, files."""
    headers = [*study.spec.rows, *(c.header for c in columns)]
    csv_headers = [*study.spec.rows, *(name for c in columns for name in c.csv)]
    shown, raw = [], []
    for row in study.rows:
        cells = [c.cell(row) for c in columns]
        shown.append([*row, *(text for text, _ in cells)])
        raw.append([*row, *(value for _, values in cells for value in values)])
    return headers, shown, write_table(stem, headers, shown, csv_headers, raw)


def _file_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-")


def _tables(study: Study) -> list[tuple[str, str, list[Column], bool]]:
    """Every table of the study: (file stem, title, columns, whether the console shows it)."""
    spec = study.spec
    shape = " × ".join([*spec.rows, *([spec.columns] if spec.columns else [])])
    by_name = {metric.name: metric for metric in spec.metrics}
    tables = []
    if spec.columns:
        for metric in spec.metrics:
            tables.append((f"table_{_file_name(metric.name)}", f"{metric_header(metric.name)}: {shape}",
                           [metric_column(study, metric, c, c, c) for c in study.columns], True))
        for name, reference in spec.relative_to.items():
            tables.append((f"table_{_file_name(name)}_over_{_file_name(reference)}", f"{name} / {reference}: {shape}",
                           [ratio_column(study, by_name[name], reference, c, c) for c in study.columns], True))
    else:
        side_by_side = [metric_column(study, m, None, metric_header(m.name), m.name) for m in spec.metrics]
        # each metric alone too, in the file it has with columns
        tables += [(f"table_{_file_name(m.name)}", m.name, [c], False) for m, c in zip(spec.metrics, side_by_side)]
        side_by_side += [ratio_column(study, by_name[name], reference, None, f"{name} / {reference}")
                         for name, reference in spec.relative_to.items()]
        tables.append(("table", f"{shape}: a column per metric", side_by_side, True))
    if spec.target is not None:
        reaches = "≥" if higher_is_better(spec.target_metric) else "≤"
        tables.append(("time_to_target", f"time to mean {spec.target_metric} {reaches} {spec.target:g}: {shape}",
                       [c for column in study.columns for c in target_columns(study, column)], True))
    return tables


def _frontier_keys(spec: TableSpec, row: Row, column: str | None) -> tuple[str, str]:
    """(series, cell) of a run in the frontier: with several rows axes a colour per label of the last one and
    the other labels naming the cell, else a colour per row; the column names the cell too."""
    series, rest = (row[-1], row[:-1]) if len(spec.rows) > 1 else (", ".join(row), ())
    return series, ", ".join([*rest, *([column] if column else [])])


def _plots(folder: Path, study: Study) -> list[Path]:
    """Per main metric of the runs: each cell's curve by round (and with samples, by emulated time), and each
    run's final value against its bytes."""
    panels: dict[str, dict[str, dict[str, list[Curves]]]] = {}  # metric -> column -> row -> its runs' curves
    timed: dict[str, dict[str, dict[str, list[Curves]]]] = {}  # the same, over the ticks of samples.jsonl
    finals: dict[str, dict[str, dict[str, list[tuple[float, float]]]]] = {}  # metric -> series -> cell -> points
    for column in study.columns:
        for row in study.rows:
            name = ", ".join(row)
            series, cell = _frontier_keys(study.spec, row, column)
            for run in study.cells.get((row, column), []):
                sampled = run.curves(axis="time")
                if sampled is not None:
                    timed.setdefault(sampled.metric, {}).setdefault(column or "", {}).setdefault(name, []).append(
                        sampled)
                curves = run.curves()
                if curves is None:
                    continue
                panels.setdefault(curves.metric, {}).setdefault(column or "", {}).setdefault(name, []).append(curves)
                finals.setdefault(curves.metric, {}).setdefault(series, {}).setdefault(cell, []).append(
                    (run.total_bytes, curves.final()[0]))
    series = list(dict.fromkeys(_frontier_keys(study.spec, row, None)[0] for row in study.rows))
    return study_plots(folder, [", ".join(row) for row in study.rows], series, panels, finals, timed)


def tabulate(out: Path, spec: TableSpec, axes: dict[str, list[str]], runs: list[StudyRun],
             console: Console) -> list[Path]:
    """Every table and plot of the study into `out`, the tables shown on `console`; the files written."""
    study = Study(spec, axes, runs)
    for metric in spec.metrics:
        if metric.measure is None and study.cells and not any(study.values[metric.name].values()):
            console.print(f"[yellow]no finished run has {metric.name!r} in its summary.json", highlight=False)
    spread = [axis for axis in axes if axis not in spec.rows and axis != spec.columns]
    over = f"mean ± std over {', '.join(spread)}" if spread else "one run per cell"
    written = []
    for stem, title, columns, shown_here in _tables(study):
        headers, shown, files = write_study_table(out / stem, study, columns)
        written += files
        if shown_here:
            console.print(rich_table(f"{title} ({over})", headers, shown, right_from=len(spec.rows)))
    if study.finished:
        written += write_comparison(study.finished, out / "runs")[1]
        written += _plots(out / "plots", study)
    return written
