"""Where a sweep's runs execute: one after another in this process, in worker processes, or as Ray tasks.

Every runner takes jobs (`start`), hands back their outcomes as they finish
(`finished`), tells how far each running run is (`rounds`), and on `close` ends the
runs still going as Ctrl-C ends one run: their directories stay incomplete, so the
next sweep reruns them. A run is always `emulate FLAGS --out DIR`, so where it ran
never shows in its directory.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from emulator import ray_executor

from . import cli
from . import settings as cfg
from .analysis.rundir import rounds_closed

# What a run imports on first use (5 s on 2 cores): imported once before the workers fork, not once per worker.
PRELOAD = ("torch", "p2p_emulator.workloads.models", "sklearn.datasets")
INTERRUPTED = (130, 143)  # Ctrl-C or SIGTERM ended the run
STOP_GRACE = 60.0  # seconds a run has to write its last rounds after SIGTERM


@dataclass
class Job:
    """One run: `emulate ARGV` (which names its --out directory) of `rounds` rounds."""
    name: str
    argv: list[str]
    out: Path
    rounds: int
    started: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Outcome:
    name: str
    status: int  # emulate's exit status
    error: str = ""  # its last error line, when status is not 0


def run_job(argv: list[str]) -> tuple[int, str]:
    """`emulate ARGV` in this process: its exit status and its last error line (stderr is kept, not shown)."""
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        try:
            status = cli.main(argv)
        except Exception as exc:  # noqa: BLE001 - one crashed run must not lose the rest of the sweep
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            status = 1
    lines = [line for line in captured.getvalue().splitlines() if line.strip()]
    return status, (lines[-1] if lines and status else "")


class InProcess:
    """One run at a time, here: a sequential sweep."""
    slots = 1

    def __init__(self):
        self.pending: list[Job] = []

    def start(self, job: Job) -> None:
        self.pending.append(job)

    def finished(self, timeout: float) -> list[Outcome]:
        if not self.pending:
            return []
        job = self.pending[0]
        status, error = run_job(job.argv)  # Ctrl-C reaches the run here and ends it with 130
        self.pending.pop(0)
        return [Outcome(job.name, status, error)]

    def rounds(self) -> dict[str, int]:
        return {job.name: rounds_closed(job.out) for job in list(self.pending)}  # list: the view's thread

    def close(self) -> None:
        self.pending.clear()


def _worker(connection, cores: int) -> None:
    """A worker process: runs the jobs it is sent, one at a time, and sends back each outcome."""
    os.environ[cfg.CORES_VARIABLE] = str(cores)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # idle: Ctrl-C is the sweep's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the sweep's handler, forked with it
    while (argv := _next(connection)) is not None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # running: Ctrl-C ends the run, as for `emulate`
        status, error = run_job(argv)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        connection.send((status, error))


def _next(connection) -> list[str] | None:
    """The next run's argv; None when the sweep is over (it says so, or it is gone)."""
    try:
        return connection.recv()
    except EOFError:
        return None


class WorkerProcesses:
    """Up to `jobs` runs at once, each in a worker process of its own with `cores` cores.

    Workers are forked from the sweep, which has imported torch and the protocols already,
    so a run starts at once; a worker that dies is replaced and its run reported failed.
    """

    def __init__(self, jobs: int, cores: int):
        self.slots, self.cores = jobs, cores
        forks = sys.platform == "linux" and "fork" in multiprocessing.get_all_start_methods()
        self.context = multiprocessing.get_context("fork" if forks else "spawn")
        if forks:
            for module in PRELOAD:
                importlib.import_module(module)
        self.idle: list = []
        self.busy: dict = {}  # worker process -> (its connection, its job)

    def _spawn(self):
        ours, theirs = self.context.Pipe()
        process = self.context.Process(target=_worker, args=(theirs, self.cores), daemon=True)
        process.start()
        theirs.close()
        return process, ours

    def start(self, job: Job) -> None:
        while self.idle and not self.idle[-1][0].is_alive():  # killed while it waited
            self.idle.pop()[1].close()
        process, connection = self.idle.pop() if self.idle else self._spawn()
        connection.send(job.argv)
        self.busy[process] = (connection, job)

    def finished(self, timeout: float) -> list[Outcome]:
        waiting = {c: p for p, (c, _) in self.busy.items()} | {p.sentinel: p for p in self.busy}
        outcomes = []
        for ready in multiprocessing.connection.wait(list(waiting), timeout):
            process = waiting[ready]
            if process not in self.busy:
                continue  # both its connection and its sentinel were ready
            connection, job = self.busy.pop(process)
            try:
                status, error = connection.recv()
                self.idle.append((process, connection))
            except (EOFError, OSError):  # the worker died (killed, out of memory) during the run
                process.join()
                status, error = 1, f"the worker process died (exit code {process.exitcode})"
            outcomes.append(Outcome(job.name, status, error))
        return outcomes

    def rounds(self) -> dict[str, int]:
        return {job.name: rounds_closed(job.out) for _, job in list(self.busy.values())}  # list: the view's thread

    def close(self) -> None:
        """End the running runs as SIGTERM ends `emulate` (their closed rounds stay on disk), then the workers."""
        for process in self.busy:
            if process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        while self.busy and time.monotonic() < deadline:
            self.finished(timeout=1.0)
        for process, connection in [*self.idle, *((p, c) for p, (c, _) in self.busy.items())]:
            with contextlib.suppress(OSError):
                connection.send(None)
            connection.close()
            process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
        self.idle.clear()
        self.busy.clear()


@dataclass(frozen=True)
class Resources:
    """What one run uses: its CPUs (None: a share of the cores, on Ray 1), and on a Ray cluster its GPUs and memory."""
    cpus: float | None = None
    gpus: float = 0.0
    memory: int = 0  # bytes; 0: no reservation


def _pack(path: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(path, arcname=".")
    return buffer.getvalue()


def _unpack(data: bytes, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for old in path.iterdir():  # what an earlier, unfinished try left
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(path, filter="data")


def _ray_task(name: str, argv: list[str], out: str, cores: int, progress) -> tuple[int, str, bytes]:
    """A run on a Ray worker, in a scratch directory of its own; its status, error line and packed run directory.

    The run keeps its --out path: relative to the scratch directory, as it is to the sweep's."""
    scratch = tempfile.mkdtemp(prefix="emulate-sweep-")
    here = os.getcwd()
    os.environ[cfg.CORES_VARIABLE] = str(cores)
    done = threading.Event()

    def report() -> None:  # the run's round, for the sweep's live view
        while not done.wait(1.0):
            progress.put_nowait((name, rounds_closed(Path(scratch) / out)))

    try:
        os.chdir(scratch)
        threading.Thread(target=report, daemon=True).start()
        status, error = run_job(argv)
        done.set()
        run_dir = Path(scratch) / out
        return status, error, _pack(run_dir) if run_dir.is_dir() else b""
    finally:
        done.set()
        os.chdir(here)
        shutil.rmtree(scratch, ignore_errors=True)


class RayTasks:
    """Each run a Ray task with `resources`; the driver writes every finished run's directory into the sweep.

    Joins the cluster at `address` (auto: the one `ray start` runs here), or starts a local
    Ray that listens on this machine's loopback address only. Ray queues the tasks the
    cluster has no room for yet; `jobs` (0: no limit) caps how many are submitted at once.
    """

    def __init__(self, address: str, resources: Resources, jobs: int):
        self.ray = ray_executor.import_ray()
        from ray.util.queue import Queue

        self.started = not self.ray.is_initialized()
        if self.started:
            ray_executor.connect(self.ray, address)
        self.slots = jobs or 1_000_000
        cpus = resources.cpus or 1.0
        self.cores = max(1, int(cpus))
        self.task = self.ray.remote(_ray_task).options(num_cpus=cpus, num_gpus=resources.gpus,
                                                       memory=resources.memory or None, max_retries=0)
        self.progress = Queue()
        self.running: dict = {}  # task reference -> its job
        self.round: dict[str, int] = {}

    def start(self, job: Job) -> None:
        out = job.argv[job.argv.index("--out") + 1]
        self.running[self.task.remote(job.name, job.argv, out, self.cores, self.progress)] = job

    def finished(self, timeout: float) -> list[Outcome]:
        ready, _ = self.ray.wait(list(self.running), num_returns=len(self.running), timeout=timeout) \
            if self.running else ([], [])
        outcomes = []
        for ref in ready:
            job = self.running.pop(ref)
            try:
                status, error, packed = self.ray.get(ref)
            except self.ray.exceptions.RayError as exc:  # the worker or its node died
                status, error, packed = 1, f"Ray task failed: {ray_executor.first_line(exc)}", b""
            if packed:
                _unpack(packed, job.out)
            outcomes.append(Outcome(job.name, status, error))
        return outcomes

    def rounds(self) -> dict[str, int]:
        while not self.progress.empty():
            name, closed = self.progress.get_nowait()
            self.round[name] = closed
        return {job.name: self.round.get(job.name, 0) for job in list(self.running.values())}

    def close(self) -> None:
        """Cancel what is still running: SIGINT ends a task's run as Ctrl-C ends `emulate`."""
        for ref in self.running:
            self.ray.cancel(ref)
        self.running.clear()
        if self.started:
            self.ray.shutdown()
