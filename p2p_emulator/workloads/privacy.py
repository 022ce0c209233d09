"""DP-SGD (Abadi et al., CCS 2016): local training whose every step is differentially private for the
node's own samples, and the accountant that says how private.

A step, for a node with n samples and expected batch size B (`--batch-size`):
  1. Poisson sampling: each sample joins the batch with probability q = B / n, independently;
  2. each sample's gradient g_s is clipped to norm C: g_s * min(1, C / (||g_s|| + 1e-6));
  3. g = (sum_s clipped g_s + N(0, (sigma C)^2 I)) / B;
  4. SGD takes g (weight decay and momentum act on g: post-processing, so they cost no privacy).
An epoch is round(n / B) steps, so that it sees about n samples. Per-sample gradients come from
torch.func (vmap over grad of a one-sample functional_call), or for a recurrent model (char-lstm), whose
LSTM kernel has no vmap batching rule, one backward pass per sample: one job on the model a node already
holds, so the thread, Ray and batched executors all run it as they run sgd (the batched one runs it
node by node). Opacus's GradSampleModule would wrap the model and hook its modules instead.

The accountant is opacus's RDP accountant (Mironov, 2017; the subsampled Gaussian of Mironov, Talwar
and Zhang, 2019), told the sampling rate q, sigma and the steps taken.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

from .lazy import LazyModule
from .training import HeavyBall, recurrent

torch = LazyModule("torch")
func = LazyModule("torch.func")

ACCOUNTANT = "opacus.accountants.RDPAccountant"
_CLIP_EPSILON = 1e-6  # opacus's: a zero gradient is not divided by zero


class PrivacyError(ValueError):
    """A --dp spec that cannot be used; one line for the user."""


@dataclass(frozen=True)
class DPSpec:
    """--dp clip=C,noise=SIGMA[,delta=D] or clip=C,target_epsilon=E[,delta=D]; delta 0 here: 1/n per node."""
    clip: float
    noise: float = 0.0
    target_epsilon: float = 0.0
    delta: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "DPSpec":
        values = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            if key not in ("clip", "noise", "target_epsilon", "delta") or key in values:
                raise PrivacyError(f"--dp {text}: expected clip=C,noise=SIGMA[,delta=D] or "
                                   "clip=C,target_epsilon=E[,delta=D]")
            try:
                values[key] = float(value)
            except ValueError:
                raise PrivacyError(f"--dp {text}: {key}={value!r} is not a number") from None
            if not math.isfinite(values[key]):
                raise PrivacyError(f"--dp {text}: {key} must be finite")
        spec = cls(**values) if "clip" in values else None
        if spec is None or ("noise" in values) == ("target_epsilon" in values):
            raise PrivacyError(f"--dp {text}: give clip=C and exactly one of noise=SIGMA and target_epsilon=E")
        for key, ok, why in (("clip", spec.clip > 0, "must be positive"),
                             ("noise", "noise" not in values or spec.noise > 0,
                              "must be positive (without noise there is no privacy: leave --dp off)"),
                             ("target_epsilon", "target_epsilon" not in values or spec.target_epsilon > 0,
                              "must be positive"),
                             ("delta", "delta" not in values or 0 < spec.delta < 1,
                              "must be in (0, 1); leave it out for 1/n")):
            if not ok:
                raise PrivacyError(f"--dp {text}: {key} {why}")
        return spec


def steps_per_call(samples: int, batch_size: int, epochs: int, steps: int) -> int:
    """The DP-SGD steps of one training call: `steps`, or `epochs` epochs of round(n / B) steps."""
    return steps if steps else epochs * max(1, round(samples / batch_size))


def sample_rate(samples: int, batch_size: int) -> float:
    return min(1.0, batch_size / samples)


def epsilon(noise: float, rate: float, steps: int, delta: float) -> float:
    """The accountant's epsilon after `steps` steps of the subsampled Gaussian mechanism: opacus's
    RDPAccountant.get_epsilon, whose RDP curve is `steps` times the one-step curve (cached, as it is
    asked after every step of SGP and AD-PSGD)."""
    if not steps:
        return 0.0
    from opacus.accountants.analysis.rdp import get_privacy_spent
    with warnings.catch_warnings():  # "optimal order is the largest alpha": the bound is loose, not wrong
        warnings.simplefilter("ignore", UserWarning)
        eps, _ = get_privacy_spent(orders=_orders(), rdp=_one_step_rdp(noise, rate) * steps, delta=delta)
    # The RDP-to-(epsilon, delta) conversion goes below 0 for a large delta and sigma; epsilon is >= 0.
    return max(0.0, float(eps))


def _orders() -> list[float]:
    from opacus.accountants import RDPAccountant
    return RDPAccountant.DEFAULT_ALPHAS


@functools.lru_cache(maxsize=None)
def _one_step_rdp(noise: float, rate: float):
    from opacus.accountants.analysis.rdp import compute_rdp
    return compute_rdp(q=rate, noise_multiplier=noise, steps=1, orders=_orders())


@functools.lru_cache(maxsize=None)  # a search over sigma, asked again for each node with the same plan
def noise_for(target_epsilon: float, rate: float, steps: int, delta: float) -> float:
    """The sigma that spends `target_epsilon` in `steps` steps (opacus's search, to its 0.01 tolerance)."""
    from opacus.accountants.utils import get_noise_multiplier
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=rate,
                                              steps=steps, accountant="rdp"))
        except ValueError as exc:  # e.g. a target no sigma reaches
            raise PrivacyError(f"--dp target_epsilon={target_epsilon:g}: {exc}") from None


def clipped_gradients(model, x, y, clip: float, names: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each sample's cross-entropy gradient over the parameters `names`, clipped to norm `clip` as one
    vector, and each sample's loss: ({name: tensor with a leading sample axis}, losses)."""
    per_sample = _looped_gradients if recurrent(model) else _vmapped_gradients
    grads, losses = per_sample(model, x, y, names)
    norms = torch.linalg.vector_norm(torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], 1), dim=1)
    factor = (clip / (norms + _CLIP_EPSILON)).clamp(max=1.0)
    return {name: g * factor.view(-1, *([1] * (g.dim() - 1))) for name, g in grads.items()}, losses


def _vmapped_gradients(model, x, y, names: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-sample gradients and losses by vmap over grad of a one-sample functional_call."""
    params = {name: p.detach() for name, p in model.named_parameters() if name in names}
    frozen = {name: t.detach() for name, t in model.named_parameters() if name not in params}
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    def loss(p, sample, label):
        logits = func.functional_call(model, (p, frozen, buffers), (sample.unsqueeze(0),))
        value = torch.nn.functional.cross_entropy(logits, label.unsqueeze(0))
        return value, value.detach()

    return func.vmap(func.grad(loss, has_aux=True), in_dims=(None, 0, 0))(params, x, y)


def _looped_gradients(model, x, y, names: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-sample gradients and losses by one backward pass per sample. For an LSTM on a CPU, vmap falls
    back to running its kernel sample by sample under a warning, 6 times slower than this loop at hidden 32
    and 24 times at 256 (10 samples, one thread); on CUDA it cannot run at all."""
    params = {name: p for name, p in model.named_parameters() if name in names}
    if not len(y):
        return {name: p.new_zeros((0, *p.shape)) for name, p in params.items()}, torch.zeros(0, device=x.device)
    grads: dict[str, list] = {name: [] for name in params}
    losses = []
    for sample, label in zip(x, y):
        value = torch.nn.functional.cross_entropy(model(sample.unsqueeze(0)), label.unsqueeze(0))
        for name, g in zip(params, torch.autograd.grad(value, list(params.values()))):
            grads[name].append(g)
        losses.append(value.detach())
    return {name: torch.stack(gs) for name, gs in grads.items()}, torch.stack(losses)


def noisy_mean(clipped: dict[str, torch.Tensor], noise: float, clip: float, batch_size: int,
               generator: torch.Generator, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """(sum of the clipped gradients + N(0, (noise * clip)^2)) / batch_size, per parameter; the noise drawn
    from `generator` on the CPU (the same draws on any device). `like`: the parameters, for an empty batch."""
    out = {}
    for name, p in like.items():
        total = clipped[name].sum(0) if clipped[name].shape[0] else torch.zeros_like(p)
        draw = torch.normal(0.0, noise * clip, p.shape, generator=generator)
        out[name] = (total + draw.to(p.device, p.dtype)) / batch_size
    return out


class Accountant:
    """A node's DP-SGD settings and the steps it has taken, kept where its jobs run (node.keep): a
    checkpoint saves `steps`, a tensor, with the node's other resident state."""

    def __init__(self, clip: float, noise: float, rate: float, delta: float):
        self.clip, self.noise, self.rate, self.delta = clip, noise, rate, delta
        self.steps = torch.zeros((), dtype=torch.int64)


def spent(accountant: Accountant) -> dict[str, float]:
    """The epsilon spent so far at the node's delta, the steps taken, delta and sigma: a job on the node's
    resident accountant."""
    steps = int(accountant.steps)
    return {"epsilon": epsilon(accountant.noise, accountant.rate, steps, accountant.delta), "steps": steps,
            "delta": accountant.delta, "noise": accountant.noise}


def private_gradient(model, x, y, accountant: Accountant, batch_size: int, generator: torch.Generator,
                     params: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One DP-SGD step's gradient over `params` ({name: parameter}), counted by the node's accountant: a Poisson
    batch, each sample's gradient clipped, the noisy mean. (gradient by name, the batch's per-sample losses)."""
    idx = (torch.rand(len(y), generator=generator) < accountant.rate).nonzero().flatten().to(y.device)
    clipped, losses = clipped_gradients(model, x[idx], y[idx], accountant.clip, list(params))
    accountant.steps += 1
    return noisy_mean(clipped, accountant.noise, accountant.clip, batch_size, generator, params), losses


def dp_sgd(model, x, y, *, accountant: Accountant, epochs: int, steps: int, lr: float, momentum: float,
           weight_decay: float, batch_size: int, generator: torch.Generator, parameters=None,
           carried: HeavyBall | None = None) -> tuple[float, int]:
    """training.sgd with DP-SGD's steps (see the module docstring), counted by the node's accountant:
    (mean loss of the sampled batches, samples seen). Takes sgd's arguments, less forward and objective."""
    trained = {id(t) for t in (model.parameters() if parameters is None else parameters)}
    params = {name: p for name, p in model.named_parameters() if id(p) in trained and p.requires_grad}
    optimizer = carried.optimizer if carried is not None else torch.optim.SGD(
        params.values(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    model.train()
    total, seen = 0.0, 0
    for _ in range(steps_per_call(len(y), batch_size, epochs, steps)):
        gradient, losses = private_gradient(model, x, y, accountant, batch_size, generator, params)
        optimizer.zero_grad(set_to_none=True)
        for name, g in gradient.items():
            params[name].grad = g
        optimizer.step()
        total, seen = total + losses.sum().item(), seen + len(losses)
    model.zero_grad(set_to_none=True)
    return total / max(seen, 1), seen


def dp_gradient(model, x, y, *, accountant: Accountant, batch_size: int, weight_decay: float,
                generator: torch.Generator) -> tuple[dict[str, torch.Tensor], float]:
    """training.gradient as one DP-SGD step, counted by the node's accountant, weight decay added
    (post-processing): ({name: gradient}, mean loss)."""
    model.train()
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    grads, losses = private_gradient(model, x, y, accountant, batch_size, generator, params)
    with torch.no_grad():
        out = {name: g + weight_decay * params[name] if weight_decay else g for name, g in grads.items()}
    return out, losses.mean().item() if len(losses) else float("nan")
