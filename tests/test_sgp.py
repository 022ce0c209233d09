"""Stochastic Gradient Push: push-sum's exact mean, asynchrony under stragglers, --sync, faults, reruns."""
import json
import math
from dataclasses import replace
from pathlib import Path

import networkx as nx
import pytest
import torch

from emulator.protocol import RunInfo
from emulator.seeds import Seeds
from p2p_emulator import run
from p2p_emulator.runs import execute
from p2p_emulator.settings import RunConfig
from p2p_emulator.workloads.task import Workload, WorkloadOptions
from p2p_emulator.workloads.training import float_state
from protocols.sgp import SGP, SGPOptions
from tests.conftest import assert_refused

QUIET = dict(quiet=True, no_plots=True)
# 16-node digits ring, a quarter of the nodes 4x slower
STRAGGLERS = dict(**QUIET, topology="ring", nodes=16, dataset="digits", partition="iid", model="mlp:hidden=64",
                  compute_speed="stragglers:fraction=0.25,slowdown=4",
                  compute_time="per-sample")  # 1 ms a training sample: the figures below
ROUNDS = 40


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _curve(result) -> dict[float, float]:
    """Mean test accuracy over the nodes at each tick of --eval-every-seconds."""
    by_tick: dict[float, list[float]] = {}
    for row in _lines(result.out_dir / "samples.jsonl"):
        by_tick.setdefault(row["t"], []).append(row["test_acc"])
    return {t: sum(accs) / len(accs) for t, accs in sorted(by_tick.items())}


def _time_to(curve: dict[float, float], target: float) -> float:
    return next((t for t, acc in curve.items() if acc >= target), float("inf"))


def _last_rows(metrics: list[dict]) -> dict[int, dict]:
    return {row["node"]: row for row in metrics}


# -- push-sum: the exact mean ------------------------------------------------------------------

def _averaged(tmp_path, n: int, seed: int, options: SGPOptions, **config) -> tuple:
    """Push-sum alone (--average-only --init independent): the run, the farthest any node's final z_i is from the
    mean of the initial models, and the farthest an initial model is from it."""
    final = {}

    class Kept(SGP):  # each node's z_i once its last step is done
        async def log_final_scores(self, node, model, data):
            final[node.id] = await self.state(node, model)

    result = execute(RunConfig(protocol="sgp", nodes=n, seed=seed, **QUIET, **config), options, Kept, tmp_path / "run")
    # the initial models as the workload draws them from the seed
    workload = Workload(WorkloadOptions(init="independent", model=options.model),
                        RunInfo(n, 1, Seeds(seed), nx.complete_graph(n), "cpu", tmp_path))
    initial = [float_state(workload.model(i)) for i in range(n)]
    mean = {k: torch.stack([x[k].double() for x in initial]).mean(0) for k in initial[0]}

    def farthest(states) -> float:
        return max(float((s[k].double() - mean[k]).abs().max()) for s in states for k in mean)

    assert sorted(final) == list(range(n))
    return result, farthest(final.values()), farthest(initial)


def test_async_push_sum_reaches_the_exact_mean_of_the_initial_models(tmp_path):
    """--average-only on the directed one-peer exponential graph, nodes at different paces (each on the graph
    of its own step): every de-biased model ends at the mean of the 16 independent initial models."""
    options = SGPOptions(average_only=True, init="independent", model="mlp:hidden=16", min_weight=0)  # AGP
    # 0.4 s: 166 to 434 steps a node (a step of counted compute takes about a millisecond)
    result, error, spread = _averaged(tmp_path, 16, 3, options, topology="ring", duration=0.4,
                                      topology_schedule="one-peer-exponential", compute_speed="uniform:low=1,high=3")
    assert spread > 0.1 and error < 1e-6  # far apart at the start
    steps = [row["round"] + 1 for row in _last_rows(result.metrics).values()]
    assert max(steps) > 1.5 * min(steps)  # the nodes went at their own paces


@pytest.mark.parametrize("seed", [0, 1])
def test_robust_push_sum_keeps_the_exact_mean_under_loss(tmp_path, seed):
    """--loss 0.1 drops a tenth of the shares. The plain rule loses their mass, and the mean the nodes agree on
    moves; --robust's running sums bring a lost share's mass with the sender's next one: the exact mean."""
    options = SGPOptions(average_only=True, init="independent", model="mlp:hidden=16")
    faults = dict(topology="regular:d=4", duration=1.5, loss="0.1", loss_model="datagram", compute_time="per-sample")
    plain, plain_error, spread = _averaged(tmp_path / "plain", 8, seed, options, **faults)
    robust, error, _ = _averaged(tmp_path / "robust", 8, seed, replace(options, robust=True), **faults)
    assert plain.summary["dropped_loss"] > 20 and robust.summary["dropped_loss"] > 20
    assert plain_error > 0.01 * spread and error < 1e-5 * spread, (plain_error, error, spread)


# -- stragglers: async against D-PSGD and against --sync ----------------------------------------

@pytest.fixture(scope="module")
def stragglers(tmp_path_factory):
    """D-PSGD for ROUNDS rounds (T emulated seconds, final accuracy A), then async and --sync SGP for T/2."""
    root = tmp_path_factory.mktemp("sgp")
    dpsgd = run(**STRAGGLERS, protocol="dpsgd", rounds=ROUNDS, eval_every=ROUNDS, out=str(root / "dpsgd"))
    horizon = dpsgd.summary["emulated_seconds"] / 2
    sgp = dict(**STRAGGLERS, protocol="sgp", duration=horizon, eval_every_seconds=horizon / 10)
    return {"dpsgd": dpsgd, "horizon": horizon, "sgp": sgp,
            "async": run(**sgp, out=str(root / "async")), "sync": run(**sgp, sync=True, out=str(root / "sync"))}


def test_async_sgp_reaches_dpsgds_accuracy_in_half_its_time(stragglers):
    """D-PSGD waits for its slowest neighbour every round; asynchronous SGP does not."""
    target = stragglers["dpsgd"].summary["final"]["test_acc"]
    assert target > 0.6
    curve = _curve(stragglers["async"])
    assert max(curve) <= stragglers["horizon"] + 1e-9
    assert max(curve.values()) >= target, (target, curve)


def test_async_nodes_wait_only_when_their_mass_runs_short_and_stragglers_take_a_quarter_of_the_steps(stragglers):
    """A fast node beside a straggler pushes more mass than comes back: it waits for w >= --min-weight (0.25),
    a fifth of its time at most; the others never wait."""
    result = stragglers["async"]
    idle = result.summary["node_time"]["idle_fraction"]
    assert max(idle) < 0.25 and sum(f < 0.02 for f in idle) >= 8, idle  # (the closing handshake waits a little)
    last = _last_rows(result.metrics)
    steps = sorted(row["round"] + 1 for row in last.values())
    slow, fast = steps[:4], steps[4:]
    assert max(slow) == min(slow) and min(fast) >= 3 * slow[0] and max(fast) == pytest.approx(4 * slow[0], abs=1)
    assert all(row["ps_weight"] >= 0.25 for row in result.metrics if row["round"] < last[row["node"]]["round"])
    assert {"train_loss", "mixed", "ps_weight"} <= set(result.metrics[0])
    assert result.summary["staleness"]["count"] > 0 and result.summary["staleness"]["max"] >= 1


def test_sync_waits_for_the_in_neighbours_and_is_slower_under_stragglers(stragglers):
    result = stragglers["sync"]
    last = _last_rows(result.metrics)
    assert all(abs(last[i]["round"] - last[(i + 1) % 16]["round"]) <= 1 for i in range(16))  # neighbours in step
    assert max(result.summary["node_time"]["idle_fraction"]) > 0.5  # the fast nodes wait
    # every share of the step arrives within it: w stays 1 (1/3 kept, 1/3 from each ring neighbour)
    within = [r for r in result.metrics if r["round"] < min(r["round"] for r in last.values())]
    assert within and all(r["mixed"] == 2 and r["ps_weight"] == pytest.approx(1, abs=1e-12) for r in within)
    fast, slow = _curve(stragglers["async"]), _curve(result)
    target = 0.6
    assert _time_to(fast, target) <= stragglers["horizon"] / 2
    assert _time_to(slow, target) >= 2 * _time_to(fast, target), (fast, slow)


def test_a_rerun_is_byte_identical(stragglers, tmp_path):
    again = run(**stragglers["sgp"], out=str(tmp_path / "again"))
    for name in ("metrics.jsonl", "links.csv", "samples.jsonl"):
        assert (again.out_dir / name).read_bytes() == (stragglers["async"].out_dir / name).read_bytes(), name


# -- faults --------------------------------------------------------------------------------------

SMALL = dict(**QUIET, protocol="sgp", topology="ring", nodes=8, dataset="digits", model="mlp:hidden=16", duration=1.5,
             compute_time="per-sample")
STEP = 0.032  # a step's compute: --batch-size 32 at the default 1 ms per sample


# w after a step without faults: 0.6 on this ring asynchronously (the rest in flight), 1 with --sync
@pytest.mark.parametrize("faults, dropped, late, lossless_w", [
    (dict(loss="0.1", loss_model="datagram"), "dropped_loss", STEP, 0.6),
    (dict(loss="0.1", loss_model="datagram", sync=True, timeout=0.2), "dropped_loss", STEP, 1.0),
    (dict(churn="up=2s,down=0.2s"), "dropped_offline", 2.0, 0.6),  # an offline node's step waits until it is back
])
def test_lost_shares_drain_the_mass_and_the_run_ends_near_the_horizon(tmp_path, faults, dropped, late, lossless_w):
    result = run(**SMALL, **faults, out=str(tmp_path / "run"))
    assert result.summary[dropped] > 0
    closing = 0.3  # a node waits for its in-neighbours' "closed" (lost ones too) about a step and a round trip
    assert SMALL["duration"] <= result.summary["emulated_seconds"] <= SMALL["duration"] + late + closing
    last = _last_rows(result.metrics)
    assert sorted(last) == list(range(8))
    # each lost share took its part of w (a --sync node's last step, cut at the horizon, waits for nothing: not that)
    before_last = _last_rows([row for row in result.metrics if row["round"] < last[row["node"]]["round"]])
    assert sum(row["ps_weight"] for row in before_last.values()) / 8 < 0.75 * lossless_w


@pytest.mark.parametrize("min_weight", [0.0, 0.25])
def test_under_heavy_loss_drained_nodes_diverge_unless_they_wait_for_mass(tmp_path, min_weight):
    """--loss 0.9: w falls about 60% a step. AGP (--min-weight 0): lr/w overflows float32 within about 100 steps,
    and the run goes on. By default a node waits for w >= 0.25 instead, until the horizon: it stops, finite."""
    result = run(**{**SMALL, "duration": 4.0}, loss="0.9", loss_model="datagram", min_weight=min_weight,
                 out=str(tmp_path / "run"))
    # and the closing wait: with 9 in 10 shares lost, the gaps between those that come are long
    assert result.summary["emulated_seconds"] <= 4.0 + STEP + 0.5
    last = _last_rows(result.metrics)
    if min_weight:
        assert all(math.isfinite(row["train_loss"]) for row in result.metrics)
        assert result.summary["dropped_invalid"] == 0 and max(row["round"] for row in last.values()) < 20
    else:
        assert all(row["ps_weight"] < 1e-40 and not math.isfinite(row["train_loss"]) for row in last.values())
        assert result.summary["dropped_invalid"] > 0  # infinite models, refused by their receivers


@pytest.mark.parametrize("argv, named", [
    (["--eval-every", "5"], "--eval-every"),
    (["--timeout", "0"], "--timeout"),
    (["--lr", "-1"], "--lr"),
    (["--batch-size", "0"], "--batch-size"),
    (["--min-weight", "1"], "--min-weight"),
    (["--robust", "--topology", "regular:d=2", "--topology-schedule", "resample:every=2"], "--robust"),
])
def test_bad_options_are_refused_in_one_line(capsys, tmp_path, argv, named):
    assert_refused(capsys, ["--protocol", "sgp", "--nodes", "4", "--duration", "1", *argv], named, tmp_path / "r")
