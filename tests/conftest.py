"""Helpers shared by the tests: run a small protocol written inline on a real emulation."""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import networkx as nx
import pytest

from emulator.config import RunConfig
from emulator.protocol import Protocol
from emulator.runner import Emulation


@dataclass
class _NoOptions:
    pass


def inline_protocol(coroutine, observe=None):
    """A protocol whose per-node coroutine is `coroutine(node)`."""

    class Inline(Protocol):
        Options = _NoOptions

        async def run(self, node):
            await coroutine(node)

        def observe(self, rnd, snapshots):
            return observe(rnd, snapshots) if observe else {}

    return Inline(_NoOptions(), None)


def emulate(coroutine, graph: nx.Graph, *, workers: int = 2, **settings) -> Emulation:
    """Run `coroutine(node)` on every node of `graph` under the given RunConfig settings."""
    config = RunConfig(**{"latency": "0ms", "bandwidth": "inf", **settings})
    with concurrent.futures.ThreadPoolExecutor(workers) as executor:
        emulation = Emulation(config, graph, inline_protocol(coroutine), executor)
        emulation.rows = emulation.run()
    return emulation


def assert_one_line_error(capsys, named: str) -> str:
    """stderr is exactly one line and it names `named`; returns the line."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], lines
    return lines[0]


@pytest.fixture
def two_nodes() -> nx.Graph:
    return nx.path_graph(2)
