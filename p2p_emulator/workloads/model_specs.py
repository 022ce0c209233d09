"""Model specs as the user writes them (`mlp:hidden=64,64`, `hetero-small`), read without torch.

Settings are checked against these before any dataset or model is loaded; the models
themselves are built in `p2p_emulator.workloads.models`.
"""
from __future__ import annotations

import numpy as np


class ModelError(ValueError):
    """A bad model configuration; the message is a one-line user-facing sentence."""


MODELS = ("cnn-small", "mlp", "resnet18", "shufflenet", "googlenet", "alexnet", "hetero", "hetero-small")
HETERO_ARCHS = ("resnet18", "shufflenet", "googlenet", "alexnet")
HETERO_SMALL_ARCHS = ("cnn-small", "small-resnet", "small-dwsep", "small-mixer")
ASSIGNMENTS = ("round-robin", "random")
NORMS = ("batch", "group")

_POOLS = {"hetero": HETERO_ARCHS, "hetero-small": HETERO_SMALL_ARCHS}


# Widths a model spec may set, as `name:key=w1,w2,...` (e.g. mlp:hidden=64,64).
SHAPES = {"mlp": "hidden", "cnn-small": "channels"}


def parse_model(spec: str) -> tuple[str, tuple[int, ...] | None]:
    """'mlp:hidden=64,64' -> ('mlp', (64, 64)); a bare name -> (name, None)."""
    name, _, rest = spec.strip().partition(":")
    if name not in MODELS:
        raise ModelError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if not rest:
        return name, None
    key, _, values = rest.partition("=")
    if name not in SHAPES or key.strip() != SHAPES[name]:
        shaped = ", ".join(f"{n}:{k}=W1,W2,..." for n, k in SHAPES.items())
        raise ModelError(f"model {spec!r}: only {shaped} take parameters")
    try:
        widths = tuple(int(v) for v in values.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise ModelError(f"model {spec!r}: {key.strip()} must be positive integers separated by commas")
    return name, widths


def assigned_arch(spec: str, node: int, assign: str = "round-robin", seed=0) -> str:
    """The concrete architecture node `node` gets under model `spec`."""
    name, _ = parse_model(spec)
    if assign not in ASSIGNMENTS:
        raise ModelError(f"unknown model assignment {assign!r}; choose one of {', '.join(ASSIGNMENTS)}")
    pool = _POOLS.get(name)
    if pool is None:
        return name
    if assign == "round-robin":
        return pool[node % len(pool)]
    # Independent per node: `seed` (an int or a SeedSequence) is the node's own.
    return pool[int(np.random.default_rng(seed).integers(len(pool)))]
