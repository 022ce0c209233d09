"""FedProto: personal models of different architectures that share class prototypes through a server."""
import json
import shutil

import pytest
import torch

from emulator import wire
from p2p_emulator.cli import main
from p2p_emulator.runs import run
from p2p_emulator.workloads.models import build_model
from p2p_emulator.workloads.training import sgd
from protocols.fedproto import CLASSES, PROTOTYPES, local_update, mean_prototypes, prototype_check, representation
from tests.conftest import assert_refused

K, D_Z, ROUNDS = 10, 32, 3
STAR = ["--protocol", "fedproto", "--dataset", "digits", "--topology", "star", "--nodes", "7", "--d-z", str(D_Z),
        "--rounds", str(ROUNDS), "--quiet", "--no-plots", "--trace", "--seed", "3"]


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def star(tmp_path_factory):
    out = tmp_path_factory.mktemp("fedproto") / "star"
    assert main([*STAR, "--out", str(out)]) == 0
    return out


def body(classes: list[int]) -> dict:
    return {CLASSES: classes, PROTOTYPES: torch.zeros(len(classes), D_Z)}


def test_each_round_is_the_held_prototypes_up_and_every_class_back(star):
    """2M messages a round; a client's holds its 5 classes' prototypes, the server's all 10, each of the
    size the encoder gives such a body."""
    held = {n["node"] + 1: sorted(int(j) for j, count in n["train"].items() if count)  # part k is client k + 1
            for n in json.loads((star / "partition.json").read_text())["nodes"]}
    assert all(len(classes) == 5 for classes in held.values())
    messages = jsonl(star / "messages.jsonl")
    assert len(messages) == ROUNDS * 2 * 6
    for m in messages:
        expected = body(list(range(K)) if m["src"] == 0 else held[m["src"]])
        assert m["bytes"] == len(wire.encode([m["kind"], m["round"], expected])), m
    rows = jsonl(star / "metrics.jsonl")
    assert [r["heard_from"] for r in rows if r["node"] == 0] == [6] * ROUNDS
    last = [r for r in rows if r["round"] == ROUNDS - 1 and r["node"] != 0]
    assert len(last) == 6 and all({"test_acc", "test_acc_proto", "train_proto_loss"} <= r.keys() for r in last)
    assert all(r["train_proto_loss"] == 0 for r in rows if r["round"] == 0 and r["node"] != 0)  # no prototypes yet
    assert all(r["train_proto_loss"] > 0 for r in rows if r["round"] > 0 and r["node"] != 0)


def test_a_seed_gives_the_same_bytes(star, tmp_path):
    assert main([*STAR, "--out", str(tmp_path / "again")]) == 0
    for name in ("metrics.jsonl", "links.csv", "messages.jsonl"):
        assert (tmp_path / "again" / name).read_bytes() == (star / name).read_bytes(), name


def test_a_run_resumed_from_its_checkpoint_gives_the_same_bytes(tmp_path):
    done = run(protocol="fedproto", topology="star", nodes=5, rounds=4, d_z=16, seed=24, trace=True, quiet=True,
               no_plots=True, checkpoint_every=2, out=str(tmp_path / "done")).out_dir
    resumed = tmp_path / "resumed"
    shutil.copytree(done, resumed)
    (resumed / "summary.json").unlink()  # killed after its checkpoint at round 2
    assert main(["resume", str(resumed)]) == 0
    for name in ("metrics.jsonl", "links.csv", "messages.jsonl"):
        assert (resumed / name).read_bytes() == (done / name).read_bytes(), name


def test_the_server_takes_the_plain_mean_of_each_class_over_the_clients_that_sent_it():
    a, b, c = (torch.randint(-64, 64, (3, D_Z)).float() for _ in range(3))
    combined = mean_prototypes([{CLASSES: [0, 1, 2], PROTOTYPES: a}, {CLASSES: [1, 2, 7], PROTOTYPES: b},
                                {CLASSES: [1], PROTOTYPES: c[:1]}])
    assert combined[CLASSES] == [0, 1, 2, 7]
    expected = torch.stack([a[0], (a[1] + b[0] + c[0]) / 3, (a[2] + b[1]) / 2, b[2]])
    assert torch.equal(combined[PROTOTYPES], expected)


def test_bodies_other_than_the_wire_form_are_refused():
    valid = prototype_check(K, D_Z)
    good = {CLASSES: [1, 4], PROTOTYPES: torch.zeros(2, D_Z)}
    assert valid(good) and valid(body([])) and valid(body(list(range(K))))
    nan = torch.zeros(2, D_Z)
    nan[1, 3] = float("nan")
    for bad in ({CLASSES: [4, 1], PROTOTYPES: torch.zeros(2, D_Z)}, {CLASSES: [1, 1], PROTOTYPES: torch.zeros(2, D_Z)},
                {CLASSES: [1, K], PROTOTYPES: torch.zeros(2, D_Z)}, {CLASSES: [1, 4], PROTOTYPES: torch.zeros(3, D_Z)},
                {CLASSES: [1, 4], PROTOTYPES: torch.zeros(2, D_Z + 1)}, {CLASSES: [1, 4], PROTOTYPES: nan},
                {CLASSES: [1, 4], PROTOTYPES: torch.zeros(2, D_Z, dtype=torch.float64)},
                {CLASSES: torch.tensor([1, 4]), PROTOTYPES: torch.zeros(2, D_Z)},
                {CLASSES: [True, 4], PROTOTYPES: torch.zeros(2, D_Z)}, {**good, "samples": 3}, {CLASSES: [1]}, None):
        assert not valid(bad), bad


def _data(n: int = 64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 8, 8, generator=g), torch.arange(n) % 4


def _train(model, x, y, shared, ld, epochs=2, lr=0.1):
    return local_update(model, x, y, shared, ld=ld, epochs=epochs, lr=lr, momentum=0.5, weight_decay=1e-4,
                        batch_size=16, generator=torch.Generator().manual_seed(1))


def _model():
    return build_model("mlp", (1, 8, 8), K, d_z=D_Z, init_seed=5)


def _same_parameters(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_without_a_prototype_pull_the_local_step_is_plain_cross_entropy_sgd():
    """ld = 0, or global prototypes only for classes the client lacks: sgd's steps, bit for bit."""
    x, y = _data()
    plain = _model()
    sgd(plain, x, y, epochs=2, steps=0, lr=0.1, momentum=0.5, weight_decay=1e-4, batch_size=16,
        generator=torch.Generator().manual_seed(1))
    others = {CLASSES: [5, 6], PROTOTYPES: torch.ones(2, D_Z)}
    for shared, ld in ((None, 1.0), ({CLASSES: [0, 1, 2, 3], PROTOTYPES: torch.ones(4, D_Z)}, 0.0), (others, 5.0)):
        model = _model()
        _, proto_loss, _ = _train(model, x, y, shared, ld)
        assert _same_parameters(model, plain), (shared, ld)
        assert proto_loss == 0 or ld == 0


def test_the_prototype_term_pulls_each_representation_toward_its_class_prototype():
    x, y = _data()
    targets = torch.rand(4, D_Z, generator=torch.Generator().manual_seed(2)) * 2
    shared = {CLASSES: [0, 1, 2, 3], PROTOTYPES: targets}

    def distance(model) -> float:
        model.eval()
        with torch.no_grad():
            return float(((representation(model, x) - targets[y]) ** 2).mean())

    before = distance(_model())
    distances = {}
    for ld in (0.0, 10.0):
        model = _model()
        _, proto_loss, _ = _train(model, x, y, shared, ld)
        distances[ld] = distance(model)
        assert proto_loss > 0
    assert distances[10.0] < 0.5 * min(before, distances[0.0]), (before, distances)


def test_local_prototypes_are_the_class_means_of_the_last_epochs_trained_samples():
    """lr 0 keeps the model, so the representations are those of the model as built. 70 samples in batches
    of 16: the last epoch's permutation (the job's second draw) drops its last 6 samples, so each class's
    mean is over its trained samples only, and class 9, whose one sample is dropped, is not sent."""
    x, y = _data(70)
    g = torch.Generator().manual_seed(1)
    torch.randperm(70, generator=g)  # the first epoch's order
    last = torch.randperm(70, generator=g)
    trained, dropped = last[:64], last[64:]
    y[dropped[0]] = 9
    model = _model()
    _, _, sent = _train(model, x, y, None, 1.0, epochs=2, lr=0.0)
    assert _same_parameters(model, _model())
    with torch.no_grad():
        r = representation(model, x)
    assert sent[CLASSES] == [0, 1, 2, 3]
    assert sent[PROTOTYPES].shape == (4, D_Z) and sent[PROTOTYPES].dtype == torch.float32
    for row, j in zip(sent[PROTOTYPES], sent[CLASSES]):
        assert torch.allclose(row, r[trained[y[trained] == j]].mean(0), atol=1e-6), j
        if (y[dropped] == j).any():  # a class with a dropped sample: its mean over all its samples differs
            assert not torch.allclose(row, r[y == j].mean(0), atol=1e-6), j


def test_fedproto_learns_within_a_few_points_of_local_training(tmp_path):
    """Scenario 1 (5 classes per client, chance 0.2), 8 clients, as many rounds of the same local SGD."""
    common = ["--dataset", "digits", "--partition", "mapl:scenario=1", "--model", "hetero-small", "--d-z", "64",
              "--init", "independent", "--lr", "0.05", "--momentum", "0.5", "--weight-decay", "0", "--batch-size",
              "16", "--rounds", "6", "--seed", "0", "--quiet", "--no-plots"]
    final = {}
    for protocol, nodes in (("fedproto", "9"), ("local", "8")):  # fedproto: one server and 8 clients
        out = tmp_path / protocol
        assert main(["--protocol", protocol, "--topology", "star", "--nodes", nodes, *common, "--out", str(out)]) == 0
        final[protocol] = json.loads((out / "summary.json").read_text())["final"]
    assert final["fedproto"]["test_acc"] >= 0.7
    assert final["fedproto"]["test_acc"] >= final["local"]["test_acc"] - 0.05, final
    assert final["fedproto"]["test_acc_proto"] >= 0.6


@pytest.mark.parametrize("argv, named", [
    (["--ld", "-1"], "--ld"),
    (["--local-steps", "5"], "--local-steps"),
    (["--topology", "ring"], "--topology star"),
])
def test_bad_options_are_refused_in_one_line(capsys, tmp_path, argv, named):
    assert_refused(capsys, ["--protocol", "fedproto", "--nodes", "5", "--topology", "star", *argv], named,
                   tmp_path / "r")
