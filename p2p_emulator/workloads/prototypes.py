"""MAPL's personalised model learning (PML, Algorithm 1 of Mukherjee, Simonetto and Jamali-Rad):
the prototype losses in both forms, and the local training job a MAPL node runs each round.

docs/mapl.md says how the "code" and "paper" forms of the losses differ.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .training import batches

if TYPE_CHECKING:  # augment imports torchvision, which token and feature data never need
    from .augment import TwoViews

ADAM_BETA2 = 0.999  # paper and code
TERMS = ("cont", "proto", "uni")  # the losses beside the cross-entropy, in the order the forms return them


def code_losses(p: torch.Tensor, y: torch.Tensor, xi: torch.Tensor, tau: float) -> tuple[torch.Tensor, ...]:
    """(l_cont, l_proto, l_uni) as the authors' code computes them."""
    p_hat = F.normalize(p, dim=1)
    eye = torch.eye(len(y), dtype=torch.bool, device=y.device)
    same = y[:, None] == y[None, :]
    logits = p_hat @ p_hat.T / tau
    # log(pos / (pos + neg)), pos = same label but not itself, neg = other labels (never itself)
    cont = -(logits.masked_fill(~same | eye, -math.inf).logsumexp(1)
             - logits.masked_fill(eye, -math.inf).logsumexp(1)).mean()
    proto = F.cross_entropy(p_hat @ xi.T, y)
    # the diagonal masked before exp, not after: a prototype of norm above sqrt(88 tau) overflows exp,
    # and inf * 0 is NaN (l_proto grows the norms; digits, seed 0, round 303 of 400)
    self_pairs = torch.eye(len(xi), dtype=torch.bool, device=xi.device)
    uni = torch.exp((xi @ xi.T / tau).masked_fill(self_pairs, -math.inf)).sum(1).mean()
    return cont, proto, uni


def paper_losses(p: torch.Tensor, y: torch.Tensor, xi: torch.Tensor, tau: float) -> tuple[torch.Tensor, ...]:
    """(l_cont, l_proto, l_uni) as the paper writes them (cosine forms), averaged over the 2B views."""
    p_hat, xi_hat = F.normalize(p, dim=1), F.normalize(xi, dim=1)
    eye = torch.eye(len(y), dtype=torch.bool, device=y.device)
    positives = (y[:, None] == y[None, :]) & ~eye
    logits = (p_hat @ p_hat.T / tau).masked_fill(eye, -math.inf)
    log_prob = (logits - logits.logsumexp(1, keepdim=True)).masked_fill(~positives, 0)
    cont = -(log_prob.sum(1) / positives.sum(1)).mean()
    proto = F.cross_entropy(p_hat @ xi_hat.T / tau, y)
    cosines = xi_hat @ xi_hat.T
    uni = cosines.masked_fill(torch.eye(len(xi), dtype=torch.bool, device=xi.device), 0).sum() / len(xi)
    return cont, proto, uni


LOSSES = {"code": code_losses, "paper": paper_losses}


def view_stats(dataset) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (mean, std) two_views un-standardises images with, shaped for (B, C, H, W); None for token ids and
    feature vectors."""
    if dataset.kind != "image":
        return None
    return torch.tensor(dataset.mean).view(-1, 1, 1), torch.tensor(dataset.std).view(-1, 1, 1)


def two_views(x: torch.Tensor, views: TwoViews | None,
              stats: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The batch's two views, first view's rows first, standardised as x is and on x's device: drawn on the CPU
    in 0..1 units (the colour ops clamp there). Without `views` (token ids and feature vectors, which have no
    augmentation) both views are the samples themselves."""
    if views is None:
        return torch.cat([x, x])
    mean, std = stats
    return ((torch.cat(views(x.cpu() * std + mean)) - mean) / std).to(x.device)


def personalised_learning(model, prototypes: torch.Tensor, x: torch.Tensor, y: torch.Tensor, views: TwoViews | None,
                          stats: tuple[torch.Tensor, torch.Tensor] | None, *, epochs: int, batch_size: int, lr: float,
                          beta1: float, weight_decay: float, tau: float, forms: str,
                          generator: torch.Generator, terms: tuple[str, ...] = TERMS) -> tuple[float, torch.Tensor]:
    """PML (Algorithm 1): returns the mean loss and the trained prototypes; trains `model` in place.

    x is standardised images (on the model's device), or token ids or features with views and
    stats None (see two_views). The optimizer is fresh every call, as in the authors' code. `terms`: the
    losses of TERMS added to the cross-entropy (all three in MAPL; fewer to ablate them).
    Prototypes come and go on the CPU, where messages live.
    """
    xi = prototypes.to(x.device, copy=True).requires_grad_(True)
    optimizer = torch.optim.Adam([*model.parameters(), xi], lr=lr, betas=(beta1, ADAM_BETA2),
                                 weight_decay=weight_decay)
    model.train()
    total, seen = 0.0, 0
    for _ in range(epochs):
        for idx in batches(len(y), batch_size, generator):
            both = two_views(x[idx], views, stats)
            labels = y[idx].repeat(2)
            z = model.features(both)
            parts = LOSSES[forms](model.project(z), labels, xi, tau)
            loss = F.cross_entropy(model.classifier(z), labels) + sum(
                part for name, part in zip(TERMS, parts) if name in terms)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
            seen += len(idx)
    return total / max(seen, 1), xi.detach().cpu()


def initial_prototypes(num_classes: int, d_p: int, generator: torch.Generator) -> torch.Tensor:
    """U(-1/sqrt(d_p), 1/sqrt(d_p)), as the authors' code."""
    bound = 1 / math.sqrt(d_p)
    return (torch.rand(num_classes, d_p, generator=generator) * 2 - 1) * bound
