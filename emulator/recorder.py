"""The recorder: each node's metric rows per round, the observer's metrics, and extra streams."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterator

from .ledger import Ledger


class Recorder:
    """Per node per round metric rows, observer metrics, and extra jsonl streams.

    A round closes (observer, progress) when every node still alive has finished it;
    a crashed node's unfinished round leaves no row and no snapshot.
    """

    def __init__(self, num_nodes: int, ledger: Ledger, observe: Callable, on_round: Callable):
        self.num_nodes, self.ledger, self.observe, self.on_round = num_nodes, ledger, observe, on_round
        self.rows: dict[tuple[int, int], dict] = {}
        self.snapshots: dict[int, dict[int, Any]] = defaultdict(dict)
        self.finished: dict[int, int] = defaultdict(int)  # open round -> live nodes that finished it
        self.done_through = [-1] * num_nodes  # each node's last finished round
        self.alive = num_nodes
        self.streams: dict[str, list[dict]] = defaultdict(list)
        self.closed_through = -1  # the last round closed
        self.changed_after_close = False  # a closed round's row got a metric or snapshot later

    def _row(self, node: int, rnd: int) -> dict:
        row = self.rows.get((rnd, node))
        if row is None:
            row = self.rows[rnd, node] = {"round": rnd, "node": node}
        return row

    def log(self, node: int, rnd: int, metrics: dict) -> None:
        self._row(node, rnd).update(metrics)
        if rnd <= self.closed_through:
            self.changed_after_close = True

    def snapshot(self, node: int, rnd: int, state: Any) -> None:
        self.snapshots[rnd][node] = state
        if rnd <= self.closed_through:
            self.changed_after_close = True

    def record(self, stream: str, row: dict) -> None:
        self.streams[stream].append(row)

    def end_round(self, node: int, rnd: int, now: float) -> None:
        self._row(node, rnd)["t"] = now
        self.done_through[node] = rnd
        self.finished[rnd] += 1
        if self.finished[rnd] == self.alive:
            self._close(rnd, now)

    def crash(self, node: int, now: float) -> None:
        """Forget the node's unfinished rounds and close the rounds that waited only for it."""
        done = self.done_through[node]
        for rnd, _ in [key for key in self.rows if key[1] == node and key[0] > done]:
            del self.rows[rnd, node]
        for rnd in [rnd for rnd in self.snapshots if rnd > done]:
            self.snapshots[rnd].pop(node, None)
        self.retire(node, now)

    def retire(self, node: int, now: float) -> None:
        """The node runs no more rounds (it crashed, or stopped at --duration): close the rounds that waited
        only for it."""
        done = self.done_through[node]
        self.alive -= 1
        for rnd in sorted(self.finished):
            if rnd <= done:
                self.finished[rnd] -= 1
            if self.finished[rnd] == self.alive:
                self._close(rnd, now)

    def _close(self, rnd: int, now: float) -> None:
        del self.finished[rnd]
        self.closed_through = max(self.closed_through, rnd)
        self._observe(rnd)
        self.on_round(rnd, now)

    def _observe(self, rnd: int) -> None:
        snapshots = self.snapshots.pop(rnd, None)
        if snapshots:
            for node, metrics in self.observe(rnd, snapshots).items():
                self._row(node, rnd).update(metrics)

    def round_rows(self, rnd: int) -> Iterator[dict]:
        """A closed round's rows in node order, with each node's ledger totals for the round so far
        (made one at a time: a million nodes' copies at once would cost a gigabyte)."""
        rows = (self.rows.get((rnd, node)) for node in range(self.num_nodes))
        return ({**row, **self.ledger.node_round(row["node"], rnd)} for row in rows if row is not None)

    def state(self) -> dict:
        """Its rows so far, each node's last finished round, the live nodes and its streams, as plain data."""
        return {"rows": [[rnd, node, row] for (rnd, node), row in self.rows.items()],
                "done_through": list(self.done_through), "alive": self.alive, "streams": dict(self.streams)}

    def load_state(self, state: dict) -> None:
        """Put state()'s data back (a resumed run, before any node starts)."""
        self.rows = {(rnd, node): row for rnd, node, row in state["rows"]}
        self.done_through[:] = state["done_through"]
        self.alive = state["alive"]
        self.streams.clear()
        self.streams.update(state["streams"])

    def finish(self, now: float) -> list[dict]:
        """Rows in (round, node) order, with each node's ledger totals for the round.

        A row whose round never closed (e.g. --rounds 0) is stamped with the end time.
        """
        for rnd in list(self.snapshots):
            self._observe(rnd)
        # Round by round, node by node: sorting a million (round, node) keys takes seconds.
        in_order = (self.rows.get((rnd, node)) for rnd in sorted({rnd for rnd, _ in self.rows})
                    for node in range(self.num_nodes))
        rows = [row for row in in_order if row is not None]
        for row in rows:
            row.setdefault("t", now)
            row.update(self.ledger.node_round(row["node"], row["round"]))
        return rows
