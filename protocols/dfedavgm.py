"""DFedAvgM (Sun et al., 2021): decentralised FedAvg with momentum.

Each round, node i:
  1. runs local SGD with heavy-ball momentum (the buffer starts fresh every round);
  2. sends its model to every neighbour;
  3. mixes x_i <- w_ii x_i + sum_{j heard} w_ij x_j with its Metropolis-Hastings
     (or uniform) row; a neighbour not heard from before the timeout (offline,
     link down, straggling) gives its weight back to i. Only floating-point
     tensors are averaged.
On a directed graph (e.g. --topology-schedule one-peer-exponential) a node sends
to its out-neighbours and mixes what its in-neighbours sent, with degrees counted
as in-degrees (one-peer exponential: half its own model, half the one received).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from emulator.errors import UsageError
from emulator.protocol import register
from topologies import neighbour_weight
from workloads.training import float_state, mix

from .base import LearningProtocol, TrainingOptions


@dataclass
class DFedAvgMOptions(TrainingOptions):
    mixing: str = field(default="mh", metadata={"help": "mixing weights: mh (Metropolis-Hastings) or uniform"})
    timeout: float = field(default=60.0, metadata={"help": "emulated seconds to wait for neighbours' messages"})

    def validate(self):
        super().validate()
        if self.mixing not in ("mh", "uniform"):
            raise UsageError(f"--mixing {self.mixing!r}: choose mh or uniform")
        if not self.timeout > 0:
            raise UsageError(f"--timeout {self.timeout}: must be positive")


@register("dfedavgm")
class DFedAvgM(LearningProtocol):
    """DFedAvgM: local momentum SGD, then Metropolis-Hastings model averaging."""
    Options = DFedAvgMOptions
    averages_models = True

    async def run(self, node):
        o = self.options
        model, data = self.workload.model(node.id), self.workload.data(node.id)
        for _ in node.rounds():
            loss = await self.train(node, model, data)
            degree = len(node.in_neighbours)
            node.broadcast("model", {"state": float_state(model), "degree": degree})
            heard = await node.gather("model", timeout=o.timeout)
            weights = [(neighbour_weight(o.mixing, degree, m.body["degree"]), m.body["state"]) for m in heard.values()]
            mix(model, 1.0 - sum(w for w, _ in weights), weights)
            node.snapshot(float_state(model))
            node.log(train_loss=loss, **await self.evaluate(node, model, data), heard_from=len(heard))
