"""--partition natural (each node holds its owners' samples), and the owned datasets: fortunes and file:PATH."""
import json
from collections import Counter

import numpy as np
import pytest

from conftest import assert_refused
from p2p_emulator.cli import main
from p2p_emulator.workloads import datasets, text
from p2p_emulator.workloads.datasets import DatasetError, load_dataset
from p2p_emulator.workloads.partitions import Owners, PartitionError, make_partition

# Six owners with uneven counts; owner o's samples carry label o % 3 and sit interleaved.
TRAIN_OWNER = np.array([0, 1, 2, 3, 4, 5] * 3 + [0, 0, 2, 5, 5, 5, 5])
TEST_OWNER = np.array([5, 4, 3, 2, 1, 0, 0, 3])
OWNERS = Owners(TRAIN_OWNER, TEST_OWNER, ("ann", "bob", "cy", "dee", "eve", "fay"))


def natural(spec, nodes, seed=0, **kwargs):
    return make_partition(spec, TRAIN_OWNER % 3, TEST_OWNER % 3, nodes, 3, seed, owners=OWNERS, **kwargs)


def owned(partition):
    """Per node: its owners' names, and the owners of its train and test samples."""
    return [(n.owners, {OWNERS.names[o] for o in TRAIN_OWNER[n.train]}, {OWNERS.names[o] for o in TEST_OWNER[n.test]})
            for n in partition.nodes]


def test_one_node_per_owner_holds_exactly_its_samples_in_order():
    p = natural("natural", 6)
    for i, node in enumerate(p.nodes):
        assert node.owners == [OWNERS.names[i]]
        assert node.train.tolist() == np.flatnonzero(TRAIN_OWNER == i).tolist()
        assert node.test.tolist() == np.flatnonzero(TEST_OWNER == i).tolist()
        assert node.classes == [i % 3]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grouped_and_drawn_owners_never_share_a_sample(seed):
    for spec, nodes, per_node in (("natural:users_per_node=2", 3, 2), ("natural:nodes=4", 4, 1),
                                  ("natural:nodes=2,users_per_node=3", 2, 3)):
        p = natural(spec, nodes, seed)
        names = [n.owners for n in p.nodes]
        assert all(len(group) == per_node for group in names)
        flat = sum(names, [])
        assert len(set(flat)) == len(flat)  # an owner on one node only
        for group, train_owners, test_owners in owned(p):
            assert train_owners == set(group) and test_owners <= set(group)
        total = sum(int((TRAIN_OWNER == OWNERS.names.index(o)).sum()) for o in flat)
        assert sum(len(n.train) for n in p.nodes) == total


def test_the_seed_draws_the_groups():
    draws = {tuple(map(tuple, (n.owners for n in natural("natural:users_per_node=2", 3, seed).nodes)))
             for seed in range(6)}
    assert len(draws) > 1
    assert [n.owners for n in natural("natural:nodes=3", 3, 4).nodes] == \
        [n.owners for n in natural("natural:nodes=3", 3, 4).nodes]


def test_caps_keep_at_most_s_train_and_t_test_samples_of_each_owner_in_order():
    p = natural("natural:samples=2,test=1", 6, seed=3)
    for i, node in enumerate(p.nodes):
        mine = np.flatnonzero(TRAIN_OWNER == i)
        assert len(node.train) == min(2, len(mine)) and set(node.train) <= set(mine)
        assert node.train.tolist() == sorted(node.train.tolist())
        assert len(node.test) == min(1, int((TEST_OWNER == i).sum()))


def test_val_and_public_splits_stay_within_an_owner():
    p = natural("natural", 6, val_fraction=0.3, public_fraction=0.2)
    public = set(p.public.tolist())
    for i, node in enumerate(p.nodes):
        mine = set(np.flatnonzero(TRAIN_OWNER == i).tolist()) - public
        assert set(node.train.tolist()) | set(node.val.tolist()) == mine
        assert not set(node.train.tolist()) & set(node.val.tolist())


@pytest.mark.parametrize("spec, nodes, fragment", [
    ("natural", 4, "the data has 6 owners and the run 4 nodes"),
    ("natural:nodes=3", 4, "natural:nodes=3, but the run has 4 nodes"),
    ("natural:users_per_node=4", 2, "need 8 owners, but the data has 6"),
    ("natural:samples=0", 6, "samples must be at least 1"),
])
def test_bad_natural_partitions(spec, nodes, fragment):
    with pytest.raises(PartitionError) as err:
        natural(spec, nodes)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_dataset_without_owners_is_refused(tmp_path, capsys):
    assert_refused(capsys, ["--dataset", "digits", "--partition", "natural", "--protocol", "local", "--nodes", "2",
                            "--rounds", "1"], "no owner per sample", tmp_path / "run")


# ---------------------------------------------------------------- fortunes


def test_fortunes_topics_are_owners_of_next_character_samples_split_as_leaf_splits_shakespeare(
        fortunes_root, private_cache):
    d = load_dataset("fortunes", str(fortunes_root))
    assert (d.kind, d.vocabulary, d.num_classes, d.shape) == ("tokens", 81, 81, (80,))
    assert d.owners == ("cats", "code", "food", "sea")
    for owner, topic in enumerate(d.owners):
        body = "\n".join(line for line in (fortunes_root / topic).read_text().split("\n") if line != "%")
        ids = [text.CHARACTERS.index(c) if c in text.CHARACTERS else text.UNKNOWN for c in body]
        n = len(ids) - 80
        train, test = int(0.9 * n), range(int(0.9 * n) + 79, n)
        x, y = d.train_x.numpy()[d.train_owner == owner], d.train_y.numpy()[d.train_owner == owner]
        assert len(y) == train and [x[i].tolist() + [y[i]] for i in (0, train - 1)] == \
            [ids[i:i + 81] for i in (0, train - 1)]
        x, y = d.test_x.numpy()[d.test_owner == owner], d.test_y.numpy()[d.test_owner == owner]
        assert len(y) == len(test) and x[0].tolist() + [y[0]] == ids[test[0]:test[0] + 81]
    assert len(list(private_cache.glob("p2p-emulator/fortunes-*.npz"))) == 1


def test_characters_outside_leafs_alphabet_are_one_unknown_id():
    assert text.encode("a@é\n").tolist() == [text.CHARACTERS.index("a"), 80, 80, 0]


def test_an_empty_fortunes_folder_is_one_line(tmp_path, capsys):
    assert_refused(capsys, ["--dataset", "fortunes", "--data-root", str(tmp_path), "--protocol", "local",
                            "--nodes", "2", "--rounds", "1"], "no fortune files", tmp_path / "run")


def test_partition_json_names_each_nodes_topics(fortunes_root, tmp_path):
    out = tmp_path / "run"
    assert main(["--dataset", "fortunes", "--data-root", str(fortunes_root), "--partition",
                 "natural:users_per_node=2,samples=20,test=10", "--model", "char-lstm:hidden=8", "--protocol",
                 "local", "--nodes", "2", "--rounds", "0", "--quiet", "--out", str(out)]) == 0
    nodes = json.loads((out / "partition.json").read_text())["nodes"]
    topics = [n["owners"] for n in nodes]
    assert sorted(sum(topics, [])) == ["cats", "code", "food", "sea"] and all(len(t) == 2 for t in topics)
    assert [sum(n["train"].values()) for n in nodes] == [40, 40]


# ---------------------------------------------------------------- file:PATH


def test_an_npz_with_owners_and_a_test_flag(tmp_path, private_cache):
    x = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    owner = np.array(["b", "a", "b", "c", "a", "b", "c"])
    test = np.array([0, 0, 1, 0, 0, 0, 1], dtype=bool)
    np.savez(tmp_path / "mine.npz", x=x, y=np.arange(7) % 2, owner=owner, test=test)
    d = load_dataset(f"file:{tmp_path / 'mine.npz'}")
    assert (d.kind, d.shape, d.num_classes, d.owners) == ("features", (3,), 2, ("b", "a", "c"))
    assert d.train_x.numpy().tolist() == x[~test].tolist() and d.test_y.tolist() == [0, 0]
    assert d.train_owner.tolist() == [0, 1, 2, 1, 0] and d.test_owner.tolist() == [0, 2]


def test_a_csv_without_a_split_holds_out_a_fifth_of_each_owner(tmp_path, private_cache):
    rows = ["owner,label,f1,f2"] + [f"u{i % 4},{i % 3},{i},{-i}" for i in range(40)]
    (tmp_path / "mine.csv").write_text("\n".join(rows) + "\n")
    d = load_dataset(f"file:{tmp_path / 'mine.csv'}")
    assert d.owners == ("u0", "u1", "u2", "u3") and d.shape == (2,)
    assert np.bincount(d.test_owner).tolist() == [2, 2, 2, 2] and np.bincount(d.train_owner).tolist() == [8] * 4
    features = sorted(d.train_x[:, 0].tolist() + d.test_x[:, 0].tolist())
    assert features == list(map(float, range(40)))


@pytest.mark.parametrize("name, content, fragment", [
    ("a.csv", "owner,f1\nu,1\n", "missing column(s) label"),
    ("b.csv", "owner,label,f1\nu,1,x\n", "not a number"),
    ("c.csv", "owner,label,split,f1\nu,1,dev,2\n", "split must be train or test"),
    ("d.txt", "", "expected a .npz or .csv"),
])
def test_bad_user_files_are_one_line(tmp_path, name, content, fragment):
    (tmp_path / name).write_text(content)
    datasets.forget_loaded()
    with pytest.raises(DatasetError) as err:
        load_dataset(f"file:{tmp_path / name}")
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_an_npz_without_owners_is_refused_by_the_cli(tmp_path, capsys):
    np.savez(tmp_path / "mine.npz", x=np.zeros((4, 2), dtype=np.float32), y=np.zeros(4, dtype=np.int64))
    datasets.forget_loaded()
    assert_refused(capsys, ["--dataset", f"file:{tmp_path / 'mine.npz'}", "--protocol", "local", "--nodes", "2",
                            "--rounds", "1"], "missing array(s) owner", tmp_path / "run")


# fortunes-min, which fortune-mod pulls in, fills the same folder with 3 topics: look for one of the full package's.
@pytest.mark.skipif(not (text.DEBIAN_FORTUNES / "computers").is_file(),
                    reason="the Debian package fortunes (./dev installs it)")
@pytest.mark.parametrize("seed", [2, 3])
def test_fedavg_on_fortunes_beats_the_most_frequent_character(tmp_path, seed):
    """Four topics drawn by the seed, a small char-LSTM: the mean test accuracy climbs past always answering
    the training data's most frequent character, scored on each client's own test split."""
    out = tmp_path / "run"
    assert main(["--dataset", "fortunes", "--partition", "natural:nodes=4,samples=200,test=100",
                 "--model", "char-lstm:hidden=32", "--protocol", "fedavg", "--topology", "star", "--nodes", "5",
                 "--rounds", "12", "--lr", "0.5", "--momentum", "0.9", "--local-epochs", "2", "--batch-size", "10",
                 "--seed", str(seed), "--quiet", "--no-plots", "--out", str(out)]) == 0
    nodes = json.loads((out / "partition.json").read_text())["nodes"]
    train = sum((Counter(n["train"]) for n in nodes), Counter())
    mode = max(train, key=train.get)
    baseline = np.mean([n["test"].get(mode, 0) / sum(n["test"].values()) for n in nodes if n["test"]])
    accuracy = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "test_acc" in row and row["node"] != 0:  # node 0 is the server
            accuracy.setdefault(row["round"], []).append(row["test_acc"])
    curve = [np.mean(accuracy[r]) for r in sorted(accuracy)]
    assert abs(curve[1] - baseline) < 0.03  # after one round the model answers the mode
    # Seeds 3-7 (untuned) end 4.8 to 10 points above it at their best of the last three rounds; seeds 2 and 3
    # 8 and 10 points (also in the last round), seeds 0 and 1 6.5 and 4.3 (2.5 and 4 in the last round).
    assert curve[-1] > baseline and max(curve[-3:]) > baseline + 0.03, (baseline, curve)
