"""A real transport: one node per process, its frames over TCP to peers in other processes.

The node API, the frames and the ledger are the network's own (TcpNetwork is a
Network); only the carrying differs:

- Node i connects once to each out-neighbour and says who it is (a 4-byte hello);
  it accepts one connection from each in-neighbour. The run starts at a wall instant
  every node was given (`start_at`, seconds since the epoch), or once all of its
  connections are up, and `now()` is wall seconds since that instant.
- A message is written to its connection as a header (sequence number on the link,
  kind, round, send time) and the frame. The ledger counts the frame, as the emulated
  network does; the header is the transport's framing, counted apart (`framing_bytes`).
- The receiver takes delivery when the frame's last byte has been read, plus the
  link's latency sample held in the application (no `netem` on the machines this was
  built on): arrival = end of transfer + latency, the link model's own rule, never
  overtaking the message before it on the link. Loss and corruption are the real
  network's: none is drawn.
- A node whose own loop has ended still receives: it closes its connections once every
  in-neighbour has closed its own (so every frame sent is read and counted).
"""
from __future__ import annotations

import asyncio
import socket
import struct
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import msgpack

from .ledger import TraceRow
from .network import Message, Network

_SIZES = struct.Struct("!IH")  # frame bytes, header bytes
_HELLO = struct.Struct("!I")  # the connecting node's id
CONNECT_SECONDS = 120.0  # how long a node keeps trying its peers: they may still be importing torch


@dataclass
class Placement:
    """Where one node runs: its id, its listening address, its peers' addresses and when the run starts."""
    node: int
    listen: tuple[str, int]
    peers: dict[int, tuple[str, int]]
    start_at: float | None = None  # wall seconds since the epoch; None: once connected
    ready: Callable[[], Awaitable[float]] | None = None  # awaited once connected: it gives start_at


class TcpNetwork(Network):
    """The network as one node sees it, carrying its frames over TCP (see the module doc)."""

    def __init__(self, *args, placement: Placement, **kwargs):
        super().__init__(*args, **kwargs)
        self.placement = placement
        self.local = placement.node
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._sent_seq: dict[int, int] = {}
        self._readers: list[asyncio.Task] = []
        self._in_neighbours = set(self.in_neighbours(self.local))
        self._accepted_from: set[int] = set()
        self._accepted = asyncio.Event()  # set once every in-neighbour has connected
        self._server = None
        self.framing_bytes = 0  # the headers written before the frames, counted apart from them

    # -- setting up -------------------------------------------------------------
    async def connect(self) -> None:
        """Listen, connect to the out-neighbours, wait for the in-neighbours; then wait for the start instant."""
        host, port = self.placement.listen
        self._server = await asyncio.start_server(self._accept, host, port, reuse_address=True)
        if not self._in_neighbours:
            self._accepted.set()
        for peer in self.neighbours(self.local):
            self._writers[peer] = await self._dial(peer)
        await asyncio.wait_for(self._accepted.wait(), CONNECT_SECONDS)
        start = self.placement.start_at
        if self.placement.ready is not None:
            start = await self.placement.ready()
        if start is not None:
            await asyncio.sleep(max(0.0, start - time.time()))
        self.clock.start(start)

    async def _dial(self, peer: int) -> asyncio.StreamWriter:
        host, port = self.placement.peers[peer]
        deadline = time.monotonic() + CONNECT_SECONDS
        while True:
            try:
                _, writer = await asyncio.open_connection(host, port)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"node {self.local}: node {peer} at {host}:{port} did not answer "
                                          f"in {CONNECT_SECONDS:g} s") from None
                await asyncio.sleep(0.05)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(_HELLO.pack(self.local))
        return writer

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (src,) = _HELLO.unpack(await reader.readexactly(_HELLO.size))
        self._accepted_from.add(src)
        if self._in_neighbours <= self._accepted_from:
            self._accepted.set()
        task = asyncio.current_task()
        self._readers.append(task)
        try:
            await self._receive(src, reader)
        finally:
            writer.close()

    # -- carrying -----------------------------------------------------------------
    def transmit(self, src: int, dst: int, kind: str, rnd: int, frame) -> None:
        link = self.links.get((src, dst))
        if link is None or dst not in self._writers:
            return super().transmit(src, dst, kind, rnd, frame)  # the network's own refusal
        now, ledger, nbytes = self.clock.now, self.ledger, len(frame)
        trace = ledger.record(src, dst, kind, rnd, nbytes, now) if ledger.trace is not None else None
        ledger.sent(link.counters, src, rnd, nbytes)
        writer = self._writers[dst]
        if writer.is_closing():
            return self._drop(link, "offline", trace)
        seq = self._sent_seq[dst] = self._sent_seq.get(dst, -1) + 1
        header = msgpack.packb([seq, kind, rnd, now])
        writer.write(_SIZES.pack(nbytes, len(header)) + header)
        writer.write(frame)
        self.framing_bytes += _SIZES.size + len(header)
        if trace is not None:
            trace.fate = "sent"

    async def _receive(self, src: int, reader: asyncio.StreamReader) -> None:
        link = self.links[src, self.local]
        while True:
            try:
                nbytes, header_bytes = _SIZES.unpack(await reader.readexactly(_SIZES.size))
                seq, kind, rnd, t_send = msgpack.unpackb(await reader.readexactly(header_bytes))
                frame = await reader.readexactly(nbytes)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the peer closed its end: it sends no more
            end = self.clock.now
            arrival = max(end + link.latency.sample(link.rng if link.latency.draws else None), link.last_arrival)
            link.last_arrival = arrival
            message = Message(src, self.local, kind, rnd, nbytes, t_send, arrival, frame)
            if arrival > end:
                self.clock.call_at(arrival, self._deliver, link, message)
            else:
                self._deliver(link, message)

    def _deliver(self, link, message: Message) -> None:
        self.ledger.delivered(link.counters, message.dst, message.round, message.size)
        if self.ledger.trace is not None:
            message.trace = TraceRow(message.src, message.dst, message.kind, message.round, message.size,
                                     message.t_send, message.t_arrive, "delivered")
            self.ledger.trace.append(message.trace)
        self.mailboxes[message.dst].put(message)

    async def close(self) -> None:
        """Flush and close the outgoing connections; then read until every in-neighbour has closed."""
        for writer in self._writers.values():
            if writer.can_write_eof():
                writer.write_eof()
        for writer in self._writers.values():
            try:
                await writer.drain()
            except ConnectionError:
                pass
        if self._readers:
            await asyncio.gather(*self._readers, return_exceptions=True)
        held = max((self.links[src, self.local].last_arrival for src in self._accepted_from), default=0.0)
        if held > self.clock.now:  # frames read but held for their latency: delivered first (timers in order)
            await asyncio.sleep(held - self.clock.now)
        for writer in self._writers.values():
            writer.close()
        self._server.close()
