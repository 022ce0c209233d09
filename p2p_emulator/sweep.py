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
"""
from __future__ import annotations

import csv
import itertools
import re
import shlex
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from rich.console import Console

from p2p_emulator.analysis.output import ArgumentsError, Parser, fail, stdout_console
from p2p_emulator.analysis.rundir import RunDirError, is_finished, load_run, read_summary
from p2p_emulator.analysis.study import StudyError, StudyRun, TableSpec, parse_table, tabulate
from emulator.errors import UsageError
from emulator.protocol import protocols
from emulator import units
from emulator.units import UnitError

from . import checkpoints, cli
from . import settings as cfg
from .live import StudyView
from .runners import INTERRUPTED, InProcess, Job, Outcome, RayTasks, Resources, WorkerProcesses

PROG = "emulate sweep"
SECTIONS = {"base", "grid", "out", "table", "jobs", "executor", "resources"}
EXECUTORS = ("local", "ray")
SET_BY_SWEEP = {"out", "quiet", "config"}


class GridError(Exception):
    """A bad grid file (one line for the user)."""


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
            raise GridError(f"{where}: {key!r} is set by the sweep itself")
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
    return Grid(base, grids, Path(out), table, None if jobs is None else _jobs(jobs, f"{where}: jobs"), executor,
                _resources(data.get("resources") or {}, f"{where}: resources"))


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


def check_settings(grid: Grid, runs: list[Point]) -> dict[str, int]:
    """Resolve every run's flags as `emulate` would, so a typo fails before hours of runs, not after;
    the rounds of each run."""
    registry = protocols()
    rounds = {}
    for point in runs:
        try:
            config, _ = cli.resolve(point.argv(grid.out / point.name), registry)
        except (UsageError, UnitError) as exc:
            raise GridError(f"run {point.name}: {exc}") from None
        rounds[point.name] = config.rounds
    return rounds


def run_emulation(argv: list[str]) -> int:
    """One `emulate` run, in this process."""
    return cli.main(argv)


def is_current(out: Path, argv: list[str]) -> bool:
    """Whether `out` holds a finished run of exactly the settings `emulate ARGV` resolves to."""
    try:
        summary = read_summary(Path(out))  # the summary alone: its metrics are not needed to tell
    except (RunDirError, OSError):
        return False
    config, options = cli.resolve([*argv, "--out", str(out)], protocols())
    return summary.get("config_hash") == cfg.config_hash(config, options)


def resume_or_run(out: Path, point: Point) -> list[str]:
    """`emulate` arguments for a point: resume an interrupted run of its settings from its checkpoint, or run it."""
    if not (out / checkpoints.NAME).exists():  # most points: nothing to resolve or read
        return point.argv(out)
    config, options = cli.resolve([*flags(point.settings), "--out", str(out)], protocols())
    if checkpoints.resumable(out, cfg.config_hash(config, options)):
        return ["resume", str(out)]
    return point.argv(out)


def run_once(out: Path, argv: list[str]) -> dict:
    """`emulate ARGV` into `out`, quiet and without plots, unless `out` holds a finished run of these settings;
    its summary."""
    if not is_current(out, argv):
        status = run_emulation([*argv, "--out", str(out), "--quiet", "--no-plots", "--overwrite"])
        if status != 0:
            raise RuntimeError(f"run {out}: emulate exited with status {status}")
    return load_run(out).summary


def run_all(grid: Grid, runs: list[Point], rounds: dict[str, int], runner, console: Console) -> list[Outcome]:
    """Run every point whose directory holds no finished run of its settings, up to runner.slots at once;
    the outcomes of those that failed."""
    todo = [p for p in runs if not is_current(grid.out / p.name, flags(p.settings))]
    for point in todo:
        if is_finished(grid.out / point.name):
            console.print(f"[yellow]rerun {point.name}: its settings changed since it ran", highlight=False)
    queue = []
    for point in todo:
        argv = resume_or_run(grid.out / point.name, point)
        if argv[0] == "resume":
            console.print(f"[yellow]resume {point.name} from its checkpoint", highlight=False)
        queue.append(Job(point.name, argv, grid.out / point.name, rounds[point.name]))
    view = StudyView(console, len(runs), len(runs) - len(todo), len(queue), runner.slots, runner.rounds)
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
                    view.finished(outcome)
    finally:
        runner.close()
    return view.failed


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
    parser.add_argument("--grid", required=True, help="YAML grid file (see p2p_emulator/sweep.py)")
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


def with_flags(grid: Grid, args) -> Grid:
    """The grid's execution settings, overridden by the command's flags."""
    given = {k: v for k, v in (("cpus", args.cpus_per_run), ("gpus", args.gpus_per_run),
                               ("memory", args.memory_per_run)) if v is not None}
    parsed = _resources(given, "--cpus/gpus/memory-per-run")
    resources = replace(grid.resources, **{k: getattr(parsed, k) for k in given})
    jobs = grid.jobs if args.jobs is None else _jobs(int(args.jobs) if args.jobs.isdigit() else args.jobs, "--jobs")
    table = grid.table if args.target is None else replace(grid.table, target=args.target)
    return replace(grid, jobs=jobs, executor=args.executor or grid.executor, resources=resources, table=table)


def make_runner(grid: Grid, address: str):
    """Where the runs go: Ray tasks, worker processes, or (one at a time) this process."""
    if grid.executor == "ray":
        return RayTasks(address, grid.resources, 0 if grid.jobs in (None, "auto") else grid.jobs)
    cores, cpus = cfg.cores(), grid.resources.cpus
    jobs = max(1, int(cores // (cpus or 1))) if grid.jobs == "auto" else grid.jobs or 1
    per_run = max(1, int(cpus)) if cpus else max(1, cores // jobs)
    return InProcess() if jobs == 1 else WorkerProcesses(jobs, per_run)


def main(argv: list[str]) -> int:
    try:
        args = parse(argv)
        grid = with_flags(load_grid(Path(args.grid)), args)
        runs = points(grid)
        rounds = check_settings(grid, runs)
        if grid.executor != "ray" and (args.ray_address or args.gpus_per_run or args.memory_per_run):
            raise GridError("--ray-address, --gpus-per-run and --memory-per-run apply to --executor ray only")
    except (UsageError, ArgumentsError, GridError) as exc:
        fail(PROG, str(exc))
        return 2
    console = stdout_console()
    if args.dry_run:
        for point in runs:
            state = "done" if is_current(grid.out / point.name, flags(point.settings)) else "todo"
            print(f"{state}  emulate {shlex.join(point.argv(grid.out / point.name))}")
        return 0
    try:
        runner = make_runner(grid, args.ray_address)
    except UsageError as exc:  # Ray could not start or be reached: nothing is written
        fail(PROG, str(exc))
        return 2
    grid.out.mkdir(parents=True, exist_ok=True)
    (grid.out / "grid.yaml").write_text(Path(args.grid).read_text())
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        failed = run_all(grid, runs, rounds, runner, Console(file=sys.stderr))  # bound now: a run captures sys.stderr
    except KeyboardInterrupt as exc:
        fail(PROG, "interrupted; finished runs are kept and the same command resumes the sweep")
        return 143 if isinstance(exc, Terminated) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    write_failures(grid.out, failed)
    try:
        written = tabulate(grid.out, grid.table, axis_labels(grid.axes), study_runs(grid, runs), console)
    except StudyError as exc:
        fail(PROG, str(exc))
        return 2
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    if failed:
        fail(PROG, f"{len(failed)} of {len(runs)} runs failed (see {grid.out / 'failed.csv'}): "
                   f"{', '.join(o.name for o in failed)}")
        return 1
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM: the sweep ends its runs as Ctrl-C does."""


def _terminate(signum, frame):
    raise Terminated
