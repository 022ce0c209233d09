"""--timeout auto: a node waits as long as its own earlier waits say (RFC 6298's timer over them), so that a silent
neighbour costs about a round, not a fixed minute, and a late message teaches the timer."""
import json

import networkx as nx
import pytest

import p2p_emulator
from emulator.timeout import CEILING, MINIMUM, Adaptive, Timer

from tests.conftest import network, nodes


def test_the_timer_follows_rfc_6298():
    timer = Timer()
    assert timer.timeout() == MINIMUM  # no sample yet
    timer.observe(2.0)
    assert (timer.srtt, timer.rttvar, timer.timeout()) == (2.0, 1.0, 6.0)
    timer.observe(4.0)  # RTTVAR first, from the old SRTT; then SRTT
    assert (timer.rttvar, timer.srtt) == (0.75 * 1.0 + 0.25 * 2.0, 0.875 * 2.0 + 0.125 * 4.0)
    assert timer.timeout() == pytest.approx(2.25 + 4 * 1.25)
    for _ in range(200):
        timer.observe(0.01)
    assert timer.timeout() == MINIMUM  # never below RFC 6298's second
    timer.observe(1000.0)
    assert timer.timeout() == CEILING


def test_a_protocol_scales_and_lengthens_the_adaptive_wait():
    assert 2 * (Adaptive() + 0.5) == Adaptive(2.0, 1.0) == (Adaptive() + 0.5) * 2
    assert Adaptive(3.0, 2.0) + Adaptive() + 1 == Adaptive(4.0, 3.0)
    assert str(Adaptive()) == "auto" and str(2 * Adaptive() + 0.5) == "2 x auto + 0.5 s"


@pytest.mark.asyncio
async def test_a_message_that_came_after_its_wait_still_teaches_the_timer(clock):
    """On a link of 2.5 s, node 1 gives up on node 0's message after its first 1 s; the message lands at 2.5 s,
    and node 1's next wait takes its transit as a sample, dropping the stale message: SRTT 2.5 s, a timeout of
    2.5 + 4 x 1.25 = 7.5 s."""
    net = network(clock, nx.path_graph(2), latency="2500ms")
    sender, receiver = nodes(net)
    sender.send(1, "x", 0)
    assert await receiver.gather("x", round=0, timeout=Adaptive()) == {}
    assert clock.now == 1.0
    await receiver.sleep(2.0)
    started = clock.now
    assert await receiver.gather("x", round=1, timeout=Adaptive()) == {}
    assert clock.now - started == pytest.approx(7.5)


@pytest.mark.asyncio
async def test_a_peer_that_sends_late_does_not_lengthen_the_wait(clock):
    """A message sent late (its sender computed, or was offline) crossed the link as fast as any: the timer learns
    the link's 10 ms, and stays at its 1 s floor."""
    net = network(clock, nx.path_graph(2), latency="10ms")
    sender, receiver = nodes(net)

    async def late_sender():
        await sender.sleep(5.0)
        sender.send(1, "x", 0)

    clock.loop.create_task(late_sender())
    assert await receiver.gather("x", round=0, timeout=Adaptive()) == {}
    await receiver.sleep(10.0)
    started = clock.now
    assert await receiver.gather("x", round=1, timeout=Adaptive()) == {}
    assert clock.now - started == MINIMUM


def _rounds(tmp_path, name, rounds=6, **settings) -> tuple[dict, list[float]]:
    out = tmp_path / name
    p2p_emulator.run(protocol="dfedavgm", topology="regular:d=4", nodes=10, rounds=rounds, model="mlp:hidden=16",
                     quiet=True, no_plots=True, out=str(out), **settings)
    ends: dict[int, float] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        ends[row["round"]] = max(ends.get(row["round"], 0.0), row["t"])
    return json.loads((out / "summary.json").read_text()), [ends[r] for r in sorted(ends)]


@pytest.mark.parametrize("seed", [0, 3])
def test_a_crashed_neighbour_costs_a_round_about_the_timer_not_a_minute(tmp_path, seed):
    """A fifth of the nodes crash at the start: under the fixed minute every round lasts a minute; under auto the
    neighbours of a crashed node wait out about a second (RFC 6298's floor) and the round's compute."""
    crash = dict(crash="0.2@0s", seed=seed)
    _, fixed = _rounds(tmp_path, f"fixed{seed}", timeout=60, **crash)
    summary, adaptive = _rounds(tmp_path, f"auto{seed}", **crash)
    compute = summary["timeout"]["longest_compute"]
    assert all(b - a > 60 for a, b in zip(fixed, fixed[1:]))
    assert all(b - a < MINIMUM + compute + 0.5 for a, b in zip([0.0] + adaptive, adaptive))
    assert summary["timeout"]["given"] == "auto"


def test_a_fault_free_run_never_times_out_under_auto(tmp_path):
    """Without faults, auto waits for every message as the fixed minute did: the same run, byte for byte."""
    for seed in (1, 2):
        _, fixed = _rounds(tmp_path, f"fixed{seed}", timeout=60, seed=seed, compute_speed="uniform:low=1,high=3")
        _, adaptive = _rounds(tmp_path, f"auto{seed}", seed=seed, compute_speed="uniform:low=1,high=3")
        assert fixed == adaptive
        for name in ("metrics.jsonl", "links.csv"):
            assert (tmp_path / f"fixed{seed}" / name).read_bytes() == (tmp_path / f"auto{seed}" / name).read_bytes()


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan"])
def test_a_bad_timeout_is_one_line_and_exit_2(tmp_path, capsys, value):
    from p2p_emulator.cli import main

    assert main(["--protocol", "dfedavgm", "--timeout", value, "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == (f"emulate: error: --timeout {value}: must be a positive number of seconds, "
                                       "or auto\n")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("seed", [0, 1])
def test_under_churn_a_round_costs_about_the_timer_not_the_outages(tmp_path, seed):
    """Nodes that come back send their old rounds' models late, but those crossed the links as fast as any: the
    wait stays at its 1 s floor, and a round of heavy churn (up 0.5 s, down 0.5 s) lasts about that, not the
    seconds a timer fed with the outages would wait."""
    summary, ends = _rounds(tmp_path, f"churn{seed}", rounds=15, churn="up=0.5s,down=0.5s", seed=seed)
    assert summary["dropped_offline"] > 0
    assert ends[-1] / len(ends) < MINIMUM + summary["timeout"]["longest_compute"] + 0.5
