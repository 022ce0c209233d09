"""A real transport: the same protocol file, each node its own process, frames over loopback TCP."""
import json
import os
import subprocess
import sys

import pytest

import p2p_emulator
from p2p_emulator import testbed, transport
from p2p_emulator.analysis.rundir import read_jsonl
from p2p_emulator.cli import main

SETTINGS = dict(protocol="gossip", topology="ring", nodes=3, rounds=3, latency="30ms", quiet=True, no_plots=True,
                trace=True)


def test_tcp_run_carries_the_emulated_ledger_and_results(tmp_path):
    emulated = p2p_emulator.run(**SETTINGS, out=str(tmp_path / "emulated"))
    real = p2p_emulator.run(**SETTINGS, transport="tcp", out=str(tmp_path / "tcp"),
                            log_to=f"tensorboard:{tmp_path / 'tb'}")
    # Payload bytes per link, counted by the sender and the receiver's sockets, equal the emulated ledger's.
    assert (real.out_dir / "links.csv").read_text() == (emulated.out_dir / "links.csv").read_text()
    # Same seed, same protocol file, same frames: the same values and metrics, whatever the timing; only the
    # observer's metrics across nodes are missing (no process sees every node's state).
    observed = {"t", "error", "consensus_distance"}
    assert set(emulated.metrics[0]) - set(real.metrics[0]) == observed - {"t"}
    assert ([{k: v for k, v in r.items() if k not in observed} for r in real.metrics]
            == [{k: v for k, v in r.items() if k not in observed} for r in emulated.metrics])
    messages = read_jsonl(real.out_dir / "messages.jsonl")
    assert len(messages) == 3 * 2 * 3 and {m["fate"] for m in messages} == {"delivered"}
    # The latency is held by the receiver: no message arrives sooner than 30 ms after it was sent (less the
    # skew of the processes' clocks, which share the wall clock's time zero).
    assert min(m["t_arrive"] - m["t_send"] for m in messages) >= 0.029
    assert real.summary["transport"] == "tcp" and real.summary["framing_bytes"] > 0
    assert sorted(p.name for p in (real.out_dir / "nodes").iterdir()) == ["0", "0.log", "1", "1.log", "2", "2.log"]
    assert [p.name for p in (tmp_path / "tb").iterdir()] == ["tcp"]  # the merged run is logged, not each node
    # emulate merge rebuilds the same run directory from the nodes' own directories.
    links = (real.out_dir / "links.csv").read_text()
    (real.out_dir / "links.csv").unlink()
    assert main(["merge", str(real.out_dir)]) == 0
    assert (real.out_dir / "links.csv").read_text() == links
    assert json.loads((real.out_dir / "summary.json").read_text())["bytes_total"] == emulated.summary["bytes_total"]


def test_settings_only_an_emulated_network_has_are_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--transport", "tcp", "--churn", "0.1", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == ("emulate: error: --churn 0.1: not with --transport tcp (a real "
                                               "network's own loss and timing apply; see docs/validation.md)")
    assert not out.exists()


@pytest.mark.skipif(testbed.unavailable() is not None, reason=f"namespaces: {testbed.unavailable()}")
def test_shaped_run_in_namespaces_carries_the_emulated_bytes_at_the_shaped_rate(tmp_path):
    shaped = dict(SETTINGS, dim=25_000, uplink="8Mbps", latency="5ms", timeout=1000.0)  # 200 kB frames
    emulated = p2p_emulator.run(**shaped, link_overhead="tcp", link_sharing="fair", out=str(tmp_path / "emulated"))
    real = p2p_emulator.run(**shaped, transport="netns", out=str(tmp_path / "netns"))
    assert (real.out_dir / "links.csv").read_text() == (emulated.out_dir / "links.csv").read_text()
    # Each node sends its two 200 kB frames through its own 8 Mbit/s uplink: the kernel's shaper, not loopback
    # speed, sets the pace (0.42 s a round with headers). Wall time only adds to it.
    rounds = [max(r["t"] for r in real.metrics if r["round"] == k) for k in range(3)]
    assert rounds[-1] >= 0.97 * emulated.summary["emulated_seconds"]
    assert not [name for name in testbed._namespaces() if name.startswith(f"{testbed.PREFIX}{os.getpid()}")]


def test_nodes_started_on_their_own_then_merged(tmp_path):
    """What one would run on two machines: each node with the run's settings and its peers' addresses."""
    settings = dict(SETTINGS, topology="line", nodes=2)
    emulated = p2p_emulator.run(**settings, out=str(tmp_path / "emulated"))
    ports = transport._free_ports(2)
    peers = tmp_path / "peers.csv"
    peers.write_text("node,host,port\n" + "".join(f"{i},127.0.0.1,{port}\n" for i, port in enumerate(ports)))
    run = tmp_path / "run"
    nodes = [subprocess.Popen([sys.executable, "-m", "p2p_emulator.cli", "node", "--config",
                               str(emulated.out_dir / "config.yaml"), "--id", str(i), "--listen",
                               f"127.0.0.1:{ports[i]}", "--peers", str(peers), "--out", str(run / "nodes" / str(i))])
             for i in range(2)]
    assert [node.wait(timeout=120) for node in nodes] == [0, 0]
    assert main(["merge", str(run)]) == 0
    assert (run / "links.csv").read_text() == (emulated.out_dir / "links.csv").read_text()


def test_a_node_refuses_an_id_or_peers_its_run_does_not_have(tmp_path, capsys):
    emulated = p2p_emulator.run(**dict(SETTINGS, rounds=1), out=str(tmp_path / "emulated"))
    peers = tmp_path / "peers.csv"
    peers.write_text("node,host,port\n0,127.0.0.1,7100\n")
    node = ["node", "--config", str(emulated.out_dir / "config.yaml"), "--listen", "127.0.0.1:7101", "--peers",
            str(peers), "--out", str(tmp_path / "node")]
    assert main([*node, "--id", "1"]) == 2
    assert main([*node, "--id", "3"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "emulate: error: --peers: no address for node 2, an out-neighbour of node 1",
        "emulate: error: --id 3: the run's nodes are 0..2"]
    assert not (tmp_path / "node").exists()
