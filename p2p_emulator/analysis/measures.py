"""What a measure is: a number per run read from its run directory, named in a study's `table: metric:`,
with its arguments after colons (`bytes_per_round:5-9`). The built-in measures are in study.py; an analysis
extension (extensions.py) adds its own with the argument parsers here."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

ROUND = "ROUND a round number or last"  # how a measure's usage explains round_or_last


@dataclass(frozen=True)
class Measure:
    """A number per run, read from its directory; `usage` shows its arguments (after colons)."""
    compute: Callable[..., float]
    usage: str
    arguments: tuple[Callable[[str], Any], ...] = ()
    optional: int = 0      # how many of the last arguments may be left out
    counted: bool = False  # 1 or 0 per run: a cell shows for how many of its runs it holds
    needs: str | None = None  # a run setting its input exists only with (trace: messages.jsonl), checked before runs
    # The study's finished runs and the arguments -> what keeps the measure from them (one line), or None.
    check: Callable[..., str | None] | None = None


def per(total: float, count: float) -> float:
    """total / count, NaN for a count of 0."""
    return total / count if count else math.nan


# -- argument parsers: each raises ValueError on a bad argument --------------------------------------------------------


def whole_number(text: str) -> int:
    """A whole number from 0."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def round_or_last(text: str) -> int | None:
    """A round number, or None for `last`."""
    return None if text == "last" else whole_number(text)


def round_range(text: str) -> range:
    """FIRST-LAST: the rounds from FIRST to LAST, inclusive."""
    first, last = (whole_number(part) for part in text.split("-"))  # ValueError unless two counts
    if last < first:
        raise ValueError(text)
    return range(first, last + 1)


def fraction(text: str) -> float:
    """A fraction in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError(text)
    return value
