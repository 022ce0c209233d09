"""Directed links: latency, bandwidth, loss, corruption, and the per-node capacity they share.

A link sends FIFO, one message at a time (message-level store and forward):
transmission takes 8*bytes/rate, where rate is the link bandwidth capped by the
sender's uplink, and the sender's uplink is itself one FIFO shared by all its
links. Arrival is the end of transmission plus a latency sample, never
overtaking the previous message on the link. A receiver with a downlink
capacity takes delivery no faster than that capacity allows. Corruption flips
bits of a frame that arrives. (--link-sharing fair replaces the FIFO capacities
with max-min fair sharing among the links' head messages: emulator.sharing.)

A link times the bytes on its wire: the payload alone, or with --link-overhead
tcp the payload plus 66 header bytes (20 IP, 32 TCP with timestamps, 14
Ethernet: what a tc shaper on an Ethernet device counts) per 1448-byte segment
of a 1500-byte MTU. Its receiver then sends a 66-byte ACK for every second
segment: counted in wire_bytes, and, under fair sharing, drawing on the
receiver's uplink (and the sender's downlink) beside the data.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .recovery import Window, transfer
from .seeds import numpy_generator, numpy_state, random_state, set_random_state


class Delay:
    """Latency model; every sample is >= 0."""

    def __init__(self, kind: str, **params: float):
        self.kind, self.params = kind, params
        self.draws = kind != "constant"  # whether a sample takes random numbers
        draw = getattr(self, f"_{kind}")
        # A constant needs no draw: the common case stays cheap.
        self.sample = (lambda rng: params["value"]) if kind == "constant" else (
            lambda rng: max(0.0, draw(rng, **params)))

    @staticmethod
    def _constant(rng, value):
        return value

    @staticmethod
    def _uniform(rng, low, high):
        return rng.uniform(low, high)

    @staticmethod
    def _normal(rng, mean, std):
        return rng.gauss(mean, std)

    @staticmethod
    def _lognormal(rng, median, sigma):
        return median * math.exp(rng.gauss(0.0, sigma))

    def __repr__(self):
        return f"Delay({self.kind}, {self.params})"


class Bernoulli:
    """Each message is lost independently with probability p."""

    def __init__(self, p: float):
        self.p = p
        self.draws = p > 0

    def lost(self, rng: random.Random, link: Link) -> bool:
        return self.p > 0 and rng.random() < self.p


class GilbertElliott:
    """Two-state bursty loss: good->bad with p, bad->good with r.

    In the bad state a message is lost with `loss_bad`, in the good state with
    `loss_good`; with the defaults a burst lasts 1/r messages on average.
    """

    def __init__(self, p: float, r: float, loss_good: float = 0.0, loss_bad: float = 1.0):
        self.p, self.r, self.loss_good, self.loss_bad = p, r, loss_good, loss_bad
        self.draws = True

    def lost(self, rng: random.Random, link: Link) -> bool:
        bad = link.loss_bad = (rng.random() >= self.r) if link.loss_bad else (rng.random() < self.p)
        return rng.random() < (self.loss_bad if bad else self.loss_good)


class Corruption:
    """Bit flips in an arriving frame: one bit with probability `p` per message, or
    each bit independently with probability `ber` (a bit error rate)."""

    def __init__(self, p: float = 0.0, ber: float = 0.0):
        self.p, self.ber = p, ber
        self.draws = p > 0 or ber > 0

    def bits(self, rng, nbytes: int) -> list[int]:
        """Which bits of an nbytes frame flip (none, usually)."""
        nbits = 8 * nbytes
        if self.ber > 0:
            count = int(rng.binomial(nbits, self.ber))
            return [int(bit) for bit in rng.choice(nbits, count, replace=False)] if count else []
        return [int(rng.integers(nbits))] if nbits and rng.random() < self.p else []

    def __repr__(self):
        return f"Corruption(p={self.p}, ber={self.ber})"


NO_CORRUPTION = Corruption()


TCP_SEGMENT = 1448  # payload bytes of a full segment: a 1500-byte MTU less IP, TCP and its timestamps option
TCP_HEADERS = 66  # per segment on an Ethernet device: 20 IP + 32 TCP + 14 Ethernet


def tcp_wire_bytes(nbytes: int) -> int:
    """The bytes a message of nbytes payload puts on an Ethernet wire as TCP segments."""
    return nbytes + -(-nbytes // TCP_SEGMENT) * TCP_HEADERS


def tcp_ack_bytes(nbytes: int) -> int:
    """The bytes of the ACKs a receiver sends back for nbytes of payload: one 66-byte ACK (headers alone) for
    every second segment, as Linux's delayed ACKs do on a steady transfer."""
    return -(-nbytes // (2 * TCP_SEGMENT)) * TCP_HEADERS


# --loss-model: a lossy link loses whole messages (datagram), or segments that are sent again (reliable)
LOSS_MODELS = ("datagram", "reliable")

# --link-overhead: the wire size of a payload and of its ACKs on the way back (None: the payload itself, no ACKs)
OVERHEADS = {"none": None, "tcp": tcp_wire_bytes}
ACKS = {"none": None, "tcp": tcp_ack_bytes}


@dataclass
class LinkSpec:
    """What a link is configured with, before it carries anything."""
    latency: Delay
    bandwidth: float
    loss: Bernoulli | GilbertElliott
    corrupt: Corruption = NO_CORRUPTION


class Capacity:
    """A node's uplink or downlink: one FIFO shared by all of its links (fair sharing: its rate, split
    among its links' flows)."""
    __slots__ = ("rate", "free_at")

    def __init__(self, rate: float):
        self.rate, self.free_at = rate, 0.0


class Link:
    __slots__ = ("src", "dst", "latency", "bandwidth", "loss", "corrupt", "draws", "_rng", "_corrupt_rng", "_seeds",
                 "loss_bad", "free_at", "last_start", "last_arrival", "up", "down", "counters", "window", "resent")

    def __init__(self, src: int, dst: int, spec: LinkSpec, seeds, up: Capacity, down: Capacity,
                 counters: list[int] | None = None, reliable: bool = False):
        self.src, self.dst = src, dst
        self.counters = counters  # this link's row of the ledger
        self.latency, self.bandwidth, self.loss, self.corrupt = spec.latency, spec.bandwidth, spec.loss, spec.corrupt
        self.draws = spec.latency.draws or spec.loss.draws
        self._rng, self._seeds = None, seeds  # the run's Seeds: the link's stream is ("link", src, dst)
        self._corrupt_rng = None  # a stream of its own: corruption leaves loss and delay draws as they were
        self.loss_bad = False  # the loss channel's state between messages: bad (bursty) or good
        self.free_at = self.last_start = 0.0
        self.last_arrival = 0.0
        self.up, self.down = up, down
        # Reliable transport (emulator.recovery): lost segments are sent again; None: whole messages are lost.
        self.window = Window() if reliable and spec.loss.draws else None
        self.resent = 0  # payload bytes the last message sent again

    @property
    def rng(self) -> random.Random:
        """The link's own generator, so its fate does not depend on traffic elsewhere.

        Made on first use: a link with a constant delay and no loss (draws False) never needs one.
        """
        if self._rng is None:
            self._rng = self._seeds.python("link", self.src, self.dst)
        return self._rng

    def damage(self, frame: bytes) -> bytearray | None:
        """A copy of an arriving frame with the corruption model's bit flips; None if it arrives intact.

        The frame itself is never touched: a broadcast's receivers share it.
        """
        if self._corrupt_rng is None:
            self._corrupt_rng = self._seeds.numpy("link.corrupt", self.src, self.dst)
        bits = self.corrupt.bits(self._corrupt_rng, len(frame))
        if not bits:
            return None
        damaged = bytearray(frame)
        for bit in bits:
            damaged[bit >> 3] ^= 1 << (bit & 7)
        return damaged

    def state(self) -> list:
        """Its queue's times, loss state, generators (None: not made yet) and ledger row, as plain data."""
        return [self.free_at, self.last_start, self.last_arrival, self.loss_bad, random_state(self._rng),
                numpy_state(self._corrupt_rng), list(self.counters)] + (
            [self.window.state()] if self.window is not None else [])

    def load_state(self, state: list) -> None:
        self.free_at, self.last_start, self.last_arrival, self.loss_bad, rng, corrupt, counters, *window = state
        if window:
            self.window.load_state(window[0])
        if rng is not None:
            set_random_state(self.rng, rng)
        if corrupt is not None:
            self._corrupt_rng = numpy_generator(corrupt)
        self.counters[:] = counters  # the ledger's row: the ledger holds the same list

    def fate(self) -> float | None:
        """A message's way over the link, drawn when it is put on the link: its latency sample, or None when
        it is lost (the loss draw comes first; a reliable link loses segments instead: `recover`)."""
        rng = self.rng if self.draws else None
        if self.loss.draws and self.window is None and self.loss.lost(rng, self):
            return None
        return self.latency.sample(rng)

    def recover(self, payload: int, sending: float, latency: float) -> float:
        """A reliable link: how long a message whose loss-free transmission takes `sending` holds the link, its
        lost segments sent again (their payload bytes: `resent`)."""
        took, self.resent = transfer(self.window, payload, TCP_SEGMENT, sending, 2 * latency, self.loss.lost, self)
        return took

    def arrival(self, end: float, latency: float) -> float:
        """When a message whose transmission ended at `end` arrives: never before the one ahead of it."""
        self.last_arrival = max(end + latency, self.last_arrival)
        return self.last_arrival

    def transmit(self, now: float, nbytes: int, payload: int | None = None) -> float | None:
        """Occupy the link (FIFO) for a message of nbytes on the wire (`payload` of them its own); return its
        arrival time, or None when it is lost."""
        up = self.up
        rate = min(self.bandwidth, up.rate)
        start = self.last_start = max(now, self.free_at, up.free_at)
        end = start + 8.0 * nbytes / rate if rate != math.inf else start
        self.free_at = end
        if up.rate != math.inf:
            up.free_at = end
        latency = self.fate()
        if latency is None:
            return None
        if self.window is not None:
            payload = nbytes if payload is None else payload
            self.free_at = end = start + self.recover(payload, end - start, latency)
            if up.rate != math.inf and payload:  # the uplink carries the bits, resent ones too, not the waits
                up.free_at = start + (up.free_at - start) * (1 + self.resent / payload)
        arrival = self.arrival(end, latency)
        down = self.down
        if down.rate != math.inf:
            arrival = max(arrival, down.free_at + 8.0 * nbytes / down.rate)
            down.free_at = arrival
        return arrival
