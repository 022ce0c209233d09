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

With --wake-up periodic or poisson, the paper's own schedule (its Algorithm 1): every node runs
its own clock instead of common cycles. periodic: a wake-up every --period, at a phase drawn
uniformly in [0, --period) by the node's generator; poisson: exponential gaps of mean --period
(the node's generator). Node i:
  on each wake-up (one step of its own): pushes (x_i, age_i) to one neighbour drawn uniformly;
  onReceiveModel, as each model arrives (a node.serve handler, beside the wake-ups): merges it as
     above, then trains one local round on the merged model and sets age_i <- age_i + 1.
Such a node trains only on receipt (--train-on-receipt-only changes nothing); a push waits for a
training under way (the node's jobs run in order). Each step's row: heard_from (models trained on
since the step began) and their mean train_loss.

These modes are asynchronous: a node's steps are its own wake-ups, so the summary's final metrics
are each node's last row. `asynchronous` stays False on the class, so that --wake-up cycle runs
as before without --duration; the instance sets it True. Like the other asynchronous protocols,
they need --duration (and so refuse --checkpoint-every); --rounds, if given, also bounds each
node's wake-ups. Test accuracy is not scored every step (that would be charged compute): each
node's goes into its last row, uncharged, and --eval-every-seconds gives the curve. No consensus
snapshots: nodes at step k are at different times.

Departures in these modes: the received model is merged into the node's current model, as gossipy's
MERGE_UPDATE does; the paper's createModelMU merges it with lastModel, the model received before
it. gossipy's asynchronous nodes each draw a period of their own (normal, mean Δ, sd Δ/10) and wake
at its multiples; periodic here keeps the one --period and gives each node a phase.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from emulator.compute import Resident
from emulator.errors import UsageError
from emulator.protocol import register
from p2p_emulator.workloads.training import mix

from .common import STATE, LearningProtocol, SGDOptions, like

MERGES = ("average", "age")
WAKE_UPS = ("cycle", "periodic", "poisson")


@dataclass
class GossipLearningOptions(SGDOptions):
    period: float = field(default=1.0, metadata={
        "help": "gossip-learning: emulated seconds a node listens for pushed models each round (the gossip cycle)"})
    merge: str = field(default="average", metadata={
        "help": "gossip-learning: how a received model is merged: average (halfway) or age (weighted by ages)"})
    train_on_receipt_only: bool = field(default=False, metadata={
        "help": "gossip-learning: train only in rounds where a model arrived, as gossipy does"})
    wake_up: str = field(default="cycle", metadata={
        "help": "gossip-learning: cycle (common rounds of --period), periodic (every --period at a random phase "
                "per node) or poisson (exponential gaps of mean --period per node): with periodic and poisson a "
                "node pushes on each wake-up and trains on each model it receives"})

    def validate(self):
        super().validate()
        if self.merge not in MERGES:
            raise UsageError(f"--merge {self.merge!r}: choose one of {', '.join(MERGES)}")
        if not self.period > 0:
            raise UsageError(f"--period {self.period}: must be positive")
        if self.wake_up not in WAKE_UPS:
            raise UsageError(f"--wake-up {self.wake_up!r}: choose one of {', '.join(WAKE_UPS)}")


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

    def __init__(self, options, run_info, **workload):
        # Wake-ups of its own: each node's steps are its own, and the final metrics each node's last row.
        self.asynchronous = options.wake_up != "cycle"
        if self.asynchronous and not run_info.duration:
            raise UsageError(f"--wake-up {options.wake_up}: each node wakes at times of its own (asynchronous); "
                             "give the emulated time to run, --duration SECONDS")
        super().__init__(options, run_info, **workload)

    async def run(self, node):
        if self.options.wake_up != "cycle":
            return await self.run_wake_ups(node)
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

    async def run_wake_ups(self, node):
        """--wake-up periodic or poisson: push on each wake-up of the node's own clock; merge and train on each
        model as it arrives (onReceiveModel)."""
        o = self.options
        model, data = self.hold(node)
        state = node.carry(Carried(model, age=0))
        valid = like({STATE: await self.state(node, model), "age": 0})
        losses: list[float] = []  # of the trainings on the models received in the current step

        async def on_receive_model(message):  # one at a time, in arrival order
            w = merge_weight(o.merge, state.age, message.body["age"])
            state.age = max(state.age, message.body["age"]) + 1  # of the model once trained: what a push sends
            await node.compute(mix, model, 1.0 - w, [(w, message.body[STATE])], work=0)
            losses.append(await self.train(node, model, data))

        node.serve("model", on_receive_model, valid=valid)
        horizon, rng = self.run_info.duration or math.inf, node.rng
        if o.wake_up == "periodic":
            gap = lambda: o.period  # noqa: E731
            wake = node.now() + rng.random() * o.period  # its phase
        else:
            gap = lambda: rng.expovariate(1 / o.period)  # noqa: E731
            wake = node.now() + gap()
        await node.sleep(min(wake, horizon) - node.now())
        # A step: a wake-up, then the wait for the next; node.rounds() ends at the horizon.
        async for _ in node.rounds():
            body = {STATE: await self.state(node, model), "age": state.age}  # after a training under way
            if node.neighbours:
                node.send(rng.choice(node.neighbours), "model", body)
            wake += gap()
            if (until := min(wake, horizon) - node.now()) > 0:  # else its push came after its next wake-up
                await node.sleep(until)
            node.log(heard_from=len(losses), **({"train_loss": sum(losses) / len(losses)} if losses else {}))
            losses.clear()
        await self.log_final_scores(node, model, data)
