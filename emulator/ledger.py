"""The ledger: every message's exact encoded size, per directed link and per node per round."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Iterator

DROP_CAUSES = ("loss", "offline", "corrupt", "over_limit", "link_down", "invalid")
# A link's counters, in the order of its row.
LINK_COUNTERS = ("msgs_sent", "msgs_delivered", "msgs_dropped", "bytes_sent",
                 "bytes_delivered") + tuple(f"dropped_{cause}" for cause in DROP_CAUSES)

# Positions in a link's counter row: a plain list, as the hot path updates it on every message.
_SENT, _DELIVERED, _DROPPED, _BYTES_SENT, _BYTES_DELIVERED = range(5)
_CAUSE = {cause: 5 + i for i, cause in enumerate(DROP_CAUSES)}


@dataclass(slots=True)
class NodeRound:
    """What one node sent and received in one round (messages tagged with that round)."""
    msgs_sent: int = 0
    bytes_sent: int = 0
    msgs_received: int = 0
    bytes_received: int = 0


_NO_TRAFFIC = NodeRound()


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
        self.links: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0] * len(LINK_COUNTERS))
        self.node_rounds: dict[tuple[int, int], NodeRound] = defaultdict(NodeRound)
        self.trace: list[TraceRow] | None = [] if trace else None

    def row(self, src: int, dst: int) -> list[int]:
        """The counters of link src -> dst; links keep a reference so the hot path skips lookups."""
        return self.links[src, dst]

    def sent(self, row: list[int], src: int, rnd: int, nbytes: int) -> None:
        row[_SENT] += 1
        row[_BYTES_SENT] += nbytes
        node = self.node_rounds[src, rnd]
        node.msgs_sent += 1
        node.bytes_sent += nbytes

    def delivered(self, row: list[int], dst: int, rnd: int, nbytes: int) -> None:
        row[_DELIVERED] += 1
        row[_BYTES_DELIVERED] += nbytes
        node = self.node_rounds[dst, rnd]
        node.msgs_received += 1
        node.bytes_received += nbytes

    def refused(self, row: list[int], dst: int, rnd: int, nbytes: int, cause: str) -> None:
        """A delivered message its receiver could not use: counted as a drop instead (corrupt: it did
        not decode; invalid: its protocol's check of the body failed)."""
        row[_DELIVERED] -= 1
        row[_BYTES_DELIVERED] -= nbytes
        node = self.node_rounds[dst, rnd]
        node.msgs_received -= 1
        node.bytes_received -= nbytes
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
        counts = self.node_rounds.get((node, rnd), _NO_TRAFFIC)
        return {name: getattr(counts, name) for name in NodeRound.__slots__}  # asdict's deep copy is slow

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
        return out

    def link_rows(self) -> Iterator[dict]:
        """One row per directed link, in (src, dst) order: src, dst and its counters by name."""
        for (src, dst), row in sorted(self.links.items()):
            yield {"src": src, "dst": dst, **dict(zip(LINK_COUNTERS, row))}

    def trace_rows(self) -> Iterator[dict]:
        return (asdict(row) for row in self.trace)
