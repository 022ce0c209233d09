"""--timeout auto: a node waits for messages as long as what its links have taken says, as TCP's
retransmission timer does (RFC 6298), plus the compute its peers may still be doing.

A sample R is a message's time in transit, from its send to its arrival, taken for every message
a wait of the node collects, and for one that comes after its wait gave up (stale then, and dropped
unseen). How long a peer computes, or stays offline, is not the network's: a returning node's old
message says nothing of the links, and the protocol adds the longest round of compute itself.

    first sample:  SRTT = R, RTTVAR = R / 2
    then:          RTTVAR <- 3/4 RTTVAR + 1/4 |SRTT - R|;  SRTT <- 7/8 SRTT + 1/8 R
    timeout:       SRTT + 4 RTTVAR, at least MINIMUM (RFC 6298's 1 s), at most CEILING;  MINIMUM before any sample

A protocol asks for `Adaptive()` (times k, plus s seconds: `k * wait + s`): the node's timeout, k times
over, s seconds more (a round of compute the protocol knows it waits for).
"""
from __future__ import annotations

from dataclasses import dataclass

MINIMUM = 1.0  # s: RFC 6298's least timeout, and its first before any sample
CEILING = 60.0  # s: the most (the fixed --timeout's old default)


@dataclass(frozen=True, slots=True)
class Adaptive:
    """A wait of `times` the node's timeout plus `extra` seconds."""
    times: float = 1.0
    extra: float = 0.0

    def __mul__(self, k: float) -> Adaptive:
        return Adaptive(self.times * k, self.extra * k)

    __rmul__ = __mul__

    def __add__(self, other: float | Adaptive) -> Adaptive:
        if isinstance(other, Adaptive):  # two waits one after the other
            return Adaptive(self.times + other.times, self.extra + other.extra)
        return Adaptive(self.times, self.extra + other)

    __radd__ = __add__

    def __str__(self) -> str:
        scaled = "auto" if self.times == 1 else f"{self.times:g} x auto"
        return f"{scaled} + {self.extra:g} s" if self.extra else scaled


class Timer:
    """One node's estimate of how long its messages take in transit."""
    __slots__ = ("srtt", "rttvar")

    def __init__(self):
        self.srtt: float | None = None
        self.rttvar = 0.0

    def timeout(self) -> float:
        if self.srtt is None:
            return MINIMUM
        return min(CEILING, max(MINIMUM, self.srtt + 4 * self.rttvar))

    def observe(self, sample: float) -> None:
        sample = max(0.0, sample)
        if self.srtt is None:
            self.srtt, self.rttvar = sample, sample / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - sample)
            self.srtt = 0.875 * self.srtt + 0.125 * sample

    def state(self) -> list:
        return [self.srtt, self.rttvar]

    def load_state(self, state: list) -> None:
        self.srtt, self.rttvar = state
