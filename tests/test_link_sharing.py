"""--link-sharing fair (max-min fair flows) and --link-overhead tcp (bytes on the wire), on a Network driven
directly by a virtual clock, and through the settings."""
import asyncio
import math

import networkx as nx
import pytest

from emulator.clock import VirtualClock
from emulator.ledger import Ledger
from emulator.links import LinkSpec, tcp_ack_bytes, tcp_wire_bytes
from emulator.network import Network
from emulator.seeds import Seeds
from emulator.sharing import Flow, fair_rates
from p2p_emulator.specs import parse_delay, parse_loss
from tests.conftest import assert_refused, emulate

L = 0.01  # latency, seconds
B = 1000  # message bytes
R = 1e6  # a capacity, bit/s


def _network(graph: nx.Graph, sharing: str = "fair", *, latency: str = "10ms", bandwidth: float = math.inf,
             loss: str = "0", overhead: str = "none", **options) -> Network:
    spec = LinkSpec(parse_delay(latency), bandwidth, parse_loss(loss))
    ledger = Ledger(trace=True)
    return Network(graph, VirtualClock(), ledger, spec, Seeds(0), sharing=sharing, overhead=overhead, **options)


def _run(net: Network, sends: list[tuple[int, int, int]], at: float = 0.0) -> list[float | None]:
    """Put frames of (src, dst, nbytes) on their links at time `at`, in order; each one's arrival time (None:
    dropped), in the same order."""
    for src, dst, nbytes in sends:
        net.clock.schedule(at, net.transmit, src, dst, "x", 0, bytes(nbytes))
    net.clock.run(asyncio.sleep(1e6))
    return [row.t_arrive if row.fate == "delivered" else None for row in net.ledger.trace]


def test_fair_one_sender_to_four_neighbours_share_its_uplink():
    sends = [(0, leaf, B) for leaf in range(1, 5)]
    fair = _run(_network(nx.star_graph(4), "fair", uplink=R), sends)
    fifo = _run(_network(nx.star_graph(4), "fifo", uplink=R), sends)
    assert fair == pytest.approx([L + 4 * 8 * B / R] * 4, rel=1e-12)
    assert fifo == pytest.approx([L + k * 8 * B / R for k in range(1, 5)], rel=1e-12)


def test_fair_four_senders_share_one_downlink():
    arrivals = _run(_network(nx.star_graph(4), downlink=R), [(leaf, 0, B) for leaf in range(1, 5)])
    assert arrivals == pytest.approx([L + 4 * 8 * B / R] * 4, rel=1e-12)


def test_fair_small_flow_ends_at_half_rate_then_the_big_one_takes_the_uplink():
    small, big = 1000, 3000
    arrivals = _run(_network(nx.star_graph(2), uplink=R), [(0, 1, small), (0, 2, big)])
    assert arrivals == pytest.approx([L + 2 * 8 * small / R, L + 8 * (small + big) / R], rel=1e-12)


def test_fair_link_bandwidth_caps_a_flow_and_the_others_get_the_rest():
    capped = LinkSpec(parse_delay("10ms"), 2e6, parse_loss("0"))
    net = _network(nx.star_graph(2), uplink=10e6, edge_specs={(0, 1): capped})
    flows = [Flow(net.links[0, dst], 8.0 * B, None, 0.0) for dst in (1, 2)]
    uplink = net.uplinks[0]
    assert list(fair_rates(flows, {uplink: dict.fromkeys(flows)}).values()) == [2e6, 8e6]  # max-min, not 5 and 5
    assert _run(net, [(0, 1, B), (0, 2, B)]) == pytest.approx([L + 8 * B / 2e6, L + 8 * B / 8e6], rel=1e-12)


def test_fair_link_sends_its_next_message_when_the_first_ends():
    # Link 0->1 carries two messages, link 0->2 one: the first of each share the uplink, then 0->1's second
    # has it alone.
    arrivals = _run(_network(nx.star_graph(2), uplink=R), [(0, 1, B), (0, 1, B), (0, 2, B)])
    assert arrivals == pytest.approx([L + 2 * 8 * B / R, L + 3 * 8 * B / R, L + 2 * 8 * B / R], rel=1e-12)


def test_fair_alone_on_a_link_ends_exactly_as_fifo():
    net = _network(nx.path_graph(2), bandwidth=R)
    assert _run(net, [(0, 1, B), (0, 1, 2 * B)]) == [L + 8 * B / R, L + 8 * B / R + 8 * 2 * B / R]
    assert net.send_seconds == [8 * B / R + 8 * 2 * B / R, 0.0]


def test_fair_draws_loss_and_latency_as_fifo_and_never_overtakes():
    # Links that share nothing: fair is fifo, draw for draw, even with loss and jitter.
    sends = [(0, 1, B * (1 + i % 3)) for i in range(40)]
    kwargs = dict(latency="uniform:low=0ms,high=500ms", bandwidth=R, loss="0.3")
    fair, fifo = (_run(_network(nx.path_graph(2), sharing, **kwargs), sends) for sharing in ("fair", "fifo"))
    assert fair == fifo
    arrived = [t for t in fair if t is not None]
    assert 0 < len(arrived) < len(sends) and arrived == sorted(arrived)


def test_fair_sender_offline_at_its_turn_drops_the_waiting_message():
    net = _network(nx.path_graph(2), bandwidth=R, nodes_change=True)
    net.clock.schedule(0.001, net.online.__setitem__, 0, False)  # while the first message is on the link
    assert _run(net, [(0, 1, B), (0, 1, B)]) == [L + 8 * B / R, None]
    assert net.ledger.trace[1].fate == "offline" and net.in_flight == 0


@pytest.mark.parametrize("sharing", ["fifo", "fair"])
def test_tcp_overhead_times_the_wire_bytes_and_keeps_the_payload_counts(sharing):
    payload = 1448 * 10
    net = _network(nx.path_graph(2), sharing, bandwidth=1e6, overhead="tcp")
    assert _run(net, [(0, 1, payload)]) == [pytest.approx(L + 8 * (payload + 660) / 1e6, rel=1e-12)]
    totals = net.ledger.totals()
    # wire: 10 segments' headers; and 5 ACKs (one per two segments) on the way back
    assert (totals["bytes_total"], totals["bytes_delivered"], totals["wire_bytes"]) == (payload, payload,
                                                                                          payload + 660 + 330)


def test_wire_bytes_per_segment():
    assert [tcp_wire_bytes(n) for n in (0, 1, 1448, 1449)] == [0, 67, 1514, 1449 + 132]
    assert [tcp_ack_bytes(n) for n in (0, 1, 2 * 1448, 2 * 1448 + 1)] == [0, 66, 66, 132]


def test_fair_acks_take_their_share_of_the_receivers_uplink():
    """Two nodes sending to each other through uplinks of R: each uplink carries its data and the ACKs of the
    other's, so each flow runs at R / (1 + a), a = ACK bytes per wire byte; one way alone, at R."""
    size = 1448 * 100
    wire, acks = tcp_wire_bytes(size), tcp_ack_bytes(size)
    both = _run(_network(nx.path_graph(2), uplink=R, overhead="tcp"), [(0, 1, size), (1, 0, size)])
    assert both == pytest.approx([L + 8 * (wire + acks) / R] * 2, rel=1e-12)
    one_way = _run(_network(nx.path_graph(2), uplink=R, overhead="tcp"), [(0, 1, size)])
    assert one_way == [L + 8 * wire / R]


def test_settings_reach_the_network_and_defaults_add_no_totals():
    async def run(node):
        if node.id == 0:
            node.broadcast("data", b"x" * B)
        else:
            await node.recv(timeout=10.0)

    fair = emulate(run, nx.star_graph(3), latency="10ms", uplink="1Mbps", link_sharing="fair",
                   link_overhead="tcp", trace=True)
    size = fair.ledger.trace[0].bytes
    assert fair.ledger.totals()["wire_bytes"] == 3 * (tcp_wire_bytes(size) + tcp_ack_bytes(size))
    assert [row.t_arrive for row in fair.ledger.trace] == pytest.approx(
        [L + 3 * 8 * tcp_wire_bytes(size) / 1e6] * 3, rel=1e-12)
    fifo = emulate(run, nx.star_graph(3), latency="10ms", uplink="1Mbps", trace=True)
    assert "wire_bytes" not in fifo.ledger.totals()
    assert [row.t_arrive for row in fifo.ledger.trace] == pytest.approx(
        [L + k * 8 * size / 1e6 for k in (1, 2, 3)], rel=1e-12)


@pytest.mark.parametrize("argv, named", [(["--link-sharing", "wfq"], "--link-sharing"),
                                         (["--link-overhead", "udp"], "--link-overhead"),
                                         (["--link-sharing", "fair", "--checkpoint-every", "1"], "--link-sharing")])
def test_bad_values_are_one_line_errors_naming_the_flag(capsys, tmp_path, argv, named):
    assert_refused(capsys, ["--protocol", "dpsgd", *argv], named, tmp_path / "run")
