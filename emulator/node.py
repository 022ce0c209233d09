"""The node: the one surface a protocol sees, built on a narrow context of its own."""
from __future__ import annotations

import asyncio
import functools
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .clock import sleep
from .compute import Compute
from .network import Message, Network
from .recorder import Recorder
from .seeds import Seeds


@dataclass(frozen=True)
class NodeContext:
    """What one node may use; it holds nothing of other nodes but the network that carries messages."""
    id: int
    network: Network
    clock: Any
    compute: Compute
    recorder: Recorder
    rounds: int
    seeds: Seeds


class Node:
    def __init__(self, context: NodeContext):
        self.id = context.id
        self._round = 0
        self._context = context
        self._network, self._clock = context.network, context.clock
        self._mailbox = context.network.mailboxes[context.id]
        # Each node owns its generators: concurrent jobs never share random state.
        self.rng = context.seeds.python("node.random", self.id)
        self.np_rng = context.seeds.numpy("node.numpy", self.id)
        self._torch_generator = None

    def __repr__(self):
        return f"Node({self.id}, round={self._round})"

    @property
    def round(self) -> int:
        """The round this node is in; node.rounds() advances it."""
        return self._round

    @property
    def seeds(self) -> Seeds:
        """The run's streams: node.seeds.numpy("purpose", node.id) for a stream of the protocol's own."""
        return self._context.seeds

    @property
    def torch_generator(self):
        if self._torch_generator is None:
            import torch

            self._torch_generator = torch.Generator().manual_seed(self.seeds.integer("node.torch", self.id))
        return self._torch_generator

    # -- where and when ---------------------------------------------------
    @property
    def neighbours(self) -> list[int]:
        """Whom this node sends to in its current round, sorted: its neighbours on an
        undirected graph, its out-neighbours on a directed one. Follows a time-varying topology."""
        return self._network.neighbours(self.id, self._round)

    @property
    def in_neighbours(self) -> list[int]:
        """Who sends to this node in its current round, sorted (the neighbours, on an undirected graph)."""
        return self._network.in_neighbours(self.id, self._round)

    @property
    def online(self) -> bool:
        """Whether this node is up now (--churn, --crash, --availability)."""
        return self._network.online[self.id]

    @property
    def num_nodes(self) -> int:
        return self._network.num_nodes

    def now(self) -> float:
        """Emulated seconds since the start of the run."""
        return self._clock.now

    async def sleep(self, seconds: float) -> None:
        await sleep(self._clock, seconds)

    # -- messages ---------------------------------------------------------
    def send(self, dst: int, kind: str, body: Any = None) -> None:
        """Send `body` to neighbour `dst`, tagged with `kind` and the current round."""
        self._network.send(self.id, dst, kind, self._round, body)

    def broadcast(self, kind: str, body: Any = None, to: list[int] | None = None) -> None:
        """Send the same message to every (out-)neighbour, or to the listed ones."""
        peers = self.neighbours if to is None else to
        if peers:
            self._network.broadcast(self.id, peers, kind, self._round, body)

    async def recv(self, timeout: float | None = None, kind: str | None = None) -> Message | None:
        """The next arrived message (of `kind`, if given); None after `timeout` emulated seconds."""
        deadline = None if timeout is None else self._clock.now + timeout
        while True:
            message = self._take(kind)
            if message is not None:
                return message
            if not await self._wait(deadline):
                return None

    def _take(self, kind: str | None) -> Message | None:
        """The first intact arrived message (of `kind`), decoded; corrupt ones on the way are dropped."""
        messages = self._mailbox.messages
        while True:
            message = next((m for m in messages if kind is None or m.kind == kind), None)
            if message is None:
                return None
            if kind is None:
                messages.popleft()
            else:
                messages.remove(message)
            if self._network.open(message):
                return message

    async def gather(self, kind: str, round: int | None = None, peers: list[int] | None = None,
                     timeout: float | None = None) -> dict[int, Message]:
        """One message of `kind` for `round` from each of `peers` (default: the in-neighbours), until `timeout`.

        Returns what arrived, by sender in ascending order. Messages of `kind`
        from earlier rounds are stale and discarded; other messages stay queued.
        """
        rnd = self._round if round is None else round
        wanted = set(self._network.in_neighbours(self.id, rnd) if peers is None else peers)
        got: dict[int, Message] = {}
        deadline = None if timeout is None else self._clock.now + timeout
        while True:
            self._collect(kind, rnd, wanted, got)
            if not wanted or not await self._wait(deadline):
                return dict(sorted(got.items()))

    def _collect(self, kind: str, rnd: int, wanted: set, got: dict) -> None:
        keep = []
        for message in self._mailbox.messages:
            if message.kind != kind or message.round > rnd:
                keep.append(message)
            elif message.round == rnd and message.src in wanted:
                if self._network.open(message):  # a corrupt one counts as lost: keep waiting for its sender
                    got[message.src] = message
                    wanted.discard(message.src)
            elif message.round == rnd:
                keep.append(message)
        if len(keep) != len(self._mailbox.messages):
            self._mailbox.messages = deque(keep)

    async def _wait(self, deadline: float | None) -> bool:
        """Wait for the next arrival; False once the deadline has passed."""
        clock = self._clock
        if deadline is not None and clock.now >= deadline:
            return False
        waiter = clock.loop.create_future()
        self._mailbox.waiter = waiter
        handle = None if deadline is None else clock.call_at(deadline, _expire, waiter)
        try:
            return await waiter
        finally:
            self._mailbox.waiter = None
            if handle is not None:
                handle.cancel()

    # -- compute ----------------------------------------------------------
    async def compute(self, fn: Callable, *args, work: float = 1.0, **kwargs):
        """Run fn(*args, **kwargs) on the shared executor; emulated time is charged by the compute model.

        An offline node starts once it is back, and time offline during the job does
        not count: the result comes that much later.
        """
        if kwargs:
            fn = functools.partial(fn, **kwargs)
        return await self._context.compute.run(self.id, fn, args, work)

    # -- results ----------------------------------------------------------
    def rounds(self) -> Iterator[int]:
        """for r in node.rounds(): ... — sets node.round and closes each round's metrics row."""
        recorder = self._context.recorder
        for rnd in range(self._context.rounds):
            self._round = rnd
            yield rnd
            recorder.end_round(self.id, rnd, self._clock.now)

    def log(self, **metrics: Any) -> None:
        """Add metrics to this node's row for the current round."""
        self._context.recorder.log(self.id, self._round, metrics)

    def snapshot(self, state: Any) -> None:
        """Hand the protocol's observer a view of this node's state for the current round."""
        self._context.recorder.snapshot(self.id, self._round, state)

    def record(self, stream: str, **row: Any) -> None:
        """Append a row (tagged with round and node) to `<stream>.jsonl` in the run directory."""
        self._context.recorder.record(stream, {"round": self._round, "node": self.id, **row})


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(False)
