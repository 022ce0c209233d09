"""LEAF's federated datasets (Caldas et al. 2018): FEMNIST, Shakespeare and Sent140.

Format read: the data folder that LEAF's ``preprocess.sh ... -t sample`` writes, e.g.
leaf/data/femnist/data, with train/*.json and test/*.json. Each file is one JSON object:
``users`` (names), ``num_samples`` (one count per user) and ``user_data`` ({user: {"x": [...],
"y": [...]}}); other keys (``hierarchies``) are ignored. Files are streamed with ijson, one user
at a time, into arrays sized from ``num_samples``: memory is the arrays plus one user's JSON.

Every LEAF user is one owner (for ``--partition natural``), named and numbered in order of first
appearance, train files first, each folder's files by name. A user in both train and test (LEAF's
by-sample split) is one owner. Samples keep their order in the files.

- femnist: x is 784 numbers in [0, 1] (a 28x28 image, LEAF's pixel/255), y a class in [0, 62).
  Stored as uint8 images (N, 1, 28, 28) = round(255 x), which gives back LEAF's pixels exactly.
- shakespeare: x is 80 characters, y the next one; both as ids of `text.CHARACTERS`. Departure:
  characters outside LEAF's 80 map to `text.UNKNOWN` (LEAF looks them up as -1).
- sent140: x is a Sentiment140 row [tweet id, date, query, user, text], y 0 (negative) or 1
  (positive). The text is split with LEAF's tokenizer (``[\\w']+|[.,!?;]``, case kept, as LEAF).
  Departures: LEAF looks words up in GloVe's vocabulary and embedding; here the vocabulary is the
  10,000 most frequent tokens of the training users' tweets (ties by the token), with id 0 for
  padding, 1 for unknown words and 2.. for the words in that order, and the model learns its own
  embedding. Each tweet is its first 25 token ids (LEAF's max_words), padded at the end with 0
  (LEAF pads with its unknown id).

Decoded arrays are cached as .npz under $XDG_CACHE_HOME/p2p-emulator (`decoded.disk_cached`),
keyed by the JSON files' paths, sizes and mtimes.
"""
from __future__ import annotations

import contextlib
import re
from collections import Counter
from pathlib import Path

import ijson
import numpy as np

from . import text
from .decoded import Dataset, DatasetError, disk_cached, make_dataset

TASKS = ("femnist", "shakespeare", "sent140")
SPLITS = ("train", "test")

# LEAF's own commands (run in leaf/data/<task>) for its small-sized datasets; Shakespeare's train
# fraction is FedAvg's. LEAF's README spells it -tf, which its script silently ignores.
PREPROCESS = {
    "femnist": "./preprocess.sh -s niid --sf 0.05 -k 0 -t sample",
    "shakespeare": "./preprocess.sh -s niid --sf 0.2 -k 0 -t sample --tf 0.8",
    "sent140": "./preprocess.sh -s niid --sf 0.05 -k 3 -t sample",
}

FEMNIST_CLASSES = 62
FEMNIST_PIXELS = 28 * 28
SENT140_WORDS = 10_000
SENT140_LENGTH = 25  # LEAF's max_words
PADDING, UNKNOWN_WORD, FIRST_WORD = 0, 1, 2
_TOKENS = re.compile(r"[\w']+|[.,!?;]")  # LEAF's split_line


def load(task: str, root: str | None) -> Dataset:
    """LEAF's `task` (femnist, shakespeare or sent140) from its data folder `root`."""
    if task not in TASKS:
        raise DatasetError(f"unknown LEAF task {task!r}; choose from {', '.join(TASKS)}")
    files = _json_files(task, root)
    sources = sorted(files["train"] + files["test"])
    return disk_cached(f"leaf-{task}", sources, lambda: _decode(task, files))


def _json_files(task: str, root: str | None) -> dict[str, list[Path]]:
    """The train and test JSON files under `root`, each folder's by name."""
    how = f"make them in leaf/data/{task} with LEAF's {PREPROCESS[task]}"
    if not root:
        raise DatasetError(f"leaf-{task}: pass --data-root DIR, LEAF's data/{task}/data folder "
                           f"holding train/ and test/ ({how})")
    base = Path(root)
    if not base.is_dir():
        raise DatasetError(f"leaf-{task}: {base} is not a directory; pass LEAF's data/{task}/data "
                           f"folder holding train/ and test/ ({how})")
    files = {split: sorted(p for p in (base / split).glob("*.json") if p.is_file()) for split in SPLITS}
    for split, found in files.items():
        if not found:
            raise DatasetError(f"leaf-{task}: no .json files in {base / split} (LEAF's data folder has "
                               f"train/ and test/); {how}")
    return files


def _decode(task: str, files: dict[str, list[Path]]) -> Dataset:
    codec = _CODECS[task]()
    owners: dict[str, int] = {}
    arrays = {split: _read_split(codec, owners, files[split], split == "train") for split in SPLITS}
    for split, (_, y, _) in arrays.items():
        if not len(y):
            raise DatasetError(f"leaf-{task}: the .json files in {files[split][0].parent} hold no samples")
    options = codec.finish(arrays)
    (train_x, train_y, train_owner), (test_x, test_y, test_owner) = arrays.values()
    return make_dataset(f"leaf-{task}", train_x, train_y, test_x, test_y, owners=list(owners),
                        train_owner=train_owner, test_owner=test_owner, **options)


def _read_split(codec, owners: dict[str, int], paths: list[Path], training: bool) -> list[np.ndarray]:
    """[x, y, owner] of one split's files, filled user by user into arrays sized from num_samples."""
    headers = [_read_header(path) for path in paths]
    total = sum(sum(counts.values()) for counts in headers)
    x = np.empty((total, *codec.shape), dtype=codec.dtype)
    y = np.empty(total, dtype=np.int64)
    owner = np.empty(total, dtype=np.int64)
    start = 0
    for path, counts in zip(paths, headers):
        for user, xs, ys in _users(path, counts):
            end = start + len(ys)
            x[start:end], y[start:end] = codec.convert(f"{path}: user {user!r}", xs, ys, training)
            owner[start:end] = owners.setdefault(user, len(owners))
            start = end
    return [x, y, owner]


# ---------------------------------------------------------------- streaming LEAF's JSON

_MISSING = object()


@contextlib.contextmanager
def _parsing(path: Path):
    """Turn unreadable files and ijson's errors (bad JSON, truncation, non-UTF-8 bytes) into one line."""
    try:
        yield
    except OSError as err:
        raise DatasetError(f"{path}: cannot read ({err.strerror or err})") from None
    except (ijson.JSONError, UnicodeDecodeError) as err:
        reason = err.args[0] if err.args else ""
        if isinstance(reason, bytes):  # yajl's messages
            reason = reason.decode("utf-8", "replace")
        first = next(iter(str(reason).strip().splitlines()), type(err).__name__)
        raise DatasetError(f"{path}: not valid JSON ({first})") from None


def _top_level(f, key: str):
    """The value of the file's top-level `key`, or _MISSING; ijson stops reading once it has it."""
    f.seek(0)
    return next(ijson.items(f, key, use_float=True), _MISSING)


def _read_header(path: Path) -> dict[str, int]:
    """The file's users and their num_samples, in the file's order."""
    with _parsing(path), path.open("rb") as f:
        users, counts = _top_level(f, "users"), _top_level(f, "num_samples")
    for key, value in (("users", users), ("num_samples", counts)):
        if value is _MISSING:
            raise DatasetError(f"{path}: no '{key}' key (LEAF's files have users, num_samples and user_data)")
        if not isinstance(value, list):
            raise DatasetError(f"{path}: '{key}' is not a list")
    if not all(isinstance(u, str) for u in users):
        raise DatasetError(f"{path}: 'users' holds something other than names")
    if not all(type(n) is int and n >= 0 for n in counts):
        raise DatasetError(f"{path}: 'num_samples' holds something other than counts")
    if len(users) != len(counts):
        raise DatasetError(f"{path}: {len(users)} users but {len(counts)} num_samples")
    header = dict(zip(users, counts))
    if len(header) != len(users):
        twice = next(u for u in users if users.count(u) > 1)
        raise DatasetError(f"{path}: user {twice!r} is listed twice in users")
    return header


def _users(path: Path, counts: dict[str, int]):
    """(user, x, y) for each user of user_data, in file order, checked against the header."""
    seen = set()
    with _parsing(path), path.open("rb") as f:
        for user, data in ijson.kvitems(f, "user_data", use_float=True):
            where = f"{path}: user {user!r}"
            if user not in counts:
                raise DatasetError(f"{where} is in user_data but not in users")
            if user in seen:
                raise DatasetError(f"{where} appears twice in user_data")
            seen.add(user)
            xs, ys = _samples(where, data)
            if not len(xs) == len(ys) == counts[user]:
                raise DatasetError(f"{where}: num_samples says {counts[user]} but x has {len(xs)} "
                                   f"and y {len(ys)} samples")
            yield user, xs, ys
        if not seen:
            _check_user_data(path, f)
    missing = [u for u in counts if u not in seen]
    if missing:
        raise DatasetError(f"{path}: user {missing[0]!r} is in users but not in user_data")


def _check_user_data(path: Path, f) -> None:
    # Only when user_data gave no user: cheap then, and it tells a missing key from an empty one.
    user_data = _top_level(f, "user_data")
    if user_data is _MISSING:
        raise DatasetError(f"{path}: no 'user_data' key (LEAF's files have users, num_samples and user_data)")
    if not isinstance(user_data, dict):
        raise DatasetError(f"{path}: 'user_data' is not an object of users")


def _samples(where: str, data) -> tuple[list, list]:
    if not isinstance(data, dict):
        raise DatasetError(f"{where}: its user_data is not an object with x and y")
    for key in ("x", "y"):
        if not isinstance(data.get(key), list):
            raise DatasetError(f"{where}: its user_data has no '{key}' list")
    return data["x"], data["y"]


def _first_bad(values: list, good) -> int | None:
    return next((i for i, value in enumerate(values) if not good(value)), None)


def _check(where: str, values: list, good, what: str) -> None:
    bad = _first_bad(values, good)
    if bad is not None:
        raise DatasetError(f"{where}: sample {bad}: {what}, got {_brief(values[bad])}")


def _brief(value) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    shown = repr(value)
    return shown if len(shown) <= 40 else f"{shown[:37]}..."


# ---------------------------------------------------------------- the three tasks


class _Femnist:
    shape, dtype = (1, 28, 28), np.uint8

    def convert(self, where: str, xs: list, ys: list, training: bool) -> tuple[np.ndarray, list]:
        _check(where, ys, lambda c: type(c) is int and 0 <= c < FEMNIST_CLASSES,
               f"y is not a class in [0, {FEMNIST_CLASSES})")
        what = f"x is not {FEMNIST_PIXELS} numbers in [0, 1]"
        _check(where, xs, lambda image: isinstance(image, list) and len(image) == FEMNIST_PIXELS, what)
        pixels = _pixel_rows(xs)
        if pixels is None:
            bad = _first_bad(xs, lambda image: all(type(v) in (int, float) for v in image))
            raise DatasetError(f"{where}: sample {bad}: {what}, got a non-number")
        inside = (pixels >= 0) & (pixels <= 1)  # NaN is not
        if not inside.all():
            bad = int(np.flatnonzero(~inside.all(axis=1))[0])
            raise DatasetError(f"{where}: sample {bad}: {what}, got {pixels[bad][~inside[bad]][0]}")
        return np.rint(pixels * 255).astype(np.uint8).reshape(-1, *self.shape), ys

    def finish(self, arrays: dict) -> dict:
        return {"num_classes": FEMNIST_CLASSES, "kind": "image"}


def _pixel_rows(xs: list) -> np.ndarray | None:
    """The images as an (N, 784) number array, or None when one holds a non-number."""
    if not xs:
        return np.empty((0, FEMNIST_PIXELS))
    try:
        pixels = np.array(xs)
    except ValueError:  # ragged: a list among the pixels
        return None
    return pixels if pixels.dtype.kind in "iuf" and pixels.ndim == 2 else None


class _Shakespeare:
    shape, dtype = (text.SEQUENCE,), np.uint8

    def convert(self, where: str, xs: list, ys: list, training: bool) -> tuple[np.ndarray, np.ndarray]:
        _check(where, xs, lambda s: isinstance(s, str) and len(s) == text.SEQUENCE,
               f"x is not a string of {text.SEQUENCE} characters")
        _check(where, ys, lambda c: isinstance(c, str) and len(c) == 1, "y is not one character")
        return text.encode("".join(xs)).reshape(-1, text.SEQUENCE), text.encode("".join(ys))

    def finish(self, arrays: dict) -> dict:
        return {"num_classes": text.VOCABULARY, "kind": "tokens", "vocabulary": text.VOCABULARY}


class _Sent140:
    """Tweets as token ids; words are numbered in reading order first, then by training frequency."""
    shape, dtype = (SENT140_LENGTH,), np.int32

    def __init__(self):
        self.order: dict[str, int] = {}  # token -> its id in reading order, from 1 (0 is padding)
        self.train_counts: Counter[str] = Counter()

    def convert(self, where: str, xs: list, ys: list, training: bool) -> tuple[np.ndarray, list]:
        _check(where, ys, lambda label: type(label) is int and label in (0, 1), "y is not 0 or 1")
        _check(where, xs, lambda row: isinstance(row, list) and len(row) == 5 and isinstance(row[4], str),
               "x is not a record [tweet id, date, query, user, text] with a string text")
        ids = np.zeros((len(xs), SENT140_LENGTH), dtype=np.int32)
        for row, record in zip(ids, xs):
            tokens = _TOKENS.findall(record[4])
            if training:
                self.train_counts.update(tokens)
            head = tokens[:SENT140_LENGTH]
            row[:len(head)] = [self.order.setdefault(token, len(self.order) + 1) for token in head]
        return ids, ys

    def finish(self, arrays: dict) -> dict:
        """Renumber every split's reading-order ids by training frequency."""
        words = sorted(self.train_counts, key=lambda word: (-self.train_counts[word], word))[:SENT140_WORDS]
        renumber = np.full(len(self.order) + 1, UNKNOWN_WORD, dtype=np.int32)
        renumber[PADDING] = PADDING
        for rank, word in enumerate(words):
            if word in self.order:  # a word seen only past a tweet's 25th token has no reading-order id
                renumber[self.order[word]] = FIRST_WORD + rank
        for x, _, _ in arrays.values():
            x[:] = renumber[x]
        vocabulary = FIRST_WORD + len(words)
        return {"num_classes": 2, "kind": "tokens", "vocabulary": vocabulary}


_CODECS = {"femnist": _Femnist, "shakespeare": _Shakespeare, "sent140": _Sent140}
