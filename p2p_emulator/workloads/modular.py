"""FedMN's modular network and routing hypernetwork (Wang et al., Sections II-A to II-D).

A network `[n1 x n2 x ... x nL]` has n1 encoders (layer 1), then layers of blocks; layer L
gives the logits. The decision V is E = sum_l n_l n_(l+1) + n_L binary connections: for each
pair of successive layers a matrix C (n_(l+1) x n_l, row-major), then one connection per
output block to the prediction. A block's input is Eq. 13, the sum of the outputs connected
to it divided by max(number connected, 1): for a binary V that is the paper's mean (0 when
nothing is connected), and a relaxed V keeps a gradient. The prediction combines the output
blocks the same way.

A module is active when it lies on a connected path from the input to the prediction. The
paper calls a block active when its input is not all zero; a block whose output reaches
nothing gets no gradient either, so it is inactive here too, and so is an encoder no
connection leaves. Only active modules train, are sent and are averaged.

The router (Eq. 10) embeds a whole dataset: an encoder like the network's for x, a linear
embedding of one-hot y, the two concatenated and layer-normalised, then one linear layer to
E logits, averaged over the samples; Pi = sigmoid of that mean.
"""
from __future__ import annotations

import networkx as nx
import torch
from torch import nn
from torch.nn import functional as F

from .model_specs import ModelError
from .models import RNG_LOCK, build_model

LABEL_WIDTH = 32  # the router's one-hot label embedding


def parse_modules(spec: str) -> tuple[int, ...]:
    """'2,2,2' -> (2, 2, 2): encoders, then blocks per layer; at least two layers."""
    try:
        widths = tuple(int(v) for v in spec.split(","))
    except ValueError:
        widths = ()
    if len(widths) < 2 or min(widths) < 1:
        raise ModelError(f"--modules {spec!r}: give blocks per layer as N1,N2,...,NL (encoders first, "
                         "at least two layers, each at least 1)")
    return widths


def connections(widths: tuple[int, ...]) -> int:
    """E, the number of binary connections in a decision."""
    return sum(a * b for a, b in zip(widths, widths[1:])) + widths[-1]


def _matrices(widths, gates: torch.Tensor) -> list[torch.Tensor]:
    """The decision cut into each layer pair's C (n_(l+1) x n_l), then the output row (1 x n_L)."""
    out, start = [], 0
    for n_in, n_out in [*zip(widths, widths[1:]), (widths[-1], 1)]:
        out.append(gates[start:start + n_in * n_out].reshape(n_out, n_in))
        start += n_in * n_out
    return out


def active_modules(widths: tuple[int, ...], decision) -> list[tuple[int, int]]:
    """(layer, index) of every module on a connected path from the input to the prediction."""
    wiring = nx.DiGraph([("input", (0, k)) for k in range(widths[0])])  # every encoder sees the input
    for layer, c in enumerate(_matrices(widths, torch.as_tensor(decision).round())):
        last = layer + 1 == len(widths)  # the output row: output blocks -> the prediction
        wiring.add_edges_from(((layer, k), "prediction" if last else (layer + 1, j)) for j, k in c.nonzero().tolist())
    if "prediction" not in wiring:
        return []
    return sorted(nx.descendants(wiring, "input") & nx.ancestors(wiring, "prediction"))


def module_prefix(layer: int, index: int) -> str:
    """The state-dict prefix of one module's tensors."""
    return f"layers.{layer}.{index}."


ROUTER = "router."


def binary_concrete(pi: torch.Tensor, noise: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 5: sigmoid((log u - log(1 - u) + log pi - log(1 - pi)) / tau), u = noise ~ Uniform(0, 1).

    Above 1/2 exactly when u > 1 - pi, so thresholding it is a Bernoulli(pi) draw at any tau;
    as tau -> 0 the sample itself tends to that 0/1 value.
    """
    return torch.sigmoid((torch.logit(noise, eps=1e-6) + torch.logit(pi, eps=1e-6)) / tau)


def _dropout(h: torch.Tensor, p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Inverted dropout drawing from the node's generator (never the global RNG): runs stay reproducible."""
    if generator is None or p == 0:
        return h
    keep = torch.rand(h.shape, generator=generator, device=h.device) >= p
    return h * keep / (1 - p)


class Router(nn.Module):
    """Eqs. 9-10: a dataset -> E logits, the mean of h([phi_x(x), phi_y(y)]) over its samples."""

    def __init__(self, encoder: nn.Module, d_z: int, num_classes: int, edges: int):
        super().__init__()
        self.num_classes = num_classes
        self.encoder = encoder
        self.labels = nn.Linear(num_classes, LABEL_WIDTH)
        self.head = nn.Linear(d_z + LABEL_WIDTH, edges)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        joint = torch.cat([F.relu(self.encoder(x)), self.labels(F.one_hot(y, self.num_classes).float())], 1)
        return self.head(F.layer_norm(joint, joint.shape[1:])).mean(0)


class ModularNetwork(nn.Module):
    """Encoders, blocks (Linear, ReLU, dropout) and linear output blocks, wired by a decision.

    `decision` (not in the state dict, never sent) is the round's 0/1 V; forward uses it when
    given no gates, so plain evaluation code can score the network.
    """

    def __init__(self, widths: tuple[int, ...], encoders: list[nn.Module], router: Router, d_z: int,
                 num_classes: int, dropout: float):
        super().__init__()
        self.widths, self.dropout = widths, dropout
        layers = [nn.ModuleList(nn.Sequential(e, nn.ReLU()) for e in encoders)]
        for n in widths[1:-1]:
            layers.append(nn.ModuleList(nn.Sequential(nn.Linear(d_z, d_z), nn.ReLU()) for _ in range(n)))
        layers.append(nn.ModuleList(nn.Linear(d_z, num_classes) for _ in range(widths[-1])))
        self.layers = nn.ModuleList(layers)
        self.router = router
        self.register_buffer("decision", torch.ones(connections(widths)), persistent=False)

    def forward(self, x: torch.Tensor, gates: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
        """Logits under `gates` (default: the decision); their values must be 0/1, their gradient may be relaxed."""
        gates = self.decision if gates is None else gates
        active = set(active_modules(self.widths, gates.detach()))
        mats = _matrices(self.widths, gates)
        outputs = [x] * self.widths[0]
        for layer, modules in enumerate(self.layers):
            if layer:
                inputs = torch.stack(outputs)
                c = mats[layer - 1]
                counts = c.sum(1).clamp(min=1).view(-1, *[1] * (inputs.dim() - 1))
                inputs = torch.einsum("jk,k...->j...", c, inputs) / counts
            else:
                inputs = outputs
            last = layer == len(self.layers) - 1
            drop = None if last else generator
            outputs = [self._run(module, u, (layer, j) in active, drop)
                       for j, (module, u) in enumerate(zip(modules, inputs))]
        c = mats[-1][0]
        return torch.einsum("j,j...->...", c, torch.stack(outputs)) / c.sum().clamp(min=1)

    def _run(self, module: nn.Module, u: torch.Tensor, active: bool, generator) -> torch.Tensor:
        """An active module trains; an inactive one runs frozen (no gradient, no BatchNorm update),
        as its output still gives the gradient of the connections that leave it."""
        if active:
            h = module(u)
            return _dropout(h, self.dropout, generator) if self.training else h
        was = module.training
        module.eval()
        with torch.no_grad():
            h = module(u)
        module.train(was)
        return h


def build_modular(model: str, widths: tuple[int, ...], in_shape, num_classes: int, *, d_z: int, norm: str,
                  dropout: float, init_seed: int, vocabulary: int = 0) -> ModularNetwork:
    """The network; encoder j is `model`'s backbone from init_seed + j, the router's from init_seed + n1.
    The blocks are as wide as the backbone's latent (d_z; a shaped mlp's last hidden width)."""
    built = [build_model(model, in_shape, num_classes, d_z=d_z, norm=norm, init_seed=init_seed + j,
                         vocabulary=vocabulary)
             for j in range(widths[0] + 1)]
    encoders, router_encoder, d_z = [m.backbone for m in built[:-1]], built[-1].backbone, built[0].d_z
    with RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(init_seed)
        router = Router(router_encoder, d_z, num_classes, connections(widths))
        return ModularNetwork(widths, encoders, router, d_z, num_classes, dropout)
