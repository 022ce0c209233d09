"""--checkpoint-every and `emulate resume`: a killed run continues to the same bytes as one never killed."""
from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
import yaml

from p2p_emulator import runners
from p2p_emulator.cli import main
from p2p_emulator.runs import run
from emulator.clock import VirtualClock
from emulator.dynamics import Availability, Churn, Crash, Scenario
from emulator.protocol import protocols
from emulator.seeds import Seeds
from protocols.dfedavgm import DFedAvgM
from tests.conftest import assert_one_line_error, assert_refused
from tests.forked import Forked

STREAMED = ("metrics.jsonl", "links.csv", "messages.jsonl")
QUIET = dict(trace=True, quiet=True, no_plots=True)
# Small data and models: a checkpoint holds the same kinds of state for 5 samples as for 300.
FEW_MAPL = "mapl:scenario=1,samples=5,test=2"  # 5 training and 2 test samples per class and node
SMALL_CNN = dict(model="cnn-small:channels=4,8", d_z=16)
RUNS = {
    "dfedavgm": dict(protocol="dfedavgm", topology="regular:d=4", nodes=8, rounds=6, model="mlp:hidden=32", seed=1),
    "dfedavgm-batched": dict(protocol="dfedavgm", topology="ring", nodes=7, rounds=5, model="mlp:hidden=32", seed=20,
                             executor="batched", partition="dirichlet:alpha=0.5"),  # the stack is the models
    "gossip-learning": dict(protocol="gossip-learning", topology="regular:d=4", nodes=10, rounds=6,
                            model="mlp:hidden=32", seed=2, latency="uniform:low=5ms,high=40ms", loss="0.1"),
    "local": dict(protocol="local", topology="ring", rounds=4, model="mlp:hidden=16", seed=3),  # nodes: the default
    "gossip": dict(protocol="gossip", topology="er:p=0.4", nodes=12, rounds=7, seed=4, loss="0.2"),
    "push-sum": dict(protocol="push-sum", topology="ring", nodes=9, rounds=5, seed=5, latency="normal:mean=20ms,std=5ms"),
    "dpsgd": dict(protocol="dpsgd", topology="torus", nodes=9, rounds=4, model="mlp:hidden=16", seed=6),
    "dfedavgm-churn-crash": dict(protocol="dfedavgm", topology="regular:d=4", nodes=10, rounds=8,
                                 model="mlp:hidden=16", seed=10, churn="up=0.4s,down=0.2s", crash="0.2@0.9s",
                                 timeout=0.3),
    "gossip-link-faults": dict(protocol="gossip-learning", topology="regular:d=4", nodes=8, rounds=7,
                               model="mlp:hidden=16", seed=11, link_failures="up=0.3s,down=0.2s",
                               partition_event="t=0.5s:groups=0-3|4-7:heal=1.2s", availability="AVAILABILITY"),
    "l2c": dict(protocol="l2c", topology="regular:d=4", nodes=8, rounds=6, model="mlp:hidden=16", seed=12,
                prune="0.5", prune_round=2, local_epochs=1),
    "meta-l2c": dict(protocol="meta-l2c", topology="regular:d=4", nodes=8, rounds=5, model="mlp:hidden=16", seed=13,
                     local_epochs=1),
    # fedmn: a small cnn-small, whose batch norms' running statistics the checkpoint must carry too
    "fedmn": dict(protocol="fedmn", topology="star", nodes=6, rounds=6, seed=14, pretrain_rounds=2,
                  **SMALL_CNN, partition="mixture:components=2,samples=40"),
    "fedmn-p2p": dict(protocol="fedmn-p2p", topology="ring", nodes=6, rounds=5, seed=15, pretrain_rounds=1,
                      **SMALL_CNN, partition="mixture:components=2,samples=40"),
    "fedmn-frozen-mlp": dict(protocol="fedmn", topology="star", nodes=6, rounds=5, seed=23, router="frozen",
                             model="mlp:hidden=32", modules="1,3,2"),
    "fedlinked": dict(protocol="fedlinked", topology="star", nodes=5, rounds=5, seed=16, model="cnn-small:channels=8,16",
                      d_z=16, init_epochs=3, local_epochs=1, dist_epochs=1, partition="fedlinked:samples=40"),
    "fedlinked-p2p": dict(protocol="fedlinked-p2p", topology="ring", nodes=4, rounds=5, seed=17,
                          model="cnn-small:channels=8,16", d_z=16, init_epochs=3, local_epochs=1, dist_epochs=1,
                          partition="fedlinked:samples=40"),
    "dfedavgm-schedule-adversaries": dict(protocol="dfedavgm", topology="er:p=0.5", nodes=8, rounds=6,
                                         model="mlp:hidden=16", seed=18, topology_schedule="resample:every=2",
                                         adversaries="fraction=0.25,kind=noise:std=1", aggregate="median"),
    "dpsgd-one-peer-stale": dict(protocol="dpsgd", topology="ring", nodes=8, rounds=6, model="mlp:hidden=16",
                                 seed=19, topology_schedule="one-peer-exponential",
                                 adversaries="fraction=0.25,kind=stale"),
    "choco": dict(protocol="choco", topology="regular:d=4", nodes=8, rounds=7, model="mlp:hidden=16", seed=21,
                  loss="0.15", timeout=0.5),  # lost increments: stale copies, asked for whole
    "choco-icml2019": dict(protocol="choco", topology="regular:d=4", nodes=8, rounds=7, model="mlp:hidden=16",
                           seed=28, loss="0.15", timeout=0.5, choco_order="icml2019"),  # rows kept across rounds
    "deepsqueeze-randk": dict(protocol="dpsgd", topology="ring", nodes=8, rounds=6, model="mlp:hidden=16",
                              seed=22, sparsify="randk:0.1", error_feedback=True, churn="up=0.4s,down=0.2s",
                              timeout=0.3),
    "dcd-psgd-q8": dict(protocol="dpsgd", topology="ring", nodes=8, rounds=6, model="mlp:hidden=16", seed=27,
                        sparsify="q8", churn="up=0.4s,down=0.2s", timeout=0.3),  # replicas repaired whole
    "dfedavgm-dp": dict(protocol="dfedavgm", topology="ring", nodes=6, rounds=5, model="mlp:hidden=16", seed=29,
                        dp="clip=1,noise=0.8"),  # each node's accountant: its steps come back with the checkpoint
    "powergossip": dict(protocol="powergossip", topology="regular:d=4", nodes=8, rounds=6, model="mlp:hidden=16",
                        seed=23, power_steps=2, rank=2, loss="0.15", timeout=0.5),
    "fedavg": dict(protocol="fedavg", topology="star", nodes=7, rounds=5, model="mlp:hidden=16", seed=9,
                   clients_per_round=3, lr=0.5),
    "fedclassavg": dict(protocol="fedclassavg", topology="star", nodes=5, rounds=4, model="hetero-small", d_z=16,
                        batch_size=16, seed=25, partition=FEW_MAPL),
    "fedproto": dict(protocol="fedproto", topology="star", nodes=5, rounds=4, model="hetero-small", d_z=16, seed=26,
                     partition=FEW_MAPL),
    "fedsim": dict(protocol="fedsim", topology="star", nodes=5, rounds=4, model="hetero-small", d_z=16, seed=24,
                   partition=FEW_MAPL),
    "mapl": dict(protocol="mapl", topology="mesh", nodes=6, rounds=5, model="hetero-small", partition=FEW_MAPL,
                 local_epochs=1, t_thr=1, seed=7),
    "mapl+": dict(protocol="mapl+", topology="ring", nodes=6, rounds=4, model="mlp:hidden=16", local_epochs=1, t_thr=2,
                  seed=8, partition=FEW_MAPL),
}


def _same_run_directories(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir() if p.suffix == ".jsonl" or p.name == "links.csv")
    assert names == sorted(p.name for p in b.iterdir() if p.suffix == ".jsonl" or p.name == "links.csv")
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    first, second = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    for summary in (first, second):
        summary.pop("wall_seconds"), summary.pop("executor")
        summary.get("checkpoints", {}).pop("write_seconds", None)  # wall time
    assert first == second


def _unfinished_copy(done: Path, to: Path) -> Path:
    """The finished run as a kill after its last checkpoint leaves it: every file, no summary.json."""
    shutil.copytree(done, to)
    (to / "summary.json").unlink()
    return to


@pytest.mark.parametrize("name", list(RUNS))
def test_a_run_resumed_from_its_last_checkpoint_gives_the_same_bytes(name, tmp_path):
    settings = {**QUIET, **RUNS[name], "checkpoint_every": 2}
    if settings.get("availability") == "AVAILABILITY":  # an outage trace: node 2 away for a while, node 5 for good
        (tmp_path / "trace.csv").write_text("node,t_down,t_up\n2,0.2,0.9\n5,0.6,\n")
        settings["availability"] = str(tmp_path / "trace.csv")
    done = run(**settings, out=str(tmp_path / "done")).out_dir
    assert json.loads((done / "summary.json").read_text())["checkpoints"]["barriers"] == (settings["rounds"] - 1) // 2
    assert (done / "checkpoint").exists()
    resumed = _unfinished_copy(done, tmp_path / "resumed")
    assert main(["resume", str(resumed)]) == 0
    _same_run_directories(done, resumed)


def test_every_protocol_that_says_it_can_be_checkpointed_is_tested_here():
    claimed = {name for name, cls in protocols().items() if cls.checkpointable}
    assert claimed == {settings["protocol"] for settings in RUNS.values()}


@pytest.mark.parametrize("every", [1, 3])
def test_every_k_rounds(every, tmp_path):
    """K = 1 resumes from the last round; K = 3 from round 3 of 7, so rows past it are dropped and redone."""
    settings = {**QUIET, **RUNS["gossip-learning"], "rounds": 7, "checkpoint_every": every}
    done = run(**settings, out=str(tmp_path / "done")).out_dir
    resumed = _unfinished_copy(done, tmp_path / "resumed")
    assert main(["resume", str(resumed)]) == 0
    _same_run_directories(done, resumed)


def test_the_availability_process_puts_its_own_pending_transitions_back_on_the_clock():
    """Its state names its transitions still due (churn's with their generators); loaded into a fresh one on a
    fresh clock, the same transitions are due there, and another object's event is left to that object."""
    scenario = Scenario(num_nodes=6, churn=Churn(up=0.4, down=0.2), crash=Crash(fraction=0.5, time=3.0),
                        outages=[(1, 0.5, 0.9)])
    clock, fresh_clock = VirtualClock(), VirtualClock()
    availability = Availability(scenario, [True] * 6, clock, Seeds(1))
    availability.start()
    clock.schedule(0.1, print)  # not the availability's
    saved = availability.state()
    fresh = Availability(scenario, [True] * 6, fresh_clock, Seeds(1))
    fresh.load_state(saved)
    assert {name for _, name, _ in saved["pending"]} == {"_down", "_up", "_churn_down", "_crash"}
    assert fresh.state() == saved
    assert len(fresh_clock.pending()) == len(clock.pending()) - 1
    for each in (clock, fresh_clock):
        each.loop.close()


# Runs killed in the middle, each with its own --checkpoint-every (2 to 5): long enough that a kill within
# one checkpoint interval of the second checkpoint lands two intervals or more before the end.
KILLED = {
    "dfedavgm": ["--protocol", "dfedavgm", "--topology", "regular:d=4", "--nodes", "8", "--rounds", "20",
                 "--model", "mlp:hidden=32", "--seed", "7", "--checkpoint-every", "4"],
    "gossip-learning": ["--protocol", "gossip-learning", "--topology", "regular:d=4", "--nodes", "8", "--rounds", "30",
                        "--model", "mlp:hidden=32", "--seed", "8", "--checkpoint-every", "5", "--loss", "0.1"],
    "mapl": ["--protocol", "mapl", "--topology", "mesh", "--nodes", "6", "--rounds", "10", "--model", "hetero-small",
             "--partition", "mapl:scenario=1,samples=5,test=2", "--local-epochs", "1", "--seed", "9",
             "--checkpoint-every", "2"],
    # the crash, at 5 s of emulated time (about round 9), is still due at the second checkpoint
    "dfedavgm-churn-crash": ["--protocol", "dfedavgm", "--topology", "regular:d=4", "--nodes", "10", "--rounds", "18",
                             "--model", "mlp:hidden=32", "--seed", "10", "--checkpoint-every", "3", "--churn",
                             "up=0.4s,down=0.2s", "--crash", "0.2@5s", "--timeout", "0.3"],
}
KILLS = [("dfedavgm", 0), ("dfedavgm", 1), ("gossip-learning", 2), ("mapl", 3), ("dfedavgm-churn-crash", 4)]
KILLED_FLAGS = ["--trace", "--quiet", "--no-plots"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run of KILLED[name], never killed (made once per name, in this process)."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name) / "done"
            assert main([*KILLED[name], *KILLED_FLAGS, "--out", str(made[name])]) == 0
        return made[name]
    return get


@pytest.mark.parametrize("name, seed", KILLS, ids=[f"{name}-{seed}" for name, seed in KILLS])
def test_kill_9_at_a_random_moment_then_resume(uninterrupted, tmp_path, name, seed):
    """SIGKILL after the second checkpoint, at a random further delay of up to the wall time the run took
    from its first checkpoint to its second (so anywhere up to about the third, its write included); resume;
    the uninterrupted run's bytes."""
    reference = uninterrupted(name)
    every = int(KILLED[name][KILLED[name].index("--checkpoint-every") + 1])
    out = tmp_path / "killed"
    process = Forked([*KILLED[name], *KILLED_FLAGS, "--out", out])
    try:
        first = _checkpointed(out / "checkpoint", every, process)
        interval = _checkpointed(out / "checkpoint", 2 * every, process) - first
        time.sleep(random.Random(seed).uniform(0, interval))
    finally:
        process.kill()
        process.wait()
    assert not (out / "summary.json").exists(), "the run finished before the kill: make it longer"
    assert main(["resume", str(out)]) == 0
    _same_run_directories(reference, out)


def _checkpointed(path: Path, rnd: int, process: Forked) -> float:
    """The moment (time.monotonic) the run's checkpoint is first seen at round `rnd` or later."""
    deadline = time.monotonic() + 120
    while _checkpoint_round(path) < rnd:
        assert process.poll() is None and time.monotonic() < deadline, f"the run wrote no checkpoint of round {rnd}"
        time.sleep(0.01)
    return time.monotonic()


def _checkpoint_round(path: Path) -> int:
    from p2p_emulator import checkpoints

    try:
        import msgpack

        data = path.read_bytes()[len(checkpoints.MAGIC) + 32:]
        return msgpack.unpackb(data, raw=False, strict_map_key=False)["round"]
    except Exception:  # noqa: BLE001 - replaced under us: the next poll reads the new one
        return -1


def test_a_sweep_resumes_an_interrupted_run_from_its_checkpoint(tmp_path, monkeypatch):
    grid = {"base": {**RUNS["push-sum"], "trace": True, "no_plots": True, "checkpoint_every": 2},
            "grid": {"seed": [5, 6]}, "out": "runs/sweep"}
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid))
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", "--grid", "grid.yaml"]) == 0
    done = tmp_path / "done"
    shutil.copytree(tmp_path / "runs" / "sweep" / "seed=6", done)
    (tmp_path / "runs" / "sweep" / "seed=6" / "summary.json").unlink()  # killed after its last checkpoint
    started = []
    monkeypatch.setattr(runners, "run_job", lambda argv, run=runners.run_job: started.append(argv) or run(argv))
    assert main(["sweep", "--grid", "grid.yaml"]) == 0
    assert started == [["resume", str(Path("runs/sweep/seed=6"))]]
    _same_run_directories(done, tmp_path / "runs" / "sweep" / "seed=6")


# -- refused, one line and exit 2

@pytest.fixture
def unfinished(tmp_path):
    settings = {**QUIET, **RUNS["dfedavgm"], "checkpoint_every": 2}
    done = run(**settings, out=str(tmp_path / "done")).out_dir
    return _unfinished_copy(done, tmp_path / "unfinished")


def test_a_flipped_byte_is_refused(unfinished, capsys):
    checkpoint = unfinished / "checkpoint"
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0x10
    checkpoint.write_bytes(bytes(data))
    assert main(["resume", str(unfinished)]) == 2
    assert_one_line_error(capsys, "checksum")


def test_a_checkpoint_of_another_run_is_refused(unfinished, tmp_path, capsys):
    other = run(**QUIET, **{**RUNS["dfedavgm"], "seed": 9}, checkpoint_every=2, out=str(tmp_path / "other")).out_dir
    shutil.copy(other / "checkpoint", unfinished / "checkpoint")
    assert main(["resume", str(unfinished)]) == 2
    assert_one_line_error(capsys, "other settings")


def test_changed_settings_are_refused(unfinished, capsys):
    config = unfinished / "config.yaml"
    config.write_text(config.read_text().replace("rounds: 6", "rounds: 8"))
    assert main(["resume", str(unfinished)]) == 2
    assert_one_line_error(capsys, "other settings")


def test_no_checkpoint_and_a_finished_run_are_refused(tmp_path, capsys):
    done = run(**QUIET, **RUNS["push-sum"], out=str(tmp_path / "plain")).out_dir
    assert main(["resume", str(done)]) == 2
    assert_one_line_error(capsys, "finished")
    (done / "summary.json").unlink()
    assert main(["resume", str(done)]) == 2
    assert_one_line_error(capsys, "no checkpoint")


def test_a_protocol_that_declares_no_carried_state_is_refused(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(DFedAvgM, "checkpointable", False)  # as a plugin that never calls node.carry
    assert_refused(capsys, ["--protocol", "dfedavgm", "--checkpoint-every", "2", "--rounds", "3", "--quiet"],
                   "does not declare", tmp_path / "r")


@pytest.mark.parametrize("flags, named", [
    (["--checkpoint-every", "2", "--executor", "ray"], "--executor"),
    (["--checkpoint-every", "2", "--clock", "real"], "--clock"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
])
def test_runs_a_checkpoint_cannot_hold_are_refused(flags, named, tmp_path, capsys):
    assert_refused(capsys, [*flags, "--rounds", "3", "--quiet"], named, tmp_path / "r")
