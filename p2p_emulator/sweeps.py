"""`emulate sweep --grid FILE [--dry-run]`: run every combination of a grid of settings, then tabulate.

The grid file (YAML):

    base:                        # settings of every run: `emulate` flags as config keys
      dataset: fashion-mnist
      nodes: 20
    grid:                        # axes: one run per combination of one entry of each
      method:                    # an entry is a mapping of settings with an optional label ...
        - {protocol: mapl, label: MAPL}
        - {protocol: mapl, mapl_no_cgl: true, label: MAPL w/o CGL}
      partition: ["mapl:scenario=1", "mapl:scenario=2"]  # ... or a value of the setting named like its axis
      seed: [0, 1, 2]
    out: runs/my-sweep           # default: runs/sweep-<grid file name>
    jobs: 2                      # runs at once, each in a worker process (auto: cores / CPUs per run); default 1
    executor: local              # or ray: each run a Ray task (--ray-address joins a cluster)
    resources: {cpus: 1, gpus: 0, memory: 4GB}  # one run's share: its cores; on Ray also what it reserves
    log_to: mlflow:runs/mlruns   # each run as it finishes, to trackers (--log-to), grouped under the study's name;
                                 # OUT/logged.csv notes what was logged: a rerun logs what is missing
    table:                       # the tables and plots: see p2p_emulator/analysis/study.py
      rows: method
      columns: partition
      metric: [test_acc, bytes_per_round]

`grid:` may also be a list of such mappings (sub-grids), each with the same axes in the same
order: the runs are then the union of their combinations, for studies whose settings are not
a full product (four FedMN architectures, one FedAvg MLP).

Settings apply in order base, then each axis's entry; true makes a bool flag bare
(mapl_no_cgl: true -> --mapl-no-cgl), false leaves it out. Every run's
settings are checked before the first run starts. Run i goes to
OUT/<axis>=<label>__<axis>=<label>...; a directory that already holds a finished
run (a valid summary.json) is skipped, so an interrupted sweep resumes where it
stopped. At the end the tables (mean ± std over the remaining axes, the seeds:
sample std), the plots and OUT/runs.md, the per-run comparison of `emulate
report`, are written from the run directories (p2p_emulator/analysis/study.py). The flags --jobs, --executor,
--cpus-per-run, --gpus-per-run and --memory-per-run override the file. A run
that fails is kept in OUT/failed.csv and the others go on (exit status 1);
SIGINT or SIGTERM ends the running runs, and the same command resumes.

From Python, `sweep(GRID, jobs=2)` does the same and returns a SweepResult (the folder, the run
directories, the failed runs, the files written); bad input raises UsageError.
"""
from __future__ import annotations

import contextlib
import csv
import itertools
import re
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from rich.console import Console

from emulator.errors import UsageError
from emulator.protocol import protocols
from emulator import units
from emulator.units import UnitError

from . import checkpoints, cli
from . import settings as cfg
from .analysis.output import ArgumentsError, Parser, fail, stdout_console
from .analysis.rundir import RunDirError, is_finished, read_summary
from .analysis.study import StudyError, StudyRun, TableSpec, parse_table, tabulate
from .analysis.trackers import Destination, TrackerError, destinations, log_run
from .live import StudyView
from .runners import INTERRUPTED, InProcess, Job, Outcome, RayTasks, Resources, WorkerProcesses

PROG = "emulate sweep"
SECTIONS = {"base", "grid", "out", "table", "jobs", "executor", "resources", "log_to"}
EXECUTORS = ("local", "ray")
SET_BY_SWEEP = {"out", "quiet", "config", "watch", "watch_port", "log_to"}
WATCH_ONE = " (`emulate watch OUT/RUN` follows one of its runs)"
LOGGED = "logged.csv"  # run, config_hash, destination: which runs the study's trackers have
SWEEP_SETS = {"watch": WATCH_ONE, "watch_port": WATCH_ONE,
              "log_to": " (the grid file's top-level log_to: logs every run, grouped under the study)"}


class GridError(UsageError):
    """A bad grid file, or bad settings in it (one line for the user)."""


@dataclass(frozen=True)
class Entry:
    """One value of an axis: the settings it applies and the label it shows in names and tables."""
    label: str
    settings: dict


@dataclass
class Grid:
    base: dict
    grids: list[dict[str, list[Entry]]]  # the runs: the union of each sub-grid's combinations
    out: Path
    table: TableSpec
    jobs: int | str | None  # runs at once (auto: cores / CPUs per run); None: not set in the file
    executor: str
    resources: Resources
    log_to: list[Destination]  # trackers each finished run is logged to

    @property
    def axes(self) -> dict[str, list[Entry]]:
        return merged_axes(self.grids)


def merged_axes(grids: list[dict[str, list[Entry]]]) -> dict[str, list[Entry]]:
    """Every axis and its entries over all sub-grids, in order of first appearance."""
    merged: dict[str, dict[str, Entry]] = {}
    for axes in grids:
        for axis, entries in axes.items():
            for entry in entries:
                merged.setdefault(axis, {}).setdefault(entry.label, entry)
    return {axis: list(entries.values()) for axis, entries in merged.items()}


@dataclass
class Point:
    """One run of the sweep: an entry of every axis."""
    labels: dict[str, str]
    settings: dict

    @property
    def name(self) -> str:
        return "__".join(f"{axis}={slug(label)}" for axis, label in self.labels.items())

    def argv(self, run_dir: Path) -> list[str]:
        return flags(self.settings) + ["--out", str(run_dir), "--quiet", "--overwrite"]  # only unfinished runs rerun


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-") or "-"


def flags(settings: dict) -> list[str]:
    """Settings as `emulate` flags: true -> a bare flag, false or null -> nothing."""
    argv = []
    for key, value in settings.items():
        if value is False or value is None:
            continue
        argv.append("--" + key.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv


def _settings(mapping, where: str) -> dict:
    if not isinstance(mapping, dict):
        raise GridError(f"{where}: expected a mapping of settings")
    settings = {}
    for key, value in mapping.items():
        name = str(key).replace("-", "_")
        if name in SET_BY_SWEEP:
            raise GridError(f"{where}: {key!r} is set by the sweep itself" + SWEEP_SETS.get(name, ""))
        if isinstance(value, (list, dict)):
            raise GridError(f"{where}: {key}: expected a single value, got {type(value).__name__}")
        settings[name] = value
    return settings


def _entry(axis: str, value, where: str) -> Entry:
    if isinstance(value, dict):
        value = dict(value)
        label = value.pop("label", None)
        settings = _settings(value, where)
        if not settings:
            raise GridError(f"{where}: an entry must set something")
        return Entry(str(label) if label is not None else ",".join(f"{k}={v}" for k, v in settings.items()),
                     settings)
    return Entry(str(value), _settings({axis: value}, where))


def load_grid(path: Path) -> Grid:
    """Parse and check a grid file; GridError (one line) on anything wrong with it."""
    path = Path(path)
    where = str(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise GridError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GridError(f"{where}: cannot read: {exc}") from None
    except yaml.YAMLError as exc:
        raise GridError(f"{where}: not valid YAML: {str(exc).strip().splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise GridError(f"{where}: expected a mapping with base, grid, out and table")
    unknown = set(data) - SECTIONS
    if unknown:
        raise GridError(f"{where}: unknown section {sorted(map(str, unknown))[0]!r} "
                        f"(expected {', '.join(sorted(SECTIONS))})")
    base = _settings(data.get("base") or {}, f"{where}: base")
    grid = data.get("grid")
    many = isinstance(grid, list) and len(grid) > 0
    grids = [_axes(sub, f"{where}: grid" + (f"[{k}]" if many else ""))
             for k, sub in enumerate(grid if many else [grid])]
    if any(list(axes) != list(grids[0]) for axes in grids):
        raise GridError(f"{where}: grid: every sub-grid must list the same axes in the same order "
                        f"({', '.join(grids[0])})")
    out = data.get("out") or f"runs/sweep-{path.stem}"
    if not isinstance(out, str):
        raise GridError(f"{where}: out: expected a directory path")
    try:
        table = parse_table(data.get("table") or {}, axis_labels(merged_axes(grids)), where)
    except StudyError as exc:
        raise GridError(str(exc)) from None
    executor = data.get("executor", "local")
    if executor not in EXECUTORS:
        raise GridError(f"{where}: executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    jobs = data.get("jobs")
    try:
        log_to = destinations(",".join(map(str, data["log_to"])) if isinstance(data.get("log_to"), list)
                              else str(data.get("log_to") or ""))
    except TrackerError as exc:
        raise GridError(f"{where}: log_to: {exc}") from None
    return Grid(base, grids, Path(out), table, None if jobs is None else _jobs(jobs, f"{where}: jobs"), executor,
                _resources(data.get("resources") or {}, f"{where}: resources"), log_to)


def _axes(grid, where: str) -> dict[str, list[Entry]]:
    """One (sub-)grid: axis -> its entries."""
    if not isinstance(grid, dict) or not grid:
        raise GridError(f"{where}: expected a mapping of axes, each a list of entries (or a list of such mappings)")
    axes = {}
    for axis, values in grid.items():
        if not isinstance(values, list) or not values:
            raise GridError(f"{where}: {axis}: expected a non-empty list of entries")
        axes[str(axis)] = [_entry(str(axis), v, f"{where}: {axis}") for v in values]
    return axes


def _jobs(value, where: str) -> int | str:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise GridError(f"{where}: expected a whole number of runs at once (at least 1) or auto, got {value!r}")


def _resources(spec, where: str) -> Resources:
    """cpus, gpus and memory of one run (memory as a size: 4GB)."""
    if not isinstance(spec, dict) or set(spec) - {"cpus", "gpus", "memory"}:
        raise GridError(f"{where}: expected a mapping of cpus, gpus and memory")
    cpus, gpus = spec.get("cpus"), spec.get("gpus", 0)
    for name, value, least in (("cpus", cpus, 0.01), ("gpus", gpus, 0)):
        if value is None and name == "cpus":
            continue  # not set: the cores shared out over the jobs (Ray: 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not least <= value <= 1024:
            raise GridError(f"{where}: {name}: expected a number within {least}..1024, got {value!r}")
    try:
        memory = units.size(spec["memory"]) if spec.get("memory") is not None else 0
    except UnitError as exc:
        raise GridError(f"{where}: memory: {exc}") from None
    return Resources(None if cpus is None else float(cpus), float(gpus), memory)


def points(grid: Grid) -> list[Point]:
    """Every combination of one entry per axis, sub-grid by sub-grid, the first axis varying slowest."""
    runs = []
    for axes in grid.grids:
        for combination in itertools.product(*axes.values()):
            settings = dict(grid.base)
            for entry in combination:
                settings.update(entry.settings)
            runs.append(Point({axis: e.label for axis, e in zip(axes, combination)}, settings))
    names = [p.name for p in runs]
    clash = next((n for n in names if names.count(n) > 1), None)
    if clash:
        raise GridError(f"two runs would share the directory {clash}: give their entries distinct labels")
    return runs


@dataclass(frozen=True)
class Resolved:
    """What the sweep needs of a point's settings as `emulate` resolves them."""
    rounds: int
    config_hash: str  # summary.json's and the checkpoint's: tells a finished or resumable run of these settings


def check_settings(grid: Grid, runs: list[Point]) -> dict[str, Resolved]:
    """Resolve every run's flags as `emulate` would, and check they set what the table's measures need (trace),
    so a typo fails before hours of runs, not after; each run's rounds and config hash, by its name (resolved
    once: the sweep reuses them)."""
    registry = protocols()
    resolved = {}
    for point in runs:
        try:
            config, options = cli.resolve(point.argv(grid.out / point.name), registry)
        except (UsageError, UnitError) as exc:
            raise GridError(f"run {point.name}: {exc}") from None
        for metric in grid.table.metrics:
            needs = metric.measure.needs if metric.measure is not None else None
            if needs is not None and not getattr(config, needs):
                raise GridError(f"run {point.name}: table: metric {metric.name!r} needs {needs}: true "
                                f"(--{needs.replace('_', '-')}), which the run does not set")
        resolved[point.name] = Resolved(config.rounds, cfg.config_hash(config, options))
    return resolved


def is_current(out: Path, config_hash: str) -> bool:
    """Whether `out` holds a finished run of exactly the settings that hash to `config_hash`."""
    try:
        summary = read_summary(Path(out))  # the summary alone: its metrics are not needed to tell
    except (RunDirError, OSError):
        return False
    return summary.get("config_hash") == config_hash


def resume_or_run(out: Path, point: Point, config_hash: str) -> list[str]:
    """`emulate` arguments for a point: resume an interrupted run of its settings from its checkpoint, or run it."""
    return ["resume", str(out)] if checkpoints.resumable(out, config_hash) else point.argv(out)


def run_all(grid: Grid, runs: list[Point], resolved: dict[str, Resolved], runner, console: Console) -> list[Outcome]:
    """Run every point whose directory holds no finished run of its settings, up to runner.slots at once;
    the outcomes of those that failed."""
    todo = [p for p in runs if not is_current(grid.out / p.name, resolved[p.name].config_hash)]
    for point in todo:
        if is_finished(grid.out / point.name):
            console.print(f"[yellow]rerun {point.name}: its settings changed since it ran", highlight=False)
    queue = []
    for point in todo:
        argv = resume_or_run(grid.out / point.name, point, resolved[point.name].config_hash)
        if argv[0] == "resume":
            console.print(f"[yellow]resume {point.name} from its checkpoint", highlight=False)
        queue.append(Job(point.name, argv, grid.out / point.name, resolved[point.name].rounds))
    view = StudyView(console, len(runs), len(runs) - len(todo), len(queue), runner.slots, runner.rounds)
    by_name = {point.name: point for point in runs}
    unlogged = [Outcome(p.name, 1, error) for p in runs if p not in todo
                if (error := log_once(grid, p, resolved[p.name].config_hash))]  # runs finished before this sweep
    try:
        with view:
            while queue or view.running:
                while queue and len(view.running) < runner.slots:
                    job = queue.pop(0)
                    job.started = time.monotonic()
                    runner.start(job)
                    view.started(job)
                for outcome in runner.finished(timeout=1.0):
                    if outcome.status in INTERRUPTED:  # Ctrl-C or SIGTERM ended a run: end the sweep too
                        raise Terminated if outcome.status == 143 else KeyboardInterrupt
                    error = "" if outcome.status else log_once(grid, by_name[outcome.name],
                                                               resolved[outcome.name].config_hash)
                    view.finished(Outcome(outcome.name, 1, error) if error else outcome)
    finally:
        runner.close()
    return view.failed + unlogged


def log_once(grid: Grid, point: Point, config_hash: str) -> str:
    """Log the point's finished run to each of the grid's trackers that OUT/logged.csv does not say has it (in
    the experiment, or under the folder, named after the study), and note it there; the error line of a
    tracker that failed ("" if none did): the sweep's next call tries it again."""
    ledger = grid.out / LOGGED
    done: set[tuple[str, ...]] = set()
    if ledger.is_file():
        with open(ledger, newline="") as fh:
            done = {tuple(row) for row in csv.reader(fh)}
    for destination in grid.log_to:
        key = (point.name, config_hash, f"{destination.kind}:{destination.where}")
        if key in done:
            continue
        try:
            log_run(grid.out / point.name, [destination], study=grid.out.resolve().name, labels=point.labels)
        except Exception as exc:  # noqa: BLE001 - a tracker's failure: the run directory is whole, the sweep goes on
            return f"log_to {destination.kind} failed: {type(exc).__name__}: {exc}".splitlines()[0]
        with open(ledger, "a", newline="") as fh:
            csv.writer(fh).writerow(key)
    return ""


def write_failures(out: Path, failed: list[Outcome]) -> None:
    """OUT/failed.csv: each failed run's exit status and error line (none: no file)."""
    path = out / "failed.csv"
    path.unlink(missing_ok=True)
    if failed:
        with open(path, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["run", "exit_status", "error"])
            writer.writerows((o.name, o.status, o.error) for o in failed)


def study_runs(grid: Grid, runs: list[Point]) -> list[StudyRun]:
    return [StudyRun(grid.out / p.name, p.labels) for p in runs]


def axis_labels(axes: dict[str, list[Entry]]) -> dict[str, list[str]]:
    return {axis: [e.label for e in entries] for axis, entries in axes.items()}


def parse(argv: list[str]):
    parser = Parser(prog=PROG, description="Run the cross product of a grid of settings, then tabulate.")
    parser.add_argument("--grid", required=True, help="YAML grid file (see p2p_emulator/sweeps.py)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their commands; run nothing")
    parser.add_argument("--jobs", help="runs at once, each in a process of its own (auto: cores / CPUs per run; "
                                       "default: the grid's jobs, else 1)")
    parser.add_argument("--executor", choices=EXECUTORS, help="local (default) or ray: each run a Ray task")
    parser.add_argument("--ray-address", default="", help="ray: a running cluster, auto or HOST:PORT "
                                                          "(unset: a local Ray on this machine's loopback address)")
    parser.add_argument("--cpus-per-run", type=float, help="CPUs each run uses (default: the grid's resources, "
                                                           "else the cores shared out over --jobs)")
    parser.add_argument("--gpus-per-run", type=float, help="ray: GPUs each run reserves")
    parser.add_argument("--memory-per-run", help="ray: memory each run reserves (4GB)")
    parser.add_argument("--target", type=float, help="the time-to-target table's target (overrides the grid's)")
    return parser.parse_args(argv)


def with_overrides(grid: Grid, *, jobs: int | str | None = None, executor: str | None = None,
                   cpus: float | None = None, gpus: float | None = None, memory: str | None = None,
                   target: float | None = None) -> Grid:
    """The grid's execution settings, overridden by the command's flags or sweep()'s arguments (None: the file's)."""
    given = {k: v for k, v in (("cpus", cpus), ("gpus", gpus), ("memory", memory)) if v is not None}
    parsed = _resources(given, "--cpus/gpus/memory-per-run")
    resources = replace(grid.resources, **{k: getattr(parsed, k) for k in given})
    if executor not in (None, *EXECUTORS):  # the command's flag has these choices; sweep()'s argument is checked here
        raise GridError(f"--executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    table = grid.table if target is None else replace(grid.table, target=target)
    return replace(grid, jobs=grid.jobs if jobs is None else _jobs(jobs, "--jobs"), executor=executor or grid.executor,
                   resources=resources, table=table)


def make_runner(grid: Grid, address: str):
    """Where the runs go: Ray tasks, worker processes, or (one at a time) this process."""
    if grid.executor == "ray":
        return RayTasks(address, grid.resources, 0 if grid.jobs in (None, "auto") else grid.jobs)
    cores, cpus = cfg.cores(), grid.resources.cpus
    jobs = max(1, int(cores // (cpus or 1))) if grid.jobs == "auto" else grid.jobs or 1
    per_run = max(1, int(cpus)) if cpus else max(1, cores // jobs)
    return InProcess() if jobs == 1 else WorkerProcesses(jobs, per_run)


@dataclass
class Plan:
    """A sweep checked and ready to run: its grid file, the grid with the overrides, its runs and their settings."""
    grid_file: Path
    grid: Grid
    points: list[Point]
    resolved: dict[str, Resolved]  # by run name
    ray_address: str


def plan_sweep(grid_file: Path, *, jobs: int | str | None = None, executor: str | None = None, ray_address: str = "",
               cpus: float | None = None, gpus: float | None = None, memory: str | None = None,
               target: float | None = None) -> Plan:
    """The grid file loaded, overridden and checked, every run's settings resolved; GridError (one line) otherwise."""
    grid = with_overrides(load_grid(grid_file), jobs=jobs, executor=executor, cpus=cpus, gpus=gpus, memory=memory,
                          target=target)
    runs = points(grid)
    resolved = check_settings(grid, runs)
    if grid.executor != "ray" and (ray_address or gpus or memory):
        raise GridError("--ray-address, --gpus-per-run and --memory-per-run apply to --executor ray only")
    return Plan(Path(grid_file), grid, runs, resolved, ray_address)


@dataclass
class SweepResult:
    """What a sweep leaves: its folder, its run directories, the runs that failed and the tables and plots."""
    out: Path  # the study folder: the run directories, grid.yaml, the tables and plots, failed.csv
    runs: list[Path]  # every run's directory, in grid order
    failed: list[str]  # the names of the runs that failed; OUT/failed.csv has their exit status and error line
    written: list[Path]  # the tables and plots written


def run_sweep(plan: Plan) -> SweepResult:
    """Run the plan's runs whose directories lack a finished run of their settings, then write the tables and plots.

    UsageError if Ray cannot be reached (nothing is written) or a run directory cannot be read for the tables;
    KeyboardInterrupt (Terminated on SIGTERM) once Ctrl-C has ended the running runs.
    """
    grid = plan.grid
    runner = make_runner(grid, plan.ray_address)
    grid.out.mkdir(parents=True, exist_ok=True)
    (grid.out / "grid.yaml").write_text(plan.grid_file.read_text())
    live = Console(file=sys.stderr)  # bound now: a run captures sys.stderr
    with _sigterm_interrupts():
        failed = run_all(grid, plan.points, plan.resolved, runner, live)
    write_failures(grid.out, failed)
    try:
        written = tabulate(grid.out, grid.table, axis_labels(grid.axes), study_runs(grid, plan.points),
                           stdout_console())
    except StudyError as exc:
        raise UsageError(str(exc)) from None
    return SweepResult(grid.out, [grid.out / p.name for p in plan.points], [o.name for o in failed], written)


def sweep(grid: str | Path, *, jobs: int | str | None = None, executor: str | None = None, ray_address: str = "",
          target: float | None = None) -> SweepResult:
    """Run every combination of a grid file's settings, then write its tables and plots: `emulate sweep --grid GRID`.

        import p2p_emulator as emu
        result = emu.sweep("grid.yaml", jobs=2)
        result.out, result.runs, result.failed, result.written

    jobs (a number, or "auto": cores / CPUs per run), executor ("local" or "ray"), ray_address (a Ray
    cluster: "auto" or HOST:PORT) and target (the time-to-target table's) override the grid file's, as
    the flags of the same names do. A run whose directory holds a finished run of its settings is kept,
    and an interrupted one with a checkpoint resumes, so calling it again continues an interrupted sweep.

    Raises UsageError (one line) on a bad grid file or bad settings in it, before any run starts. A run
    that fails raises nothing: the others go on, and `failed` names it. Ctrl-C or SIGTERM ends the
    running runs and raises KeyboardInterrupt; the finished runs are kept.
    """
    return run_sweep(plan_sweep(Path(grid), jobs=jobs, executor=executor, ray_address=ray_address, target=target))


def print_runs(plan: Plan) -> None:
    """--dry-run: each run, done or todo, and its `emulate` command."""
    for point in plan.points:
        out = plan.grid.out / point.name
        state = "done" if is_current(out, plan.resolved[point.name].config_hash) else "todo"
        print(f"{state}  emulate {shlex.join(point.argv(out))}")


def main(argv: list[str]) -> int:
    """`emulate sweep`: sweep() from the command line, with --dry-run and the per-run resources.

    Exit status 0; 2 on bad input; 1 if some runs failed; 130 or 143 when Ctrl-C or SIGTERM ended it.
    """
    try:
        args = parse(argv)
        jobs = int(args.jobs) if args.jobs is not None and args.jobs.isdigit() else args.jobs
        plan = plan_sweep(Path(args.grid), jobs=jobs, executor=args.executor, ray_address=args.ray_address,
                          cpus=args.cpus_per_run, gpus=args.gpus_per_run, memory=args.memory_per_run,
                          target=args.target)
        if args.dry_run:
            print_runs(plan)
            return 0
        result = run_sweep(plan)
    except (UsageError, ArgumentsError) as exc:
        fail(PROG, str(exc))
        return 2
    except KeyboardInterrupt as exc:
        fail(PROG, "interrupted; finished runs are kept and the same command resumes the sweep")
        return 143 if isinstance(exc, Terminated) else 130
    console = stdout_console()
    for path in result.written:
        console.print(f"wrote {path}", highlight=False)
    if result.failed:
        fail(PROG, f"{len(result.failed)} of {len(result.runs)} runs failed (see {result.out / 'failed.csv'}): "
                   f"{', '.join(result.failed)}")
        return 1
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM: the sweep ends its runs as Ctrl-C does."""


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM raises Terminated meanwhile (only the main thread can take a signal: elsewhere it stays as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    raise Terminated
