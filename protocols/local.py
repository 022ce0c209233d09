"""Local: every node trains on its own data and never communicates — the floor personalised methods must beat."""
from __future__ import annotations

from dataclasses import dataclass

from emulator.protocol import register

from .common import CarriedModel, LearningProtocol, SGDOptions, default


@dataclass
class LocalOptions(SGDOptions):
    init: str = default(SGDOptions, "init", "independent")


@register("local")
class Local(LearningProtocol):
    """Local training only; sends nothing."""
    Options = LocalOptions
    checkpointable = True
    state_copies = 1.0

    async def run(self, node):
        model, data = self.hold(node)
        node.carry(CarriedModel(model))
        async for _ in node.rounds():
            loss = await self.train(node, model, data)
            node.log(train_loss=loss, **await self.evaluate(node, model, data))
