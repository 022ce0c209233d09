"""Helpers shared by the tests: run a small protocol written inline on a real emulation, or
drive nodes directly from an async test on the virtual clock's loop.

Every `@pytest.mark.asyncio` test runs on a VirtualClock's loop (the hook below), so
`await asyncio.sleep(60)` takes no wall time; the `clock` fixture is that clock and
`nodes(network(clock, graph))` builds nodes on a network over it.
"""
from __future__ import annotations

import asyncio
import functools
import math
import os
import re
import sys
from dataclasses import dataclass

import networkx as nx
import pytest
import pytest_asyncio

from p2p_emulator.build import build_emulation
from p2p_emulator.settings import RunConfig
from p2p_emulator.specs import parse_delay, parse_loss
from emulator.clock import VirtualClock
from emulator.compute import Compute, ComputeModel, ThreadExecutor
from emulator.emulation import Emulation
from emulator.ledger import Ledger
from emulator.links import LinkSpec
from emulator.network import Network
from emulator.node import Node, NodeContext
from emulator.protocol import Protocol
from emulator.recorder import Recorder
from emulator.seeds import Seeds


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: -p no:xdist -n 0 still loads this file
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup (pyproject.toml's addopts), with one more rule: a test file that defines a module-
    or session-scoped fixture (a run that several of its tests read) runs on one worker, so that the
    fixture is built once; the files that name one xdist_group (the Ray tests: one local Ray, local_ray)
    run on one worker together, so that Ray starts once. Every other test goes to whichever worker is free.

    The rule lives here because pytest-xdist 3.8 marks a group by appending "@group" to the test's id,
    which pytest 9.2's structured ids ignore: loadgroup then silently spreads a group over the workers
    (pytest-dev/pytest-xdist#1386). An id that does carry "@group" still groups as xdist intends.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    root = config.rootpath

    class FileGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):
                return super()._split_scope(nodeid)
            path = nodeid.split("::", 1)[0]
            return _unit(root, path) or nodeid

    return FileGroups(config, log)


@functools.cache
def _unit(root, path: str) -> str | None:
    """The scheduling unit of a test file's tests: the name of the xdist_group it names, the file if it defines
    a module- or session-scoped fixture, else None (each test on its own)."""
    try:
        source = (root / path).read_text()
    except OSError:
        return None
    if group := re.search(r"""xdist_group\(["'](\w+)["']\)""", source):
        return group[1]
    return path if re.search(r"""scope=["'](module|package|session)["']""", source) else None


@pytest.fixture(scope="module")
def local_ray():
    """The local Ray that `emulate` starts itself (on the loopback address only), of 2 CPUs on any machine
    (a test asks for more workers than it holds): started by the first Ray test (xdist_group "ray"), joined
    by the runs of every other, and shut down after the last (pytest_runtest_teardown below)."""
    import ray

    from emulator import ray_executor

    if not ray.is_initialized():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "cpu_count", lambda: 2)  # what emulate's local Ray takes as its CPUs
            ray_executor.connect(ray, "")
    return ray


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last Ray test of a stretch, local_ray's Ray goes down: a later test's `emulate --executor ray`
    in this process would join it instead of starting or reaching its own."""
    if _ray_test(item) and not (nextitem is not None and _ray_test(nextitem)):
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()


def _ray_test(item) -> bool:
    marker = item.get_closest_marker("xdist_group")
    return marker is not None and marker.args[:1] == ("ray",)


def pytest_asyncio_loop_factories(config, item):
    """Async tests run on the virtual clock's loop."""
    return {"virtual": lambda: VirtualClock().loop}


@pytest_asyncio.fixture
async def clock() -> VirtualClock:
    """The virtual clock whose loop runs the current async test."""
    return asyncio.get_running_loop().clock


def network(clock, graph: nx.Graph, *, latency: str = "0ms", bandwidth: float = math.inf, loss: str = "0",
            seed: int = 0, trace: bool = False, **options) -> Network:
    """A network over `clock`; `options` go to Network (uplink=..., compress=...)."""
    spec = LinkSpec(parse_delay(latency), bandwidth, parse_loss(loss))
    return Network(graph, clock, Ledger(trace=trace), spec, Seeds(seed), **options)


def nodes(net: Network, *, compute_cost: float = 1e-3, rounds: int = 1, seed: int = 0) -> list[Node]:
    """One Node per node of `net`, each charged compute_cost per unit of work."""
    n, clock = net.num_nodes, net.clock
    compute = Compute(ComputeModel("per-sample", compute_cost, 1.0, (1.0,) * n), clock)
    recorder = Recorder(n, net.ledger, lambda rnd, snapshots: {}, lambda rnd, now: None)
    return [Node(NodeContext(i, net, clock, compute, recorder, rounds, Seeds(seed))) for i in range(n)]


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
    with ThreadExecutor(workers) as executor:
        emulation = build_emulation(config, graph, inline_protocol(coroutine), executor)
        emulation.rows = emulation.run()
    return emulation


def library_epsilon(noise: float, rate: float, steps: int, delta: float) -> float:
    """Epsilon from opacus's RDPAccountant stepped one step at a time: what the run's accounting must equal."""
    import warnings

    from opacus.accountants import RDPAccountant  # only the privacy tests pay for its import

    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=noise, sample_rate=rate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return accountant.get_epsilon(delta)


def assert_one_line_error(capsys, named: str) -> str:
    """stderr is exactly one line and it names `named`; returns the line."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], lines
    return lines[0]


def assert_refused(capsys, argv: list[str], named: str, out) -> None:
    """`emulate ARGV --out OUT` exits 2 with one line on stderr naming `named`, and leaves no run directory."""
    from p2p_emulator.cli import main

    assert main([*argv, "--out", str(out)]) == 2
    assert_one_line_error(capsys, named)
    assert not out.exists()


@pytest.fixture
def two_nodes() -> nx.Graph:
    return nx.path_graph(2)


_TOPICS = {
    "cats": "The cat sat on the mat and looked at the moon. A cat will always land on its feet.",
    "code": "Programs must be written for people to read, and only incidentally for machines to run.",
    "food": "An apple a day keeps the doctor away, but an onion a day keeps everyone away.",
    "sea": "The sea is calm tonight. The tide is full, the moon lies fair upon the straits.",
}


def write_fortunes(root, repeats: int = 12):
    """A directory in the Debian fortunes layout (topic files of `%`-separated fortunes, each with a
    .dat index) holding a few short English topics, for runs that must not depend on the package."""
    root.mkdir(parents=True, exist_ok=True)
    for topic, sentence in _TOPICS.items():
        (root / topic).write_text("\n%\n".join([sentence] * repeats) + "\n%\n", encoding="utf-8")
        (root / f"{topic}.dat").write_bytes(b"\0" * 24)  # strfile's index: only its presence matters here
    return root


@pytest.fixture(scope="session")
def fortunes_root(tmp_path_factory):
    """`write_fortunes` in a session-wide folder: four topics, so four owners for --partition natural."""
    return write_fortunes(tmp_path_factory.mktemp("fortunes"))


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A fresh dataset cache: the .npz files (and torchvision's default root) under tmp_path, not the home,
    and nothing memoised in-process. Yields the cache folder."""
    from p2p_emulator.workloads import datasets

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    datasets.forget_loaded()
    yield tmp_path / "cache"
    datasets.forget_loaded()
