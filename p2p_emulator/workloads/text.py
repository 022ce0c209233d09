"""Next-character prediction, as LEAF's Shakespeare, and the Debian `fortunes` text in that format.

Characters are LEAF's 80 (`CHARACTERS`, from its models/utils/language_utils.py) plus one id for
every other character (`UNKNOWN`, 80): LEAF looks unknown characters up as index -1, which
its embedding cannot take. A sample is 80 characters and the character after them.

`fortunes`: each topic file of the Debian package `fortunes` (/usr/share/games/fortunes, about
40 files: art, computers, food, ...) is one owner. Its fortunes, read as UTF-8 with the `%`
separator lines removed and joined by newlines, are one text. Every position gives a sample
(stride 1, as LEAF's Shakespeare), and each owner's samples are split as LEAF's
`split_data.py --by_sample` splits Shakespeare's: the first 90% train, the rest test, less the
79 test samples that would overlap the last training one. One departure: LEAF drops a user whose
test split comes out empty; here the topic stays, with training samples only (pratchett, the one
such topic), and `--partition natural` names it in a note.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

CHARACTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
UNKNOWN = len(CHARACTERS)
VOCABULARY = UNKNOWN + 1
SEQUENCE = 80
TRAIN_FRACTION = 0.9  # LEAF's default --tf

DEBIAN_FORTUNES = Path("/usr/share/games/fortunes")

_CODES = np.full(0x110000, UNKNOWN, dtype=np.uint8)
_CODES[[ord(c) for c in CHARACTERS]] = np.arange(len(CHARACTERS), dtype=np.uint8)


def encode(text: str) -> np.ndarray:
    """Character ids (uint8) of `text`."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return _CODES[points]


def next_character_samples(codes: np.ndarray, length: int = SEQUENCE) -> tuple[np.ndarray, np.ndarray]:
    """(x, y): every window of `length` ids and the id after it, in text order; x is a view of `codes`."""
    if len(codes) <= length:
        return np.empty((0, length), dtype=np.uint8), np.empty(0, dtype=np.int64)
    return np.lib.stride_tricks.sliding_window_view(codes[:-1], length), codes[length:].astype(np.int64)


def split_by_sample(count: int, length: int = SEQUENCE, fraction: float = TRAIN_FRACTION) -> tuple[slice, slice]:
    """LEAF's Shakespeare split of one owner's `count` samples: (train, test) positions, as slices (numpy
    takes views)."""
    train = max(1, int(fraction * count)) if count > 1 else count
    return slice(0, train), slice(min(count, train + length - 1), count)


def fortune_topics(root: Path) -> list[Path]:
    """The topic files of a fortunes directory: plain files next to their strfile .dat index."""
    return sorted(p for p in root.iterdir() if p.is_file() and p.with_name(p.name + ".dat").is_file())


def read_fortunes(path: Path) -> str:
    """The fortunes of one topic file, joined by newlines (the `%` separator lines dropped)."""
    text = path.read_bytes().decode("utf-8")
    return "\n".join(line for line in text.split("\n") if line != "%")
