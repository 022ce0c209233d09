"""Time-varying topologies: the graph for a given round."""
from __future__ import annotations

import networkx as nx
import numpy as np

from .errors import TopologyError
from .spec import build


def one_peer_exponential(n: int, t: int) -> nx.Graph:
    """Round t of the one-peer exponential graph: edges {i, (i + 2^k) mod n} with k = t mod tau.

    tau = log2 n when n is a power of two, else floor(log2 n). Each node i sends to
    i + 2^k and receives from i - 2^k; as an undirected graph that makes every node
    degree 2, except when 2^k = n/2, where the two coincide and the edges form a
    perfect matching.
    """
    if n < 2:
        raise TopologyError(f"one-peer exponential: needs n >= 2, got n={n}")
    offset = 2 ** (t % (n.bit_length() - 1))  # bit_length - 1 == floor(log2 n), exactly
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    graph.add_edges_from((i, (i + offset) % n) for i in range(n))
    graph.graph["name"] = f"one-peer exponential (round {t})"
    return graph


def resample(spec: str, n: int | None, seed: int, round_index: int, every: int) -> nx.Graph:
    """build(spec, n, seed') with seed' fixed by (seed, round_index // every): a new graph every `every` rounds."""
    if every < 1:
        raise TopologyError(f"resample: every must be >= 1, got {every}")
    # SeedSequence mixes the pair well and wants non-negative entropy, hence the modulus.
    epoch_seed = np.random.SeedSequence([seed % 2 ** 64, round_index // every]).generate_state(1)[0]
    return build(spec, n, int(epoch_seed))
