"""Gossip learning (Ormándi, Hegedűs and Jelasity, 2013), round by round as gossipy runs it.

Each round (one gossip cycle of --period emulated seconds), node i:
  1. pushes (x_i, age_i) to one neighbour drawn uniformly by its own generator;
  2. until --period has passed since the round began, merges each model that
     arrives, in arrival order and whatever round it was sent in:
       average: x_i <- (x_i + x_j) / 2
       age:     x_i <- (age_i x_i + age_j x_j) / (age_i + age_j)
     and age_i <- max(age_i, age_j);
  3. trains one local round and sets age_i <- age_i + 1 (--train-on-receipt-only:
     only if a model arrived in step 2). Only floating-point tensors are merged.
A push to an offline node is dropped by the network; nobody waits for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from emulator.compute import Resident
from emulator.errors import UsageError
from emulator.protocol import register
from p2p_emulator.workloads.training import mix

from .common import STATE, LearningProtocol, SGDOptions, like

MERGES = ("average", "age")


@dataclass
class GossipLearningOptions(SGDOptions):
    period: float = field(default=1.0, metadata={
        "help": "gossip-learning: emulated seconds a node listens for pushed models each round (the gossip cycle)"})
    merge: str = field(default="average", metadata={
        "help": "gossip-learning: how a received model is merged: average (halfway) or age (weighted by ages)"})
    train_on_receipt_only: bool = field(default=False, metadata={
        "help": "gossip-learning: train only in rounds where a model arrived, as gossipy does"})

    def validate(self):
        super().validate()
        if self.merge not in MERGES:
            raise UsageError(f"--merge {self.merge!r}: choose one of {', '.join(MERGES)}")
        if not self.period > 0:
            raise UsageError(f"--period {self.period}: must be positive")


def merge_weight(how: str, age: int, other_age: int) -> float:
    """The weight of the received model: 1/2, or its share of the two ages (1/2 when both are 0)."""
    if how == "age" and age + other_age > 0:
        return other_age / (age + other_age)
    return 0.5


@dataclass
class Carried:
    """What a node carries from round to round: its model and the model's age."""
    model: Resident
    age: int


@register("gossip-learning")
class GossipLearning(LearningProtocol):
    """Gossip learning: push the model to one random neighbour, merge what arrives, train."""
    Options = GossipLearningOptions
    averages_models = True
    checkpointable = True

    async def run(self, node):
        o = self.options
        model, data = self.hold(node)
        state = node.carry(Carried(model, age=0))
        async for _ in node.rounds():
            age = state.age
            deadline = node.now() + o.period
            body = {STATE: await self.state(node, model), "age": age}
            if node.neighbours:
                node.send(node.rng.choice(node.neighbours), "model", body)
            heard = 0
            # A push sent in an earlier round is still a model: take every one, in arrival order.
            while (msg := await node.recv(timeout=deadline - node.now(), kind="model", valid=like(body))) is not None:
                w = merge_weight(o.merge, age, msg.body["age"])
                await node.compute(mix, model, 1.0 - w, [(w, msg.body[STATE])], work=0)
                age, heard = max(age, msg.body["age"]), heard + 1
            trained = {}
            if heard or not o.train_on_receipt_only:
                trained = {"train_loss": await self.train(node, model, data)}
                age += 1
            state.age = age
            node.snapshot(await self.state(node, model))
            node.log(**trained, **await self.evaluate(node, model, data), heard_from=heard)
