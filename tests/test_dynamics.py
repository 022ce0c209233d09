"""Network dynamics: churn, crashes, availability traces, link failures, partitions, time-varying graphs."""
import csv
import json
from pathlib import Path
from types import SimpleNamespace

import networkx as nx
import numpy as np
import pytest
import yaml

import topologies
from emulator.compute import ThreadExecutor
from p2p_emulator.build import build_emulation
from p2p_emulator.cli import main
from p2p_emulator.settings import RunConfig
from emulator.network import NotNeighbourError
from emulator.seeds import Seeds
from protocols.gossip import Gossip, GossipOptions
from tests.conftest import assert_one_line_error, emulate

QUIET = ["--quiet", "--no-plots"]
SCENARIOS = Path(__file__).resolve().parents[1] / "experiments" / "scenarios"


def _run(out, *args) -> dict:
    assert main([*args, *QUIET, "--out", str(out)]) == 0
    return {
        "summary": json.loads((out / "summary.json").read_text()),
        "metrics": [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()],
        "out": out,
    }


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rounds_by_node(metrics) -> dict[int, list[int]]:
    rounds: dict[int, list[int]] = {}
    for row in metrics:
        rounds.setdefault(row["node"], []).append(row["round"])
    return rounds


# -- churn -------------------------------------------------------------------------------

# 20 nodes, each down a third of the time (30% of the nodes' time offline, give or take the draws).
CHURN20 = ["--nodes", "20", "--topology", "regular:d=4", "--dataset", "digits", "--rounds", "6",
           "--churn", "up=0.7s,down=0.3s", "--timeout", "0.3"]


# The final mean test accuracy measured over seeds 0-3: dfedavgm 0.75-0.80, mapl 0.45-0.49 (chance: 0.1).
@pytest.mark.parametrize("protocol,extra,bar", [
    ("dfedavgm", [], 0.6),
    ("mapl", ["--d-z", "16", "--d-p", "16", "--projection-hidden", "32", "--local-epochs", "1"], 0.3),
])
def test_churn_every_node_completes_every_round(tmp_path, protocol, extra, bar):
    run = _run(tmp_path / protocol, "--protocol", protocol, *CHURN20, *extra)
    # each node closes each round once, in order, and scores its model in it
    assert _rounds_by_node(run["metrics"]) == {i: list(range(6)) for i in range(20)}
    assert all("test_acc" in row for row in run["metrics"])
    assert run["summary"]["dropped_offline"] > 0
    outages = _jsonl(run["out"] / "availability.jsonl")
    down = {row["node"] for row in outages}
    assert len(down) >= 10 and all(row["t_up"] is None or row["t_up"] > row["t_down"] for row in outages)
    # Some rounds went without some neighbours, and the runs renormalised over who arrived.
    assert min(row["heard_from"] for row in run["metrics"]) < 4
    assert run["summary"]["final"]["test_acc"] > bar  # and they learned all the same


def _trace_file(tmp_path, rows):
    path = tmp_path / "trace.csv"
    path.write_text("node,t_down,t_up\n" + "".join(f"{n},{d},{u}\n" for n, d, u in rows))
    return str(path)


def test_offline_node_does_not_compute_and_rejoins_with_its_state(tmp_path):
    # Node 1 is down from 0.5 s to 2 s; node 2 from 0 s to 1 s.
    trace = _trace_file(tmp_path, [(1, 0.5, 2.0), (2, 0, 1.0)])
    finished, state = {}, {}

    async def run(node):
        count = 0
        async for _ in node.rounds():
            await node.compute(lambda: None, work=1000)  # 1 s at 1 ms per unit
            count += 1
            finished.setdefault(node.id, []).append(node.now())
        state[node.id] = count

    emulation = emulate(run, nx.empty_graph(3), rounds=2, compute_cost="1ms", availability=trace)
    assert finished[0] == [1.0, 2.0]
    # Node 1 computed 0.5 s, was away 1.5 s, then did the other 0.5 s: no work while down.
    assert finished[1] == [pytest.approx(2.5), pytest.approx(3.5)]
    # Node 2 starts only when it comes up at 1 s.
    assert finished[2] == [pytest.approx(2.0), pytest.approx(3.0)]
    assert state == {0: 2, 1: 2, 2: 2}  # it carried on from its round and state, not from round 0
    assert [(r["node"], r["round"]) for r in emulation.rows] == [(n, r) for r in range(2) for n in range(3)]
    assert emulation.availability.rows() == [{"node": 2, "t_down": 0.0, "t_up": 1.0},
                                             {"node": 1, "t_down": 0.5, "t_up": 2.0}]


def test_messages_to_and_from_an_offline_node_are_dropped(tmp_path):
    trace = _trace_file(tmp_path, [(1, 1.0, 2.0)])
    got = []

    async def run(node):
        if node.id == 0:
            for t in (0.5, 1.5, 2.5):  # 1.5: node 1 is down when it would arrive
                await node.sleep(t - node.now())
                node.send(1, "ping", t)
        else:
            await node.sleep(1.2)
            node.send(0, "from-offline")
            while (message := await node.recv(timeout=2.0)) is not None:
                got.append(message.body)

    emulation = emulate(run, nx.path_graph(2), latency="10ms", availability=trace, trace=True)
    assert got == [0.5, 2.5]  # the first was queued before the outage and kept
    fates = {(r.src, r.kind): r.fate for r in emulation.ledger.trace}
    assert fates[1, "from-offline"] == "offline"
    assert [r.fate for r in emulation.ledger.trace if r.kind == "ping"] == ["delivered", "offline", "delivered"]
    assert emulation.ledger.totals()["dropped_offline"] == 2


@pytest.mark.parametrize("cause", ["offline", "link_down"])
def test_a_message_still_queued_when_its_sender_goes_down_never_leaves(tmp_path, cause):
    # Three 125 kB messages on a 1 Mbps link take 1 s each: at t = 0.5 the first is on the
    # wire (delivered at 1 s); the other two are still queued and drop when their turn comes.
    got = []

    async def run(node):
        if node.id == 0:
            for k in range(3):
                node.send(1, "blob", bytes(125_000))
        else:
            while (message := await node.recv(timeout=5.0)) is not None:
                got.append(message.t_arrive)

    settings = ({"availability": _trace_file(tmp_path, [(0, 0.5, 10.0)])} if cause == "offline"
                else {"partition_event": "t=0.5s:groups=0|1:heal=10s"})  # sender down, or the edge
    emulation = emulate(run, nx.path_graph(2), bandwidth="1Mbps", trace=True, **settings)
    assert got == [pytest.approx(1.0, rel=1e-3)]
    assert [r.fate for r in emulation.ledger.trace] == ["delivered", cause, cause]
    totals = emulation.ledger.totals()
    assert totals[f"dropped_{cause}"] == 2 and totals["bytes_total"] == 3 * emulation.ledger.trace[0].bytes


def test_an_outage_that_never_ends_is_a_crash(tmp_path):
    trace = _trace_file(tmp_path, [(1, 0.05, "")])
    run = _run(tmp_path / "never", "--protocol", "gossip", "--nodes", "4", "--topology", "ring", "--rounds", "20",
               "--timeout", "0.05", "--availability", trace)
    assert run["summary"]["crashed"] == [1]
    rounds = _rounds_by_node(run["metrics"])
    assert len(rounds[1]) < 20 and all(rounds[node] == list(range(20)) for node in (0, 2, 3))
    assert _jsonl(run["out"] / "availability.jsonl") == [{"node": 1, "t_down": 0.05, "t_up": None}]


def test_yaml_off_and_null_switch_a_fault_off(tmp_path):
    config = tmp_path / "scenario.yaml"
    config.write_text("protocol: gossip\nrounds: 3\nchurn: off\navailability: null\nlink_failures: no\n")
    run = _run(tmp_path / "off", "--config", str(config))
    assert len(run["metrics"]) == 3 * 10 and "crashed" not in run["summary"]
    assert not (run["out"] / "availability.jsonl").exists()
    assert run["summary"]["dropped_link_down"] == 0 and run["summary"]["dropped_offline"] == 0
    resolved = yaml.safe_load((run["out"] / "config.yaml").read_text())
    assert (resolved["churn"], resolved["link_failures"]) == ("none", "none")


# -- crash -------------------------------------------------------------------------------

def test_crash_of_half_the_nodes_mid_run_leaves_the_others_running(tmp_path):
    # gossip on a 20-node ring: 10 ms per round, so 0.1 s is round 10 of 20.
    run = _run(tmp_path / "crash", "--protocol", "gossip", "--nodes", "20", "--topology", "regular:d=4",
               "--rounds", "20", "--crash", "0.5@0.1s", "--timeout", "1")
    crashed = run["summary"]["crashed"]
    assert len(crashed) == 10
    rounds = _rounds_by_node(run["metrics"])
    survivors = sorted(set(range(20)) - set(crashed))
    assert all(rounds[i] == list(range(20)) for i in survivors)
    assert all(rounds[i] == list(range(len(rounds[i]))) and 5 <= len(rounds[i]) < 20 for i in crashed)
    assert run["summary"]["dropped_offline"] > 0
    outages = _jsonl(run["out"] / "availability.jsonl")
    assert outages == [{"node": i, "t_down": 0.1, "t_up": None} for i in crashed]
    # The observer kept closing rounds over the live nodes.
    assert all("consensus_distance" in row for row in run["metrics"])


# -- links -------------------------------------------------------------------------------

def _links(out):
    with open(out / "links.csv") as fh:
        return list(csv.DictReader(fh))


def test_link_failures_drop_with_link_down_and_runs_reproduce(tmp_path):
    args = ["--protocol", "gossip", "--nodes", "12", "--topology", "ring", "--rounds", "30",
            "--link-failures", "up=0.1s,down=0.05s", "--churn", "up=0.5s,down=0.1s", "--timeout", "0.05"]
    first = _run(tmp_path / "a", *args)
    again = _run(tmp_path / "b", *args)
    other = _run(tmp_path / "c", *args, "--seed", "1")
    assert first["summary"]["dropped_link_down"] > 0
    assert _links(first["out"]) == _links(again["out"])
    assert first["metrics"] == again["metrics"]
    assert (first["out"] / "availability.jsonl").read_text() == (again["out"] / "availability.jsonl").read_text()
    assert _links(first["out"]) != _links(other["out"])
    # Both directions of an edge fail together.
    by_link = {(int(r["src"]), int(r["dst"])): int(r["dropped_link_down"]) for r in _links(first["out"])}
    assert all((by_link[s, d] > 0) == (by_link[d, s] > 0) for s, d in by_link)


def test_same_seed_and_scenario_give_identical_learning_runs(tmp_path):
    args = ["--protocol", "dfedavgm", "--nodes", "10", "--topology", "ring", "--dataset", "digits",
            "--rounds", "4", "--churn", "up=0.3s,down=0.2s", "--link-failures", "up=1s,down=0.2s",
            "--timeout", "0.2"]
    first, again = _run(tmp_path / "a", *args), _run(tmp_path / "b", *args)
    assert _links(first["out"]) == _links(again["out"])
    assert first["metrics"] == again["metrics"]


class _GroupGossip(Gossip):
    """Gossip that also reports the distance between the two groups' means."""

    def observe(self, rnd, snapshots):
        metrics = super().observe(rnd, snapshots)
        gap = float(np.linalg.norm(np.mean([snapshots[i] for i in range(5)], axis=0)
                                   - np.mean([snapshots[i] for i in range(5, 10)], axis=0)))
        return {i: {**m, "group_gap": gap} for i, m in metrics.items()}


def test_partition_keeps_the_groups_apart_until_the_heal():
    protocol = _GroupGossip(GossipOptions(timeout=1.0), SimpleNamespace(seeds=Seeds(0), num_nodes=10))
    # Rounds take 1 s (the timeout) while parted, 10 ms once whole: rounds 0-3 are parted.
    config = RunConfig(protocol="gossip", rounds=8, partition_event="t=0s:groups=0-4|5-9:heal=3.5s")
    with ThreadExecutor(1) as executor:
        emulation = build_emulation(config, nx.complete_graph(10), protocol, executor)
        rows = emulation.run()
    gap = {r["round"]: r["group_gap"] for r in rows if r["node"] == 0}
    start = {r["round"] + 1: r["t"] for r in rows if r["node"] == 0} | {0: 0.0}
    assert [rnd for rnd in gap if start[rnd] < 3.5] == [0, 1, 2, 3]
    # While apart, each group keeps its mean: the gap stays what it was at the start.
    x0 = np.array([protocol.initial(i) for i in range(10)])
    initial = np.linalg.norm(x0[:5].mean(0) - x0[5:].mean(0))
    assert initial > 0.5 and all(gap[rnd] == pytest.approx(initial, rel=1e-9) for rnd in range(4))
    # Healed, the mesh averages both groups: round 4 already reaches the mean.
    assert gap[4] < 1e-9 and gap[7] < 1e-9
    assert emulation.ledger.totals()["dropped_link_down"] == 4 * 2 * 5 * 5


def test_per_node_uplinks_from_a_graphml_topology():
    graph = nx.path_graph(2)
    graph.nodes[0]["uplink"] = "8kbps"  # 1000 bytes take 1 s
    arrivals = {}

    async def run(node):
        if node.id == 0:
            node.send(1, "x", bytes(1000))
        else:
            message = await node.recv()
            arrivals[1] = (message.t_arrive, message.size)

    emulate(run, graph, downlink="uniform:low=1Gbps,high=2Gbps")
    t_arrive, size = arrivals[1]
    assert t_arrive == pytest.approx(size / 1000, rel=1e-4) and size > 1000


# -- time-varying topologies -------------------------------------------------------------

def _sent_edges(out) -> dict[int, set]:
    edges: dict[int, set] = {}
    for message in _jsonl(out / "messages.jsonl"):
        edges.setdefault(message["round"], set()).add((message["src"], message["dst"]))
    return edges


@pytest.mark.parametrize("n", [8, 12])
def test_one_peer_exponential_messages_follow_the_schedule(tmp_path, n):
    run = _run(tmp_path / "op", "--protocol", "gossip", "--nodes", str(n), "--rounds", "7",
               "--topology-schedule", "one-peer-exponential", "--trace")
    tau = n.bit_length() - 1
    assert _sent_edges(run["out"]) == {t: {(i, (i + 2 ** (t % tau)) % n) for i in range(n)} for t in range(7)}
    assert {row["heard_from"] for row in run["metrics"]} == {1}
    if n == 8:  # half-and-half averaging over log2(n) rounds reaches the exact mean
        assert max(row["error"] for row in run["metrics"] if row["round"] >= 2) < 1e-12


def test_resample_every_k_rounds(tmp_path):
    run = _run(tmp_path / "rs", "--protocol", "gossip", "--nodes", "10", "--topology", "regular:d=3",
               "--rounds", "6", "--topology-schedule", "resample:every=2", "--trace")
    sent = _sent_edges(run["out"])
    for t in range(6):
        graph = topologies.resample("regular:d=3", 10, Seeds(0).integer("topology"), t, every=2)
        assert sent[t] == {(u, v) for u, v in graph.edges} | {(v, u) for u, v in graph.edges}
    assert sent[0] == sent[1] != sent[2] == sent[3]


def test_schedule_file_and_a_message_in_flight_on_a_vanishing_edge(tmp_path):
    schedule = tmp_path / "schedule.csv"
    schedule.write_text("round,sender,receiver\n0,0,1\n1,1,0  # round 1: only 1 -> 0\n")
    seen = {}

    async def run(node):
        async for rnd in node.rounds():
            seen[node.id, rnd] = (node.neighbours, node.in_neighbours)
            if node.id == 0 and rnd == 0:
                node.send(1, "slow")  # 1 s on the wire; node 1 gives up after 0.5 s
            if node.id == 0 and rnd == 1:
                with pytest.raises(NotNeighbourError):
                    node.send(1, "late")
            if node.id == 1:
                seen["gather", rnd] = sorted(await node.gather("slow", timeout=0.5))
        if node.id == 1:
            seen["after"] = await node.recv(timeout=5.0)

    emulation = emulate(run, nx.empty_graph(2), rounds=2, latency="1s", trace=True,
                        topology_schedule=str(schedule))
    assert seen[0, 0] == ([1], []) and seen[1, 0] == ([], [0])
    assert seen[0, 1] == ([], [1]) and seen[1, 1] == ([0], [])
    assert seen["gather", 0] == [] and seen["gather", 1] == []
    # Sent in round 0 on 0 -> 1, which round 1 no longer has: delivered all the same.
    assert (seen["after"].src, seen["after"].round, seen["after"].t_arrive) == (0, 0, 1.0)
    assert [row.fate for row in emulation.ledger.trace] == ["delivered"]


def test_time_varying_scenario_file_runs(tmp_path):
    run = _run(tmp_path / "tv", "--scenario", str(SCENARIOS / "time_varying.yaml"), "--rounds", "3")
    assert _sent_edges(run["out"])[2] == {(i, (i + 4) % 16) for i in range(16)}
    assert run["summary"]["topology"] == "one-peer-exponential"


def test_dropout_scenario_file_and_list_of_partitions(tmp_path):
    config = tmp_path / "scenario.yaml"
    config.write_text(((SCENARIOS / "dropout.yaml").read_text()
                       + "rounds: 2\npartition_event:\n  - t=0s:groups=0-9:heal=0.1s\n  - t=0.2s:groups=0-4\n"))
    run = _run(tmp_path / "d", "--config", str(config), "--trace")
    resolved = (run["out"] / "config.yaml").read_text()
    assert "partition_event: t=0s:groups=0-9:heal=0.1s;t=0.2s:groups=0-4" in resolved
    assert (run["out"] / "availability.jsonl").exists()
    # Apart: 0-9 | 10-19 for t < 0.1 s, whole until 0.2 s, then 0-4 | 5-19 to the end. The link_down drops
    # (44, 0 and 42 on seed 0) are each, by when they were sent, a message across the partition then in force.
    messages = _jsonl(run["out"] / "messages.jsonl")
    across_first = lambda m: (m["src"] < 10) != (m["dst"] < 10)  # noqa: E731
    across_second = lambda m: (m["src"] < 5) != (m["dst"] < 5)  # noqa: E731
    down = [m for m in messages if m["fate"] == "link_down"]
    assert len(down) == run["summary"]["dropped_link_down"]
    first = [m for m in down if m["t_send"] < 0.1]
    healed = [m for m in down if 0.1 <= m["t_send"] < 0.2]
    second = [m for m in down if m["t_send"] >= 0.2]
    assert first and all(map(across_first, first))
    assert healed == []
    assert second and all(map(across_second, second))
    # while each is in force it cuts every message across it (that a node going offline does not drop first)
    assert all(m["fate"] in ("link_down", "offline") for m in messages if m["t_send"] < 0.1 and across_first(m))
    assert all(m["fate"] in ("link_down", "offline") for m in messages if m["t_send"] >= 0.2 and across_second(m))
    # the first healed: across it but within one of the second's groups, messages arrive again
    assert any(m["fate"] == "delivered" for m in messages
               if m["t_send"] >= 0.1 and across_first(m) and not across_second(m))


# -- bad input ---------------------------------------------------------------------------

BAD = [
    (["--churn", "up=60s"], "--churn"),
    (["--churn", "up=1s,down=soon"], "--churn"),
    (["--churn", "up=1s,down=1s,immune=2"], "--churn"),
    (["--crash", "1.5@10s"], "--crash"),
    (["--crash", "0.5"], "--crash"),
    (["--availability", "/no/such/trace.csv"], "/no/such/trace.csv"),
    (["--link-failures", "down=1s"], "--link-failures"),
    (["--partition-event", "t=1s:groups=0-4|3-9"], "node 3"),
    (["--partition-event", "t=1s:groups=0-4|5-30"], "node 30"),
    (["--partition-event", "t=5s:groups=0-4:heal=2s"], "--partition-event"),
    (["--partition-event", "groups=0-4"], "--partition-event"),
    (["--topology-schedule", "resample:every=0"], "--topology-schedule"),
    (["--topology-schedule", "resample:every=2"], "random"),  # the default topology, mesh, is not random
    (["--topology-schedule", "one-peer-exponential", "--nodes", "1"], "--topology-schedule"),
    (["--topology-schedule", "/no/such/schedule.csv"], "/no/such/schedule.csv"),
    (["--uplink", "uniform:low=1Mbps"], "--uplink"),
]


@pytest.mark.parametrize("args,named", BAD)
def test_bad_scenario_input_exits_2_with_one_line(args, named, tmp_path, capsys):
    assert main(["--protocol", "gossip", "--quiet", "--out", str(tmp_path / "r"), *args]) == 2
    assert_one_line_error(capsys, named)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("content,named", [
    ("node,t_down\n0,1\n", "header"),
    ("node,t_down,t_up\n0,1s,0.5s\n", ":2: t_up must come after t_down"),
    ("node,t_down,t_up\n12,1,2\n", ":2: node 12 does not exist"),
    ("node,t_down,t_up\n0,1,5\n0,3,\n", ":3: node 0 is already down"),
    ("node,t_down,t_up\nzero,1,2\n", ":2:"),
])
def test_bad_availability_file_exits_2(content, named, tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text(content)
    assert main(["--protocol", "gossip", "--quiet", "--out", str(tmp_path / "r"), "--availability", str(trace)]) == 2
    assert_one_line_error(capsys, named)


def test_a_schedule_file_keeps_only_the_rounds_it_names(tmp_path):
    schedule = tmp_path / "far.csv"
    schedule.write_text("round,src,dst\n0,0,1\n1000000,1,2\n")
    far = topologies.schedules.FromFile(str(schedule))
    assert (far.period, sorted(far.graphs), far.num_nodes) == (1_000_001, [0, 1_000_000], 3)
    assert far.graph(1).number_of_edges() == 0 and list(far.graph(1_000_000).edges) == [(1, 2)]
    run = _run(tmp_path / "far", "--protocol", "gossip", "--rounds", "2", "--timeout", "0.05",
               "--topology-schedule", str(schedule))
    assert run["summary"]["messages_total"] == 2  # round 0: 0 <-> 1; round 1: no edges


def test_bad_schedule_file_exits_2(tmp_path, capsys):
    schedule = tmp_path / "s.csv"
    schedule.write_text("round,src,dst\n0,1,1\n")
    assert main(["--protocol", "gossip", "--quiet", "--out", str(tmp_path / "r"),
                 "--topology-schedule", str(schedule)]) == 2
    assert "s.csv:2: self-loop" in capsys.readouterr().err


def test_crash_at_time_zero_and_after_the_last_round(tmp_path):
    finished = []

    async def run(node):
        async for _ in node.rounds():
            await node.sleep(1.0)
        finished.append(node.id)

    emulation = emulate(run, nx.empty_graph(4), rounds=3, crash="0.5@0s")
    crashed = sorted(emulation.availability.crashed)
    assert len(crashed) == 2 and sorted(finished) == sorted(set(range(4)) - set(crashed))
    assert {r["node"] for r in emulation.rows} == set(range(4)) - set(crashed)
    late = emulate(run, nx.empty_graph(4), rounds=3, crash="1@5s")  # everyone is done by 3 s
    assert len(late.rows) == 12 and all(row["t"] == 3.0 for row in late.rows if row["round"] == 2)


@pytest.mark.parametrize("kind", ["schedule", "topology"])
def test_a_file_owns_the_node_count(tmp_path, capsys, kind):
    edges = [(i, (i + 1) % 12) for i in range(12)]
    if kind == "schedule":
        path = tmp_path / "ring.csv"
        path.write_text("round,src,dst\n" + "".join(f"0,{u},{v}\n" for u, v in edges))
        flags = ["--topology-schedule", str(path)]
    else:
        path = tmp_path / "ring.edgelist"
        path.write_text("".join(f"{u} {v}\n" for u, v in edges))
        flags = ["--topology", str(path)]
    unset = _run(tmp_path / "unset", "--protocol", "gossip", "--rounds", "1", *flags)
    assert unset["summary"]["nodes"] == 12
    agreeing = _run(tmp_path / "agree", "--protocol", "gossip", "--rounds", "1", "--nodes", "12", *flags)
    assert agreeing["summary"]["nodes"] == 12
    assert main(["--protocol", "gossip", "--quiet", "--out", str(tmp_path / "r"), "--nodes", "16", *flags]) == 2
    line = assert_one_line_error(capsys, "12 nodes")
    assert "16" in line and "unset" in line
    assert not (tmp_path / "r").exists()


def test_nodes_default_to_ten_without_a_file(tmp_path):
    assert _run(tmp_path / "r", "--protocol", "gossip", "--rounds", "1")["summary"]["nodes"] == 10
