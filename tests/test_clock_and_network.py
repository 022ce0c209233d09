"""The virtual clock, compute offload, topology enforcement and the mailbox."""
import asyncio
import time

import networkx as nx
import pytest

from emulator.clock import DeadlockError
from emulator.network import MessageTooLargeWarning, NotNeighbourError
from tests.conftest import emulate


def test_idle_waiting_costs_no_wall_time(two_nodes):
    seen = {}

    async def run(node):
        await asyncio.sleep(3600 * 1000)  # plain asyncio: a thousand emulated hours
        seen[node.id] = node.now()

    start = time.perf_counter()
    emulate(run, two_nodes)
    # measured 0.4 to 21 ms (the first run in a process the slowest), the machine busy or not
    assert time.perf_counter() - start < 2.0
    assert seen == {0: 3.6e6, 1: 3.6e6}


def test_clock_stands_still_while_compute_runs(two_nodes):
    seen = {}

    def slow_job(seconds):
        time.sleep(seconds)
        return seconds

    async def run(node):
        # Node 0's job takes 10x the wall time of node 1's; both are charged the same.
        result = await node.compute(slow_job, 0.3 if node.id == 0 else 0.03, work=5)
        seen[node.id] = (node.now(), result)

    emulate(run, two_nodes, compute_cost="1ms")
    assert seen == {0: (pytest.approx(0.005), 0.3), 1: (pytest.approx(0.005), 0.03)}


def test_measured_compute_charges_wall_time(two_nodes):
    seen = {}

    def job():
        start = time.perf_counter()
        time.sleep(0.1)
        return time.perf_counter() - start

    async def run(node):
        took = await node.compute(job)
        seen[node.id] = (node.now(), took)

    emulate(run, two_nodes, compute_time="measured", compute_factor=2.0)
    assert len(seen) == 2
    for charged, took in seen.values():
        # factor 2 times the job's wall time, timed around the call: a little over what the job times
        # itself (measured: 1 to 57 us, two busy processes beside it on 2 cores). Charging the wall
        # time unscaled (0.1 s) or scaled twice (0.4 s) falls outside.
        assert 2 * took <= charged < 2 * (took + 0.05)


def test_compute_results_resume_in_a_deterministic_order():
    order = []

    def job(node_id):
        time.sleep(0.02 * (4 - node_id))  # later nodes finish first in wall time
        return node_id

    async def run(node):
        order.append(await node.compute(job, node.id))

    emulate(run, nx.empty_graph(4), workers=4)
    assert order == [0, 1, 2, 3]


def test_stragglers_are_charged_more():
    seen = {}

    async def run(node):
        await node.compute(lambda: None, work=10)
        seen[node.id] = node.now()

    emulate(run, nx.empty_graph(20), compute_cost="1ms", compute_speed="stragglers:fraction=0.5,slowdown=4")
    assert {round(v, 9) for v in seen.values()} == {0.01, 0.04}


def test_compute_errors_reach_the_protocol(two_nodes):
    caught = []

    def broken():
        raise ValueError("boom")

    async def run(node):
        try:
            await node.compute(broken)
        except ValueError as exc:
            caught.append(str(exc))

    emulate(run, two_nodes)
    assert caught == ["boom", "boom"]


def test_send_to_a_non_neighbour_is_refused():
    errors = []

    async def run(node):
        if node.id == 0:
            try:
                node.send(2, "hello")
            except NotNeighbourError as exc:
                errors.append(str(exc))

    emulation = emulate(run, nx.path_graph(3))
    assert errors == ["node 0 cannot send to 2: not a current neighbour in round 0 (neighbours: [1])"]
    assert emulation.ledger.totals()["messages_total"] == 0


def test_a_receive_nobody_answers_is_a_deadlock_not_a_hang(two_nodes):
    async def run(node):
        await node.recv()

    with pytest.raises(DeadlockError, match="every node is waiting and no timer is pending"):
        emulate(run, two_nodes)


def test_receive_times_out_in_emulated_time(two_nodes):
    seen = []

    async def run(node):
        seen.append((await node.recv(timeout=2.5), node.now()))

    emulate(run, two_nodes)
    assert seen == [(None, 2.5), (None, 2.5)]


def test_oversized_message_is_refused_at_send(two_nodes):
    got = []

    async def run(node):
        if node.id == 0:
            node.send(1, "big", b"x" * 5000)
        else:
            got.append(await node.recv(timeout=1.0))

    with pytest.warns(MessageTooLargeWarning, match="exceeds the 1000-byte limit"):
        emulation = emulate(run, two_nodes, max_message_size="1kB")
    assert got == [None]
    totals = emulation.ledger.totals()
    assert totals["dropped_over_limit"] == 1 and totals["bytes_total"] == 0


def test_gather_collects_one_message_per_neighbour_and_keeps_the_rest():
    star = nx.star_graph(3)
    result = {}

    async def run(node):
        async for rnd in node.rounds():
            if node.id == 0 and rnd == 1:
                got = await node.gather("model", peers=[1, 2, 3], timeout=1.0)
                result["got"] = {src: m.body for src, m in got.items()}
                result["t"] = node.now()
                result["other"] = (await node.recv(timeout=0.0)).kind
            elif node.id in (1, 2) and rnd == 0:
                node.send(0, "model", "stale")  # an earlier round's model is discarded
            elif node.id in (1, 2):
                node.send(0, "ping", node.id)
                node.send(0, "model", node.id * 10)
            # node 3 stays silent: gather times out without it

    emulate(run, star, latency="10ms", rounds=2)
    assert result == {"got": {1: 10, 2: 20}, "t": 1.0, "other": "ping"}


def test_plain_asyncio_primitives_work_under_both_clocks(two_nodes):
    for clock in ("virtual", "real"):
        seen = []

        async def run(node):
            event = asyncio.Event()
            queue = asyncio.Queue()
            asyncio.get_running_loop().call_later(0.02, event.set)
            await asyncio.wait_for(event.wait(), timeout=1.0)
            await queue.put(node.id)
            seen.append(await queue.get())
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.sleep(1.0), timeout=0.01)

        emulate(run, two_nodes, clock=clock)
        assert sorted(seen) == [0, 1]


def test_real_clock_runs_in_wall_time_scaled(two_nodes):
    seen = {}

    async def run(node):
        wall, now = time.perf_counter(), node.now()
        await node.sleep(2.0)
        seen[node.id] = (time.perf_counter() - wall, node.now() - now)

    emulate(run, two_nodes, clock="real", time_scale=10.0)
    assert len(seen) == 2
    for wall, emulated in seen.values():
        # libuv's clock ticks in whole milliseconds: a timer may fire up to 1 ms (wall) early
        assert wall >= 2.0 / 10 - 0.002
        # measured: 2.0 to 2.1, and 2.34 (a wake-up 34 ms late) with two busy processes beside it on
        # 2 cores; 6.0 is 400 ms late. A timer that ignored the scale would wake at 20.
        assert 2.0 - 0.02 <= emulated < 6.0
        # emulated time runs at 10 times the wall clock (measured: 9.98 to 10.03); unscaled, at 1
        assert emulated / wall == pytest.approx(10, rel=0.25)
