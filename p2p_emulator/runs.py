"""A run as the user sees it: settings in; the emulation built and run; run directory, plots and tables out.

    import p2p_emulator as emu
    result = emu.run(protocol="gossip", topology="ring", nodes=16, rounds=30)
    result.out_dir, result.summary["final"], pandas.DataFrame(result.metrics)

`run(**settings)` takes the names and values of the config keys (every flag, with
_ for -); the CLI and the sweeps are layers over it.
Its parts are built in p2p_emulator.build, its console output drawn in p2p_emulator.console.
"""
from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console

import topologies
from emulator import dynamics, wire
from emulator.checkpoint import Checkpoints
from emulator.compute import peak_rss
from emulator.emulation import Emulation
from emulator.errors import UsageError
from emulator.protocol import RunInfo, protocols
from emulator.seeds import Seeds
from emulator.tcp import Placement
from emulator.units import read_spec

from . import __version__, checkpoints, transport
from . import scenario as scenarios
from . import settings as cfg
from .analysis import trackers
from .analysis.rundir import RunDirWriter, bytes_by_phase, final_metrics, read_jsonl, staleness
from .build import build_emulation, build_topology, make_executor
from .console import progress_bar, progress_done, summary_table
from .stream import RunStream
from .watching import Watch


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


def execute(config: cfg.RunConfig, options: Any, protocol_cls: type, out_dir: Path, resume: bool = False,
            placement: Placement | None = None) -> RunResult:
    """Run the emulation into out_dir; with `resume`, continue the run there from its checkpoint; with
    `placement`, run only that node, its peers in other processes (a real transport)."""
    console = Console(stderr=True, quiet=config.quiet)
    config_hash = cfg.config_hash(config, options)  # of the settings as resolved, before the graph fills them in
    if protocol_cls.asynchronous and not config.duration:
        raise UsageError(f"--protocol {config.protocol}: asynchronous (its nodes go at their own pace); give the "
                         "emulated time to run, --duration SECONDS")
    if config.checkpoint_every and not protocol_cls.checkpointable:
        raise UsageError(f"--checkpoint-every {config.checkpoint_every}: protocol {config.protocol} does not declare "
                         "what its nodes carry between rounds yet, so it cannot be checkpointed")
    if config.transport != "emulated" and placement is None:
        return _launched(config, options, out_dir)
    graph, schedule = build_topology(config)
    if placement is not None:
        transport.check_placement(placement, graph)
    nodes_filled_in = config.nodes != graph.number_of_nodes()
    config.nodes = graph.number_of_nodes()
    scenario = scenarios.scenario(config, config.nodes, schedule)  # bad node ids fail before any work
    # of the settings as config.yaml holds them, which resume checks: the same settings unless the graph filled in nodes
    config_yaml_hash = cfg.config_hash(config, options) if nodes_filled_in else config_hash
    saved = checkpoints.read(out_dir / checkpoints.NAME, config_yaml_hash) if resume else None
    if saved is not None:
        config_hash = saved["config_hash"]  # the run's, from before config.yaml had its node count filled in
    existed = out_dir.exists()
    page = Watch(config)  # its port, bound before the run directory is touched: one in use is bad input
    if not resume:
        try:
            prepare_out_dir(out_dir, config.overwrite)
        except UsageError:
            page.close()
            raise
    writer = RunDirWriter(out_dir)
    progress, task = progress_bar(console, config)  # shown once the rounds start

    def on_round(rnd: int, now: float) -> None:
        stream.round_closed(rnd)
        progress.update(task, **progress_done(config, rnd, now), info=f"t={now:.3f}s  {emulation.ledger.bytes_total / 1e6:.2f} MB")

    def save(rnd: int, state: dict, tensors: dict) -> None:
        checkpoints.write(out_dir / checkpoints.NAME, config_yaml_hash, config_hash, rnd, {**state, "stream": stream.position()},
                          tensors)

    with writer, contextlib.ExitStack() as resources:
        resources.push(lambda failed, *_: failed and page.close())  # a finished run's page stays, below
        try:  # bad input found while setting up (a dataset path, a topology file's edge) leaves no run directory
            if not resume:
                writer.config({**asdict(config), **asdict(options)})
            compute = cfg.compute_model(config, config.nodes, Seeds(config.seed))
            run_info = RunInfo(config.nodes, config.rounds, Seeds(config.seed), graph, config.device, out_dir, console,
                               state_in_process=config.executor != "ray", duration=config.duration,
                               time_varying=schedule is not None,
                               charge=None if compute.kind == "measured" else compute.charge)
            protocol = protocol_cls(options, run_info)
            if schedule is not None and schedule.in_time and not protocol.asynchronous:
                raise UsageError(f"--topology-schedule {config.topology_schedule}: a schedule in emulated seconds "
                                 f"is for time-driven protocols; {config.protocol} runs in rounds (use every=K)")
            executor = resources.enter_context(make_executor(config))  # after the cheap checks: Ray starts slowly
            plan = None
            if config.checkpoint_every:
                state, tensors = (saved["state"], saved["tensors"]) if saved is not None else (None, None)
                plan = Checkpoints(config.checkpoint_every, checkpoints.RESIDENTS, save, state, tensors)
            emulation = build_emulation(config, graph, protocol, executor, scenario, on_round, plan, compute,
                                        placement)
            page.start(out_dir)  # last: the page's server reads config.yaml
        except UsageError:
            page.close()
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
                   **_checkpoint_summary(config, emulation), **_transport(config, placement, emulation),
                   "executor": {**executor.stats(), "driver_peak_rss": peak_rss(), "driver_cpu_seconds": cpu}}
        stream.finish(rows, summary)
    with page:  # its server shows the summary meanwhile
        if not config.no_plots and config.rounds > 0:  # a run of no rounds has no curve to draw: matplotlib stays out
            from .analysis.plots import plot_run

            plot_run(out_dir)
        if not config.quiet:
            console.print(summary_table(summary, out_dir))
            _guarded(failures, f"{config.protocol} render", protocol.render, console, summary)
        _log(config, out_dir, failures)
    if failures:
        raise LateFailure(f"{'; '.join(failures)} (the run directory {out_dir} holds every round)")
    return RunResult(out_dir, summary, rows)


def _launched(config: cfg.RunConfig, options: Any, out_dir: Path) -> RunResult:
    """A run over a real transport: one process per node, merged into out_dir (p2p_emulator.transport)."""
    graph, _ = build_topology(config)
    config.nodes = graph.number_of_nodes()
    transport.check(config)
    prepare_out_dir(out_dir, config.overwrite)
    summary = transport.launch(config, options, graph, out_dir)
    if not config.no_plots and config.rounds > 0:
        from .analysis.plots import plot_run

        plot_run(out_dir)
    if not config.quiet:
        Console(stderr=True).print(summary_table(summary, out_dir))
    failures: list[str] = []
    _log(config, out_dir, failures)
    if failures:
        raise LateFailure(f"{failures[0]} (the run directory {out_dir} holds every round)")
    return RunResult(out_dir, summary, read_jsonl(out_dir / "metrics.jsonl"))


def _log(config: cfg.RunConfig, out_dir: Path, failures: list[str]) -> None:
    """--log-to: the finished run, to each tracker; a failure is noted in `failures`."""
    if config.log_to:
        _guarded(failures, "--log-to", trackers.log_run, out_dir, trackers.destinations(config.log_to))


def _transport(config: cfg.RunConfig, placement: Placement | None, emulation: Emulation) -> dict:
    """A node process's transport, its id and the framing bytes it wrote beside its frames."""
    if placement is None:
        return {}
    return {"transport": config.transport, "node": placement.node, "framing_bytes": emulation.network.framing_bytes}


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


def _rounds_run(config: cfg.RunConfig, rows: list[dict]) -> int:
    """--rounds; with --duration, the most rounds (an asynchronous protocol's steps) any node ran."""
    if not config.duration:
        return config.rounds
    return max((row["round"] + 1 for row in rows), default=0)


def _node_time(emulation: Emulation) -> dict:
    """Each node's emulated seconds computing, idle and sending, and its idle fraction (of the run's time)."""
    times = emulation.node_time()
    end = emulation.clock.now
    return {**times, "idle_fraction": [idle / end if end else 0.0 for idle in times["idle_seconds"]]}


def _compute_slowdowns(config: cfg.RunConfig, emulation: Emulation) -> dict:
    """Each node's drawn compute slowdown, so that a reader sees who was slow; a constant speed slows
    every node alike and adds nothing (its runs' summary.json stays as it was)."""
    if read_spec(config.compute_speed).name == "constant":
        return {}
    return {"compute_slowdowns": {str(node): s for node, s in enumerate(emulation.compute.model.slowdowns)}}


def _timeout(protocol) -> dict:
    """A synchronous learning protocol's wait: --timeout and the longest round of compute it was lengthened by
    (protocols.common.LearningProtocol.longest_round_of_compute)."""
    compute = getattr(protocol, "compute_wait", 0.0)
    if not compute:
        return {}
    def seconds(wait) -> float | str:  # a fixed wait, or --timeout auto's as text ("auto + 0.03 s")
        return wait if isinstance(wait, float) else str(wait)

    return {"timeout": {"given": seconds(protocol.given_timeout), "longest_compute": compute,
                        "waited": seconds(protocol.options.timeout)}}


def _summary(config: cfg.RunConfig, scenario: dynamics.Scenario, emulation: Emulation, rows: list[dict],
             wall: float, failures: list[str]) -> dict:
    totals = emulation.ledger.totals()
    availability = emulation.availability
    protocol, streams = emulation.protocol, emulation.recorder.streams
    extra = {**_guarded(failures, f"{config.protocol} summary", protocol.shared_summary, streams, default={}),
             **_guarded(failures, f"{config.protocol} summary", protocol.summary, streams, default={})}
    return {
        "protocol": config.protocol, "topology": topology_label(config, scenario),
        "nodes": emulation.network.num_nodes, "rounds": _rounds_run(config, rows), "seed": config.seed, "version": __version__,
        **totals,
        "messages_in_flight": totals["messages_total"] - totals["messages_delivered"]
        - sum(v for k, v in totals.items() if k.startswith("dropped_")),
        "wall_seconds": wall,
        "emulated_seconds": emulation.clock.now,
        "final": final_metrics(rows, each_node_last=emulation.protocol.asynchronous),
        **({"staleness": spread} if (spread := staleness(rows)) else {}),
        "node_time": _node_time(emulation),
        **_compute_slowdowns(config, emulation),
        **_timeout(emulation.protocol),
        **({"bytes_by_phase": phases} if (phases := bytes_by_phase(rows)) else {}),
        **({"crashed": sorted(availability.crashed)} if availability is not None else {}),
        **({"adversaries": sorted(adversaries.nodes)} if (adversaries := emulation.network.adversaries) else {}),
        **extra,
        **({"errors": list(failures)} if failures else {}),
    }
