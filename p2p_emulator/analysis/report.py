"""`emulate report RUN_DIR [RUN_DIR ...] [--out DIR] [--partial]`: plots and a comparison table of finished runs.

One run: re-renders its plots under RUN_DIR/plots and prints its row of the table.
Several: overlays their curves (one labelled line per run) in --out (default
report/) and writes the comparison table there as comparison.md and comparison.csv.
A missing or corrupt run directory is reported on stderr in one line and makes
the exit status 2; the other runs are still reported. So is an incomplete one (no
summary.json: stopped, killed or failed), unless --partial: then the rounds it
has are plotted and tabulated, its name marked "incomplete" in every title and row.
"""
from __future__ import annotations

import math
from pathlib import Path

from .output import (ArgumentsError, Parser, fail, human_bytes, mean_std, metric_header, metric_value, rich_table,
                     stdout_console, write_table)
from .plots import overlay_plots, plot_run
from .rundir import Run, RunDirError, read_run

PROG = "emulate report"
HEADERS = ["run", "protocol", "topology", "scenario", "metric", "final mean ± std", "worst 10%",
           "total bytes", "bytes per node", "emulated time", "wall time"]
CSV_HEADERS = ["run", "protocol", "topology", "scenario", "metric", "final_mean", "final_std", "worst10",
               "bytes_total", "bytes_per_node", "emulated_seconds", "wall_seconds"]


def comparison(runs: list[Run]) -> tuple[list[list[str]], list[list]]:
    """The comparison table's rows, formatted and raw, one per run."""
    shown, raw = [], []
    for run in runs:
        curves = run.curves()
        metric = curves.metric if curves else ""
        mean, std, worst = curves.final() if curves else (float("nan"),) * 3
        per_node = run.total_bytes / max(1, run.num_nodes)
        raw.append([run.name, run.protocol, run.topology, run.scenario, metric, mean, std, worst,
                    run.total_bytes, per_node, run.emulated_seconds, run.wall_seconds])
        shown.append([run.name, run.protocol, run.topology, run.scenario or "—", metric_header(metric),
                      mean_std(metric, mean, std), metric_value(metric, worst), human_bytes(run.total_bytes),
                      human_bytes(per_node), f"{run.emulated_seconds:.3f} s", _wall(run.wall_seconds)])
    return shown, raw


def _wall(value: float) -> str:
    return f"{value:.2f} s" if math.isfinite(value) else "—"  # an incomplete run's wall time is unknown


def write_comparison(runs: list[Run], stem: Path) -> tuple[list[list[str]], list[Path]]:
    shown, raw = comparison(runs)
    return shown, write_table(stem, HEADERS, shown, CSV_HEADERS, raw)


def parse(argv: list[str]):
    parser = Parser(prog=PROG, description="Plots and a comparison table of finished runs.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories")
    parser.add_argument("--out", default="report", help="where several runs' plots and table go (default: report)")
    parser.add_argument("--partial", action="store_true",
                        help="also report incomplete runs (no summary.json), from the rounds they have")
    return parser.parse_args(argv)


def report(run_dirs: list[str | Path], out: str | Path = "report", partial: bool = False) -> list[Path]:
    """Plots and a comparison table of finished runs, as `emulate report` writes them; the paths written.

    One run: its plots are drawn again under RUN_DIR/plots. Several: their curves are overlaid in
    `out`, with comparison.md and comparison.csv. A run directory that is missing, corrupt or
    unfinished (unless `partial`) raises RunDirError naming it, before anything is written.
    """
    if not run_dirs:
        raise RunDirError("report: no run directories given")
    runs = [read_run(path, partial) for path in run_dirs]
    return _write(runs, Path(out), partial, alone=len(runs) == 1)[0]


def _write(runs: list[Run], out: Path, partial: bool, alone: bool) -> tuple[list[Path], str, list[list[str]]]:
    """What report writes for these runs (`alone`: one run was asked for): the paths, and the table's title
    and rows for the console."""
    if alone:
        return plot_run(runs[0].path, partial), f"run {runs[0].name}", comparison(runs)[0]
    out.mkdir(parents=True, exist_ok=True)
    written = overlay_plots(runs, out)
    shown, tables = write_comparison(runs, out / "comparison")
    return written + tables, f"{len(runs)} runs", shown


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
        written, title, shown = _write(runs, Path(args.out), args.partial, alone=len(args.runs) == 1)
        console.print(rich_table(title, HEADERS, shown, right_from=5))
        for path in written:
            console.print(f"wrote {path}", highlight=False)
    return 0 if len(runs) == len(args.runs) else 2
