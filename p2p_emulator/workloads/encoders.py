"""Meta-L2C's model encoder E (Li et al., 2022, eq. 7-8): one small MLP per weight tensor, applied to each filter."""
from __future__ import annotations

import torch
from torch import nn


def _linear(n_in: int, n_out: int, generator: torch.Generator) -> nn.Linear:
    """nn.Linear with PyTorch's U(-1/sqrt(n_in), 1/sqrt(n_in)) init drawn from `generator`."""
    layer = nn.utils.skip_init(nn.Linear, n_in, n_out)
    for p in layer.parameters():
        nn.init.uniform_(p, -n_in ** -0.5, n_in ** -0.5, generator=generator)
    return layer


class Encoder(nn.Module):
    """E(theta) = [phi_1, ..., phi_L], phi_l = [E_l(filter) for each filter of weight tensor l]."""

    def __init__(self, shapes: dict[str, torch.Size], widths: tuple[int, ...], generator: torch.Generator):
        super().__init__()
        self.names = list(shapes)
        layers = []
        for shape in shapes.values():
            sizes = (shape[1:].numel(), *widths)
            mlp = []
            for n_in, n_out in zip(sizes, sizes[1:]):
                mlp += [_linear(n_in, n_out, generator), nn.ReLU()]
            layers.append(nn.Sequential(*mlp[:-1]))
        self.layers = nn.ModuleList(layers)

    def forward(self, drift: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([E_l(drift[name].flatten(1)).flatten() for name, E_l in zip(self.names, self.layers)])
