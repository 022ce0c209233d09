"""Emulated time as an axis of every run: --duration, the clock-driven sampler (--eval-every-seconds),
node.serve beside a node's own loop, and each node's compute, idle and send seconds."""
import asyncio
import json
import math

import networkx as nx
import pytest

from p2p_emulator import run
from tests.conftest import assert_refused, emulate, network, nodes

QUIET = dict(quiet=True, no_plots=True)
# per-sample compute (1 ms a training sample): runs long enough to take several samples
DPSGD = dict(protocol="dpsgd", topology="ring", nodes=6, model="mlp:hidden=16", latency="10ms",
             compute_time="per-sample")


def _lines(path):
    return path.read_text().splitlines()


# -- --duration --------------------------------------------------------------------------

async def _round_of_one_second(node):
    async for _ in node.rounds():
        await node.sleep(1.0)


@pytest.mark.parametrize("duration, rounds_started", [(3.0, 3), (3.5, 4), (0.5, 1)])
def test_no_round_starts_after_the_duration(duration, rounds_started):
    emulation = emulate(_round_of_one_second, nx.path_graph(3), duration=duration)
    assert emulation.clock.now == rounds_started  # the round under way at the horizon finishes
    assert sorted({row["round"] for row in emulation.rows}) == list(range(rounds_started))


def test_with_rounds_and_duration_whichever_comes_first():
    assert emulate(_round_of_one_second, nx.path_graph(2), duration=10.0, rounds=4).clock.now == 4
    assert emulate(_round_of_one_second, nx.path_graph(2), duration=2.0, rounds=4).clock.now == 2


def test_a_synchronous_run_to_a_duration_reports_the_rounds_it_ran(tmp_path):
    result = run(**QUIET, protocol="push-sum", topology="ring", nodes=8, duration=0.1, latency="10ms",
                 out=str(tmp_path / "r"))
    assert result.summary["rounds"] == 10  # a round of push-sum is one 10 ms hop
    assert max(row["round"] for row in result.metrics) == 9
    assert result.summary["final"]["estimate"] == pytest.approx(3.5, abs=0.5)


def test_an_asynchronous_protocol_needs_a_duration(capsys, tmp_path, monkeypatch):
    from protocols.push_sum import PushSum

    monkeypatch.setattr(PushSum, "asynchronous", True)
    assert_refused(capsys, ["--protocol", "push-sum", "--nodes", "4"], "--duration", tmp_path / "r")


@pytest.mark.parametrize("argv, named", [
    (["--duration", "-1"], "--duration"),
    (["--eval-every-seconds", "-0.5"], "--eval-every-seconds"),
    (["--duration", "5", "--checkpoint-every", "2", "--protocol", "push-sum"], "--duration"),
])
def test_bad_time_settings_are_refused_in_one_line(capsys, tmp_path, argv, named):
    assert_refused(capsys, ["--nodes", "4", *argv], named, tmp_path / "r")


# -- the clock-driven sampler -------------------------------------------------------------

@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampled")
    plain = run(**QUIET, **DPSGD, rounds=6, out=str(root / "plain"))
    every = run(**QUIET, **DPSGD, rounds=6, eval_every_seconds=0.1, out=str(root / "every"))
    return plain, every


def test_samples_are_taken_every_s_emulated_seconds_for_every_node(sampled):
    _, every = sampled
    rows = [json.loads(line) for line in _lines(every.out_dir / "samples.jsonl")]
    ticks = sorted({row["t"] for row in rows})
    assert ticks == [k * 0.1 for k in range(1, len(ticks) + 1)]  # k S exactly, not a running sum
    assert ticks[-1] <= every.summary["emulated_seconds"] < ticks[-1] + 0.1 + 1e-9
    assert all(sorted(row["node"] for row in rows if row["t"] == t) == list(range(6)) for t in ticks)
    assert {"t", "node", "step", "test_acc", "bytes_sent", "bytes_received"} <= set(rows[0])


def test_a_samples_traffic_is_the_nodes_bytes_so_far(sampled):
    _, every = sampled
    rows = [json.loads(line) for line in _lines(every.out_dir / "samples.jsonl")]
    for node in range(6):
        mine = [row for row in rows if row["node"] == node]
        sent = [row["bytes_sent"] for row in mine]
        assert sent == sorted(sent) and sent[-1] <= sum(r["bytes_sent"] for r in every.metrics if r["node"] == node)
        # a round's model goes to both ring neighbours: whole rounds' worth of bytes, by the step it is in
        per_round = every.metrics[0]["bytes_sent"]
        assert all(row["bytes_sent"] % per_round == 0 and row["bytes_sent"] // per_round in (row["step"],
                                                                                            row["step"] + 1)
                   for row in mine)


def test_sampling_moves_no_node(sampled):
    plain, every = sampled
    for name in ("metrics.jsonl", "links.csv"):
        assert (plain.out_dir / name).read_bytes() == (every.out_dir / name).read_bytes(), name
    assert plain.summary["emulated_seconds"] == every.summary["emulated_seconds"]
    assert not (plain.out_dir / "samples.jsonl").exists()


def test_samples_are_reproducible(tmp_path):
    a = run(**QUIET, **DPSGD, rounds=3, eval_every_seconds=0.05, out=str(tmp_path / "a"))
    b = run(**QUIET, **DPSGD, rounds=3, eval_every_seconds=0.05, out=str(tmp_path / "b"))
    assert (a.out_dir / "samples.jsonl").read_bytes() == (b.out_dir / "samples.jsonl").read_bytes()


# -- node.serve ------------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_a_plain_handler_answers_at_arrival_while_the_node_computes(clock):
    asker, answerer = nodes(network(clock, nx.path_graph(2), latency="10ms"), compute_cost=1.0)
    answerer.serve("ping", lambda message: answerer.send(message.src, "pong", message.body + 1))
    working = asyncio.ensure_future(answerer.compute(sum, [1, 2], work=5))  # busy until t = 5
    asker.send(1, "ping", 41)
    pong = await asker.recv(kind="pong")
    assert (pong.body, clock.now) == (42, pytest.approx(0.020))
    assert await working == 3 and clock.now == 5
    assert await answerer.recv(timeout=0) is None  # served messages never reach the mailbox


@pytest.mark.asyncio
async def test_a_coroutine_handler_takes_messages_one_at_a_time_in_arrival_order(clock):
    a, b = nodes(network(clock, nx.path_graph(2), latency="10ms"))
    handled = []

    async def handler(message):
        handled.append((message.body, "start", clock.now))
        await b.sleep(1.0)
        handled.append((message.body, "end", clock.now))

    b.serve("job", handler)
    for body in (1, 2, 3):
        a.send(1, "job", body)
    await asyncio.sleep(5)
    assert handled == [(1, "start", 0.010), (1, "end", 1.010), (2, "start", 1.010), (2, "end", 2.010),
                       (3, "start", 2.010), (3, "end", 3.010)]


@pytest.mark.asyncio
async def test_a_served_body_that_fails_its_check_is_dropped_as_invalid(clock):
    net = network(clock, nx.path_graph(2))
    a, b = nodes(net)
    seen = []
    b.serve("x", seen.append, valid=lambda body: body > 0)
    a.send(1, "x", -1)
    a.send(1, "x", 5)
    await asyncio.sleep(1)
    assert [m.body for m in seen] == [5]
    assert net.ledger.totals()["dropped_invalid"] == 1


def test_a_failing_handler_fails_the_run():
    async def main(node):
        if node.id == 1:
            async def broken(message):
                raise ValueError("handler bug")
            node.serve("x", broken)
            await node.sleep(1)
        else:
            node.send(1, "x", 0)

    with pytest.raises(ValueError, match="handler bug"):
        emulate(main, nx.path_graph(2))


# -- each node's compute, idle and send seconds --------------------------------------------

def test_compute_idle_and_send_seconds_are_exact():
    async def main(node):
        if node.id == 0:
            await node.compute(sum, [1], work=250)  # 0.25 s at 1 ms a unit
            node.send(1, "x", bytes(1000))
        else:
            assert await node.recv(kind="x") is not None
            await node.sleep(0.5)

    emulation = emulate(main, nx.path_graph(2), bandwidth="8Mbps", compute_cost="1ms")
    times = emulation.node_time()
    size = emulation.ledger.totals()["bytes_total"]
    assert times["compute_seconds"] == [pytest.approx(0.25), 0.0]
    assert times["send_seconds"] == [pytest.approx(size * 8 / 8e6), 0.0]
    # node 1 waits for the message (compute, then its transmission), then sleeps half a second
    assert times["idle_seconds"] == [0.0, pytest.approx(0.25 + size * 8 / 8e6 + 0.5)]


def test_the_summary_gives_each_nodes_time_and_idle_fraction(sampled):
    plain, _ = sampled
    node_time, end = plain.summary["node_time"], plain.summary["emulated_seconds"]
    assert all(len(values) == 6 for values in node_time.values())
    assert node_time["idle_fraction"] == pytest.approx([idle / end for idle in node_time["idle_seconds"]])
    assert all(c + i <= end + 1e-9 for c, i in zip(node_time["compute_seconds"], node_time["idle_seconds"]))
    assert all(s > 0 and math.isfinite(s) for s in node_time["send_seconds"])


def test_stragglers_leave_their_neighbours_idle(tmp_path):
    result = run(**QUIET, **DPSGD, rounds=3, compute_speed="stragglers:fraction=0.5,slowdown=4",
                 out=str(tmp_path / "r"))
    node_time = result.summary["node_time"]
    slow = [i for i, c in enumerate(node_time["compute_seconds"]) if c > min(node_time["compute_seconds"]) * 2]
    fast = [i for i in range(6) if i not in slow]
    assert slow and fast
    assert min(node_time["idle_fraction"][i] for i in fast) > max(node_time["idle_fraction"][i] for i in slow)
