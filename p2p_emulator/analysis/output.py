"""What `emulate report` and `emulate sweep` share: one-line usage errors, number formats, tables."""
from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

class ArgumentsError(Exception):
    """Bad command-line arguments (one line for the user, exit 2)."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        raise ArgumentsError(message)


def fail(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr)


def human_bytes(count: float) -> str:
    if math.isnan(count):
        return "—"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(count) < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def metric_value(metric: str, value: float) -> str:
    """Accuracies in percent, byte counts in kB/MB/GB, parameter counts in millions, anything else to 4
    significant digits."""
    if value is None or math.isnan(value):
        return "—"
    if "acc" in metric:
        return f"{100 * value:.2f}"
    if "bytes" in metric:
        return human_bytes(value)
    if metric.startswith("params"):
        return f"{value / 1e6:.2f} M"
    return f"{value:.4g}"


def metric_header(metric: str) -> str:
    return f"{metric} (%)" if "acc" in metric else metric


def mean_std(metric: str, mean: float, std: float | None) -> str:
    """`mean ± std`; just the mean when there is no spread to report (a single value)."""
    if std is None or math.isnan(mean):
        return metric_value(metric, mean)
    return f"{metric_value(metric, mean)} ± {metric_value(metric, std)}"


def spread(values: list[float], fmt: str) -> str:
    """`mean ± std` over values (sample std) in format `fmt`; just the mean for a single value."""
    mean = statistics.fmean(values)
    return f"{mean:{fmt}}" + (f" ± {statistics.stdev(values):{fmt}}" if len(values) > 1 else "")


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers)), *map(line, rows)]) + "\n"


def write_table(stem: Path, headers: list[str], shown: list[list[str]],
                csv_headers: list[str], raw: list[list]) -> list[Path]:
    """stem.md with the formatted cells, stem.csv with the raw numbers."""
    # appended, not with_suffix: a metric's argument may hold a dot (secagg.keys, 0.5) that is no suffix
    md, table_csv = stem.with_name(f"{stem.name}.md"), stem.with_name(f"{stem.name}.csv")
    md.write_text(markdown(headers, shown))
    with open(table_csv, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(csv_headers)
        writer.writerows([["" if isinstance(v, float) and math.isnan(v) else v for v in row] for row in raw])
    return [md, table_csv]


def stdout_console() -> Console:
    """Tables are wide: don't squeeze them into 80 columns when the output goes to a file or pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def rich_table(title: str, headers: list[str], rows: list[list[str]], right_from: int = 1) -> Table:
    table = Table(title=title)
    for k, header in enumerate(headers):
        table.add_column(header, justify="right" if k >= right_from else "left")
    for row in rows:
        table.add_row(*row)
    return table
