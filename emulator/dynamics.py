"""Network dynamics: node churn, crashes and availability traces; link failures and partitions;
time-varying topologies.

Every random choice comes from a generator of its own, derived from the seed and the node
(or edge) it concerns, so the same seed and scenario give the same faults whatever the traffic.

What they mean for a run:
- An offline node's messages, and messages arriving at it, are dropped with cause `offline`.
  `Node.compute` waits until the node is online, and compute time that overlaps an outage
  does not count: the job finishes later by that much. A node that comes back carries on
  from where it was (same round, same state).
- A crashed node (--crash, or a trace outage that never ends) is offline for good:
  its coroutine is cancelled at the crash, its unfinished round leaves no row, and
  rounds close without it.
- A link failure or a partition drops a message at send with cause `link_down`; its
  bytes count as sent, as for a loss.
- A message already on the wire is delivered when its sender goes offline, its edge
  fails or its edge leaves a time-varying graph after the send: its bits had left.
  (It is still dropped if its receiver is offline when it arrives.) A message still
  queued at its sender (behind earlier ones on a busy link or uplink) when the sender
  goes offline or the edge fails never leaves: it drops when its turn comes, cause
  `offline` or `link_down`, its bytes counted as sent, as for a loss.
Churn keeps scheduling events for as long as the run lasts, so with churn a protocol
that waits without a timeout on a peer that never sends hangs instead of raising
DeadlockError; every shipped protocol waits with a timeout.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .seeds import numpy_generator, numpy_state


@dataclass(frozen=True)
class Churn:
    """Each node alternates up and down periods drawn from exponentials with these means."""
    up: float
    down: float
    immune: float = 0.0


@dataclass(frozen=True)
class Crash:
    fraction: float
    time: float


@dataclass(frozen=True)
class LinkFailures:
    """Each edge alternates up and down periods drawn from exponentials with these means."""
    up: float
    down: float


@dataclass(frozen=True)
class Partition:
    """From `start` until `heal`, messages between nodes of different groups are dropped."""
    start: float
    heal: float
    groups: tuple[tuple[int, ...], ...]

    def group_of(self, n: int) -> list[int]:
        """Each node's group; the nodes no group names form one more group."""
        of = [len(self.groups)] * n
        for index, group in enumerate(self.groups):
            for node in group:
                of[node] = index
        return of


@dataclass
class Scenario:
    """Every fault and change of a run, checked against its node count (p2p_emulator/scenario.py builds it)."""
    num_nodes: int
    churn: Churn | None = None
    crash: Crash | None = None
    outages: list[tuple[int, float, float]] = field(default_factory=list)
    link_failures: LinkFailures | None = None
    partitions: tuple[Partition, ...] = ()
    schedule: Any = None

    @property
    def nodes_change(self) -> bool:
        return bool(self.churn or self.crash or self.outages)

    @property
    def links_change(self) -> bool:
        return bool(self.link_failures or self.partitions)


# -- nodes going down and up ----------------------------------------------------------

_CHURN = ("_churn_down", "_churn_up")  # the transitions whose args are (node, the node's churn generator)


def _saved_args(transition: str, args: tuple) -> list:
    """A pending transition's args as plain data."""
    if transition in _CHURN:
        node, rng = args
        return [node, numpy_state(rng)]
    return list(args)


def _restored_args(transition: str, saved: list) -> list:
    if transition in _CHURN:
        node, rng = saved
        return [node, numpy_generator(rng)]
    return saved


class Availability:
    """Drives Network.online from the scenario's outages, as clock events.

    Outages from several sources (churn, trace, crash) may overlap: a node is online
    when none holds it down. `intervals[i]` lists node i's offline spells [t_down, t_up]
    (t_up None while it lasts).
    """

    def __init__(self, scenario: Scenario, online: list[bool], clock, seeds):
        self.scenario, self.online, self.clock, self.seeds = scenario, online, clock, seeds
        self.on_crash: Callable[[int], None] = lambda node: None  # the emulation ends the node's coroutine
        n = scenario.num_nodes
        self._holds = [0] * n
        self.intervals: list[list[list]] = [[] for _ in range(n)]
        self.crashed: set[int] = set()
        self._waiters: dict[int, list] = defaultdict(list)

    def start(self) -> None:
        """Put the outages on the clock; call it from inside the running loop."""
        s = self.scenario
        for node, t_down, t_up in s.outages:
            if t_up == math.inf:  # never back: a crash
                self._at(t_down, self._crash, [node])
            else:
                self._at(t_down, self._down, node)
                self._at(t_up, self._up, node)
        if s.churn:
            for node in self._churning(s.churn):
                rng = self.seeds.numpy("churn", node)
                self._at(rng.exponential(s.churn.up), self._churn_down, node, rng)
        if s.crash:
            rng = self.seeds.numpy("crash")
            chosen = rng.choice(s.num_nodes, size=round(s.crash.fraction * s.num_nodes), replace=False)
            self._at(s.crash.time, self._crash, sorted(int(node) for node in chosen))

    def _churning(self, churn: Churn) -> list[int]:
        n = self.scenario.num_nodes
        immune = self.seeds.numpy("churn.immune").choice(n, size=round(churn.immune * n), replace=False)
        return sorted(set(range(n)) - {int(node) for node in immune})

    def _at(self, when: float, callback: Callable, *args) -> None:
        if when <= self.clock.now:  # e.g. down from t=0: before any node sends
            callback(*args)
        else:
            self.clock.schedule(when, callback, *args)

    def _down(self, node: int) -> None:
        self._holds[node] += 1
        if self._holds[node] == 1:
            self.online[node] = False
            self.intervals[node].append([self.clock.now, None])

    def _up(self, node: int) -> None:
        self._holds[node] -= 1
        if self._holds[node] == 0:
            self.online[node] = True
            self.intervals[node][-1][1] = self.clock.now
            for waiter in self._waiters.pop(node, ()):
                if not waiter.done():
                    waiter.set_result(None)

    def _churn_down(self, node: int, rng) -> None:
        if node not in self.crashed:
            self._down(node)
            self.clock.schedule(self.clock.now + rng.exponential(self.scenario.churn.down), self._churn_up, node, rng)

    def _churn_up(self, node: int, rng) -> None:
        if node not in self.crashed:
            self._up(node)
            self.clock.schedule(self.clock.now + rng.exponential(self.scenario.churn.up), self._churn_down, node, rng)

    def _crash(self, nodes: list[int]) -> None:
        for node in nodes:
            if node in self.crashed:  # a trace and --crash may both end it
                continue
            self.crashed.add(node)
            self._down(node)
            self.on_crash(node)

    def state(self) -> dict:
        """Who is down and why, the offline spells so far, and its transitions still on the clock (by name,
        with the churn generators they draw from), as plain data."""
        names = {transition: name for name, transition in self._transitions().items()}
        pending = [[when, names[callback], _saved_args(names[callback], args)]
                   for when, callback, args in self.clock.pending() if callback in names]
        return {"holds": list(self._holds), "online": list(self.online), "intervals": self.intervals,
                "crashed": sorted(self.crashed), "pending": pending}

    def load_state(self, state: dict) -> None:
        """Put a saved state back, its transitions back on the clock; instead of start()."""
        self._holds[:] = state["holds"]
        self.online[:] = state["online"]
        self.intervals[:] = state["intervals"]
        self.crashed.update(state["crashed"])
        transitions = self._transitions()
        for when, name, args in state["pending"]:
            self.clock.schedule(when, transitions[name], *_restored_args(name, args))

    def _transitions(self) -> dict[str, Callable]:
        """The clock events it schedules, by the names a checkpoint gives them (its methods' names, as the
        checkpoint files have always held them)."""
        return {"_down": self._down, "_up": self._up, "_churn_down": self._churn_down, "_churn_up": self._churn_up,
                "_crash": self._crash}

    async def until_online(self, node: int) -> None:
        while not self.online[node]:
            waiter = self.clock.loop.create_future()
            self._waiters[node].append(waiter)
            await waiter

    def offline_time(self, node: int, start: float, end: float) -> float:
        """Seconds node spent offline within [start, end]."""
        total = 0.0
        for t_down, t_up in reversed(self.intervals[node]):
            t_up = end if t_up is None else t_up
            if t_up <= start:
                break
            total += max(0.0, min(end, t_up) - max(start, t_down))
        return total

    def rows(self) -> list[dict]:
        """availability.jsonl: one row per offline spell; t_up null if it had not ended by the end of the run."""
        spells = [(t_down, node, t_up) for node, spells in enumerate(self.intervals) for t_down, t_up in spells]
        return [{"node": node, "t_down": t_down, "t_up": t_up} for t_down, node, t_up in sorted(spells)]


# -- links going down ---------------------------------------------------------------------

class LinkFaults:
    """Whether the edge between two nodes is down now: a failure of its own, or a partition.

    Failures are per node pair (both directions fail together), each pair an up/down
    Markov chain with exponential periods, starting up at t=0 and advanced lazily.
    """

    def __init__(self, scenario: Scenario, seeds):
        self.failures, self.seeds = scenario.link_failures, seeds
        self.partitions = [(p.start, p.heal, p.group_of(scenario.num_nodes)) for p in scenario.partitions]
        self._edges: dict[tuple[int, int], EdgeFaults] = {}

    def state(self) -> list:
        """Each faulty edge's chain so far, as plain data."""
        return [[u, v, edge.down, edge.next_change, numpy_state(edge.rng)] for (u, v), edge in self._edges.items()]

    def load_state(self, state: list) -> None:
        for u, v, down, next_change, rng in state:
            self._edges[u, v] = EdgeFaults(down, next_change, numpy_generator(rng))

    def down(self, src: int, dst: int, now: float) -> bool:
        for start, heal, group in self.partitions:
            if start <= now < heal and group[src] != group[dst]:
                return True
        return self.failures is not None and self._failed(min(src, dst), max(src, dst), now)

    def _failed(self, u: int, v: int, now: float) -> bool:
        edge = self._edges.get((u, v))
        if edge is None:
            rng = self.seeds.numpy("link.failures", u, v)
            edge = self._edges[u, v] = EdgeFaults(False, rng.exponential(self.failures.up), rng)
        while edge.next_change <= now:
            edge.down = not edge.down
            edge.next_change += edge.rng.exponential(self.failures.down if edge.down else self.failures.up)
        return edge.down


@dataclass(slots=True)
class EdgeFaults:
    """One node pair's failure chain: whether it is down, when that next changes, its generator."""
    down: bool
    next_change: float
    rng: np.random.Generator
