"""AD-PSGD (Lian, Zhang, Zhang and Liu, ICML 2018): asynchronous decentralized parallel SGD.

Every node i, at its own pace, step after step:
  1. reads its model: x̂ = x_i;
  2. computes a stochastic gradient g on x̂ from one minibatch (charged as --batch-size samples);
  3. averages atomically with ONE neighbour j drawn uniformly by its own generator:
     both end with (x_i + x_j) / 2;
  4. applies the gradient: x_i <- x_i - lr g. x_i may have moved since step 1 (the
     averages that neighbours started with i meanwhile, and i's own in step 3): g is
     stale. Each step logs that staleness, the number of such model updates (averages)
     between steps 1 and 4, and the minibatch loss.
The exchange of step 3: i sends x_i with a sequence number; j, in one job that nothing
of j's can interleave with (node.serve, work 0), sets x_j <- (x_j + x_i) / 2 and answers
with x_j as it was before; i sets x_i <- (x_i + x_j) / 2 from the answer. Only
floating-point tensors are averaged.

Who starts exchanges (--exchange auto picks the first that applies):
  bipartite: on a bipartite graph, the paper's deadlock-free split. The 2-colouring of
    the topology (networkx) makes colour 0 active and colour 1 passive: active nodes
    start exchanges, always with a passive neighbour, and answer none; passive nodes
    only answer, and skip step 3. No node ever waits on a node that waits.
  try-lock: on any other graph, every node both starts exchanges and answers them. A
    node waiting for the answer to its own request answers any request it gets
    meanwhile with "busy": its model cannot move while it waits, so each exchange stays
    atomic, and two nodes that ask each other at once both hear "busy" instead of
    waiting on each other. A node told "busy" backs off a random time, uniform in
    [0, 2^a r) after its a-th "busy" (r: the round trip that answer took, at least
    --timeout / 1000), and asks again (a new draw). Nodes of equal speed ask at the
    same instants, so without the back-off every request would meet a waiting node
    and no exchange would complete.
An initiator spends at most --timeout emulated seconds on one exchange (waiting for
answers, backing off): a lost message, an offline or crashed neighbour, or "busy" until
then, and it applies g without averaging; an answer that comes after its request was
given up carries an old sequence number and is ignored.
The horizon: no request leaves at or after --duration; a request sent before it is answered
(and its answer waited for) even past it; a node answers with an average until --duration,
also once --rounds has ended its own steps, and "busy" from then on. Then each node that asks
tells the nodes it asks "closed", and a node that answers keeps answering until every node
that asks it has said so (at most --timeout; links are FIFO, so every request has come by
then). So every exchange is completed on both sides or on neither: averaging alone keeps the
sum of the models to the end (tests/test_async_horizon.py). The summary names the
scheme ("exchange") and sums each node's counts, which RUN_DIR/exchanges.jsonl holds
("exchanges": requests sent, averaged, busy answers heard, timed_out, answered, and
refused: requests answered "busy").

Departures from the paper (Algorithm 1 and its per-worker form):
  - g is the minibatch's mean gradient, not the sum over the minibatch: --lr is per
    mean gradient, as in every protocol here; g includes --weight-decay (default 5e-4,
    0 for the paper's plain objective).
  - x̂ is a consistent copy (the gradient job starts on the model as it stands); the
    paper also allows a read that averages change half-way through.
  - Staleness here counts the updates of the node's own model between reading x̂ and
    applying g, not the paper's global iteration count.
  - The exchange may fail: --timeout and the sequence numbers are not in the paper,
    which assumes a reliable network. If j answered and the answer was lost (or came after
    i's --timeout), j has averaged and i has not, so that exchange does not preserve the sum
    of the models.
  - BatchNorm's running statistics are averaged with the parameters (every floating-point
    entry of the state); the reference averages module.parameters() only.
  - try-lock is this emulator's scheme for non-bipartite graphs; the paper (and the
    reference code) run only the bipartite split.
  - The initiator's neighbour is drawn uniformly from its current neighbours (the
    paper samples W^k, the averaging over one edge, at random); under a topology
    schedule, a node that is no longer the requester's neighbour does not answer.
Departures from the reference code (facebookresearch/stochastic_gradient_push,
gossip/ad_psgd.py and gossip/graph_manager.py):
  - There, a gossip process on each node averages continuously, beside training, so a
    node averages as often as its link allows, several times per gradient or none;
    here each asking node's step makes one exchange (asked again only after "busy")
    between steps 2 and 4, as in the paper's algorithm box.
  - There, peers come from a fixed, rotating schedule of the (dynamic exponential or
    linear) bipartite graph, odd ranks active; here a uniform draw over the neighbours,
    the colouring from the given topology.
  - There, the gradient is applied with heavy-ball momentum (0.9 by default, Nesterov
    optional) and weight decay at the current model; here --momentum defaults to 0 (the
    paper's plain step) and weight decay is part of g at x̂. With --momentum m > 0 each
    node keeps a buffer b <- m b + g and applies x_i <- x_i - lr b, as the reference does.
  - There, the training copy pulls the shared model after each backward pass and then
    takes its own optimizer step, so the next gradient is taken one local step ahead of
    the shared model; here g is taken at x_i as it stands.
  - There, the learning rate is scaled with the world size and warmed up and decayed by
    a schedule; here --lr is constant.
  - There, exchanges block without a timeout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from emulator.errors import UsageError
from emulator.protocol import register
from p2p_emulator.workloads.training import descend, mix

from .common import (STATE, LearningProtocol, TimeoutOptions, TrainingOptions, check, closing_handshake, expects,
                     like, option_help)

SCHEMES = ("auto", "bipartite", "try-lock")
ACTIVE, PASSIVE = 0, 1  # colours of the bipartite split


@dataclass
class ADPSGDOptions(TimeoutOptions, TrainingOptions):
    timeout: float = field(default=1.0, metadata=option_help(
        "ad-psgd: emulated seconds a node spends at most on one averaging exchange (waiting for answers, "
        "backing off after busy); then it applies its gradient without averaging"))
    momentum: float = field(default=0.0, metadata=option_help(
        "ad-psgd: heavy-ball momentum on the (stale) gradients, its buffer kept across steps (0: the paper's step)"))
    exchange: str = field(default="auto", metadata=option_help(
        "ad-psgd: who starts averaging: bipartite (colour 0 of the graph's 2-colouring asks, colour 1 answers), "
        "try-lock (every node asks and answers; a node waiting for its own answer replies busy, and the asker "
        "backs off at random and asks again), "
        "auto (bipartite on a bipartite graph, else try-lock)"))

    def validate(self):
        super().validate()
        check("exchange", repr(self.exchange), self.exchange in SCHEMES, "choose auto, bipartite or try-lock")
        check("momentum", self.momentum, 0 <= self.momentum < 1, "must be in [0, 1)")
        check("local-epochs", self.local_epochs, self.local_epochs == 1,
              "ad-psgd takes one minibatch gradient per step (use --batch-size)")


@dataclass
class Exchanges:
    """What a node's loop and its answering task share: whether it waits for an answer (try-lock), its
    request numbers, and counts of its model updates and of how its exchanges went."""
    waiting: bool = False
    closed: bool = False  # at --duration: it averages with no one any more
    seq: int = 0
    updates: int = 0  # averages applied to x_i so far (answered or own): staleness is a difference of these
    requested: int = 0
    averaged: int = 0
    busy: int = 0
    timed_out: int = 0
    answered: int = 0
    refused: int = 0  # requests answered "busy"


def average_returning_old(model, other: dict) -> dict:
    """x <- (x + other) / 2 over other's entries, in place; x's entries as they were before (a job)."""
    state = model.state_dict()
    old = {name: state[name].detach().clone() for name in other}
    mix(model, 0.5, [(0.5, other)])
    return old


def momentum_step(model, buffers: dict, grads: dict, lr: float, momentum: float) -> None:
    """b <- momentum b + g (b starts at g), x <- x - lr b, in place; buffers persist from step to step (a job)."""
    for name, g in grads.items():
        b = buffers.get(name)
        buffers[name] = g.clone() if b is None else b.mul_(momentum).add_(g)
    descend(model, buffers, lr)


@register("ad-psgd")
class ADPSGD(LearningProtocol):
    """AD-PSGD: asynchronous SGD steps, each averaging atomically with one random neighbour."""
    Options = ADPSGDOptions
    averages_models = True
    asynchronous = True

    def __init__(self, options, run_info, **workload):
        graph = run_info.graph
        if graph.is_directed():
            raise UsageError("--topology: ad-psgd averages in pairs, both ways: it needs an undirected graph "
                             "(and no directed --topology-schedule)")
        bipartite = nx.is_bipartite(graph)
        scheme = options.exchange
        if scheme == "auto":
            scheme = "bipartite" if bipartite else "try-lock"
        if scheme == "bipartite" and not bipartite:
            raise UsageError("--exchange bipartite: the topology is not bipartite (use try-lock or auto)")
        super().__init__(options, run_info, **workload)
        self.scheme = scheme
        self.colour = nx.bipartite.color(graph) if scheme == "bipartite" else {}

    def asks(self, node_id: int) -> bool:
        return self.scheme == "try-lock" or self.colour[node_id] == ACTIVE

    def answers(self, node_id: int) -> bool:
        return self.scheme == "try-lock" or self.colour[node_id] == PASSIVE

    async def run(self, node):
        o = self.options
        model, data = self.hold(node)
        example = await self.state(node, model)
        request_check = like({"seq": 0, STATE: example})
        reply_check = expects(optional=(STATE,), seq=int, **{STATE: example})
        ex = Exchanges()
        if self.answers(node.id):
            node.serve("request", self.answerer(node, model, ex), valid=request_check)
        buffers = node.keep({}) if o.momentum else None
        try:
            async for _ in node.rounds():
                seen = ex.updates  # 1: x̂ is the model the gradient job starts on
                grads, loss = await self.stochastic_gradient(node, model, data)  # 2
                if self.asks(node.id):
                    await self.exchange(node, model, ex, reply_check)  # 3
                if buffers is None:  # 4
                    await node.compute(descend, model, grads, o.lr, work=0)
                else:
                    await node.compute(momentum_step, model, buffers, grads, o.lr, o.momentum, work=0)
                node.log(staleness=ex.updates - seen, train_loss=loss)
            await self.close(node, ex)
        finally:  # a crashed node's counts too
            node.record("exchanges", requested=ex.requested, averaged=ex.averaged, busy=ex.busy,
                        timed_out=ex.timed_out, answered=ex.answered, refused=ex.refused)
        await self.log_final_scores(node, model, data)

    def partners(self, node) -> list[int]:
        """Whom the node may ask: its neighbours (bipartite: the passive ones, which all are on a static graph)."""
        if self.scheme == "try-lock":
            return node.neighbours
        return [j for j in node.neighbours if self.colour.get(j) == PASSIVE]

    async def close(self, node, ex: Exchanges) -> None:
        """The horizon rule, so that every exchange is completed on both sides or on neither: a node that has run
        its steps (--rounds) answers until --duration, and from then on answers "busy". Then it tells the nodes
        it asks that it is closed, and keeps answering until each node that asks it has said so (links are FIFO:
        every request it sent has come), at most --timeout."""
        await node.sleep(max(0.0, self.run_info.duration - node.now()))
        ex.closed = True
        askers = {j for j in node.neighbours if self.asks(j)} if self.answers(node.id) else set()
        asked = self.partners(node) if self.asks(node.id) else []
        await closing_handshake(node, asked, askers, self.options.timeout)

    async def exchange(self, node, model, ex: Exchanges, reply_check) -> None:
        """Step 3 on the initiator's side: ask one random neighbour and average with its answer. After "busy",
        back off a random time and ask again (a new draw) while the --timeout since the first request allows;
        at the timeout, give up. No request leaves at or after --duration."""
        deadline = node.now() + self.options.timeout
        attempt = 0
        while node.now() < self.run_info.duration and (partners := self.partners(node)):
            sent = node.now()
            outcome = await self.ask(node, model, ex, node.rng.choice(partners), deadline, reply_check)
            if outcome != "busy":
                return
            attempt += 1  # binary exponential back-off, in units of the round trip the busy answer took
            unit = max(node.now() - sent, self.options.timeout / 1000)  # (a floor: links may take no time)
            backoff = node.rng.uniform(0.0, 2.0 ** attempt * unit)
            if node.now() + backoff >= min(deadline, self.run_info.duration):  # no request could leave then
                return
            await node.sleep(backoff)

    async def ask(self, node, model, ex: Exchanges, peer: int, deadline: float, reply_check) -> str:
        """One request to `peer` and the wait for its answer: "averaged", "busy" or "timed_out"."""
        ex.waiting = True  # from here to the answer x_i cannot move: requests meet "busy"
        try:
            ex.seq += 1
            ex.requested += 1
            node.send(peer, "request", {"seq": ex.seq, STATE: await self.state(node, model)})
            while (msg := await node.recv(timeout=max(0.0, deadline - node.now()), kind="reply",
                                          valid=reply_check, past_horizon=True)) is not None:
                if msg.src != peer or msg.body["seq"] != ex.seq:
                    continue  # the late answer to a request already given up
                if STATE not in msg.body:
                    ex.busy += 1
                    return "busy"
                await node.compute(mix, model, 0.5, [(0.5, msg.body[STATE])], work=0)
                ex.updates += 1
                ex.averaged += 1
                return "averaged"
            ex.timed_out += 1
            return "timed_out"
        finally:
            ex.waiting = False

    def answerer(self, node, model, ex: Exchanges):
        """The answering side of step 3, run by node.serve one request at a time."""
        async def answer(message) -> None:
            requester, seq = message.src, message.body["seq"]
            if requester not in node.neighbours:
                return  # not a neighbour (any more) under a topology schedule: no link to answer on
            if ex.waiting or ex.closed:  # try-lock: mid-exchange of its own; or past --duration
                ex.refused += 1
                node.send(requester, "reply", {"seq": seq})
                return
            old = await node.compute(average_returning_old, model, message.body[STATE], work=0)
            ex.updates += 1
            ex.answered += 1
            node.send(requester, "reply", {"seq": seq, STATE: old})
        return answer

    def summary(self, records):
        totals = {key: 0 for key in ("requested", "averaged", "busy", "timed_out", "answered", "refused")}
        for row in records.get("exchanges", []):
            for key in totals:
                totals[key] += row[key]
        return {"exchange": self.scheme, "exchanges": totals}
