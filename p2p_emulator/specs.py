"""Spec strings: the settings written `name:key=value,...`, read by one parser into the emulator's objects.

`read_spec` (in emulator.units, so that every layer reads specs alike) splits a spec into its name and
key=value items and `Spec.keywords` checks the keys against the required and optional ones; the parsers
below (latency, loss and corruption models, adversaries, per-node capacities and slowdowns) turn the
values into objects. Each error is one line that quotes the spec.
"""
from __future__ import annotations

import math

import numpy as np

from emulator import units
from emulator.adversaries import KINDS as ATTACKS
from emulator.adversaries import AdversarySpec
from emulator.links import Bernoulli, Corruption, Delay, GilbertElliott
from emulator.units import read_spec


DELAY_KEYS = {"uniform": ("low", "high"), "normal": ("mean", "std"), "lognormal": ("median", "sigma")}


def parse_delay(text: str | float) -> Delay:
    """'20ms', 'uniform:low=10ms,high=30ms', 'normal:mean=20ms,std=5ms', 'lognormal:median=20ms,sigma=0.5'."""
    if isinstance(text, (int, float)) or str(text).strip()[:1] in tuple("0123456789.-+"):
        return Delay("constant", value=units.duration(text))
    spec = read_spec(text)
    keys = DELAY_KEYS.get(spec.name)
    if keys is None:
        raise units.UnitError(f"unknown latency model {spec.name!r} (use a duration, uniform, normal or lognormal)")
    params = spec.keywords(keys, usage=f"latency {text!r} needs exactly {', '.join(keys)}")
    return Delay(spec.name, **{k: (_sigma(text, v) if k == "sigma" else units.duration(v)) for k, v in params.items()})


def _sigma(text: str, value: str) -> float:
    sigma = _number(value)
    if not 0 <= sigma < math.inf:
        raise units.UnitError(f"latency {text!r:.60}: sigma must be a finite number >= 0")
    return sigma


def _number(value: str) -> float:
    """The value as a float; NaN where it is not a number, so that every range check refuses it."""
    try:
        return float(value)
    except ValueError:
        return math.nan


def parse_loss(text: str | float) -> Bernoulli | GilbertElliott:
    """'0.01' (Bernoulli) or 'ge:p=0.01,r=0.3[,loss_good=0,loss_bad=1]'."""
    if isinstance(text, (int, float)) or not str(text)[:1].isalpha():
        return Bernoulli(units.probability(text))
    spec = read_spec(text)
    if spec.name not in ("ge", "gilbert-elliott"):
        raise units.UnitError(f"unknown loss model {spec.name!r} (use a probability or ge:p=..,r=..)")
    params = spec.keywords(("p", "r"), ("loss_good", "loss_bad"),
                           usage=f"loss {text!r} needs p and r (optional loss_good, loss_bad)")
    return GilbertElliott(**{k: units.probability(v) for k, v in params.items()})


def parse_corrupt(text: str | float) -> Corruption:
    """'0.01' (one bit flipped in that fraction of messages) or 'ber:1e-7' (each bit with that probability)."""
    if isinstance(text, str) and text.strip().startswith("ber:"):  # a name and a bare value: no keywords
        return Corruption(ber=units.probability(text.strip()[4:]))
    return Corruption(p=units.probability(text))


def parse_adversaries(text: str) -> AdversarySpec | None:
    """'none', or 'fraction=0.1,kind=signflip' (kind noise takes noise:std=S)."""
    if str(text).strip().lower() in ("none", "", "0"):
        return None
    usage = f"adversaries {text!r:.60}: expected fraction=F,kind=K with K one of {', '.join(ATTACKS)}"
    params = read_spec(text, named=False, bad_item=usage).keywords(("fraction", "kind"), usage=usage)
    no_std = f"adversaries {text!r:.60}: only noise takes a parameter, std=S (finite, >= 0)"
    attack = read_spec(params["kind"], bad_item=no_std)
    if attack.name not in ATTACKS:
        raise units.UnitError(usage)
    takes = ("std",) if attack.name == "noise" else ()
    std = _number(attack.keywords(optional=takes, usage=no_std).get("std", "1"))
    if not 0 <= std < math.inf:
        raise units.UnitError(no_std)
    return AdversarySpec(units.probability(params["fraction"]), attack.name, std)


# Each compute-speed model: its parameters' defaults, and its draw of slowdowns for n nodes.
SPEEDS = {
    "constant": ({"value": 1.0}, lambda p, n, rng: np.full(n, p["value"])),
    "uniform": ({"low": 1.0, "high": 2.0}, lambda p, n, rng: rng.uniform(p["low"], p["high"], n)),
    "lognormal": ({"sigma": 0.5}, lambda p, n, rng: rng.lognormal(0.0, p["sigma"], n)),
    "stragglers": ({"fraction": 0.1, "slowdown": 5.0}, lambda p, n, rng: _stragglers(p, n, rng)),
}


def _stragglers(params: dict, num_nodes: int, rng: np.random.Generator) -> np.ndarray:
    """Exactly round(fraction * n) nodes slowed, the seed choosing which: a coin per node could slow none.

    Python's round, so a half rounds to even (fraction 0.5 of 5 nodes slows 2, of 7 nodes 4); it is the
    same on every run, and the nodes are the seed's alone.
    """
    slow = rng.permutation(num_nodes)[:round(params["fraction"] * num_nodes)]
    factors = np.ones(num_nodes)
    factors[slow] = params["slowdown"]
    return factors


SLOWDOWN_KEYS = ("value", "low", "high", "slowdown")  # the parameters that are themselves slowdown factors


def slowdowns(text: str, num_nodes: int, rng: np.random.Generator) -> tuple[float, ...]:
    """Per-node compute slowdown factors (1 = nominal speed), drawn reproducibly."""
    spec = read_spec(text)
    try:  # values before the model and its keys: a spec with several faults is told the fault it always was
        values = {k: float(v) for k, v in spec.items}
    except ValueError:
        raise units.UnitError(f"compute speed {text!r:.60}: parameters must be numbers") from None
    if not all(math.isfinite(v) for v in values.values()):
        raise units.UnitError(f"compute speed {text!r:.60}: parameters must be finite")
    if spec.name not in SPEEDS:
        raise units.UnitError(f"unknown compute speed {spec.name!r} (use {', '.join(SPEEDS)})")
    defaults, draw = SPEEDS[spec.name]
    spec.keywords(optional=tuple(defaults), usage=f"compute speed {text!r}: unknown or repeated parameter")
    params = {**defaults, **values}
    if params.get("low", 0) > params.get("high", math.inf) or params.get("sigma", 0) < 0:  # numpy would raise
        raise units.UnitError(f"compute speed {text!r}: need low <= high and sigma >= 0")
    # checked on the parameters, not on a draw: a draw may miss the nodes a bad value would slow
    if (bad := next((k for k in SLOWDOWN_KEYS if params.get(k, 1.0) <= 0), None)) is not None:
        raise units.UnitError(f"compute speed {text!r}: {bad} must be positive (it is a slowdown factor)")
    if not 0 <= params.get("fraction", 0) <= 1:
        raise units.UnitError(f"compute speed {text!r}: fraction must be in [0, 1]")
    factors = draw(params, num_nodes, rng)
    if not np.all(factors > 0):
        raise units.UnitError(f"compute speed {text!r}: slowdowns must be positive")
    return tuple(float(f) for f in factors)


CAPACITY_KEYS = {"uniform": ("low", "high"), "lognormal": ("median", "sigma")}


def node_rates(text: str | float, num_nodes: int, rng: np.random.Generator) -> list[float]:
    """Per-node capacities in bit/s: one rate for all, or uniform/lognormal draws from rng."""
    if isinstance(text, (int, float)) or ":" not in str(text):
        return [units.rate(text)] * num_nodes
    usage = f"capacity {text!r}: use a rate, uniform:low=..,high=.. or lognormal:median=..,sigma=.."
    spec = read_spec(text)
    if spec.name not in CAPACITY_KEYS:
        raise units.UnitError(usage)
    params = spec.keywords(CAPACITY_KEYS[spec.name], usage=usage)
    if spec.name == "uniform":
        low, high = units.rate(params["low"]), units.rate(params["high"])
        if not high >= low or math.isinf(high):
            raise units.UnitError(f"capacity {text!r}: need finite low <= high")
        return [float(r) for r in rng.uniform(low, high, num_nodes)]
    sigma = _number(params["sigma"])
    if not sigma >= 0:
        raise units.UnitError(f"capacity {text!r}: sigma must be a number >= 0")
    return [float(r) for r in units.rate(params["median"]) * rng.lognormal(0.0, sigma, num_nodes)]
