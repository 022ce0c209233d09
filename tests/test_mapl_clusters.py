"""MAPL's graph learning finds the two clusters of scenario 1 whatever the seed and the horizon.

The user's command with nothing tuned: digits, M = 10, hetero-small, T_thr = rounds // 4. What decides
whether the graph finds the clusters is how far the classifiers have trained when graph learning starts,
so each horizon H is run up to two rounds past its T_thr = H // 4: `--rounds T_thr + 2 --t-thr T_thr`
writes, byte for byte, the first T_thr + 2 rounds of `--rounds H` (the horizon changes nothing but T_thr;
test_a_run_cut_short_is_the_first_rounds_of_the_users_command). With the paper's raw classifier rows
these runs miss at the seeds where the whole runs miss (docs/mapl.md: all but seed 4 at 20 rounds, all
at 40).
"""
import json

import pytest
import torch

from p2p_emulator.analysis.plots import plot_run
from p2p_emulator.cli import main
from protocols.analysis.learned_graph import cluster_similarity
from protocols.mapl import classifier_similarity
from tests.conftest import assert_one_line_error

USER = ["--topology", "mesh", "--protocol", "mapl", "--nodes", "10", "--dataset", "digits",
        "--partition", "mapl:scenario=1", "--model", "hetero-small", "--quiet", "--no-plots"]


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("seed, horizon", [(0, 20), (1, 20), (2, 40)])
def test_every_node_puts_its_weight_on_its_own_cluster(tmp_path, seed, horizon):
    """Three seeds and two horizons here; `./dev bench mapl_clusters` runs every seed 0-4 at 20, 40 and 120
    rounds, whole, and counts the cells where a node kept its whole cluster and nothing else."""
    t_thr = horizon // 4
    rounds = t_thr + 2  # the first graph step, and one more: the cut holds and every node still mixes
    assert main([*USER, "--rounds", str(rounds), "--t-thr", str(t_thr), "--seed", str(seed),
                 "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert min(summary["within_cluster_weight"].values()) >= 0.9
    cluster = {n["node"]: n["cluster"] for n in json.loads((tmp_path / "partition.json").read_text())["nodes"]}
    # and not by cutting itself off: every node still mixes with its own cluster
    for row in jsonl(tmp_path / "graph.jsonl"):
        if row["round"] == rounds - 1:
            assert any(w > 0 for j, w in row["weights"].items()
                       if int(j) != row["node"] and cluster[int(j)] == cluster[row["node"]])
    # what the nodes compared: every learned row scores its own cluster above the other one
    first = min(row["round"] for row in jsonl(tmp_path / "graph.jsonl") if row["similarity"])
    assert first == t_thr
    for row in jsonl(tmp_path / "graph.jsonl"):
        if row["round"] == first:
            c = {int(j): s for j, s in row["similarity"].items()}
            assert len(c) == 9
            assert min(s for j, s in c.items() if cluster[j] == cluster[row["node"]]) > \
                max(s for j, s in c.items() if cluster[j] != cluster[row["node"]])


def test_a_run_cut_short_is_the_first_rounds_of_the_users_command(tmp_path):
    """Nothing but T_thr (rounds // 4 by default) depends on --rounds: the cut-short runs above stand for
    the user's whole command. (Only what a node received differs: the four backbones train at their own
    speeds, so in the longer run a faster neighbour's next-round model lands in a slower node's row.)"""
    assert main([*USER, "--rounds", "4", "--seed", "1", "--out", str(tmp_path / "user")]) == 0
    assert main([*USER, "--rounds", "2", "--t-thr", "1", "--seed", "1", "--out", str(tmp_path / "short")]) == 0
    assert min(row["round"] for row in jsonl(tmp_path / "user" / "graph.jsonl") if row["similarity"]) == 4 // 4
    received = ("msgs_received", "bytes_received")
    for name in ("metrics.jsonl", "graph.jsonl"):
        whole = [{k: v for k, v in row.items() if k not in received}
                 for row in jsonl(tmp_path / "user" / name) if row["round"] < 2]
        short = [{k: v for k, v in row.items() if k not in received} for row in jsonl(tmp_path / "short" / name)]
        assert short == whole, name


def test_graph_rows_carry_the_similarities_used_and_the_cluster_plot_shows_them(tmp_path):
    assert main(["--protocol", "mapl", "--nodes", "4", "--rounds", "3", "--t-thr", "1", "--dataset", "digits",
                 "--partition", "mapl:scenario=1,samples=10,test=3", "--d-z", "16", "--d-p", "8",
                 "--projection-hidden", "16", "--quiet", "--out", str(tmp_path)]) == 0
    rows = jsonl(tmp_path / "graph.jsonl")
    assert all(row["similarity"] == {} for row in rows if row["round"] == 0)  # before T_thr: no graph learning
    for row in rows:
        if row["round"] >= 1:
            # the neighbours still linked at the start of the round, each with a cosine
            assert set(row["similarity"]) <= {str(j) for j in range(4)} - {str(row["node"])}
            assert all(-1 <= c <= 1 for c in row["similarity"].values())
    assert rows[-1]["similarity"] or rows[-1]["weights"][str(rows[-1]["node"])] == 1.0
    assert (tmp_path / "plots" / "cluster_graph.png").is_file()
    clusters = {0: 0, 1: 0, 2: 1, 3: 1}
    means = cluster_similarity(rows, clusters)
    expected = [c for row in rows if row["round"] == 1 for j, c in row["similarity"].items()
                if clusters[int(j)] == clusters[row["node"]]]
    assert means["within cluster"][0][0] == 1
    assert means["within cluster"][1][0] == pytest.approx(sum(expected) / len(expected))


def test_no_cluster_plot_without_clusters(tmp_path):
    assert main(["--protocol", "mapl", "--nodes", "3", "--rounds", "2", "--t-thr", "1", "--dataset", "digits",
                 "--partition", "classes:k=3", "--d-z", "16", "--d-p", "8", "--projection-hidden", "16",
                 "--quiet", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "plots" / "learned_graph.png").is_file()
    assert "cluster_graph.png" not in {p.name for p in plot_run(tmp_path)}


def test_centred_similarity_ignores_a_shift_common_to_every_class():
    generator = torch.Generator().manual_seed(0)
    own, other = torch.randn(10, 32, generator=generator), torch.randn(10, 32, generator=generator)
    shift = 5 * torch.randn(32, generator=generator)  # the softmax cannot see it: every logit moves by z . shift
    unrelated = classifier_similarity(own, other, "centred")
    assert classifier_similarity(own, other + shift, "centred") == pytest.approx(unrelated, abs=1e-6)
    assert classifier_similarity(own + shift, other + shift, "centred") == pytest.approx(unrelated, abs=1e-6)
    # two unrelated classifiers that share the shift look alike to the raw rule, not to the centred one
    assert abs(unrelated) < 0.2 and classifier_similarity(own + shift, other + shift, "raw") > 0.8
    assert classifier_similarity(own, own + shift, "centred") == pytest.approx(1.0, abs=1e-6)


def test_norms_are_the_same_in_any_basis_of_the_latent():
    """Heterogeneous backbones share no basis of the latent: the norms rule sees only each class's distance
    from the mean row, so a rotation of one node's latent changes nothing, where the centred rule sees noise."""
    generator = torch.Generator().manual_seed(1)
    own = torch.randn(10, 32, generator=generator) * torch.arange(1, 11).view(-1, 1)  # a spread over the classes
    rotation, _ = torch.linalg.qr(torch.randn(32, 32, generator=generator))
    shift = 5 * torch.randn(32, generator=generator)
    rotated = own @ rotation + shift
    assert classifier_similarity(own, rotated, "norms") == pytest.approx(1.0, abs=1e-5)
    assert abs(classifier_similarity(own, rotated, "centred")) < 0.3
    # the opposite spread (the classes this node pushes down, the other node raises) scores -1
    flipped = torch.randn(10, 32, generator=generator) * torch.arange(10, 0, -1).view(-1, 1)
    assert classifier_similarity(own, flipped, "norms") < -0.9


def test_an_unknown_row_rule_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["--protocol", "mapl", "--classifier-rows", "sideways", "--quiet", "--out", str(tmp_path)]) == 2
    assert_one_line_error(capsys, "--classifier-rows")
