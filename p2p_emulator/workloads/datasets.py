"""Every dataset by name (`load_dataset`), as compact tensors.

Every loader returns a `Dataset` (decoded.py) with int64 labels; images are uint8 NCHW
tensors (normalise per batch with `normalise`), text is uint8 character ids. Sources:

- ``digits``: scikit-learn's bundled 8x8 digits (values 0..16 scaled to 0..255).
  It has no official test split, so 20% of each class (rounded) is held out as
  test, chosen by ``numpy.random.default_rng(0)``: the split is the same on every
  machine and run.
- ``fashion-mnist``: the gzip (or plain) IDX files, by default those of the Debian
  package ``dataset-fashion-mnist`` in /usr/share/datasets/fashion-mnist; a root
  may hold them directly or in the torchvision layout root/FashionMNIST/raw.
- ``mnist``, ``cifar10``, ``svhn``: torchvision's files under root (downloaded
  there with ``download=True``).
- ``cinic10``: the ImageFolder layout root/{train,test}/<class>/*.png.
- ``fortunes``: the Debian package ``fortunes``, next-character prediction (text.py).
- ``leaf-femnist``, ``leaf-shakespeare``, ``leaf-sent140``: LEAF's JSON files (leaf.py).
- ``file:PATH``: a user's .npz or .csv with an owner per sample (user_files.py).

Decoded IDX, CINIC-10 and fortunes data is cached (decoded.py) as an uncompressed .npz under
$XDG_CACHE_HOME/p2p-emulator (default ~/.cache/p2p-emulator), keyed by the source
files' paths, sizes and mtimes; every load is also memoised in-process.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .decoded import Dataset, DatasetError, cache_dir, disk_cached, make_dataset, stratified_holdout
from .lazy import LazyModule

torch = LazyModule("torch")

DATASETS = ("digits", "fashion-mnist", "mnist", "cifar10", "svhn", "cinic10", "fortunes",
            "leaf-femnist", "leaf-shakespeare", "leaf-sent140")
FILE_PREFIX = "file:"  # --dataset file:PATH, a user's own CSV or NPZ

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
CINIC10_URL = "https://datashare.ed.ac.uk/handle/10283/3192"


def load_dataset(name: str, root: str | None = None, download: bool = False) -> Dataset:
    """Load `name` (one of DATASETS, or file:PATH) from `root` or its default location."""
    if name.startswith(FILE_PREFIX):
        return _load_memoised(name, None, False)
    if name not in _LOADERS:
        raise DatasetError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    resolved = str(Path(root).expanduser().resolve()) if root else None
    return _load_memoised(name, resolved, bool(download))


NORMALIZATIONS = ("standard", "max", "none")


def normalise(x_uint8: torch.Tensor, dataset: Dataset, mode: str = "standard") -> torch.Tensor:
    """float32 images, for one (C,H,W) or a batch (B,C,H,W); tokens and features as they are.

    standard: (x/255 - mean)/std per channel; max: x/255 (divided by the largest
    pixel value); none: the raw 0..255 values.
    """
    if dataset.kind != "image":
        return x_uint8
    x = x_uint8.float()
    if mode == "none":
        return x
    if mode == "max":
        return x / 255.0
    mean = torch.tensor(dataset.mean, dtype=torch.float32, device=x_uint8.device).view(-1, 1, 1)
    std = torch.tensor(dataset.std, dtype=torch.float32, device=x_uint8.device).view(-1, 1, 1)
    return (x / 255.0 - mean) / std


def forget_loaded() -> None:
    """Drop the datasets held in memory; the next load_dataset reads them (or the on-disk cache) again."""
    _load_memoised.cache_clear()


@functools.lru_cache(maxsize=None)
def _load_memoised(name: str, root: str | None, download: bool) -> Dataset:
    if name.startswith(FILE_PREFIX):
        from .user_files import load_file

        return load_file(name[len(FILE_PREFIX):])
    return _LOADERS[name](root, download)


def _default_root() -> Path:
    # Where torchvision datasets live (and are downloaded to) when no root is given.
    return cache_dir() / "datasets"


# ---------------------------------------------------------------- digits


def _load_digits(root: str | None, download: bool) -> Dataset:
    table = _digits_table()
    images = np.round(table[:, :-1].reshape(-1, 1, 8, 8) * (255.0 / 16.0)).astype(np.uint8)
    labels = table[:, -1].astype(np.int64)
    test = stratified_holdout(labels, fraction=0.2, seed=0)
    return make_dataset("digits", images[~test], labels[~test], images[test], labels[test], 10)


def _digits_table() -> np.ndarray:
    """The digits as scikit-learn ships them: a row per image, 64 values 0..16, then the label."""
    # load_digits reads this gzipped CSV; reading it here skips importing scikit-learn, whose import
    # (scipy.stats) takes longer than a small run's whole emulation.
    csv = Path(importlib.util.find_spec("sklearn").origin).parent / "datasets" / "data" / "digits.csv.gz"
    if not csv.is_file():  # another scikit-learn layout: its own loader
        from sklearn.datasets import load_digits

        digits = load_digits()
        return np.column_stack([digits.data, digits.target])
    with gzip.open(csv, "rt") as lines:
        return np.loadtxt(lines, delimiter=",")


# ---------------------------------------------------------------- IDX (fashion-mnist)

_IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


def _load_fashion_mnist(root: str | None, download: bool) -> Dataset:
    if root:
        dirs = [Path(root), Path(root) / "FashionMNIST" / "raw"]
    else:
        dirs = [DEBIAN_FASHION_MNIST, _default_root() / "FashionMNIST" / "raw"]
    files = _find_idx(dirs)
    if files is None and download:
        _open_torchvision("fashion-mnist", "FashionMNIST", root, download,
                          lambda r, train: _tv().FashionMNIST(r, train=train, download=True))
        files = _find_idx(dirs)
    if files is None:
        looked = " or ".join(str(d) for d in dirs)
        raise DatasetError(
            f"fashion-mnist: no IDX files in {looked} (looked for {_IDX_FILES['train_x']}[.gz] "
            f"and the other three); install the Debian package dataset-fashion-mnist, "
            f"pass --data-root DIR, or pass --download (needs internet)")
    return disk_cached("fashion-mnist", list(files.values()), lambda: _decode_idx(files))


def _find_idx(dirs: list[Path]) -> dict[str, Path] | None:
    """The first directory holding all four IDX files (plain or .gz), as key -> path."""
    for directory in dirs:
        found = {}
        for key, stem in _IDX_FILES.items():
            candidates = [directory / stem, directory / f"{stem}.gz"]
            found[key] = next((p for p in candidates if p.is_file()), None)
        if all(found.values()):
            return found
    return None


def _decode_idx(files: dict[str, Path]) -> Dataset:
    train_x, test_x = _read_idx(files["train_x"], 3), _read_idx(files["test_x"], 3)
    train_y, test_y = _read_idx(files["train_y"], 1), _read_idx(files["test_y"], 1)
    for x, y, key in ((train_x, train_y, "train_x"), (test_x, test_y, "test_x")):
        if len(x) != len(y):
            raise DatasetError(f"fashion-mnist: {files[key]} has {len(x)} images but its labels file has {len(y)}")
    num_classes = int(max(train_y.max(), test_y.max())) + 1
    return make_dataset("fashion-mnist", train_x[:, None], train_y, test_x[:, None], test_y, num_classes)


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    """Parse an unsigned-byte IDX file: magic 0x0000080N, N big-endian uint32 sizes, data."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except (OSError, EOFError) as err:
        raise DatasetError(f"{path}: cannot read ({err})") from None
    header = 4 + 4 * ndim
    magic = int.from_bytes(raw[:4], "big") if len(raw) >= header else None
    if magic != 0x800 + ndim:
        raise DatasetError(f"{path}: not an unsigned-byte IDX file with {ndim} dimension(s) "
                           f"(magic {magic if magic is None else hex(magic)}, expected {hex(0x800 + ndim)})")
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(np.int64)
    data = np.frombuffer(raw, dtype=np.uint8, offset=header)
    if data.size != int(np.prod(dims)):
        raise DatasetError(f"{path}: header says {'x'.join(map(str, dims))} = {int(np.prod(dims))} bytes "
                           f"but the file holds {data.size}")
    return data.reshape(tuple(dims))


# ---------------------------------------------------------------- fortunes (next character)


def _load_fortunes(root: str | None, download: bool) -> Dataset:
    from . import text

    base = Path(root) if root else text.DEBIAN_FORTUNES
    topics = text.fortune_topics(base) if base.is_dir() else []
    if not topics:
        raise DatasetError(f"fortunes: no fortune files (a text file with its .dat index) in {base}; "
                           f"install the Debian package fortunes or pass --data-root DIR")
    return disk_cached("fortunes", topics, lambda: _decode_fortunes(topics))


def _decode_fortunes(topics: list[Path]) -> Dataset:
    from . import text

    parts: dict[str, list] = {"train": [], "test": []}
    for owner, path in enumerate(topics):
        try:
            x, y = text.next_character_samples(text.encode(text.read_fortunes(path)))
        except (OSError, UnicodeDecodeError) as err:
            raise DatasetError(f"{path}: cannot read as UTF-8 text ({err})") from None
        for split, picked in zip(parts, text.split_by_sample(len(y))):  # views: the concatenation is the one copy
            parts[split].append((x[picked], y[picked], np.full(len(y[picked]), owner)))
    (train_x, train_y, train_owner), (test_x, test_y, test_owner) = (
        [np.concatenate(arrays) for arrays in zip(*rows)] for rows in parts.values())
    return make_dataset("fortunes", train_x, train_y, test_x, test_y, text.VOCABULARY, kind="tokens",
                        vocabulary=text.VOCABULARY, owners=[p.name for p in topics], train_owner=train_owner,
                        test_owner=test_owner)


# ---------------------------------------------------------------- torchvision


def _tv():
    # Imported lazily: torchvision is slow to import and digits/fashion-mnist never need it.
    import torchvision.datasets

    return torchvision.datasets


def _open_torchvision(name: str, files: str, root: str | None, download: bool, make) -> tuple:
    """(train, test) torchvision datasets, with their errors turned into one-line DatasetErrors."""
    base = root or str(_default_root())
    try:
        return make(base, True), make(base, False)
    except (RuntimeError, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        if download:
            raise DatasetError(f"{name}: download into {base} failed ({reason}); check the network "
                               f"or put the torchvision {files} files there") from None
        raise DatasetError(f"{name}: not found under {base}; pass --download (needs internet) "
                           f"or put the torchvision {files} files there") from None


def _load_mnist(root: str | None, download: bool) -> Dataset:
    train, test = _open_torchvision("mnist", "MNIST", root, download,
                                    lambda r, t: _tv().MNIST(r, train=t, download=download))
    return make_dataset("mnist", train.data.numpy()[:, None], train.targets.numpy(),
                        test.data.numpy()[:, None], test.targets.numpy(), 10)


def _load_cifar10(root: str | None, download: bool) -> Dataset:
    train, test = _open_torchvision("cifar10", "CIFAR-10", root, download,
                                    lambda r, t: _tv().CIFAR10(r, train=t, download=download))
    # CIFAR10 keeps images as NHWC.
    return make_dataset("cifar10", train.data.transpose(0, 3, 1, 2), np.asarray(train.targets),
                        test.data.transpose(0, 3, 1, 2), np.asarray(test.targets), 10)


def _load_svhn(root: str | None, download: bool) -> Dataset:
    split = {True: "train", False: "test"}
    train, test = _open_torchvision("svhn", "SVHN", root, download,
                                    lambda r, t: _tv().SVHN(r, split=split[t], download=download))
    return make_dataset("svhn", train.data, train.labels, test.data, test.labels, 10)


# ---------------------------------------------------------------- CINIC-10


def _load_cinic10(root: str | None, download: bool) -> Dataset:
    base = Path(root) if root else _default_root() / "cinic10"
    images = {split: sorted((base / split).glob("*/*.png")) for split in ("train", "test")}
    if not images["train"] or not images["test"]:
        raise DatasetError(f"cinic10: no PNG images under {base}/train/<class>/ and {base}/test/<class>/ "
                           f"(torchvision cannot download it); unpack CINIC-10 from {CINIC10_URL} "
                           f"there or pass --data-root DIR")
    classes = sorted({p.parent.name for p in images["train"]})
    return disk_cached("cinic10", images["train"] + images["test"],
                        lambda: _decode_folder(images, classes))


def _decode_folder(images: dict[str, list[Path]], classes: list[str]) -> Dataset:
    index = {name: i for i, name in enumerate(classes)}
    arrays = {}
    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its image decoders (for torchcodec) on every call.
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="torchvision")
        decoded = {split: [_decode_png(p) for p in paths] for split, paths in images.items()}
    for split, paths in images.items():
        unknown = {p.parent.name for p in paths} - index.keys()
        if unknown:
            raise DatasetError(f"cinic10: {split} has classes missing from train: {', '.join(sorted(unknown))}")
        shapes = {tuple(x.shape) for x in decoded[split]}
        if len(shapes) != 1:
            raise DatasetError(f"cinic10: {split} images differ in size: {sorted(shapes)}")
        arrays[split] = (torch.stack(decoded[split]).numpy(), np.array([index[p.parent.name] for p in paths]))
    return make_dataset("cinic10", *arrays["train"], *arrays["test"], len(classes))


def _decode_png(path: Path) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_image

    try:
        # RGB mode: CINIC-10 has some greyscale images.
        return decode_image(str(path), mode=ImageReadMode.RGB)
    except RuntimeError as err:
        raise DatasetError(f"{path}: cannot decode ({str(err).splitlines()[0]})") from None


def _leaf(task: str) -> Callable[[str | None, bool], Dataset]:
    def load(root: str | None, download: bool) -> Dataset:
        from . import leaf  # ijson and the text tools: only LEAF runs need them

        return leaf.load(task, root)
    return load


_LOADERS: dict[str, Callable[[str | None, bool], Dataset]] = {
    "digits": _load_digits,
    "fashion-mnist": _load_fashion_mnist,
    "mnist": _load_mnist,
    "cifar10": _load_cifar10,
    "svhn": _load_svhn,
    "cinic10": _load_cinic10,
    "fortunes": _load_fortunes,
    "leaf-femnist": _leaf("femnist"),
    "leaf-shakespeare": _leaf("shakespeare"),
    "leaf-sent140": _leaf("sent140"),
}
