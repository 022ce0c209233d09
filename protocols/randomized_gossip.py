"""Randomized gossip (Boyd, Ghosh, Prabhakar and Shah, 2006): pairwise averaging on Poisson clocks.

Node i holds one number x_i: its id, or with --initial normal a standard normal draw from its
own stream of the seed. Its clock ticks at the times of a Poisson process of rate --wake-rate,
independent of every other node's (exponential gaps from its own generator). At each tick, the
paper's asynchronous time model:
  1. i picks one neighbour j uniformly at random (its own generator): P_ij = 1/deg_i;
  2. x_i, x_j <- (x_i + x_j) / 2.
One exchange is x <- W x with W = I - (e_i - e_j)(e_i - e_j)^T / 2, so sum x is conserved and, on
a connected graph, every x_i converges to the mean of the initial values, with
E[(1/n) ||x(k) - mean||^2] <= lambda_2(E[W])^k (1/n) ||x(0) - mean||^2 after k exchanges, where
E[W] = I - (1/2n) sum_i (1/deg_i) sum_{j~i} (e_i - e_j)(e_i - e_j)^T (the paper's W-bar).

Step 2 as messages: i sends ("ask", [seq, x_i]); j's handler (a plain function, run as the request
arrives) sets x_j <- (x_i + x_j) / 2 and answers ("avg", [seq, x_j]); i's handler sets x_i to it.
A node's step is one tick and the wait for its next; its row holds x_i at the step's end (the
last row: its final value).

Departures from the paper, whose exchanges are instantaneous:
- an exchange takes a round trip. To keep it atomic, a node waiting for its own answer answers any
  request meanwhile with ("busy", seq), and the requester gives up that exchange (a try-lock: no
  deadlock, no lost average); a tick that falls while i still waits is skipped;
- i waits at most --timeout for its answer and ignores one that comes later (a stale sequence
  number, or past the deadline). A lost request costs an exchange; a lost answer (--loss, --churn),
  or one after the timeout, leaves x_j averaged and x_i not: sum x is conserved only while no
  answer is lost;
- on a time-varying graph (--topology-schedule) each node's graph is that of its own step: j
  leaves a request from a node that is not its neighbour in its step unanswered (i times out);
  a directed graph is refused, as j must answer i;
- the horizon: a node answers requests until --duration (also after --rounds has ended its own
  ticks), then answers busy; a request of its own still unanswered then it waits for, checking
  END_CHECKS times per --timeout, so the run ends a round trip or so after --duration.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from emulator.errors import UsageError
from emulator.protocol import Protocol, register

from .common import check

INITIALS = ("id", "normal")
END_CHECKS = 64  # how often per --timeout a node past the horizon checks whether its last request was answered


@dataclass
class RandomizedGossipOptions:
    wake_rate: float = field(default=1.0, metadata={
        "help": "randomized-gossip: ticks per emulated second of each node's Poisson clock (its wake-ups)"})
    timeout: float = field(default=1.0, metadata={
        "help": "randomized-gossip: emulated seconds a node waits for its neighbour's answer before it skips "
                "the exchange"})
    initial: str = field(default="id", metadata={
        "help": "randomized-gossip: x_i at the start: id (the node's number) or normal (a standard normal draw "
                "from the node's own stream of the seed)"})

    def validate(self):
        check("wake-rate", self.wake_rate, self.wake_rate > 0 and math.isfinite(self.wake_rate),
              "must be a positive number")
        check("timeout", self.timeout, 0 < self.timeout < math.inf, "must be a positive number")
        check("initial", repr(self.initial), self.initial in INITIALS, f"choose one of {', '.join(INITIALS)}")


@dataclass(slots=True)
class Carried:
    """What a node carries from tick to tick: x_i; the request it waits for an answer to, if any (while it waits,
    it answers others busy); its counts."""
    x: float
    seq: int = 0  # of its last request
    pending: int = 0  # the seq of the request it waits for an answer to (0: none)
    peer: int = -1
    deadline: float = 0.0
    done: bool = False  # past the horizon: it answers every request busy
    exchanges: int = 0  # its own requests answered with an average
    refused: int = 0  # its own requests answered busy
    timeouts: int = 0  # its own requests with no answer in time (lost, or too late)
    skipped: int = 0  # ticks that fell while it still waited for an answer
    served: int = 0  # others' requests it averaged with
    busy: int = 0  # others' requests it answered busy


def _pair(body) -> bool:
    """[seq, x]: an int and a finite float (a request, or an answer with the average)."""
    return (type(body) is list and len(body) == 2 and type(body[0]) is int and type(body[1]) is float
            and math.isfinite(body[1]))


def _seq(body) -> bool:
    """seq: an answer of busy."""
    return type(body) is int


@register("randomized-gossip")
class RandomizedGossip(Protocol):
    """Randomized gossip: on each tick of its Poisson clock a node averages with one random neighbour."""
    Options = RandomizedGossipOptions
    asynchronous = True

    def __init__(self, options, run_info):
        super().__init__(options, run_info)
        if run_info.graph.is_directed():
            raise UsageError("--topology: randomized-gossip needs an undirected graph (a neighbour answers the "
                             "node that asked)")

    def initial(self, node_id: int) -> float:
        """x_i at the start."""
        if self.options.initial == "id":
            return float(node_id)
        return float(self.run_info.seeds.numpy("randomized-gossip.initial", node_id).standard_normal())

    async def run(self, node):
        o = self.options
        state = node.carry(Carried(self.initial(node.id)))
        send, now = node.send, node.now

        def waiting() -> bool:
            """Whether it still waits for the answer to its request; past the deadline it gives up on it."""
            if state.pending and now() >= state.deadline:
                state.pending = 0
                state.timeouts += 1
            return state.pending != 0

        def ask(message):  # j's side, as a request arrives: average at once, or refuse while waiting or done
            seq, x = message.body
            if message.src not in node.neighbours:  # a time-varying graph took the edge back: i times out
                return
            if state.done or waiting():
                state.busy += 1
                send(message.src, "busy", seq)
            else:
                state.served += 1
                state.x = x = (state.x + x) / 2
                send(message.src, "avg", [seq, x])

        def answered(message) -> bool:
            """Whether the message answers the request it waits for (anything else came too late)."""
            seq = message.body if type(message.body) is int else message.body[0]
            if seq == state.pending and message.src == state.peer and waiting():
                state.pending = 0
                return True
            return False

        def averaged(message):  # i's side: the average comes back
            if answered(message):
                state.x = message.body[1]
                state.exchanges += 1

        def refused(message):
            if answered(message):
                state.refused += 1

        node.serve("ask", ask, valid=_pair)
        node.serve("avg", averaged, valid=_pair)
        node.serve("busy", refused, valid=_seq)
        horizon, rate, rng = self.run_info.duration or math.inf, o.wake_rate, node.rng
        last = self.run_info.rounds - 1
        wake = now() + rng.expovariate(rate)
        await node.sleep(min(wake, horizon) - now())
        # A step: a tick, then the wait for the next; node.rounds() ends at the horizon.
        async for step in node.rounds():
            if waiting():
                state.skipped += 1
            elif neighbours := node.neighbours:
                state.seq = state.pending = seq = state.seq + 1
                state.peer = j = rng.choice(neighbours)
                state.deadline = now() + o.timeout
                send(j, "ask", [seq, state.x])
            wake += rng.expovariate(rate)  # the ticks of a Poisson process: independent of the exchanges
            if wake < horizon and step < last:
                await node.sleep(wake - now())
            else:  # its last step ends with its final value, so that no closed row changes
                await self.finish(node, state, waiting, wake)
            node.log(estimate=state.x)
        if not state.done:  # no tick before the horizon: its final value in a row of its own
            await self.finish(node, state, waiting, horizon)
            node.log(estimate=state.x)

    async def finish(self, node, state: Carried, waiting, wake: float) -> None:
        """Its last step's end: a partner for the others until the horizon (also when --rounds has ended its ticks
        first; without a horizon, until its next tick), then busy to all; it waits for the answer to its last
        request, which its partner may have averaged with already; its counts for the summary."""
        horizon = self.run_info.duration or wake
        await node.sleep(horizon - node.now())
        state.done = True
        while waiting():
            await node.sleep(min(self.options.timeout / END_CHECKS, state.deadline - node.now()))
        node.record("randomized_gossip", x0=self.initial(node.id), x=state.x, exchanges=state.exchanges,
                    refused=state.refused, timeouts=state.timeouts, skipped=state.skipped, served=state.served,
                    busy=state.busy)

    def summary(self, records):
        """Exchanges completed (requests answered with an average), requests refused busy, requests timed out;
        the largest |x_i - mean of the initial values| at the end."""
        rows = records.get("randomized_gossip", [])
        if not rows:
            return {}
        n = self.run_info.num_nodes
        if len(rows) == n:  # no node crashed
            mean = math.fsum(row["x0"] for row in rows) / n
        else:
            mean = (n - 1) / 2 if self.options.initial == "id" else math.fsum(map(self.initial, range(n))) / n
        total = {key: sum(row[key] for row in rows) for key in ("exchanges", "refused", "timeouts", "skipped")}
        return {"exchanges": total["exchanges"], "busy_refusals": total["refused"], "timeouts": total["timeouts"],
                "ticks_skipped": total["skipped"], "max_error": max(abs(row["x"] - mean) for row in rows)}

    def render(self, console, summary) -> None:
        if "exchanges" in summary:
            console.print(f"randomized gossip: {summary['exchanges']:,} exchanges, {summary['busy_refusals']:,} "
                          f"refused busy, {summary['timeouts']:,} timed out; largest error at the end "
                          f"{summary['max_error']:.3g}")
