"""Image classification datasets as compact uint8 tensors.

Every loader returns a `Dataset` with images as uint8 NCHW tensors (normalise per
batch with `normalise`) and int64 labels. Sources:

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

Decoded IDX and CINIC-10 data is cached as an uncompressed .npz under
$XDG_CACHE_HOME/p2p-emulator (default ~/.cache/p2p-emulator), keyed by the source
files' paths, sizes and mtimes; every load is also memoised in-process.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .lazy import LazyModule

torch = LazyModule("torch")

DATASETS = ("digits", "fashion-mnist", "mnist", "cifar10", "svhn", "cinic10")

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
CINIC10_URL = "https://datashare.ed.ac.uk/handle/10283/3192"


class DatasetError(Exception):
    """A dataset cannot be loaded; the message is one line meant for the user."""


@dataclass(frozen=True)
class Dataset:
    name: str
    train_x: torch.Tensor  # uint8 (N, C, H, W)
    train_y: torch.Tensor  # int64 (N,)
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]  # per channel, 0..1 units, of the training images
    std: tuple[float, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])


def load_dataset(name: str, root: str | None = None, download: bool = False) -> Dataset:
    """Load `name` (one of DATASETS) from `root` or its default location."""
    if name not in _LOADERS:
        raise DatasetError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    resolved = str(Path(root).expanduser().resolve()) if root else None
    return _load_memoised(name, resolved, bool(download))


NORMALIZATIONS = ("standard", "max", "none")


def normalise(x_uint8: torch.Tensor, dataset: Dataset, mode: str = "standard") -> torch.Tensor:
    """float32 images, for one (C,H,W) or a batch (B,C,H,W).

    standard: (x/255 - mean)/std per channel; max: x/255 (divided by the largest
    pixel value); none: the raw 0..255 values.
    """
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
    return _LOADERS[name](root, download)


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "p2p-emulator"


def _default_root() -> Path:
    # Where torchvision datasets live (and are downloaded to) when no root is given.
    return _cache_dir() / "datasets"


def _make(name, train_x, train_y, test_x, test_y, num_classes, stats=None) -> Dataset:
    mean, std = stats if stats is not None else _channel_stats(train_x)
    return Dataset(
        name=name,
        train_x=_tensor(train_x, np.uint8),
        train_y=_tensor(train_y, np.int64),
        test_x=_tensor(test_x, np.uint8),
        test_y=_tensor(test_y, np.int64),
        num_classes=int(num_classes),
        mean=tuple(float(m) for m in mean),
        std=tuple(float(s) for s in std),
    )


def _tensor(array: np.ndarray, dtype) -> torch.Tensor:
    # np.require copies only when needed (read-only buffers, other dtypes).
    return torch.from_numpy(np.require(array, dtype=dtype, requirements=("C", "W")))


def _channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact per-channel mean and std in 0..1 units from a 256-bin histogram (no float copy)."""
    levels = np.arange(256) / 255.0
    means, stds = [], []
    for channel in range(x.shape[1]):
        hist = np.bincount(x[:, channel].ravel(), minlength=256)
        p = hist / hist.sum()
        mean = p @ levels
        means.append(mean)
        stds.append(np.sqrt(p @ (levels - mean) ** 2))
    return np.array(means), np.array(stds)


# ---------------------------------------------------------------- on-disk cache


def _disk_cached(name: str, sources: list[Path], build: Callable[[], Dataset]) -> Dataset:
    """Load `build()`'s result from the .npz cache, or build it and try to cache it."""
    stamp = repr([(str(p), st.st_size, st.st_mtime_ns) for p in sources for st in [p.stat()]])
    path = _cache_dir() / f"{name}-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.npz"
    try:
        with np.load(path, allow_pickle=False) as z:
            return _make(name, z["train_x"], z["train_y"], z["test_x"], z["test_y"],
                         z["num_classes"], (z["mean"], z["std"]))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        pass  # no cache yet, or an unreadable one: rebuild it
    dataset = build()
    _save_npz(path, dataset)
    return dataset


def _save_npz(path: Path, dataset: Dataset) -> None:
    # Written to a temporary file and renamed, so concurrent loaders never read half a file;
    # the cache is optional, so a read-only home just means no cache.
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = f.name
            np.savez(f, train_x=dataset.train_x.numpy(), train_y=dataset.train_y.numpy(),
                     test_x=dataset.test_x.numpy(), test_y=dataset.test_y.numpy(),
                     num_classes=dataset.num_classes, mean=dataset.mean, std=dataset.std)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


# ---------------------------------------------------------------- digits


def _load_digits(root: str | None, download: bool) -> Dataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[:, None]
    labels = digits.target.astype(np.int64)
    test = _stratified_holdout(labels, fraction=0.2, seed=0)
    return _make("digits", images[~test], labels[~test], images[test], labels[test], 10)


def _stratified_holdout(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask holding out round(fraction * n_c) random samples of every class c."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        mask[rng.permutation(members)[: round(fraction * len(members))]] = True
    return mask


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
    return _disk_cached("fashion-mnist", list(files.values()), lambda: _decode_idx(files))


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
    return _make("fashion-mnist", train_x[:, None], train_y, test_x[:, None], test_y, num_classes)


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
    return _make("mnist", train.data.numpy()[:, None], train.targets.numpy(),
                 test.data.numpy()[:, None], test.targets.numpy(), 10)


def _load_cifar10(root: str | None, download: bool) -> Dataset:
    train, test = _open_torchvision("cifar10", "CIFAR-10", root, download,
                                    lambda r, t: _tv().CIFAR10(r, train=t, download=download))
    # CIFAR10 keeps images as NHWC.
    return _make("cifar10", train.data.transpose(0, 3, 1, 2), np.asarray(train.targets),
                 test.data.transpose(0, 3, 1, 2), np.asarray(test.targets), 10)


def _load_svhn(root: str | None, download: bool) -> Dataset:
    split = {True: "train", False: "test"}
    train, test = _open_torchvision("svhn", "SVHN", root, download,
                                    lambda r, t: _tv().SVHN(r, split=split[t], download=download))
    return _make("svhn", train.data, train.labels, test.data, test.labels, 10)


# ---------------------------------------------------------------- CINIC-10


def _load_cinic10(root: str | None, download: bool) -> Dataset:
    base = Path(root) if root else _default_root() / "cinic10"
    images = {split: sorted((base / split).glob("*/*.png")) for split in ("train", "test")}
    if not images["train"] or not images["test"]:
        raise DatasetError(f"cinic10: no PNG images under {base}/train/<class>/ and {base}/test/<class>/ "
                           f"(torchvision cannot download it); unpack CINIC-10 from {CINIC10_URL} "
                           f"there or pass --data-root DIR")
    classes = sorted({p.parent.name for p in images["train"]})
    return _disk_cached("cinic10", images["train"] + images["test"],
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
    return _make("cinic10", *arrays["train"], *arrays["test"], len(classes))


def _decode_png(path: Path) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_image

    try:
        # RGB mode: CINIC-10 has some greyscale images.
        return decode_image(str(path), mode=ImageReadMode.RGB)
    except RuntimeError as err:
        raise DatasetError(f"{path}: cannot decode ({str(err).splitlines()[0]})") from None


_LOADERS: dict[str, Callable[[str | None, bool], Dataset]] = {
    "digits": _load_digits,
    "fashion-mnist": _load_fashion_mnist,
    "mnist": _load_mnist,
    "cifar10": _load_cifar10,
    "svhn": _load_svhn,
    "cinic10": _load_cinic10,
}
