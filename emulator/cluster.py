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
import socket
import threading
from typing import Any, Callable

from .compute import Resident, peak_rss, run_job
from .errors import UsageError, WorkerLost


class NodeWorker:
    """A Ray actor: the resident state of its nodes, and their jobs."""

    def __init__(self, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.store: dict[tuple[int, int], Any] = {}
        self.shared: dict[str, Any] = {}
        self.device = "cuda" if _gpu_ids() else "cpu"

    def keep(self, node: int, key: int, value: Any, shared: list | None = None) -> None:
        """Keep value (or, when it was put once for many nodes, the object store's copy) on this worker's device."""
        if shared is not None:
            ref = shared[0]
            if ref.hex() not in self.shared:
                import ray

                self.shared[ref.hex()] = _to(ray.get(ref), self.device)
            value = self.shared[ref.hex()]
        self.store[node, key] = _to(value, self.device)

    def run(self, fn: Callable, args: tuple, kwargs: dict, keep: tuple | None) -> tuple[Any, float]:
        result, wall = run_job(self.store, fn, args, kwargs, keep)
        return _to(result, "cpu"), wall

    def usage(self) -> dict:
        return {"pid": os.getpid(), "peak_rss": peak_rss(), "device": self.device}


class RayExecutor:
    """Jobs on Ray workers (actors); node i's jobs and state on worker i mod W."""
    kind = "ray"

    def __init__(self, *, address: str, workers: int, cpus_per_worker: float, gpus_per_worker: float):
        ray = _import_ray()
        if address not in ("", "auto"):
            _reachable(address)  # ray.init itself retries an unreachable address for minutes
        self.started = not ray.is_initialized()
        if self.started:  # else join the Ray this process already runs (a notebook's, a test's)
            _connect(ray, address)
        cpus = ray.cluster_resources().get("CPU", 0)
        count = workers or max(1, int(cpus // cpus_per_worker))
        actor = ray.remote(NodeWorker).options(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, max_restarts=0)
        self.workers = [actor.remote(max(1, int(cpus_per_worker))) for _ in range(count)]
        self.pids = ray.get([w.usage.remote() for w in self.workers], timeout=120)
        self._shared: dict[int, tuple[Any, Any]] = {}  # id(value) -> (value, its object-store copy)
        self._lock = threading.Lock()
        self.bytes_kept = self.bytes_to_workers = self.bytes_from_workers = self.jobs = 0

    def worker_of(self, node: int) -> int:
        return node % len(self.workers)

    def keep(self, node: int, key: int, value: Any) -> None:
        worker = self.workers[self.worker_of(node)]
        size = payload_bytes(value)
        if size >= _SHARE_ABOVE:  # a tensor several nodes keep (a global test split): put it in the store once
            shared = self._shared.get(id(value))
            if shared is None:
                import ray

                shared = self._shared[id(value)] = (value, ray.put(value))
                self.bytes_kept += size
            worker.keep.remote(node, key, None, [shared[1]])
            return
        self.bytes_kept += size
        worker.keep.remote(node, key, value)

    def start(self, node: int, fn: Callable, args: tuple, kwargs: dict,
              keep: tuple | None = None) -> concurrent.futures.Future:
        index = self.worker_of(node)
        sent = payload_bytes(args) + payload_bytes(kwargs)
        with self._lock:
            self.bytes_to_workers += sent
            self.jobs += 1
        remote = self.workers[index].run.remote(fn, args, kwargs, keep).future()
        done: concurrent.futures.Future = concurrent.futures.Future()
        remote.add_done_callback(lambda f: self._finish(f, done, node, index))
        return done

    def _finish(self, remote, done, node: int, index: int) -> None:
        import ray

        try:
            result = remote.result()
        except ray.exceptions.RayActorError as exc:
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            done.set_exception(WorkerLost(f"node {node}'s Ray worker {index} (pid {self.pids[index]['pid']}) "
                                          f"died: {cause}"))
            return
        except ray.exceptions.RayTaskError as exc:  # the job itself raised: hand back its own error
            done.set_exception(exc.as_instanceof_cause())
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting node
            done.set_exception(exc)
            return
        with self._lock:
            self.bytes_from_workers += payload_bytes(result[0])
        done.set_result(result)

    def stats(self) -> dict:
        """What travelled between this process and the workers, and each worker's peak memory."""
        import ray

        usage = ray.get([w.usage.remote() for w in self.workers], timeout=120)
        return {"kind": self.kind, "workers": len(self.workers), "jobs": self.jobs,
                "bytes_kept": self.bytes_kept, "bytes_to_workers": self.bytes_to_workers,
                "bytes_from_workers": self.bytes_from_workers,
                "worker_peak_rss": [u["peak_rss"] for u in usage], "worker_devices": [u["device"] for u in usage]}

    def close(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.workers, self._shared = [], {}
        if self.started:
            ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_SHARE_ABOVE = 1 << 20  # bytes: a value this large is put in the object store once, however many nodes keep it


def _import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray: Ray is not installed; pip install -e '.[ray]'") from None
    return ray


def _connect(ray, address: str) -> None:
    """Join the cluster at `address`, or start a local one on this machine's cores; UsageError if unreachable."""
    try:
        if address:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        else:
            ray.init(num_cpus=os.cpu_count(), logging_level="ERROR", log_to_driver=False, include_dashboard=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"--ray-address {address or '(local)'}: cannot start or reach Ray: {first}") from None


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
    """Tensors and modules in value on `device`; other values as they are (CPU-only workers: unchanged)."""
    if device == "cpu" and not _has_cuda(value):
        return value
    if hasattr(value, "to") and hasattr(value, "is_cuda" if hasattr(value, "numel") else "parameters"):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


def _has_cuda(value: Any) -> bool:
    if getattr(value, "is_cuda", False):
        return True
    if isinstance(value, dict):
        return any(_has_cuda(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_cuda(v) for v in value)
    return False


def _gpu_ids() -> list:
    import ray

    return ray.get_gpu_ids()
