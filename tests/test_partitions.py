import json

import numpy as np
import pytest

from p2p_emulator.workloads.partitions import PARTITIONS, PartitionError, make_partition

# FashionMNIST-sized labels: 6000 train and 1000 test images per class.
TRAIN_Y = np.repeat(np.arange(10), 6000)
TEST_Y = np.repeat(np.arange(10), 1000)
# Digits-sized: about 144 train and 36 test images per class.
SMALL_TRAIN_Y = np.repeat(np.arange(10), 144)
SMALL_TEST_Y = np.repeat(np.arange(10), 36)


def part(spec, nodes=10, seed=0, **kwargs):
    return make_partition(spec, TRAIN_Y, TEST_Y, nodes, 10, seed, **kwargs)


def class_counts(labels, indices):
    return dict(zip(*np.unique(labels[indices], return_counts=True)))


def assert_disjoint(partition):
    for split, limit in (("train", len(TRAIN_Y)), ("test", len(TEST_Y))):
        chunks = [getattr(n, split) for n in partition.nodes]
        if split == "train":
            chunks += [n.val for n in partition.nodes]
            if partition.public is not None:
                chunks.append(partition.public)
        everything = np.concatenate(chunks)
        assert len(np.unique(everything)) == len(everything), f"{split} indices shared"
        assert everything.min() >= 0 and everything.max() < limit


@pytest.mark.parametrize("spec", ["iid", "dirichlet:alpha=0.3", "classes:k=3", "mapl:scenario=4", "shards:n=2"])
def test_indices_disjoint_across_nodes(spec):
    assert_disjoint(part(spec, val_fraction=0.2, public_fraction=0.1))


def test_mapl_scenario1_fashion_sized():
    p = part("mapl:scenario=1")
    assert p.notes == []
    for node in p.nodes:
        expected = list(range(5)) if node.node < 5 else list(range(5, 10))
        assert node.cluster == (0 if node.node < 5 else 1)
        assert node.classes == expected
        assert class_counts(TRAIN_Y, node.train) == {c: 300 for c in expected}
        assert class_counts(TEST_Y, node.test) == {c: 15 for c in expected}
    assert_disjoint(p)


def test_mapl_scenario2_overlapping_classes():
    p = part("mapl:scenario=2")
    assert [p.nodes[i].classes for i in (0, 9)] == [list(range(7)), list(range(3, 10))]
    assert class_counts(TRAIN_Y, p.nodes[9].train) == {c: 300 for c in range(3, 10)}
    # overlap=2 is the paper figure's 0-5 / 4-9
    p = part("mapl:scenario=2,overlap=2")
    assert [p.nodes[i].classes for i in (0, 9)] == [list(range(6)), list(range(4, 10))]


def test_mapl_five_clusters():
    p = part("mapl:scenario=1,clusters=5")
    assert [p.nodes[i].classes for i in range(0, 10, 2)] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert [n.cluster for n in p.nodes] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    p = part("mapl:scenario=2,clusters=5,overlap=1")
    assert [p.nodes[i].classes for i in range(0, 10, 2)] == [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8], [8, 9]]


def test_mapl_scenario3_counts_vary_in_range():
    p = part("mapl:scenario=3", nodes=20)
    counts = [k for n in p.nodes for k in class_counts(TRAIN_Y, n.train).values()]
    assert len(counts) == 20 * 5
    assert min(counts) >= 100 and max(counts) < 300
    assert len(set(counts)) > 10


def test_mapl_scales_down_with_note_on_small_dataset():
    p = make_partition("mapl:scenario=1", SMALL_TRAIN_Y, SMALL_TEST_Y, 10, 10, seed=0)
    assert any(note.startswith("train: scaled") for note in p.notes)
    assert any(note.startswith("test: scaled") for note in p.notes)
    per_class = {k for n in p.nodes for k in class_counts(SMALL_TRAIN_Y, n.train).values()}
    assert per_class == {144 * 300 // 1500}  # one common factor: 5 nodes need each class
    assert 0 < len(p.nodes[0].test) < 5 * 15


def test_shards_two_classes_per_node_even_use():
    p = part("shards:n=2", nodes=100)
    assert all(len(n.classes) == 2 for n in p.nodes)
    for node in p.nodes:
        assert sorted(class_counts(TRAIN_Y, node.train)) == node.classes
        assert set(class_counts(TEST_Y, node.test)) == set(node.classes)
    holders = np.bincount([c for n in p.nodes for c in n.classes], minlength=10)
    assert list(holders) == [20] * 10  # P = ceil(100 * 2 / 10) shards per class, all used
    assert {len(n.train) for n in p.nodes} == {600}
    assert {len(n.test) for n in p.nodes} == {100}
    assert p.notes == []


def test_shards_uneven_leaves_note():
    p = part("shards:n=3", nodes=7)
    assert all(len(n.classes) == 3 for n in p.nodes)
    assert any("unused" in note for note in p.notes)


def test_classes_k():
    p = part("classes:k=3")
    for node in p.nodes:
        assert len(node.classes) == 3
        assert sorted(class_counts(TRAIN_Y, node.train)) == node.classes
    assert_disjoint(p)


def label_share(labels, indices):
    return np.bincount(labels[indices], minlength=10) / len(indices)


def test_iid_covers_everything_evenly():
    """Even sizes, and every node's classes in the global shares (1/10 each): over 100 seeds the largest
    deviation is 0.011 in train (8571 samples a node) and 0.025 in test (1428)."""
    p = part("iid", nodes=7)
    assert sum(len(n.train) for n in p.nodes) == len(TRAIN_Y)
    assert sum(len(n.test) for n in p.nodes) == len(TEST_Y)
    assert max(len(n.train) for n in p.nodes) - min(len(n.train) for n in p.nodes) <= 1
    for node in p.nodes:
        assert np.abs(label_share(TRAIN_Y, node.train) - 0.1).max() < 0.02, node.node
        assert np.abs(label_share(TEST_Y, node.test) - 0.1).max() < 0.05, node.node


def test_dirichlet_covers_everything_and_test_follows_train():
    """alpha = 0.5 skews the nodes' classes: the mean total-variation distance to uniform is 0.46 here, at
    least 0.35 over 100 seeds (iid: 0.013). Each node's test class counts are its train counts over 6
    (6000 train, 1000 test images a class), to the rounding, so its shares match to 0.0008 on the largest."""
    p = part("dirichlet:alpha=0.5")
    assert sum(len(n.train) for n in p.nodes) == len(TRAIN_Y)
    assert sum(len(n.test) for n in p.nodes) == len(TEST_Y)
    distance = [0.5 * np.abs(label_share(TRAIN_Y, n.train) - 0.1).sum() for n in p.nodes]
    assert np.mean(distance) > 0.3, distance
    for n in p.nodes:
        train_counts = np.bincount(TRAIN_Y[n.train], minlength=10)
        assert np.abs(np.bincount(TEST_Y[n.test], minlength=10) - train_counts / 6).max() <= 1, n.node
    node = max(p.nodes, key=lambda n: len(n.train))
    assert np.abs(label_share(TRAIN_Y, node.train) - label_share(TEST_Y, node.test)).max() < 0.005
    assert min(len(n.train) for n in p.nodes) >= 10


def test_same_seed_same_partition_other_seed_differs():
    for spec in ("iid", "dirichlet", "classes:k=2", "mapl:scenario=3", "shards:n=2"):
        a, b, c = part(spec, seed=1), part(spec, seed=1), part(spec, seed=2)
        assert all(np.array_equal(x.train, y.train) and np.array_equal(x.test, y.test)
                   for x, y in zip(a.nodes, b.nodes))
        assert any(not np.array_equal(x.train, y.train) for x, y in zip(a.nodes, c.nodes))


def test_val_split_disjoint_stratified_and_sized():
    p = part("mapl:scenario=1", val_fraction=0.2)
    for node in p.nodes:
        assert len(np.intersect1d(node.train, node.val)) == 0
        assert len(node.val) == 300
        assert set(class_counts(TRAIN_Y, node.val).values()) == {60}
    tiny = make_partition("iid", np.arange(20) % 2, np.arange(4) % 2, 10, 2, 0, val_fraction=0.01)
    assert all(len(n.val) == 1 and len(n.train) == 1 for n in tiny.nodes)


def test_public_split_is_stratified_and_held_out():
    p = part("iid", public_fraction=0.1)
    assert class_counts(TRAIN_Y, p.public) == {c: 600 for c in range(10)}
    assert sum(len(n.train) for n in p.nodes) == len(TRAIN_Y) - 6000
    assert part("iid").public is None


def test_to_json_shape():
    p = part("mapl:scenario=1", val_fraction=0.1)
    doc = p.to_json("fashion-mnist", TRAIN_Y, TEST_Y, [f"m{i}" for i in range(10)])
    json.dumps(doc)
    assert doc["dataset"] == "fashion-mnist" and doc["partition"] == "mapl:scenario=1"
    assert doc["notes"] == []
    first = doc["nodes"][0]
    assert first == {"node": 0, "model": "m0", "cluster": 0,
                     "train": {str(c): 270 for c in range(5)},
                     "val": {str(c): 30 for c in range(5)},
                     "test": {str(c): 15 for c in range(5)}}
    assert list(doc["nodes"][9]["train"]) == ["5", "6", "7", "8", "9"]
    with pytest.raises(PartitionError):
        p.to_json("fashion-mnist", TRAIN_Y, TEST_Y, ["m0"])


@pytest.mark.parametrize("spec, fragment", [
    ("nope", "'nope'"),
    ("classes:q=2", "'q=2'"),
    ("classes:k=two", "'two'"),
    ("classes:k", "'k'"),
    ("classes:k=11", "k must be"),
    ("dirichlet:alpha=0", "alpha"),
    ("mapl:scenario=5", "scenario"),
    ("mapl:clusters=3", "3 equal clusters"),
    ("mapl:scenario=1,overlap=2", "overlap"),
    ("mapl:scenario=2,overlap=6", "overlap"),
    ("shards:n=0", "n must be"),
])
def test_bad_specs(spec, fragment):
    with pytest.raises(PartitionError) as err:
        part(spec)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_bad_arguments():
    with pytest.raises(PartitionError):
        make_partition("iid", TRAIN_Y, TEST_Y, 10, 5, 0)  # labels beyond num_classes
    with pytest.raises(PartitionError):
        part("iid", val_fraction=1.0)
    with pytest.raises(PartitionError):
        part("iid", nodes=0)
    assert PARTITIONS == ("iid", "dirichlet", "classes", "mapl", "shards", "mixture", "fedlinked", "natural")
