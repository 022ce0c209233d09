"""The work of a model's jobs, counted from the kernels they run: what counted compute time charges.

One training step (training.sgd on one minibatch) and one scoring pass (forward, no
gradient) are run on a copy of the model, at two batch sizes, under a dispatch mode
that counts kernels, views, the elements memory-bound kernels write and the time
steps of LSTM layers, and the FLOPs of each kernel by torch's FlopCounterMode
formulas. Every count is affine in the batch size, so the two give each count's
fixed part and its part per sample; a job of n samples in minibatches of B is then
ceil(n / B) steps' fixed parts plus n samples' parts. Counts are cached per
(architecture, input), so a run counts each architecture once.

Those formulas count nothing for oneDNN's LSTM kernels: their FLOPs are counted
here, 2 * 4H(I + H) per time step and sample for a layer of input I and H units,
and twice that for the backward pass.
"""
from __future__ import annotations

import copy
import functools
import math

from emulator.work import Work
from .lazy import LazyModule

torch = LazyModule("torch")

COUNTED_BATCHES = (2, 4)  # BatchNorm trains on two samples at the least
SCORING_BATCH = 1024  # training.accuracy's and mean_loss's minibatch
FORWARD_SHARE = 1 / 3  # a forward pass's share of a training step: per-sample time charges a scored sample that
# Ops that only make a view of their input: no kernel runs, only the dispatcher.
VIEWS = frozenset({"view", "_unsafe_view", "detach", "transpose", "t", "select", "expand", "reshape", "permute",
                   "alias", "as_strided", "slice", "unsqueeze", "squeeze", "split", "unbind", "split_with_sizes",
                   "unflatten", "flatten", "view_as"})


class ModelWork:
    """A model's counted work: a training step and a scoring pass, each a fixed part and a part per sample.
    Each is counted when first asked for (a run of no rounds never runs a training step, nor imports
    the optimizer), on a copy of the model."""

    def __init__(self, model, x, y):
        self._model = copy.deepcopy(model).cpu()
        n = max(COUNTED_BATCHES)
        self._x, self._y = _enough(x[:n].cpu(), n), _enough(y[:n].cpu(), n)
        self._step: tuple[Work, Work] | None = None
        self._score: tuple[Work, Work] | None = None

    def training(self, samples: float, batch_size: int) -> Work:
        """Local SGD over `samples` samples in minibatches of batch_size."""
        if self._step is None:
            self._step = _affine(self._train)
        return _in_batches(*self._step, samples, batch_size, units=samples)

    def scoring(self, samples: int, batch_size: int = SCORING_BATCH) -> Work:
        """A forward pass over `samples` samples (accuracy, mean loss, representations)."""
        if self._score is None:
            self._score = _affine(self._forward)
        return _in_batches(*self._score, samples, batch_size, units=samples * FORWARD_SHARE)

    def _train(self, batch: int) -> None:
        from .training import sgd  # noqa: PLC0415 - training imports torch

        sgd(self._model, self._x[:batch], self._y[:batch], epochs=1, steps=1, lr=1e-9, momentum=0.9,
            weight_decay=5e-4, batch_size=batch, generator=torch.Generator().manual_seed(0))

    def _forward(self, batch: int) -> None:
        self._model.eval()
        with torch.no_grad():
            self._model(self._x[:batch])


def model_work(model, x, y) -> ModelWork:
    """The counted work of `model` on inputs like x (labels like y), cached; the model itself is not touched."""
    key = (repr(model), tuple(x.shape[1:]), str(x.dtype))
    if key not in _CACHE:
        _CACHE[key] = ModelWork(model, x, y)
    return _CACHE[key]


_CACHE: dict = {}


def _in_batches(fixed: Work, per_sample: Work, samples: float, batch_size: int, units: float) -> Work:
    """ceil(samples / batch_size) steps' fixed parts and `samples` samples' parts."""
    steps = math.ceil(samples / batch_size)
    return fixed * steps + per_sample * samples + Work(steps=steps, units=units)


def _enough(t, n: int):
    """t's rows repeated to n where it has fewer (a node with few samples)."""
    return t.repeat((math.ceil(n / len(t)),) + (1,) * (t.dim() - 1))[:n] if len(t) else t


def _affine(run) -> tuple[Work, Work]:
    """(fixed, per sample) counts of run(batch), from the two counted batch sizes."""
    small, large = COUNTED_BATCHES
    with torch.random.fork_rng(devices=[]):
        low, high = _counts(run, small), _counts(run, large)
    per_sample = (high - low) * (1 / (large - small))
    return low - per_sample * small, per_sample


def _counts(run, batch: int) -> Work:
    with _counter() as counter:  # a dispatch mode is the calling thread's only: other nodes' jobs run on
        run(batch)
    return Work(**counter.counts)


def _rnn_flops(input, weight_ih, weight_hh, *args, out_shape=None, **kwargs) -> int:
    """oneDNN's LSTM layer: 2 * (4H) * (I + H) per time step and sample (shapes: input (T, B, I), w_ih (4H, I))."""
    return 2 * math.prod(input[:-1]) * weight_ih[0] * (weight_ih[1] + weight_hh[1])


def _rnn_backward_flops(input, weight_ih, weight_hh, *args, out_shape=None, **kwargs) -> int:
    return 2 * _rnn_flops(input, weight_ih, weight_hh)


@functools.cache
def _counter_type():
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415
    from torch.utils.flop_counter import flop_registry, shape_wrapper  # noqa: PLC0415

    aten = torch.ops.aten
    formulas = {**flop_registry, aten.mkldnn_rnn_layer: shape_wrapper(_rnn_flops),
                aten.mkldnn_rnn_layer_backward: shape_wrapper(_rnn_backward_flops)}

    class Counter(TorchDispatchMode):
        """Counts the ops dispatched (views, convolutions, other kernels), the elements kernels write, and
        their FLOPs by FlopCounterMode's formulas."""

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # never compiled: torch would otherwise import torch._dynamo (a second) to wrap the hook

        def __init__(self):
            super().__init__()
            self.counts = dict.fromkeys(("kernels", "convolutions", "views", "elements", "recurrent_steps",
                                         "matmul_flops", "conv_flops", "recurrent_flops"), 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            packet = func.overloadpacket
            name = packet.__name__
            if name in VIEWS:
                self.counts["views"] += 1
                return out
            self.counts["convolutions" if "conv" in name else "kernels"] += 1
            if "rnn" in name:  # a layer's time steps run one after another (input: (T, B, I))
                self.counts["recurrent_steps"] += args[0].shape[0]
            if packet in formulas:  # compute-bound: its FLOPs are its cost
                kind = "conv_flops" if "conv" in name else "recurrent_flops" if "rnn" in name else "matmul_flops"
                self.counts[kind] += formulas[packet](*args, **kwargs, out_val=out)
                return out
            for t in out if isinstance(out, (tuple, list)) else (out,):  # memory-bound: the elements it writes
                if isinstance(t, torch.Tensor):
                    self.counts["elements"] += t.numel()
            return out

    return Counter


def _counter():
    return _counter_type()()
