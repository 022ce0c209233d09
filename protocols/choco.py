"""CHOCO-SGD (Koloskova, Lin, Stich, Jaggi, ICLR 2020): compressed gossip with momentum SGD.

Node i keeps x_i, its public copy x̂_i, and a copy x̂_j of each neighbour's; every x̂ starts at 0.
Each round, node i, in the order of the paper's Algorithm 1 (Algorithm 2 with momentum):
  1. takes --local-steps steps of SGD with heavy-ball momentum (the buffer carries between rounds):
     x_i <- x_i^{t+1/2};
  2. q_i = Q(x_i - x̂_i) with the operator --compress-op; x̂_i <- x̂_i + q_i;
  3. sends q_i to its (out-)neighbours, and adds each q_j it hears to x̂_j;
  4. x_i <- x_i + gamma sum_j w_ij (x̂_j - x̂_i), gamma = --consensus-step (unset: the operator's,
     compression.CONSENSUS_STEPS), w_ij Metropolis-Hastings (or uniform) from the two degrees.
--choco-order icml2019 runs the order of the reference code (epfml/ChocoSGD, dl_code/pcode/optim/
parallel_choco.py; Koloskova et al., ICML 2019): 1, then 4 on the copies of the last exchange, then 2
and 3. At the digits table's settings the two orders end within 0.33 points (docs/compression.md).
With --compress-op none and gamma 1 this is D-PSGD only with --momentum 0.
The paper assumes every q_j arrives. Here a neighbour not heard at the last exchange keeps its x̂_j for
later, and in step 4 gives its weight back to i (--silent-neighbours drop) or counts with that last x̂_j
(keep). A copy x̂_j that missed an increment is left out of step 4 until j, asked, sends its x̂_j whole
once, counted on the ledger (protocols/compression.py: PublicCopies).
Other departures from the reference code: every floating-point entry travels, BatchNorm's running
statistics with the weights, as in every averaging protocol here (the reference gossips the parameters
only); heavy-ball momentum, not the Nesterov momentum and learning-rate schedule of its ResNet-20
scripts; each x̂_j is kept whole (the reference keeps only sum_j w_ij x̂_j, which a lost increment
would leave wrong).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from emulator.compute import Resident
from emulator.protocol import register
from p2p_emulator.workloads.training import HeavyBall, shift

from .common import LearningProtocol, MixingOptions, SGDOptions, check, default
from .compression import CONSENSUS_STEPS, Operator, PublicCopies, difference, on_host


@dataclass
class ChocoOptions(MixingOptions, SGDOptions):
    local_steps: int = default(SGDOptions, "local_steps", 1)
    compress_op: str = field(default="sign", metadata={
        "help": "choco: Q, how x - x̂ is sent: topk:F, randk:F (F the share of each tensor's entries), sign, q8, "
                "q4, qsgd:s=S[,biased] or none"})
    consensus_step: float | None = field(default=None, metadata={
        "help": "choco: gamma, the consensus step size in (0, 1] (unset: the operator's, docs/compression.md)"})
    silent_neighbours: str = field(default="drop", metadata={
        "help": "choco: a neighbour not heard this round is left out of the consensus step, its weight kept by the "
                "node (drop), or counted with its last x̂ (keep)"})
    choco_order: str = field(default="iclr2020", metadata={
        "help": "choco: iclr2020 (compress, exchange, then the consensus step on the new copies) or icml2019 "
                "(the consensus step on the last exchange's copies, then compress and exchange)"})

    def validate(self):
        super().validate()
        operator = Operator.parse("compress-op", self.compress_op)
        if self.consensus_step is None:
            self.consensus_step = CONSENSUS_STEPS["choco"][operator.name]
        check("consensus-step", self.consensus_step, 0 < self.consensus_step <= 1, "must be in (0, 1]")
        check("silent-neighbours", repr(self.silent_neighbours), self.silent_neighbours in ("drop", "keep"),
              "choose drop or keep")
        check("choco-order", repr(self.choco_order), self.choco_order in ("iclr2020", "icml2019"),
              "choose iclr2020 or icml2019")


@dataclass
class Carried:
    """What a node carries from round to round: x_i, its momentum, x̂_i and the x̂_j."""
    model: Resident
    momentum: Resident
    copies: PublicCopies
    rows: list = field(default_factory=list)  # [w_ij, j] of the neighbours mixed, as the last exchange left them


@register("choco")
class Choco(LearningProtocol):
    """CHOCO-SGD: momentum SGD, then gossip of compressed differences to the public copies x̂."""
    Options = ChocoOptions
    averages_models = True
    checkpointable = True
    # x, its momentum, x̂_i, an x̂_j per neighbour, the snapshot, frames in flight: 11.1 to 11.4 measured on a
    # 4-regular graph (./dev bench memory, docs/compression.md)
    state_copies = 12.0

    async def run(self, node):
        o = self.options
        operator = Operator.parse("compress-op", o.compress_op)
        model, data = self.hold(node)
        momentum = await node.compute(HeavyBall, model, o.lr, o.momentum, o.weight_decay, work=0, keep=True)
        zeros = {name: value.zero_() for name, value in on_host(await self.state(node, model)).items()}
        # every x̂_j starts at 0: a broadcast view of one zero holds that start in no memory
        copies = PublicCopies(public=zeros, start={k: v.new_zeros(()).expand(v.shape) for k, v in zeros.items()})
        carried = node.carry(Carried(model, momentum, copies))
        valid = copies.check(operator, node.num_nodes)
        async for _ in node.rounds():
            loss = await self.train(node, model, data, carried=momentum)  # 1
            if o.choco_order == "icml2019":
                await self.consensus(node, model, carried)
            q = operator.compress(difference(on_host(await self.state(node, model)), copies.public), node.np_rng)  # 2
            copies.advance(operator.decompress(q, copies.public))
            copies.send(node, "choco", q, degree=len(node.in_neighbours))  # 3
            heard = await node.gather("choco", timeout=o.timeout, valid=valid)
            copies.receive(node, heard, operator)
            carried.rows = copies.rows(node, o.mixing, heard if o.silent_neighbours == "drop" else None)
            if o.choco_order == "iclr2020":
                await self.consensus(node, model, carried)  # 4
            node.snapshot(await self.state(node, model))
            node.log(train_loss=loss, **await self.evaluate(node, model, data), heard_from=len(heard),
                     stale_copies=len(copies.stale))

    async def consensus(self, node, model, carried: Carried) -> None:
        """x_i <- x_i + gamma sum_j w_ij (x̂_j - x̂_i), over the rows of the last exchange: the neighbours heard
        then (drop) or every neighbour whose x̂_j was whole (keep), with the weights of that round's graph."""
        step = carried.copies.consensus(carried.rows, self.options.consensus_step)
        await node.compute(shift, model, step, work=0)
