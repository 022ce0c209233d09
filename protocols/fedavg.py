"""FedAvg (McMahan et al., 2017): a server node and clients that hold the data.

The server is the node of highest degree (ties: the lowest id); it must be adjacent to
every other node (--topology star, or mesh). Each round r:
  1. the server samples --clients-per-round clients (0: all) and sends them the global model x;
  2. each sampled client k loads x, runs local SGD on its n_k samples, sends back (x_k, n_k);
  3. the server sets x <- sum_k n_k x_k / sum_k n_k over the updates heard before --timeout
     (none heard: x stays). Only floating-point tensors are averaged.
Unsampled clients get an empty message, so every client follows the server's rounds.
The server holds no data: the partition has one part per client. Under --test-set global the
server scores x; under --test-set local each sampled client scores the x it received on its own
test split, before training on it.
With --secure-aggregation secagg or secagg+, steps 2 and 3 are protocols/secagg.py's: the server
learns only the sum of the sampled clients' weighted updates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from emulator.errors import UsageError
from emulator.protocol import adaptive, register
from p2p_emulator.workloads.training import load_state, mix
from p2p_emulator.workloads.work import model_work

from .common import (STATE, CarriedModel, LearningProtocol, SGDOptions, TimeoutOptions, default, expects, keep_data,
                     positive_int, entry_count, test_scores)
from .secagg import Plan, SecureAggregationOptions, SecureClient, SecureServer, secure


@dataclass
class FedAvgOptions(TimeoutOptions, SGDOptions):
    momentum: float = default(SGDOptions, "momentum", 0.0)
    weight_decay: float = default(SGDOptions, "weight_decay", 0.0)
    timeout: float | str = field(default="auto", metadata={
        "help": "emulated seconds the server waits for updates (a client waits up to twice this for the model), or "
                "auto: TCP's retransmission timer over the node's messages' times in transit (docs/network-model.md)"})
    clients_per_round: int = field(default=0, metadata={
        "help": "fedavg: clients the server samples each round, uniformly without replacement (0: all)"})

    def validate(self):
        super().validate()
        if self.clients_per_round < 0:
            raise UsageError(f"--clients-per-round {self.clients_per_round}: must not be negative (0: all clients)")
        if self.init != "common":
            raise UsageError(f"--init {self.init}: fedavg has one global model; use --init common")


@dataclass
class SecureFedAvgOptions(SecureAggregationOptions, FedAvgOptions):
    """FedAvg's options with secure aggregation's (FedMN extends FedAvgOptions, without them)."""


def star(graph, protocol: str) -> tuple[int, list[int]]:
    """(server, clients): the node of highest degree (ties: the lowest id), which must be adjacent to every other."""
    server = max(graph.nodes, key=lambda i: (graph.degree(i), -i))
    clients = sorted(i for i in graph.nodes if i != server)
    if not clients or not all(graph.has_edge(server, c) and graph.has_edge(c, server) for c in clients):
        raise UsageError(f"{protocol} needs a server adjacent to every node, e.g. --topology star")
    return server, clients


async def from_server(node, kind: str, valid, timeout: float):
    """The next message of `kind` for this round or a later one; None after `timeout` without one.
    Messages of earlier rounds are dropped, each restarting the wait."""
    while (message := await node.recv(timeout=timeout, kind=kind, valid=valid)) is not None:
        if message.round >= node.round:
            return message
    return None


def average(model, updates: list[tuple[int, dict]]) -> None:
    """x <- sum_k n_k x_k / sum_k n_k over the (n_k, state_k) pairs, in place; no samples: x stays."""
    total = sum(n for n, _ in updates)
    if total:
        mix(model, 0.0, [(n / total, state) for n, state in updates])


class ServerAndClients(LearningProtocol):
    """A server node (the centre of a star) and clients that hold the data, a part each; the server's
    global model is one architecture, from the common x0. Not a protocol: FedAvg and FedBuff are."""
    averages_models = True

    def __init__(self, options, run_info):
        self.server, self.clients = star(run_info.graph, self.name)
        self.check_clients(options)
        super().__init__(options, run_info, parts=len(self.clients))
        self.part = {client: part for part, client in enumerate(self.clients)}

    def check_clients(self, options) -> None:
        """Refuse, before the workload is built, options the clients cannot meet."""

    async def run(self, node):
        await (self._serve(node) if node.id == self.server else self._client(node))

    async def run_no_rounds(self, node):
        """--rounds 0: the scores a round would log, of the initial global model."""
        if node.id == self.server:
            if self.workload.test_set == "global":
                model = self.workload.model(0)
                node.log(**await self.scores(node, node.keep(model), self._global_test(node, model)))
        elif self.workload.test_set == "local":
            model = self.workload.model(0)
            data = keep_data(node, self.workload.data(self.part[node.id]), model)
            node.log(**await self.scores(node, node.keep(model), data))

    def _global_test(self, node, model):
        """The whole test split, kept where the server's jobs run, with the counted work of scoring `model`."""
        x, y = self.workload.global_test()
        return SimpleNamespace(test_x=node.keep(x), test_y=node.keep(y), work=model_work(model, x, y))


@register("fedavg")
class FedAvg(ServerAndClients):
    """FedAvg: a server averages the models its sampled clients trained, weighted by their samples."""
    Options = SecureFedAvgOptions
    checkpointable = True

    def __init__(self, options, run_info):
        super().__init__(options, run_info)
        self.secure = secure(options)
        if self.secure:
            waits = adaptive(options)  # --timeout as the phases wait it, with no compute allowance
            self.secure_server = SecureServer(waits)
            self.secure_client = SecureClient(waits, self.server, self.clients)

    def check_clients(self, options):
        if options.clients_per_round > len(self.clients):
            raise UsageError(f"--clients-per-round {options.clients_per_round}: there are only "
                             f"{len(self.clients)} clients (node {self.server} is the server)")
        if secure(options):
            n = options.clients_per_round or len(self.clients)
            Plan.of(options, n).check(f"--clients-per-round {n}" if options.clients_per_round else f"{n} clients")

    async def _serve(self, node):
        initial = self.workload.model(0)  # the common start x0
        model = node.keep(initial)
        test = self._global_test(node, initial) if self.workload.test_set == "global" else None
        if test is not None:
            node.score_with(test_scores, model, test.test_x, test.test_y)
        node.carry(CarriedModel(model))
        async for _ in node.rounds():
            reachable = node.neighbours  # all clients, unless a --topology-schedule cuts some off this round
            sampled = self._sample(node, reachable)
            state = await self.state(node, model)
            node.broadcast("model", {STATE: state}, to=sampled)
            # The others get an empty model, so every client hears from the server every round: an
            # unsampled one ends its round now instead of waiting out the silence, which then means
            # only that the server is down.
            node.broadcast("model", None, to=[c for c in reachable if c not in sampled])
            if self.secure:
                heard = await self.secure_server.round(node, model, state, sampled)
            else:
                heard = await self._average_updates(node, model, state, sampled)
            scores = await self.evaluate(node, model, test) if test is not None else {}
            node.log(**heard, params_sent=entry_count(state) * len(sampled), **scores)

    async def _average_updates(self, node, model, state, sampled) -> dict:
        """Plain FedAvg's steps 2 and 3 on the server: the sampled clients' models, averaged."""
        updates = await node.gather("update", peers=sampled, timeout=self.options.timeout,
                                    valid=expects(**{STATE: state, "samples": positive_int}))
        await node.compute(average, model, [(m.body["samples"], m.body[STATE]) for m in updates.values()], work=0)
        return {"heard_from": len(updates)}

    def _sample(self, node, reachable: list[int]) -> list[int]:
        k = self.options.clients_per_round
        if k == 0 or k >= len(reachable):
            return list(reachable)
        return sorted(node.rng.sample(reachable, k))

    async def _client(self, node):
        model, data = self.hold(node, self.part[node.id])
        # the server's model has the clients' architecture
        model_body = expects(**{STATE: await self.state(node, model)})
        node.carry(CarriedModel(model))
        message = None  # the server's model for this round, taken anew each round (none is ahead at a barrier)
        async for _ in node.rounds():
            if message is None or message.round < node.round:
                message = await self._next_model(node, model_body)
            if message is None or message.round > node.round or message.body is None:
                continue  # the server fell silent; or it is rounds ahead (skip to its round); or not sampled
            await node.compute(load_state, model, message.body[STATE], work=0)
            scores = await self.evaluate(node, model, data) if self.workload.test_set == "local" else {}
            if self.secure:
                node.log(**await self.secure_client.round(node, self, model, data, message.body[STATE],
                                                          self._phase_message), **scores)
                continue
            loss = await self.train(node, model, data)
            sent = {}
            if self.server in node.neighbours:
                sent = await self.state(node, model)
                node.send(self.server, "update", {STATE: sent, "samples": len(data.train_y)})
            node.log(train_loss=loss, params_sent=entry_count(sent), **scores)

    async def _next_model(self, node, model_body):
        """The server's message for this round or a later one; None once the server has been silent too long.

        Between two messages to a client the server may wait out --timeout for a silent client and
        then evaluate, so a client waits twice that: a client that gives up on a live server runs a
        round ahead and misses its models. A message of an earlier round is dropped but restarts the
        wait: the server is alive and catching up after it was offline.
        """
        valid = lambda body: body is None or model_body(body)  # noqa: E731 - None: not sampled this round
        return await from_server(node, "model", valid, 2 * self.options.timeout)

    async def _phase_message(self, node, kind: str, valid):
        """The server's next secure-aggregation message of this round; None if it gave up on the round (an
        empty body), moved on, or fell silent."""
        message = await from_server(node, kind, lambda body: body is None or valid(body), 2 * self.options.timeout)
        return message if message is not None and message.round == node.round and message.body is not None else None

    def summary(self, records):
        if not self.secure:
            return {"server": self.server}
        outcomes = [row["outcome"] for row in records.get("secagg", [])]
        return {"server": self.server, "secagg_rounds_failed": outcomes.count("failed")}
