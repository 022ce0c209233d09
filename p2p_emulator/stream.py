"""A run directory kept current while the run goes: what each closed round settled is on disk.

At every round close: that round's metric rows, the protocol's new stream rows
(graph.jsonl, ...) and the trace rows whose fate is known are appended;
links.csv and availability.jsonl are replaced whole, at most every
REPLACE_SECONDS of wall time and at most 1/REPLACE_SHARE of it (400,000 links
take a second to write). When the run ends, messages.jsonl is replaced by its final version, and so is
metrics.jsonl if a closed round's rows changed since they were written (a
message tagged with a round can still arrive, or turn out corrupt, after that
round closed; a node can log into its last round after it); otherwise the rows
of rounds that never closed are appended. summary.json comes last.
"""
from __future__ import annotations

import time
from dataclasses import asdict

from emulator.emulation import Emulation
from emulator.ledger import RoundCounts
from .analysis.rundir import LINK_COLUMNS, RunDirWriter, csv_writer

REPLACE_SECONDS = 2.0
REPLACE_SHARE = 50


class RunStream:
    def __init__(self, writer: RunDirWriter, emulation: Emulation):
        self.writer, self.emulation = writer, emulation
        self._streamed: dict[str, int] = {}  # node.record stream -> rows on disk
        self._traced = 0  # trace rows on disk
        self._metric_rows = 0  # metrics.jsonl rows on disk
        self._written_counts: dict[int, RoundCounts] = {}  # a closed round's ledger counts when its rows were written
        self._resumed = False
        self._next_replace = time.perf_counter() + REPLACE_SECONDS

    def round_closed(self, rnd: int) -> None:
        self._metric_rows += self.writer.append("metrics.jsonl", self.emulation.recorder.round_rows(rnd))
        self._written_counts[rnd] = self.emulation.ledger.counts(rnd).copy()
        self._append_streams()
        self._append_trace()
        if time.perf_counter() >= self._next_replace:
            self.replace_tables()

    def replace_tables(self) -> None:
        """links.csv and availability.jsonl as they stand now, each replaced whole."""
        emulation, start = self.emulation, time.perf_counter()
        resent = ("bytes_resent",) if emulation.ledger.resent_bytes is not None else ()  # reliable lossy links
        self.writer.replace("links.csv", csv_writer(LINK_COLUMNS + resent, emulation.ledger.link_table()))
        if emulation.availability is not None:
            self.writer.jsonl("availability.jsonl", emulation.availability.rows())
        end = time.perf_counter()
        self._next_replace = end + max(REPLACE_SECONDS, REPLACE_SHARE * (end - start))

    def position(self) -> dict:
        """How many rows of each streamed file are on disk (and the writer's null counts): a checkpoint keeps it."""
        return {"metrics": self._metric_rows, "streams": dict(self._streamed), "traced": self._traced,
                "nulled": self.writer.nulled}

    def resume_at(self, position: dict) -> None:
        """Cut each streamed file back to its rows at the checkpoint (later ones are written again)."""
        self._metric_rows, self._traced = position["metrics"], position["traced"]
        self._resumed = True  # what the rows on disk counted is not known here: finish rewrites them
        self._streamed = dict(position["streams"])
        self.writer.nulled = position["nulled"]
        self.writer.keep_lines("metrics.jsonl", self._metric_rows)
        self.writer.keep_lines("messages.jsonl", self._traced)
        for name, rows in self._streamed.items():
            self.writer.keep_lines(f"{name}.jsonl", rows)

    def finish(self, rows: list[dict], summary: dict) -> None:
        if self._rows_written_are_final():
            self.writer.append("metrics.jsonl", rows[self._metric_rows:])
        else:
            self.writer.jsonl("metrics.jsonl", rows)
        self._append_streams()
        if self.emulation.ledger.trace is not None:
            self.writer.jsonl("messages.jsonl", self.emulation.ledger.trace_rows())
        self.replace_tables()
        self.writer.finish(summary)

    def _rows_written_are_final(self) -> bool:
        """Whether the rows on disk are the final rows' first ones: no closed round's ledger counts,
        metrics or snapshots changed after its rows were written (then rewriting them changes nothing)."""
        if self._resumed or self.emulation.recorder.changed_after_close:
            return False
        ledger = self.emulation.ledger
        return all(ledger.counts(rnd) == counts for rnd, counts in self._written_counts.items())

    def _append_streams(self) -> None:
        for name, rows in self.emulation.recorder.streams.items():
            done = self._streamed.get(name, 0)
            self.writer.append(f"{name}.jsonl", rows[done:])
            self._streamed[name] = len(rows)

    def _append_trace(self) -> None:
        """Trace rows in send order, up to the first message still in flight."""
        trace = self.emulation.ledger.trace
        if trace is None:
            return
        end = self._traced
        while end < len(trace) and trace[end].fate is not None:
            end += 1
        self.writer.append("messages.jsonl", (asdict(row) for row in trace[self._traced:end]))
        self._traced = end
