"""D-PSGD (Lian et al., 2017): one local SGD step, then gossip averaging with the neighbours.

DFedAvgM's round with a single local step and no momentum.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from emulator.protocol import register

from .dfedavgm import DFedAvgM, DFedAvgMOptions


@dataclass
class DPSGDOptions(DFedAvgMOptions):
    local_steps: int = field(default=1, metadata={"help": "local SGD steps per round (0: use --local-epochs)"})
    momentum: float = field(default=0.0, metadata={"help": "heavy-ball momentum"})


@register("dpsgd")
class DPSGD(DFedAvgM):
    """D-PSGD: one SGD step per round, then Metropolis-Hastings averaging."""
    Options = DPSGDOptions
