"""LEAF's FEMNIST, Shakespeare and Sent140 read from files in LEAF's own JSON format."""
import json
import shutil

import numpy as np
import pytest
import torch

from conftest import assert_refused
from p2p_emulator.cli import main
from p2p_emulator.workloads import datasets, leaf, text
from p2p_emulator.workloads.datasets import DatasetError, load_dataset

rng = np.random.default_rng(0)

# Per split, the files (sorted by name, as the loader reads them) and their users in file order:
# uneven counts, users out of name order, "u3" and "u1" in train and test, "u5" only in test.
LAYOUT = {
    "train": {"all_data_0_niid_05_keep_0_train_9.json": [("u3", 3), ("u1", 1)],
              "all_data_1_niid_05_keep_0_train_9.json": [("u2", 4), ("u4", 2)]},
    "test": {"all_data_0_niid_05_keep_0_test_9.json": [("u1", 2), ("u5", 1)],
             "all_data_1_niid_05_keep_0_test_9.json": [("u3", 1)]},
}
OWNERS = ("u3", "u1", "u2", "u4", "u5")


def femnist_sample(i: int):
    pixels = rng.integers(0, 256, 784)
    if i == 0:
        pixels = np.arange(784) % 256  # every level once: round(255 * k/255) gives k back
    return (pixels / 255).tolist(), int(rng.integers(0, 62))


def shakespeare_sample(i: int):
    characters = list(rng.choice(list(text.CHARACTERS), 81))
    characters[i % 80] = "@é"[i % 2]  # outside LEAF's 80 characters
    return "".join(characters[:80]), characters[80]


def sent140_sample(i: int):
    words = rng.choice(["good", "bad", "day", "Day", "don't", "!", "."], int(rng.integers(1, 30)))
    return [str(1000 + i), "Sat May 16 23:58:44 UTC 2009", "NO_QUERY", "someone", " ".join(words)], i % 2


SAMPLES = {"femnist": femnist_sample, "shakespeare": shakespeare_sample, "sent140": sent140_sample}


def write_file(path, users: dict[str, tuple[list, list]], **extra):
    """One JSON file exactly as LEAF's split_data.py writes it."""
    data = {"users": list(users), **extra, "num_samples": [len(y) for _, y in users.values()],
            "user_data": {user: {"x": x, "y": y} for user, (x, y) in users.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f)


def write_leaf(root, task: str) -> dict[str, list[tuple[str, object, object]]]:
    """LEAF's data folder for `task` under root; returns each split's (user, x, y) in file order."""
    written = {}
    for split, files in LAYOUT.items():
        written[split] = []
        for name, users in files.items():
            content = {}
            for user, count in users:
                samples = [SAMPLES[task](i) for i in range(count)]
                content[user] = ([x for x, _ in samples], [y for _, y in samples])
                written[split] += [(user, x, y) for x, y in samples]
            extra = {"hierarchies": ["play"] * len(users)} if task == "shakespeare" else {}
            write_file(root / split / name, content, **extra)
    return written


pytestmark = pytest.mark.usefixtures("private_cache")


def split_arrays(d, split: str):
    return (getattr(d, f"{split}_x").numpy(), getattr(d, f"{split}_y").numpy(), getattr(d, f"{split}_owner"))


def assert_owners(d, written):
    assert d.owners == OWNERS
    for split in ("train", "test"):
        owner = split_arrays(d, split)[2]
        assert owner.tolist() == [OWNERS.index(user) for user, _, _ in written[split]]


def test_femnist(tmp_path):
    written = write_leaf(tmp_path / "data", "femnist")
    d = load_dataset("leaf-femnist", str(tmp_path / "data"))
    assert (d.name, d.kind, d.num_classes, d.shape, d.vocabulary) == ("leaf-femnist", "image", 62, (1, 28, 28), 0)
    assert d.train_x.dtype == torch.uint8 and d.train_y.dtype == torch.int64
    for split in ("train", "test"):
        x, y, _ = split_arrays(d, split)
        assert np.array_equal(x, np.array([np.rint(np.array(s) * 255) for _, s, _ in written[split]])
                              .reshape(-1, 1, 28, 28))
        assert y.tolist() == [label for _, _, label in written[split]]
    assert np.array_equal(d.train_x[0].flatten().numpy(), np.arange(784) % 256)  # lossless
    assert_owners(d, written)
    # normalise's statistics: the training pixels' mean and (population) std, in 0..1 units
    pixels = {split: np.rint(np.array([s for _, s, _ in written[split]]) * 255) / 255 for split in ("train", "test")}
    assert len(d.mean) == len(d.std) == 1
    assert d.mean[0] == pytest.approx(pixels["train"].mean(), abs=1e-12)
    assert d.std[0] == pytest.approx(pixels["train"].std(), abs=1e-12)
    assert abs(pixels["test"].mean() - pixels["train"].mean()) > 1e-4  # the test split's (7e-4 apart) fails


def test_shakespeare_characters_and_unknown(tmp_path):
    written = write_leaf(tmp_path / "data", "shakespeare")
    d = load_dataset("leaf-shakespeare", str(tmp_path / "data"))
    assert (d.kind, d.num_classes, d.vocabulary, d.shape) == ("tokens", 81, 81, (80,))

    def ids(s):  # LEAF's lookup, with its -1 for other characters as UNKNOWN
        return [text.CHARACTERS.find(c) if c in text.CHARACTERS else text.UNKNOWN for c in s]

    for split in ("train", "test"):
        x, y, _ = split_arrays(d, split)
        assert x.tolist() == [ids(s) for _, s, _ in written[split]]
        assert y.tolist() == [ids(c)[0] for _, _, c in written[split]]
    assert d.train_x[0, 0] == text.UNKNOWN and d.train_x[1, 1] == text.UNKNOWN  # '@', 'é'
    assert_owners(d, written)


def test_sent140_records_and_owners(tmp_path):
    written = write_leaf(tmp_path / "data", "sent140")
    d = load_dataset("leaf-sent140", str(tmp_path / "data"))
    words = [w for _, record, _ in written["train"] for w in record[4].split()]  # spaced out in sent140_sample
    ranked = sorted(set(words), key=lambda w: (-words.count(w), w))
    assert (d.kind, d.num_classes, d.shape, d.vocabulary) == ("tokens", 2, (25,), 2 + len(ranked))
    for split in ("train", "test"):
        x, y, _ = split_arrays(d, split)
        ids = [[2 + ranked.index(w) if w in ranked else 1 for w in record[4].split()[:25]]
               for _, record, _ in written[split]]
        assert x.tolist() == [row + [0] * (25 - len(row)) for row in ids]
        assert y.tolist() == [label for _, _, label in written[split]]
    assert_owners(d, written)


def test_sent140_vocabulary_by_training_frequency(tmp_path):
    root = tmp_path / "data"
    many = " ".join(f"w{i:05d}" for i in range(10_005))  # more words than the vocabulary keeps
    record = lambda s: ["1", "date", "NO_QUERY", "someone", s]  # noqa: E731
    write_file(root / "train" / "a.json", {"ann": ([record("b a a"), record("Good, don't!")], [1, 0])})
    write_file(root / "train" / "b.json", {"bob": ([record(many)], [1])})
    write_file(root / "test" / "a.json", {"ann": ([record("a unseen w00030 w09993 w09994 don't")], [0])})
    d = load_dataset("leaf-sent140", str(root))
    assert d.vocabulary == 10_002 and d.train_x.dtype == torch.int32
    # "a" (2 uses) is 2; the others, used once, follow by the token: "!", ",", "Good", "b", "don't",
    # "w00000", ... "w09993" (the 10,000th word); no lowercasing, LEAF's tokens
    assert d.train_x[0, :4].tolist() == [6, 2, 2, 0] and d.train_x[1, :5].tolist() == [5, 4, 7, 3, 0]
    assert d.train_x[2].tolist() == [8 + i for i in range(25)]  # the first 25 tokens
    # a, unseen (unknown), w00030 (seen in training only past the 25th token), w09993 (the last
    # kept word), w09994 (past the 10,000: unknown), don't; padding
    assert d.test_x[0].tolist() == [2, 1, 8 + 30, 10_001, 1, 7] + [0] * 19
    assert d.owners == ("ann", "bob") and d.test_owner.tolist() == [0]


def test_second_load_comes_from_the_cache(tmp_path, monkeypatch):
    write_leaf(tmp_path / "data", "sent140")
    first = load_dataset("leaf-sent140", str(tmp_path / "data"))
    assert len(list((tmp_path / "cache" / "p2p-emulator").glob("leaf-sent140-*.npz"))) == 1
    datasets.forget_loaded()
    monkeypatch.setattr(leaf, "_decode", lambda task, files: pytest.fail("decoded again"))
    again = load_dataset("leaf-sent140", str(tmp_path / "data"))
    for key in ("train_x", "train_y", "test_x", "test_y", "train_owner", "test_owner"):
        assert np.array_equal(np.asarray(getattr(first, key)), np.asarray(getattr(again, key))), key
    assert (again.owners, again.vocabulary, again.kind, again.num_classes) == (
        first.owners, first.vocabulary, first.kind, first.num_classes)


def edit(split: str, index: int, change):
    """A case that rewrites the split's index-th file: change(data) edits the parsed JSON."""
    def apply(root):
        path = sorted((root / split).glob("*.json"))[index]
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))
        return path.name
    return apply


def replace_bytes(old: bytes, new: bytes, split="train"):
    def apply(root):
        path = sorted((root / split).glob("*.json"))[0]
        path.write_bytes(path.read_bytes().replace(old, new, 1))
        return path.name
    return apply


def truncate(root):
    path = sorted((root / "test").glob("*.json"))[1]
    path.write_bytes(path.read_bytes()[:-40])
    return path.name


def remove(part: str):
    def apply(root):
        shutil.rmtree(root / part)
        return str(root / part)
    return apply


def empty_train(root):
    for path in (root / "train").glob("*.json"):
        path.unlink()
    return str(root / "train")


def no_test_users(root):
    for path in (root / "test").glob("*.json"):
        write_file(path, {})
    return str(root / "test")


def first_x(data):
    return data["user_data"][data["users"][0]]["x"]


def first_y(data):
    return data["user_data"][data["users"][0]]["y"]


BAD = {
    "no users": ("femnist", edit("train", 0, lambda d: d.pop("users")), "'users'"),
    "no num_samples": ("femnist", edit("train", 1, lambda d: d.pop("num_samples")), "'num_samples'"),
    "no user_data": ("femnist", edit("test", 0, lambda d: d.pop("user_data")), "'user_data'"),
    "count off": ("femnist", edit("train", 1, lambda d: d["num_samples"].__setitem__(0, 5)), "'u2'"),
    "one count short": ("femnist", edit("train", 0, lambda d: d["num_samples"].pop()), "num_samples"),
    "user without data": ("femnist", edit("test", 0, lambda d: d["user_data"].pop("u5")), "'u5'"),
    "data without user": ("femnist", edit("test", 0, lambda d: d["user_data"].update(zz={"x": [], "y": []})),
                          "'zz'"),
    "not utf-8": ("femnist", replace_bytes(b'"u3"', b'"u\xff3"'), "UTF8"),
    "truncated": ("femnist", truncate, "not valid JSON"),
    "short image": ("femnist", edit("train", 0, lambda d: first_x(d)[1].pop()), "784"),
    "pixel above 1": ("femnist", edit("train", 0, lambda d: first_x(d)[2].__setitem__(5, 1.5)), "1.5"),
    "pixel a string": ("femnist", edit("train", 0, lambda d: first_x(d)[0].__setitem__(5, "0.5")), "sample 0"),
    "class 62": ("femnist", edit("train", 0, lambda d: first_y(d).__setitem__(0, 62)), "62"),
    "class a string": ("femnist", edit("train", 0, lambda d: first_y(d).__setitem__(0, "3")), "'3'"),
    "79 characters": ("shakespeare", edit("test", 1, lambda d: first_x(d).__setitem__(0, "a" * 79)), "80"),
    "two next characters": ("shakespeare", edit("test", 1, lambda d: first_y(d).__setitem__(0, "ab")),
                            "one character"),
    "sentiment 4": ("sent140", edit("train", 0, lambda d: first_y(d).__setitem__(0, 4)), "0 or 1"),
    "4-item record": ("sent140", edit("train", 0, lambda d: first_x(d)[0].pop()), "record"),
    "text a number": ("sent140", edit("train", 0, lambda d: first_x(d)[0].__setitem__(4, 7)), "record"),
    "no test samples": ("shakespeare", no_test_users, "hold no samples"),
    "no test folder": ("femnist", remove("test"), "test"),
    "empty train folder": ("sent140", empty_train, "train"),
    "no root": ("shakespeare", remove(""), "is not a directory"),
}


@pytest.mark.parametrize("case", BAD)
def test_malformed_files_are_one_line_naming_the_file(tmp_path, case):
    task, spoil, fragment = BAD[case]
    root = tmp_path / "data"
    write_leaf(root, task)
    named = spoil(root)
    with pytest.raises(DatasetError) as err:
        load_dataset(f"leaf-{task}", str(root))
    message = str(err.value)
    assert "\n" not in message and named in message and fragment in message, message


def test_no_data_root_says_how_to_make_the_files():
    with pytest.raises(DatasetError, match=r"--data-root.*preprocess\.sh -s niid"):
        load_dataset("leaf-femnist")


def test_cli_refuses_a_bad_file_in_one_line(tmp_path, capsys):
    root = tmp_path / "data"
    write_leaf(root, "femnist")
    named = edit("train", 1, lambda d: d["num_samples"].__setitem__(1, 9))(root)
    assert_refused(capsys, ["--dataset", "leaf-femnist", "--data-root", str(root), "--protocol", "local",
                            "--nodes", "2", "--rounds", "1"], named, tmp_path / "out")


def test_a_natural_fedavg_run_gives_each_client_one_writer_and_only_their_samples(tmp_path):
    root = tmp_path / "data"
    write_leaf(root, "femnist")
    out = tmp_path / "out"
    assert main(["--dataset", "leaf-femnist", "--data-root", str(root), "--partition", "natural",
                 "--model", "mlp:hidden=16", "--protocol", "fedavg", "--topology", "star", "--nodes", "5",
                 "--rounds", "1", "--quiet", "--out", str(out)]) == 0
    partition = json.loads((out / "partition.json").read_text())
    nodes = partition["nodes"]
    assert [n["owners"] for n in nodes] == [["u3"], ["u1"], ["u2"], ["u4"]]  # u5 has no training samples
    assert [sum(n["train"].values()) for n in nodes] == [3, 1, 4, 2]
    assert [sum(n["test"].values()) for n in nodes] == [1, 2, 0, 0]
    assert partition["notes"] == ["natural: 1 owner(s) without training samples left out",
                                  "natural: no test samples for u2, u4: their nodes report no test_acc"]
