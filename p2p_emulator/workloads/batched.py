"""Training and evaluation of many nodes' models as one vectorised job (`--executor batched`).

Nodes whose models share one architecture and whose jobs share the hyper-parameters
run together: `torch.func.vmap` over `functional_call` and `grad`, with the models'
tensors stacked along a leading node axis. Each node keeps its own batch order (drawn
from its own generator, exactly as `training.sgd` draws it), its own momentum buffer (fresh,
or its carried HeavyBall's, read and written back) and its own BatchNorm statistics; results
are `training.sgd`'s, `accuracy`'s and `mean_loss`'s up to float rounding.

Storage: the first time a set of fresh models runs together, their tensors move into
one stack and each model's parameters and buffers become views of its row, so the stack
*is* the models (one copy, not two). A later job over exactly those rows, in any order,
works on the stack in place; any other set is gathered into a temporary stack and
written back.

Recurrent models (char-lstm) are never batched: their jobs run node by node (see `_batchable`).

Batches of unequal size (a node's last batch, unequal data) are padded and masked, except
for a model with BatchNorm in training, where padding would change the batch statistics:
there, nodes whose batch has one size step together.
"""
from __future__ import annotations

import math
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from .lazy import LazyModule
from .training import accuracy, batches, float_state, mean_loss, mix, recurrent, sgd, shift

torch = LazyModule("torch")
func = LazyModule("torch.func")
F = LazyModule("torch.nn.functional")


@dataclass
class _Layout:
    """What the batched path knows of one model: its architecture, modules and (once stacked) its row."""
    architecture: tuple | None  # None: a model the batched path leaves alone (tied tensors)
    batch_norm: bool
    convolution: bool
    recurrent: bool
    modules: list
    slots: list  # (name, owning module, attribute, is a parameter)
    row: tuple | None = None  # (stack, row, data pointers of the row's views)

    @classmethod
    def of(cls, model) -> "_Layout":
        slots = [(f"{prefix}.{leaf}".lstrip("."), module, leaf, param)
                 for prefix, module in model.named_modules()
                 for param, entries in ((True, module._parameters), (False, module._buffers))
                 for leaf, value in entries.items() if value is not None]
        tensors = [(name, _get(module, leaf, param)) for name, module, leaf, param in slots]
        shapes = tuple((name, tuple(t.shape), t.dtype, t.device) for name, t in tensors)
        modules = list(model.modules())
        norm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in modules)
        conv = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in modules)
        tied = len({id(t) for _, t in tensors}) < len(tensors)  # one tensor in two places: not stackable
        known = cls((type(model), repr(model), shapes), norm, conv, recurrent(model), modules, slots)
        if tied or list(known.state()) != list(model.state_dict()):  # shared modules: leave it to the plain jobs
            known.architecture = None
        return known

    def tensors(self) -> dict:
        return {name: _get(module, leaf, param) for name, module, leaf, param in self.slots}

    def state(self) -> dict:
        """What state_dict() holds (the persistent tensors, in its order), without its walk over the modules."""
        return {name: _get(module, leaf, param) for name, module, leaf, param in self.slots
                if param or leaf not in module._non_persistent_buffers_set}

    def stacked_in(self) -> tuple | None:
        """(stack, row) when every tensor of the model still is its row of a stack (nothing rebound one)."""
        if self.row is None:
            return None
        stack, row, pointers = self.row
        if any(_get(module, leaf, param).data_ptr() != pointer
               for (_, module, leaf, param), pointer in zip(self.slots, pointers)):
            return None
        return stack, row

    def set_mode(self, training: bool) -> None:
        if self.modules[0].training != training:
            for module in self.modules:
                module.__dict__["training"] = training  # what Module.train() sets, without its per-call checks


def _get(module, leaf: str, param: bool):
    return module._parameters[leaf] if param else module._buffers[leaf]


_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layout(model) -> _Layout:
    known = _layouts.get(model)
    if known is None:
        known = _layouts[model] = _Layout.of(model)
    return known


class Stack:
    """The tensors of same-architecture models along a leading node axis: the models' own storage when
    they are exactly one stack's rows, in order (or fresh, and then adopted); else a temporary copy."""

    def __init__(self, models: list, training: bool):
        layouts = [layout(m) for m in models]
        for model_layout in layouts:
            model_layout.set_mode(training)
        shared, order = self._shared(layouts)
        self.order = order  # order[k]: the call whose model is row k
        self.models, self.layouts = [models[k] for k in order], [layouts[k] for k in order]
        self.temporary = shared is None
        if shared is not None:
            self.tensors = shared
        else:
            per_model = [model_layout.tensors() for model_layout in self.layouts]
            self.tensors = {name: torch.stack([t[name].detach() for t in per_model]) for name in per_model[0]}
            if all(model_layout.row is None for model_layout in self.layouts):
                self._adopt()

    @staticmethod
    def _shared(layouts: list) -> tuple[dict | None, list[int]]:
        """(the stack these models are, the calls in row order) when they are all of one stack's rows;
        else (None, the calls as they came)."""
        rows = [model_layout.stacked_in() for model_layout in layouts]
        as_given = list(range(len(layouts)))
        if rows[0] is None:
            return None, as_given
        stack = rows[0][0]
        if len(next(iter(stack.values()))) != len(rows) or any(r is None or r[0] is not stack for r in rows):
            return None, as_given
        order = sorted(as_given, key=lambda k: rows[k][1])
        if [rows[k][1] for k in order] != as_given:
            return None, as_given
        return stack, order

    def arrange(self, calls: list) -> list:
        """The calls in row order."""
        return [calls[k] for k in self.order]

    def restore(self, results: list) -> list:
        """Results in row order, back in the calls' order."""
        out = [None] * len(results)
        for k, result in zip(self.order, results):
            out[k] = result
        return out

    def _adopt(self) -> None:
        """Make each model's tensors views of its row: from now on the stack is the only copy."""
        with torch.no_grad():
            for row, model_layout in enumerate(self.layouts):
                pointers = []
                for name, module, leaf, param in model_layout.slots:
                    view = self.tensors[name][row]
                    if param:
                        module._parameters[leaf].data = view
                    else:
                        module._buffers[leaf] = view
                    pointers.append(view.data_ptr())
                model_layout.row = (self.tensors, row, pointers)
        self.temporary = False

    def split(self) -> tuple[dict, dict]:
        """(parameters, buffers), each {name: stacked tensor}."""
        slots = self.layouts[0].slots
        return ({name: self.tensors[name] for name, _, _, param in slots if param},
                {name: self.tensors[name] for name, _, _, param in slots if not param})

    def write_back(self) -> None:
        """A temporary stack's values, copied into the models."""
        if self.temporary:
            with torch.no_grad():
                for row, model_layout in enumerate(self.layouts):
                    for name, value in model_layout.tensors().items():
                        value.copy_(self.tensors[name][row])


def _rows_of(stacked: dict, rows) -> dict:
    return stacked if rows is None else {name: value[rows] for name, value in stacked.items()}


def _put_rows(stacked: dict, rows, values: dict) -> None:
    if rows is not None:
        for name, value in values.items():
            stacked[name].index_copy_(0, rows, value)


def _padded(tensors: list, length: int):
    """The tensors stacked along a new first axis, each padded with zeros to `length` rows."""
    out = tensors[0].new_zeros((len(tensors), length, *tensors[0].shape[1:]))
    for i, t in enumerate(tensors):
        out[i, :len(t)] = t
    return out


def _mask(lengths, length: int):
    """1 for each row's first lengths[i] places of `length`, 0 after (lengths: a tensor)."""
    return (torch.arange(length, device=lengths.device) < lengths[:, None]).float()


# -- local SGD

def _sgd_key(model, x, y, *, epochs, steps, lr, momentum, weight_decay, batch_size, generator, forward=None,
             objective=None, parameters=None, carried=None):
    if forward is not None or objective is not None or parameters is not None:
        return None
    if carried is not None and not _plain_heavy_ball(carried, model, lr, momentum, weight_decay):
        return None
    if not _batchable(model, x):
        return None
    return (layout(model).architecture, tuple(x.shape[1:]), x.dtype, y.dtype, x.device, epochs, steps, lr, momentum,
            weight_decay, batch_size, carried is not None)


def _plain_heavy_ball(carried, model, lr, momentum, weight_decay) -> bool:
    """Whether a carried HeavyBall steps as _sgd_update does: every parameter of the model in one group,
    with the call's lr, momentum and weight decay (sgd steps with the optimizer's, and the key holds the call's)."""
    optimizer = carried.optimizer
    if len(optimizer.param_groups) != 1:
        return False
    group, mine = optimizer.param_groups[0], list(model.parameters())
    return (len(group["params"]) == len(mine) and all(a is b for a, b in zip(group["params"], mine))
            and (group["lr"], group["momentum"], group["weight_decay"]) == (lr, momentum, weight_decay)
            and not (group["dampening"] or group["nesterov"] or group["maximize"]))


def _batchable(model, x) -> bool:
    """Whether vmap pays: not for tied tensors, nor for convolutions on a CPU, where vmap's grouped
    convolution runs slower than one node after another (docs/batched.md has the measurement), nor for
    an RNN (char-lstm): vmap has no batching rule for the LSTM kernels. On a CPU training falls back to
    a loop under a warning, 3-4 times slower than one node after another (8 nodes, hidden 32 and 256),
    and evaluation (no_grad) cannot run at all; on CUDA neither runs (cuDNN's weights have no storage)."""
    model_layout = layout(model)
    return (model_layout.architecture is not None and not model_layout.recurrent
            and not (model_layout.convolution and x.device.type == "cpu"))


def sgd_together(calls: list[tuple[tuple, dict]]) -> list[tuple[float, int]]:
    """training.sgd for each call, as vectorised steps: step t of every node runs as one call."""
    stack = Stack([args[0] for args, _ in calls], training=True)
    return stack.restore(_sgd_rows(stack, stack.arrange(calls)))


def _sgd_rows(stack: Stack, calls: list) -> list[tuple[float, int]]:
    xs, ys = [args[1] for args, _ in calls], [args[2] for args, _ in calls]
    o = calls[0][1]
    passes = 1 if o["steps"] else o["epochs"]
    # Each node draws its batches from its own generator, in sgd's order; sgd skips single-sample batches.
    orders = [[idx for _ in range(passes) for idx in batches(len(y), o["batch_size"], kw["generator"], o["steps"])
               if len(idx) >= 2] for y, (_, kw) in zip(ys, calls)]
    params, buffers = stack.split()
    carried = [kw.get("carried") for _, kw in calls]
    momenta = _momenta(stack, params, carried) if o["momentum"] else {}
    device = xs[0].device
    totals = torch.zeros(len(calls), dtype=torch.float64, device=device)
    step = _step_function(stack.models[0])
    by_size = stack.layouts[0].batch_norm
    with torch.no_grad():
        for t in range(max(map(len, orders), default=0)):
            for members in _steppers(orders, t, by_size):
                index = torch.tensor(members, device=device)
                rows = None if len(members) == len(calls) else index
                p, b, m = _rows_of(params, rows), _rows_of(buffers, rows), _rows_of(momenta, rows)
                idx = [orders[i][t] for i in members]
                lengths = [len(i) for i in idx]
                counts = torch.tensor(lengths, device=device)
                x = _padded([xs[i][j] for i, j in zip(members, idx)], max(lengths))
                y = _padded([ys[i][j] for i, j in zip(members, idx)], max(lengths))
                with torch.enable_grad():
                    grads, per_sample = step(p, b, x, y, _mask(counts, max(lengths)))
                _sgd_update(p, grads, m, o)
                for stacked, values in ((params, p), (buffers, b), (momenta, m)):
                    _put_rows(stacked, rows, values)
                totals.index_add_(0, index, _batch_losses(per_sample, lengths).double() * counts.double())
    stack.write_back()
    if momenta and carried[0] is not None:
        _carry_momenta(stack, momenta, carried)
    seen = [sum(map(len, order)) for order in orders]
    return [(total / max(n, 1), n) for total, n in zip(totals.tolist(), seen)]


def _carried_slots(stack: Stack, carried: list):
    """(row, parameter name, the carried optimizer's state, the parameter) of every node's trained tensors."""
    for row, (model_layout, heavy_ball) in enumerate(zip(stack.layouts, carried)):
        for name, module, leaf, param in model_layout.slots:
            if param:
                yield row, name, heavy_ball.optimizer.state, module._parameters[leaf]


def _momenta(stack: Stack, params: dict, carried: list) -> dict:
    """The momentum buffers, stacked: zeros (sgd's fresh buffers), or each carried HeavyBall's, zeros where it has
    none yet (torch.optim.SGD's first step takes the gradient itself, as zero times momentum plus it does)."""
    momenta = {name: torch.zeros_like(value) for name, value in params.items()}
    if carried[0] is not None:
        with torch.no_grad():
            for row, name, state, p in _carried_slots(stack, carried):
                buffer = state.get(p, {}).get("momentum_buffer")
                if buffer is not None:
                    momenta[name][row].copy_(buffer)
    return momenta


def _carry_momenta(stack: Stack, momenta: dict, carried: list) -> None:
    """Each node's row of the stepped buffers back into its HeavyBall, for its next call."""
    with torch.no_grad():
        for row, name, state, p in _carried_slots(stack, carried):
            state[p]["momentum_buffer"] = momenta[name][row].clone()


def _steppers(orders: list[list], t: int, by_size: bool) -> list[list[int]]:
    """The nodes with a batch t: all together, or (BatchNorm) grouped by the batch's size."""
    groups = defaultdict(list)
    for i, order in enumerate(orders):
        if t < len(order):
            groups[len(order[t]) if by_size else 0].append(i)
    return list(groups.values())


def _sgd_update(params: dict, grads: dict, momenta: dict, o: dict) -> None:
    """torch.optim.SGD's step (heavy ball, no dampening; a zero buffer makes the first step plain), every row at once."""
    for name, value in params.items():
        d = grads[name]
        if o["weight_decay"]:
            d = d.add(value, alpha=o["weight_decay"])
        if momenta:
            d = momenta[name].mul_(o["momentum"]).add_(d)
        value.add_(d, alpha=-o["lr"])


def _step_function(template):
    """vmap(grad) of one node's mean cross-entropy over the unmasked samples of a batch: (grads, per-sample losses)."""
    def loss(p, b, x, y, mask):
        per_sample = F.cross_entropy(func.functional_call(template, (p, b), (x,)), y, reduction="none")
        return (per_sample * mask).sum() / mask.sum(), per_sample.detach()
    return func.vmap(func.grad(loss, has_aux=True))


def _batch_losses(per_sample, lengths: list[int]):
    """Each node's mean loss over its batch as sgd reports it: summed by nll_loss itself, whose order of
    addition a masked sum does not keep (off in the 7th digit): from the same per-sample losses, sgd's to the bit."""
    rows = per_sample.neg().unsqueeze(-1).unbind(0)  # each node's log-probabilities of its labels, as a column
    labels = per_sample.new_zeros(per_sample.shape[1], dtype=torch.long)

    def mean(row, n):  # slicing only a padded batch: a slice costs as much as the sum
        return F.nll_loss(row, labels) if n == len(labels) else F.nll_loss(row[:n], labels[:n])
    return torch.stack([mean(row, n) for row, n in zip(rows, lengths)])


# -- evaluation (eval mode: every sample is scored on its own, so padding is exact)

EVAL_ELEMENTS = 2 ** 20  # input values per vectorised forward pass, all nodes together: a bound on its activations

def _eval_key(model, x, y, batch_size: int = 1024):
    if not _batchable(model, x):
        return None
    return layout(model).architecture, tuple(x.shape[1:]), x.dtype, x.device, batch_size


def _scores_together(calls: list[tuple[tuple, dict]], per_sample) -> list[float]:
    """sum over each node's samples of per_sample(logits, labels), over its sample count (NaN without samples)."""
    stack = Stack([args[0] for args, _ in calls], training=False)
    return stack.restore(_score_rows(stack, stack.arrange(calls), per_sample))


def _score_rows(stack: Stack, calls: list, per_sample) -> list[float]:
    xs, ys = [args[1] for args, _ in calls], [args[2] for args, _ in calls]
    args, kwargs = calls[0]
    batch_size = kwargs.get("batch_size", args[3] if len(args) > 3 else 1024)
    params, buffers = stack.split()
    forward = func.vmap(lambda p, b, x: func.functional_call(stack.models[0], (p, b), (x,)))
    device = xs[0].device
    totals = torch.zeros(len(calls), dtype=torch.float64, device=device)
    chunk = max(1, min(batch_size, EVAL_ELEMENTS // (len(calls) * max(1, math.prod(xs[0].shape[1:])))))
    with torch.no_grad():
        for start in range(0, max(len(y) for y in ys), chunk):
            members = [i for i, y in enumerate(ys) if len(y) > start]
            index = torch.tensor(members, device=device)
            rows = None if len(members) == len(calls) else index
            lengths = [min(len(ys[i]) - start, chunk) for i in members]
            logits = forward(_rows_of(params, rows), _rows_of(buffers, rows),
                             _padded([xs[i][start:start + chunk] for i in members], max(lengths)))
            labels = _padded([ys[i][start:start + chunk] for i in members], max(lengths))
            mask = _mask(torch.tensor(lengths, device=device), max(lengths))
            scores = (per_sample(logits, labels) * mask).sum(1)
            totals.index_add_(0, index, scores.double())
    return [total / len(y) if len(y) else float("nan") for total, y in zip(totals.tolist(), ys)]


def accuracy_together(calls):
    return _scores_together(calls, lambda logits, labels: (logits.argmax(-1) == labels).float())


def mean_loss_together(calls):
    return _scores_together(calls, lambda logits, labels: F.cross_entropy(
        logits.transpose(1, 2), labels, reduction="none"))


@dataclass(frozen=True)
class Together:
    """A job function's batched form (see emulator.compute.Batcher)."""
    key: Callable
    run: Callable


BATCHERS = {
    sgd: Together(_sgd_key, sgd_together),
    accuracy: Together(_eval_key, accuracy_together),
    mean_loss: Together(_eval_key, mean_loss_together),
}


# -- the bookkeeping jobs averaging protocols run inline: by the layout, without state_dict()'s walk

def float_state_by_layout(module) -> dict:
    """training.float_state."""
    model_layout = layout(module)
    if model_layout.architecture is None:
        return float_state(module)
    return {name: t.detach().clone() for name, t in model_layout.state().items() if t.is_floating_point()}


def mix_by_layout(module, self_weight: float, others: list[tuple[float, dict]]) -> None:
    """training.mix, as one multi-tensor operation per neighbour."""
    model_layout = layout(module)
    if not others or model_layout.architecture is None:
        return mix(module, self_weight, others)
    state = model_layout.state()
    names = list(others[0][1])
    values = [state[name] for name in names]
    with torch.no_grad():
        torch._foreach_mul_(values, self_weight)
        for weight, other in others:
            torch._foreach_add_(values, [other[name].to(v.device, v.dtype) for name, v in zip(names, values)],
                                alpha=weight)


def shift_by_layout(module, delta: dict) -> None:
    """training.shift, as one multi-tensor operation (CHOCO's and PowerGossip's consensus step)."""
    model_layout = layout(module)
    if model_layout.architecture is None:
        return shift(module, delta)
    state = model_layout.state()
    values = [state[name] for name in delta]
    with torch.no_grad():
        torch._foreach_add_(values, [d.to(v.device, v.dtype) for v, d in zip(values, delta.values())])


SHORTCUTS = {float_state: float_state_by_layout, mix: mix_by_layout, shift: shift_by_layout}
