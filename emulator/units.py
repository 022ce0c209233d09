"""SI units for durations, rates and sizes, and the one parser of `name:key=value,...` spec strings."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

_NUMBER = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z/]*)\s*$")
_DURATION = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "min": 60.0, "h": 3600.0}
_RATE = {"": 1.0, "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9,
         "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9}
_BYTES = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_UNLIMITED = {"inf", "unlimited", "none"}


class UnitError(ValueError):
    """A value that does not parse; the message names it."""


def _split(text: str, what: str) -> tuple[float, str]:
    match = _NUMBER.match(str(text))
    if not match:
        raise UnitError(f"cannot read {what} {text!r:.40}")
    return float(match.group(1)), match.group(2)


def duration(text: str | float) -> float:
    """'20ms' -> 0.02 seconds; a bare number is seconds."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        number, unit = _split(text, "duration")
        if unit not in _DURATION:
            raise UnitError(f"unknown duration unit in {text!r} (use s, ms, us, ns, min, h)")
        value = number * _DURATION[unit]
    if not 0 <= value < math.inf:
        raise UnitError(f"duration {text!r:.40} must be finite and not negative")
    return value


def rate(text: str | float) -> float:
    """'10Mbps' -> 1e7 bit/s (SI: 1 Mbps = 10**6 bit/s); 'inf' is unlimited."""
    if isinstance(text, (int, float)):
        value = float(text)
        if value == math.inf:
            return math.inf
    elif str(text).strip().lower() in _UNLIMITED:
        return math.inf
    else:
        number, unit = _split(text, "bandwidth")
        if unit.lower() not in _RATE:
            raise UnitError(f"unknown bandwidth unit in {text!r} (use bps, kbps, Mbps, Gbps)")
        value = number * _RATE[unit.lower()]
    if not 0 < value < math.inf:  # unlimited is spelt inf: an overflow is a mistake
        raise UnitError(f"bandwidth {text!r:.40} must be positive and finite (or inf for unlimited)")
    return value


def size(text: str | int) -> int:
    """'64MB' -> 64 * 10**6 bytes; '1MiB' -> 2**20."""
    if isinstance(text, int):
        value = text
    else:
        number, unit = _split(text, "size")
        if unit.lower() not in _BYTES:
            raise UnitError(f"unknown size unit in {text!r} (use B, kB, MB, GB, KiB, MiB, GiB)")
        value = number * _BYTES[unit.lower()]
        if not value < math.inf:
            raise UnitError(f"size {text!r:.40} must be finite")
        value = int(value)
    if value <= 0:
        raise UnitError(f"size {text!r:.40} must be positive")
    return value


def probability(text: str | float) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise UnitError(f"cannot read probability {text!r:.40}") from None
    if not 0.0 <= value <= 1.0:
        raise UnitError(f"probability {text!r:.40} must be within 0..1")
    return value


class SpecError(UnitError):
    """A spec that does not read or whose keys do not fit.

    `item` is an item that is not key=value, `missing` a required key left out; None where not the fault.
    """

    def __init__(self, message: str, *, item: str | None = None, missing: str | None = None):
        super().__init__(message)
        self.item, self.missing = item, missing


@dataclass(frozen=True)
class Spec:
    """A spec string read into its name (empty for a bare key=value list) and its items, in order."""
    name: str
    items: tuple[tuple[str, str], ...]

    def keywords(self, required: tuple[str, ...] = (), optional: tuple[str, ...] = (), *,
                 usage: str) -> dict[str, str]:
        """The items as {key: value}, in the spec's order.

        A key neither required nor optional, a key given twice, or a required key left out
        raises SpecError(usage).
        """
        keys = [key for key, _ in self.items]
        if not set(keys) <= {*required, *optional} or len(set(keys)) < len(keys):
            raise SpecError(usage)
        missing = [key for key in required if key not in keys]
        if missing:
            raise SpecError(usage, missing=missing[0])
        return dict(self.items)


def read_spec(text: Any, named: bool = True, bad_item: str | None = None, separator: str = ",") -> Spec:
    """'uniform:low=1,high=2' -> Spec('uniform', (('low', '1'), ('high', '2'))).

    Not `named`, all of the text is items. Blank items are skipped; names, keys and values are stripped.
    An item that is not key=value raises SpecError: `bad_item` where given, else one quoting the item.
    """
    name, _, rest = str(text).partition(":") if named else ("", "", str(text))
    items = []
    for item in filter(None, (part.strip() for part in rest.split(separator))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise SpecError(bad_item or f"cannot read {item!r} in {text!r}: expected key=value", item=item)
        items.append((key.strip(), value.strip()))
    return Spec(name.strip(), tuple(items))
