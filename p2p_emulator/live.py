"""The live view of a sweep: runs done, running (with their round), queued and failed, and the time left.

On a terminal it is a rich table redrawn in place; otherwise one line per finished run.
"""
from __future__ import annotations

import time
from typing import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .runners import Job, Outcome


def duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class StudyView:
    """What the sweep has done and is doing; `rounds` tells how far each running run is."""

    def __init__(self, console: Console, total: int, skipped: int, queued: int, slots: int,
                 rounds: Callable[[], dict[str, int]]):
        self.console, self.total, self.skipped, self.queued, self.slots = console, total, skipped, queued, slots
        self.rounds = rounds
        self.done = 0
        self.failed: list[Outcome] = []
        self.running: dict[str, Job] = {}
        self.walls: list[float] = []  # seconds of each run this sweep finished
        self.live = Live(self, console=console, refresh_per_second=2, transient=False) \
            if console.is_terminal else None

    def __enter__(self) -> "StudyView":
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def started(self, job: Job) -> None:
        self.running[job.name] = job
        self.queued -= 1

    def finished(self, outcome: Outcome) -> None:
        job = self.running.pop(outcome.name)
        wall = time.monotonic() - job.started
        self.walls.append(wall)
        if outcome.status:
            self.failed.append(outcome)
        else:
            self.done += 1
        count = self.skipped + self.done + len(self.failed)
        state = "done" if not outcome.status else f"[red]failed: {escape(outcome.error)}[/]"
        line = f"[{count}/{self.total}] {outcome.name} {state} ({duration(wall)})"
        if self.live:
            self.live.console.print(line, highlight=False)
        else:
            self.console.print(line, highlight=False, soft_wrap=True)

    def time_left(self) -> float | None:
        """Mean run time so far times the work left, spread over the slots; None before any run has finished."""
        if not self.walls:
            return None
        mean = sum(self.walls) / len(self.walls)
        now = time.monotonic()
        running = sum(max(0.0, mean - (now - job.started)) for job in list(self.running.values()))
        return (self.queued * mean + running) / min(self.slots, max(1, self.queued + len(self.running)))

    def __rich__(self) -> Group:
        closed = self.rounds()
        table = Table(box=None, show_header=False, pad_edge=False)
        for name, job in list(self.running.items()):  # list: the sweep's thread adds and removes runs
            table.add_row(f"  {name}", f"round {closed.get(name, 0)}/{job.rounds}",
                          duration(time.monotonic() - job.started))
        left = self.time_left()
        head = Text(f"sweep: {self.skipped + self.done} done, {len(self.running)} running, {self.queued} queued, "
                    f"{len(self.failed)} failed of {self.total}"
                    + (f"; about {duration(left)} left" if left is not None else ""), style="bold")
        return Group(head, table)
