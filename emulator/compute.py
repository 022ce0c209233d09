"""Compute jobs on the shared executor, and the emulated time they are charged."""
from __future__ import annotations

import os

from dataclasses import dataclass
from typing import Callable

from .clock import sleep


@dataclass(frozen=True)
class ComputeModel:
    """How much emulated time a compute job is charged.

    kind "model": work * cost_per_unit * slowdown (deterministic);
    kind "measured": the job's wall time * factor * slowdown.
    """
    kind: str
    cost_per_unit: float
    factor: float
    slowdowns: tuple[float, ...]


class Compute:
    """Runs nodes' jobs on the clock's executor and charges each by the model.

    An offline node starts a job once it is back, and time offline during the job
    does not count: the result comes that much later.
    """

    def __init__(self, model: ComputeModel, clock, availability=None):
        self.model, self.clock, self.availability = model, clock, availability

    async def run(self, node: int, fn: Callable, args: tuple, work: float):
        availability = self.availability
        if availability is None:
            return await self._submit(node, fn, args, work)
        await availability.until_online(node)
        start = self.clock.now
        result = await self._submit(node, fn, args, work)
        lost = availability.offline_time(node, start, self.clock.now)
        while lost > 0:
            await availability.until_online(node)
            start = self.clock.now
            await sleep(self.clock, lost)
            lost = availability.offline_time(node, start, self.clock.now)
        return result

    def _submit(self, node: int, fn: Callable, args: tuple, work: float):
        model = self.model
        slowdown = model.slowdowns[node]
        if model.kind == "measured":
            return self.clock.submit(fn, args, None, model.factor * slowdown)
        return self.clock.submit(fn, args, work * model.cost_per_unit * slowdown)


def physical_memory() -> int:
    """Bytes of RAM on this machine: what a run's state must fit in."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
