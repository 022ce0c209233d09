"""Local training, evaluation and model averaging: the pieces protocols run as compute jobs."""
from __future__ import annotations

from .lazy import LazyModule

torch = LazyModule("torch")


def batches(n: int, batch_size: int, generator: torch.Generator, steps: int = 0):
    """Index batches over a fresh permutation; with steps > 0, exactly that many (reshuffling as needed)."""
    done = 0
    while True:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            yield order[start:start + batch_size]
            done += 1
            if steps and done >= steps:
                return
        if not steps:
            return


def full_batches(n: int, batch_size: int, generator: torch.Generator):
    """batches without an epoch's last partial batch (a DataLoader's drop_last), unless no batch is full."""
    for idx in batches(n, batch_size, generator):
        if len(idx) == batch_size or n < batch_size:
            yield idx


def full_batch_samples(n: int, batch_size: int) -> int:
    """The samples an epoch of full_batches trains on."""
    return n if n < batch_size else n // batch_size * batch_size


def sgd(model, x, y, *, epochs: int, steps: int, lr: float, momentum: float, weight_decay: float,
        batch_size: int, generator: torch.Generator, forward=None, objective=None,
        parameters=None, carried: HeavyBall | None = None) -> tuple[float, int]:
    """Local SGD with heavy-ball momentum, buffer fresh each call; returns (mean loss, samples seen).

    forward(x_batch, y_batch) -> logits replaces model(x_batch), for a model whose forward pass needs more;
    objective(x_batch, y_batch) -> loss replaces the cross-entropy, and y may then hold any per-sample target.
    parameters: those SGD updates (default: all the model's).
    carried: a HeavyBall to step with instead, whose momentum buffers carry from call to call.
    """
    optimizer = carried.optimizer if carried is not None else torch.optim.SGD(
        model.parameters() if parameters is None else parameters, lr=lr, momentum=momentum, weight_decay=weight_decay)
    model.train()
    total, seen = 0.0, 0
    for _ in range(1 if steps else epochs):
        for idx in batches(len(y), batch_size, generator, steps):
            if len(idx) < 2 and model.training:
                continue  # BatchNorm cannot train on a single sample
            if objective is not None:
                loss = objective(x[idx], y[idx])
            else:
                logits = model(x[idx]) if forward is None else forward(x[idx], y[idx])
                loss = torch.nn.functional.cross_entropy(logits, y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
            seen += len(idx)
    model.zero_grad(set_to_none=True)  # a model's worth of memory per node between rounds
    return total / max(seen, 1), seen


def gradient(model, x, y, *, batch_size: int, weight_decay: float, generator: torch.Generator
             ) -> tuple[dict[str, torch.Tensor], float]:
    """The stochastic gradient of one minibatch (drawn by `generator`) at the model's parameters as they are
    now, weight decay included: ({name: gradient}, loss). The model is not changed (an asynchronous method
    applies the gradient later, with descend, to a model that may have moved meanwhile)."""
    model.train()
    idx = next(batches(len(y), batch_size, generator, steps=1))
    loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named])
    with torch.no_grad():
        out = {name: g + weight_decay * p if weight_decay else g for (name, p), g in zip(named, grads)}
    return out, loss.item()


def descend(model, grads: dict[str, torch.Tensor], lr: float) -> None:
    """x <- x - lr * g, in place, over the gradient's entries."""
    state = model.state_dict()
    with torch.no_grad():
        for name, g in grads.items():
            state[name].add_(g.to(state[name].device, state[name].dtype), alpha=-lr)


class HeavyBall:
    """SGD with heavy-ball momentum whose buffers live as long as the model (CHOCO-SGD's local step).
    Make it as a job, where the model lives, and keep it there: node.compute(HeavyBall, model, ..., keep=True)."""

    def __init__(self, model, lr: float, momentum: float, weight_decay: float):
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


def accuracy(model, x, y, batch_size: int = 1024) -> float:
    return _mean_over(model, x, y, batch_size, lambda logits, labels: (logits.argmax(1) == labels).sum().item())


def recurrent(model) -> bool:
    """Whether the model has an RNN (char-lstm): vmap has no batching rule for its kernels."""
    return any(isinstance(m, torch.nn.RNNBase) for m in model.modules())


def mean_loss(model, x, y, batch_size: int = 1024) -> float:
    """Mean cross-entropy of the model (eval mode) on (x, y)."""
    return _mean_over(model, x, y, batch_size, lambda logits, labels: torch.nn.functional.cross_entropy(
        logits, labels, reduction="sum").item())


def _mean_over(model, x, y, batch_size: int, batch_sum) -> float:
    """sum over batches of batch_sum(logits, labels), over the sample count; NaN without samples."""
    if len(y) == 0:
        return float("nan")
    model.eval()
    with torch.no_grad():
        total = sum(batch_sum(model(x[i:i + batch_size]), y[i:i + batch_size]) for i in range(0, len(y), batch_size))
    return total / len(y)


def float_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The floating-point entries of a state dict (never counters such as num_batches_tracked)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items() if v.is_floating_point()}


def load_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy the entries of `state` into the module's (others stay as they are)."""
    module.load_state_dict(state, strict=False)


def mix(module: torch.nn.Module, self_weight: float, others: list[tuple[float, dict]]) -> None:
    """x <- w_ii x + sum_j w_ij x_j, in place, over the entries the neighbours sent."""
    if not others:
        return
    state = module.state_dict()
    with torch.no_grad():
        for name in others[0][1]:
            value = state[name]
            mixed = value * self_weight
            for weight, other in others:
                mixed.add_(other[name].to(value.device, value.dtype), alpha=weight)
            value.copy_(mixed)


def shift(module: torch.nn.Module, delta: dict[str, torch.Tensor]) -> None:
    """x <- x + delta, in place, over delta's entries."""
    state = module.state_dict()
    with torch.no_grad():
        for name, value in delta.items():
            state[name].add_(value.to(state[name].device, state[name].dtype))


def aggregate(module: torch.nn.Module, others: list[dict], rule: str, param: float) -> None:
    """x <- a robust aggregate of {x} and the neighbours' states, in place, with equal weights.

    median: coordinate-wise median; trimmed: coordinate-wise mean after dropping the
    fraction `param` of largest and of smallest values (at least one each when any is
    dropped); krum: the candidate (own state included) with the least summed squared
    distance to its m - f - 2 nearest others, f = `param` (Blanchard et al., 2017).
    """
    if not others:
        return
    state = module.state_dict()
    names = list(others[0])
    with torch.no_grad():
        stacks = {name: torch.stack([state[name].float(), *(o[name].float() for o in others)]) for name in names}
        if rule == "krum":
            chosen = _krum(torch.cat([stack.flatten(1) for stack in stacks.values()], 1), int(param))
            values = {name: stack[chosen] for name, stack in stacks.items()}
        else:
            values = {name: _coordinate_wise(stack, rule, param) for name, stack in stacks.items()}
        for name, value in values.items():
            state[name].copy_(value.to(state[name].dtype))


def _coordinate_wise(stack: torch.Tensor, rule: str, trim: float) -> torch.Tensor:
    ordered = stack.sort(0).values
    m = ordered.shape[0]
    if rule == "median":
        return (ordered[(m - 1) // 2] + ordered[m // 2]) / 2
    cut = min(int(trim * m), (m - 1) // 2)
    return ordered[cut:m - cut].mean(0)


def _krum(points: torch.Tensor, f: int) -> int:
    distances = torch.cdist(points, points).square()
    nearest = max(1, points.shape[0] - f - 2)
    scores = distances.sort(1).values[:, 1:nearest + 1].sum(1)  # column 0: the point itself
    return int(scores.argmin())


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1).float() for v in state.values()])


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """a - b, entry by entry, over the entries of a."""
    return {name: a[name] - b[name] for name in a}


def inner(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """<a, b> over the entries both hold."""
    return float(sum((a[name].double() * b[name].double()).sum() for name in a if name in b))


def loss_gradient(model, x, y) -> tuple[float, dict[str, torch.Tensor]]:
    """Cross-entropy of the model (eval mode) on (x, y) and its gradient by parameter name."""
    model.eval()
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return loss.item(), {name: g for (name, _), g in zip(named, grads) if g is not None}
