"""Adversarial nodes: chosen senders put an attack on the wire instead of what their protocol wrote.

An attack rewrites the floating-point tensors and arrays of a body, wherever they sit
in its dicts and lists; everything else (ids, degrees, counts) passes as written:

- signflip: -x;
- noise:std=S: x plus Gaussian noise of standard deviation S (default 1);
- random: a standard normal draw of x's shape, x itself forgotten;
- nan: every value NaN;
- stale: the first body the node ever sent of that kind, again and again;
- oversize: the body plus a padding array of 8 times its floating-point bytes.

Which nodes attack is drawn once from the run's seed. No learning happens here: the
attack is as blind to the protocol as a compromised sender's network stack would be.
"""
from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import wire
from .seeds import numpy_generator, numpy_state

KINDS = ("signflip", "noise", "random", "nan", "stale", "oversize")
PADDING = 8  # oversize: padding bytes per floating-point byte of the body


@dataclass(frozen=True)
class AdversarySpec:
    fraction: float
    kind: str
    std: float = 1.0


class Adversaries:
    def __init__(self, spec: AdversarySpec, num_nodes: int, seeds):
        self.spec = spec
        count = round(spec.fraction * num_nodes)
        chosen = seeds.numpy("adversaries").choice(num_nodes, size=count, replace=False)
        self.nodes = frozenset(int(node) for node in chosen)
        self._seeds = seeds
        self._rngs: dict[int, np.random.Generator] = {}
        self._first: dict[tuple[int, str], Any] = {}  # stale: (node, kind) -> its first body

    def state(self) -> dict:
        """Each attacker's noise generator, and the first bodies the stale attack keeps sending, as plain data."""
        return {"rngs": {src: numpy_state(rng) for src, rng in self._rngs.items()},
                "first": [[src, kind, bytes(wire.encode(body))] for (src, kind), body in self._first.items()]}

    def load_state(self, state: dict) -> None:
        for src, rng in state["rngs"].items():
            self._rngs[src] = numpy_generator(rng)
        self._first.update({(src, kind): wire.decode(body) for src, kind, body in state["first"]})

    def tamper(self, src: int, kind: str, body: Any) -> Any:
        """What adversary `src` sends in place of `body`."""
        attack = self.spec.kind
        if attack == "stale":
            return self._first.setdefault((src, kind), copy.deepcopy(body))
        if attack == "oversize":
            floats = _float_bytes(body)
            return {**body, "padding": np.zeros(PADDING * floats // 4 + 1, np.float32)} if isinstance(body, dict) \
                else body
        rng = self._rngs.get(src)
        if rng is None:
            rng = self._rngs[src] = self._seeds.numpy("adversary", src)
        change = {"signflip": lambda a: -a,
                  "noise": lambda a: a + self.spec.std * rng.standard_normal(a.shape),
                  "random": lambda a: rng.standard_normal(a.shape),
                  "nan": lambda a: np.full(a.shape, math.nan)}[attack]
        return _map_floats(body, change)


def _map_floats(value: Any, change: Callable[[np.ndarray], np.ndarray]) -> Any:
    """value with each floating tensor or array x replaced by change(x) (same shape, dtype and type)."""
    if isinstance(value, dict):
        return {key: _map_floats(item, change) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_floats(item, change) for item in value)
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return change(value.astype(np.float64)).astype(value.dtype)
    torch = sys.modules.get("torch")  # a tensor exists only once torch is loaded
    if torch is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
        changed = change(value.detach().cpu().double().numpy())
        return torch.from_numpy(np.ascontiguousarray(changed)).to(value.dtype)
    return value


def _float_bytes(value: Any) -> int:
    if isinstance(value, dict):
        return sum(_float_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_float_bytes(item) for item in value)
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return value.nbytes
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.numel() * value.element_size()
    return 0
