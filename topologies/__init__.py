"""Topologies for the emulator: graphs only (no links, clocks or learning).

    build(spec, n, seed)       a named topology ('ring', 'regular:d=4', ...) or a file
    describe(graph)            one-line summary
    mixing_weights(graph, kind) gossip weights ('mh' or 'uniform')
    one_peer_exponential(n, t[, directed]), resample(spec, n, seed, round_index, every)
                               graphs for time-varying schedules
    schedule(spec, topology, n, seed)
                               a time-varying topology: .graph(round), .key(round)
"""
from .errors import TopologyError, TopologyWarning
from .graphs import NAMES, ba, er, exponential, grid, line, mesh, regular, ring, star, torus, ws
from .mixing import metropolis_hastings, mixing_weights, neighbour_weight
from .schedules import one_peer_exponential, resample, schedule
from .spec import build, describe, parse

__all__ = [
    "TopologyError", "TopologyWarning", "NAMES", "build", "describe", "parse",
    "mixing_weights", "metropolis_hastings", "neighbour_weight", "one_peer_exponential", "resample", "schedule",
    "mesh", "ring", "line", "star", "grid", "torus", "regular", "er", "ws", "ba", "exponential",
]
