"""Model specs as the user writes them (`mlp:hidden=64,64`, `hetero-small`), read without torch.

Settings are checked against these before any dataset or model is loaded; the models
themselves are built in `p2p_emulator.workloads.models`.
"""
from __future__ import annotations

import numpy as np


class ModelError(ValueError):
    """A bad model configuration; the message is a one-line user-facing sentence."""


MODELS = ("cnn-small", "mlp", "resnet18", "shufflenet", "googlenet", "alexnet", "hetero", "hetero-small",
          "leaf-cnn", "char-lstm")
HETERO_ARCHS = ("resnet18", "shufflenet", "googlenet", "alexnet")
HETERO_SMALL_ARCHS = ("cnn-small", "small-resnet", "small-dwsep", "small-mixer")
ASSIGNMENTS = ("round-robin", "random")
NORMS = ("batch", "group")

_POOLS = {"hetero": HETERO_ARCHS, "hetero-small": HETERO_SMALL_ARCHS}


# Widths a model spec may set, as `name:key=w1,w2,...` (e.g. mlp:hidden=64,64).
SHAPES = {"mlp": "hidden", "cnn-small": "channels", "char-lstm": "hidden"}
# Shaped models that take one width: both of char-lstm's LSTM layers have the same size.
ONE_WIDTH = frozenset({"char-lstm"})


def parse_model(spec: str) -> tuple[str, tuple[int, ...] | None]:
    """'mlp:hidden=64,64' -> ('mlp', (64, 64)); a bare name -> (name, None)."""
    name, _, rest = spec.strip().partition(":")
    if name not in MODELS:
        raise ModelError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if not rest:
        return name, None
    key, _, values = rest.partition("=")
    if name not in SHAPES or key.strip() != SHAPES[name]:
        shaped = ", ".join(f"{n}:{k}={'W' if n in ONE_WIDTH else 'W1,W2,...'}" for n, k in SHAPES.items())
        raise ModelError(f"model {spec!r}: only {shaped} take parameters")
    try:
        widths = tuple(int(v) for v in values.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise ModelError(f"model {spec!r}: {key.strip()} must be positive integers separated by commas")
    if name in ONE_WIDTH and len(widths) > 1:
        raise ModelError(f"model {spec!r}: {key.strip()} is one width, that of every layer")
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


# What each architecture reads; every other one reads images (C, H, W).
READS = {"char-lstm": ("tokens",), "mlp": ("image", "features")}
_DATA = {"image": "images", "tokens": "token sequences (fortunes, leaf-shakespeare, leaf-sent140)",
         "features": "feature vectors"}
_FOR = {"image": "cnn-small or leaf-cnn", "tokens": "char-lstm", "features": "mlp"}  # a model that reads each kind


def data_kind(shape: tuple[int, ...], vocabulary: int) -> str:
    """What a dataset of samples of `shape` gives: token ids come with a vocabulary, images have three axes."""
    if len(shape) == 1 and shape[0] >= 1:
        return "tokens" if vocabulary > 0 else "features"
    if len(shape) == 3 and min(shape) >= 1:
        return "image"
    raise ModelError(f"input shape must be (channels, height, width), (features,) or (tokens,), got {tuple(shape)}")


def check_reads(spec: str, arch: str, shape: tuple[int, ...], vocabulary: int) -> None:
    """A one-line ModelError when architecture `arch` (of `spec`) cannot read samples of `shape`."""
    kind = data_kind(shape, vocabulary)
    reads = _reads(arch)
    if kind not in reads:
        gives = {"image": f"images {tuple(shape)}", "tokens": f"token sequences of length {shape[0]}",
                 "features": f"feature vectors of {shape[0]} values"}[kind]
        raise ModelError(f"--model {spec} reads {' or '.join(_DATA[k] for k in reads)}; this dataset gives "
                         f"{gives}: use --model {_FOR[kind]}")


def reads_images(spec: str) -> bool:
    """Whether model `spec` may give a node an architecture that reads images (all but char-lstm)."""
    name, _ = parse_model(spec)
    return any("image" in _reads(arch) for arch in _POOLS.get(name, (name,)))


def _reads(arch: str) -> tuple[str, ...]:
    return READS.get(arch, ("image",))  # the image models are the unlisted default
