"""Runs over a real transport: each node its own process, frames over TCP (emulator.tcp).

`emulate --transport tcp ...` (loopback) or `--transport netns ...` (one network
namespace per node, links shaped by tc; p2p_emulator.testbed) starts one process
per node, `emulate node ...`, and merges what they wrote into one run directory:

    RUN_DIR/peers.csv                 node,host,port: where each node listened
    RUN_DIR/nodes/<i>/                each node's own run directory (its rows, its side of its links)
    RUN_DIR/nodes/<i>.log             its stderr
    RUN_DIR/metrics.jsonl ...         the run's, merged: links.csv takes a link's sent counts from its
                                      sender and its delivered counts from its receiver

A node can be started on its own, on any machine, with the run's config file and its
peers' addresses (`emulate node --config RUN.yaml --id I --listen HOST:PORT --peers
peers.csv --out DIR`); `emulate merge RUN_DIR` then merges the node directories gathered
under RUN_DIR/nodes/.
"""
from __future__ import annotations

import asyncio
import csv
import json
import math
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from emulator.errors import UsageError
from emulator.ledger import DROP_CAUSES, LINK_COUNTERS, Ledger
from emulator.protocol import protocols
from emulator.tcp import Placement

from . import __version__
from . import settings as cfg
from .analysis.rundir import LINK_COLUMNS, RunDirWriter, csv_writer, final_metrics, read_jsonl

class NodeFailed(RuntimeError):
    """A node's process failed; its log is in the run directory."""


PORT = 7000  # each node's port inside its own namespace
START_DELAY = 0.5  # seconds between the last node's "ready" and the common start instant
READY_SECONDS = 300.0  # how long the launcher waits for every node to be up (imports, data, connections)


def check(config: cfg.RunConfig) -> None:
    """Refuse, before anything is written, a testbed this machine cannot make."""
    if config.transport == "netns":
        from .testbed import unavailable

        reason = unavailable()
        if reason is not None:
            raise UsageError(f"--transport netns: {reason}")


def launch(config: cfg.RunConfig, options: Any, graph, out_dir: Path) -> dict:
    """Start every node's process, wait for them, and merge their directories into out_dir (empty); the summary."""
    n = graph.number_of_nodes()
    (out_dir / "nodes").mkdir()
    RunDirWriter(out_dir).config({**asdict(config), **asdict(options)})
    start = time.perf_counter()
    if config.transport == "netns":
        from . import testbed

        with testbed.Testbed(n, *shaping(config, graph)) as bed:
            addresses = {i: (bed.address(i), PORT) for i in range(n)}
            _run_nodes(out_dir, addresses, lambda i, argv: bed.command(i, argv))
    else:
        addresses = {i: ("127.0.0.1", port) for i, port in enumerate(_free_ports(n))}
        _run_nodes(out_dir, addresses, lambda i, argv: argv)
    return merge(out_dir, wall_seconds=time.perf_counter() - start)


def shaping(config: cfg.RunConfig, graph) -> tuple[list[float], list[float], dict[tuple[int, int], float]]:
    """Each node's uplink and downlink and each directed link's bandwidth, in bit/s, as the emulator reads them."""
    from emulator.seeds import Seeds

    seeds = Seeds(config.seed)
    spec = cfg.link_spec(config)
    edge_specs = cfg.edge_specs(graph, spec)
    directed = [(u, v) for u, v in graph.edges] + ([] if graph.is_directed() else [(v, u) for u, v in graph.edges])
    bandwidth = {link: edge_specs.get(link, spec).bandwidth for link in directed}
    return (cfg.capacities(graph, "uplink", config.uplink, seeds),
            cfg.capacities(graph, "downlink", config.downlink, seeds),
            {link: rate for link, rate in bandwidth.items() if rate != math.inf})


def _free_ports(n: int) -> list[int]:
    """n loopback ports free now (held open together, so they differ)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _run_nodes(out_dir: Path, addresses: dict[int, tuple[str, int]], wrap) -> None:
    """Start each node, wait until all are connected, give them one start instant, and wait for them to end."""
    peers = out_dir / "peers.csv"
    peers.write_text("node,host,port\n" + "".join(f"{i},{h},{p}\n" for i, (h, p) in addresses.items()))
    processes = {}
    try:
        for i, (host, port) in addresses.items():
            argv = [sys.executable, "-m", "p2p_emulator.cli", "node", "--config", str(out_dir / "config.yaml"),
                    "--id", str(i), "--listen", f"{host}:{port}", "--peers", str(peers),
                    "--out", str(out_dir / "nodes" / str(i)), "--launched"]
            with open(out_dir / "nodes" / f"{i}.log", "w") as log:
                processes[i] = subprocess.Popen(wrap(i, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=log, text=True)
        for i, process in processes.items():
            _await_ready(i, process, out_dir)
        start_at = f"{time.time() + START_DELAY!r}\n"
        for process in processes.values():
            process.stdin.write(start_at)
            process.stdin.close()
        _await_end(processes, out_dir)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def _await_end(processes: dict[int, subprocess.Popen], out_dir: Path) -> None:
    """Wait for every node to end; the first one that fails ends the run (its peers may wait for it forever)."""
    running = dict(processes)
    while running:
        for i, process in list(running.items()):
            code = process.poll()
            if code is None:
                continue
            del running[i]
            if code != 0:
                raise NodeFailed(f"node {i} failed: {_last_line(out_dir / 'nodes' / f'{i}.log')} "
                                 f"({out_dir / 'nodes' / f'{i}.log'})")
        time.sleep(0.1)


def _await_ready(i: int, process: subprocess.Popen, out_dir: Path) -> None:
    line = process.stdout.readline()  # the node prints "ready" once its connections are up, or exits
    if line.strip() != "ready":
        process.wait(timeout=READY_SECONDS)
        raise NodeFailed(f"node {i} did not start: {_last_line(out_dir / 'nodes' / f'{i}.log')}")


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


# -- one node ---------------------------------------------------------------------

def placement(node: int, listen: str, peers: str, start_at: float | None, launched: bool) -> Placement:
    """Where `emulate node` runs its node, from its flags."""
    return Placement(node, _address(listen, "--listen"), read_peers(peers), start_at,
                     ready=_ready_from_launcher if launched else None)


def check_placement(where: Placement, graph) -> None:
    """Refuse a node id the run does not have, or peers that lack one of the node's out-neighbours."""
    n = graph.number_of_nodes()
    if not 0 <= where.node < n:
        raise UsageError(f"--id {where.node}: the run's nodes are 0..{n - 1}")
    out = graph.successors(where.node) if graph.is_directed() else graph.neighbors(where.node)
    missing = sorted(set(out) - set(where.peers))
    if missing:
        raise UsageError(f"--peers: no address for node {missing[0]}, an out-neighbour of node {where.node}")


async def _ready_from_launcher() -> float:
    """Say so to the launcher and read back the run's start instant."""
    print("ready", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    return float(line)


def _address(text: str, flag: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{flag} {text!r:.60}: expected HOST:PORT")
    return host, int(port)


def read_peers(path: str) -> dict[int, tuple[str, int]]:
    """node,host,port rows -> {node: (host, port)}."""
    try:
        with open(path, newline="") as fh:
            return {int(row["node"]): (row["host"], int(row["port"])) for row in csv.DictReader(fh)}
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise UsageError(f"--peers {path}: expected CSV node,host,port ({exc})") from None


# -- merging ------------------------------------------------------------------------

_SENDER_COLUMNS = ("msgs_sent", "bytes_sent", *(f"dropped_{cause}" for cause in DROP_CAUSES))
_RECEIVER_COLUMNS = ("msgs_delivered", "bytes_delivered")


def merge(out_dir: Path, wall_seconds: float = 0.0) -> dict:
    """One run directory from the node directories under out_dir/nodes; its summary."""
    parts = sorted((p for p in (out_dir / "nodes").iterdir() if p.is_dir()), key=lambda p: int(p.name))
    summaries = [json.loads((part / "summary.json").read_text()) for part in parts]
    rows = sorted((row for part in parts for row in read_jsonl(part / "metrics.jsonl")),
                  key=lambda row: (row["round"], row["node"]))
    links = _merged_links(parts)
    with RunDirWriter(out_dir) as writer:
        writer.jsonl("metrics.jsonl", rows)
        writer.replace("links.csv", csv_writer(LINK_COLUMNS, ([src, dst, *(row[c] for c in LINK_COLUMNS[2:])]
                                                            for (src, dst), row in sorted(links.items()))))
        if (parts[0] / "messages.jsonl").exists():
            writer.jsonl("messages.jsonl", _merged_trace(parts))
        summary = _merged_summary(summaries, rows, links, wall_seconds)
        writer.finish(summary)
    return summary


def _merged_links(parts: list[Path]) -> dict[tuple[int, int], dict[str, int]]:
    """Each link's counts: what was sent from its sender's directory, what was delivered from its receiver's."""
    links: dict[tuple[int, int], dict[str, int]] = {}
    for part in parts:
        node = int(part.name)
        with open(part / "links.csv", newline="") as fh:
            for row in csv.DictReader(fh):
                src, dst = int(row["src"]), int(row["dst"])
                merged = links.setdefault((src, dst), dict.fromkeys(LINK_COLUMNS[2:], 0))
                columns = _SENDER_COLUMNS if src == node else _RECEIVER_COLUMNS if dst == node else ()
                for column in columns:
                    merged[column] = int(row[column])
    for merged in links.values():
        merged["msgs_dropped"] = sum(merged[f"dropped_{cause}"] for cause in DROP_CAUSES)
    return links


def _merged_trace(parts: list[Path]) -> list[dict]:
    """Messages in send order: the receiver's row (with its arrival) where it arrived, else the sender's.

    TCP keeps a link's frames in order, so a link's k-th frame sent is its k-th received."""
    sent, received = {}, {}
    for part in parts:
        for row in read_jsonl(part / "messages.jsonl"):
            side = sent if row["fate"] != "delivered" else received
            side.setdefault((row["src"], row["dst"]), []).append(row)
    merged = []
    for link, rows in sent.items():
        arrived = received.get(link, [])
        merged += [arrived[k] if k < len(arrived) else {**row, "fate": "undelivered"} for k, row in enumerate(rows)]
    return sorted(merged, key=lambda row: (row["t_send"], row["src"], row["dst"]))


def _merged_summary(summaries: list[dict], rows: list[dict], links: dict, wall_seconds: float) -> dict:
    first = summaries[0]
    ledger = Ledger()  # the merged links' counters, totalled as an emulated run's are
    ledger.links = {link: [row[column] for column in LINK_COUNTERS] for link, row in links.items()}
    totals = ledger.totals()
    node_time = {key: [s["node_time"][key][s["node"]] for s in summaries] for key in ("compute_seconds", "idle_seconds")}
    asynchronous = protocols()[first["protocol"]].asynchronous
    return {"protocol": first["protocol"], "topology": first["topology"], "nodes": len(summaries),
            "rounds": max(s["rounds"] for s in summaries), "seed": first["seed"], "version": __version__,
            "transport": first["transport"], **totals,
            "framing_bytes": sum(s["framing_bytes"] for s in summaries),
            "wall_seconds": wall_seconds,
            "emulated_seconds": max(s["emulated_seconds"] for s in summaries),
            "final": final_metrics(rows, each_node_last=asynchronous),
            "node_time": node_time}
