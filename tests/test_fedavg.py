"""FedAvg: a server node on a star, clients that hold the data, through the real network path."""
import csv
import json

import pytest
import torch

from p2p_emulator.cli import main
from protocols.fedavg import average
from tests.conftest import assert_one_line_error
from p2p_emulator.workloads.models import build_model
from p2p_emulator.workloads.training import float_state

DIGITS = ["--protocol", "fedavg", "--dataset", "digits", "--model", "mlp:hidden=64", "--normalize", "max",
          "--lr", "0.5", "--quiet", "--no-plots"]
STAR9 = [*DIGITS, "--topology", "star", "--nodes", "9"]  # node 0 serves 8 clients
ROUNDS = 10


def _run(out, *args):
    assert main([*args, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    return summary, _jsonl(out / "metrics.jsonl")


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def star(tmp_path_factory):
    out = tmp_path_factory.mktemp("fedavg") / "star"
    return (*_run(out, *STAR9, "--rounds", str(ROUNDS), "--trace"), out)


def test_fedavg_learns_digits_on_a_star(star):
    summary, metrics, _ = star
    assert summary["server"] == 0
    assert summary["final"]["test_acc"] >= 0.85
    # Under the global test set only the server scores the global model; every client trains every round.
    assert all(("test_acc" in r) == (r["node"] == 0) for r in metrics)
    assert all("train_loss" in r for r in metrics if r["node"] != 0)
    assert [r["heard_from"] for r in metrics if r["node"] == 0] == [8] * ROUNDS


def test_a_seed_gives_the_same_run(star, tmp_path):
    _, _, out = star
    _run(tmp_path / "again", *STAR9, "--rounds", str(ROUNDS), "--trace")
    for name in ("metrics.jsonl", "links.csv", "messages.jsonl"):
        assert (tmp_path / "again" / name).read_text() == (out / name).read_text()


def test_the_average_is_weighted_by_samples_exactly():
    model = build_model("mlp", (1, 8, 8), 10)
    # Small integers: 0.25 a + 0.75 b is then exact in float32, whatever the order of the operations.
    a = {k: torch.randint(-64, 64, v.shape).float() for k, v in float_state(model).items()}
    b = {k: torch.randint(-64, 64, v.shape).float() for k, v in float_state(model).items()}
    average(model, [(1, a), (3, b)])
    after = float_state(model)
    assert all(torch.equal(after[k], 0.25 * a[k] + 0.75 * b[k]) for k in a)


def test_no_update_keeps_the_global_model():
    model = build_model("mlp", (1, 8, 8), 10)
    before = float_state(model)
    average(model, [])
    assert all(torch.equal(before[k], v) for k, v in float_state(model).items())


def test_each_round_is_one_model_out_and_one_update_back_per_client(star):
    summary, _, out = star
    assert summary["messages_total"] == summary["messages_delivered"] == ROUNDS * (8 + 8)
    links = {(int(r["src"]), int(r["dst"])): r for r in csv.DictReader((out / "links.csv").open())}
    assert set(links) == {(0, c) for c in range(1, 9)} | {(c, 0) for c in range(1, 9)}
    for c in range(1, 9):
        down, up = links[0, c], links[c, 0]
        assert int(down["msgs_sent"]) == int(up["msgs_sent"]) == ROUNDS
        assert int(down["bytes_sent"]) > 0 and int(up["bytes_sent"]) > 0
        # The same float state both ways; the update adds only its sample count.
        assert abs(int(up["bytes_sent"]) - int(down["bytes_sent"])) <= ROUNDS * 32


def test_params_sent_counts_the_model_once_per_message(star):
    _, metrics, _ = star
    entries = sum(p.numel() for p in build_model("mlp:hidden=64", (1, 8, 8), 10).parameters())  # 64*64+64 + 64*10+10
    assert entries == 4810
    for row in metrics:
        assert row["params_sent"] == entries * (8 if row["node"] == 0 else 1), row


def test_clients_per_round_samples_that_many_and_idles_the_rest(tmp_path):
    _run(tmp_path / "r", *STAR9, "--rounds", "6", "--clients-per-round", "3", "--trace")
    messages = _jsonl(tmp_path / "r" / "messages.jsonl")
    sampled = [{m["src"] for m in messages if m["kind"] == "update" and m["round"] == r} for r in range(6)]
    assert all(len(s) == 3 for s in sampled)
    assert len({frozenset(s) for s in sampled}) > 1
    for r in range(6):
        models = [m for m in messages if m["kind"] == "model" and m["round"] == r]
        assert sorted(m["dst"] for m in models) == list(range(1, 9))  # every client hears every round
        assert all(m["bytes"] > 1000 for m in models if m["dst"] in sampled[r])
        assert all(m["bytes"] < 100 for m in models if m["dst"] not in sampled[r])  # an empty message


def test_a_mesh_works_and_local_test_sets_are_scored_by_the_clients(tmp_path):
    summary, metrics = _run(tmp_path / "r", *DIGITS, "--topology", "mesh", "--nodes", "5", "--rounds", "2",
                            "--partition", "classes:k=2")
    assert summary["server"] == 0 and summary["messages_total"] == 2 * (4 + 4)
    assert all(("test_acc" in r) == (r["node"] != 0) for r in metrics)


def test_rounds_zero_scores_the_initial_global_model_once(tmp_path):
    _, metrics = _run(tmp_path / "r", *STAR9, "--rounds", "0")
    assert [r["node"] for r in metrics if "test_acc" in r] == [0]


@pytest.mark.parametrize("args,named", [
    (["--topology", "ring", "--nodes", "6"], "--topology star"),
    (["--topology", "star", "--nodes", "9", "--clients-per-round", "9"], "--clients-per-round 9"),
    (["--clients-per-round", "-1"], "--clients-per-round -1"),
    (["--init", "independent"], "--init independent"),
    (["--timeout", "0"], "--timeout 0"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, named):
    assert main([*DIGITS, "--rounds", "1", *args, "--out", str(tmp_path / "r")]) == 2
    assert_one_line_error(capsys, named)
    assert not (tmp_path / "r" / "summary.json").exists()


def test_churn_drops_messages_and_the_run_completes(tmp_path):
    summary, metrics = _run(tmp_path / "r", *STAR9, "--rounds", str(ROUNDS), "--churn", "up=2s,down=1s",
                            "--timeout", "0.5", "--compute-time", "per-sample")  # rounds of seconds: churn hits
    assert summary["dropped_offline"] > 0
    server = [r for r in metrics if r["node"] == 0]
    assert [r["round"] for r in server] == list(range(ROUNDS))
    assert 0 < sum(r["heard_from"] for r in server) < 8 * ROUNDS


def test_a_schedule_that_cuts_a_client_off_leaves_it_out_of_those_rounds(tmp_path):
    schedule = tmp_path / "star.csv"  # round 0: a star of 4; round 1: client 3 cut off; then it repeats
    schedule.write_text("round,src,dst\n0,0,1\n0,0,2\n0,0,3\n1,0,1\n1,0,2\n")
    summary, metrics = _run(tmp_path / "r", *DIGITS, "--topology-schedule", str(schedule), "--rounds", "4",
                            "--timeout", "1")
    heard = [row["heard_from"] for row in metrics if row["node"] == 0]
    assert heard == [3, 2, 3, 2]
    assert summary["messages_total"] == 3 * 2 + 2 * 2 + 3 * 2 + 2 * 2
