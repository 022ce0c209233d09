"""Node compute on Ray workers: each node is pinned to one worker, which holds its resident state.

The clock, links, ledger and protocol coroutines stay in this process; only jobs
travel. A worker keeps the models, data and generators its nodes put there with
node.keep, for the whole run, and a job ships only its other arguments and its
result. Results are handed back at their charged emulated finish times by the
clock, so the order in which workers finish never shows in a run's results.
"""
from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import threading
import weakref
from typing import Any, Callable

from .compute import Resident, peak_rss, run_job
from .errors import UsageError, WorkerLost


class NodeWorker:
    """A Ray actor: the resident state of its nodes, and their jobs.

    Compute jobs run one at a time; keeps and jobs of no work run in a concurrency group
    of their own (QUICK), so that the driver, which waits for those, never waits behind
    another node's training. A node's own jobs never overlap (it awaits each), and a job
    waits until the objects it names have been kept.
    """

    def __init__(self, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.store: dict[tuple[int, int], Any] = {}
        self.shared: dict[str, Any] = {}
        self.kept = threading.Condition()
        self.device = "cuda" if _gpu_ids() else "cpu"

    def keep(self, node: int, key: int, value: Any, shared: list | None = None) -> None:
        """Keep value (or the object store's copy, fetched once per worker) on this worker's device."""
        if shared is not None:
            ref = shared[0]
            if ref.hex() not in self.shared:
                import ray

                self.shared[ref.hex()] = _to(ray.get(ref), self.device)
            value = self.shared[ref.hex()]
        with self.kept:
            self.store[node, key] = _to(value, self.device)
            self.kept.notify_all()

    def run(self, fn: Callable, args: tuple, kwargs: dict, keep: tuple | None) -> tuple[Any, float]:
        """The job on this worker's device: what it received goes there too; its result comes back on the CPU."""
        if self.device != "cpu":
            args = tuple(_to(a, self.device) for a in args)
            kwargs = {k: _to(v, self.device) for k, v in kwargs.items()}
        named = [(h.node, h.key) for h in (*args, *kwargs.values()) if isinstance(h, Resident)]
        with self.kept:  # a keep sent before this job may still be on its way in the other group
            if not self.kept.wait_for(lambda: all(key in self.store for key in named), timeout=_KEEP_WAIT):
                raise RuntimeError(f"objects {named} were never kept on this worker")
        result, wall = run_job(self.store, fn, args, kwargs, keep)
        return (result if self.device == "cpu" else _to(result, "cpu")), wall

    def usage(self) -> dict:
        return {"pid": os.getpid(), "peak_rss": peak_rss(), "device": self.device}


class RayExecutor:
    """Jobs on Ray workers (actors); node i's jobs and state on worker i mod W.

    Joins the Ray this process already runs (a notebook's, a test's) if there is one;
    else the cluster at `address`, or a local Ray it starts and stops.
    """
    kind = "ray"

    def __init__(self, *, nodes: int, address: str, workers: int, cpus_per_worker: float, gpus_per_worker: float):
        ray = import_ray()
        if address not in ("", "auto"):
            _reachable(address)  # also when this process runs a Ray already: the address must not be a typo
        self.started = not ray.is_initialized()
        self.workers: list = []
        self._shared: dict[int, Any] = {}  # id(value) -> its object-store copy, while the value lives
        self._lock = threading.Lock()
        self.bytes_kept = self.bytes_to_workers = self.bytes_from_workers = self.jobs = 0
        if self.started:
            connect(ray, address)
        try:
            count = _worker_count(ray.cluster_resources(), nodes, workers, cpus_per_worker, gpus_per_worker)
            actor = ray.remote(concurrency_groups={QUICK: 1})(NodeWorker).options(
                num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, max_restarts=0)
            self.workers = [actor.remote(max(1, int(cpus_per_worker))) for _ in range(count)]
            self.usage = ray.get([w.usage.remote() for w in self.workers], timeout=300)
        except BaseException as exc:
            self.close()
            if isinstance(exc, (ray.exceptions.RayError, TimeoutError)):
                raise UsageError(f"--executor ray: the workers did not start: {first_line(exc)}") from None
            raise

    def worker_of(self, node: int) -> int:
        return node % len(self.workers)

    def keep(self, node: int, key: int, value: Any) -> None:
        worker = self.workers[self.worker_of(node)]
        size = payload_bytes(value)
        if size < _SHARE_ABOVE:
            self.bytes_kept += size
            worker.keep.options(concurrency_group=QUICK).remote(node, key, value)
            return
        # Large: through the object store, once while the value lives (the global test split every node keeps).
        ref = self._shared.get(id(value))
        if ref is None:
            import ray

            ref = self._shared[id(value)] = ray.put(value)
            weakref.finalize(value, self._shared.pop, id(value), None)
            self.bytes_kept += size
        worker.keep.options(concurrency_group=QUICK).remote(node, key, None, [ref])

    def start(self, node: int, fn: Callable, args: tuple, kwargs: dict,
              keep: tuple | None = None, group: str | None = None) -> concurrent.futures.Future:
        index = self.worker_of(node)
        sent = payload_bytes(args) + payload_bytes(kwargs)
        with self._lock:
            self.bytes_to_workers += sent
            self.jobs += 1
        run = self.workers[index].run
        if group is not None:
            run = run.options(concurrency_group=group)
        remote = run.remote(fn, args, kwargs, keep).future()
        done: concurrent.futures.Future = concurrent.futures.Future()
        remote.add_done_callback(lambda f: self._finish(f, done, node, index))
        return done

    def run_now(self, node: int, fn: Callable, args: tuple, kwargs: dict, keep: tuple | None = None) -> Any:
        """The job, waited for: the caller (the event loop) stands still for the round trip."""
        return self.start(node, fn, args, kwargs, keep, group=QUICK).result()[0]

    def _finish(self, remote, done, node: int, index: int) -> None:
        """Hand the job's outcome to `done`, always: the clock blocks on it."""
        import ray

        try:
            result = remote.result()
            with self._lock:
                self.bytes_from_workers += payload_bytes(result[0])
        except ray.exceptions.RayTaskError as exc:  # the job itself raised: hand back its own error
            done.set_exception(exc.as_instanceof_cause())
        except ray.exceptions.RayError as exc:  # the worker, or an object it held, is gone
            done.set_exception(WorkerLost(f"node {node}'s Ray worker {index} (pid {self.usage[index]['pid']}) "
                                          f"died: {first_line(exc)}"))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting node
            done.set_exception(exc)
        else:
            done.set_result(result)

    def stats(self) -> dict:
        """What travelled between this process and the workers, and each worker's peak memory (None if gone)."""
        import ray

        try:
            usage = ray.get([w.usage.remote() for w in self.workers], timeout=120)
        except (ray.exceptions.RayError, TimeoutError):
            usage = [{"peak_rss": None, "device": None}] * len(self.workers)
        return {"kind": self.kind, "workers": len(self.workers), "jobs": self.jobs,
                "bytes_kept": self.bytes_kept, "bytes_to_workers": self.bytes_to_workers,
                "bytes_from_workers": self.bytes_from_workers,
                "worker_peak_rss": [u["peak_rss"] for u in usage], "worker_devices": [u["device"] for u in usage]}

    def close(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.workers, self._shared = [], {}
        if self.started and ray.is_initialized():
            ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _worker_count(available: dict, nodes: int, workers: int, cpus: float, gpus: float) -> int:
    """--ray-workers, or as many as the cluster's CPUs (and GPUs) hold, at most one per node; UsageError
    when the cluster cannot hold the workers asked for."""
    fits = int(available.get("CPU", 0) // cpus)
    if gpus > 0:
        fits = min(fits, int(available.get("GPU", 0) // gpus))
    count = workers or min(fits, nodes)
    if count < 1 or count > fits:
        raise UsageError(f"--ray-workers {count or 1}: the cluster has room for {fits} workers of "
                         f"{cpus:g} CPUs{f' and {gpus:g} GPUs' if gpus else ''} (it has "
                         f"{available.get('CPU', 0):g} CPUs, {available.get('GPU', 0):g} GPUs)")
    return count


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


QUICK = "quick"  # the actors' concurrency group for keeps and jobs of no work
_KEEP_WAIT = 600.0  # seconds a job waits for a keep sent before it
_SHARE_ABOVE = 1 << 20  # bytes: a value this large is put in the object store once, however many nodes keep it


def import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray: Ray is not installed; pip install -e '.[ray]'") from None
    return ray


def _start_on_loopback(ray) -> None:
    """A local Ray whose every server listens on 127.0.0.1 only. Ray has no public switch for it: it takes
    127.0.0.1 only where it runs without clusters (macOS, Windows), so say so while it starts."""
    from ray._private import ray_constants

    clusters = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", num_cpus=os.cpu_count(), logging_level="ERROR", log_to_driver=False,
                 include_dashboard=False)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = clusters


def connect(ray, address: str) -> None:
    """Join the cluster at `address`, or start a local one on this machine's cores that listens on the loopback
    address only (Ray has no authentication); UsageError if it fails."""
    if address not in ("", "auto"):
        _reachable(address)  # ray.init itself retries an unreachable address for minutes
    in_main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if in_main_thread else None
    try:
        if address:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        else:  # "local": never a cluster that RAY_ADDRESS or a `ray start` on this machine points at
            _start_on_loopback(ray)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UsageError(f"--ray-address {address or '(local)'}: cannot start or reach Ray: {first_line(exc)}") \
            from None
    finally:
        if in_main_thread:  # ray.init installs its own SIGTERM handler; ours ends a run in one line
            signal.signal(signal.SIGTERM, handler)


def _reachable(address: str, timeout: float = 5.0) -> None:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise UsageError(f"--ray-address {address}: nothing answers there ({exc.strerror or exc}); "
                         "start the head with `ray start --head`") from None


def payload_bytes(value: Any) -> int:
    """Bytes of the tensors, arrays, strings and numbers in value (what dominates a job's transfer)."""
    if isinstance(value, Resident):  # a handle: a few bytes, and hasattr() answers yes to anything
        return 8
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return value.element_size() * value.numel()
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    if hasattr(value, "state_dict"):  # a module
        return payload_bytes(value.state_dict())
    if isinstance(value, dict):
        return sum(payload_bytes(k) + payload_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v) for v in value)
    if isinstance(value, (str, bytes)):
        return len(value)
    return 8


def _to(value: Any, device: str) -> Any:
    """Tensors and modules in value on `device`; other values (handles too) as they are."""
    if isinstance(value, Resident):
        return value
    if hasattr(value, "to") and hasattr(value, "is_cuda" if hasattr(value, "numel") else "parameters"):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


def _gpu_ids() -> list:
    import ray

    return ray.get_gpu_ids()
