"""The node: the one surface a protocol sees, built on a narrow context of its own.

A protocol gets a NodeHandle, never the Node: the handle has the node API and no
attributes at all (no __dict__, empty __slots__), and its Node sits in a table that only
the handle's own functions close over. `node._network`, `vars(node)` and friends fail, so
a protocol cannot reach other nodes' mailboxes, list the nodes or send as another node.
(Python has no true privacy: gc and closure introspection still reach everything; the
handle closes the paths a protocol could take by accident or by habit.)
"""
from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from .checkpoint import carried_bytes
from .clock import sleep
from .compute import Compute, Resident
from .work import Work
from .network import Message, Network
from .recorder import Recorder
from .timeout import Adaptive, Timer
from .seeds import Seeds, numpy_state, random_state, set_numpy_state, set_random_state


@dataclass(frozen=True, slots=True)
class NodeContext:
    """What one node may use; it holds nothing of other nodes but the network that carries messages."""
    id: int
    network: Network
    clock: Any
    compute: Compute
    recorder: Recorder
    rounds: int
    seeds: Seeds
    duration: float = 0.0  # --duration: no round (step) starts after this emulated instant (0: no such horizon)
    barrier: Any = None  # checkpoint.Barrier, with --checkpoint-every
    resume: Any = None  # the run's Resume, when it continues from a checkpoint


class Node:
    """One node of the emulated network: what a protocol's `run(node)` uses to send, receive, compute and log.

    A protocol gets a handle with exactly the members named in PROPERTIES and METHODS (below), not
    the Node itself. `node.id` is the node's number, 0 to num_nodes - 1.
    """
    __slots__ = ("id", "_round", "_context", "_network", "_clock", "_mailbox", "_rng", "_np_rng", "_torch_generator",
                 "_carried", "_timer", "idle_seconds", "scorer", "servers", "__weakref__")

    def __init__(self, context: NodeContext):
        self.id = context.id
        self._round = 0
        self._context = context
        self._network, self._clock = context.network, context.clock
        self._mailbox = context.network.mailboxes[context.id]
        self._rng = self._np_rng = self._torch_generator = None
        self._carried = None
        self._timer: Timer | None = None  # made on its first --timeout auto wait
        self.idle_seconds = 0.0  # emulated seconds its own loop spent waiting for messages or sleeping
        self.scorer: tuple | None = None  # (fn, args): what the clock-driven sampler scores (score_with)
        self.servers: list[asyncio.Task] = []  # its node.serve tasks, ended with the node

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

    # Each node owns its generators, made on first use: concurrent jobs never share random state.
    @property
    def rng(self):
        """The node's random.Random."""
        if self._rng is None:
            self._rng = self.seeds.python("node.random", self.id)
        return self._rng

    @property
    def np_rng(self):
        """The node's numpy Generator."""
        if self._np_rng is None:
            self._np_rng = self.seeds.numpy("node.numpy", self.id)
        return self._np_rng

    @property
    def torch_generator(self):
        """A handle to the node's torch.Generator, kept where its jobs run: pass it to node.compute."""
        if self._torch_generator is None:
            import torch

            generator = torch.Generator().manual_seed(self.seeds.integer("node.torch", self.id))
            self._torch_generator = self.keep(generator)
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
        """How many nodes the network has."""
        return self._network.num_nodes

    def now(self) -> float:
        """Emulated seconds since the start of the run."""
        return self._clock.now

    async def sleep(self, seconds: float) -> None:
        """Let `seconds` of emulated time pass for this node (no wall time)."""
        start = self._clock.now
        await sleep(self._clock, seconds)
        self.idle_seconds += self._clock.now - start

    # -- messages ---------------------------------------------------------
    def send(self, dst: int, kind: str, body: Any = None) -> None:
        """Send `body` to neighbour `dst`, tagged with `kind` and the current round."""
        self._network.send(self.id, dst, kind, self._round, body)

    def broadcast(self, kind: str, body: Any = None, to: list[int] | None = None) -> None:
        """Send the same message to every (out-)neighbour, or to the listed ones."""
        peers = self.neighbours if to is None else to
        if peers:
            self._network.broadcast(self.id, peers, kind, self._round, body)

    async def recv(self, timeout: float | Adaptive | None = None, kind: str | None = None,
                   valid: Callable[[Any], bool] | None = None, past_horizon: bool = False) -> Message | None:
        """The next arrived message (of `kind`, if given); None after `timeout` emulated seconds (at --duration at
        the latest, unless `past_horizon`: the answer to an exchange begun before it; Adaptive: as long as the
        node's timer says, emulator.timeout).

        With `valid`, a message whose body it rejects (or raises on) is dropped as invalid, unseen.
        """
        start = self._clock.now
        deadline = self._deadline(timeout, start)
        while True:
            message = self._take(kind, valid)
            if message is not None:
                if isinstance(timeout, Adaptive):
                    self._timer.observe(message.t_arrive - message.t_send)
                return message
            if not await self._wait(deadline, past_horizon=past_horizon):
                return None

    def _take(self, kind: str | None, valid: Callable[[Any], bool] | None) -> Message | None:
        """The first intact, valid arrived message (of `kind`), decoded; corrupt and invalid ones on the way
        are dropped."""
        messages = self._mailbox.messages
        while True:
            if kind is None:
                message = messages.pop(0) if messages else None
            else:
                message = next((m for m in messages if m.kind == kind), None)
                if message is not None:
                    messages.remove(message)
            if message is None or self._opens(message, valid):
                return message

    async def gather(self, kind: str, round: int | None = None, peers: list[int] | None = None,
                     timeout: float | Adaptive | None = None,
                     valid: Callable[[Any], bool] | None = None) -> dict[int, Message]:
        """One message of `kind` for `round` from each of `peers` (default: the in-neighbours), until `timeout`
        (Adaptive: as long as the node's timer says, emulator.timeout).

        Returns what arrived, by sender in ascending order. Messages of `kind`
        from earlier rounds are stale and discarded; other messages stay queued.
        Messages are decoded on return, all at once: while a node waits, what it
        has collected stays one shared frame per sender, not a copy per receiver.
        A corrupt one is dropped then, as if lost, and so is one whose body `valid` rejects.
        """
        rnd = self._round if round is None else round
        wanted = set(self._network.in_neighbours(self.id, rnd) if peers is None else peers)
        got: dict[int, Message] = {}
        self._collect(kind, rnd, wanted, got)  # first: a stale message it drops may teach the timer
        deadline = self._deadline(timeout, self._clock.now)
        timed_out = False
        while wanted and not timed_out:
            timed_out = not await self._wait(deadline, _Awaited(kind, rnd, wanted))
            self._collect(kind, rnd, wanted, got)
        if isinstance(timeout, Adaptive):
            for message in got.values():
                self._timer.observe(message.t_arrive - message.t_send)
        return {src: got[src] for src in sorted(got) if self._opens(got[src], valid)}

    def _deadline(self, timeout: float | Adaptive | None, start: float) -> float | None:
        if timeout is None:
            return None
        if isinstance(timeout, Adaptive):
            if self._timer is None:
                self._timer = Timer()
            return start + timeout.times * self._timer.timeout() + timeout.extra
        return start + timeout

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
            elif self._timer is not None:  # stale: one a wait gave up on, whose transit still counts
                self._timer.observe(message.t_arrive - message.t_send)
        if len(keep) != len(self._mailbox.messages):
            self._mailbox.messages = keep

    def _opens(self, message: Message, valid: Callable[[Any], bool] | None) -> bool:
        """Decode the message; False (and a drop) if it is corrupt or its body fails `valid`."""
        if not self._network.open(message):
            return False
        if valid is None:
            return True
        try:
            accepted = bool(valid(message.body))
        except Exception:  # noqa: BLE001 - a check that trips over a hostile body has rejected it
            accepted = False
        if not accepted:
            message.body = None
            self._network.refuse(message, "invalid")
        return accepted

    async def _wait(self, deadline: float | None, wakes: Callable[[Message], bool] | None = None,
                    past_horizon: bool = False) -> bool:
        """Wait for the next arrival (one `wakes` accepts, if given); False once the deadline has passed."""
        clock = self._clock
        horizon = self._context.duration
        if horizon and not past_horizon and deadline is not None and deadline > horizon:
            deadline = max(horizon, clock.now)  # past --duration, no one waits for what has not come
        if deadline is not None and clock.now >= deadline:
            return False
        waiter = clock.loop.create_future()
        mailbox = self._mailbox
        mailbox.waiter, mailbox.wakes = waiter, wakes
        handle = None if deadline is None else clock.call_at(deadline, _expire, waiter)
        start = clock.now
        try:
            return await waiter
        finally:
            mailbox.waiter = mailbox.wakes = None
            self.idle_seconds += clock.now - start
            if handle is not None:
                handle.cancel()

    def serve(self, kind: str, handler: Callable[[Message], Any], valid: Callable[[Any], bool] | None = None) -> None:
        """Answer every arriving message of `kind` with handler(message), beside the node's own loop.

        Such messages never reach recv or gather. A plain function is called as each one arrives; a
        coroutine function handles them one at a time, in arrival order, in a task of the node's that
        ends with it. The node's compute jobs still run one at a time, in the order they were started.
        With `valid`, a message whose body it rejects is dropped as invalid, unseen.
        """
        mailbox = self._mailbox
        if mailbox.served is None:
            mailbox.served = {}
        if inspect.iscoroutinefunction(handler):
            queue: asyncio.Queue = asyncio.Queue()
            mailbox.served[kind] = queue.put_nowait
            self.servers.append(asyncio.ensure_future(self._serve(queue, handler, valid)))
        else:
            mailbox.served[kind] = lambda message: handler(message) if self._opens(message, valid) else None

    async def _serve(self, queue: asyncio.Queue, handler: Callable, valid: Callable[[Any], bool] | None) -> None:
        while True:
            message = await queue.get()
            if self._opens(message, valid):
                await handler(message)

    # -- compute ----------------------------------------------------------
    def keep(self, value: Any) -> Resident:
        """Put `value` (a model, a data split, ...) where this node's jobs run, for the whole run; its handle.

        Pass the handle (or `handle.attribute`) to node.compute: the job gets the object itself.
        """
        return self._context.compute.keep(self.id, value)

    async def compute(self, fn: Callable, *args, work: "float | Work" = 1.0, keep: bool = False, **kwargs):
        """Run fn(*args, **kwargs) as this node's job; emulated time is charged by the compute model for its
        `work`: a Work (counts of what the job does), or a number of units at --compute-cost each.

        Resident handles among args and kwargs (this node's own) reach fn as the objects
        they name. With keep=True the result stays where the job ran and a handle to it
        comes back (so fn cannot take a keyword named keep, nor work). fn must be
        importable (a module-level function), so that it can run on another machine. An
        offline node starts a job of any work once it is back, and time offline during the
        job does not count: the result comes that much later.
        """
        for value in (*args, *kwargs.values()):
            if isinstance(value, Resident) and value.node != self.id:
                raise ValueError(f"node {self.id}: a job got node {value.node}'s {value!r}; nodes share state "
                                 "only through messages")
        return await self._context.compute.run(self.id, fn, args, kwargs, work, keep)

    # -- results ----------------------------------------------------------
    async def rounds(self) -> AsyncIterator[int]:
        """async async for r in node.rounds(): ... — sets node.round and closes each round's metrics row.

        With --checkpoint-every K, the node waits at the barrier before each K-th round; a
        resumed run starts at the checkpoint's round, the node's state put back first.
        """
        context = self._context
        recorder, barrier, resume = context.recorder, context.barrier, context.resume
        start = 0
        if resume is not None:
            start = resume.round
            resume.restore(self)
        for rnd in range(start, context.rounds):
            if context.duration and self._clock.now >= context.duration:
                break
            if barrier is not None and rnd > start and barrier.due(rnd):
                await barrier.wait(self.id, rnd)
            self._round = rnd
            yield rnd
            recorder.end_round(self.id, rnd, self._clock.now)

    def carry(self, state: Any) -> Any:
        """Declare what this node carries from round to round (a dataclass: the algorithm box's
        variables); a checkpoint saves it, and a resumed run hands it back as it was. Call it
        before `async for ... in node.rounds()`, and keep cross-round state in it, not in locals."""
        self._carried = state
        resume = self._context.resume
        if resume is not None:
            resume.refill(self, state)
        return state

    def score_with(self, fn: Callable, *args) -> None:
        """What --eval-every-seconds scores on this node: fn(*args) -> {metric: value}, a job on its state
        (Resident handles among args), run every S emulated seconds without charging compute."""
        self.scorer = (fn, args)

    def log(self, **metrics: Any) -> None:
        """Add metrics to this node's row for the current round."""
        self._context.recorder.log(self.id, self._round, metrics)

    def snapshot(self, state: Any) -> None:
        """Hand the protocol's observer a view of this node's state for the current round."""
        self._context.recorder.snapshot(self.id, self._round, state)

    def record(self, stream: str, **row: Any) -> None:
        """Append a row (tagged with round and node) to `<stream>.jsonl` in the run directory."""
        self._context.recorder.record(stream, {"round": self._round, "node": self.id, **row})

    # -- checkpoints --------------------------------------------------------
    def state(self, saved_residents: list[int]) -> dict:
        """Its part of a checkpoint, as plain data: its generators (None: not made yet), its handle count, what
        it carries, and `saved_residents`, the keys of its resident objects the checkpoint saved as tensors."""
        generator = self._torch_generator
        return {"rng": random_state(self._rng), "np_rng": numpy_state(self._np_rng),
                "torch_generator": None if generator is None else generator.key,
                "keys": self._context.compute.keys(self.id), "residents": saved_residents,
                "idle_seconds": self.idle_seconds, "compute_seconds": self._context.compute.busy_seconds[self.id],
                "carried": None if self._carried is None else carried_bytes(self._carried),
                **({"timer": self._timer.state()} if self._timer is not None else {})}

    def load_state(self, state: dict) -> None:
        """Put its generators and handle count back, once its protocol has set up; what it carries comes back
        through carry(), its resident objects' tensors through the checkpoint. A torch generator not made yet
        (made on first use) is made under its saved handle, for the checkpoint to fill."""
        if state["rng"] is not None:
            set_random_state(self.rng, state["rng"])
        if state["np_rng"] is not None:
            set_numpy_state(self.np_rng, state["np_rng"])
        if state["torch_generator"] is not None and self._torch_generator is None:
            self._keep_torch_generator(state["torch_generator"])
        self._context.compute.set_keys(self.id, state["keys"])
        if "timer" in state:
            self._timer = Timer()
            self._timer.load_state(state["timer"])

    def load_times(self, state: dict) -> None:
        """Put its idle and compute seconds back (every node's, crashed ones too, as the run resumes)."""
        self.idle_seconds = state["idle_seconds"]
        self._context.compute.busy_seconds[self.id] = state["compute_seconds"]

    def _keep_torch_generator(self, key: int) -> None:
        import torch

        self._context.compute.executor.keep(self.id, key, torch.Generator())
        self._torch_generator = Resident(self.id, key)


class _Awaited:
    """What a gather still waits for: it wakes its node once the last of them has arrived."""
    __slots__ = ("kind", "round", "pending")

    def __init__(self, kind: str, rnd: int, wanted: set):
        self.kind, self.round, self.pending = kind, rnd, set(wanted)

    def __call__(self, message: Message) -> bool:
        if message.kind == self.kind and message.round == self.round:
            self.pending.discard(message.src)
        return not self.pending


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(False)


# -- the handle protocols get ------------------------------------------------------

PROPERTIES = ("id", "round", "seeds", "rng", "np_rng", "torch_generator", "neighbours", "in_neighbours", "online",
              "num_nodes")
METHODS = ("now", "sleep", "send", "broadcast", "recv", "gather", "serve", "keep", "compute", "rounds", "carry",
           "score_with", "log", "snapshot", "record")


def handle_maker():
    """A function that makes a handle of a Node; an emulation makes its own, so its table of
    nodes goes with it (one class per run: no per-node bookkeeping to free the entries)."""
    nodes: dict[int, Node] = {}  # id(handle) -> Node; reachable only through the closures below

    def delegated_property(name: str) -> property:
        member = vars(Node).get(name)  # a property, or (id) an instance attribute
        return property(lambda handle: getattr(nodes[id(handle)], name),
                        doc=member.__doc__ if isinstance(member, property) else None)

    def delegated_method(name: str):
        method = getattr(Node, name)

        def call(handle, *args, **kwargs):
            return method(nodes[id(handle)], *args, **kwargs)
        call.__name__, call.__doc__ = name, method.__doc__
        return call

    namespace = {name: delegated_property(name) for name in PROPERTIES}
    namespace.update({name: delegated_method(name) for name in METHODS})
    namespace.update(__slots__=(), __repr__=lambda handle: repr(nodes[id(handle)]),
                     __doc__="The node API a protocol sees (see Node); nothing else is reachable through it.")
    handle_type = type("NodeHandle", (), namespace)

    def handle_of(node: Node):
        handle = handle_type()
        nodes[id(handle)] = node  # the handle lives as long as the run: ids stay unique in the table
        return handle
    return handle_of
