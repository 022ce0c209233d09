"""Clocks: emulated (virtual) time on an asyncio loop, or wall-clock time on uvloop.

Under the virtual clock, `loop.time()` is emulated seconds. When no coroutine is
runnable, the loop does not sleep: it first waits (in wall time) for compute
jobs whose emulated finish time is still unknown, then jumps straight to the
next timer. Compute jobs therefore take no emulated time of their own; what
they are charged is decided by the compute-time model, and their results are
handed back by timers at their emulated finish times, so the order in which
coroutines resume never depends on thread scheduling.

The tie rule. Two kinds of things are due at an instant: clock events
(`schedule`: message arrivals, compute results, nodes going down or up) and loop
timers (`call_at`: `node.sleep`, the deadline of `recv`/`gather`, asyncio.sleep).
At one instant every due event runs before any due timer, and the coroutines the
events wake resume before the timers fire; events run in the order they were
scheduled, timers in the order they were set. So a message that arrives exactly
at a receive's deadline is received, and a node that sleeps until the instant a
result is due finds it there.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import heapq
import itertools
import selectors
import time
from collections import deque
from typing import Any, Callable, Coroutine


# How long an idle loop waits for a thread outside the compute executor (e.g. a plain
# loop.run_in_executor) to hand something back, before it calls the run deadlocked.
_THREAD_GRACE = 1.0


class DeadlockError(RuntimeError):
    """Every coroutine waits, and nothing (timer or job) can wake any of them."""


class _Job:
    __slots__ = ("future", "submitted", "factor", "waiter")

    def __init__(self, future, submitted, factor, waiter):
        self.future, self.submitted, self.factor, self.waiter = future, submitted, factor, waiter


class _VirtualSelector:
    """A selector that never blocks on timers: it asks the clock to jump instead."""

    def __init__(self, clock: "VirtualClock"):
        self._real = selectors.DefaultSelector()
        self._clock = clock

    def select(self, timeout=None):
        # Emulation needs no file descriptors: poll them only when nothing else can happen.
        if timeout == 0:
            return []
        if self._clock._advance():
            return []
        events = self._real.select(_THREAD_GRACE)
        if not events:
            raise DeadlockError("every node is waiting and no timer is pending "
                                "(a receive without a timeout on a peer that never sends?)")
        return events

    def __getattr__(self, name):
        return getattr(self._real, name)




class _ReadyHandle(asyncio.Handle):
    """A Handle made without asyncio's debug-mode bookkeeping: every wake of a node makes one."""
    __slots__ = ()

    def __init__(self, callback, args, loop, context):
        self._context = contextvars.copy_context() if context is None else context
        self._loop, self._callback, self._args = loop, callback, args
        self._cancelled, self._repr, self._source_traceback = False, None, None


class _VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: "VirtualClock"):
        self._clock = self.clock = clock
        self._order = itertools.count()
        super().__init__(_VirtualSelector(clock))

    def call_soon(self, callback, *args, context=None):
        if self._debug:
            return super().call_soon(callback, *args, context=context)
        self._check_closed()
        handle = _ReadyHandle(callback, args, self, context)
        self._ready.append(handle)
        return handle

    def call_at(self, when, callback, *args, context=None):
        self._check_closed()
        timer = asyncio.TimerHandle(when, callback, args, self, context)
        # The heap holds (when, order set, timer): timers due at one instant fire in the order they were set,
        # so runs are reproducible; tuples compare in C, a timer's own __lt__ would be a Python call per comparison.
        heapq.heappush(self._scheduled, (when, next(self._order), timer))
        timer._scheduled = True
        return timer

    def time(self) -> float:
        return self._clock.now

    def _run_once(self):
        """asyncio's iteration less what emulated time never needs: no timeout to work out, and no
        selector call while callbacks are ready (the selector is where the clock jumps)."""
        scheduled, ready = self._scheduled, self._ready
        if len(scheduled) > 100 and self._timer_cancelled_count * 2 > len(scheduled):
            kept = []  # over half the timers are cancelled: drop them all, as asyncio does
            for entry in scheduled:
                if entry[2]._cancelled:
                    entry[2]._scheduled = False
                else:
                    kept.append(entry)
            heapq.heapify(kept)
            self._scheduled = scheduled = kept
            self._timer_cancelled_count = 0
        if not ready and not self._stopping:
            self._process_events(self._selector.select(None))
        now = self._clock.now
        while scheduled and scheduled[0][0] <= now:  # timers due now (cancelled ones are skipped below)
            timer = heapq.heappop(scheduled)[2]
            timer._scheduled = False
            ready.append(timer)
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()


class VirtualClock:
    """Emulated time: idle waiting costs no wall time; compute is charged, not timed."""

    name = "virtual"

    def __init__(self):
        self.now = 0.0
        self._unsettled: deque[_Job] = deque()
        # Uncancellable events (deliveries, job results), far cheaper than loop timers: one list per
        # instant, in scheduling order, and a heap of the instants. A round's messages often all land
        # at one instant: they cost an append each, not a heap push and pop.
        self._instants: list[float] = []
        self._due: dict[float, list[tuple]] = {}
        self._idle: deque[tuple] = deque()
        self.loop = _VirtualLoop(self)

    def run(self, coro: Coroutine) -> Any:
        try:
            return self.loop.run_until_complete(coro)
        finally:
            self.loop.close()

    def call_at(self, when: float, callback: Callable, *args) -> asyncio.TimerHandle:
        """A cancellable timer at emulated time `when`."""
        return self.loop.call_at(when, callback, *args)

    def schedule(self, when: float, callback: Callable, *args) -> None:
        """Run callback(*args) at emulated time `when`; events due together run in scheduling order."""
        due = self._due.get(when)
        if due is None:
            due = self._due[when] = []
            heapq.heappush(self._instants, when)
        due.append((callback, args))

    def pending(self) -> list[tuple[float, Callable, tuple]]:
        """The events still to run, as (when, callback, args), in the order they will run."""
        return [(when, callback, args) for when in sorted(self._due) for callback, args in self._due[when]]

    def state(self) -> dict:
        """Its time, as plain data; the events still due are their schedulers' to save (they know what the
        callbacks are)."""
        return {"now": self.now}

    def load_state(self, state: dict) -> None:
        self.now = state["now"]

    def when_idle(self, callback: Callable, *args) -> None:
        """Run callback(*args) once nothing else is due at this instant (no coroutine ready, no event or timer
        due now), before time moves on: a checkpoint's moment."""
        self._idle.append((callback, args))

    def submit(self, job: concurrent.futures.Future, charged: float | None, factor: float = 1.0) -> asyncio.Future:
        """A started job's (result, wall seconds), resolved at now + charged emulated seconds.

        With charged=None the job is charged its measured wall time times `factor`.
        """
        waiter = self.loop.create_future()
        job = _Job(job, self.now, factor, waiter)
        if charged is None:
            self._unsettled.append(job)
        else:
            self.schedule(self.now + charged, self._resolve, job)
        return waiter

    def _resolve(self, job: _Job) -> None:
        # Blocks in wall time if the job is still running: the clock stands still meanwhile.
        try:
            result, _ = job.future.result()
        except BaseException as exc:  # handed to the awaiting coroutine
            if not job.waiter.done():
                job.waiter.set_exception(exc)
            return
        if not job.waiter.done():
            job.waiter.set_result(result)

    def _settle(self) -> None:
        """Jobs with a measured cost get their finish timer once they have finished."""
        while self._unsettled:
            job = self._unsettled.popleft()
            try:
                _, wall = job.future.result()
            except BaseException:
                wall = 0.0
            self.schedule(job.submitted + wall * job.factor, self._resolve, job)

    def _advance(self) -> bool:
        """Jump to the next event or timer; False when there is none."""
        if self._unsettled:
            self._settle()
        scheduled = self.loop._scheduled  # (when, order, timer)
        while scheduled and scheduled[0][2]._cancelled:
            heapq.heappop(scheduled)[2]._scheduled = False
        instants = self._instants
        if self._idle and not self.loop._ready and not (instants and instants[0] <= self.now) and not (
                scheduled and scheduled[0][0] <= self.now):
            callback, args = self._idle.popleft()
            callback(*args)
        elif instants and (not scheduled or instants[0] <= scheduled[0][0]):
            self.now = max(self.now, instants[0])
            while instants and instants[0] <= self.now:
                # Events scheduled for this instant while it runs go to a list of their own, run next.
                for callback, args in self._due.pop(heapq.heappop(instants)):
                    callback(*args)
        elif scheduled:
            self.now = max(self.now, scheduled[0][0])
        else:
            return bool(self.loop._ready or self.loop._stopping)
        return True


class RealClock:
    """Wall-clock time on uvloop; `scale` emulated seconds pass per wall second."""

    name = "real"

    def __init__(self, scale: float = 1.0):
        import uvloop

        self.scale = scale
        self.loop = uvloop.new_event_loop()
        self._origin = self.loop.time()

    @property
    def now(self) -> float:
        return (self.loop.time() - self._origin) * self.scale

    def run(self, coro: Coroutine) -> Any:
        try:
            self._origin = self.loop.time()
            return self.loop.run_until_complete(coro)
        finally:
            self.loop.close()

    def start(self, wall: float | None = None) -> None:
        """Make this instant time zero, or the wall instant `wall` (seconds since the epoch): processes given
        one such instant share their time axis."""
        self._origin = self.loop.time() - (0.0 if wall is None else time.time() - wall)

    def call_at(self, when: float, callback: Callable, *args) -> asyncio.TimerHandle:
        return self.loop.call_at(self._origin + when / self.scale, callback, *args)

    schedule = call_at

    def submit(self, job: concurrent.futures.Future, charged: float | None, factor: float = 1.0) -> asyncio.Future:
        return asyncio.ensure_future(self._job(job, charged, factor), loop=self.loop)

    async def _job(self, job, charged, factor):
        start = self.now
        result, wall = await asyncio.wrap_future(job, loop=self.loop)
        # A job charged more than it took waits out the rest, so stragglers stay slow.
        cost = wall * factor if charged is None else charged
        remaining = (start + cost - self.now) / self.scale
        if remaining > 0:
            await asyncio.sleep(remaining)
        return result


async def sleep(clock, seconds: float) -> None:
    """Wait `seconds` of the clock's time (a loop timer: see the tie rule in the module doc)."""
    waiter = clock.loop.create_future()
    handle = clock.call_at(clock.now + seconds, _wake, waiter)
    try:
        await waiter
    finally:
        handle.cancel()


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
