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
from workloads.task import WorkloadOptions
from workloads.training import float_state, mix

from .base import LearningProtocol


@dataclass
class DFedAvgMOptions(WorkloadOptions):
    local_epochs: int = field(default=1, metadata={"help": "local epochs per round"})
    local_steps: int = field(default=0, metadata={"help": "local SGD steps per round (0: use --local-epochs)"})
    lr: float = field(default=0.05, metadata={"help": "learning rate"})
    momentum: float = field(default=0.9, metadata={"help": "heavy-ball momentum"})
    weight_decay: float = field(default=5e-4, metadata={"help": "weight decay"})
    batch_size: int = field(default=32, metadata={"help": "local batch size"})
    mixing: str = field(default="mh", metadata={"help": "mixing weights: mh (Metropolis-Hastings) or uniform"})
    timeout: float = field(default=60.0, metadata={"help": "emulated seconds to wait for neighbours' messages"})

    def validate(self):
        if self.mixing not in ("mh", "uniform"):
            raise UsageError(f"--mixing {self.mixing!r}: choose mh or uniform")
        if self.lr <= 0 or self.batch_size < 1 or self.timeout <= 0:
            raise UsageError("--lr and --timeout must be positive and --batch-size at least 1")
        if self.local_steps < 0 or self.local_epochs < 1:
            raise UsageError("--local-epochs must be at least 1 and --local-steps not negative")




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
