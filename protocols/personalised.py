"""Personalised federated learning on a star: the clients keep their own models, of any architecture,
and share one part through a server. Not a protocol: FedSim, FedClassAvg and FedProto are.

The server is the node of highest degree (ties: the lowest id), adjacent to every other node
(--topology star, or mesh); it holds no data and no model, and the partition has one part per
client. Each round r:
  1. each client k trains its own model, using the shared part it last received (none in round 0),
     and sends its own version of that part (`local_round`);
  2. the server combines the parts heard before --timeout (`combine`; none heard: the shared part
     stays) and sends the result to every client;
  3. each client takes it (`take`: e.g. loads a classifier head) and scores its own model on its own
     test split.
A client the server does not answer within twice --timeout scores its model as it is, and trains on
in the next round with the part it last received. That is 2M messages a round, as the MAPL paper's
Table 7 counts the three baselines.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from emulator.compute import Resident

from .common import TimeoutOptions, TrainingOptions, default
from .fedavg import ServerAndClients, from_server

SHARE, COMBINED = "share", "combined"  # a client's part to the server; the server's combined part back


@dataclass
class PersonalisedOptions(TimeoutOptions, TrainingOptions):
    """The defaults the star's protocols share: MAPL's scenario 1, a backbone of its own per client."""
    partition: str = default(TrainingOptions, "partition", "mapl:scenario=1")
    model: str = default(TrainingOptions, "model", "hetero-small")
    d_z: int = default(TrainingOptions, "d_z", 128)
    init: str = default(TrainingOptions, "init", "independent")  # heterogeneous backbones cannot share one x0


@dataclass
class CarriedShared:
    """A client's model and the combined part it last received (None before the first)."""
    model: Resident
    shared: Any = None


@dataclass
class CarriedCombined:
    """The server's combined part (None until a client was heard)."""
    shared: Any = None


class PersonalisedStar(ServerAndClients):
    """Clients with models of their own that share one part through a server (see the module)."""
    averages_models = False

    def __init__(self, options, run_info):
        super().__init__(options, run_info)
        self.checks = self.make_checks()  # before the run: the nodes share this object and never write to it

    # -- what a protocol defines

    async def local_round(self, node, model, data, shared) -> tuple[float, dict]:
        """Train the client's model with the combined part (None before the first); (mean loss, the body sent)."""
        raise NotImplementedError

    @staticmethod
    def combine(bodies: list[dict]) -> dict:
        """The combined part from the clients' bodies (a job on the server)."""
        raise NotImplementedError

    @staticmethod
    def take(model, shared: dict) -> None:
        """What a client does with the combined part when it arrives (a job); by default it only keeps it."""

    async def client_scores(self, node, model, data, shared) -> dict:
        """A client's scores after the round, with the combined part it holds: by default its model's on its
        own test split, in the rounds --eval-every picks."""
        return await self.evaluate(node, model, data)

    def make_checks(self):
        """(check of a client's body, check of the server's combined body): see common.expects."""
        raise NotImplementedError

    # -- the round

    async def _serve(self, node):
        state = node.carry(CarriedCombined())
        valid, _ = self.checks
        async for _ in node.rounds():
            clients = node.neighbours
            heard = await node.gather(SHARE, peers=clients, timeout=self.options.timeout, valid=valid)
            if heard:
                state.shared = await node.compute(self.combine, [m.body for m in heard.values()], work=0)
            node.broadcast(COMBINED, state.shared, to=clients)
            node.log(heard_from=len(heard))

    async def _client(self, node):
        model, data = self.hold(node, self.part[node.id])
        state = node.carry(CarriedShared(model))
        _, combined = self.checks
        reply = None  # the server's answer; one for a later round is kept for that round
        async for _ in node.rounds():
            loss, body = await self.local_round(node, model, data, state.shared)
            if self.server in node.neighbours:
                node.send(self.server, SHARE, body)
            del body
            if reply is None or reply.round < node.round:
                reply = await from_server(node, COMBINED, lambda b: b is None or combined(b), 2 * self.options.timeout)
            if reply is not None and reply.round == node.round and reply.body is not None:
                state.shared = reply.body
                await node.compute(self.take, model, state.shared, work=0)
            node.log(train_loss=loss, **await self.client_scores(node, model, data, state.shared))

    async def run_no_rounds(self, node):
        """--rounds 0: each client scores its own initial model (not the server's x0: it has none)."""
        if node.id != self.server:
            model, data = self.hold(node, self.part[node.id])
            node.log(**await self.scores(node, model, data))

    def summary(self, records):
        return {"server": self.server}


def weighted_mean(updates: list[tuple[float, dict]]) -> dict:
    """sum_k a_k x_k / sum_k a_k over (a_k, {name: tensor}) pairs with the same names."""
    total = sum(a for a, _ in updates)
    return {name: sum(a / total * state[name] for a, state in updates) for name in updates[0][1]}
