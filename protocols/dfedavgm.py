"""DFedAvgM (Sun et al., 2021): decentralised FedAvg with momentum.

Each round, node i:
  1. runs local SGD with heavy-ball momentum (the buffer starts fresh every round);
  2. sends its model to every neighbour;
  3. mixes x_i <- w_ii x_i + sum_{j heard} w_ij x_j with its Metropolis-Hastings
     (or uniform) row; a neighbour not heard from before the timeout (offline,
     link down, straggling) gives its weight back to i. Only floating-point
     tensors are averaged. With --aggregate median, trimmed:BETA or krum:f=F,
     step 3 is that robust rule over x_i and the models heard, equally weighted.
On a directed graph (e.g. --topology-schedule one-peer-exponential) a node sends
to its out-neighbours and mixes what its in-neighbours sent, with degrees counted
as in-degrees (one-peer exponential: half its own model, half the one received).
"""
from __future__ import annotations

from dataclasses import dataclass

from emulator.protocol import register
from workloads.training import aggregate, mix

from .common import DEGREE, STATE, CarriedModel, LearningProtocol, RobustMixingOptions, SGDOptions, degree_weights, like, own_row


@dataclass
class DFedAvgMOptions(RobustMixingOptions, SGDOptions):
    pass


@register("dfedavgm")
class DFedAvgM(LearningProtocol):
    """DFedAvgM: local momentum SGD, then Metropolis-Hastings model averaging."""
    Options = DFedAvgMOptions
    averages_models = True
    checkpoints = True

    async def run(self, node):
        model, data = self.hold(node)
        node.carry(CarriedModel(model))  # x_i; the momentum buffer starts fresh each round
        async for _ in node.rounds():
            loss = await self.train(node, model, data)  # 1
            heard_from = await self.average(node, model)  # 2-3
            node.snapshot(await self.state(node, model))
            node.log(train_loss=loss, **await self.evaluate(node, model, data), heard_from=heard_from)

    async def average(self, node, model) -> int:
        """Steps 2-3; returns how many neighbours were heard. Their models go with this call, once mixed."""
        o = self.options
        degree = len(node.in_neighbours)
        body = {STATE: await self.state(node, model), DEGREE: degree}
        node.broadcast("model", body)  # 2
        heard = await node.gather("model", timeout=o.timeout, valid=like(body))
        rule, param = o.robust_rule
        if rule == "mean":
            self_weight, row = own_row(degree_weights(o.mixing, degree, heard))  # 3
            await node.compute(mix, model, self_weight, [(w, heard[j].body[STATE]) for w, j in row], work=0)
        else:  # a robust rule in place of step 3's weighted mean
            await node.compute(aggregate, model, [message.body[STATE] for message in heard.values()], rule, param,
                               work=0)
        return len(heard)
