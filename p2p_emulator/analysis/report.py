"""`emulate report RUN_DIR [RUN_DIR ...] [--out DIR] [--partial] [--at SECONDS,...] [--target X]`: plots and a
comparison table of finished runs.

One run: re-renders its plots under RUN_DIR/plots and prints its row of the table.
Several: overlays their curves (one labelled line per run) in --out (default
report/) and writes the comparison table there as comparison.md and comparison.csv.
A missing or corrupt run directory is reported on stderr in one line and makes
the exit status 2; the other runs are still reported. So is an incomplete one (no
summary.json: stopped, killed or failed), unless --partial: then the rounds it
has are plotted and tabulated, its name marked "incomplete" in every title and row.

Beyond HEADERS the table has, when some run has them: with samples.jsonl (--eval-every-seconds), the
mean over nodes of the sampled metric at fixed emulated times (--at; default half-way and the end of
the shortest sampled run: the last tick at or before each), and the emulated time and bytes until that
mean first reaches --target (default 90% of the lowest last-tick mean over the runs, so every run has a
time; for a loss or an error, the highest last-tick mean; to 3 significant digits); with node_time, the
mean idle fraction over nodes; with staleness (asynchronous protocols), its median.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from .output import (ArgumentsError, Parser, fail, human_bytes, mean_std, metric_header, metric_value, rich_table,
                     stdout_console, write_table)
from .plots import overlay_plots, plot_run
from .rundir import Run, RunDirError, higher_is_better, read_run

PROG = "emulate report"
HEADERS = ["run", "protocol", "topology", "scenario", "metric", "final mean ± std", "worst 10%",
           "total bytes", "bytes per node", "emulated time", "wall time"]
CSV_HEADERS = ["run", "protocol", "topology", "scenario", "metric", "final_mean", "final_std", "worst10",
               "bytes_total", "bytes_per_node", "emulated_seconds", "wall_seconds"]


@dataclass(frozen=True)
class TimeColumns:
    """The columns beyond HEADERS, for what the runs have (none for runs written before emulated time
    was an axis): the sampled metric at emulated times `at` and the time and bytes to `target`; the mean
    idle fraction; the median staleness."""
    metric: str | None = None  # the sampled metric; None: no run has samples
    at: tuple[float, ...] = ()
    target: float = math.nan
    idle: bool = False
    staleness: bool = False

    def headers(self) -> tuple[list[str], list[str]]:
        """Shown and CSV headers."""
        shown, raw = [], []
        if self.metric is not None:
            reaches = "≥" if higher_is_better(self.metric) else "≤"
            shown += [metric_header(f"{self.metric} @ {t:g} s") for t in self.at]
            shown += [f"time to {self.metric} {reaches} {self.target:g}", f"bytes to {self.metric} {reaches} "
                      f"{self.target:g}"]
            raw += [f"{self.metric}_at_{t:g}s" for t in self.at] + ["target", "time_to_target", "bytes_to_target"]
        if self.idle:
            shown.append("idle fraction")
            raw.append("idle_fraction")
        if self.staleness:
            shown.append("median staleness")
            raw.append("median_staleness")
        return shown, raw

    def cells(self, run: Run) -> tuple[list[str], list]:
        """A run's shown and raw cells under headers()."""
        shown, raw = [], []
        if self.metric is not None:
            sampled = run.curves(self.metric, axis="time")
            values = [math.nan if sampled is None else sampled.mean_at(t) for t in self.at]
            reached = run.time_to_target(self.metric, self.target) if sampled is not None else None
            seconds, sent = reached or (math.nan, math.nan)
            shown += [metric_value(self.metric, v) for v in values]
            missing = "—" if sampled is None else "not reached"
            shown += [f"{seconds:.3f} s" if reached else missing, human_bytes(sent) if reached else missing]
            raw += [*values, self.target, seconds, sent]
        if self.idle:
            shown.append(_fraction(run.idle_fraction))
            raw.append(run.idle_fraction)
        if self.staleness:
            shown.append(f"{run.median_staleness:g}" if math.isfinite(run.median_staleness) else "—")
            raw.append(run.median_staleness)
        return shown, raw


def time_columns(runs: list[Run], at: list[float] | None = None, target: float | None = None) -> TimeColumns:
    """What the runs have beyond HEADERS; `at` and `target` default as the module says."""
    sampled = [(run, curves) for run in runs if (curves := run.curves(axis="time")) is not None]
    metrics = [curves.metric for _, curves in sampled]
    metric = max(set(metrics), key=metrics.count, default=None)  # the metric most sampled runs score
    kept = [curves for _, curves in sampled if curves.metric == metric]
    if kept and at is None:
        end = min(float(c.x[-1]) for c in kept)
        at = [end / 2, end]
    if kept and target is None:
        finals = [f for f in (c.final()[0] for c in kept) if math.isfinite(f)]
        target = _easier(0.9 * min(finals) if higher_is_better(metric) else max(finals), metric) if finals else math.nan
    return TimeColumns(metric, tuple(at or ()), math.nan if target is None else float(target),
                       any(run.node_time for run in runs), any(math.isfinite(run.median_staleness) for run in runs))


def _easier(value: float, metric: str) -> float:
    """`value` to 3 significant digits, rounded the way that keeps it reached: down for an accuracy."""
    if value == 0 or not math.isfinite(value):
        return value
    scale = 10.0 ** (2 - math.floor(math.log10(abs(value))))
    return (math.floor if higher_is_better(metric) else math.ceil)(value * scale) / scale


def _fraction(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else "—"


def headers(runs: list[Run], at: list[float] | None = None, target: float | None = None) -> tuple[list[str], list[str]]:
    """The comparison table's headers, shown and CSV: HEADERS and CSV_HEADERS, then the runs' time columns."""
    shown, raw = time_columns(runs, at, target).headers()
    return HEADERS + shown, CSV_HEADERS + raw


def comparison(runs: list[Run], at: list[float] | None = None,
               target: float | None = None) -> tuple[list[list[str]], list[list]]:
    """The comparison table's rows, formatted and raw, one per run."""
    extra = time_columns(runs, at, target)
    shown, raw = [], []
    for run in runs:
        curves = run.curves()
        metric = curves.metric if curves else ""
        mean, std, worst = curves.final() if curves else (float("nan"),) * 3
        per_node = run.total_bytes / max(1, run.num_nodes)
        more_shown, more_raw = extra.cells(run)
        raw.append([run.name, run.protocol, run.topology, run.scenario, metric, mean, std, worst,
                    run.total_bytes, per_node, run.emulated_seconds, run.wall_seconds, *more_raw])
        shown.append([run.name, run.protocol, run.topology, run.scenario or "—", metric_header(metric),
                      mean_std(metric, mean, std), metric_value(metric, worst), human_bytes(run.total_bytes),
                      human_bytes(per_node), f"{run.emulated_seconds:.3f} s", _wall(run.wall_seconds), *more_shown])
    return shown, raw


def _wall(value: float) -> str:
    return f"{value:.2f} s" if math.isfinite(value) else "—"  # an incomplete run's wall time is unknown


def write_comparison(runs: list[Run], stem: Path, at: list[float] | None = None,
                     target: float | None = None) -> tuple[list[list[str]], list[Path]]:
    shown, raw = comparison(runs, at, target)
    shown_headers, csv_headers = headers(runs, at, target)
    return shown, write_table(stem, shown_headers, shown, csv_headers, raw)


def _seconds(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected emulated seconds above 0, comma-separated, got {text!r}")
    return values


def _target(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return value


def parse(argv: list[str]):
    parser = Parser(prog=PROG, description="Plots and a comparison table of finished runs.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories")
    parser.add_argument("--out", default="report", help="where several runs' plots and table go (default: report)")
    parser.add_argument("--partial", action="store_true",
                        help="also report incomplete runs (no summary.json), from the rounds they have")
    parser.add_argument("--at", type=_seconds, metavar="SECONDS[,SECONDS...]",
                        help="runs with samples (--eval-every-seconds): the sampled metric's mean over nodes at these "
                             "emulated times (default: half-way and the end of the shortest sampled run)")
    parser.add_argument("--target", type=_target, metavar="X",
                        help="runs with samples: the emulated time and bytes until the mean over nodes first reaches X "
                             "(default: 90%% of the lowest final mean over the runs)")
    return parser.parse_args(argv)


def report(run_dirs: list[str | Path], out: str | Path = "report", partial: bool = False,
           at: list[float] | None = None, target: float | None = None) -> list[Path]:
    """Plots and a comparison table of finished runs, as `emulate report` writes them; the paths written.

    One run: its plots are drawn again under RUN_DIR/plots. Several: their curves are overlaid in
    `out`, with comparison.md and comparison.csv. A run directory that is missing, corrupt or
    unfinished (unless `partial`) raises RunDirError naming it, before anything is written.
    Runs with samples (--eval-every-seconds) get the sampled metric at the emulated times `at` and the
    time and bytes until it reaches `target` as columns (defaults: the module's docstring).
    """
    if not run_dirs:
        raise RunDirError("report: no run directories given")
    runs = [read_run(path, partial) for path in run_dirs]
    return _write(runs, Path(out), partial, alone=len(runs) == 1, at=at, target=target)[0]


def _write(runs: list[Run], out: Path, partial: bool, alone: bool, at: list[float] | None = None,
           target: float | None = None) -> tuple[list[Path], str, list[str], list[list[str]]]:
    """What report writes for these runs (`alone`: one run was asked for): the paths, and the table's title,
    headers and rows for the console."""
    shown_headers = headers(runs, at, target)[0]
    if alone:
        return plot_run(runs[0].path, partial), f"run {runs[0].name}", shown_headers, comparison(runs, at, target)[0]
    out.mkdir(parents=True, exist_ok=True)
    written = overlay_plots(runs, out)
    shown, tables = write_comparison(runs, out / "comparison", at, target)
    return written + tables, f"{len(runs)} runs", shown_headers, shown


def main(argv: list[str]) -> int:
    try:
        args = parse(argv)
    except ArgumentsError as exc:
        fail(PROG, str(exc))
        return 2
    runs = []
    for path in args.runs:  # every readable run is still reported: each bad one is named in one line
        try:
            runs.append(read_run(path, args.partial))
        except RunDirError as exc:
            fail(PROG, str(exc))
    console = stdout_console()
    if runs:
        written, title, shown_headers, shown = _write(runs, Path(args.out), args.partial, alone=len(args.runs) == 1,
                                                      at=args.at, target=args.target)
        console.print(rich_table(title, shown_headers, shown, right_from=5))
        for path in written:
            console.print(f"wrote {path}", highlight=False)
    return 0 if len(runs) == len(args.runs) else 2
