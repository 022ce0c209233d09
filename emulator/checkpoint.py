"""Checkpoints at a round barrier: the emulator's part of a run's state, taken and put back.

With --checkpoint-every K, before round r (a positive multiple of K) every live node waits
at the barrier. Once nothing else can happen (every frame in flight has landed, no timer
or job is due) the barrier takes the state, hands it to `save`, and lets every node go on,
in node order. At that instant each node's state is only what it declared with
`node.carry(...)`, its resident objects, its generators and the frames in its mailbox, so
the state is consistent. Emulated time idles at the barrier; nothing else changes.

The state is plain data (msgpack-able: numbers, strings, bytes, lists, dicts) and a dict
of tensors (the nodes' resident objects, by "node/key/name"); writing it is the caller's.
Each object gives its own part (`state()`) and takes it back (`load_state(state)`), the
availability process with its transitions still on the clock; this module lays the parts
out as a checkpoint holds them, and saves resident objects as tensors.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

from . import wire
from .compute import Resident


@dataclass
class Checkpoints:
    """A run's checkpointing: every K rounds, how resident objects are saved, where a checkpoint goes
    (write(round, state, tensors)), and the checkpoint it resumes from, if any."""
    every: int
    residents: "Residents"
    write: Callable[[int, dict, dict], None]
    saved: dict | None = None
    tensors: dict | None = None


class Barrier:
    """Where the nodes wait before a checkpointed round."""

    def __init__(self, every: int, clock, network, alive: Callable[[], int], save: Callable[[int], None]):
        self.every, self.clock, self.network, self.alive, self.save = every, clock, network, alive, save
        self.waiting: dict[int, asyncio.Future] = {}
        self.round: int | None = None  # the round the nodes wait to start
        self.releasing = False
        self.first_arrival = 0.0
        self.idle_seconds = 0.0  # emulated time between each barrier's first arrival and its release, summed
        self.count = 0
        self.write_seconds = 0.0  # wall time taking and writing the checkpoints

    def due(self, rnd: int) -> bool:
        return self.every > 0 and rnd > 0 and rnd % self.every == 0

    async def wait(self, node: int, rnd: int) -> None:
        if not self.waiting:
            self.first_arrival, self.round = self.clock.now, rnd
        waiter = self.waiting[node] = self.clock.loop.create_future()
        self.check()
        await waiter

    def crashed(self, node: int) -> None:
        """A node that will never come: the others stop waiting for it."""
        self.waiting.pop(node, None)
        if self.waiting:
            self.check()

    def check(self) -> None:
        """Release once every live node waits and no frame is in flight (arrived ones wait in mailboxes)."""
        if self.releasing or len(self.waiting) < self.alive():
            return
        if self.network.in_flight:
            self.network.drained = self.check
            return
        self.network.drained = None
        self.releasing = True
        self.clock.when_idle(self._release, self.round)

    def _release(self, rnd: int) -> None:
        self.releasing = False
        self.idle_seconds += self.clock.now - self.first_arrival
        self.count += 1
        start = time.perf_counter()
        self.save(rnd)
        self.write_seconds += time.perf_counter() - start
        waiting, self.waiting = self.waiting, {}
        for node in sorted(waiting):
            waiting[node].set_result(None)


# -- the emulator's objects: each saves its own state; the file's layout is here

def network_state(clock, network, recorder) -> dict:
    """The clock's, network's (with its ledger's) and recorder's state, in one map."""
    return {**clock.state(), **network.state(), "recorder": recorder.state()}


def load_network_state(saved: dict, clock, network, recorder) -> None:
    """Put network_state's map back, before any node starts."""
    clock.load_state(saved)
    network.load_state(saved)
    recorder.load_state(saved["recorder"])


def dynamics_state(availability, faults) -> dict:
    """The state of the availability process (churn, crashes, an availability trace) and of the link faults,
    those the run has; the availability's transitions still due are in it, to be put back on the clock."""
    saved: dict = {}
    if availability is not None:
        saved["availability"] = availability.state()
    if faults is not None:
        saved["edges"] = faults.state()
    return saved


def load_dynamics_state(saved: dict, availability, faults) -> None:
    if availability is not None:
        availability.load_state(saved["availability"])
    if faults is not None:
        faults.load_state(saved["edges"])


# -- a node: its own state, and its resident objects as tensors

class Residents:
    """How resident objects become tensors and back (a model's state dict, a generator's state);
    the application supplies it, as the emulator knows nothing of models."""

    def __init__(self, save: Callable[[Any], dict | None], load: Callable[[Any, dict], None]):
        self.save, self.load = save, load


def residents_by_node(store: dict) -> dict[int, list[tuple[int, Any]]]:
    """An executor's store, {(node, key): object}, as each node's [(key, object)] in the store's order."""
    owned: dict[int, list] = {}
    for (owner, key), obj in store.items():
        owned.setdefault(owner, []).append((key, obj))
    return owned


def node_state(node, owned: list[tuple[int, Any]], residents: Residents, tensors: dict) -> dict:
    """A node's part of the state; the tensors of its resident objects (`owned`, from residents_by_node) go
    into `tensors`, by "node/key/name"."""
    saved_keys = []
    for key, obj in owned:
        saved = residents.save(obj)
        if saved is not None:
            saved_keys.append(key)
            tensors.update({f"{node.id}/{key}/{name}": t for name, t in saved.items()})
    return node.state(saved_keys)


class Resume:
    """A run continuing from a checkpoint: each node's part, put back as the node comes to it."""

    def __init__(self, saved: dict, tensors: dict, executor, residents: Residents):
        self.round, self.nodes = saved["round"], saved["nodes"]
        self.executor, self.residents = executor, residents
        self.tensors: dict[tuple[int, int], dict] = {}  # grouped once: each node finds its own at once
        for name, t in tensors.items():
            node, key, rest = name.split("/", 2)
            self.tensors.setdefault((int(node), int(key)), {})[rest] = t

    def refill(self, node, state) -> None:
        """What the node carried, back into its fresh state object (an object field: into that object)."""
        _refill(state, carried_fields(self.nodes[node.id]["carried"], node.id))

    def restore(self, node) -> None:
        """Put a node's saved state back, once its protocol has set up (so its resident objects exist)."""
        saved = self.nodes[node.id]
        node.load_state(saved)
        for key in saved["residents"]:
            self.residents.load(self.executor.store[node.id, key], self.tensors.get((node.id, key), {}))


def carried_bytes(state) -> bytes:
    """What a node carries (a dataclass), as bytes of the wire codec (its resident handles kept as handles)."""
    return bytes(wire.encode(_plain(vars(state))))


def carried_fields(data: bytes, node_id: int) -> dict:
    """The fields of what a node carries, from carried_bytes (its resident handles made handles again)."""
    return _handles(wire.decode(data), node_id)


def _refill(obj, fields: dict) -> None:
    for name, value in fields.items():
        if isinstance(value, dict) and value.keys() == {OBJECT}:
            _refill(getattr(obj, name), value[OBJECT])
        else:
            setattr(obj, name, value)


RESIDENT, OBJECT = "__resident__", "__object__"


def _plain(value):
    """Resident handles as {RESIDENT: [key, length, path...]}, other objects as {OBJECT: their fields},
    for the wire codec."""
    if isinstance(value, Resident):
        return {RESIDENT: [value.key, value.length, *value.path]}
    if hasattr(value, "__dict__") and not isinstance(value, type) and not type(value).__module__.startswith("torch"):
        return {OBJECT: _plain(vars(value))}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _handles(value, node_id: int):
    if isinstance(value, dict):
        if value.keys() == {RESIDENT}:
            key, length, *path = value[RESIDENT]
            return Resident(node_id, key, tuple(path), length)
        return {k: _handles(v, node_id) for k, v in value.items()}
    if isinstance(value, list):
        return [_handles(v, node_id) for v in value]
    return value
