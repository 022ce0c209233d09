"""One emulation: every node's coroutine on a network and a clock, from objects built elsewhere."""
from __future__ import annotations

import asyncio
import gc
from typing import Callable

from .checkpoint import (Barrier, Checkpoints, Resume, dynamics_state, load_dynamics_state, load_network_state,
                         network_state, node_state, residents_by_node)
from .compute import Compute
from .network import Network
from .node import Node, NodeContext, handle_maker
from .protocol import Protocol
from .recorder import Recorder
from .seeds import Seeds


class Emulation:
    """The nodes of one run, driven on `clock` over `network`; `availability` (if any) takes them down and up.

    `local`: the one node this process runs, its peers running elsewhere (a real transport); None: all of them.
    """

    def __init__(self, protocol: Protocol, network: Network, clock, compute: Compute, rounds: int, seeds: Seeds,
                 availability=None, on_round: Callable = lambda rnd, now: None, checkpoints: Checkpoints | None = None,
                 duration: float = 0.0, eval_every_seconds: float = 0.0, local: int | None = None):
        self.protocol, self.network, self.clock, self.rounds = protocol, network, clock, rounds
        self.duration, self.eval_every_seconds = duration, eval_every_seconds
        self.ledger, self.availability, self.compute = network.ledger, availability, compute
        n = network.num_nodes
        # An observer sees every node's state at once, which no process of a real transport has.
        observe = protocol.observe if local is None else (lambda rnd, snapshots: {})
        self.recorder = Recorder(n, network.ledger, observe, on_round)
        if availability is not None:
            availability.on_crash = self._crash
        self.checkpoints = checkpoints
        self.barrier = resume = None
        if checkpoints is not None:
            self.barrier = Barrier(checkpoints.every, clock, network, lambda: self.recorder.alive, self._save)
            if checkpoints.saved is not None:
                resume = Resume(checkpoints.saved, checkpoints.tensors, compute.executor, checkpoints.residents)
                self.barrier.count, self.barrier.idle_seconds = checkpoints.saved["barrier"]
                load_network_state(checkpoints.saved["network"], clock, network, self.recorder)
                load_dynamics_state(checkpoints.saved["dynamics"], availability, network.faults)
                if network.adversaries is not None:
                    network.adversaries.load_state(checkpoints.saved["adversaries"])
        self.resumed = resume is not None
        self.nodes = [Node(NodeContext(i, network, clock, compute, self.recorder, rounds, seeds, duration,
                                       self.barrier, resume)) for i in range(n)]
        if resume is not None:
            for node, saved in zip(self.nodes, checkpoints.saved["nodes"]):
                node.load_times(saved)
        self.tasks: dict[int, asyncio.Task] = {}
        self._handle_of = handle_maker()  # what a protocol gets: the node API only
        self._running: set[int] = set()
        self._retired: set[int] = set()  # nodes whose coroutine ended
        self.local = self.nodes if local is None else [self.nodes[local]]
        if local is not None:
            for other in range(n):
                if other != local:  # another process runs it: no round waits for it here
                    self._retired.add(other)
                    self.recorder.retire(other, 0.0)
        self._ticks = 0  # the sampler's ticks so far

    def _save(self, rnd: int) -> None:
        """The state at round rnd's barrier, to the checkpoint writer."""
        tensors: dict = {}
        owned = residents_by_node(self.compute.executor.store)
        nodes = [node_state(node, owned.get(node.id, []), self.checkpoints.residents, tensors) for node in self.nodes]
        adversaries = self.network.adversaries
        saved = {"round": rnd, "network": network_state(self.clock, self.network, self.recorder), "nodes": nodes,
                 "dynamics": dynamics_state(self.availability, self.network.faults),
                 "adversaries": None if adversaries is None else adversaries.state(),
                 "barrier": [self.barrier.count, self.barrier.idle_seconds]}
        self.checkpoints.write(rnd, saved, tensors)

    def _crash(self, node: int) -> None:
        if node in self._running:  # a task cancelled before its first step could not catch it
            self.tasks[node].cancel()
        if node in self._retired:
            return
        self._retired.add(node)
        self.recorder.crash(node, self.clock.now)
        if self.barrier is not None:
            self.barrier.crashed(node)

    async def _node_main(self, node_main: Callable, node: Node) -> None:
        crashed = self.availability.crashed if self.availability is not None else ()
        if node.id in crashed:
            return
        self._running.add(node.id)
        try:
            await node_main(self._handle_of(node))
            self._check_servers(node)
        except asyncio.CancelledError:
            if node.id not in crashed:
                raise
        finally:
            self._running.discard(node.id)
            for server in node.servers:
                server.cancel()
        if node.id not in self._retired:
            self._retired.add(node.id)
            self.recorder.retire(node.id, self.clock.now)

    @staticmethod
    def _check_servers(node: Node) -> None:
        """A node.serve task that failed fails the run, as the node's own loop would."""
        for server in node.servers:
            if server.done() and not server.cancelled() and server.exception() is not None:
                raise server.exception()

    def _sample(self) -> None:
        """--eval-every-seconds: score every node that has a scorer and has not crashed, as it stands now,
        charging nothing; a row per node to samples.jsonl with its step and its traffic so far."""
        now, crashed = self.clock.now, self.availability.crashed if self.availability is not None else ()
        sent, received = self.ledger.node_traffic()
        for node in self.nodes:
            if node.scorer is None or node.id in crashed:
                continue
            fn, args = node.scorer
            self.recorder.record("samples", {"t": now, "node": node.id, "step": node.round,
                                             **self.compute.peek(node.id, fn, *args),
                                             "bytes_sent": sent[node.id], "bytes_received": received[node.id]})
        self._ticks += 1
        later = (self._ticks + 1) * self.eval_every_seconds  # k S exactly: no sum of S's rounding on
        if len(self._retired) < len(self.nodes) and (not self.duration or later <= self.duration):
            self.clock.schedule(later, self._sample)

    def node_time(self) -> dict[str, list[float]]:
        """Each node's emulated seconds computing (jobs charged), waiting idle (its loop waiting for messages or
        sleeping) and sending (its frames on their links)."""
        return {"compute_seconds": list(self.compute.busy_seconds),
                "idle_seconds": [node.idle_seconds for node in self.nodes],
                "send_seconds": list(self.network.send_seconds)}

    def run(self) -> list[dict]:
        """Run every node to the end; the metric rows in (round, node) order."""
        node_main = self.protocol.run if self.rounds > 0 else self.protocol.run_no_rounds

        async def main():
            await self.network.connect()
            if self.availability is not None and not self.resumed:  # resumed: its transitions are back on the clock
                self.availability.start()
            if self.eval_every_seconds:
                self.clock.schedule(self.eval_every_seconds, self._sample)
            for node in self.local:
                task = self.tasks[node.id] = asyncio.ensure_future(self._node_main(node_main, node))
                task._log_destroy_pending = False  # as gather does for its own: a failed run leaves them
            await asyncio.gather(*self.tasks.values())
            await self.network.close()

        # Messages are short-lived and acyclic, so reference counting frees them; the cyclic
        # collector would only scan a large run's millions of live objects again and again
        # (a quarter of a 50,000-node gossip run). It is off until the run ends.
        gc.freeze()
        enabled = gc.isenabled()
        gc.disable()
        try:
            self.clock.run(main())
        except BaseException:
            for task in self.tasks.values():  # an interrupt raised inside a node's task: the caller reports it
                if task.done() and not task.cancelled():
                    task.exception()
            raise
        finally:
            if enabled:
                gc.enable()
            gc.unfreeze()
        return self.recorder.finish(self.clock.now)
