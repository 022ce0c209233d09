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

With --sparsify Q, step 2 sends Q(x_i - r_i) instead, and step 3 mixes the copies x̂_j
the neighbours' increments build (protocols/compression.py); every copy starts at the
common x0. Without --error-feedback r_i is x_i at the last send, so what Q dropped is
lost; with it r_i is x̂_i, so what Q dropped is sent later (Stich et al. 2018; Karimireddy
et al. 2019). A neighbour whose x̂_j missed an increment is left out until it is whole again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from emulator.compute import Resident
from emulator.errors import UsageError
from emulator.protocol import register
from topologies import neighbour_weight
from p2p_emulator.workloads.training import aggregate, mix

from .common import DEGREE, STATE, LearningProtocol, RobustMixingOptions, SGDOptions, like, own_row
from .compression import Operator, PublicCopies, copied, difference, on_host


@dataclass
class DFedAvgMOptions(RobustMixingOptions, SGDOptions):
    sparsify: str = field(default="none", metadata={"help": (
        "dfedavgm, dpsgd: send Q(x - r) instead of x, Q one of topk:F, randk:F (F the share of each tensor's "
        "entries), sign, q8, q4 (none: send x)")})
    error_feedback: bool = field(default=False, metadata={"help": (
        "dfedavgm, dpsgd with --sparsify: r is what the neighbours hold of x, so what Q dropped is sent later "
        "(without it, r is x at the last send)")})

    def validate(self):
        super().validate()
        if self.operator.name == "none" and self.error_feedback:  # the operator first: parsing it checks it
            raise UsageError("--error-feedback: needs --sparsify")

    @property
    def operator(self) -> Operator:
        return Operator.parse("sparsify", self.sparsify)


@dataclass
class Carried:
    """What a node carries from round to round: x_i (the momentum buffer starts fresh each round);
    with --sparsify, the copies x̂ and, without --error-feedback, x_i at the last send."""
    model: Resident
    copies: PublicCopies | None = None
    last_sent: dict | None = None


@register("dfedavgm")
class DFedAvgM(LearningProtocol):
    """DFedAvgM: local momentum SGD, then Metropolis-Hastings model averaging."""
    Options = DFedAvgMOptions
    averages_models = True
    checkpointable = True

    async def run(self, node):
        model, data = self.hold(node)
        carried = node.carry(await self.carried(node, model))
        valid = None if carried.copies is None else carried.copies.check(self.options.operator, node.num_nodes)
        async for _ in node.rounds():
            loss = await self.train(node, model, data)  # 1
            heard_from = await self.average(node, model, carried, valid)  # 2-3
            node.snapshot(await self.state(node, model))
            node.log(train_loss=loss, **await self.evaluate(node, model, data), heard_from=heard_from)

    async def carried(self, node, model) -> Carried:
        o = self.options
        if o.sparsify == "none":
            return Carried(model)
        x0 = on_host(await self.state(node, model))
        common = o.init == "common"  # then every node's x̂ starts at the x0 they all drew from the seed
        copies = PublicCopies(public=x0, start=copied(x0) if common else None)
        return Carried(model, copies, None if o.error_feedback else copied(x0))

    async def average(self, node, model, carried: Carried, valid=None) -> int:
        """Steps 2-3; returns how many neighbours were heard. Their models go with this call, once mixed.
        valid: with --sparsify, the check of what the neighbours send."""
        o = self.options
        degree = len(node.in_neighbours)
        if carried.copies is None:
            body = {STATE: await self.state(node, model), DEGREE: degree}
            node.broadcast("model", body)  # 2
            heard = await node.gather("model", timeout=o.timeout, valid=like(body))
            models = {j: (message.body[DEGREE], message.body[STATE]) for j, message in heard.items()}
        else:
            models = await self.send_compressed(node, model, carried, valid)
        rule, param = o.robust_rule
        if rule == "mean":
            self_weight, row = own_row({j: neighbour_weight(o.mixing, degree, d) for j, (d, _) in models.items()})  # 3
            await node.compute(mix, model, self_weight, [(w, models[j][1]) for w, j in row], work=0)
        else:  # a robust rule in place of step 3's weighted mean
            await node.compute(aggregate, model, [state for _, state in models.values()], rule, param, work=0)
        return len(models)

    async def send_compressed(self, node, model, carried: Carried, valid) -> dict[int, tuple[int, dict]]:
        """Step 2 with --sparsify; (degree, x̂_j) of each neighbour heard whose x̂_j is whole."""
        o, copies = self.options, carried.copies
        operator = o.operator
        x = on_host(await self.state(node, model))
        q = operator.compress(difference(x, copies.public if o.error_feedback else carried.last_sent), node.np_rng)
        copies.advance(operator.decompress(q, x))
        if not o.error_feedback:
            carried.last_sent = x
        copies.send(node, "model", q, degree=len(node.in_neighbours))
        heard = await node.gather("model", timeout=o.timeout, valid=valid)
        copies.receive(node, heard, operator)
        return {j: (copies.degrees[j], copies.copies[j]) for j in heard if copies.in_step(j)}
