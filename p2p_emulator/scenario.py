"""Parsing the network-dynamics settings into an emulator Scenario: churn, crashes,
availability traces, link failures, partitions and time-varying topologies.

Every check that needs no node count runs when settings are resolved (`check`);
the rest when the run's node count is known (`scenario`).
"""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Callable

import topologies
from emulator import units
from emulator.dynamics import Churn, Crash, LinkFailures, Partition, Scenario
from emulator.errors import UsageError
from emulator.seeds import Seeds
from topologies.files import numbered_lines


class ScenarioError(UsageError):
    """A bad churn, crash, availability, link-failure, partition or schedule setting."""


NONE = ("", "none", "off", "0")


def _off(text: Any) -> bool:
    return text is None or str(text).strip().lower() in NONE


def _params(text: str, flag: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, str]:
    syntax = ",".join(f"{k}=.." for k in required) + "".join(f"[,{k}=..]" for k in optional)
    return _keywords(text, required, optional, f"--{flag} {text!r}: expected {syntax}",
                     lambda key: f"--{flag} {text!r}: missing {key}= (expected {syntax})")


def _keywords(text: str, required: tuple[str, ...], optional: tuple[str, ...], usage: str,
              missing: Callable[[str], str], separator: str = ",") -> dict[str, str]:
    """A key=value list's items; a bad one is a ScenarioError saying `usage`, a required key left out `missing(key)`."""
    try:
        spec = units.read_spec(text, named=False, bad_item=usage, separator=separator)
        return spec.keywords(required, optional, usage=usage)
    except units.SpecError as exc:
        raise ScenarioError(usage if exc.missing is None else missing(exc.missing)) from None


def _period(text: str, flag: str, key: str) -> float:
    try:
        value = units.duration(text)
    except units.UnitError as exc:
        raise ScenarioError(f"--{flag}: {key}: {exc}") from None
    if not value > 0:
        raise ScenarioError(f"--{flag}: {key} must be a positive duration, got {text!r}")
    return value


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


def parse_link_failures(text: str) -> LinkFailures | None:
    """'up=..,down=..'; none: links never fail."""
    if _off(text):
        return None
    params = _params(text, "link-failures", ("up", "down"))
    return LinkFailures(_period(params["up"], "link-failures", "up"), _period(params["down"], "link-failures", "down"))


def parse_partitions(text: str, n: int | None = None) -> tuple[Partition, ...]:
    """'t=100s:groups=0-4|5-9[:heal=200s]', several separated by ';'. Node ids are checked against n if given."""
    if _off(text):
        return ()
    return tuple(_partition(event.strip(), n) for event in str(text).split(";") if event.strip())


def _partition(event: str, n: int | None) -> Partition:
    flag = f"--partition-event {event!r}"
    fields = _keywords(event, ("t", "groups"), ("heal",),
                       f"{flag}: expected t=TIME:groups=A|B[:heal=TIME], e.g. t=100s:groups=0-4|5-9:heal=200s",
                       lambda key: f"{flag}: needs t= and groups=", separator=":")
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
        seed = Seeds(config.seed).integer("topology")
        return topologies.schedule(str(config.topology_schedule), config.topology, n, seed)
    except topologies.TopologyError as exc:  # a file's error names the file already: the problem must fit the line
        named = Path(config.topology_schedule).is_file() and str(config.topology_schedule) in str(exc)
        raise ScenarioError(str(exc) if named else f"--topology-schedule {config.topology_schedule}: {exc}") from None


def check(config) -> None:
    """The checks that need no node count (called when settings are resolved)."""
    parse_churn(config.churn)
    parse_crash(config.crash)
    parse_link_failures(config.link_failures)
    parse_partitions(config.partition_event)


def scenario(config, n: int, schedule=None) -> Scenario:
    availability = "" if _off(config.availability) else str(config.availability).strip()
    if schedule is not None and schedule.num_nodes != n:
        raise ScenarioError(f"--topology-schedule {config.topology_schedule}: has {schedule.num_nodes} nodes, "
                            f"the run {n}")
    return Scenario(n, parse_churn(config.churn), parse_crash(config.crash),
                    read_availability(availability, n) if availability else [],
                    parse_link_failures(config.link_failures), parse_partitions(config.partition_event, n), schedule)
