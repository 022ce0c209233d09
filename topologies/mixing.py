"""Mixing (gossip averaging) weights: row i maps node i and each neighbour j to w_ij; rows sum to 1."""
from __future__ import annotations

import networkx as nx

from .errors import TopologyError

KINDS = ("mh", "uniform")


def metropolis_hastings(deg_i: int, deg_j: int) -> float:
    return 1.0 / (1 + max(deg_i, deg_j))


def neighbour_weight(kind: str, deg_i: int, deg_j: int) -> float:
    """w_ij from the two degrees alone, so a node can compute its row from what neighbours tell it.

    On a directed graph pass in-degrees (how many nodes i hears from): 'uniform' then
    averages i with its in-neighbours, and on a graph where every node has one in- and
    one out-neighbour (one-peer exponential) both kinds give 1/2, a doubly stochastic row.
    """
    if kind == "mh":
        return metropolis_hastings(deg_i, deg_j)
    if kind == "uniform":
        return 1.0 / (1 + deg_i)
    raise TopologyError(f"unknown mixing {kind!r}; use mh or uniform")


def mixing_weights(graph: nx.Graph, kind: str = "mh") -> dict[int, dict[int, float]]:
    """`mh`: Metropolis–Hastings, symmetric and doubly stochastic (undirected graphs only).
    `uniform`: 1/(d_i+1) for i and each neighbour; on a directed graph the neighbours
    are in-neighbours, the nodes whose values i receives.
    """
    if kind == "mh":
        return _metropolis_hastings(graph)
    if kind == "uniform":
        return _uniform(graph)
    raise TopologyError(f"unknown mixing weights {kind!r}; choose one of {', '.join(KINDS)}")


def _metropolis_hastings(graph: nx.Graph) -> dict[int, dict[int, float]]:
    if graph.is_directed():
        raise TopologyError("mh mixing weights need an undirected graph; use 'uniform'")
    weights = {}
    for i in graph:
        row = {j: metropolis_hastings(graph.degree[i], graph.degree[j]) for j in graph[i]}
        row[i] = 1.0 - sum(row.values())
        weights[i] = row
    return weights


def _uniform(graph: nx.Graph) -> dict[int, dict[int, float]]:
    neighbours = graph.predecessors if graph.is_directed() else graph.neighbors
    weights = {}
    for i in graph:
        peers = [i, *neighbours(i)]
        weights[i] = {j: 1.0 / len(peers) for j in peers}
    return weights
