"""`emulate sweep --jobs N`: the same run directories as one run at a time; failed, interrupted and resumed sweeps."""
import csv
import functools
import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from p2p_emulator import settings as cfg
from p2p_emulator.cli import main
from p2p_emulator.runners import InProcess, Resources, WorkerProcesses
from p2p_emulator.sweeps import load_grid, make_runner
from tests.forked import ForkedApart
from tests.run_dirs import sweep_contents

# Two protocols, one with churn (nodes go down and come back), two seeds: 4 runs of a few seconds.
GRID = {
    "base": {"dataset": "digits", "nodes": 6, "rounds": 4, "topology": "regular:d=2", "model": "mlp:hidden=16",
             "no_plots": True, "trace": True},
    "grid": {
        "method": [{"protocol": "dfedavgm", "label": "DFedAvgM"},
                   {"protocol": "gossip-learning", "churn": "up=0.5s,down=0.3s",
                    "label": "GL churn"}],
        "seed": [0, 1],
    },
    "out": "runs/sweep",
}


def write_grid(where: Path, grid: dict = GRID) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "grid.yaml").write_text(yaml.safe_dump(grid))
    return where / "grid.yaml"


def sweep_in(where: Path, monkeypatch, *flags: str) -> int:
    monkeypatch.chdir(where)  # the grid's out is relative: config.yaml holds the same --out everywhere
    return main(["sweep", "--grid", "grid.yaml", *flags])


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    """The grid run one run at a time, in this process (as before --jobs)."""
    where = tmp_path_factory.mktemp("sequential")
    write_grid(where)
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert sweep_in(where, monkeypatch) == 0
    return sweep_contents(where / "runs" / "sweep")


def test_two_jobs_give_the_sequential_run_directories(sequential, tmp_path, monkeypatch):
    write_grid(tmp_path)
    assert sweep_in(tmp_path, monkeypatch, "--jobs", "2") == 0
    parallel = sweep_contents(tmp_path / "runs" / "sweep")
    assert len(sequential) >= 4 * 5 and parallel.keys() == sequential.keys()
    assert [name for name in sequential if parallel[name] != sequential[name]] == []
    churned = json.loads(parallel["method=GL-churn__seed=0/summary.json"])
    assert churned["dropped_offline"] > 0  # the churn entry did take nodes down


def test_the_live_view_prints_one_line_per_finished_run_when_not_a_terminal_and_target_adds_a_table(tmp_path, monkeypatch, capsys):
    write_grid(tmp_path, {**GRID, "grid": {"seed": [0, 1, 2]}, "base": {**GRID["base"], "protocol": "dfedavgm"}})
    assert sweep_in(tmp_path, monkeypatch, "--jobs", "2", "--target", "0.05") == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert sorted(line.split()[1] for line in lines) == ["seed=0", "seed=1", "seed=2"]
    assert [line.split()[0] for line in lines] == ["[1/3]", "[2/3]", "[3/3]"] and all(" done (" in line
                                                                                    for line in lines)
    reached = (tmp_path / "runs" / "sweep" / "time_to_target.md").read_text()  # --target: a row per seed here
    assert reached.count("| 1/1 |") == 3  # every run reaches 5%


def test_a_failed_run_does_not_stop_the_study(tmp_path, monkeypatch, capsys):
    # A missing dataset directory passes the settings check and fails when its run starts.
    grid = {**GRID, "grid": {"data": [{"dataset": "digits", "label": "digits"},
                                      {"dataset": "fashion-mnist", "data_root": str(tmp_path / "none"),
                                       "label": "missing"}], "seed": [0, 1]}}
    grid["base"] = {**GRID["base"], "protocol": "dfedavgm"}
    write_grid(tmp_path, grid)
    assert sweep_in(tmp_path, monkeypatch, "--jobs", "2") == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("emulate sweep: error: 2 of 4 runs failed")
    with open(tmp_path / "runs" / "sweep" / "failed.csv") as fh:
        failed = list(csv.DictReader(fh))
    assert sorted(row["run"] for row in failed) == ["data=missing__seed=0", "data=missing__seed=1"]
    assert all(row["exit_status"] == "2" and "none" in row["error"] for row in failed)
    for seed in (0, 1):
        assert (tmp_path / "runs" / "sweep" / f"data=digits__seed={seed}" / "summary.json").is_file()
    table = (tmp_path / "runs" / "sweep" / "table.md").read_text()
    assert "| missing | — (0 of 2 runs) |" in table and "(2 of 2" not in table  # the failed cell is marked


def test_jobs_share_out_the_cores(tmp_path, monkeypatch):
    monkeypatch.setenv(cfg.CORES_VARIABLE, "8")
    grid = load_grid(write_grid(tmp_path))
    assert isinstance(make_runner(grid, ""), InProcess)  # jobs not set: one run at a time, here
    for jobs, cpus, expected in ((2, None, (2, 4)), ("auto", None, (8, 1)), ("auto", 2.0, (4, 2)), (3, 2.0, (3, 2))):
        runner = make_runner(replace(grid, jobs=jobs, resources=Resources(cpus)), "")
        assert isinstance(runner, WorkerProcesses) and (runner.slots, runner.cores) == expected, (jobs, cpus)
        runner.close()


def test_a_run_uses_the_cores_it_is_given(monkeypatch):
    config = cfg.RunConfig()
    monkeypatch.setenv(cfg.CORES_VARIABLE, "3")
    assert cfg.workers(config) == 3
    monkeypatch.delenv(cfg.CORES_VARIABLE)
    assert cfg.workers(config) == os.cpu_count()


@pytest.mark.parametrize("flags, named", [
    (["--jobs", "0"], "--jobs"),
    (["--jobs", "two"], "--jobs"),
    (["--cpus-per-run", "0"], "cpus"),
    (["--gpus-per-run", "1"], "--executor ray only"),
    (["--memory-per-run", "4GB"], "--executor ray only"),
    (["--executor", "dask"], "--executor"),
    (["--executor", "ray", "--ray-address", "127.0.0.1:1"], "--ray-address"),  # nothing listens there
])
def test_bad_sweep_flags_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, flags, named):
    write_grid(tmp_path)
    assert sweep_in(tmp_path, monkeypatch, *flags) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("emulate sweep: error: ") and named in lines[0], lines
    assert not (tmp_path / "runs").exists()


# One quick run, then two long ones: interrupted when the quick one has finished and both long ones are going.
LONG = {**GRID, "base": {**GRID["base"], "protocol": "dfedavgm", "rounds": 400},
        "grid": {"run": [{"seed": 0, "rounds": 3, "label": "quick"}, {"seed": 1, "label": "long1"},
                         {"seed": 2, "label": "long2"}]}}


def _sweep_process(where: Path) -> ForkedApart:
    """`emulate sweep --grid grid.yaml --jobs 2` in `where`, as a shell starts it (forked: it starts in a tenth of
    the time a fresh interpreter takes to import torch); its stderr goes to where/stderr."""
    return ForkedApart(["sweep", "--grid", "grid.yaml", "--jobs", "2"], where, where / "stderr")


def _wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the sweep did not get there"
        time.sleep(0.2)


def _modified(path: Path) -> int | None:
    return path.stat().st_mtime_ns if path.exists() else None


def _going(runs: list[Path], before: list[int | None]) -> bool:
    """Whether each run has closed a round since its metrics.jsonl was last modified at `before` (None: none yet)."""
    return all(_modified(run / "metrics.jsonl") not in (None, old) for run, old in zip(runs, before))


def test_an_interrupted_sweep_ends_its_runs_and_the_same_command_resumes_it(tmp_path, monkeypatch):
    """Interrupted twice, then finished: first SIGTERM to the sweep alone, then, in the same command run again
    (the quick run kept, the long ones started afresh), SIGINT to its process group as Ctrl-C sends it. Each
    time the sweep ends its runs, says so in one line and exits 143 or 130, and no worker outlives it; the same
    command, with the long runs shortened, then finishes the sweep without running the quick run again."""
    write_grid(tmp_path, LONG)
    sweep = tmp_path / "runs" / "sweep"
    long_runs = [sweep / f"run={name}" for name in ("long1", "long2")]
    quick = None
    for how, status in (("SIGTERM", 143), ("SIGINT", 130)):
        before = [_modified(run / "metrics.jsonl") for run in long_runs]  # the interrupted runs' files, if any
        process = _sweep_process(tmp_path)
        try:
            _wait_for(functools.partial(_going, long_runs, before))
            if quick is None:
                quick = (sweep / "run=quick" / "summary.json").stat().st_mtime_ns
            if how == "SIGTERM":
                os.kill(process.pid, signal.SIGTERM)  # to the sweep alone: it ends its workers' runs
            else:
                os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole process group
            process.wait(timeout=90)
        finally:
            if process.poll() is None:  # a sweep the test gave up on must not outlive it (nor hold pytest's exit)
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        err = (tmp_path / "stderr").read_text()
        assert process.poll() == status, err
        assert err.strip().splitlines()[-1] == ("emulate sweep: error: interrupted; finished runs are kept and the "
                                                "same command resumes the sweep")
        with pytest.raises(ProcessLookupError):
            os.killpg(process.pid, 0)  # no worker process outlives the sweep
        assert not any((run / "summary.json").exists() for run in long_runs)
        assert (sweep / "run=quick" / "summary.json").stat().st_mtime_ns == quick  # finished: not run again

    write_grid(tmp_path, {**LONG, "base": {**LONG["base"], "rounds": 3}})  # the long runs shortened: the test's time
    # in this process: what follows checks the run directories, which a subprocess would only start slower
    assert sweep_in(tmp_path, monkeypatch, "--jobs", "2") == 0
    assert (sweep / "run=quick" / "summary.json").stat().st_mtime_ns == quick
    assert all((run / "summary.json").is_file() for run in long_runs)
