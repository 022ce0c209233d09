"""Gossip learning through the real network path."""
import json
import statistics
from collections import Counter

import pytest

from emulator import wire
from p2p_emulator.cli import main
from tests.conftest import assert_one_line_error
from p2p_emulator.workloads.models import build_model
from p2p_emulator.workloads.training import float_state
from protocols.gossip_learning import merge_weight

N = 16
RING16 = ["--topology", "ring", "--nodes", str(N), "--dataset", "digits", "--partition", "iid",
          "--model", "mlp:hidden=64", "--quiet", "--no-plots"]


def _run(out, *args):
    assert main([*RING16, *args, "--out", str(out)]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), metrics


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    out = tmp_path_factory.mktemp("gossip-learning") / "traced"
    summary, metrics = _run(out, "--protocol", "gossip-learning", "--rounds", "10", "--trace")
    return summary, metrics, out


def test_each_node_pushes_one_model_to_one_ring_neighbour_per_round(traced):
    summary, _, out = traced
    messages = [json.loads(line) for line in (out / "messages.jsonl").read_text().splitlines()]
    assert summary["messages_total"] == len(messages) == N * 10
    assert Counter((m["round"], m["src"]) for m in messages) == {(r, i): 1 for r in range(10) for i in range(N)}
    assert all((m["dst"] - m["src"]) % N in (1, N - 1) for m in messages)
    # Ages stay below 128 in 10 rounds, so every frame has the size of round 0's.
    model = build_model("mlp:hidden=64", (1, 8, 8), 10)
    expected = len(wire.encode(["model", 0, {"state": float_state(model), "age": 0}]))
    assert {m["bytes"] for m in messages} == {expected}


def test_every_round_trains_by_default(traced):
    _, metrics, _ = traced
    assert len(metrics) == N * 10
    assert all("train_loss" in r for r in metrics)
    assert sum(r["heard_from"] for r in metrics) == N * 10  # every push arrives on a fault-free ring


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_dfedavgm_with_the_same_training(tmp_path, seed):
    """One local epoch per node per round in both, same optimiser: gossip learning ends within 3 points.

    50 rounds (both at 0.91, 0.2 points apart at seeds 0 and 1) tell a gossip that merges nothing apart as
    100 did: it ends 4.3 and 5.1 points behind (100 rounds: 5.8 and 6.2)."""
    args = ["--rounds", "50", "--eval-every", "50", "--seed", str(seed)]
    gossip, _ = _run(tmp_path / "gossip", "--protocol", "gossip-learning", *args)
    dfedavgm, _ = _run(tmp_path / "dfedavgm", "--protocol", "dfedavgm", *args)
    assert dfedavgm["final"]["test_acc"] >= 0.85
    assert gossip["final"]["test_acc"] >= 0.85
    assert gossip["final"]["test_acc"] >= dfedavgm["final"]["test_acc"] - 0.03


def test_churn_drops_pushes_and_every_round_completes(tmp_path):
    summary, metrics = _run(tmp_path / "churn", "--protocol", "gossip-learning", "--rounds", "10",
                            "--churn", "up=2s,down=1s")
    assert sorted((r["round"], r["node"]) for r in metrics) == [(r, i) for r in range(10) for i in range(N)]
    assert summary["dropped_offline"] > 0
    assert summary["messages_total"] == N * 10


def test_train_on_receipt_only_skips_silent_rounds(tmp_path):
    _, metrics = _run(tmp_path / "receipt", "--protocol", "gossip-learning", "--rounds", "10",
                      "--train-on-receipt-only")
    silent = [r for r in metrics if r["heard_from"] == 0]
    assert silent and len(silent) < len(metrics)
    assert all(("train_loss" in r) == (r["heard_from"] > 0) for r in metrics)


def test_merge_weight_is_the_received_models_share_of_the_ages():
    """merge_weight(how, age, other_age): the weight of the received model (age other_age)."""
    assert (merge_weight("age", 3, 1), merge_weight("age", 1, 3), merge_weight("age", 0, 0),
            merge_weight("average", 3, 1)) == (0.25, 0.75, 0.5, 0.5)


def test_age_merge_departs_from_average_once_ages_differ(tmp_path):
    """On a fault-free ring every node trains every round, so all ages are equal and --merge age gives the
    same files as --merge average. With --train-on-receipt-only a node that hears nothing keeps its age, so
    ages differ from then on: the same pushes (the neighbours are drawn alike), other models."""
    tiny = ["--protocol", "gossip-learning", "--nodes", "4", "--rounds", "3", "--train-on-receipt-only"]
    _, by_age = _run(tmp_path / "age", *tiny, "--merge", "age")
    _, halfway = _run(tmp_path / "average", *tiny, "--merge", "average")
    assert [(r["round"], r["node"], r["heard_from"]) for r in by_age] == [
        (r["round"], r["node"], r["heard_from"]) for r in halfway]
    assert any(r["heard_from"] == 0 for r in by_age if r["round"] < 2)  # a node skipped training: ages differ
    assert [r for r in by_age if r["round"] == 0] == [r for r in halfway if r["round"] == 0]  # all ages 0: 1/2
    assert [r for r in by_age if r["round"] == 2] != [r for r in halfway if r["round"] == 2]


def test_an_unknown_merge_exits_2_with_one_line(tmp_path, capsys):
    assert main([*RING16, "--protocol", "gossip-learning", "--rounds", "1", "--merge", "x",
                 "--out", str(tmp_path / "r")]) == 2
    assert_one_line_error(capsys, "--merge")
    assert not (tmp_path / "r" / "summary.json").exists()


def test_the_same_seed_gives_identical_files(tmp_path, traced):
    _, _, first = traced
    second = tmp_path / "again"
    _run(second, "--protocol", "gossip-learning", "--rounds", "10", "--trace")
    for name in ("metrics.jsonl", "links.csv"):
        assert (first / name).read_bytes() == (second / name).read_bytes()


# -- --wake-up periodic and poisson: each node's own clock (the paper's schedule)

def _wake_up_run(out, wake_up, *args):
    return _run(out, "--protocol", "gossip-learning", "--wake-up", wake_up, "--duration", "20", "--trace", *args)


@pytest.fixture(scope="module", params=["periodic", "poisson"])
def woken(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("wake-up") / request.param
    summary, metrics = _wake_up_run(out, request.param)
    return request.param, summary, metrics, out


def _step_ends(metrics) -> dict[int, list[float]]:
    """Each node's step ends: its next wake-up (the last one: the horizon)."""
    ends = {i: [] for i in range(N)}
    for row in sorted(metrics, key=lambda r: r["round"]):
        ends[row["node"]].append(row["t"])
    return ends


def test_wake_ups_are_each_nodes_own(woken):
    """periodic: every --period at a phase of the node's own; poisson: exponential gaps of mean --period."""
    wake_up, _, metrics, _ = woken
    ends = _step_ends(metrics)
    gaps = [b - a for times in ends.values() for a, b in zip(times[:-1], times[1:-1])]  # wake-up to wake-up
    phases = [times[0] % 1.0 for times in ends.values()]
    assert len(set(phases)) == N and max(phases) - min(phases) > 0.5
    if wake_up == "periodic":
        assert gaps == pytest.approx([1.0] * len(gaps), abs=1e-9)
        assert {len(times) for times in ends.values()} == {20}  # 20 wake-ups in 20 s, whatever the phase
    else:
        assert len(gaps) > 200
        assert statistics.fmean(gaps) == pytest.approx(1.0, rel=0.15)
        assert 0.7 < statistics.pstdev(gaps) / statistics.fmean(gaps) < 1.3
        assert len({len(times) for times in ends.values()}) > 3


def test_each_wake_up_pushes_once_and_each_model_received_is_merged_and_trained_on(woken):
    _, summary, metrics, out = woken
    messages = [json.loads(line) for line in (out / "messages.jsonl").read_text().splitlines()]
    steps = Counter(row["node"] for row in metrics)
    assert Counter(m["src"] for m in messages) == steps
    assert all((m["dst"] - m["src"]) % N in (1, N - 1) for m in messages)
    delivered = sum(m["fate"] == "delivered" for m in messages)
    in_flight = sum(m["fate"] is None or m["t_arrive"] is None for m in messages)
    # each model is trained on once it arrives; the last ones may land after their receiver's last step
    assert delivered - N <= sum(r["heard_from"] for r in metrics) <= delivered and in_flight <= N
    assert all(("train_loss" in r) == (r["heard_from"] > 0) for r in metrics)


def test_wake_ups_learn_and_report_each_nodes_last_row(woken):
    _, summary, metrics, _ = woken
    last = {row["node"]: row for row in metrics}
    assert all("test_acc" in row for row in last.values())  # scored once, into each node's last row
    assert sum("test_acc" in row for row in metrics) == N
    assert summary["final"]["test_acc_nodes"] == N
    assert summary["final"]["test_acc"] >= 0.8


def test_wake_ups_give_identical_files_for_the_same_seed(tmp_path, woken):
    wake_up, _, _, first = woken
    second = tmp_path / "again"
    _wake_up_run(second, wake_up)
    for name in ("metrics.jsonl", "links.csv", "messages.jsonl"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_an_unknown_wake_up_exits_2_with_one_line(tmp_path, capsys):
    assert main([*RING16, "--protocol", "gossip-learning", "--rounds", "1", "--wake-up", "async",
                 "--out", str(tmp_path / "r")]) == 2
    assert_one_line_error(capsys, "--wake-up")


def test_wake_ups_need_a_duration(tmp_path, capsys):
    assert main([*RING16, "--protocol", "gossip-learning", "--rounds", "3", "--wake-up", "poisson",
                 "--out", str(tmp_path / "r")]) == 2
    assert_one_line_error(capsys, "--duration")
    assert not (tmp_path / "r" / "summary.json").exists()
