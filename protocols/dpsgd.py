"""D-PSGD (Lian et al., 2017): one local SGD step, then gossip averaging with the neighbours.

DFedAvgM's round with a single local step and no momentum.
"""
from __future__ import annotations

from dataclasses import dataclass

from emulator.protocol import register

from .common import SGDOptions, default
from .dfedavgm import DFedAvgM, DFedAvgMOptions


@dataclass
class DPSGDOptions(DFedAvgMOptions):
    local_steps: int = default(SGDOptions, "local_steps", 1)
    momentum: float = default(SGDOptions, "momentum", 0.0)


@register("dpsgd")
class DPSGD(DFedAvgM):
    """D-PSGD: one SGD step per round, then Metropolis-Hastings averaging."""
    Options = DPSGDOptions
