"""--loss-model reliable: a lossy link delivers every message, late by TCP's recovery, and counts what it resent;
--loss-model datagram: whole messages are lost, as before."""
import json
import math

import pytest

import p2p_emulator
from emulator.links import TCP_SEGMENT, Bernoulli, Capacity, Delay, GilbertElliott, Link, LinkSpec
from emulator.seeds import Seeds

MB = 1_000_000


def link(p: float, rtt: float, rate: float, seed: int = 0, loss=None) -> Link:
    spec = LinkSpec(Delay("constant", value=rtt / 2), rate, loss or Bernoulli(p))
    return Link(0, 1, spec, Seeds(seed), Capacity(math.inf), Capacity(math.inf), [0] * 16, reliable=True)


def transfer_time(lnk: Link, nbytes: int, now: float = 0.0) -> float:
    return lnk.transmit(now, nbytes) - now


def test_a_link_that_loses_nothing_keeps_the_loss_free_time():
    """Whatever its loss probability, a message none of whose segments is lost takes bytes/rate + latency."""
    lnk = link(1e-12, 0.05, 10e6)
    assert lnk.window is not None
    for nbytes in (1, 1448, 100_000, 4 * MB):
        start = lnk.free_at
        assert lnk.transmit(start, nbytes) == pytest.approx(start + 8 * nbytes / 10e6 + 0.025, rel=1e-12)
        assert lnk.resent == 0


@pytest.mark.parametrize("p", [0.005, 0.02, 0.05])
@pytest.mark.parametrize("rtt", [0.02, 0.1])
def test_a_lossy_long_transfer_runs_at_tcps_loss_bound_rate(p, rtt):
    """Well under the link's rate, throughput follows the loss: about MSS / (RTT sqrt(2p/3)) (Mathis et al.),
    over seeds and sizes; more loss or a longer round trip is slower."""
    mathis = 8 * TCP_SEGMENT / rtt * math.sqrt(1.5 / p)
    for seed in range(3):
        lnk = link(p, rtt, 100e6, seed)
        transfer_time(lnk, 16 * MB)  # the window comes down to where loss keeps it
        for nbytes in (4 * MB, 8 * MB):
            rate = 8 * nbytes / transfer_time(lnk, nbytes, lnk.free_at)
            assert 0.6 * mathis < rate < 1.4 * mathis, (seed, nbytes, rate / mathis)


def test_a_link_faster_than_loss_allows_is_the_limit_and_resent_bytes_follow_the_loss():
    p, rate = 0.01, 2e6  # the loss would allow ~14 Mbit/s at 10 ms: the link's 2 Mbit/s is the limit
    lnk = link(p, 0.01, rate, seed=3)
    seconds = transfer_time(lnk, 4 * MB)
    assert 8 * 4 * MB / rate < seconds < 1.25 * 8 * 4 * MB / rate
    expected = 4 * MB * p / (1 - p)  # each segment is sent until it gets through
    assert 0.7 * expected < lnk.resent < 1.3 * expected


def test_bursty_loss_steps_its_state_per_segment():
    """Gilbert-Elliott over segments: long bad bursts cost retransmission timeouts, so a transfer takes longer
    than under Bernoulli loss of the same mean rate."""
    ge = GilbertElliott(p=0.002, r=0.1)  # bad 2% of the time, bursts of 10 segments
    mean = 0.002 / (0.002 + 0.1)
    bursty, even = link(0, 0.02, 1e9, seed=1, loss=ge), link(mean, 0.02, 1e9, seed=1)
    assert transfer_time(bursty, 4 * MB) > transfer_time(even, 4 * MB)
    assert bursty.resent > 0


def _run(tmp_path, name, **settings):
    out = tmp_path / name
    p2p_emulator.run(protocol="dfedavgm", topology="regular:d=4", nodes=8, rounds=3, compress="q8",
                     model="mlp:hidden=16", quiet=True, no_plots=True, out=str(out), **settings)
    summary = json.loads((out / "summary.json").read_text())
    return summary, (out / "links.csv").read_text().splitlines()


def test_reliable_loss_delivers_every_message_late_and_counts_the_bytes_it_resent(tmp_path):
    clean, clean_links = _run(tmp_path, "clean")
    reliable, links = _run(tmp_path, "reliable", loss="0.05")
    datagram, datagram_links = _run(tmp_path, "datagram", loss="0.05", loss_model="datagram")
    assert reliable["messages_delivered"] == reliable["messages_total"] == clean["messages_delivered"]
    assert reliable["dropped_loss"] == 0 and datagram["dropped_loss"] > 0
    assert reliable["emulated_seconds"] > clean["emulated_seconds"]
    # Resent bytes: in the summary, and per link in links.csv (a column only where they are counted).
    assert links[0].endswith(",bytes_resent") and not datagram_links[0].endswith("bytes_resent")
    per_link = sum(int(line.rsplit(",", 1)[1]) for line in links[1:])
    assert per_link == reliable["bytes_resent"] > 0
    assert 0.01 < reliable["bytes_resent"] / reliable["bytes_total"] < 0.1
    assert "bytes_resent" not in clean and "bytes_resent" not in datagram


def test_the_loss_model_is_in_the_digest_only_where_a_link_can_lose(tmp_path):
    from p2p_emulator.settings import config_hash, resolve
    from emulator.protocol import protocols

    def digest(**settings):
        return config_hash(*resolve({"protocol": "gossip", **settings}, protocols()))

    assert digest() == digest(loss_model="datagram")  # no loss: results cannot differ
    assert digest(loss="0.1") != digest(loss="0.1", loss_model="datagram")


def test_a_bad_loss_model_is_one_line_and_exit_2(tmp_path, capsys):
    from p2p_emulator.cli import main

    assert main(["--protocol", "gossip", "--loss-model", "tcp", "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip() == "emulate: error: --loss-model 'tcp': choose one of datagram, reliable"
    assert not (tmp_path / "r").exists()
