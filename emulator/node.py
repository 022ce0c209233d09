"""The node: the one surface a protocol sees."""
from __future__ import annotations

import asyncio
import functools
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator


from .network import Message

if TYPE_CHECKING:
    from .runner import Emulation


@dataclass(frozen=True)
class ComputeModel:
    """How much emulated time a compute job is charged.

    kind "model": work * cost_per_unit * slowdown (deterministic);
    kind "measured": the job's wall time * factor * slowdown.
    """
    kind: str
    cost_per_unit: float
    factor: float
    slowdowns: tuple[float, ...]


class Node:
    def __init__(self, node_id: int, emulation: "Emulation"):
        self.id = node_id
        self.round = 0
        self._em = emulation
        self._network = emulation.network
        self._clock = emulation.clock
        self._mailbox = emulation.network.mailboxes[node_id]
        seeds = self.seeds = emulation.seeds
        # Each node owns its generators: concurrent jobs never share random state.
        self.rng = seeds.python("node.random", node_id)
        self.np_rng = seeds.numpy("node.numpy", node_id)
        self._torch_generator = None

    def __repr__(self):
        return f"Node({self.id}, round={self.round})"

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
        return self._network.neighbours(self.id, self.round)

    @property
    def in_neighbours(self) -> list[int]:
        """Who sends to this node in its current round, sorted (the neighbours, on an undirected graph)."""
        return self._network.in_neighbours(self.id, self.round)

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
        waiter = self._clock.loop.create_future()
        handle = self._clock.call_at(self._clock.now + seconds, _wake, waiter)
        try:
            await waiter
        finally:
            handle.cancel()

    # -- messages ---------------------------------------------------------
    def send(self, dst: int, kind: str, body: Any = None) -> None:
        """Send `body` to neighbour `dst`, tagged with `kind` and the current round."""
        self._network.send(self.id, dst, kind, self.round, body)

    def broadcast(self, kind: str, body: Any = None, to: list[int] | None = None) -> None:
        """Send the same message to every (out-)neighbour, or to the listed ones."""
        peers = self.neighbours if to is None else to
        if peers:
            self._network.broadcast(self.id, peers, kind, self.round, body)

    async def recv(self, timeout: float | None = None, kind: str | None = None) -> Message | None:
        """The next arrived message (of `kind`, if given); None after `timeout` emulated seconds."""
        deadline = None if timeout is None else self._clock.now + timeout
        while True:
            messages = self._mailbox.messages
            if messages:
                if kind is None:
                    return messages.popleft()
                for message in messages:
                    if message.kind == kind:
                        messages.remove(message)
                        return message
            if not await self._wait(deadline):
                return None

    async def gather(self, kind: str, round: int | None = None, peers: list[int] | None = None,
                     timeout: float | None = None) -> dict[int, Message]:
        """One message of `kind` for `round` from each of `peers` (default: the in-neighbours), until `timeout`.

        Returns what arrived, by sender in ascending order. Messages of `kind`
        from earlier rounds are stale and discarded; other messages stay queued.
        """
        rnd = self.round if round is None else round
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
        availability = self._em.availability
        if availability is None:
            return await self._submit(fn, args, work)
        await availability.until_online(self.id)
        start = self._clock.now
        result = await self._submit(fn, args, work)
        lost = availability.offline_time(self.id, start, self._clock.now)
        while lost > 0:
            await availability.until_online(self.id)
            start = self._clock.now
            await self.sleep(lost)
            lost = availability.offline_time(self.id, start, self._clock.now)
        return result

    def _submit(self, fn: Callable, args: tuple, work: float):
        model = self._em.compute_model
        slowdown = model.slowdowns[self.id]
        if model.kind == "measured":
            return self._clock.submit(fn, args, None, model.factor * slowdown)
        return self._clock.submit(fn, args, work * model.cost_per_unit * slowdown)

    # -- results ----------------------------------------------------------
    def rounds(self) -> Iterator[int]:
        """for r in node.rounds(): ... — sets node.round and closes each round's metrics row."""
        for rnd in range(self._em.rounds):
            self.round = rnd
            yield rnd
            self._em.recorder.end_round(self.id, rnd, self._clock.now)

    def log(self, **metrics: Any) -> None:
        """Add metrics to this node's row for the current round."""
        self._em.recorder.log(self.id, self.round, metrics)

    def snapshot(self, state: Any) -> None:
        """Hand the protocol's observer a view of this node's state for the current round."""
        self._em.recorder.snapshot(self.id, self.round, state)

    def record(self, stream: str, **row: Any) -> None:
        """Append a row (tagged with round and node) to `<stream>.jsonl` in the run directory."""
        self._em.recorder.record(stream, {"round": self.round, "node": self.id, **row})


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(False)


