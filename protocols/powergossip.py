"""PowerGossip (Vogels, Karimireddy, Jaggi, NeurIPS 2020, Algorithm 1; reference code epfml/powergossip).

Each pair of neighbours (i, j) runs warm-started power iterations on the difference of their
models, one tensor at a time (each seen as a matrix M, m x n, of its first dimension by the rest).
The pair shares, for each tensor, a basis b of rank r = min(m, n, --rank): drawn from a stream both
derive from the run's seed and the pair, then carried from step to step. Each round, node i first
takes --local-steps steps of SGD, then --power-steps times:
  1. for each neighbour j: b <- orthonormal columns of b (QR); send p_i = M_i^T b (an even step, n x r)
     or M_i b (an odd step, m x r) for each tensor;
  2. for each neighbour j heard: d = p_hi - p_lo (hi, lo: the larger and the smaller id of the pair),
     so d = (M_hi - M_lo)^T b or (M_hi - M_lo) b on both sides;
     M_i <- M_i -+ w_ij (b d^T or d b^T)   (minus for hi, plus for lo), and b <- d for the next step.
w_ij is Metropolis-Hastings (or uniform) from the two degrees. Both sides apply the same rank-r
projection of their difference, so the pair moves towards each other and their sum is kept.
The paper assumes every exchange completes. Here each message carries the step the pair's basis
was drawn at and the exchanges completed since. A side that missed an exchange redraws at the next
step (its basis no longer fits the step); a pair whose two messages disagree skips the update, and
both sides redraw at the step after, from their shared stream, so they are in step again.
Only pairs that are each other's neighbours exchange (on a directed graph, the mutual ones).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from emulator.compute import Resident
from emulator.protocol import register
from topologies import neighbour_weight
from p2p_emulator.workloads.lazy import LazyModule
from p2p_emulator.workloads.training import shift

from .common import DEGREE, LearningProtocol, MixingOptions, SGDOptions, check, default, expects
from .compression import on_host

torch = LazyModule("torch")


@dataclass
class PowerGossipOptions(MixingOptions, SGDOptions):
    local_steps: int = default(SGDOptions, "local_steps", 1)
    momentum: float = default(SGDOptions, "momentum", 0.0)
    rank: int = field(default=1, metadata={"help": "powergossip: rank of each exchanged difference"})
    power_steps: int = field(default=1, metadata={"help": "powergossip: power-iteration steps per round"})

    def validate(self):
        super().validate()
        check("rank", self.rank, self.rank >= 1, "must be at least 1")
        check("power-steps", self.power_steps, self.power_steps >= 1, "must be at least 1")


def as_matrix(t):
    """A tensor as the matrix PowerGossip compresses: its first dimension by the rest."""
    return t.reshape(t.shape[0] if t.dim() else 1, -1)


@dataclass
class Carried:
    """What a node carries from round to round: x_i and its state with each neighbour."""
    model: Resident
    # j -> the pair's state, the same on both sides while they are in step: {"basis": {tensor name: b},
    # "drawn": the step b was drawn at, "done": exchanges completed since}; b serves step drawn + done
    pairs: dict = field(default_factory=dict)
    step: int = 0  # power steps taken


@register("powergossip")
class PowerGossip(LearningProtocol):
    """PowerGossip: SGD, then low-rank power-iteration gossip on each pair's model difference."""
    Options = PowerGossipOptions
    averages_models = True
    checkpointable = True
    state_copies = 8.0  # 6.6 to 7.3 measured on a 4-regular graph (./dev bench memory, docs/compression.md)

    async def run(self, node):
        o = self.options
        model, data = self.hold(node)
        carried = node.carry(Carried(model))
        shapes = {name: as_matrix(value).shape for name, value in (await self.state(node, model)).items()}
        valid = [self.message_check(shapes, parity) for parity in (0, 1)]
        async for _ in node.rounds():
            loss = await self.train(node, model, data)
            heard = [await self.power_step(node, model, carried, shapes, k, valid[carried.step % 2])
                     for k in range(o.power_steps)]
            node.snapshot(await self.state(node, model))
            node.log(train_loss=loss, **await self.evaluate(node, model, data), heard_from=min(heard))

    def message_check(self, shapes: dict, parity: int):
        """A check of the products a neighbour sends at an even (parity 0) or odd step."""
        products = {name: torch.zeros(n if parity == 0 else m, min(m, n, self.options.rank))
                    for name, (m, n) in shapes.items()}
        return expects(**{DEGREE: int, "pair": [0, 0], "products": products})

    async def power_step(self, node, model, carried: Carried, shapes: dict, k: int, valid) -> int:
        """Steps 1-2 with every neighbour; returns how many were heard."""
        x = on_host(await self.state(node, model))
        sizes = {name: value.shape for name, value in x.items()}
        matrices = {name: as_matrix(value) for name, value in x.items()}
        peers = [j for j in node.neighbours if j in node.in_neighbours]  # pairs: both send, both hear
        sent = {j: self.send_products(node, carried, j, matrices, shapes, k) for j in peers}  # 1
        del x, matrices  # not held while the node waits: a model's worth per node
        heard = await node.gather(f"power-{k}", peers=peers, timeout=self.options.timeout, valid=valid)
        update = {name: torch.zeros(shape) for name, shape in shapes.items()}
        for j, message in heard.items():  # 2
            self.add_pair_update(update, node, carried, j, sent[j], message.body)
        carried.step += 1
        await node.compute(shift, model, {name: value.view(sizes[name]) for name, value in update.items()}, work=0)
        return len(heard)

    def send_products(self, node, carried: Carried, j: int, matrices: dict, shapes: dict, k: int) -> dict:
        """Step 1 with neighbour j: orthonormalise the pair's basis, send M^T b or M b; what was sent."""
        step = carried.step
        pair = carried.pairs.get(j)
        if pair is None or pair["drawn"] + pair["done"] != step:  # new, or it missed an exchange: redraw
            pair = carried.pairs[j] = self.draw(node, j, shapes, step)
        basis = pair["basis"] = {name: torch.linalg.qr(b).Q for name, b in pair["basis"].items()}
        products = {name: (m.T if step % 2 == 0 else m) @ basis[name] for name, m in matrices.items()}
        node.send(j, f"power-{k}", {DEGREE: len(node.in_neighbours), "pair": [pair["drawn"], pair["done"]],
                                    "products": products})
        return products

    def add_pair_update(self, update: dict, node, carried: Carried, j: int, mine: dict, body: dict) -> None:
        """Step 2 with neighbour j: add -+w_ij times the rank-r projection of the pair's difference."""
        pair, even = carried.pairs[j], carried.step % 2 == 0
        if body["pair"] != [pair["drawn"], pair["done"]]:  # out of step: both sides redraw at the next step
            return
        hi = node.id > j
        w = neighbour_weight(self.options.mixing, len(node.in_neighbours), body[DEGREE])
        for name, product in mine.items():
            theirs, b = body["products"][name], pair["basis"][name]
            d = product - theirs if hi else theirs - product  # (M_hi - M_lo)^T b, or (M_hi - M_lo) b
            update[name].add_(b @ d.T if even else d @ b.T, alpha=-w if hi else w)
            pair["basis"][name] = d
        pair["done"] += 1

    def draw(self, node, j: int, shapes: dict, step: int) -> dict:
        """The pair's basis for `step`, from the stream both sides derive from the seed and the pair."""
        rng = node.seeds.numpy("powergossip", min(node.id, j), max(node.id, j), step)
        rank = self.options.rank
        basis = {name: torch.from_numpy(rng.standard_normal((n if step % 2 else m, min(m, n, rank)), np.float32))
                 for name, (m, n) in shapes.items()}
        return {"basis": basis, "drawn": step, "done": 0}
