"""Decoded datasets: the `Dataset` every loader returns, the .npz cache of decoded files, and the
seeded test split of datasets that come without one (`stratified_holdout`).

Loaders (datasets.py, leaf.py, user_files.py) build a Dataset with `make_dataset`, and wrap a slow
decode in `disk_cached`: the arrays are kept as an uncompressed .npz under $XDG_CACHE_HOME/p2p-emulator
(default ~/.cache/p2p-emulator), keyed by the source files' paths, sizes and mtimes.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .lazy import LazyModule

torch = LazyModule("torch")


class DatasetError(Exception):
    """A dataset cannot be loaded; the message is one line meant for the user."""


@dataclass(frozen=True)
class Dataset:
    """A labelled dataset; `kind` says what a sample is.

    image: uint8 (N, C, H, W) pixels, normalised per batch; tokens: integer (N, L) ids below
    `vocabulary` (characters or words); features: float32 (N, D), used as they are.
    Datasets with a natural owner per sample (a LEAF user, a fortunes topic, a file's `owner`
    column) carry it as an index into `owners`, for `--partition natural`.
    """
    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor  # int64 (N,)
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]  # image: per channel, 0..1 units, of the training images
    std: tuple[float, ...]
    kind: str = "image"
    vocabulary: int = 0  # tokens: the number of token ids
    owners: tuple[str, ...] = ()  # the owners' names; empty for datasets without owners
    train_owner: np.ndarray | None = None  # int64 (N,) indices into owners
    test_owner: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "p2p-emulator"


_X_TYPES = {"image": np.uint8, "features": np.float32}


def make_dataset(name, train_x, train_y, test_x, test_y, num_classes, stats=None, *, kind="image", vocabulary=0,
                 owners=(), train_owner=None, test_owner=None) -> Dataset:
    if stats is None:
        stats = _channel_stats(train_x) if kind == "image" else ((), ())
    mean, std = stats
    x_type = _X_TYPES.get(kind, np.uint8 if vocabulary <= 256 else np.int32)  # tokens: the narrowest that holds them
    return Dataset(
        name=name,
        train_x=_tensor(train_x, x_type),
        train_y=_tensor(train_y, np.int64),
        test_x=_tensor(test_x, x_type),
        test_y=_tensor(test_y, np.int64),
        num_classes=int(num_classes),
        mean=tuple(float(m) for m in mean),
        std=tuple(float(s) for s in std),
        kind=str(kind),
        vocabulary=int(vocabulary),
        owners=tuple(str(o) for o in owners),
        train_owner=None if train_owner is None else np.asarray(train_owner, dtype=np.int64),
        test_owner=None if test_owner is None else np.asarray(test_owner, dtype=np.int64),
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


def disk_cached(name: str, sources: list[Path], build: Callable[[], Dataset]) -> Dataset:
    """Load `build()`'s result from the .npz cache, or build it and try to cache it."""
    stamp = repr([(str(p), st.st_size, st.st_mtime_ns) for p in sources for st in [p.stat()]])
    path = cache_dir() / f"{name}-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.npz"
    try:
        with np.load(path, allow_pickle=False) as z:
            owned = {key: z[key] for key in ("owners", "train_owner", "test_owner") if key in z}
            return make_dataset(name, z["train_x"], z["train_y"], z["test_x"], z["test_y"],
                                z["num_classes"], (z["mean"], z["std"]), kind=str(z["kind"]),
                                vocabulary=int(z["vocabulary"]), **owned)
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
            owned = {} if dataset.train_owner is None else {
                "owners": np.array(dataset.owners, dtype=str), "train_owner": dataset.train_owner,
                "test_owner": dataset.test_owner}
            np.savez(f, train_x=dataset.train_x.numpy(), train_y=dataset.train_y.numpy(),
                     test_x=dataset.test_x.numpy(), test_y=dataset.test_y.numpy(),
                     num_classes=dataset.num_classes, mean=dataset.mean, std=dataset.std,
                     kind=dataset.kind, vocabulary=dataset.vocabulary, **owned)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def stratified_holdout(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask holding out round(fraction * n_c) random samples of every class c."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        mask[rng.permutation(members)[: round(fraction * len(members))]] = True
    return mask
