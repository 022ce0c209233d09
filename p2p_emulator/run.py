"""A run as the user sees it: settings in; network, clock and nodes built; run directory, plots and tables out.

    from p2p_emulator.run import run
    result = run(protocol="gossip", topology="ring", nodes=16, rounds=30)
    result.out_dir, result.summary["final"], pandas.DataFrame(result.metrics)

`run(**settings)` takes the names and values of the config keys (every flag, with
_ for -); the CLI and the sweeps are layers over it.
"""
from __future__ import annotations

import contextlib
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import networkx as nx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

import topologies
from p2p_emulator.analysis.rundir import RunDirWriter, bytes_by_phase, final_metrics
from emulator import dynamics, wire
from emulator.adversaries import Adversaries
from emulator.clock import RealClock, VirtualClock
from emulator.checkpoint import Checkpoints
from emulator.compute import BatchedExecutor, Compute, ThreadExecutor, peak_rss
from emulator.emulation import Emulation
from emulator.errors import UsageError
from emulator.ledger import Ledger
from emulator.network import Network
from emulator.protocol import RunInfo, Protocol, protocols
from emulator.seeds import Seeds

from . import __version__, checkpoints
from . import scenario as scenarios
from . import settings as cfg
from .stream import RunStream


@dataclass
class RunResult:
    """What a finished run gives back: its directory, summary.json's content and the metric rows."""
    out_dir: Path
    summary: dict
    metrics: list[dict]  # one dict per node per round: pandas.DataFrame(result.metrics)


def run(**settings: Any) -> RunResult:
    """Run one emulation from settings named as the config keys; raises UsageError on bad input."""
    registry = protocols()
    config, options = cfg.resolve(settings, registry)
    wire.keep_large_frames_in_the_heap()
    return execute(config, options, registry[config.protocol], out_dir(config))


def out_dir(config: cfg.RunConfig) -> Path:
    """--out, or runs/<time>-<protocol>-<topology>."""
    if config.out:
        return Path(config.out)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    topology = Path(config.topology).stem if "/" in config.topology else config.topology.split(":")[0]
    return Path("runs") / f"{stamp}-{config.protocol}-{topology}"


def prepare_out_dir(path: Path, overwrite: bool) -> None:
    """An empty run directory at `path`: never mixes a new run's files with an earlier one's."""
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(f"--out {path}: exists and is not a directory")
        if path.is_dir() and any(path.iterdir()):
            if not overwrite:
                raise UsageError(f"--out {path}: holds files of an earlier run; choose another directory "
                                 "or pass --overwrite to clear it")
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {path}: {exc.strerror or exc}") from None


def build_topology(config: cfg.RunConfig):
    """The round-0 graph and the time-varying schedule (None for a static topology).

    A topology or schedule file owns the node count: an explicit --nodes must agree with it.
    """
    nodes = cfg.DEFAULT_NODES if config.nodes is None else config.nodes
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", topologies.TopologyWarning)
            schedule = scenarios.schedule(config, nodes)
            if schedule is not None:
                graph = schedule.graph(0)
            else:
                from_file = topologies.files.looks_like_path(config.topology.strip())
                graph = topologies.build(config.topology, config.nodes if from_file else nodes,
                                         Seeds(config.seed).integer("topology"))
    except topologies.TopologyError as exc:  # a file's error names the file already
        raise UsageError(str(exc) if config.topology in str(exc) else f"--topology {config.topology}: {exc}") from None
    if schedule is not None and config.nodes is not None and schedule.num_nodes != config.nodes:
        raise UsageError(f"--topology-schedule {config.topology_schedule}: has {schedule.num_nodes} nodes but "
                         f"--nodes {config.nodes}; leave --nodes unset to use the file's node count")
    for warning in caught:
        warnings.warn(str(warning.message), warning.category)
    return graph, schedule


def build_emulation(config: cfg.RunConfig, graph: nx.Graph, protocol: Protocol,
                    executor, scenario: dynamics.Scenario | None = None,
                    on_round=lambda rnd, now: None, checkpointing: Checkpoints | None = None) -> Emulation:
    """The clock, network, compute and availability the settings ask for, and the emulation over them."""
    n = graph.number_of_nodes()
    scenario = scenario if scenario is not None else scenarios.scenario(config, n, scenarios.schedule(config, n))
    seeds = Seeds(config.seed)
    clock = RealClock(config.time_scale) if config.clock == "real" else VirtualClock()
    try:
        spec = cfg.link_spec(config)
        network = Network(graph, clock, Ledger(trace=config.trace), spec, seeds,
                          edge_specs=cfg.edge_specs(graph, spec),
                          uplink=cfg.capacities(graph, "uplink", config.uplink, seeds),
                          downlink=cfg.capacities(graph, "downlink", config.downlink, seeds),
                          compress=config.compress, max_message_bytes=cfg.max_message_bytes(config),
                          schedule=scenario.schedule,
                          faults=dynamics.LinkFaults(scenario, seeds) if scenario.links_change else None,
                          nodes_change=scenario.nodes_change, checksum=not config.no_checksum,
                          adversaries=_adversaries(config, n, seeds))
        availability = (dynamics.Availability(scenario, network.online, clock, seeds)
                        if scenario.nodes_change else None)
        compute = Compute(cfg.compute_model(config, n, seeds), clock, availability, executor)
        return Emulation(protocol, network, clock, compute, config.rounds, seeds, availability, on_round,
                         checkpointing)
    except BaseException:  # bad input met while building (a file's edge attribute): the loop never runs
        clock.loop.close()
        raise


def make_executor(config: cfg.RunConfig):
    """Where the nodes' jobs run: threads here, or Ray workers (started or joined here)."""
    if config.executor == "ray":
        from emulator.ray_executor import RayExecutor

        return RayExecutor(nodes=config.nodes, address=config.ray_address.strip(), workers=config.ray_workers,
                           cpus_per_worker=config.ray_cpus_per_worker, gpus_per_worker=config.ray_gpus_per_worker)
    if config.executor == "batched":
        from p2p_emulator.workloads.batched import BATCHERS, SHORTCUTS

        return BatchedExecutor(cfg.workers(config), BATCHERS, SHORTCUTS)
    return ThreadExecutor(cfg.workers(config))


def _adversaries(config: cfg.RunConfig, n: int, seeds: Seeds) -> Adversaries | None:
    spec = cfg.parse_adversaries(config.adversaries)
    return Adversaries(spec, n, seeds) if spec is not None else None


def execute(config: cfg.RunConfig, options: Any, protocol_cls: type, out_dir: Path, resume: bool = False) -> RunResult:
    """Run the emulation into out_dir; with `resume`, continue the run there from its checkpoint."""
    console = Console(stderr=True, quiet=config.quiet)
    config_hash = cfg.config_hash(config, options)  # of the settings as resolved, before the graph fills them in
    if config.checkpoint_every and not protocol_cls.checkpointable:
        raise UsageError(f"--checkpoint-every {config.checkpoint_every}: protocol {config.protocol} does not declare "
                         "what its nodes carry between rounds yet, so it cannot be checkpointed")
    graph, schedule = build_topology(config)
    config.nodes = graph.number_of_nodes()
    scenario = scenarios.scenario(config, config.nodes, schedule)  # bad node ids fail before any work
    config_yaml_hash = cfg.config_hash(config, options)  # of the settings as config.yaml holds them: resume checks it
    saved = checkpoints.read(out_dir / checkpoints.NAME, config_yaml_hash) if resume else None
    if saved is not None:
        config_hash = saved["config_hash"]  # the run's, from before config.yaml had its node count filled in
    existed = out_dir.exists()
    if not resume:
        prepare_out_dir(out_dir, config.overwrite)
    writer = RunDirWriter(out_dir)
    progress, task = _progress(console, config)  # shown once the rounds start

    def on_round(rnd: int, now: float) -> None:
        stream.round_closed(rnd)
        progress.update(task, completed=rnd + 1, info=f"t={now:.3f}s  {emulation.ledger.bytes_total / 1e6:.2f} MB")

    def save(rnd: int, state: dict, tensors: dict) -> None:
        checkpoints.write(out_dir / checkpoints.NAME, config_yaml_hash, config_hash, rnd, {**state, "stream": stream.position()},
                          tensors)

    with writer, contextlib.ExitStack() as resources:
        try:  # bad input found while setting up (a dataset path, a topology file's edge) leaves no run directory
            if not resume:
                writer.config({**asdict(config), **asdict(options)})
            run_info = RunInfo(config.nodes, config.rounds, Seeds(config.seed), graph, config.device, out_dir, console,
                               state_in_process=config.executor != "ray")
            protocol = protocol_cls(options, run_info)
            executor = resources.enter_context(make_executor(config))  # after the cheap checks: Ray starts slowly
            plan = None
            if config.checkpoint_every:
                state, tensors = (saved["state"], saved["tensors"]) if saved is not None else (None, None)
                plan = Checkpoints(config.checkpoint_every, checkpoints.RESIDENTS, save, state, tensors)
            emulation = build_emulation(config, graph, protocol, executor, scenario, on_round, plan)
        except UsageError:
            resources.close()
            writer.close()
            if not resume:
                _discard(out_dir, existed)
            raise
        stream = RunStream(writer, emulation)
        if saved is not None:
            stream.resume_at(saved["state"]["stream"])
        start, cpu = time.perf_counter(), time.process_time()
        try:
            with progress:
                rows = emulation.run()
        except BaseException:  # a signal or a failure: the closed rounds are on disk; bring links.csv and availability.jsonl up to now
            stream.replace_tables()
            raise
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        failures: list[str] = []  # after the last round nothing is lost: the run directory is written first
        summary = {**_summary(config, scenario, emulation, rows, wall, failures), "config_hash": config_hash,
                   **_checkpoint_summary(config, emulation),
                   "executor": {**executor.stats(), "driver_peak_rss": peak_rss(), "driver_cpu_seconds": cpu}}
        stream.finish(rows, summary)
    if not config.no_plots and config.rounds > 0:  # a run of no rounds has no curve to draw: matplotlib stays out
        from p2p_emulator.analysis.plots import plot_run

        plot_run(out_dir)
    if not config.quiet:
        console.print(summary_table(summary, out_dir))
        _guarded(failures, f"{config.protocol} render", protocol.render, console, summary)
    if failures:
        raise LateFailure(f"{'; '.join(failures)} (the run directory {out_dir} holds every round)")
    return RunResult(out_dir, summary, rows)


def _checkpoint_summary(config: cfg.RunConfig, emulation: Emulation) -> dict:
    """K, the barriers met and the emulated seconds they held nodes back (their first arrival to their release)."""
    if not config.checkpoint_every:
        return {}
    barrier = emulation.barrier
    return {"checkpoints": {"every": config.checkpoint_every, "barriers": barrier.count,
                            "barrier_seconds": barrier.idle_seconds, "write_seconds": round(barrier.write_seconds, 6)}}


def _discard(out_dir: Path, keep_directory: bool) -> None:
    """Remove what a run that never started wrote: its files, and its directory if the run made it."""
    if not keep_directory:
        shutil.rmtree(out_dir, ignore_errors=True)
        return
    for path in out_dir.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


class LateFailure(Exception):
    """Something failed after the last round; summary.json and the plots were still written."""


def _guarded(failures: list[str], step: str, fn, *args, default=None):
    """fn(*args), or `default` with the failure noted in one line."""
    try:
        return fn(*args)
    except Exception as exc:  # protocol code at the end of a run: its rounds' results must survive it
        failures.append(f"{step} failed: {type(exc).__name__}: {exc}".splitlines()[0])
        return default


def topology_label(config: cfg.RunConfig, scenario: dynamics.Scenario) -> str:
    """--topology, or the schedule that replaces it; a resampled one names both."""
    schedule = scenario.schedule
    if schedule is None:
        return config.topology
    if isinstance(schedule, topologies.schedules.Resampled):
        return f"{config.topology} ({config.topology_schedule})"
    return config.topology_schedule


def _summary(config: cfg.RunConfig, scenario: dynamics.Scenario, emulation: Emulation, rows: list[dict],
             wall: float, failures: list[str]) -> dict:
    totals = emulation.ledger.totals()
    availability = emulation.availability
    extra = _guarded(failures, f"{config.protocol} summary", emulation.protocol.summary, emulation.recorder.streams,
                     default={})
    return {
        "protocol": config.protocol, "topology": topology_label(config, scenario),
        "nodes": emulation.network.num_nodes, "rounds": config.rounds, "seed": config.seed, "version": __version__,
        **totals,
        "messages_in_flight": totals["messages_total"] - totals["messages_delivered"]
        - sum(v for k, v in totals.items() if k.startswith("dropped_")),
        "wall_seconds": wall,
        "emulated_seconds": emulation.clock.now,
        "final": final_metrics(rows),
        **({"bytes_by_phase": phases} if (phases := bytes_by_phase(rows)) else {}),
        **({"crashed": sorted(availability.crashed)} if availability is not None else {}),
        **({"adversaries": sorted(adversaries.nodes)} if (adversaries := emulation.network.adversaries) else {}),
        **extra,
        **({"errors": list(failures)} if failures else {}),
    }


def _progress(console: Console, config: cfg.RunConfig) -> tuple[Progress, Any]:
    """A progress bar over the rounds (not started: `with progress:` shows it)."""
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        TextColumn("round {task.completed}/{task.total}"), TextColumn("{task.fields[info]}"),
                        console=console, transient=True, disable=config.quiet)
    return progress, progress.add_task(f"{config.protocol} on {config.topology}", total=config.rounds, info="")


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
