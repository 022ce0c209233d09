"""A run as the user sees it: progress bar, run directory, summary table."""
from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

import topologies

from . import config as cfg
from . import dynamics
from .errors import UsageError
from .seeds import Seeds
from .runner import Emulation, Environment, make_executor, write_run_dir


def build_graph(run: cfg.RunConfig):
    return build_topology(run)[0]


def build_topology(run: cfg.RunConfig):
    """The round-0 graph and the time-varying schedule (None for a static topology).

    A topology or schedule file owns the node count: an explicit --nodes must agree with it.
    """
    nodes = cfg.DEFAULT_NODES if run.nodes is None else run.nodes
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", topologies.TopologyWarning)
            schedule = dynamics.schedule(run, nodes)
            if schedule is not None:
                graph = schedule.graph(0)
            else:
                from_file = topologies.files.looks_like_path(run.topology.strip())
                graph = topologies.build(run.topology, run.nodes if from_file else nodes, Seeds(run.seed).integer("topology"))
    except topologies.TopologyError as exc:
        raise UsageError(f"--topology {run.topology}: {exc}") from None
    if schedule is not None and run.nodes is not None and schedule.num_nodes != run.nodes:
        raise UsageError(f"--topology-schedule {run.topology_schedule}: has {schedule.num_nodes} nodes but "
                         f"--nodes {run.nodes}; leave --nodes unset to use the file's node count")
    for warning in caught:
        warnings.warn(str(warning.message), warning.category)
    return graph, schedule


def execute(run: cfg.RunConfig, options: Any, protocol_cls: type, out_dir: Path) -> dict:
    console = Console(stderr=True, quiet=run.quiet)
    graph, schedule = build_topology(run)
    run.nodes = graph.number_of_nodes()
    scenario = dynamics.scenario(run, run.nodes, schedule)  # bad node ids fail before any work
    out_dir.mkdir(parents=True, exist_ok=True)
    env = Environment(graph.number_of_nodes(), run.rounds, Seeds(run.seed), graph, run.device, out_dir, console)
    protocol = protocol_cls(options, env)
    with make_executor(run) as executor, _progress(console, run) as (progress, task):
        def on_round(rnd: int, now: float) -> None:
            progress.update(task, completed=rnd + 1,
                            info=f"t={now:.3f}s  {emulation.ledger.bytes_total / 1e6:.2f} MB")

        emulation = Emulation(run, graph, protocol, executor, on_round, scenario)
        start = time.perf_counter()
        rows = emulation.run()
        wall = time.perf_counter() - start
    summary = write_run_dir(out_dir, run, options, emulation, rows, wall)
    if not run.no_plots:
        from analysis.plots import plot_run

        plot_run(out_dir)
    if not run.quiet:
        console.print(summary_table(summary, out_dir))
        protocol.render(console, summary)
    return summary


def _progress(console: Console, run: cfg.RunConfig):
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        TextColumn("round {task.completed}/{task.total}"), TextColumn("{task.fields[info]}"),
                        console=console, transient=True, disable=run.quiet)
    task = progress.add_task(f"{run.protocol} on {run.topology}", total=run.rounds, info="")

    class _Context:
        def __enter__(self):
            progress.start()
            return progress, task

        def __exit__(self, *exc):
            progress.stop()

    return _Context()


def summary_table(summary: dict, out_dir: Path) -> Table:
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
    for name, value in summary["final"].items():
        table.add_row(f"final {name}", f"{value:.4f}" if isinstance(value, float) else str(value))
    return table
