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

import csv
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

import topologies
from topologies.files import numbered_lines

from . import units
from .errors import UsageError
from .seeds import Seeds

NONE = ("", "none", "off", "0")


class ScenarioError(UsageError):
    """A bad churn, crash, availability, link-failure, partition or schedule setting."""


def _off(text: Any) -> bool:
    return text is None or str(text).strip().lower() in NONE


def _params(text: str, flag: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, str]:
    params = {}
    for item in filter(None, (part.strip() for part in str(text).split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in required + optional or key in params:
            raise ScenarioError(f"--{flag} {text!r}: expected {_syntax(required, optional)}")
        params[key] = value.strip()
    missing = [key for key in required if key not in params]
    if missing:
        raise ScenarioError(f"--{flag} {text!r}: missing {missing[0]}= (expected {_syntax(required, optional)})")
    return params


def _syntax(required, optional) -> str:
    return ",".join(f"{k}=.." for k in required) + "".join(f"[,{k}=..]" for k in optional)


def _period(text: str, flag: str, key: str) -> float:
    try:
        value = units.duration(text)
    except units.UnitError as exc:
        raise ScenarioError(f"--{flag}: {key}: {exc}") from None
    if not value > 0:
        raise ScenarioError(f"--{flag}: {key} must be a positive duration, got {text!r}")
    return value


# -- parsing ------------------------------------------------------------------------

@dataclass(frozen=True)
class Churn:
    """Each node alternates up and down periods drawn from exponentials with these means."""
    up: float
    down: float
    immune: float = 0.0


def parse_churn(text: str) -> Churn | None:
    """'up=60s,down=30s[,immune=0.1]'; none: no churn."""
    if _off(text):
        return None
    params = _params(text, "churn", ("up", "down"), ("immune",))
    try:
        immune = units.probability(params.get("immune", 0))
    except units.UnitError as exc:
        raise ScenarioError(f"--churn: immune: {exc}") from None
    return Churn(_period(params["up"], "churn", "up"), _period(params["down"], "churn", "down"), immune)


@dataclass(frozen=True)
class Crash:
    fraction: float
    time: float


def parse_crash(text: str) -> Crash | None:
    """'FRACTION@TIME', e.g. 0.5@100s; none: no crash."""
    if _off(text):
        return None
    fraction, at, time = str(text).partition("@")
    try:
        if not at:
            raise units.UnitError("expected FRACTION@TIME, e.g. 0.5@100s")
        return Crash(units.probability(fraction.strip()), units.duration(time.strip()))
    except units.UnitError as exc:
        raise ScenarioError(f"--crash {text!r}: {exc}") from None


@dataclass(frozen=True)
class LinkFailures:
    """Each edge alternates up and down periods drawn from exponentials with these means."""
    up: float
    down: float


def parse_link_failures(text: str) -> LinkFailures | None:
    """'up=..,down=..'; none: links never fail."""
    if _off(text):
        return None
    params = _params(text, "link-failures", ("up", "down"))
    return LinkFailures(_period(params["up"], "link-failures", "up"), _period(params["down"], "link-failures", "down"))


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


def parse_partitions(text: str, n: int | None = None) -> tuple[Partition, ...]:
    """'t=100s:groups=0-4|5-9[:heal=200s]', several separated by ';'. Node ids are checked against n if given."""
    if _off(text):
        return ()
    return tuple(_partition(event.strip(), n) for event in str(text).split(";") if event.strip())


def _partition(event: str, n: int | None) -> Partition:
    flag = f"--partition-event {event!r}"
    fields = {}
    for part in event.split(":"):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in ("t", "groups", "heal") or key in fields:
            raise ScenarioError(f"{flag}: expected t=TIME:groups=A|B[:heal=TIME], e.g. t=100s:groups=0-4|5-9:heal=200s")
        fields[key] = value.strip()
    if "t" not in fields or "groups" not in fields:
        raise ScenarioError(f"{flag}: needs t= and groups=")
    try:
        start = units.duration(fields["t"])
        heal = units.duration(fields["heal"]) if "heal" in fields else math.inf
    except units.UnitError as exc:
        raise ScenarioError(f"{flag}: {exc}") from None
    if heal <= start:
        raise ScenarioError(f"{flag}: heal must come after t")
    groups = tuple(_group(flag, group, n) for group in fields["groups"].split("|"))
    seen: dict[int, int] = {}
    for index, group in enumerate(groups):
        for node in group:
            if seen.setdefault(node, index) != index:
                raise ScenarioError(f"{flag}: node {node} is in two groups")
    return Partition(start, heal, groups)


def _group(flag: str, text: str, n: int | None) -> tuple[int, ...]:
    nodes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        low, dash, high = item.partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise ScenarioError(f"{flag}: bad group member {item!r}: use node ids and ranges like 0-4,7") from None
        if first < 0 or last < first:
            raise ScenarioError(f"{flag}: bad range {item!r}")
        if n is not None and last >= n:
            raise ScenarioError(f"{flag}: node {last} does not exist (nodes are 0..{n - 1})")
        nodes.extend(range(first, last + 1))
    if not nodes:
        raise ScenarioError(f"{flag}: empty group in groups=")
    return tuple(nodes)


def read_availability(path: str, n: int) -> list[tuple[int, float, float]]:
    """A trace file: CSV with header node,t_down,t_up; t_up empty or inf: never comes back (a crash)."""
    lines = numbered_lines(path, "availability file", ScenarioError)
    rows = [(number, next(csv.reader([line]))) for number, line in lines]
    if not rows or [cell.strip().lower() for cell in rows[0][1]] != ["node", "t_down", "t_up"]:
        raise ScenarioError(f"--availability {path}: expected a CSV header node,t_down,t_up")
    outages = sorted(_outage(path, number, row, n) for number, row in rows[1:])
    for (node, _, end, _), (other, start, _, number) in zip(outages, outages[1:]):
        if node == other and start < end:
            raise ScenarioError(f"{path}:{number}: node {node} is already down at t_down={start}")
    return [(node, t_down, t_up) for node, t_down, t_up, _ in outages]


def _outage(path: str, number: int, row: list[str], n: int) -> tuple[int, float, float, int]:
    where = f"{path}:{number}"
    if len(row) != 3:
        raise ScenarioError(f"{where}: expected node,t_down,t_up, got {','.join(row)!r}")
    node, down, up = (cell.strip() for cell in row)
    try:
        node_id = int(node)
        t_down = units.duration(down)
        t_up = math.inf if up.lower() in ("", "inf", "never") else units.duration(up)
    except (ValueError, units.UnitError) as exc:
        raise ScenarioError(f"{where}: {exc}") from None
    if not 0 <= node_id < n:
        raise ScenarioError(f"{where}: node {node_id} does not exist (nodes are 0..{n - 1})")
    if t_up <= t_down:
        raise ScenarioError(f"{where}: t_up must come after t_down")
    return node_id, t_down, t_up, number


def schedule(config, n: int):
    """The time-varying topology of --topology-schedule, or None."""
    if _off(config.topology_schedule):
        return None
    try:
        return topologies.schedule(str(config.topology_schedule), config.topology, n, Seeds(config.seed).integer("topology"))
    except topologies.TopologyError as exc:
        raise ScenarioError(f"--topology-schedule {config.topology_schedule}: {exc}") from None


def check(config) -> None:
    """The checks that need no node count (called when settings are resolved)."""
    parse_churn(config.churn)
    parse_crash(config.crash)
    parse_link_failures(config.link_failures)
    parse_partitions(config.partition_event)


@dataclass
class Scenario:
    """Every fault and change of a run, parsed and checked against its node count."""
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


def scenario(config, n: int, schedule=None) -> Scenario:
    availability = "" if _off(config.availability) else str(config.availability).strip()
    if schedule is not None and schedule.num_nodes != n:
        raise ScenarioError(f"--topology-schedule {config.topology_schedule}: has {schedule.num_nodes} nodes, "
                            f"the run {n}")
    return Scenario(n, parse_churn(config.churn), parse_crash(config.crash),
                    read_availability(availability, n) if availability else [],
                    parse_link_failures(config.link_failures), parse_partitions(config.partition_event, n), schedule)


# -- nodes going down and up ----------------------------------------------------------

class Availability:
    """Drives Network.online from the scenario's outages, as clock events.

    Outages from several sources (churn, trace, crash) may overlap: a node is online
    when none holds it down. `intervals[i]` lists node i's offline spells [t_down, t_up]
    (t_up None while it lasts).
    """

    def __init__(self, scenario: Scenario, online: list[bool], clock, seeds, on_crash: Callable[[int], None]):
        self.scenario, self.online, self.clock, self.seeds, self.on_crash = scenario, online, clock, seeds, on_crash
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
        self._edges: dict[tuple[int, int], list] = {}

    def down(self, src: int, dst: int, now: float) -> bool:
        for start, heal, group in self.partitions:
            if start <= now < heal and group[src] != group[dst]:
                return True
        return self.failures is not None and self._failed(min(src, dst), max(src, dst), now)

    def _failed(self, u: int, v: int, now: float) -> bool:
        state = self._edges.get((u, v))
        if state is None:
            rng = self.seeds.numpy("link.failures", u, v)
            state = self._edges[u, v] = [False, rng.exponential(self.failures.up), rng]  # [down, next change, rng]
        while state[1] <= now:
            state[0] = not state[0]
            state[1] += state[2].exponential(self.failures.down if state[0] else self.failures.up)
        return state[0]
