"""One emulation: build the network and the nodes, run every node's coroutine, write the run directory."""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import networkx as nx
import yaml

from . import config as cfg
from .clock import RealClock, VirtualClock
from .ledger import Ledger
from .network import Network
from .node import Node
from .protocol import Protocol
from .units import rate


@dataclass
class Environment:
    """What a protocol may know about the run when it sets itself up."""
    num_nodes: int
    rounds: int
    seed: int
    graph: nx.Graph
    device: str
    out_dir: Path
    console: Any = None

    def write_json(self, name: str, obj: Any) -> None:
        (self.out_dir / name).write_text(json.dumps(obj, indent=1) + "\n")


class Recorder:
    """Per node per round metric rows, observer metrics, and extra jsonl streams."""

    def __init__(self, num_nodes: int, ledger: Ledger, observe: Callable, on_round: Callable):
        self.num_nodes, self.ledger, self.observe, self.on_round = num_nodes, ledger, observe, on_round
        self.rows: dict[tuple[int, int], dict] = {}
        self.snapshots: dict[int, dict[int, Any]] = defaultdict(dict)
        self.finished: dict[int, int] = defaultdict(int)
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
        self.finished[rnd] += 1
        if self.finished[rnd] == self.num_nodes:
            self._observe(rnd)
            self.on_round(rnd, now)

    def _observe(self, rnd: int) -> None:
        snapshots = self.snapshots.pop(rnd, None)
        if snapshots:
            for node, metrics in self.observe(rnd, snapshots).items():
                self._row(node, rnd).update(metrics)

    def finish(self, now: float) -> list[dict]:
        """Rows in (round, node) order, with each node's ledger totals for the round.

        A row whose round never closed (e.g. --rounds 0, or a crashed node) is stamped with the end time.
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
    """The network, the clock and the nodes of one run."""

    def __init__(self, config: cfg.RunConfig, graph: nx.Graph, protocol: Protocol,
                 executor: concurrent.futures.Executor, on_round: Callable = lambda rnd, now: None):
        self.config, self.seed, self.rounds = config, config.seed, config.rounds
        self.clock = (RealClock(executor, config.time_scale) if config.clock == "real"
                      else VirtualClock(executor))
        self.ledger = Ledger(trace=config.trace)
        self.network = Network(graph, self.clock, self.ledger, cfg.link_spec(config), config.seed,
                               uplink=rate(config.uplink), downlink=rate(config.downlink),
                               compress=config.compress, max_message_bytes=cfg.max_message_bytes(config))
        self.compute_model = cfg.compute_model(config, graph.number_of_nodes())
        self.recorder = Recorder(graph.number_of_nodes(), self.ledger, protocol.observe, on_round)
        self.protocol = protocol
        self.nodes = [Node(i, self) for i in range(graph.number_of_nodes())]

    def run(self) -> list[dict]:
        node_main = self.protocol.run if self.rounds > 0 else self.protocol.run_no_rounds

        async def main():
            await asyncio.gather(*(node_main(node) for node in self.nodes))

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


def write_run_dir(out_dir: Path, config: cfg.RunConfig, options: Any, emulation: Emulation,
                  rows: list[dict], wall: float) -> dict:
    resolved = {**asdict(config), **asdict(options)}
    (out_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    with open(out_dir / "metrics.jsonl", "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    emulation.ledger.write_links(out_dir / "links.csv")
    if emulation.ledger.trace is not None:
        emulation.ledger.write_trace(out_dir / "messages.jsonl")
    for stream, stream_rows in emulation.recorder.streams.items():
        with open(out_dir / f"{stream}.jsonl", "w") as fh:
            for row in stream_rows:
                fh.write(json.dumps(row) + "\n")
    totals = emulation.ledger.totals()
    summary = {
        "protocol": config.protocol, "topology": config.topology, "nodes": emulation.network.num_nodes,
        "rounds": config.rounds, "seed": config.seed,
        **totals,
        "messages_in_flight": totals["messages_total"] - totals["messages_delivered"]
        - sum(v for k, v in totals.items() if k.startswith("dropped_")),
        "wall_seconds": wall,
        "emulated_seconds": emulation.clock.now,
        "final": final_metrics(rows),
        **emulation.protocol.summary(),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
