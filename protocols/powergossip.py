"""PowerGossip (Vogels, Karimireddy, Jaggi, NeurIPS 2020, Algorithm 1; reference code epfml/powergossip).

Each pair of neighbours (i, j) runs warm-started power iterations on the difference of their
models, one tensor at a time (each seen as a matrix M, m x n, of its first dimension by the rest),
for the tensors of dimension >= 2; the tensors of dimension <= 1 (biases, BatchNorm's weights,
biases and running statistics) are gossiped exactly, as the reference's OnlyOnLargeParameters
does. The pair shares, for each matrix, a basis b of rank r = min(m, n, --rank): drawn from a
stream both derive from the run's seed and the pair, then carried from step to step. Each round,
node i first takes --local-steps steps of SGD, then --power-steps times (s counts power steps
since the start, K = --power-steps; s + K is the reference's iteration number, even or odd):
  1. for each neighbour j: b <- orthonormal columns of b (QR); send p_i = M_i^T b (s + K even,
     n x r) or M_i b (odd, m x r) for each matrix, and, in the round's first power step only,
     its tensors of dimension <= 1 whole (v_i);
  2. for each neighbour j heard: d = p_hi - p_lo (hi, lo: the larger and the smaller id of the pair),
     so d = (M_hi - M_lo)^T b or (M_hi - M_lo) b on both sides;
     M_i <- M_i -+ gamma w_ij (b d^T or d b^T)   (minus for hi, plus for lo), and b <- d for the next step;
     v_i <- v_i + w_ij (v_j - v_i)   (first power step of the round only).
gamma = --consensus-step (the reference's diffusion rate, default 1; its ResNet-20 CIFAR-10 runs
use 1.308) scales the low-rank part only, as in the reference, whose OnlyOnLargeParameters builds
its SimpleGossip for the small tensors without the rate. w_ij is Metropolis-Hastings (or uniform)
from the two degrees, the same for both parts. Both sides apply the same rank-r projection of
their difference, and opposite exact differences, so the pair moves towards each other and their
sum is kept.
The paper assumes every exchange completes. Here each message carries the step the pair's basis
was drawn at and the exchanges completed since. A side that missed an exchange redraws at the next
step (its basis no longer fits the step); a pair whose two messages disagree skips the low-rank
update, and both sides redraw at the step after, from their shared stream, so they are in step
again. The exact part needs no shared state: it is applied whenever the message is heard.
Only pairs that are each other's neighbours exchange (on a directed graph, the mutual ones).

Where this departs from epfml/powergossip (algorithms.py: PowerGossip, OnlyOnLargeParameters,
SimpleGossip; train.py: get_optimizer):
- Order within a round. The reference wraps the gossip in its overlapping DPSGD: the gradient is
  taken at x_t, the gossip runs on x_t, and the SGD step is applied to the gossiped model
  (x_{t+1} = G(x_t) - lr m_t). Here the node trains first, then gossips the trained model
  (x_{t+1} = G(x_t - lr m_t)), as this repository's D-PSGD does.
- The first step. The reference skips its iteration 0 (all its models start equal and it gossips
  before the first update, so the difference, and a warm start from it, would be zero); here the
  first power step follows local training, so none is skipped. Its first products are iteration
  K's, and ours have the same parity (s + K).
- Random stream. Both sides draw b from the run's seeds (node.seeds, keyed by the pair and the
  step), not from numpy's RandomState(int(f"{seed}{lo}{hi}")) filling the m x r and n x r
  buffers of all tensors at once; and only the basis the step needs is drawn.
- Orthonormalisation. QR (torch.linalg.qr) instead of the reference's column-by-column
  Gram-Schmidt with eps 1e-8. Both span the same columns; QR may flip a column's sign, which
  cancels in b d^T. They differ only for a basis of zero (or dependent) columns: Gram-Schmidt
  leaves zeros (and a warm start from zero stays zero), QR returns unit columns.
- BatchNorm statistics. The reference gossips model.parameters() only and keeps the running
  statistics local; here every floating-point entry is gossiped, running statistics exactly
  with the other tensors of dimension <= 1 (as every averaging protocol here does).
- Training. The reference's local step is one SGD step with Nesterov momentum 0.9 carried from
  step to step (no weight decay on BatchNorm's parameters; a learning-rate warm-up and schedule);
  here --local-steps steps of heavy-ball SGD whose buffer starts fresh each round (--momentum 0).
- Options. Only the reference's defaults: warm start always (no warm_start=False, which redraws
  b every iteration, its ablation), orthonormalised bases (no round_weights, b's signs / sqrt(m)).
- Weights. The reference reads W from its fixed topology (a ring's 1/3, a torus's 1/5); here
  w_ij comes from the degrees (Metropolis-Hastings or uniform), which on a regular graph of
  degree d is the same 1/(d + 1). A neighbour not heard leaves its weight with the node.
- Bytes. The reference counts 32 bits an entry, exact part and products as separate sends; here
  the exact tensors ride in the first power step's message, and the ledger counts wire frames.
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
    consensus_step: float = field(default=1.0, metadata={"help": (
        "powergossip: the diffusion rate gamma that scales each pair's low-rank update, "
        "M_i <- M_i -+ gamma w_ij (projected difference); tensors of dimension <= 1 are averaged with w_ij "
        "alone, as in the reference, whose ResNet-20 CIFAR-10 runs use 1.308")})

    def validate(self):
        super().validate()
        check("rank", self.rank, self.rank >= 1, "must be at least 1")
        check("power-steps", self.power_steps, self.power_steps >= 1, "must be at least 1")
        check("consensus-step", self.consensus_step, self.consensus_step > 0, "must be positive")


def as_matrix(t):
    """A tensor as the matrix PowerGossip compresses: its first dimension by the rest."""
    return t.reshape(t.shape[0] if t.dim() else 1, -1)


def is_small(t) -> bool:
    """Whether a tensor is gossiped exactly, whole (dimension <= 1), not by power iteration."""
    return t.dim() <= 1


def layout(state: dict) -> tuple[dict, dict]:
    """(m x n of each tensor of dimension >= 2, a zero tensor like each one of dimension <= 1)."""
    shapes = {name: as_matrix(value).shape for name, value in state.items() if not is_small(value)}
    small = {name: torch.zeros(value.shape, dtype=value.dtype) for name, value in state.items() if is_small(value)}
    return shapes, small


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
        shapes, small = layout(await self.state(node, model))
        valid = self.checks(shapes, small)
        async for _ in node.rounds():
            loss = await self.train(node, model, data)
            heard = [await self.power_step(node, model, carried, shapes, k, valid[self.parity(carried.step), k == 0])
                     for k in range(o.power_steps)]
            node.snapshot(await self.state(node, model))
            node.log(train_loss=loss, **await self.evaluate(node, model, data), heard_from=min(heard))

    def parity(self, step: int) -> int:
        """0 if power step `step` sends M^T b (the reference's iteration step + K even), 1 if M b."""
        return (step + self.options.power_steps) % 2

    def checks(self, shapes: dict, small: dict) -> dict:
        """(parity, first power step of the round?) -> the check of a neighbour's body at such a step."""
        return {(parity, k == 0): self.message_check(shapes, parity, small if k == 0 else None)
                for parity in (0, 1) for k in range(min(self.options.power_steps, 2))}

    def message_check(self, shapes: dict, parity: int, small: dict | None = None):
        """A check of what a neighbour sends at a step of `parity`: the products of each matrix, and
        the tensors of dimension <= 1 whole (`small`: an example of each) if the step carries them."""
        products = {name: torch.zeros(n if parity == 0 else m, min(m, n, self.options.rank))
                    for name, (m, n) in shapes.items()}
        body = {DEGREE: int, "pair": [0, 0], "products": products}
        return expects(**body, **({} if small is None else {"exact": small}))

    async def power_step(self, node, model, carried: Carried, shapes: dict, k: int, valid) -> int:
        """Steps 1-2 with every neighbour; returns how many were heard."""
        x = on_host(await self.state(node, model))
        sizes = {name: value.shape for name, value in x.items()}
        matrices = {name: as_matrix(x[name]) for name in shapes}
        exact = {name: value for name, value in x.items() if is_small(value)} if k == 0 else None  # v_i
        peers = [j for j in node.neighbours if j in node.in_neighbours]  # pairs: both send, both hear
        sent = {j: self.send_products(node, carried, j, matrices, shapes, k, exact) for j in peers}  # 1
        del x, matrices  # not held while the node waits: a model's worth per node
        heard = await node.gather(f"power-{k}", peers=peers, timeout=self.options.timeout, valid=valid)
        update = {name: torch.zeros(shape) for name, shape in shapes.items()}
        exact = exact or {}
        update.update({name: torch.zeros_like(value) for name, value in exact.items()})
        for j, message in heard.items():  # 2
            self.add_pair_update(update, node, carried, j, sent[j], exact, message.body)
        carried.step += 1
        await node.compute(shift, model, {name: value.view(sizes[name]) for name, value in update.items()}, work=0)
        return len(heard)

    def send_products(self, node, carried: Carried, j: int, matrices: dict, shapes: dict, k: int,
                      exact: dict | None = None) -> dict:
        """Step 1 with neighbour j: orthonormalise the pair's basis, send M^T b or M b (and `exact`, the
        tensors of dimension <= 1, if given); returns the products sent."""
        step = carried.step
        pair = carried.pairs.get(j)
        if pair is None or pair["drawn"] + pair["done"] != step:  # new, or it missed an exchange: redraw
            pair = carried.pairs[j] = self.draw(node, j, shapes, step)
        basis = pair["basis"] = {name: torch.linalg.qr(b).Q for name, b in pair["basis"].items()}
        even = self.parity(step) == 0
        products = {name: (m.T if even else m) @ basis[name] for name, m in matrices.items()}
        body = {DEGREE: len(node.in_neighbours), "pair": [pair["drawn"], pair["done"]], "products": products}
        node.send(j, f"power-{k}", body if exact is None else {**body, "exact": exact})
        return products

    def add_pair_update(self, update: dict, node, carried: Carried, j: int, mine: dict, exact: dict,
                        body: dict) -> None:
        """Step 2 with neighbour j: add w_ij (v_j - v_i) for the exact tensors, and -+gamma w_ij times the
        rank-r projection of the pair's difference if the pair is in step."""
        w = neighbour_weight(self.options.mixing, len(node.in_neighbours), body[DEGREE])
        for name, value in exact.items():  # the reference's SimpleGossip, at diffusion rate 1
            update[name].add_(body["exact"][name] - value, alpha=w)
        pair, even = carried.pairs[j], self.parity(carried.step) == 0
        if body["pair"] != [pair["drawn"], pair["done"]]:  # out of step: both sides redraw at the next step
            return
        hi, rate = node.id > j, w * self.options.consensus_step
        for name, product in mine.items():
            theirs, b = body["products"][name], pair["basis"][name]
            d = product - theirs if hi else theirs - product  # (M_hi - M_lo)^T b, or (M_hi - M_lo) b
            update[name].add_(b @ d.T if even else d @ b.T, alpha=-rate if hi else rate)
            pair["basis"][name] = d
        pair["done"] += 1

    def draw(self, node, j: int, shapes: dict, step: int) -> dict:
        """The pair's basis for `step`, from the stream both sides derive from the seed and the pair."""
        rng = node.seeds.numpy("powergossip", min(node.id, j), max(node.id, j), step)
        rank, odd = self.options.rank, self.parity(step) == 1
        basis = {name: torch.from_numpy(rng.standard_normal((n if odd else m, min(m, n, rank)), np.float32))
                 for name, (m, n) in shapes.items()}
        return {"basis": basis, "drawn": step, "done": 0}
