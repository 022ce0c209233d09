"""The network: it carries encoded messages over links and enforces the topology.

A message is encoded once at send, and a broadcast's receivers share that one
immutable frame; its exact size goes on the ledger for every link it crosses.
The receiver decodes it when it takes it from its mailbox (recv, gather), so
frames waiting in mailboxes cost one copy per send, not one per receiver; bytes
that fail to decode are dropped as corrupt then. Drops at send: over_limit,
offline (sender), link_down (failed edge or partition); when a message queued
behind others gets its turn: offline (sender), link_down; on the way: loss; at
arrival: offline (receiver), corrupt (the corruption model flipped bits and the
frame fails its checksum, as a real transport's would); when taken: corrupt (it
does not decode, e.g. with checksums off), invalid (it decodes, but its protocol's
check of the body fails). A message already in flight
when its edge disappears from a time-varying graph, or fails, or when its sender
goes offline, is still delivered: its bits had left the sender.

Links share capacity as emulator.links states (FIFO), or, with sharing="fair",
max-min fairly as concurrent flows (emulator.sharing): a message's loss and
latency are drawn when it is put on its link either way, in the same order, and
it arrives a latency after its flow ends. With an overhead (overhead="tcp") a
link times a message's bytes on the wire, payload and headers, and the ledger
totals them as wire_bytes; its payload counts stay as they are.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import networkx as nx

from . import wire
from .ledger import Ledger, TraceRow
from .seeds import Seeds, numpy_state, set_numpy_state
from .links import ACKS, LOSS_MODELS, OVERHEADS, Capacity, Link, LinkSpec
from .sharing import FairSharing, Flow


class NotNeighbourError(RuntimeError):
    """A protocol tried to send along an edge the current topology does not have."""


class MessageTooLargeWarning(RuntimeWarning):
    pass


@dataclass(slots=True)
class Message:
    """A message on its link, then in its receiver's mailbox. `body` is set when the receiver takes it;
    until then `frame` holds its bytes."""
    src: int
    dst: int
    kind: str
    round: int
    size: int
    t_send: float
    t_arrive: float
    frame: Any = None
    body: Any = None
    trace: TraceRow | None = None


class Mailbox:
    """Arrived messages of one node, in arrival order, and the coroutine waiting on them.

    `wakes(message)`, when set, says whether an arrival is worth waking the waiter for:
    a node gathering from k neighbours wakes once, not k times.
    """
    __slots__ = ("messages", "waiter", "wakes", "served")

    def __init__(self):
        # A list, not a deque: an empty deque costs 760 bytes, a million nodes' 0.7 GB. Taking the
        # first of n waiting messages moves n pointers, as finding one of a kind already scans them.
        self.messages: list[Message] = []
        self.waiter = None
        self.wakes: Callable[[Message], bool] | None = None
        self.served: dict[str, Callable[[Message], None]] | None = None  # kind -> its node.serve handler

    def put(self, message: Message) -> None:
        served = self.served
        if served is not None and message.kind in served:
            return served[message.kind](message)
        self.messages.append(message)
        waiter = self.waiter
        if waiter is not None and not waiter.done() and (self.wakes is None or self.wakes(message)):
            waiter.set_result(True)


class RoundGraph:
    """One round's topology: whom each node sends to (out) and hears from (in)."""
    __slots__ = ("graph", "_out", "out_sorted", "in_sorted")

    def __init__(self, graph: nx.Graph):
        self.graph = graph
        directed = graph.is_directed()
        self.out_sorted = {node: sorted(graph.successors(node) if directed else graph.neighbors(node))
                           for node in graph.nodes}
        self.in_sorted = ({node: sorted(graph.predecessors(node)) for node in graph.nodes} if directed
                          else self.out_sorted)
        self._out = None

    @property
    def out(self) -> dict[int, set[int]]:
        """Each node's out-neighbours as a set: made on first use, as a static topology never asks."""
        if self._out is None:
            self._out = {node: set(peers) for node, peers in self.out_sorted.items()}
        return self._out


class Network:
    """Links between nodes, the topology they may use, and who is online.

    With a time-varying topology (a schedule), a node's graph is that of its own
    round: a message tagged round r may use an edge of round r's graph.
    `uplink` and `downlink` are one capacity for all nodes or one per node.
    `edge_specs` gives directed links (src, dst) their own LinkSpec (a topology file's
    edge attributes); the others get `spec`.
    `faults` (if any) says when an edge is down (link failures, partitions).
    `sharing` is fifo (links.py's queues) or fair (emulator.sharing's flows); `overhead`, a key of
    links.OVERHEADS, what a message puts on the wire besides its payload (the ledger totals it as wire_bytes).
    """

    def __init__(self, graph: nx.Graph, clock, ledger: Ledger, spec: LinkSpec, seeds: Seeds, *,
                 edge_specs: dict[tuple[int, int], LinkSpec] | None = None,
                 uplink: float | Sequence[float] = math.inf, downlink: float | Sequence[float] = math.inf,
                 compress: str = "none", max_message_bytes: int = 2**62, schedule=None, faults=None,
                 nodes_change: bool = False, checksum: bool = True, adversaries=None, sharing: str = "fifo",
                 overhead: str = "none", loss_model: str = "datagram"):
        if sharing not in ("fifo", "fair"):
            raise ValueError(f"link sharing {sharing!r}: fifo or fair")
        if loss_model not in LOSS_MODELS:
            raise ValueError(f"loss model {loss_model!r}: {' or '.join(LOSS_MODELS)}")
        self.reliable = loss_model == "reliable"  # lossy links lose segments, sent again (emulator.recovery)
        self.wire_size = OVERHEADS[overhead]  # a payload's bytes on the wire; None: the payload alone
        self.ack_size = ACKS[overhead]  # the bytes of its ACKs on the way back; None: none
        if self.wire_size is not None:
            ledger.count_wire_bytes()
        # Fair sharing's flows; None: each link's FIFO queue times its messages at send.
        self.flows = FairSharing(clock, self._turn, self._flow_ended) if sharing == "fair" else None
        self.clock, self.ledger, self.spec, self.seeds = clock, ledger, spec, seeds
        self.edge_specs = edge_specs or {}
        self.compress, self.max_message_bytes, self.checksum = compress, max_message_bytes, checksum
        self.adversaries = adversaries  # Adversaries: chosen senders' bodies are replaced by an attack
        self.num_nodes = ledger.num_nodes = n = graph.number_of_nodes()
        self.uplinks = [Capacity(rate) for rate in _per_node(uplink, n)]
        self.downlinks = [Capacity(rate) for rate in _per_node(downlink, n)]
        self.mailboxes = [Mailbox() for _ in range(n)]
        self.online = [True] * n
        self.faults = faults
        # Whether a message queued at its sender must be checked again when its turn comes.
        self.senders_change = nodes_change or faults is not None
        self.links: dict[tuple[int, int], Link] = {}
        self._wire_rngs: dict[int, object] = {}
        self.in_flight = 0  # frames on their links: sent, not yet arrived nor dropped
        self.send_seconds = [0.0] * n  # emulated seconds each node's frames held its links (serialisation)
        self.drained: Callable[[], None] | None = None  # called when the last frame in flight lands
        # Bound once: a bound method made per message would cost an object for every frame in flight.
        self._arrive_event, self._start_event = self._arrive, self._start
        self.graph = graph
        # A time-varying topology: schedule.graph(r) is round r's graph; rounds with one schedule.key(r) share
        # it, and links keep their queues across changes. Without one, the links are exactly graph's edges.
        self.schedule = schedule
        self._rounds: dict[Any, RoundGraph] = {}
        self._static = self._adopt(graph)

    def at(self, rnd: int) -> RoundGraph:
        """The topology of round `rnd` (of a schedule in time: the topology of now)."""
        if self.schedule is None:
            return self._static
        if self.schedule.in_time:
            rnd = self.schedule.index(self.clock.now)
        key = self.schedule.key(rnd)
        current = self._rounds.get(key)
        if current is None:
            current = self._rounds[key] = self._adopt(self.schedule.graph(rnd))
        return current

    def _adopt(self, graph: nx.Graph) -> RoundGraph:
        directed = graph.is_directed()
        for src, dst in graph.edges:
            self._link(src, dst)
            if not directed:
                self._link(dst, src)
        return RoundGraph(graph)

    def _link(self, src: int, dst: int) -> Link:
        key = (src, dst)
        link = self.links.get(key)
        if link is None:
            spec = self.edge_specs.get(key, self.spec)
            # every link gets a ledger row, even if it stays idle
            link = self.links[key] = Link(src, dst, spec, self.seeds, self.uplinks[src], self.downlinks[dst],
                                          self.ledger.row(key), self.reliable)
            if link.window is not None:
                self.ledger.count_resent_bytes()
        return link

    def state(self) -> dict:
        """Its links, capacities, quantiser generators and mailboxes, with its ledger's state (the frames in
        mailboxes point into its trace), as plain data; taken when no frame is in flight."""
        trace = self.ledger.trace
        trace_index = {id(row): i for i, row in enumerate(trace)} if trace is not None else {}
        return {"links": [[src, dst, *link.state()] for (src, dst), link in sorted(self.links.items())],
                "uplinks": [capacity.free_at for capacity in self.uplinks],
                "downlinks": [capacity.free_at for capacity in self.downlinks],
                "wire_rngs": {src: numpy_state(rng) for src, rng in self._wire_rngs.items()},
                "send_seconds": list(self.send_seconds),
                **self.ledger.state(),
                "mailboxes": [[[m.src, m.kind, m.round, m.size, m.t_send, m.t_arrive, bytes(m.frame),
                                trace_index.get(id(m.trace))] for m in box.messages] for box in self.mailboxes]}

    def load_state(self, state: dict) -> None:
        for src, dst, *link in state["links"]:
            self._link(src, dst).load_state(link)  # a later round's graph (a schedule) may have made it
        for capacity, free_at in zip((*self.uplinks, *self.downlinks), state["uplinks"] + state["downlinks"]):
            capacity.free_at = free_at
        self.send_seconds[:] = state["send_seconds"]
        for src, rng in state["wire_rngs"].items():
            set_numpy_state(self._wire_rng(src), rng)
        ledger = self.ledger
        ledger.load_state(state)
        for dst, messages in enumerate(state["mailboxes"]):
            self.mailboxes[dst].messages.extend(
                Message(src, dst, kind, rnd, size, t_send, t_arrive, frame,
                        trace=None if i is None else ledger.trace[i])
                for src, kind, rnd, size, t_send, t_arrive, frame, i in messages)

    async def connect(self) -> None:
        """Before the nodes start: nothing to set up on emulated links (a real transport connects here)."""

    async def close(self) -> None:
        """After the local nodes end: nothing to flush on emulated links."""

    def neighbours(self, node: int, rnd: int = 0) -> list[int]:
        """Whom `node` sends to in round `rnd` (on an undirected graph, its neighbours)."""
        return self.at(rnd).out_sorted[node]

    def in_neighbours(self, node: int, rnd: int = 0) -> list[int]:
        """Who sends to `node` in round `rnd` (on an undirected graph, its neighbours)."""
        return self.at(rnd).in_sorted[node]

    # -- sending ----------------------------------------------------------
    def send(self, src: int, dst: int, kind: str, rnd: int, body: Any) -> None:
        self.transmit(src, dst, kind, rnd, self._encode(src, kind, rnd, body))

    def broadcast(self, src: int, dsts: list[int], kind: str, rnd: int, body: Any) -> None:
        """Encode once: every receiver shares the immutable frame and decodes its own copy when it takes it."""
        frame = bytes(self._encode(src, kind, rnd, body))
        for dst in dsts:
            self.transmit(src, dst, kind, rnd, frame)

    def _encode(self, src: int, kind: str, rnd: int, body: Any) -> bytearray:
        """The frame of a message from src: its body, or an adversary's attack in its place."""
        adversaries = self.adversaries
        if adversaries is not None and src in adversaries.nodes:
            body = adversaries.tamper(src, kind, body)
        rng = self._wire_rng(src) if self.compress in wire.QUANTISERS else None
        return wire.encode([kind, rnd, body], compress=self.compress, rng=rng, checksum=self.checksum)

    def _wire_rng(self, src: int):
        """The sender's own generator for quantising compressors."""
        rng = self._wire_rngs.get(src)
        if rng is None:
            rng = self._wire_rngs[src] = self.seeds.numpy("wire", src)
        return rng

    def transmit(self, src: int, dst: int, kind: str, rnd: int, frame) -> None:
        """Put an already encoded frame on the link src -> dst."""
        # A static topology's links are its edges; a schedule's round may use only some of them.
        link = self.links.get((src, dst)) if self.schedule is None or dst in self.at(rnd).out[src] else None
        if link is None:
            raise NotNeighbourError(f"node {src} cannot send to {dst}: not a current neighbour in round {rnd} "
                                    f"(neighbours: {self.at(rnd).out_sorted[src]})")
        now = self.clock.now
        ledger = self.ledger
        nbytes = len(frame)
        trace = ledger.record(src, dst, kind, rnd, nbytes, now) if ledger.trace is not None else None
        if nbytes > self.max_message_bytes:
            warnings.warn(f"node {src}: a {kind!r} message of {nbytes} bytes exceeds the "
                          f"{self.max_message_bytes}-byte limit and was refused", MessageTooLargeWarning)
            ledger.sent(link.counters, src, rnd, 0)
            return self._drop(link, "over_limit", trace)
        if not self.online[src]:
            ledger.sent(link.counters, src, rnd, 0)
            return self._drop(link, "offline", trace)
        ledger.sent(link.counters, src, rnd, nbytes)
        if self.faults is not None and self.faults.down(src, dst, now):
            return self._drop(link, "link_down", trace)
        wire = nbytes
        if self.wire_size is not None:
            wire = self.wire_size(nbytes)
            ledger.wire_bytes += wire + self.ack_size(nbytes)
        if self.flows is not None:
            return self._flow(link, nbytes, wire, Message(src, dst, kind, rnd, nbytes, now, math.inf, frame, None,
                                                          trace))
        arrival = link.transmit(now, wire, nbytes)
        self.send_seconds[src] += link.free_at - link.last_start
        if arrival is None:
            return self._drop(link, "loss", trace)
        if link.window is not None:
            self._resent(link)
        self.in_flight += 1
        message = Message(src, dst, kind, rnd, nbytes, now, arrival, frame, None, trace)
        if self.senders_change and link.last_start > now:
            self.clock.schedule(link.last_start, self._start_event, link, message)
        else:
            self.clock.schedule(arrival, self._arrive_event, link, message)

    def _resent(self, link: Link) -> None:
        """A reliable link's last message sent `link.resent` payload bytes again: on the ledger, and on the wire."""
        self.ledger.resent(link, link.resent)
        if self.wire_size is not None and link.resent:
            self.ledger.wire_bytes += self.wire_size(link.resent) + self.ack_size(link.resent)

    def _flow(self, link: Link, nbytes: int, wire: int, message: Message) -> None:
        """Fair sharing: the message joins its link's queue as a flow of its wire bits (its ACKs, with an
        overhead, drawing on the way back). Its loss and latency are drawn now, as a FIFO link draws them; a
        lost message's bits still take their share. On a reliable lossy link, recovery at the link's own rate
        decides the rest: the bits sent again join the flow, and the waits for lost segments its latency."""
        latency = link.fate()
        if latency is None:
            self._drop(link, "loss", message.trace)
        else:
            self.in_flight += 1
        if link.window is not None:
            wire, latency = self._recover(link, nbytes, wire, latency)
        acks = None
        if self.ack_size is not None and wire:
            acks = (self.uplinks[link.dst], self.downlinks[link.src], self.ack_size(nbytes) / wire)
        self.flows.send(Flow(link, 8.0 * wire, message if latency is not None else None, latency, acks))

    def _recover(self, link: Link, nbytes: int, wire: int, latency: float) -> tuple[float, float]:
        """A reliable lossy link under fair sharing: its message's wire bytes, resent ones too, and its latency
        lengthened by the waits for lost segments (recovery played at the link's own rate)."""
        rate = min(link.bandwidth, link.up.rate)
        sending = 8.0 * wire / rate if rate != math.inf else 0.0
        took = link.recover(nbytes, sending, latency)
        self._resent(link)
        more = link.resent / nbytes if nbytes else 0.0
        return wire * (1 + more), latency + took - sending * (1 + more)

    def _turn(self, flow: Flow, now: float) -> bool:
        """A flow that waited behind others on its link leaves only if its sender and its edge are still up."""
        if not self.senders_change:
            return True
        link, message = flow.link, flow.message
        cause = ("offline" if not self.online[link.src] else
                 "link_down" if self.faults is not None and self.faults.down(link.src, link.dst, now) else None)
        if cause is not None and message is not None:
            self._landed(link, cause, message.trace)
        return cause is None

    def _flow_ended(self, flow: Flow, now: float) -> None:
        """A flow sent its bits: its sender's transmitting time grows, and its message arrives a latency later."""
        link, message = flow.link, flow.message
        self.send_seconds[link.src] += now - flow.start
        if message is not None:
            message.t_arrive = link.arrival(now, flow.latency)
            self.clock.schedule(message.t_arrive, self._arrive_event, link, message)

    def _start(self, link: Link, message: Message) -> None:
        """A queued message's turn: it leaves only if its sender and its edge are still up."""
        if not self.online[link.src]:
            return self._landed(link, "offline", message.trace)
        if self.faults is not None and self.faults.down(link.src, link.dst, self.clock.now):
            return self._landed(link, "link_down", message.trace)
        self.clock.schedule(message.t_arrive, self._arrive_event, link, message)

    def _landed(self, link: Link, drop_cause: str, trace: TraceRow | None) -> None:
        """A frame in flight dropped on arrival or at its turn to leave."""
        self._drop(link, drop_cause, trace)
        self._off_the_link()

    def _off_the_link(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self.drained is not None:
            self.drained()

    def _drop(self, link: Link, cause: str, trace: TraceRow | None) -> None:
        self.ledger.dropped(link.counters, cause)
        if trace is not None:
            trace.fate = cause

    def _arrive(self, link: Link, message: Message) -> None:
        dst, trace = link.dst, message.trace
        if not self.online[dst]:
            return self._landed(link, "offline", trace)
        if link.corrupt.draws:
            damaged = link.damage(message.frame)
            if damaged is not None:
                if self.checksum and not wire.intact(damaged):
                    return self._landed(link, "corrupt", trace)
                message.frame = damaged
        self.ledger.delivered(link.counters, dst, message.round, message.size)
        if trace is not None:
            trace.t_arrive, trace.fate = message.t_arrive, "delivered"
        self._off_the_link()
        self.mailboxes[dst].put(message)

    def open(self, message: Message) -> bool:
        """Decode a message its receiver takes; False, and a corrupt drop instead of a delivery, if it does not decode."""
        try:
            # The checksum was verified at arrival for the frames the corruption model damaged; every
            # other frame is intact by construction, so verifying it again here could only pass.
            kind, rnd, message.body = wire.decode(message.frame, checksum=False)
            intact = kind == message.kind and rnd == message.round
        except (wire.WireError, TypeError, ValueError):
            intact = False
        message.frame = None  # the receiver's copy now lives in the body
        if not intact:
            self.refuse(message, "corrupt")
        return intact

    def refuse(self, message: Message, cause: str) -> None:
        """A delivered message its receiver cannot use becomes a drop for `cause` (corrupt, invalid)."""
        self.ledger.refused(self.links[message.src, message.dst].counters, message.dst, message.round, message.size,
                            cause)
        if message.trace is not None:
            message.trace.fate = cause


def _per_node(rate: float | Sequence[float], n: int) -> list[float]:
    return [rate] * n if isinstance(rate, (int, float)) else list(rate)
