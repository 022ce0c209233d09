"""A user's own dataset, `--dataset file:PATH`: an NPZ or a CSV with an owner per sample.

NPZ: arrays `x`, `y` (integer classes from 0) and `owner` (names or numbers), one row per
sample, and optionally `test` (booleans: True for a test sample). What a sample is follows
from `x`: uint8 (N, H, W) or (N, C, H, W) is an image; float (N, D) features, used as they are;
any other integer (N, L) token ids (the vocabulary is the largest id + 1).

CSV: a header row naming `owner`, `label` and optionally `split` (train or test); every other
column is a float feature.

Without a test flag, each owner's samples are split as the embedded digits are: 20% of them
(rounded) held out as test, drawn by numpy.random.default_rng(0), the same on every machine.
Owners are numbered in order of first appearance; `--partition natural` gives each node its own.
"""
from __future__ import annotations

import csv
import zipfile
from pathlib import Path

import numpy as np

from .decoded import Dataset, DatasetError, make_dataset, stratified_holdout

TEST_FRACTION = 0.2


def load_file(path: str) -> Dataset:
    """The dataset in `path` (.npz or .csv); see the module doc."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DatasetError(f"file:{path}: no such file")
    readers = {".npz": _read_npz, ".csv": _read_csv}
    if file.suffix.lower() not in readers:
        raise DatasetError(f"file:{path}: expected a .npz or .csv file")
    x, y, owner, test = readers[file.suffix.lower()](file)
    return _owned_dataset(file, x, y, owner, test)


def _read_npz(file: Path):
    try:
        with np.load(file, allow_pickle=False) as z:
            missing = [key for key in ("x", "y", "owner") if key not in z]
            if missing:
                raise DatasetError(f"{file}: missing array(s) {', '.join(missing)} (needs x, y, owner)")
            return z["x"], z["y"], z["owner"], z["test"] if "test" in z else None
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise DatasetError(f"{file}: not a readable .npz ({str(err).splitlines()[0]})") from None


def _read_csv(file: Path):
    try:
        with file.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DatasetError(f"{file}: cannot read as UTF-8 CSV ({err})") from None
    columns = list(rows[0]) if rows else []
    missing = [c for c in ("owner", "label") if c not in columns]
    if missing:
        raise DatasetError(f"{file}: missing column(s) {', '.join(missing)} (the header needs owner and label)")
    features = [c for c in columns if c not in ("owner", "label", "split")]
    splits = {row.get("split", "train") for row in rows} - {"train", "test"}
    if splits:
        raise DatasetError(f"{file}: split must be train or test, got {sorted(splits)[0]!r}")
    try:
        x = np.array([[float(row[c]) for c in features] for row in rows], dtype=np.float32)
        y = np.array([int(row["label"]) for row in rows])
    except (TypeError, ValueError) as err:
        raise DatasetError(f"{file}: a feature or label is not a number ({err})") from None
    test = np.array([row.get("split") == "test" for row in rows]) if "split" in columns else None
    return x, y, np.array([row["owner"] for row in rows]), test


def _owned_dataset(file: Path, x, y, owner, test) -> Dataset:
    n = len(y)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer) or (n and y.min() < 0):
        raise DatasetError(f"{file}: y must be one non-negative integer class per sample")
    for name, values in (("x", x), ("owner", owner), ("test", test)):
        if values is not None and len(values) != n:
            raise DatasetError(f"{file}: {name} has {len(values)} rows but y has {n}")
    if n == 0:
        raise DatasetError(f"{file}: holds no samples")
    kind, x, vocabulary = _sample_kind(file, x)
    names, first, owner_index = np.unique(owner.astype(str), return_index=True, return_inverse=True)
    first_seen = np.argsort(first)
    renumber = np.empty(len(names), dtype=np.int64)
    renumber[first_seen] = np.arange(len(names))
    owner_index = renumber[owner_index.ravel()]
    test = stratified_holdout(owner_index, TEST_FRACTION, seed=0) if test is None else test.astype(bool)
    return make_dataset(f"file:{file}", x[~test], y[~test], x[test], y[test], int(y.max()) + 1, kind=kind,
                        vocabulary=vocabulary, owners=list(names[first_seen]), train_owner=owner_index[~test],
                        test_owner=owner_index[test])


def _sample_kind(file: Path, x: np.ndarray) -> tuple[str, np.ndarray, int]:
    if x.dtype == np.uint8 and x.ndim in (3, 4):
        return "image", x if x.ndim == 4 else x[:, None], 0
    if np.issubdtype(x.dtype, np.floating) and x.ndim == 2:
        return "features", x, 0
    if np.issubdtype(x.dtype, np.integer) and x.ndim == 2 and x.size and x.min() >= 0:
        return "tokens", x, int(x.max()) + 1
    raise DatasetError(f"{file}: x of {x.dtype} {x.shape} is none of uint8 images (N, [C,] H, W), "
                       f"float features (N, D) or non-negative integer tokens (N, L)")
