"""Meta-L2C (Li, Zhou, Tian, Tao; 2022, section 3.3): mixing weights from an encoder of the models.

The round of L2C (protocols/l2c.py), with the logits alpha_i replaced by an
attention over encoded models:
  w_ij = softmax_j <E(dtheta_i), E(dtheta_j)>,   dtheta_j = theta_j^{t+1/2} - theta^0,
so node j also sends dtheta_j (its change since the common start; only the
tensors E reads). E concatenates, over the model's weight tensors (conv and
linear; one "layer" each), a two-layer MLP E_l (widths 10 and 5) applied to
every filter (row) of that tensor (eq. 7-8). Node i's AdamW step trains its copy
of E down the hypergradient of its validation loss, through both E(dtheta_i)
and E(dtheta_j).

The paper AllReduces E every round; here the nodes gossip instead: after its
step each node sends E's parameters to all its neighbours in the topology (also
the pruned ones: the mixing rule needs symmetric links) and sets
E_i <- E_i + sum_j w_ij (E_j - E_i) with Metropolis-Hastings weights
w_ij = 1/(1 + max(deg_i, deg_j)). That matrix is doubly stochastic, so the
copies converge to the average over all nodes (on a full mesh they reach it in
one round). All copies start equal, seeded by the run's seed. The encoder and
dtheta messages are on the byte ledger like any other.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from emulator.errors import UsageError
from emulator.protocol import register
from p2p_emulator.workloads.lazy import LazyModule
from p2p_emulator.workloads.training import difference, mix

from .common import DEGREE, STATE, degree_weights, like, own_row
from .l2c import L2C, L2COptions

torch = LazyModule("torch")
encoders = LazyModule("p2p_emulator.workloads.encoders")  # an nn.Module: needs torch


@dataclass
class MetaL2COptions(L2COptions):
    encoder: str = field(default="10,5", metadata={"help": "meta-L2C: output widths of each layer's encoder MLP"})

    def validate(self):
        super().validate()
        encoder_widths(self.encoder)


def encoder_widths(spec: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in spec.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise UsageError(f"--encoder {spec!r}: expected positive widths such as 10,5")
    return widths


def encoded(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors the encoder reads: weights with filters (conv and linear), not biases or norms."""
    return {name: value for name, value in state.items() if value.dim() >= 2}


class Attention:
    """Meta-L2C's mixer: w_ij = softmax_j <E(dtheta_i), E(dtheta_j)>, E trained by AdamW."""

    def __init__(self, me: int, encoder: encoders.Encoder, lr: float, weight_decay: float):
        self.me, self.encoder = me, encoder
        self.optimizer = torch.optim.AdamW(encoder.parameters(), lr=lr, weight_decay=weight_decay)

    def weights(self, bodies: dict[int, dict]) -> torch.Tensor:
        codes = {j: self.encoder(body["drift"]) for j, body in bodies.items()}
        return torch.softmax(torch.stack([codes[self.me] @ codes[j] for j in bodies]), 0)


@register("meta-l2c")
class MetaL2C(L2C):
    """Meta-L2C: L2C with weights from a gossip-averaged encoder of each model's change since the start."""
    Options = MetaL2COptions
    state_copies = 11.0

    def mixer(self, node, origin: dict):
        o = self.options
        generator = torch.Generator().manual_seed(self.run_info.seeds.integer("meta-l2c.encoder"))  # one E for all nodes
        shapes = {name: value.shape for name, value in encoded(origin).items()}
        return Attention(node.id, encoders.Encoder(shapes, encoder_widths(o.encoder), generator),
                         o.alpha_lr, o.alpha_weight_decay)

    def message(self, start: dict, now: dict, origin: dict) -> dict:
        """Delta_i and dtheta_i = theta_i^{t+1/2} - theta^0."""
        return {"update": difference(start, now), "drift": difference(encoded(now), origin)}

    async def share(self, node, mixer) -> None:
        """One gossip step towards the average encoder (Metropolis-Hastings weights)."""
        degree = len(node.neighbours)
        body = {STATE: await self.state(node, mixer.encoder), DEGREE: degree}
        node.broadcast("encoder", body)
        heard = await node.gather("encoder", timeout=self.options.timeout, valid=like(body))
        self_weight, row = own_row(degree_weights("mh", degree, heard))
        await node.compute(mix, mixer.encoder, self_weight, [(w, heard[j].body[STATE]) for w, j in row], work=0)
