"""Gossip averaging of a vector: the reference protocol, with no model.

Each round every node sends (x_i, deg_i) to its neighbours and sets
x_i <- w_ii x_i + sum_j w_ij x_j over the neighbours heard from, with
Metropolis-Hastings weights w_ij = 1/(1+max(deg_i, deg_j)) computed from the
degree that rides on each message; a silent neighbour's weight stays with i
(a neighbour offline, its link down, or too slow for --timeout).
On a connected graph every x_i converges to the mean of the initial values.

On a directed graph a node sends to its out-neighbours, hears from its
in-neighbours, and its degree is the in-degree: on the one-peer exponential graph
that is x_i <- (x_i + x_j) / 2 with j the one node that sends to i.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from emulator.protocol import Protocol, register

from .common import DEGREE, MixingOptions, check, default, degree_weights, like, own_row


@dataclass
class GossipOptions(MixingOptions):
    timeout: float = default(MixingOptions, "timeout", 5.0)
    dim: int = field(default=16, metadata={"help": "gossip: length of the averaged vector"})

    def validate(self):
        super().validate()
        check("dim", self.dim, self.dim >= 1, "must be at least 1")


@dataclass
class Carried:
    """What a node carries from round to round: its value x_i."""
    x: np.ndarray


@register("gossip")
class Gossip(Protocol):
    """Gossip averaging of a vector (no model); converges to the mean."""
    Options = GossipOptions
    checkpointable = True

    def __init__(self, options, run_info):
        super().__init__(options, run_info)
        # What gossip converges to, for the observer: the mean of all initial values (drawn once, not per round).
        self.target = np.mean([self.initial(i) for i in range(run_info.num_nodes)], axis=0)
        # What a neighbour's message looks like: one check for all nodes (it holds no state), not 1.5 KB each.
        self.valid = like({"x": np.zeros(options.dim), DEGREE: 0})

    def initial(self, node_id: int) -> np.ndarray:
        """x_i at the start: a standard normal draw from node i's own stream."""
        return self.run_info.seeds.numpy("gossip.initial", node_id).normal(size=self.options.dim)

    async def run(self, node):
        state = node.carry(Carried(self.initial(node.id)))
        async for _ in node.rounds():
            x = state.x
            degree = len(node.in_neighbours)
            node.broadcast("x", {"x": x, DEGREE: degree})
            heard = await node.gather("x", timeout=self.options.timeout, valid=self.valid)
            _, row = own_row(degree_weights(self.options.mixing, degree, heard))
            # w_ii x + sum_j w_ij x_j as x + sum_j w_ij (x_j - x): the same row, as w_ii = 1 - sum_j w_ij
            mixed = x.copy()
            for w, j in row:
                mixed += w * (heard[j].body["x"] - x)
            state.x = mixed
            node.snapshot(mixed)
            node.log(heard_from=len(heard))

    def observe(self, rnd, snapshots):
        """error: ||x_i - the mean of all initial values||; consensus_distance: ||x_i - the mean of this round's x||."""
        x = np.stack(list(snapshots.values()))  # one row per node: a vectorised pass over every node
        errors = np.linalg.norm(x - self.target, axis=1)
        distances = np.linalg.norm(x - x.mean(axis=0), axis=1)
        return {i: {"error": float(e), "consensus_distance": float(d)}
                for i, e, d in zip(snapshots, errors, distances)}
