"""Flow-level max-min fair sharing of links, uplinks and downlinks (--link-sharing fair).

FIFO links (emulator.links) send a node's messages over its uplink one after
another. TCP connections leaving one host run side by side and split its
capacity instead; this is the flow-level model of that, SimGrid's without its
TCP window and latency terms:

- A directed link carries its messages in order, one at a time, as one TCP
  connection does: the message at the head of the link's queue is the link's
  active flow, and the next starts when that one's transmission ends.
- Active flows share capacity max-min fairly. A flow's rate is at most its
  link's bandwidth; the active flows leaving a node share its uplink; those
  entering a node share its downlink; an infinite capacity constrains nothing.
  With --link-overhead tcp a flow's ACKs draw on its receiver's uplink and its
  sender's downlink too, at their share of its rate (66 bytes per two segments
  of 1514: 2.2%): a node receiving at full rate has that much less to send with.
  The rates are progressive filling's (water-filling): all rates rise together,
  and a flow's stops when its link's bandwidth or a capacity it draws on is
  used up.
- Rates are recomputed whenever a flow starts or ends, over the flows joined to
  it through shared capacities (no other rate can change); flows that start at
  one instant (a broadcast) are shared out once, at the end of that instant,
  as no time passes in between. Each of those flows' bits left first advance
  by rate x elapsed time; a flow whose rate changes gets a new end event with a
  new version, and the event it had does nothing when it comes (clock events
  cannot be cancelled).
- A flow that has sent its bits ends: its owner is told (emulator.network: the
  message arrives a latency sample later, never before the one ahead of it on
  the link; the downlink keeps no queue of its own, its share is in the rates),
  and the link's next message starts.

Floating point: rates and bits are plain floats. A flow alone ends at exactly
start + bits/rate, as a FIFO link's message does. When a flow ends, the flows
joined to it whose bits left are rounding of zero (at most FINISHED of their
size) end with it: k equal flows started together end together, at one instant.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any, Callable, Collection, Iterable

from .links import Capacity, Link

FINISHED = 1e-9  # bits left, as a fraction of a flow's size, that are rounding of rate x time, not data


class Flow:
    """One message's transmission on its link, and what its owner needs when it ends."""
    __slots__ = ("link", "bits", "left", "rate", "start", "updated", "end", "version", "capacities", "weights",
                 "message", "latency")

    def __init__(self, link: Link, bits: float, message: Any, latency: float | None,
                 acks: tuple[Capacity, Capacity, float] | None = None):
        self.link, self.bits, self.left = link, bits, bits
        self.message, self.latency = message, latency  # the owner's: what arrives, and how long after the end
        self.rate = 0.0  # until it starts
        self.start = self.updated = self.end = 0.0
        self.version = 0
        # The shared capacities it draws on, and how much of each per bit/s of its rate: its bits on the sender's
        # uplink and the receiver's downlink, and `acks` = (receiver's uplink, sender's downlink, ACK bits per
        # bit) for the ACKs coming back. An infinite capacity constrains nothing.
        uses = [(link.up, 1.0), (link.down, 1.0)] + ([(acks[0], acks[2]), (acks[1], acks[2])] if acks else [])
        used = [(capacity, weight) for capacity, weight in uses if capacity.rate != math.inf]
        self.capacities = tuple(capacity for capacity, _ in used)
        self.weights = tuple(weight for _, weight in used)


class FairSharing:
    """The links' queues, their active flows, and the rates those share.

    `turn(flow, now)` says whether a flow that waited behind others on its link may start now (its
    sender may have gone offline meanwhile); `ended(flow, now)` is told each flow that sent its bits.
    """

    def __init__(self, clock, turn: Callable[[Flow, float], bool], ended: Callable[[Flow, float], None]):
        self.clock, self.turn, self.ended = clock, turn, ended
        self.queues: dict[Link, deque[Flow]] = {}  # a busy link's flows, its active one first
        # Each finite capacity's active flows; dicts keep them in start order, so runs repeat exactly.
        self.active: dict[Capacity, dict[Flow, None]] = {}
        self.starting: list[Flow] = []  # flows started at this instant, not shared out yet
        self._end_event, self._settle_event = self._end, self._settle  # bound once, not per event

    def send(self, flow: Flow) -> None:
        """Put a flow on its link: it starts now if the link is idle, else it waits its turn."""
        queue = self.queues.get(flow.link)
        if queue is not None:
            queue.append(flow)
            return
        self.queues[flow.link] = deque((flow,))
        now = self.clock.now
        self._attach(flow, now)
        if not self.starting:
            self.clock.schedule(now, self._settle_event)
        self.starting.append(flow)

    def _settle(self) -> None:
        """Share capacity anew among the flows that started at this instant and those joined to them."""
        starting, self.starting = self.starting, []
        # One may have ended already (zero bits, finished with a flow that ended at this instant).
        self._share(self._joined(flow for flow in starting if self._active(flow)), self.clock.now)

    def _active(self, flow: Flow) -> bool:
        queue = self.queues.get(flow.link)
        return queue is not None and queue[0] is flow

    def _end(self, flow: Flow, version: int) -> None:
        if version != flow.version:
            return  # its rate changed since this event was set: a later one ends it
        now = flow.end  # the model's instant, even if a wall clock fires late
        joined = self._joined([flow])
        _advance(joined, now)
        done = [other for other in joined if other is flow or other.left <= FINISHED * other.bits]
        for other in done:
            self._detach(other)
            del joined[other]
        for other in done:
            self.ended(other, now)
            following = self._next(other.link, now)
            if following is not None:
                # Same link, same capacities: every flow it shares them with is in `joined` already.
                joined[following] = None
        self._share(joined, now)

    def _next(self, link: Link, now: float) -> Flow | None:
        """Start the next flow of a link whose active flow ended; None when the link falls idle."""
        queue = self.queues[link]
        queue.popleft()
        while queue:
            flow = queue[0]
            if self.turn(flow, now):
                self._attach(flow, now)
                return flow
            queue.popleft()  # it never leaves (sender offline, link down); the one behind it may
        del self.queues[link]
        return None

    def _attach(self, flow: Flow, now: float) -> None:
        flow.start = flow.updated = now
        for capacity in flow.capacities:
            self.active.setdefault(capacity, {})[flow] = None

    def _detach(self, flow: Flow) -> None:
        flow.version += 1  # an end event it still has does nothing
        for capacity in flow.capacities:
            flows = self.active[capacity]
            del flows[flow]
            if not flows:
                del self.active[capacity]

    def _joined(self, flows: Iterable[Flow]) -> dict[Flow, None]:
        """The flows given and every active flow joined to them through shared capacities, in a repeatable
        order: the only flows whose rates a change among the given ones can move."""
        found = dict.fromkeys(flows)
        pending, seen = list(found), set()
        while pending:
            for capacity in pending.pop().capacities:
                if capacity not in seen:
                    seen.add(capacity)
                    for other in self.active[capacity]:
                        if other not in found:
                            found[other] = None
                            pending.append(other)
        return found

    def _share(self, flows: Collection[Flow], now: float) -> None:
        """Advance the flows to now, give them their max-min fair rates, and set a new end event for each
        flow whose rate changed (one whose rate stays keeps its event: its end has not moved)."""
        _advance(flows, now)
        for flow, rate in fair_rates(flows, self.active).items():
            if rate != flow.rate:
                flow.rate, flow.version = rate, flow.version + 1
                flow.end = now + flow.left / rate
                self.clock.schedule(flow.end, self._end_event, flow, flow.version)


def _advance(flows: Iterable[Flow], now: float) -> None:
    """Take the bits each flow sent since its last update off what it has left."""
    for flow in flows:
        if now > flow.updated:  # no time passed, no bits (an unbounded rate x 0 would be nan)
            flow.left = max(0.0, flow.left - flow.rate * (now - flow.updated))
            flow.updated = now


def fair_rates(flows: Collection[Flow], active: dict[Capacity, dict[Flow, None]]) -> dict[Flow, float]:
    """Max-min fair rates by progressive filling, for flows that include every active flow on their capacities.

    All rates rise together from zero: the level. A flow stops at its link's bandwidth when the level reaches
    it; when a capacity is used up (the level reaches what the stopped flows left of it over the weight of the
    flows still rising on it: a flow draws weight x rate, 1 for its bits, its ACK share for its ACKs), its
    flows still rising stop there. A heap of the capacities' shares finds each next level: the cost is
    (flows + capacities) x log(capacities).
    """
    left: dict[Capacity, float] = {}  # what the stopped flows left of each capacity
    rising: dict[Capacity, int] = {}  # how many of its flows still rise
    weight: dict[Capacity, float] = {}  # what they draw on it per unit of the level
    for flow in flows:
        for capacity, w in zip(flow.capacities, flow.weights):
            left[capacity] = capacity.rate
            rising[capacity] = rising.get(capacity, 0) + 1
            weight[capacity] = weight.get(capacity, 0.0) + w
    order = {capacity: i for i, capacity in enumerate(left)}  # equal shares go in a repeatable order
    shares = [(left[capacity] / weight[capacity], order[capacity], capacity) for capacity in left]
    heapq.heapify(shares)
    rates: dict[Flow, float] = {}
    changed: dict[Capacity, None] = {}  # capacities whose share the flows stopped in this step moved

    def stop(flow: Flow, rate: float) -> None:
        rates[flow] = rate
        for capacity, w in zip(flow.capacities, flow.weights):
            left[capacity] -= w * rate
            rising[capacity] -= 1
            weight[capacity] -= w
            changed[capacity] = None

    def share(capacity: Capacity) -> float:
        return max(0.0, left[capacity]) / weight[capacity]

    def tightest() -> tuple[float, Capacity | None]:
        """The lowest share of a capacity with flows still rising (entries a stop has changed are dropped)."""
        for capacity in changed:
            if rising[capacity]:
                heapq.heappush(shares, (share(capacity), order[capacity], capacity))
        changed.clear()
        while shares:
            level, _, capacity = shares[0]
            if rising[capacity] and level == share(capacity):
                return level, capacity
            heapq.heappop(shares)
        return math.inf, None

    by_bandwidth = sorted(flows, key=lambda flow: flow.link.bandwidth)
    capped = 0  # by_bandwidth[:capped] have reached their bandwidth, or stopped below it
    while len(rates) < len(by_bandwidth):
        level, capacity = tightest()
        if capped < len(by_bandwidth) and by_bandwidth[capped].link.bandwidth <= level:
            flow = by_bandwidth[capped]
            capped += 1
            if flow not in rates:
                stop(flow, flow.link.bandwidth)
            continue
        for flow in active[capacity]:
            if flow not in rates:
                stop(flow, level)
    return rates
