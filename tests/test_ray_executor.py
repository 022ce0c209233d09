"""--executor ray: the same run as on threads, byte for byte; a lost worker; bad flags."""
from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from emulator.ray_executor import payload_bytes
from p2p_emulator.cli import main
from p2p_emulator.runs import run
from p2p_emulator.workloads.models import build_model
from p2p_emulator.workloads.training import float_state
from tests.conftest import assert_one_line_error

# Under xdist the Ray tests run on one worker: their runs join one local Ray (local_ray, the bad flags that reach
# Ray too) instead of each starting a cluster on a machine shared with the other workers.
pytestmark = pytest.mark.xdist_group("ray")

OUTPUTS = ("metrics.jsonl", "links.csv", "messages.jsonl")
SMALL = dict(nodes=8, rounds=3, trace=True, quiet=True, no_plots=True, seed=3)
SMALL_ARGS = 64  # bytes: what a job moves besides the models it sends or returns (test_state_stays_on_the_workers)

# A Ray run costs seconds whatever its size (its workers start and import torch afresh): two runs, the second
# carrying MAPL's four backbones (one per node), its prototypes, and churn (nodes go down and come back).
SETTINGS = {
    "dfedavgm": dict(protocol="dfedavgm", topology="regular:d=4", model="mlp:hidden=32"),
    "mapl-hetero-small-churn": dict(protocol="mapl", topology="mesh", nodes=4, model="hetero-small",
                                    partition="mapl:scenario=1,samples=10,test=5", local_epochs=1,
                                    churn="up=0.5s,down=0.3s", timeout=0.5),
}


@pytest.fixture(scope="module")
def on_ray(local_ray, tmp_path_factory):
    """The run of SETTINGS[name] on Ray, made once for the module: a Ray run starts its worker processes
    afresh (seconds each), and the tests below read the same runs."""
    @functools.cache
    def get(name):
        out = tmp_path_factory.mktemp(name) / "ray"
        return run(**{**SMALL, **SETTINGS[name]}, executor="ray", ray_workers=2, out=str(out))

    return get


@pytest.mark.parametrize("name", list(SETTINGS))
def test_ray_gives_the_thread_runs_bytes(on_ray, tmp_path, name):
    settings = SETTINGS[name]
    threads = run(**{**SMALL, **settings}, workers=2, out=str(tmp_path / "thread"))
    ray_run = on_ray(name)
    for output in OUTPUTS:
        assert (threads.out_dir / output).read_bytes() == (ray_run.out_dir / output).read_bytes(), output
    executor = ray_run.summary["executor"]
    assert executor["kind"] == "ray" and executor["workers"] == 2 and executor["jobs"] > 0
    if "churn" in settings:
        assert ray_run.summary["dropped_offline"] > 0  # the scenario did take nodes down


def test_state_stays_on_the_workers(on_ray):
    """Models and data go to the workers once; per round only what the protocol sends or reads travels."""
    result = on_ray("dfedavgm")  # SMALL, dfedavgm on a 4-regular graph, an MLP, 2 Ray workers
    executor = result.summary["executor"]
    state = payload_bytes(float_state(build_model("mlp:hidden=32", (1, 8, 8), 10)))  # one model, as jobs count it
    heard = sum(1 for line in (result.out_dir / "messages.jsonl").read_text().splitlines()
                if json.loads(line)["fate"] == "delivered")  # models received: each goes to its node's mix job
    sent = SMALL["nodes"] * SMALL["rounds"] * 2  # each node, each round: the state it sends, the one snapshotted
    # Beyond those models, a job carries handles, options and numbers, and returns a loss, an accuracy or None:
    # under SMALL_ARGS bytes a job (measured: 44 a job on average to the workers, 6.4 back). A job that shipped
    # its node's model to the worker or back would add a whole state (9,708 bytes) per job.
    jobs = executor["jobs"]
    assert heard == 96 and jobs > 0
    assert heard * state <= executor["bytes_to_workers"] <= heard * state + jobs * SMALL_ARGS
    assert sent * state <= executor["bytes_from_workers"] <= sent * state + jobs * SMALL_ARGS
    assert executor["bytes_kept"] > 0 and executor["driver_peak_rss"] > 0
    assert all(rss > 0 for rss in executor["worker_peak_rss"])


def _descendants(pid: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _node_workers(pid: int) -> list[int]:
    workers = []
    for child in _descendants(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if command.startswith(b"ray::NodeWorker"):
            workers.append(child)
    return workers


def test_a_killed_worker_ends_the_run_in_one_line_and_keeps_the_closed_rounds(local_ray, tmp_path):
    # The run joins local_ray (rather than starting a Ray of its own, seconds more), whose processes are this
    # one's descendants: its two workers are the NodeWorkers among them (earlier runs' were killed as they ended).
    # local_ray listens on 127.0.0.1 only, where Ray in another process looks for it only when told that this
    # machine has no cluster address (as emulate tells its own Ray when it starts it: _start_on_loopback).
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "p2p_emulator.cli", "--protocol", "dfedavgm", "--topology", "regular:d=4", "--nodes", "8",
         "--rounds", "100000", "--model", "mlp:hidden=32", "--executor", "ray", "--ray-workers", "2", "--quiet",
         "--no-plots", "--ray-address", local_ray.get_runtime_context().gcs_address, "--out", str(out)],
        stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1],
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and _closed_rounds(out) < 2:
            time.sleep(0.2)
        workers = _node_workers(os.getpid())
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    lines = err.strip().splitlines()
    assert process.returncode == 1
    assert len(lines) == 1 and f"(pid {workers[1]}) died" in lines[0] and "closed rounds" in lines[0], lines
    named = re.search(r"node (\d+)'s Ray worker (\d+)", lines[0])
    assert named and int(named[1]) % 2 == int(named[2])  # node i runs on worker i mod 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    assert {row["round"] for row in rows if row["node"] == 0} >= {0, 1}
    assert not (out / "summary.json").exists()


def _closed_rounds(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return len({json.loads(line)["round"] for line in lines if line.endswith("}")})


@pytest.mark.parametrize("flags, named", [
    (["--ray-workers", "2"], "--ray-workers"),  # without --executor ray
    (["--executor", "ray", "--ray-cpus-per-worker", "0"], "--ray-cpus-per-worker"),
    (["--executor", "ray", "--ray-gpus-per-worker", "-1"], "--ray-gpus-per-worker"),
    (["--executor", "ray", "--ray-workers", "-3"], "--ray-workers"),
    (["--executor", "ray", "--ray-workers", "1.5"], "--ray-workers"),
    (["--executor", "ray", "--ray-address", "not an address"], "--ray-address"),
    (["--executor", "ray", "--ray-address", "127.0.0.1:1"], "--ray-address"),  # nothing listens there
    (["--executor", "ray", "--device", "cuda"], "--device"),
    (["--executor", "ray", "--ray-cpus-per-worker", "0.00001"], "--ray-cpus-per-worker"),  # finer than Ray takes
    (["--executor", "ray", "--workers", "2"], "--workers"),  # the thread pool's size
    (["--executor", "ray", "--ray-workers", "64"], "--ray-workers 64: the cluster has room for"),
    (["--executor", "dask"], "--executor"),
])
def test_bad_ray_flags_are_one_line_and_exit_2(local_ray, capsys, tmp_path, flags, named):
    out = tmp_path / "run"
    assert main(["--protocol", "gossip", "--nodes", "4", "--rounds", "1", "--out", str(out), *flags]) == 2
    assert_one_line_error(capsys, named)
    assert not out.exists()


def test_worker_count_fits_the_cluster_and_the_nodes():
    from emulator.ray_executor import _worker_count
    from emulator.errors import UsageError

    assert _worker_count({"CPU": 16.0}, nodes=10, workers=0, cpus=1, gpus=0) == 10  # one per node at most
    assert _worker_count({"CPU": 16.0}, nodes=50, workers=0, cpus=4, gpus=0) == 4
    assert _worker_count({"CPU": 16.0, "GPU": 1.0}, nodes=50, workers=0, cpus=1, gpus=0.25) == 4  # 4 share a GPU
    with pytest.raises(UsageError, match="room for 0 workers"):
        _worker_count({"CPU": 16.0}, nodes=50, workers=0, cpus=1, gpus=1)  # no GPU at all
    with pytest.raises(UsageError, match="--ray-workers 3: the cluster has room for 2"):
        _worker_count({"CPU": 2.0}, nodes=50, workers=3, cpus=1, gpus=0)


def test_payload_bytes_are_the_tensor_bytes():
    import torch

    from emulator.ray_executor import payload_bytes
    from emulator.compute import Resident

    state = {"w": torch.zeros(3, 5), "b": torch.zeros(5, dtype=torch.float16)}
    assert payload_bytes(state) == 4 * 15 + 2 * 5 + len("w") + len("b")
    assert payload_bytes([(0.5, state)]) == 8 + payload_bytes(state)
    assert payload_bytes(Resident(0, 1)) == 8  # a handle, not what it names
