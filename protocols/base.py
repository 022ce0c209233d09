"""What the learning protocols share: the workload, evaluation, and the consensus observer."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from emulator.errors import UsageError
from emulator.protocol import Protocol
from workloads.task import Workload, WorkloadError, WorkloadOptions
from workloads.training import accuracy, flat, sgd

EVAL_COST = 1 / 3  # a forward pass costs about a third of a training step per sample


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class TrainingOptions(WorkloadOptions):
    """Local SGD, as LearningProtocol.train runs it; checked once here."""
    local_epochs: int = field(default=1, metadata=_help("local epochs per round"))
    local_steps: int = field(default=0, metadata=_help("local SGD steps per round (0: use --local-epochs)"))
    lr: float = field(default=0.05, metadata=_help("learning rate"))
    momentum: float = field(default=0.9, metadata=_help("heavy-ball momentum"))
    weight_decay: float = field(default=5e-4, metadata=_help("weight decay"))
    batch_size: int = field(default=32, metadata=_help("local batch size"))

    def validate(self):
        checks = [("lr", self.lr > 0, "must be positive"),
                  ("batch-size", self.batch_size >= 1, "must be at least 1"),
                  ("local-epochs", self.local_epochs >= 1, "must be at least 1"),
                  ("local-steps", self.local_steps >= 0, "must not be negative"),
                  ("momentum", self.momentum >= 0, "must not be negative"),
                  ("weight-decay", self.weight_decay >= 0, "must not be negative")]
        for flag, ok, problem in checks:
            if not ok:
                raise UsageError(f"--{flag} {getattr(self, flag.replace('-', '_'))}: {problem}")


def default(options: type, name: str, value):
    """A field of `options` with another default, keeping its help text."""
    return field(default=value, metadata={f.name: f for f in fields(options)}[name].metadata)


class LearningProtocol(Protocol):
    """A protocol over a Workload: every node gets its data split and its own model."""
    averages_models = False  # then every node needs the same architecture

    def __init__(self, options, env, **workload):
        super().__init__(options, env)
        try:
            self.workload = Workload(options, env, averaged_by=self.name if self.averages_models else None,
                                     **workload)
        except WorkloadError as exc:
            raise UsageError(str(exc)) from None

    async def run_no_rounds(self, node):
        """--rounds 0: build the node's data and model, evaluate once."""
        model, data = self.workload.model(node.id), self.workload.data(node.id)
        node.log(test_acc=await self.accuracy(node, model, data))

    async def train(self, node, model, data) -> float:
        """Local SGD as the options say (local_epochs or local_steps, lr, momentum, ...); returns the mean loss."""
        o = self.options
        samples = o.local_steps * o.batch_size if o.local_steps else o.local_epochs * len(data.train_y)
        loss, _ = await node.compute(
            sgd, model, data.train_x, data.train_y, epochs=o.local_epochs, steps=o.local_steps, lr=o.lr,
            momentum=o.momentum, weight_decay=o.weight_decay, batch_size=o.batch_size,
            generator=node.torch_generator, work=samples)
        return loss

    async def evaluate(self, node, model, data) -> dict[str, float]:
        """{"test_acc": ...} in the rounds --eval-every picks (and the last), else {}; charged as compute."""
        last = node.round == self.env.rounds - 1
        if (node.round + 1) % self.options.eval_every and not last:
            return {}
        return {"test_acc": await self.accuracy(node, model, data)}

    async def accuracy(self, node, model, data) -> float:
        return await node.compute(accuracy, model, data.test_x, data.test_y, work=len(data.test_y) * EVAL_COST)

    def observe(self, rnd, snapshots):
        """consensus_distance: ||x_i - mean_j x_j|| from flattened float states (no messages)."""
        vectors = {i: flat(state) for i, state in snapshots.items() if state is not None}
        if len(vectors) < 2:
            return {}
        mean = torch.stack(list(vectors.values())).mean(0)
        return {i: {"consensus_distance": float(torch.linalg.vector_norm(v - mean))} for i, v in vectors.items()}
