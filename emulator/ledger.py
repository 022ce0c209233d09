"""The ledger: every message's exact encoded size, per directed link and per node per round."""
from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass
from typing import Iterator

DROP_CAUSES = ("loss", "offline", "corrupt", "over_limit", "link_down", "invalid")
# A link's counters, in the order of its row.
LINK_COUNTERS = ("msgs_sent", "msgs_delivered", "msgs_dropped", "bytes_sent",
                 "bytes_delivered") + tuple(f"dropped_{cause}" for cause in DROP_CAUSES)

# Positions in a link's counter row: a plain list, as the hot path updates it on every message.
_SENT, _DELIVERED, _DROPPED, _BYTES_SENT, _BYTES_DELIVERED = range(5)
_CAUSE = {cause: 5 + i for i, cause in enumerate(DROP_CAUSES)}


# What a node sent and received in a round (messages tagged with that round), in metric-row order.
NODE_ROUND_COUNTERS = ("msgs_sent", "bytes_sent", "msgs_received", "bytes_received")


class RoundCounts:
    """One round's NODE_ROUND_COUNTERS for every node: four arrays of 64-bit ints, 32 bytes a node
    (a dict of small objects per node and round costs ~1.4 KB, too much at a million nodes)."""
    __slots__ = ("msgs_sent", "bytes_sent", "msgs_received", "bytes_received")

    def __init__(self, num_nodes: int):
        zeros = array("q", bytes(8 * num_nodes))
        self.msgs_sent, self.bytes_sent, self.msgs_received, self.bytes_received = (
            zeros, array("q", zeros), array("q", zeros), array("q", zeros))

    def of(self, node: int) -> list[int]:
        return [self.msgs_sent[node], self.bytes_sent[node], self.msgs_received[node], self.bytes_received[node]]

    def copy(self) -> RoundCounts:
        copied = RoundCounts(0)
        for counter in self.__slots__:
            setattr(copied, counter, array("q", getattr(self, counter)))
        return copied

    def __eq__(self, other) -> bool:
        return isinstance(other, RoundCounts) and all(
            getattr(self, counter) == getattr(other, counter) for counter in self.__slots__)

    def put(self, node: int, values: list[int]) -> None:
        self.msgs_sent[node], self.bytes_sent[node], self.msgs_received[node], self.bytes_received[node] = values


@dataclass(slots=True)
class TraceRow:
    """One message of messages.jsonl; the network fills in t_arrive and fate later."""
    src: int
    dst: int
    kind: str
    round: int
    bytes: int
    t_send: float
    t_arrive: float | None = None
    fate: str | None = None


class Ledger:
    def __init__(self, trace: bool = False):
        self.links: dict[tuple[int, int], list[int]] = {}
        self.num_nodes = 0  # set by the network that carries the messages
        self.rounds: dict[int, RoundCounts] = {}  # round -> every node's counts for it
        self.trace: list[TraceRow] | None = [] if trace else None
        self.wire_bytes: int | None = None  # payload and headers on the wire, where a network counts them
        self.resent_bytes: dict[tuple[int, int], int] | None = None  # per link: payload sent again (reliable loss)

    def count_wire_bytes(self) -> None:
        """Total the bytes on the wire too (a network with a link overhead adds to wire_bytes)."""
        self.wire_bytes = 0

    def count_resent_bytes(self) -> None:
        """Count, per link, the payload bytes a reliable transport sends again (a lossy link under it adds them)."""
        if self.resent_bytes is None:
            self.resent_bytes = {}

    def resent(self, link, nbytes: int) -> None:
        key = (link.src, link.dst)
        self.resent_bytes[key] = self.resent_bytes.get(key, 0) + nbytes

    def state(self) -> dict:
        """Its per node and round counts (the nonzero ones) and its trace, as plain data; the per link
        counters are the links' to save (each holds its row)."""
        return {"node_rounds": [[node, rnd, *counts.of(node)] for rnd, counts in self.rounds.items()
                                for node in range(self.num_nodes) if any(counts.of(node))],
                "trace": None if self.trace is None else [
                    [r.src, r.dst, r.kind, r.round, r.bytes, r.t_send, r.t_arrive, r.fate] for r in self.trace],
                **({"wire_bytes": self.wire_bytes} if self.wire_bytes is not None else {}),
                **({"resent_bytes": [[*key, n] for key, n in sorted(self.resent_bytes.items())]}
                   if self.resent_bytes is not None else {})}

    def load_state(self, state: dict) -> None:
        self.rounds.clear()
        for node, rnd, *counts in state["node_rounds"]:
            self.counts(rnd).put(node, counts)
        if state["trace"] is not None:
            self.trace[:] = [TraceRow(*row) for row in state["trace"]]
        self.wire_bytes = state.get("wire_bytes")  # counted only with a link overhead
        if "resent_bytes" in state:  # counted only on reliable lossy links
            self.resent_bytes = {(src, dst): n for src, dst, n in state["resent_bytes"]}

    def row(self, key: tuple[int, int]) -> list[int]:
        """The counters of link key = (src, dst); links keep a reference so the hot path skips lookups."""
        row = self.links.get(key)
        if row is None:
            row = self.links[key] = [0] * len(LINK_COUNTERS)
        return row

    def counts(self, rnd: int) -> RoundCounts:
        """Every node's counts for round rnd (zeros for a round nobody used yet)."""
        counts = self.rounds.get(rnd)
        if counts is None:
            counts = self.rounds[rnd] = RoundCounts(self.num_nodes)
        return counts

    def sent(self, row: list[int], src: int, rnd: int, nbytes: int) -> None:
        row[_SENT] += 1
        row[_BYTES_SENT] += nbytes
        counts = self.rounds.get(rnd) or self.counts(rnd)
        counts.msgs_sent[src] += 1
        counts.bytes_sent[src] += nbytes

    def delivered(self, row: list[int], dst: int, rnd: int, nbytes: int) -> None:
        row[_DELIVERED] += 1
        row[_BYTES_DELIVERED] += nbytes
        counts = self.rounds.get(rnd) or self.counts(rnd)
        counts.msgs_received[dst] += 1
        counts.bytes_received[dst] += nbytes

    def refused(self, row: list[int], dst: int, rnd: int, nbytes: int, cause: str) -> None:
        """A delivered message its receiver could not use: counted as a drop instead (corrupt: it did
        not decode; invalid: its protocol's check of the body failed)."""
        row[_DELIVERED] -= 1
        row[_BYTES_DELIVERED] -= nbytes
        counts = self.counts(rnd)
        counts.msgs_received[dst] -= 1
        counts.bytes_received[dst] -= nbytes
        self.dropped(row, cause)

    def dropped(self, row: list[int], cause: str) -> None:
        row[_DROPPED] += 1
        row[_CAUSE[cause]] += 1

    def record(self, src, dst, kind, rnd, nbytes, t_send) -> TraceRow:
        """Start a trace row for a message sent now."""
        row = TraceRow(src, dst, kind, rnd, nbytes, t_send)
        self.trace.append(row)
        return row

    def node_round(self, node: int, rnd: int) -> dict[str, int]:
        counts = self.rounds.get(rnd)
        return dict(zip(NODE_ROUND_COUNTERS, counts.of(node) if counts is not None else (0, 0, 0, 0)))

    def node_traffic(self) -> tuple[list[int], list[int]]:
        """Each node's bytes sent and bytes received (delivered to it) so far, over all its links."""
        sent, received = [0] * self.num_nodes, [0] * self.num_nodes
        for (src, dst), row in self.links.items():
            sent[src] += row[_BYTES_SENT]
            received[dst] += row[_BYTES_DELIVERED]
        return sent, received

    @property
    def bytes_total(self) -> int:
        return sum(row[_BYTES_SENT] for row in self.links.values())

    @property
    def messages_total(self) -> int:
        return sum(row[_SENT] for row in self.links.values())

    def totals(self) -> dict[str, int]:
        rows = self.links.values()
        out = {"messages_total": sum(r[_SENT] for r in rows),
               "messages_delivered": sum(r[_DELIVERED] for r in rows),
               "bytes_total": sum(r[_BYTES_SENT] for r in rows),
               "bytes_delivered": sum(r[_BYTES_DELIVERED] for r in rows)}
        out.update({f"dropped_{c}": sum(r[i] for r in rows) for c, i in _CAUSE.items()})
        if self.wire_bytes is not None:
            out["wire_bytes"] = self.wire_bytes
        if self.resent_bytes is not None:
            out["bytes_resent"] = sum(self.resent_bytes.values())
        return out

    def link_table(self) -> Iterator[list[int]]:
        """One row per directed link, in (src, dst) order: [src, dst, *counters] (LINK_COUNTERS' order), and the
        payload bytes it sent again where those are counted."""
        resent = self.resent_bytes
        if resent is None:
            return ([*key, *self.links[key]] for key in sorted(self.links))
        return ([*key, *self.links[key], resent.get(key, 0)] for key in sorted(self.links))

    def trace_rows(self) -> Iterator[dict]:
        return (asdict(row) for row in self.trace)
