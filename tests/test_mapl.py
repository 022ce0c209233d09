"""MAPL: the learned graph finds the clusters, messages carry exactly prototypes (+ classifier),
zero-weight links go silent, the paper backbones run, and the w/o-CGL ablation stays uniform."""
import json

import pytest
import torch

from emulator import wire
from p2p_emulator.cli import main
from p2p_emulator.workloads.models import build_model
from p2p_emulator.workloads.training import float_state
from tests.conftest import assert_refused
from protocols.mapl import CollaborationRow, MapLOptions, dissimilarity, learn_row, project_simplex

K = 10  # digits
SMALL = ["--dataset", "digits", "--quiet", "--no-plots", "--trace"]


def emulate(out, *flags) -> dict:
    assert main([*SMALL, *flags, "--out", str(out)]) == 0
    return json.loads((out / "summary.json").read_text())


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_counts(out) -> dict[int, int]:
    nodes = json.loads((out / "partition.json").read_text())["nodes"]
    return {n["node"]: sum(n["train"].values()) for n in nodes}


def expected_size(rnd: int, samples: int, d_p: int, d_z: int | None, backbone: dict | None = None) -> int:
    """The encoded frame of an equivalent MAPL message: K x d_p prototypes (+ K x d_z classifier, + the
    backbone's float state for mapl+)."""
    body = {"prototypes": torch.zeros(K, d_p)}
    if d_z is not None:
        body["classifier"] = torch.zeros(K, d_z)
    if rnd == 0:
        body["samples"] = samples
    if backbone is not None:
        body["backbone"] = backbone
    return len(wire.encode(["mapl", rnd, body]))


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    """Scenario 1, M = 10, C = 2 on digits, hetero-small, mesh; graph learning from round 3."""
    out = tmp_path_factory.mktemp("mapl")
    summary = emulate(out, "--protocol", "mapl", "--nodes", "10", "--rounds", "6", "--t-thr", "3",
                      "--partition", "mapl:scenario=1", "--model", "hetero-small")
    return out, summary


def test_learned_graph_puts_the_weight_on_the_own_cluster(clusters):
    out, summary = clusters
    cluster = {n["node"]: n["cluster"] for n in json.loads((out / "partition.json").read_text())["nodes"]}
    last = [row for row in jsonl(out / "graph.jsonl") if row["round"] == 5]
    assert len(last) == 10
    for row in last:
        weights = {int(j): w for j, w in row["weights"].items()}
        assert sum(weights.values()) == pytest.approx(1.0, abs=1e-5)
        assert sum(w for j, w in weights.items() if cluster[j] == cluster[row["node"]]) >= 0.9
        assert summary["collaboration_graph"][str(row["node"])] == row["weights"]
    assert min(summary["within_cluster_weight"].values()) >= 0.9
    assert summary["within_cluster_weight_mean"] >= 0.9
    # before T_thr the graph is the uniform one over the mesh
    first = [row for row in jsonl(out / "graph.jsonl") if row["round"] == 2]
    assert all(w == pytest.approx(0.1) for row in first for w in row["weights"].values())


def test_messages_are_prototypes_then_classifier_and_framing(clusters):
    out, _ = clusters
    counts = train_counts(out)
    messages = [m for m in jsonl(out / "messages.jsonl") if m["kind"] == "mapl"]
    assert {m["round"] for m in messages} == set(range(6))
    for m in messages:
        d_z = 128 if m["round"] >= 3 else None
        assert m["bytes"] == expected_size(m["round"], counts[m["src"]], 128, d_z)
        floats = 4 * K * (128 + (d_z or 0))
        assert floats < m["bytes"] <= floats + 256  # no backbone, only a small frame around the floats
    # one message per directed edge per round while the link lives
    before_cgl = [m for m in messages if m["round"] < 3]
    assert len(before_cgl) == 3 * 10 * 9
    assert len({(m["src"], m["dst"], m["round"]) for m in messages}) == len(messages)


def test_zero_weight_links_go_silent(clusters):
    out, _ = clusters
    cluster = {n["node"]: n["cluster"] for n in json.loads((out / "partition.json").read_text())["nodes"]}
    zero_since = {}
    for row in jsonl(out / "graph.jsonl"):
        for j, w in row["weights"].items():
            if w == 0 and (row["node"], int(j)) not in zero_since:
                zero_since[row["node"], int(j)] = row["round"]
    across = {(i, j) for i in cluster for j in cluster if cluster[i] != cluster[j]}
    assert len(across) == 10 * 5 and across <= set(zero_since)  # the other cluster at least
    messages = jsonl(out / "messages.jsonl")
    for m in messages:
        dropped = zero_since.get((m["src"], m["dst"]))
        assert dropped is None or m["round"] <= dropped
    # the only traffic on a link in the round it is dropped, besides the data, is a tiny drop notice
    notices = [m for m in messages if m["kind"] == "drop"]
    assert notices and all(m["bytes"] == len(wire.encode(["drop", m["round"], None]))
                           and m["round"] == zero_since[m["src"], m["dst"]] for m in notices)
    assert len(notices) == len(zero_since) and {(m["src"], m["dst"]) for m in notices} == set(zero_since)  # once each


def test_no_data_crosses_the_clusters_once_the_graph_has_settled(clusters):
    out, _ = clusters
    cluster = {n["node"]: n["cluster"] for n in json.loads((out / "partition.json").read_text())["nodes"]}
    late = [m for m in jsonl(out / "messages.jsonl") if m["round"] >= 4 and m["kind"] == "mapl"]
    assert late and all(cluster[m["src"]] == cluster[m["dst"]] for m in late)


def test_a_weight_parked_just_above_zero_is_dropped():
    # The authors' sign steps can hold a weight at a few 1e-6 round after round (seen on digits, M = 10).
    row = CollaborationRow(0, [1, 2, 3], samples=100)
    row.weights = {0: 0.5, 1: 0.5 - 3e-6, 2: 3e-6, 3: 0.0}
    assert row.sparsify(MapLOptions().zero_weight) == [2, 3]
    assert row.peers == [1] and sum(row.weights.values()) == pytest.approx(1.0)
    exact = CollaborationRow(0, [1, 2], samples=100)
    exact.weights = {0: 0.5, 1: 0.5 - 3e-6, 2: 3e-6}
    assert exact.sparsify(0.0) == [] and exact.sparsify(1e-5) == [2]


def test_without_cgl_weights_stay_uniform_and_no_classifier_is_sent(tmp_path):
    summary = emulate(tmp_path, "--protocol", "mapl", "--mapl-no-cgl", "--nodes", "4", "--rounds", "3",
                      "--topology", "ring", "--d-z", "32", "--d-p", "16", "--projection-hidden", "32")
    for row in jsonl(tmp_path / "graph.jsonl"):
        assert row["weights"] == {str(j): pytest.approx(1 / 3) for j in row["weights"]}
        assert len(row["weights"]) == 3  # itself and its two ring neighbours
    counts = train_counts(tmp_path)
    messages = jsonl(tmp_path / "messages.jsonl")
    assert len(messages) == 3 * 4 * 2 == summary["messages_total"]
    assert all(m["kind"] == "mapl" and m["bytes"] == expected_size(m["round"], counts[m["src"]], 16, None)
               for m in messages)


def test_paper_backbones_run_end_to_end(tmp_path):
    summary = emulate(tmp_path, "--protocol", "mapl", "--model", "hetero", "--nodes", "4", "--rounds", "2",
                      "--t-thr", "1", "--partition", "mapl:scenario=1,samples=6,test=2",
                      "--d-z", "32", "--d-p", "16", "--projection-hidden", "32", "--batch-size", "16", "--local-epochs", "1")
    models = [n["model"] for n in json.loads((tmp_path / "partition.json").read_text())["nodes"]]
    assert models == ["resnet18", "shufflenet", "googlenet", "alexnet"]
    rows = jsonl(tmp_path / "metrics.jsonl")
    assert sorted((r["round"], r["node"]) for r in rows) == [(rnd, node) for rnd in range(2) for node in range(4)]
    assert all(0 <= r["test_acc"] <= 1 and 0 < r["train_loss"] < float("inf") for r in rows)
    assert all(r["heard_from"] == 3 for r in rows) and summary["final"]["heard_from"] == 3  # the mesh of 4
    counts = train_counts(tmp_path)
    messages = jsonl(tmp_path / "messages.jsonl")
    assert len(messages) == 2 * 4 * 3 and all(m["kind"] == "mapl" for m in messages)
    for m in messages:  # every architecture maps to the same d_z = 32: the classifiers are K x 32 from T_thr = 1
        assert m["bytes"] == expected_size(m["round"], counts[m["src"]], 16, 32 if m["round"] >= 1 else None), m


def test_mapl_plus_sends_backbones_only_when_homogeneous(tmp_path, capsys):
    assert_refused(capsys, ["--protocol", "mapl+", "--model", "hetero-small", "--quiet"],
                   "mapl+ averages backbones: --model hetero-small gives nodes different architectures", tmp_path / "bad")
    out = tmp_path / "run"
    summary = emulate(out, "--protocol", "mapl+", "--model", "mlp", "--nodes", "2", "--rounds", "1",
                      "--d-z", "32", "--d-p", "16", "--projection-hidden", "32")
    backbone = float_state(build_model("mlp", (1, 8, 8), K, d_z=32, d_p=16, hidden=32).backbone)
    assert {k: tuple(t.shape) for k, t in backbone.items()} == {  # Linear(64, 256), ReLU, Linear(256, d_z)
        "1.weight": (256, 64), "1.bias": (256,), "3.weight": (32, 256), "3.bias": (32,)}
    counts = train_counts(out)
    messages = jsonl(out / "messages.jsonl")
    # 1 round, T_thr = 1 // 4 = 0: each node sends the other its prototypes, classifier, samples and backbone
    assert sorted((m["src"], m["dst"], m["kind"], m["round"]) for m in messages) == [(0, 1, "mapl", 0), (1, 0, "mapl", 0)]
    for m in messages:
        assert m["bytes"] == expected_size(0, counts[m["src"]], 16, 32, backbone), m
    assert summary["bytes_total"] == sum(m["bytes"] for m in messages) and summary["messages_total"] == 2


def test_project_simplex():
    assert torch.allclose(project_simplex(torch.tensor([0.2, 0.3, 0.5])), torch.tensor([0.2, 0.3, 0.5]))
    assert torch.allclose(project_simplex(torch.tensor([2.0, 0.0])), torch.tensor([1.0, 0.0]))
    assert torch.allclose(project_simplex(torch.tensor([0.3, 0.3, -1.0])), torch.tensor([0.5, 0.5, 0.0]))
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        v = torch.randn(7, generator=generator, dtype=torch.float64) * 2
        w = project_simplex(v)
        assert (w >= 0).all() and w.sum() == pytest.approx(1.0)
        # optimality: w = max(v - theta, 0) with one theta, and no feasible point is closer to v
        theta = (v - w)[w > 0]
        assert torch.allclose(theta, theta[0].expand_as(theta)) and ((v - theta[0])[w == 0] <= 1e-12).all()
        spread = -torch.log(torch.rand(200, 7, generator=generator, dtype=torch.float64))
        others = spread / spread.sum(1, keepdim=True)  # uniform points of the simplex
        assert ((others - v).norm(dim=1) >= (w - v).norm() - 1e-12).all()


def test_one_graph_step_separates_two_clusters_of_five():
    # node 0 of a 10-node mesh: neighbours 1-4 share its classes, 5-9 do not (authors' step rule)
    c = torch.tensor([0.9, 0.8, 0.9, 0.85, -0.2, 0.05, 0.1, -0.1, 0.0])
    w = learn_row(torch.full((10,), 0.1), dissimilarity(c, "max"), torch.full((10,), 0.1), MapLOptions())
    assert torch.allclose(w, torch.tensor([0.2] * 5 + [0.0] * 5), atol=1e-6)


def test_max_normalisation_never_flips_signs():
    assert torch.equal(dissimilarity(torch.tensor([-0.5, -0.25]), "max"), torch.tensor([-1.0, 0.5, 0.25]))
    assert torch.equal(dissimilarity(torch.tensor([0.5, 0.25]), "max"), torch.tensor([-1.0, -1.0, -0.5]))


def test_the_code_losses_stay_finite_when_the_prototypes_grow():
    """l_proto grows the prototypes' norms round after round; past sqrt(88 tau) (94 at tau = 100) exp of a
    prototype's product with itself overflows, which must not reach l_uni (it masks the diagonal before exp)."""
    from p2p_emulator.workloads.prototypes import code_losses
    generator = torch.Generator().manual_seed(0)
    orthonormal, _ = torch.linalg.qr(torch.randn(16, K, generator=generator))
    xi = (120 * orthonormal.T).requires_grad_(True)  # apart as l_uni wants them: every other product 0
    p, y = torch.randn(8, 16, generator=generator), torch.arange(8) % 4  # two views of each sample
    loss = sum(code_losses(p, y, xi, tau=100.0))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(xi.grad).all()


@pytest.mark.parametrize("terms, moves", [((), False), (("cont",), False), (("proto",), True), (("uni",), True)])
def test_pml_losses_choose_what_trains_beside_the_cross_entropy(terms, moves):
    """--pml-losses: the prototypes move only under a loss that reads them (l_proto, l_uni), and the
    cross-entropy alone (none) leaves them as they came."""
    from p2p_emulator.workloads.models import build_model
    from p2p_emulator.workloads.prototypes import initial_prototypes, personalised_learning
    generator = torch.Generator().manual_seed(0)
    model = build_model("mlp:hidden=16", (16,), K, d_z=8, d_p=4, hidden=8)
    x, y = torch.randn(12, 16, generator=generator), torch.arange(12) % K
    xi = initial_prototypes(K, 4, generator)
    _, trained = personalised_learning(model, xi, x, y, None, None, epochs=1, batch_size=6, lr=0.01, beta1=0.5,
                                       weight_decay=0.0, tau=100.0, forms="code", generator=generator, terms=terms)
    assert (not torch.equal(trained, xi)) == moves


@pytest.mark.parametrize("value", ["cont,cont", "ce", ""])
def test_bad_pml_losses_are_refused_in_one_line(capsys, tmp_path, value):
    assert_refused(capsys, ["--protocol", "mapl", "--pml-losses", value, "--quiet"], "--pml-losses", tmp_path / "r")
