"""Compute jobs on an executor, the state they run on, and the emulated time they are charged.

A node's model, data and random generator are *resident*: `node.keep(value)` puts
them where the node's jobs run (this process's threads, or a Ray worker) and hands
back a Resident handle. A job names handles among its arguments; the executor
resolves each to the object it holds for that node before calling the job. So a
protocol never holds a live model on the emulator's side, and on a cluster only
what a job takes and returns travels.
"""
from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import resource
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .clock import sleep
from .work import DeviceProfile, Work


@dataclass(frozen=True)
class ComputeModel:
    """How much emulated time a compute job is charged, times the node's slowdown.

    kind "counted": the job's Work priced by the node's device profile (deterministic);
    kind "per-sample": the Work's units (training-sample steps) * cost_per_unit;
    kind "measured": the job's wall time * factor.
    A job's work given as a plain number is that many units, at cost_per_unit, under either of the first two.
    """
    kind: str
    cost_per_unit: float
    factor: float
    slowdowns: tuple[float, ...]
    profiles: tuple[DeviceProfile, ...] = ()

    def charge(self, node: int, work: "float | Work") -> float:
        """Emulated seconds node's job of `work` takes (kinds counted and per-sample)."""
        if not isinstance(work, Work):
            seconds = work * self.cost_per_unit
        elif self.kind == "counted":
            seconds = self.profiles[node].seconds(work)
        else:
            seconds = work.units * self.cost_per_unit
        return seconds * self.slowdowns[node]


class Resident:
    """A handle to an object a node keeps where its jobs run; `handle.attr` is a handle to its attribute."""
    __slots__ = ("node", "key", "path", "length")

    def __init__(self, node: int, key: int, path: tuple[str, ...] = (), length: int | None = None):
        self.node, self.key, self.path, self.length = node, key, path, length

    def __getattr__(self, name: str) -> "Resident":
        if name.startswith("_"):
            raise AttributeError(name)
        return Resident(self.node, self.key, (*self.path, name))

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("len() of a resident object: keep it with a length (a tensor's first dimension)")
        return self.length

    def __repr__(self):
        return f"Resident(node {self.node}, #{self.key}{''.join('.' + p for p in self.path)})"


def resolve(store: dict, value: Any) -> Any:
    """The object a handle names in `store` (by (node, key), then down its attribute path); other values as they are."""
    if not isinstance(value, Resident):
        return value
    obj = store[value.node, value.key]
    for name in value.path:
        obj = getattr(obj, name)
    return obj


def run_job(store: dict, fn: Callable, args: tuple, kwargs: dict, keep: tuple | None) -> tuple[Any, float]:
    """fn on the resolved arguments; (result, wall seconds). With `keep`, the result stays in the store."""
    args = tuple(resolve(store, a) for a in args)
    kwargs = {k: resolve(store, v) for k, v in kwargs.items()}
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    wall = time.perf_counter() - start
    return kept(store, keep, result), wall


def kept(store: dict, keep: tuple | None, result: Any) -> Any:
    """With `keep`, the result goes into the store and the caller gets None; else the result."""
    if keep is None:
        return result
    store[keep] = result
    return None


class ThreadExecutor:
    """Jobs on a pool of threads in this process; resident objects stay where they are."""
    kind = "thread"

    def __init__(self, workers: int):
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compute")
        self.store: dict[tuple[int, int], Any] = {}
        self.job_seconds: collections.Counter = collections.Counter()  # wall seconds by job function
        self._lock = threading.Lock()

    def keep(self, node: int, key: int, value: Any) -> None:
        self.store[node, key] = value

    def start(self, node: int, fn: Callable, args: tuple, kwargs: dict,
              keep: tuple | None = None) -> concurrent.futures.Future:
        return self.pool.submit(self._timed, fn, args, kwargs, keep)

    def run_now(self, node: int, fn: Callable, args: tuple, kwargs: dict, keep: tuple | None = None) -> Any:
        """The job, here and now (on the calling thread); its result."""
        return self._timed(fn, args, kwargs, keep)[0]

    def _timed(self, fn: Callable, args: tuple, kwargs: dict, keep: tuple | None) -> tuple[Any, float]:
        result, wall = run_job(self.store, fn, args, kwargs, keep)
        self.count(fn.__name__, wall)
        return result, wall

    def count(self, name: str, seconds: float) -> None:
        with self._lock:
            self.job_seconds[name] += seconds

    def stats(self) -> dict:
        return {"kind": self.kind, "job_seconds": {name: round(s, 6) for name, s in sorted(self.job_seconds.items())}}

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.store.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Batcher(Protocol):
    """How one job function runs for many nodes at once.

    key(*args, **kwargs): what calls must share to run together (None: this call runs alone);
    run(calls): the results of [(args, kwargs), ...], in order, as fn would return them.
    """
    key: Callable[..., Any]
    run: Callable[[list[tuple[tuple, dict]]], list]


class _PendingJob(concurrent.futures.Future):
    """A job waiting for its batch: asking for its result runs every pending job first."""

    def __init__(self, executor: "BatchedExecutor", node: int, group: tuple, fn: Callable, args: tuple, kwargs: dict,
                 keep):
        super().__init__()
        self.executor, self.node, self.group, self.keep = executor, node, group, keep
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def result(self, timeout=None):
        if not self.done():
            self.executor.flush()
        return super().result(timeout)


class BatchedExecutor(ThreadExecutor):
    """A thread executor that holds back the jobs it has a Batcher for (those whose key is not None),
    and runs those of one kind with one key as one call when a result is first asked for.

    Under the virtual clock that is when no coroutine can run, so every job due in a round
    is in. A node's jobs run in the order it started them (one per node per call). A group
    of one runs fn itself. A batch's wall time is shared equally among its jobs.
    """
    kind = "batched"

    def __init__(self, workers: int, batchers: dict[Callable, Batcher], shortcuts: dict[Callable, Callable]):
        super().__init__(workers)
        self.batchers, self.shortcuts = batchers, shortcuts
        self.pending: list[_PendingJob] = []
        self.batches = self.batched_jobs = 0

    def start(self, node, fn, args, kwargs, keep=None):
        batcher = self.batchers.get(fn)
        if batcher is not None:
            resolved = tuple(resolve(self.store, a) for a in args)
            resolved_kwargs = {k: resolve(self.store, v) for k, v in kwargs.items()}
            key = batcher.key(*resolved, **resolved_kwargs)
            if key is None:  # runs alone, on the arguments already resolved
                return super().start(node, fn, resolved, resolved_kwargs, keep)
            job = _PendingJob(self, node, (fn, key), fn, resolved, resolved_kwargs, keep)
            self.pending.append(job)
            return job
        return super().start(node, fn, args, kwargs, keep)

    def run_now(self, node, fn, args, kwargs, keep=None):
        """The job at once, by its shortcut when it has one (a drop-in replacement, cheaper on stacked models)."""
        return super().run_now(node, self.shortcuts.get(fn, fn), args, kwargs, keep)

    def flush(self) -> None:
        """Run every pending job, in waves of at most one job per node."""
        while self.pending:
            wave, later, nodes = [], [], set()
            for job in self.pending:
                (later if job.node in nodes else wave).append(job)
                nodes.add(job.node)
            self.pending = later
            for group in self._groups(wave):
                self._run_group(group)

    @staticmethod
    def _groups(jobs: list[_PendingJob]) -> list[list[_PendingJob]]:
        groups: dict = {}
        for job in jobs:
            groups.setdefault(job.group, []).append(job)
        return list(groups.values())

    def _run_group(self, group: list[_PendingJob]) -> None:
        if len(group) == 1:
            job = group[0]
            try:
                self._finish(job, *self._timed(job.fn, job.args, job.kwargs, None))
            except BaseException as exc:
                job.set_exception(exc)
            return
        start = time.perf_counter()
        try:
            results = self.batchers[group[0].fn].run([(job.args, job.kwargs) for job in group])
        except BaseException as exc:  # each node's job failed: the run fails as it would job by job
            for job in group:
                job.set_exception(exc)
            return
        wall = time.perf_counter() - start
        self.count(f"{group[0].fn.__name__} (batched)", wall)
        self.batches += 1
        self.batched_jobs += len(group)
        wall /= len(group)
        for job, result in zip(group, results):
            self._finish(job, result, wall)

    def _finish(self, job: _PendingJob, result: Any, wall: float) -> None:
        job.set_result((kept(self.store, job.keep, result), wall))

    def stats(self) -> dict:
        return {**super().stats(), "batches": self.batches, "batched_jobs": self.batched_jobs}

    def close(self) -> None:
        self.pending.clear()
        super().close()


class Compute:
    """Runs nodes' jobs on the executor and charges each by the model.

    An offline node starts a job once it is back, and time offline during the job
    does not count: the result comes that much later.
    """

    def __init__(self, model: ComputeModel, clock, availability=None, executor=None):
        self.model, self.clock, self.availability = model, clock, availability
        self.executor = executor if executor is not None else ThreadExecutor(1)
        n = len(model.slowdowns)
        self._keys = [0] * n
        # A node's last job started on the executor: its next one waits for it (in wall time), so a node's jobs
        # touch its state in the order they were started even when two of its coroutines (node.serve) compute.
        self._last: list[concurrent.futures.Future | None] = [None] * n
        self.busy_seconds = [0.0] * n  # emulated seconds each node's jobs were charged, for the summary

    def keep(self, node: int, value: Any) -> Resident:
        """Put `value` where node's jobs run; its handle (with len() when the value has one)."""
        key = self._next_key(node)
        self.executor.keep(node, key, value)
        return Resident(node, key, length=_length(value))

    async def run(self, node: int, fn: Callable, args: tuple, kwargs: dict, work: "float | Work", keep: bool = False):
        """fn(*args, **kwargs) as node's job; its result, or with `keep` a handle to the result left where it ran.

        A job of no work (taking the state to send, mixing in what arrived) is bookkeeping,
        not compute: it runs at once, without yielding to other nodes and whether its node
        is online or not, as the same step would inline. (Yielding would let every node hold
        the models it gathered until its turn: on a 256-node mesh, 256 x 255 models.)
        """
        target = (node, self._next_key(node)) if keep else None
        if not work:
            self.settle(node)
            result = self.executor.run_now(node, fn, args, kwargs, target)
            return Resident(*target) if keep else result
        availability, start = self.availability, self.clock.now
        if availability is None:
            result = await self._submit(node, fn, args, kwargs, work, target)
        else:
            result = await self._offline_aware(availability, node, fn, args, kwargs, work, target)
        self.busy_seconds[node] += self.clock.now - start
        return Resident(*target) if keep else result

    def settle(self, node: int) -> None:
        """Wait (in wall time) for the node's last started job to finish on the executor: its state is then
        as every job started so far left it."""
        last = self._last[node]
        if last is not None and not last.done():
            try:
                last.result()  # (a batched job waiting for its batch runs now)
            except BaseException:  # noqa: BLE001 - the failure is its awaiting coroutine's to raise
                pass

    def peek(self, node: int, fn: Callable, *args) -> Any:
        """fn(*args) on the node's state now, charged nothing and moving nothing (the clock-driven sampler's
        scoring): a job still running is waited for first, so the state is the one its result leaves."""
        self.settle(node)
        return self.executor.run_now(node, fn, args, {})

    async def _offline_aware(self, availability, node, fn, args, kwargs, work, target):
        await availability.until_online(node)
        start = self.clock.now
        result = await self._submit(node, fn, args, kwargs, work, target)
        lost = availability.offline_time(node, start, self.clock.now)
        while lost > 0:
            await availability.until_online(node)
            start = self.clock.now
            await sleep(self.clock, lost)
            lost = availability.offline_time(node, start, self.clock.now)
        return result

    def _submit(self, node, fn, args, kwargs, work, target):
        model = self.model
        self.settle(node)
        job = self._last[node] = self.executor.start(node, fn, args, kwargs, target)
        if model.kind == "measured":
            return self.clock.submit(job, None, model.factor * model.slowdowns[node])
        return self.clock.submit(job, model.charge(node, work))

    def _next_key(self, node: int) -> int:
        self._keys[node] += 1
        return self._keys[node]

    def keys(self, node: int) -> int:
        """How many handles the node has made (a checkpoint keeps the count, so later handles line up)."""
        return self._keys[node]

    def set_keys(self, node: int, count: int) -> None:
        self._keys[node] = count


def _length(value: Any) -> int | None:
    try:
        return len(value)
    except TypeError:
        return None


def physical_memory() -> int:
    """Bytes of RAM on this machine: what a run's state must fit in."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_rss() -> int:
    """Bytes: this process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
