"""Message throughput through the full stack (clock, link, codec, ledger) against a bare asyncio.Queue.

    python benchmarks/throughput.py [--messages 200000]

Both are measured in the same run; the figure that matters is the ratio. The target of issue 39,
200,000 msgs/s through the full stack with checksums on, is an absolute figure: it holds only on
a machine as fast as the one it was set on.
"""
from __future__ import annotations

import argparse
import asyncio
import time

import networkx as nx
from rich.console import Console
from rich.table import Table

from emulator.compute import ThreadExecutor
from p2p_emulator.build import build_emulation
from p2p_emulator.settings import RunConfig
from emulator.protocol import NoOptions, Protocol


TARGET = 200_000  # messages a second, full stack, checksums on


class Blast(Protocol):
    """Node 0 sends `count` small messages to node 1, which receives them all."""

    count = 0

    async def run(self, node):
        if node.id == 0:
            for i in range(self.count):
                node.send(1, "m", i)
        else:
            for _ in range(self.count):
                await node.recv()


class Spread(Protocol):
    """Every node sends `count` small messages round-robin to its neighbours and receives as many.

    On a regular graph with count a multiple of the degree, each node receives exactly count:
    the message path (clock, links, codec, ledger, mailboxes) spread over many nodes.
    """

    count = 0

    async def run(self, node):
        peers = node.neighbours
        for i in range(self.count):
            node.send(peers[i % len(peers)], "m", i)
        for _ in range(self.count):
            await node.recv()


def spread_rate(nodes: int, count: int, degree: int = 4) -> float:
    """Messages per second of Spread over a random `degree`-regular graph of `nodes` nodes."""
    Spread.count = count
    graph = nx.random_regular_graph(degree, nodes, seed=0)
    with ThreadExecutor(1) as executor:
        emulation = build_emulation(RunConfig(latency="1ms", bandwidth="1Gbps"), graph, Spread(NoOptions(), None),
                                    executor)
        start = time.perf_counter()
        emulation.run()
        wall = time.perf_counter() - start
    assert emulation.ledger.totals()["messages_delivered"] == nodes * count
    return nodes * count / wall


def emulator_rate(count: int) -> float:
    Blast.count = count
    config = RunConfig(latency="1ms", bandwidth="1Gbps")
    with ThreadExecutor(1) as executor:
        emulation = build_emulation(config, nx.path_graph(2), Blast(NoOptions(), None), executor)
        start = time.perf_counter()
        emulation.run()
        wall = time.perf_counter() - start
    assert emulation.ledger.totals()["messages_delivered"] == count
    return count / wall


def queue_rate(count: int) -> float:
    async def main():
        queue: asyncio.Queue = asyncio.Queue()

        async def produce():
            for i in range(count):
                await queue.put(i)

        async def consume():
            for _ in range(count):
                await queue.get()

        await asyncio.gather(produce(), consume())

    start = time.perf_counter()
    asyncio.run(main())
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    emulated = max(emulator_rate(args.messages) for _ in range(args.repeats))
    bare = max(queue_rate(args.messages) for _ in range(args.repeats))
    table = Table(title=f"message throughput, {args.messages:,} small messages, best of {args.repeats}")
    for column in ("path", "messages/s"):
        table.add_column(column)
    table.add_row("emulator (clock+link+codec+ledger)", f"{emulated:,.0f}")
    table.add_row("bare asyncio.Queue put+get", f"{bare:,.0f}")
    table.add_row("ratio queue / emulator", f"{bare / emulated:.1f}x")
    Console().print(table)
    met = "[green]met" if emulated >= TARGET else "[red]missed"
    Console().print(f"emulator: {emulated:,.0f} msgs/s (target >= {TARGET:,}) {met}")


if __name__ == "__main__":
    main()
