"""What a compute job does, counted, and what a device charges for it.

A job's Work is a handful of counts taken from the kernels it runs: the kernels
launched (convolutions apart: each costs far more to set up), the views taken,
the tensor elements that memory-bound kernels write (memory traffic), the time
steps recurrent layers take one after another, and the floating-point operations
of matrix products, convolutions and recurrent layers, plus the Python-level
steps (minibatches) around them. A DeviceProfile prices each count in seconds;
the job is charged the sum:

    seconds = sum over counts c of work.c * profile.c

`reference_seconds` is work no kernel count sees (cryptography): seconds on the
reference device, scaled by the profile's `uncounted` factor. `units` is the old
measure (training-sample steps), which `--compute-time per-sample` charges alone.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

# The counts a device profile prices, in the order of its fields.
PRICED = ("steps", "kernels", "convolutions", "views", "elements", "recurrent_steps", "matmul_flops", "conv_flops",
          "recurrent_flops")


@dataclass(frozen=True)
class Work:
    """A job's counts (see the module docstring); Work() is bookkeeping, charged nothing."""
    steps: float = 0.0
    kernels: float = 0.0
    convolutions: float = 0.0
    views: float = 0.0
    elements: float = 0.0
    recurrent_steps: float = 0.0
    matmul_flops: float = 0.0
    conv_flops: float = 0.0
    recurrent_flops: float = 0.0
    reference_seconds: float = 0.0
    units: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __sub__(self, other: "Work") -> "Work":
        return self + other * -1

    def __mul__(self, factor: float) -> "Work":
        return Work(*(a * factor for a in dataclasses.astuple(self)))

    __rmul__ = __mul__

    def __bool__(self) -> bool:
        return any(dataclasses.astuple(self))

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.conv_flops + self.recurrent_flops


@dataclass(frozen=True)
class DeviceProfile:
    """Seconds a device takes per count of each kind (per kernel, per FLOP, ...); `uncounted`: its seconds per
    reference second of work no count sees."""
    name: str
    steps: float
    kernels: float
    convolutions: float
    views: float
    elements: float
    recurrent_steps: float
    matmul_flops: float
    conv_flops: float
    recurrent_flops: float
    uncounted: float = 1.0

    def seconds(self, work: Work) -> float:
        """What the device is charged for `work`."""
        total = work.reference_seconds * self.uncounted
        for name in PRICED:
            total += getattr(work, name) * getattr(self, name)
        return total

    def scaled(self, speed: float, name: str) -> "DeviceProfile":
        """This device made `speed` times faster (every count priced 1/speed as much)."""
        return DeviceProfile(name, *(getattr(self, f.name) / speed for f in fields(self)[1:]))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
