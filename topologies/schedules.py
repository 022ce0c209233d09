"""Time-varying topologies: the graph for a given round, and schedules of them.

A schedule maps a round r to a graph: `graph(r)`; `key(r)` names the distinct
graph of round r (rounds with the same key have the same graph), so that a
caller can build each graph once. A schedule `in_time` (resample:every=5s) is
keyed by emulated time instead: `index(t)` is the r whose graph holds at t.
"""
from __future__ import annotations

import bisect
import inspect
import math
import warnings

import networkx as nx
import numpy as np

from emulator import units

from . import files
from .errors import TopologyError, TopologyWarning
from .graphs import TOPOLOGIES
from .spec import build, parse


def one_peer_exponential(n: int, t: int, directed: bool = False) -> nx.Graph:
    """Round t of the one-peer exponential graph: edges i -> (i + 2^k) mod n with k = t mod tau.

    tau = log2 n when n is a power of two, else floor(log2 n). Each node i sends to
    i + 2^k and receives from i - 2^k. Directed, that is one out- and one in-neighbour
    per node. Undirected, every node has degree 2, except when 2^k = n/2, where the
    two coincide and the edges form a perfect matching.
    """
    if n < 2:
        raise TopologyError(f"one-peer exponential: needs n >= 2, got n={n}")
    offset = 2 ** (t % _tau(n))
    graph = nx.DiGraph() if directed else nx.Graph()
    graph.add_nodes_from(range(n))
    graph.add_edges_from((i, (i + offset) % n) for i in range(n))
    graph.graph["name"] = f"one-peer exponential (round {t})"
    return graph


def _tau(n: int) -> int:
    return n.bit_length() - 1  # == floor(log2 n), exactly


def resample(spec: str, n: int | None, seed: int, round_index: int, every: int) -> nx.Graph:
    """build(spec, n, seed') with seed' fixed by (seed, round_index // every): a new graph every `every` rounds."""
    if every < 1:
        raise TopologyError(f"resample: every must be >= 1, got {every}")
    # SeedSequence mixes the pair well and wants non-negative entropy, hence the modulus.
    epoch_seed = np.random.SeedSequence([seed % 2 ** 64, round_index // every]).generate_state(1)[0]
    return build(spec, n, int(epoch_seed))


class Resampled:
    """A fresh draw of a random topology every `every` rounds, or with `seconds`, every that many emulated
    seconds (the draw of [k S, (k + 1) S) is that of index k)."""
    directed = False

    def __init__(self, spec: str, n: int, seed: int, every: int, seconds: float = 0.0):
        name, _ = parse(spec)
        function = TOPOLOGIES.get(name)
        if function is None or "seed" not in inspect.signature(function).parameters:
            random = [k for k, f in TOPOLOGIES.items() if "seed" in inspect.signature(f).parameters]
            raise TopologyError(f"resample needs a random named topology ({', '.join(random)}), got {spec!r}")
        if every < 1:
            raise TopologyError(f"resample: every must be >= 1, got {every}")
        self.spec, self.num_nodes, self.seed, self.every = spec, n, seed, every
        self.in_time, self.seconds = seconds > 0, seconds
        self.first = resample(spec, n, seed, 0, every)  # a bad spec fails now, not mid-run

    def index(self, t: float) -> int:
        """The index of the draw that holds at emulated instant t (in_time)."""
        return math.floor(t / self.seconds)

    def key(self, rnd: int) -> int:
        return rnd // self.every

    def graph(self, rnd: int) -> nx.Graph:
        if self.key(rnd) == 0:
            return self.first
        with warnings.catch_warnings():  # a disconnected draw is reported once, for round 0
            warnings.simplefilter("ignore", TopologyWarning)
            return resample(self.spec, self.num_nodes, self.seed, rnd, self.every)


class OnePeerExponential:
    """The directed one-peer exponential graph of each round (period floor(log2 n))."""
    directed = True
    in_time = False

    def __init__(self, n: int):
        one_peer_exponential(n, 0)  # checks n
        self.num_nodes = n

    def key(self, rnd: int) -> int:
        return rnd % _tau(self.num_nodes)

    def graph(self, rnd: int) -> nx.Graph:
        return one_peer_exponential(self.num_nodes, rnd, directed=True)


class FromFile:
    """Graphs read from a schedule file, one per round, the list repeating when the run is longer; or one per
    instant (a `t` column), each holding until the next, the last to the end of the run."""

    def __init__(self, path: str):
        self.path = path
        self.graphs, self.period, self.num_nodes, self.directed = files.read_schedule(path)
        self.in_time = self.period == 0
        self.instants = sorted(self.graphs)

    def index(self, t: float) -> int:
        """The index of the instant whose graph holds at t (in_time)."""
        return bisect.bisect_right(self.instants, t) - 1

    def key(self, rnd: int) -> int:
        return rnd if self.in_time else rnd % self.period

    def graph(self, rnd: int) -> nx.Graph:
        if self.in_time:
            return self.graphs[self.instants[rnd]]
        key = self.key(rnd)
        graph = self.graphs.get(key)
        return graph if graph is not None else files.empty_round(self.path, key, self.num_nodes, self.directed)


SCHEDULES = ("resample:every=K", "resample:every=Ss", "one-peer-exponential", "FILE")


def schedule(spec: str, topology: str, n: int, seed: int):
    """The schedule for a --topology-schedule value; `topology` is what `resample` draws from."""
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    if name.replace("_", "-").lower() == "one-peer-exponential" and not rest:
        return OnePeerExponential(n)
    if files.looks_like_path(spec):
        return FromFile(spec)
    if name.lower() == "resample":
        every = _every(rest, spec)
        if isinstance(every, float):
            return Resampled(topology, n, seed, 1, seconds=every)
        return Resampled(topology, n, seed, every)
    raise TopologyError(f"unknown schedule {spec!r}; use one of {', '.join(SCHEDULES)}")


def _every(options: str, spec: str) -> int | float:
    """The K of resample:every=K (whole rounds, an int), or the S of every=Ss (emulated seconds with a unit, a
    positive float), read from `options`, the text after the colon."""
    usage = (f"resample: expected resample:every=K with K a whole number of rounds, or every=S with a unit "
             f"(every=5s: emulated seconds), got {spec!r}")
    try:
        every = units.read_spec(options, named=False).keywords(("every",), usage=usage)["every"]
        if every.isdigit():
            return int(every)
        seconds = units.duration(every)
    except (units.SpecError, units.UnitError):
        raise TopologyError(usage) from None
    if every[-1:].isdigit() or seconds <= 0:
        raise TopologyError(usage)
    return seconds
