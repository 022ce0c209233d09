import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from p2p_emulator.workloads import datasets
from p2p_emulator.workloads.datasets import DATASETS, DatasetError, load_dataset, normalise

DEBIAN = Path("/usr/share/datasets/fashion-mnist")


pytestmark = pytest.mark.usefixtures("private_cache")


def write_idx(path: Path, array: np.ndarray, magic: int | None = None) -> None:
    header = (magic if magic is not None else 0x800 + array.ndim).to_bytes(4, "big")
    header += b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if path.suffix == ".gz":
        data = gzip.compress(data)
    path.write_bytes(data)


def fake_fashion(root: Path, n_train=30, n_test=10, gz=True) -> None:
    rng = np.random.default_rng(0)
    ext = ".gz" if gz else ""
    root.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(root / f"{prefix}-images-idx3-ubyte{ext}", rng.integers(0, 256, (n, 28, 28)))
        write_idx(root / f"{prefix}-labels-idx1-ubyte{ext}", np.arange(n) % 10)


def test_digits():
    d = load_dataset("digits")
    assert d.shape == (1, 8, 8) and d.num_classes == 10
    assert d.train_x.dtype == torch.uint8 and d.train_y.dtype == torch.int64
    assert len(d.train_x) + len(d.test_x) == 1797
    assert int(d.train_x.max()) == 255
    # 20% of every class held out, and the same split every time
    for c in range(10):
        n_test, n_all = int((d.test_y == c).sum()), int((d.train_y == c).sum() + (d.test_y == c).sum())
        assert n_test == round(0.2 * n_all)
    datasets.forget_loaded()
    assert torch.equal(load_dataset("digits").test_x, d.test_x)


@pytest.mark.parametrize("layout", ["its file", "its loader"])
def test_digits_are_scikit_learns_whether_read_from_its_file_or_by_its_loader(monkeypatch, layout):
    """The file read without importing scikit-learn, or load_digits where that file is not found."""
    from sklearn.datasets import load_digits

    if layout == "its loader":
        monkeypatch.setattr(Path, "is_file", lambda self: False)
    digits = load_digits()
    assert np.array_equal(datasets._digits_table(), np.column_stack([digits.data, digits.target]))


def test_normalise():
    d = load_dataset("digits")
    x = normalise(d.train_x, d)
    assert x.dtype == torch.float32 and x.shape == d.train_x.shape
    assert abs(x.mean().item()) < 1e-3 and abs(x.std().item() - 1) < 1e-2
    assert normalise(d.train_x[0], d).shape == (1, 8, 8)


@pytest.mark.skipif(not DEBIAN.is_dir(), reason="Debian package dataset-fashion-mnist not installed")
def test_fashion_mnist_debian_files_and_cache(private_cache, monkeypatch):
    d = load_dataset("fashion-mnist")
    assert (len(d.train_x), len(d.test_x)) == (60000, 10000)
    assert d.shape == (1, 28, 28) and d.num_classes == 10 and d.train_x.dtype == torch.uint8
    assert np.bincount(d.train_y.numpy()).tolist() == [6000] * 10
    assert abs(d.mean[0] - 0.2860) < 1e-3 and abs(d.std[0] - 0.3530) < 1e-3
    assert len(list((private_cache / "p2p-emulator").glob("fashion-mnist-*.npz"))) == 1
    datasets.forget_loaded()  # force the on-disk cache
    monkeypatch.setattr(datasets, "_decode_idx", lambda files: pytest.fail("decoded again"))
    cached = load_dataset("fashion-mnist")
    for key in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(cached, key), getattr(d, key)), key
    assert (cached.mean, cached.std, cached.num_classes) == (d.mean, d.std, d.num_classes)


@pytest.mark.parametrize("layout, gz", [(".", True), (".", False), ("FashionMNIST/raw", True)])
def test_fashion_mnist_from_root(tmp_path, layout, gz):
    fake_fashion(tmp_path / "data" / layout, gz=gz)
    d = load_dataset("fashion-mnist", root=str(tmp_path / "data"))
    assert d.train_x.shape == (30, 1, 28, 28) and d.test_x.shape == (10, 1, 28, 28)
    assert d.train_y.tolist() == [i % 10 for i in range(30)]


def test_mnist_via_torchvision_layout(tmp_path):
    fake_fashion(tmp_path / "MNIST" / "raw", gz=False)  # torchvision reads the plain IDX files
    d = load_dataset("mnist", root=str(tmp_path))
    assert d.shape == (1, 28, 28) and d.train_x.dtype == torch.uint8 and len(d.test_x) == 10


@pytest.mark.parametrize("name", ["fashion-mnist", "mnist", "cifar10", "svhn", "cinic10"])
def test_empty_root_is_one_line_error_naming_the_path(tmp_path, name):
    with pytest.raises(DatasetError) as err:
        load_dataset(name, root=str(tmp_path))
    message = str(err.value)
    assert str(tmp_path) in message and "\n" not in message and name in message


def test_corrupt_idx_bad_magic(tmp_path):
    fake_fashion(tmp_path)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((30, 28, 28)), magic=0x1234)
    with pytest.raises(DatasetError, match="magic"):
        load_dataset("fashion-mnist", root=str(tmp_path))


def test_truncated_idx(tmp_path):
    fake_fashion(tmp_path)
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes())[:-3]))
    with pytest.raises(DatasetError, match="holds 7"):
        load_dataset("fashion-mnist", root=str(tmp_path))


def test_cinic10_image_folder(tmp_path):
    from PIL import Image

    for split, n in (("train", 3), ("test", 2)):
        for name in ("airplane", "cat"):
            folder = tmp_path / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (32, 32), (i, i, i)).save(folder / f"{i}.png")
    Image.new("L", (32, 32)).save(tmp_path / "test" / "cat" / "grey.png")  # CINIC-10 has some
    d = load_dataset("cinic10", root=str(tmp_path))
    assert d.shape == (3, 32, 32) and d.num_classes == 2
    assert d.train_y.tolist() == [0, 0, 0, 1, 1, 1] and len(d.test_x) == 5


def test_unknown_name():
    with pytest.raises(DatasetError) as err:
        load_dataset("imagenet")
    assert "imagenet" in str(err.value) and all(name in str(err.value) for name in DATASETS)
