"""One emulation: build the network and the nodes, run every node's coroutine, write the run directory."""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import networkx as nx
import yaml

import topologies

from . import config as cfg
from . import dynamics
from .clock import RealClock, VirtualClock
from .ledger import Ledger
from .network import Network
from .node import Node
from .protocol import Protocol
from .seeds import Seeds
from .units import UnitError, rate


@dataclass
class Environment:
    """What a protocol may know about the run when it sets itself up."""
    num_nodes: int
    rounds: int
    seeds: Seeds
    graph: nx.Graph
    device: str
    out_dir: Path
    console: Any = None

    def write_json(self, name: str, obj: Any) -> None:
        (self.out_dir / name).write_text(json.dumps(obj, indent=1) + "\n")


class Recorder:
    """Per node per round metric rows, observer metrics, and extra jsonl streams.

    A round closes (observer, progress) when every node still alive has finished it;
    a crashed node's unfinished round leaves no row and no snapshot.
    """

    def __init__(self, num_nodes: int, ledger: Ledger, observe: Callable, on_round: Callable):
        self.num_nodes, self.ledger, self.observe, self.on_round = num_nodes, ledger, observe, on_round
        self.rows: dict[tuple[int, int], dict] = {}
        self.snapshots: dict[int, dict[int, Any]] = defaultdict(dict)
        self.finished: dict[int, int] = defaultdict(int)  # open round -> live nodes that finished it
        self.done_through = [-1] * num_nodes  # each node's last finished round
        self.alive = num_nodes
        self.streams: dict[str, list[dict]] = defaultdict(list)

    def _row(self, node: int, rnd: int) -> dict:
        row = self.rows.get((rnd, node))
        if row is None:
            row = self.rows[rnd, node] = {"round": rnd, "node": node}
        return row

    def log(self, node: int, rnd: int, metrics: dict) -> None:
        self._row(node, rnd).update(metrics)

    def snapshot(self, node: int, rnd: int, state: Any) -> None:
        self.snapshots[rnd][node] = state

    def record(self, stream: str, row: dict) -> None:
        self.streams[stream].append(row)

    def end_round(self, node: int, rnd: int, now: float) -> None:
        self._row(node, rnd)["t"] = now
        self.done_through[node] = rnd
        self.finished[rnd] += 1
        if self.finished[rnd] == self.alive:
            self._close(rnd, now)

    def crash(self, node: int, now: float) -> None:
        """Forget the node's unfinished rounds and close the rounds that waited only for it."""
        done = self.done_through[node]
        for rnd, _ in [key for key in self.rows if key[1] == node and key[0] > done]:
            del self.rows[rnd, node]
        for rnd in [rnd for rnd in self.snapshots if rnd > done]:
            self.snapshots[rnd].pop(node, None)
        self.alive -= 1
        for rnd in sorted(self.finished):
            if rnd <= done:
                self.finished[rnd] -= 1
            if self.finished[rnd] == self.alive:
                self._close(rnd, now)

    def _close(self, rnd: int, now: float) -> None:
        del self.finished[rnd]
        self._observe(rnd)
        self.on_round(rnd, now)

    def _observe(self, rnd: int) -> None:
        snapshots = self.snapshots.pop(rnd, None)
        if snapshots:
            for node, metrics in self.observe(rnd, snapshots).items():
                self._row(node, rnd).update(metrics)

    def finish(self, now: float) -> list[dict]:
        """Rows in (round, node) order, with each node's ledger totals for the round.

        A row whose round never closed (e.g. --rounds 0) is stamped with the end time.
        """
        for rnd in list(self.snapshots):
            self._observe(rnd)
        rows = []
        for (rnd, node), row in sorted(self.rows.items()):
            row.setdefault("t", now)
            row.update(self.ledger.node_round(node, rnd))
            rows.append(row)
        return rows


class Emulation:
    """The network, the clock, the nodes and the scenario's dynamics of one run."""

    def __init__(self, config: cfg.RunConfig, graph: nx.Graph, protocol: Protocol,
                 executor: concurrent.futures.Executor, on_round: Callable = lambda rnd, now: None,
                 scenario: dynamics.Scenario | None = None):
        self.config, self.rounds = config, config.rounds
        self.seeds = Seeds(config.seed)
        n = graph.number_of_nodes()
        if scenario is None:
            scenario = dynamics.scenario(config, n, dynamics.schedule(config, n))
        self.scenario = scenario
        self.clock = (RealClock(executor, config.time_scale) if config.clock == "real"
                      else VirtualClock(executor))
        self.ledger = Ledger(trace=config.trace)
        self.network = Network(graph, self.clock, self.ledger, cfg.link_spec(config), self.seeds,
                               uplink=_capacities(graph, "uplink", config.uplink, self.seeds),
                               downlink=_capacities(graph, "downlink", config.downlink, self.seeds),
                               compress=config.compress, max_message_bytes=cfg.max_message_bytes(config),
                               schedule=scenario.schedule,
                               faults=dynamics.LinkFaults(scenario, self.seeds) if scenario.links_change else None,
                               nodes_change=scenario.nodes_change)
        self.compute_model = cfg.compute_model(config, n, self.seeds)
        self.recorder = Recorder(n, self.ledger, protocol.observe, on_round)
        self.availability = (dynamics.Availability(scenario, self.network.online, self.clock, self.seeds,
                                                   self._crash) if scenario.nodes_change else None)
        self.protocol = protocol
        self.nodes = [Node(i, self) for i in range(n)]
        self.tasks: dict[int, asyncio.Task] = {}
        self._running: set[int] = set()

    def _crash(self, node: int) -> None:
        if node in self._running:  # a task cancelled before its first step could not catch it
            self.tasks[node].cancel()
        self.recorder.crash(node, self.clock.now)

    async def _node_main(self, node_main: Callable, node: Node) -> None:
        crashed = self.availability.crashed if self.availability is not None else ()
        if node.id in crashed:
            return
        self._running.add(node.id)
        try:
            await node_main(node)
        except asyncio.CancelledError:
            if node.id not in crashed:
                raise
        finally:
            self._running.discard(node.id)

    def run(self) -> list[dict]:
        node_main = self.protocol.run if self.rounds > 0 else self.protocol.run_no_rounds

        async def main():
            if self.availability is not None:
                self.availability.start()
            for node in self.nodes:
                task = self.tasks[node.id] = asyncio.ensure_future(self._node_main(node_main, node))
                task._log_destroy_pending = False  # as gather does for its own: a failed run leaves them
            await asyncio.gather(*self.tasks.values())

        # Messages are short-lived and acyclic; full collections over a large run's
        # long-lived objects would dominate the wall time.
        gc.freeze()
        thresholds = gc.get_threshold()
        gc.set_threshold(50_000, 50, 100)
        try:
            self.clock.run(main())
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()
        return self.recorder.finish(self.clock.now)


def _capacities(graph: nx.Graph, attribute: str, default: str, seeds: Seeds) -> list[float]:
    """Per-node capacity: the node's attribute in a topology file, else the flag's value or draw."""
    rates = cfg.node_rates(default, graph.number_of_nodes(), seeds.numpy(attribute))
    for node, value in graph.nodes(data=attribute):
        if value is not None:
            try:
                rates[node] = rate(value)
            except UnitError as exc:
                raise cfg.ConfigError(f"topology node {node}: {attribute}: {exc}") from None
    return rates


def make_executor(config: cfg.RunConfig) -> concurrent.futures.Executor:
    return concurrent.futures.ThreadPoolExecutor(cfg.workers(config), thread_name_prefix="compute")


def final_metrics(rows: list[dict]) -> dict[str, float]:
    """Each numeric metric's mean over nodes at the last round; test_acc also gets std and worst 10%."""
    if not rows:
        return {}
    last = max(row["round"] for row in rows)
    at_last = [row for row in rows if row["round"] == last]
    skip = {"round", "node", "t"}
    names = sorted({k for row in at_last for k, v in row.items()
                    if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)})
    final: dict[str, float] = {}
    for name in names:
        values = [row[name] for row in at_last if isinstance(row.get(name), (int, float))]
        final[name] = statistics.fmean(values)
    accuracies = sorted(row["test_acc"] for row in at_last if isinstance(row.get("test_acc"), (int, float)))
    if accuracies:
        final["test_acc_std"] = statistics.pstdev(accuracies)
        worst = max(1, len(accuracies) // 10)
        final["test_acc_worst10"] = statistics.fmean(accuracies[:worst])
    return final


@dataclass
class RunResult:
    out_dir: Path
    rows: list[dict]
    summary: dict
    extra: dict = field(default_factory=dict)


def topology_label(config: cfg.RunConfig, scenario: dynamics.Scenario) -> str:
    """--topology, or the schedule that replaces it; a resampled one names both."""
    schedule = scenario.schedule
    if schedule is None:
        return config.topology
    if isinstance(schedule, topologies.schedules.Resampled):
        return f"{config.topology} ({config.topology_schedule})"
    return config.topology_schedule


def write_run_dir(out_dir: Path, config: cfg.RunConfig, options: Any, emulation: Emulation,
                  rows: list[dict], wall: float) -> dict:
    resolved = {**asdict(config), **asdict(options)}
    (out_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    _write_jsonl(out_dir / "metrics.jsonl", rows)
    emulation.ledger.write_links(out_dir / "links.csv")
    if emulation.ledger.trace is not None:
        emulation.ledger.write_trace(out_dir / "messages.jsonl")
    if emulation.availability is not None:
        _write_jsonl(out_dir / "availability.jsonl", emulation.availability.rows())
    for stream, stream_rows in emulation.recorder.streams.items():
        _write_jsonl(out_dir / f"{stream}.jsonl", stream_rows)
    totals = emulation.ledger.totals()
    summary = {
        "protocol": config.protocol, "topology": topology_label(config, emulation.scenario),
        "nodes": emulation.network.num_nodes, "rounds": config.rounds, "seed": config.seed,
        **totals,
        "messages_in_flight": totals["messages_total"] - totals["messages_delivered"]
        - sum(v for k, v in totals.items() if k.startswith("dropped_")),
        "wall_seconds": wall,
        "emulated_seconds": emulation.clock.now,
        "final": final_metrics(rows),
        **({"crashed": sorted(emulation.availability.crashed)} if emulation.availability is not None else {}),
        **emulation.protocol.summary(emulation.recorder.streams),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
