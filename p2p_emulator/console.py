"""What a run shows on the console: a progress bar over its rounds, then its summary as a table."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

from . import settings as cfg


def progress_bar(console: Console, config: cfg.RunConfig) -> tuple[Progress, Any]:
    """A progress bar over the rounds and its task (not started: `with progress:` shows it)."""
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        TextColumn("{task.completed:g}/{task.total:g}"), TextColumn("{task.fields[info]}"),
                        console=console, transient=True, disable=config.quiet)
    return progress, progress.add_task(f"{config.protocol} on {config.topology}", total=config.rounds, info="")


def progress_done(config: cfg.RunConfig, rnd: int, now: float) -> dict:
    """How far the bar is: rounds closed, or with --duration the emulated time."""
    if config.duration:
        return {"completed": min(now, config.duration), "total": config.duration}
    return {"completed": rnd + 1}


def summary_table(summary: dict, out_dir: Path) -> Table:
    """summary.json's totals and final metrics, titled with the run and its directory."""
    table = Table(title=f"{summary['protocol']} on {summary['topology']}: {summary['nodes']} nodes, "
                        f"{summary['rounds']} rounds  →  {out_dir}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("emulated time", f"{summary['emulated_seconds']:.3f} s")
    table.add_row("wall time", f"{summary['wall_seconds']:.2f} s")
    table.add_row("messages sent / delivered", f"{summary['messages_total']} / {summary['messages_delivered']}")
    table.add_row("bytes sent", f"{summary['bytes_total']:,}")
    dropped = {k: v for k, v in summary.items() if k.startswith("dropped_") and v}
    for name, count in dropped.items():
        table.add_row(name.replace("_", " "), str(count))
    idle = summary.get("node_time", {}).get("idle_fraction")
    if idle:
        table.add_row("idle fraction (mean over nodes)", f"{sum(idle) / len(idle):.3f}")
    if "staleness" in summary:
        table.add_row("staleness (median / max)", f"{summary['staleness']['median']:g} / {summary['staleness']['max']:g}")
    for name, value in summary["final"].items():
        table.add_row(f"final {name}", f"{value:.4f}" if isinstance(value, float) else str(value))
    return table
