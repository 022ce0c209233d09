"""The emulator's async pieces driven directly from async tests on the virtual clock (see conftest)."""
import asyncio

import networkx as nx
import pytest

from tests.conftest import network, nodes


@pytest.mark.asyncio
async def test_a_message_arrives_after_latency_plus_transmission_and_the_next_waits_behind_it(clock):
    sender, receiver = nodes(network(clock, nx.path_graph(2), latency="10ms", bandwidth=8e6))  # 1 byte per microsecond
    sender.send(1, "x", bytes(1000))
    sender.send(1, "x", bytes(1000))
    first = await receiver.recv()
    assert clock.now == first.t_arrive == 0.010 + first.size * 1e-6
    second = await receiver.recv()
    assert second.t_arrive == pytest.approx(0.010 + 2 * first.size * 1e-6, abs=1e-12)
    assert receiver.now() == second.t_arrive


@pytest.mark.asyncio
async def test_a_message_due_at_a_receive_deadline_is_received(clock):
    sender, receiver = nodes(network(clock, nx.path_graph(2), latency="1s"))
    sender.send(1, "x", 7)
    message = await receiver.recv(timeout=1.0)  # deadline and arrival both at t = 1 s: the event wins
    assert message is not None and message.body == 7 and clock.now == 1.0


@pytest.mark.asyncio
async def test_at_one_instant_events_run_before_timers(clock):
    order = []
    clock.call_at(2.0, order.append, "timer set first")
    clock.schedule(2.0, order.append, "event scheduled later")
    clock.schedule(2.0, order.append, "second event")
    await asyncio.sleep(3.0)
    assert order == ["event scheduled later", "second event", "timer set first"]


@pytest.mark.asyncio
async def test_a_node_that_sleeps_until_an_arrival_finds_the_message_there(clock):
    sender, receiver = nodes(network(clock, nx.path_graph(2), latency="500ms"))
    await receiver.sleep(0.2)
    sender.send(1, "x", "hello")  # arrives at 0.7 s
    await receiver.sleep(0.5)
    assert clock.now == 0.7 and (await receiver.recv(timeout=0)).body == "hello"


@pytest.mark.asyncio
async def test_compute_is_charged_by_the_model_not_by_its_wall_time(clock):
    node, _ = nodes(network(clock, nx.path_graph(2)), compute_cost=0.002)
    assert await node.compute(sum, [1, 2, 3], work=5) == 6
    assert clock.now == pytest.approx(0.010)


class _Box:
    def __init__(self, items):
        self.items = items


def _append(box, item):
    box.items.append(item)
    return len(box.items)


@pytest.mark.asyncio
async def test_a_job_gets_the_object_a_handle_names_and_can_leave_its_result_where_it_ran(clock):
    node, _ = nodes(network(clock, nx.path_graph(2)), compute_cost=0.001)
    box = node.keep(_Box([1, 2]))
    assert await node.compute(_append, box, 3, work=0) == 3  # the job changed the kept object itself
    assert await node.compute(len, box.items, work=0) == 3  # handle.attr names the attribute
    kept = await node.compute(_Box, [7], work=2, keep=True)
    assert clock.now == pytest.approx(0.002) and await node.compute(len, kept.items, work=0) == 1
    assert len(node.keep(list(range(5)))) == 5


@pytest.mark.asyncio
async def test_a_job_on_another_nodes_handle_is_refused(clock):
    first, second = nodes(network(clock, nx.path_graph(2)))
    theirs = second.keep([1, 2, 3])
    with pytest.raises(ValueError, match="node 0: a job got node 1's"):
        await first.compute(len, theirs)


@pytest.mark.asyncio
async def test_corrupt_bytes_are_dropped_and_counted(clock):
    net = network(clock, nx.path_graph(2))
    sender, receiver = nodes(net)
    net.transmit(0, 1, "x", 0, b"\xc1garbage")  # 0xc1 is never valid msgpack
    sender.send(1, "ok", 1)
    assert (await receiver.recv(timeout=1.0)).kind == "ok"
    assert await receiver.recv(timeout=1.0) is None
    assert net.ledger.totals()["dropped_corrupt"] == 1


@pytest.mark.asyncio
async def test_gather_waits_for_the_round_and_keeps_other_kinds(clock):
    net = network(clock, nx.star_graph(2), latency="10ms")
    hub, *leaves = nodes(net)
    for leaf in leaves:
        leaf.send(0, "ping", leaf.id)
        leaf.send(0, "model", leaf.id * 10)
    got = await hub.gather("model", timeout=1.0)
    assert {src: m.body for src, m in got.items()} == {1: 10, 2: 20} and clock.now == 0.010
    assert [(await hub.recv(timeout=0)).body for _ in leaves] == [1, 2]
