"""The ledger: every message's exact encoded size, per directed link and per node per round."""
from __future__ import annotations

import csv
import json
from collections import defaultdict

DROP_CAUSES = ("loss", "offline", "corrupt", "over_limit", "link_down")
LINK_COLUMNS = ("src", "dst", "msgs_sent", "msgs_delivered", "msgs_dropped", "bytes_sent",
                "bytes_delivered") + tuple(f"dropped_{cause}" for cause in DROP_CAUSES)
TRACE_COLUMNS = ("src", "dst", "kind", "round", "bytes", "t_send", "t_arrive", "fate")

# Column positions in a link's counter row.
_SENT, _DELIVERED, _DROPPED, _BYTES_SENT, _BYTES_DELIVERED = range(5)
_CAUSE = {cause: 5 + i for i, cause in enumerate(DROP_CAUSES)}
# Per node per round: messages and bytes sent and received.
NODE_ROUND_COLUMNS = ("msgs_sent", "bytes_sent", "msgs_received", "bytes_received")


class Ledger:
    def __init__(self, trace: bool = False):
        self.links: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0] * (5 + len(DROP_CAUSES)))
        self.node_rounds: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        self.trace: list[list] | None = [] if trace else None

    def row(self, src: int, dst: int) -> list[int]:
        """The counters of link src -> dst; links keep a reference so the hot path skips lookups."""
        return self.links[src, dst]

    def sent(self, row: list[int], src: int, rnd: int, nbytes: int) -> None:
        row[_SENT] += 1
        row[_BYTES_SENT] += nbytes
        node = self.node_rounds[src, rnd]
        node[0] += 1
        node[1] += nbytes

    def delivered(self, row: list[int], dst: int, rnd: int, nbytes: int) -> None:
        row[_DELIVERED] += 1
        row[_BYTES_DELIVERED] += nbytes
        node = self.node_rounds[dst, rnd]
        node[2] += 1
        node[3] += nbytes

    def dropped(self, row: list[int], cause: str) -> None:
        row[_DROPPED] += 1
        row[_CAUSE[cause]] += 1

    def record(self, src, dst, kind, rnd, nbytes, t_send) -> list:
        """Start a trace row; the network fills in t_arrive and fate later."""
        row = [src, dst, kind, rnd, nbytes, t_send, None, None]
        self.trace.append(row)
        return row

    def node_round(self, node: int, rnd: int) -> dict[str, int]:
        return dict(zip(NODE_ROUND_COLUMNS, self.node_rounds.get((node, rnd), (0, 0, 0, 0))))

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

    def write_links(self, path) -> None:
        with open(path, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(LINK_COLUMNS)
            for (src, dst), row in sorted(self.links.items()):
                writer.writerow([src, dst, *row])

    def write_trace(self, path) -> None:
        with open(path, "w") as fh:
            for row in self.trace:
                fh.write(json.dumps(dict(zip(TRACE_COLUMNS, row))) + "\n")
