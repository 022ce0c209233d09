"""Checkpoints at a round barrier: the emulator's part of a run's state, taken and put back.

With --checkpoint-every K, before round r (a positive multiple of K) every live node waits
at the barrier. Once nothing else can happen (every frame in flight has landed, no timer
or job is due) the barrier takes the state, hands it to `save`, and lets every node go on,
in node order. At that instant each node's state is only what it declared with
`node.carry(...)`, its resident objects, its generators and the frames in its mailbox, so
the state is consistent. Emulated time idles at the barrier; nothing else changes.

The state is plain data (msgpack-able: numbers, strings, bytes, lists, dicts) and a dict
of tensors (the nodes' resident objects, by "node/key/name"); writing it is the caller's.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import wire
from .compute import Resident
from .dynamics import EdgeFaults
from .ledger import TraceRow
from .network import Message


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


# -- random generators as plain data

def random_state(rng: random.Random | None):
    if rng is None:
        return None
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_random_state(rng: random.Random, state) -> None:
    rng.setstate((state[0], tuple(state[1]), state[2]))


def numpy_state(generator) -> str | None:
    """A numpy Generator's bit generator state, as JSON (its integers outgrow msgpack's 64 bits)."""
    return None if generator is None else json.dumps(generator.bit_generator.state)


def set_numpy_state(generator, state: str) -> None:
    generator.bit_generator.state = json.loads(state)


def numpy_generator(state: str) -> np.random.Generator:
    """A numpy Generator in a saved state (the state is all of it: which stream it came from no longer matters)."""
    generator = np.random.default_rng()
    set_numpy_state(generator, state)
    return generator


# -- the network, the ledger and the recorder

def capture_network(network, recorder, clock) -> dict:
    ledger = network.ledger
    trace_index = {id(row): i for i, row in enumerate(ledger.trace)} if ledger.trace is not None else {}
    return {
        "now": clock.now,
        "links": [[src, dst, link.free_at, link.last_start, link.last_arrival, link.loss_bad,
                   random_state(link._rng), numpy_state(link._corrupt_rng), list(link.counters)]
                  for (src, dst), link in sorted(network.links.items())],
        "uplinks": [c.free_at for c in network.uplinks],
        "downlinks": [c.free_at for c in network.downlinks],
        "wire_rngs": {src: numpy_state(g) for src, g in network._wire_rngs.items()},
        "node_rounds": [[node, rnd, *counts.of(node)] for rnd, counts in ledger.rounds.items()
                        for node in range(ledger.num_nodes) if any(counts.of(node))],
        "trace": None if ledger.trace is None else [
            [r.src, r.dst, r.kind, r.round, r.bytes, r.t_send, r.t_arrive, r.fate] for r in ledger.trace],
        "mailboxes": [[[m.src, m.kind, m.round, m.size, m.t_send, m.t_arrive, bytes(m.frame),
                        trace_index.get(id(m.trace))] for m in box.messages] for box in network.mailboxes],
        "recorder": {"rows": [[rnd, node, row] for (rnd, node), row in recorder.rows.items()],
                     "done_through": list(recorder.done_through), "alive": recorder.alive,
                     "streams": dict(recorder.streams)},
    }


def restore_network(saved: dict, network, recorder, clock) -> None:
    clock.now = saved["now"]
    ledger = network.ledger
    for src, dst, free_at, last_start, last_arrival, bad, rng, corrupt, counters in saved["links"]:
        link = network._link(src, dst)  # a later round's graph (a schedule) may have made it
        link.free_at, link.last_start, link.last_arrival, link.loss_bad = free_at, last_start, last_arrival, bad
        if rng is not None:
            set_random_state(link.rng, rng)
        if corrupt is not None:
            link._corrupt_rng = numpy_generator(corrupt)
        link.counters[:] = counters  # the ledger's row: the link holds a reference to it
    for capacity, free_at in zip((*network.uplinks, *network.downlinks), saved["uplinks"] + saved["downlinks"]):
        capacity.free_at = free_at
    for src, state in saved["wire_rngs"].items():
        set_numpy_state(network._wire_rng(src), state)
    ledger.rounds.clear()
    for node, rnd, *counts in saved["node_rounds"]:
        ledger.counts(rnd).put(node, counts)
    if saved["trace"] is not None:
        ledger.trace[:] = [TraceRow(*row) for row in saved["trace"]]
    for dst, messages in enumerate(saved["mailboxes"]):
        network.mailboxes[dst].messages.extend(
            Message(src, dst, kind, rnd, size, t_send, t_arrive, frame, trace=None if i is None else ledger.trace[i])
            for src, kind, rnd, size, t_send, t_arrive, frame, i in messages)
    rec = saved["recorder"]
    recorder.rows = {(rnd, node): row for rnd, node, row in rec["rows"]}
    recorder.done_through[:] = rec["done_through"]
    recorder.alive = rec["alive"]
    recorder.streams.clear()
    recorder.streams.update(rec["streams"])


# -- adversaries, the availability process (churn, crashes, an availability trace) and link faults

def capture_adversaries(adversaries) -> dict | None:
    """Each attacker's noise generator, and the first bodies the stale attack keeps sending."""
    if adversaries is None:
        return None
    return {"rngs": {src: numpy_state(g) for src, g in adversaries._rngs.items()},
            "first": [[src, kind, bytes(wire.encode(body))] for (src, kind), body in adversaries._first.items()]}


def restore_adversaries(saved: dict | None, adversaries) -> None:
    if adversaries is None:
        return
    for src, state in saved["rngs"].items():
        adversaries._rngs[src] = numpy_generator(state)
    adversaries._first.update({(src, kind): wire.decode(body) for src, kind, body in saved["first"]})


def capture_dynamics(availability, faults, clock) -> dict:
    """Who is down and why, the offline spells so far, and the transitions still on the clock (with the
    churn generators they draw from); each faulty edge's chain."""
    saved: dict = {}
    if availability is not None:
        pending = [(when, callback.__name__, args) for when, callback, args in clock.pending()
                   if getattr(callback, "__self__", None) is availability]
        saved["availability"] = {
            "holds": list(availability._holds), "online": list(availability.online),
            "intervals": availability.intervals, "crashed": sorted(availability.crashed),
            "pending": [[when, name, [numpy_state(a) if hasattr(a, "bit_generator") else a for a in args]]
                        for when, name, args in pending]}
    if faults is not None:
        saved["edges"] = [[u, v, edge.down, edge.next_change, numpy_state(edge.rng)]
                          for (u, v), edge in faults._edges.items()]
    return saved


def restore_dynamics(saved: dict, availability, faults, clock) -> None:
    if availability is not None:
        state = saved["availability"]
        availability._holds[:] = state["holds"]
        availability.online[:] = state["online"]
        availability.intervals[:] = state["intervals"]
        availability.crashed.update(state["crashed"])
        for when, name, args in state["pending"]:
            if name.startswith("_churn"):  # (node, the node's churn generator)
                args = [args[0], numpy_generator(args[1])]
            clock.schedule(when, getattr(availability, name), *args)
    if faults is not None:
        for u, v, down, next_change, rng in saved["edges"]:
            faults._edges[u, v] = EdgeFaults(down, next_change, numpy_generator(rng))


# -- a node: its generators, its resident objects and what it carries

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


def capture_node(node, owned: list[tuple[int, Any]], residents: Residents, tensors: dict) -> dict:
    """A node's part of the state; the tensors of its resident objects (`owned`, from residents_by_node) go
    into `tensors`."""
    kept = []
    for key, obj in owned:
        saved = residents.save(obj)
        if saved is not None:
            kept.append(key)
            tensors.update({f"{node.id}/{key}/{name}": t for name, t in saved.items()})
    carried = node._carried
    generator = node._torch_generator
    return {"rng": random_state(node._rng), "np_rng": numpy_state(node._np_rng),
            "torch_generator": None if generator is None else generator.key, "keys": node._context.compute.keys(node.id),
            "residents": kept, "carried": None if carried is None else bytes(wire.encode(_plain(vars(carried))))}


def restore_node(node, saved: dict, tensors: dict, executor, residents: Residents) -> None:
    """Put a node's saved state back, once its protocol has set up (so its resident objects exist);
    tensors: {(node, key): {name: tensor}}, as Resume groups them."""
    if saved["rng"] is not None:
        set_random_state(node.rng, saved["rng"])
    if saved["np_rng"] is not None:
        set_numpy_state(node.np_rng, saved["np_rng"])
    if saved["torch_generator"] is not None and node._torch_generator is None:
        node.keep_torch_generator(saved["torch_generator"])  # made on first use: maybe not yet, in a resumed run
    for key in saved["residents"]:
        residents.load(executor.store[node.id, key], tensors.get((node.id, key), {}))
    node._context.compute.set_keys(node.id, saved["keys"])


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
        _refill(state, carried_fields(self.nodes[node.id], node.id))

    def restore(self, node) -> None:
        restore_node(node, self.nodes[node.id], self.tensors, self.executor, self.residents)


def carried_fields(saved: dict, node_id: int) -> dict:
    """The fields of what a node carries, as saved (its resident handles made handles again)."""
    return _handles(wire.decode(saved["carried"]), node_id)


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
