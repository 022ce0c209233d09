"""The `emulate` command as a user runs it: run directory, trace invariants, reproducibility, bad input."""
import csv
import json
import re
import subprocess
import sys

import pytest
import yaml

from p2p_emulator.analysis.rundir import LINK_COLUMNS
from p2p_emulator.cli import main
from emulator.ledger import LINK_COUNTERS
from emulator.protocol import protocols
from tests.conftest import assert_one_line_error, assert_refused

GOSSIP = ["--topology", "ring", "--protocol", "gossip", "--nodes", "16", "--rounds", "20",
          "--latency", "10ms", "--bandwidth", "1Mbps", "--trace", "--quiet", "--no-plots"]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def gossip_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("r1")
    assert main(GOSSIP + ["--out", str(out)]) == 0
    return out


def test_run_directory_has_every_file_and_column(gossip_run):
    for name in ("config.yaml", "metrics.jsonl", "links.csv", "messages.jsonl", "summary.json"):
        assert (gossip_run / name).is_file(), name
    with open(gossip_run / "links.csv") as fh:
        links = list(csv.DictReader(fh))
    assert tuple(links[0]) == LINK_COLUMNS
    assert len(links) == 32  # a ring of 16 has 32 directed links
    metrics = _rows(gossip_run / "metrics.jsonl")
    assert len(metrics) == 16 * 20
    assert {"round", "node", "t", "error", "consensus_distance", "bytes_sent"} <= set(metrics[0])
    summary = json.loads((gossip_run / "summary.json").read_text())
    assert {"bytes_total", "messages_total", "wall_seconds", "emulated_seconds", "final"} <= set(summary)
    assert summary["bytes_total"] == sum(int(row["bytes_sent"]) for row in links)
    assert summary["final"]["error"] == pytest.approx(
        sum(r["error"] for r in metrics if r["round"] == 19) / 16)


def test_trace_respects_latency_plus_transmission(gossip_run):
    messages = _rows(gossip_run / "messages.jsonl")
    assert messages and all(m["fate"] == "delivered" for m in messages)
    idle_links = set()
    for m in sorted(messages, key=lambda m: m["t_send"]):
        floor = m["t_send"] + 0.010 + 8 * m["bytes"] / 1e6
        assert m["t_arrive"] >= floor - 1e-12
        if (m["src"], m["dst"]) not in idle_links:  # the first message on a link finds it idle
            assert m["t_arrive"] == pytest.approx(floor, abs=1e-12)
            idle_links.add((m["src"], m["dst"]))
    assert len(idle_links) == 32


def test_gossip_converges_to_the_mean(gossip_run):
    metrics = _rows(gossip_run / "metrics.jsonl")
    first = sum(r["error"] for r in metrics if r["round"] == 0)
    last = sum(r["error"] for r in metrics if r["round"] == 19)
    assert last < 0.5 * first


@pytest.mark.parametrize("topology", ["ring", "torus", "regular:d=4"])
def test_gossip_converges_on_connected_graphs(tmp_path, topology):
    assert main(["--protocol", "gossip", "--topology", topology, "--nodes", "16", "--rounds", "150",
                 "--quiet", "--no-plots", "--out", str(tmp_path)]) == 0
    final = json.loads((tmp_path / "summary.json").read_text())["final"]
    assert final["error"] < 1e-3


def test_same_seed_gives_identical_ledger_and_metrics(tmp_path):
    for name in ("a", "b"):
        assert main(GOSSIP + ["--topology", "er:p=0.3", "--loss", "0.1", "--latency", "normal:mean=10ms,std=5ms",
                              "--out", str(tmp_path / name)]) == 0
    for file in ("links.csv", "metrics.jsonl", "messages.jsonl"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file
    assert main(GOSSIP + ["--topology", "er:p=0.3", "--loss", "0.1", "--seed", "1", "--out", str(tmp_path / "c")]) == 0
    assert (tmp_path / "a" / "links.csv").read_bytes() != (tmp_path / "c" / "links.csv").read_bytes()


def test_config_file_reruns_and_flags_override_it(tmp_path, gossip_run):
    config = yaml.safe_load((gossip_run / "config.yaml").read_text())
    assert config["topology"] == "ring" and config["latency"] == "10ms" and config["dim"] == 16
    assert main(["--config", str(gossip_run / "config.yaml"), "--rounds", "3", "--out", str(tmp_path)]) == 0
    rerun = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert rerun == {**config, "rounds": 3, "out": str(tmp_path)}


def test_toml_config(tmp_path):
    (tmp_path / "run.toml").write_text('protocol = "gossip"\nnodes = 4\nrounds = 2\ntopology = "line"\n')
    assert main(["--config", str(tmp_path / "run.toml"), "--quiet", "--no-plots", "--out", str(tmp_path / "r")]) == 0
    config = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert (config["protocol"], config["nodes"], config["rounds"], config["topology"]) == ("gossip", 4, 2, "line")
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["nodes"] == 4
    assert len(_rows(tmp_path / "r" / "metrics.jsonl")) == 4 * 2


BAD_INPUT = [
    (["--nodes", "many"], "--nodes"),
    (["--latency", "fast"], "--latency"),
    (["--bandwidth=-3Mbps"], "--bandwidth: bandwidth '-3Mbps' must be positive"),  # "--bandwidth -3Mbps" is argparse's
    (["--loss", "1.5"], "--loss"),
    (["--clock", "sundial"], "--clock"),
    (["--topology", "moebius"], "moebius"),
    (["--topology", "regular:d=3", "--nodes", "5"], "regular"),
    (["--topology", "/no/such/graph.edgelist"], "/no/such/graph.edgelist"),
    (["--protocol", "telepathy"], "telepathy"),
    (["--config", "/no/such/config.yaml"], "/no/such/config.yaml"),
    (["--frobnicate"], "--frobnicate"),
    (["--dataset", "digits"], "--dataset"),  # gossip has no dataset
    (["--compress", "zip"], "--compress"),
    (["--seed", "-1"], "--seed"),
]


@pytest.mark.parametrize("args,named", BAD_INPUT)
def test_bad_input_exits_2_with_one_line(args, named, tmp_path, capsys):
    assert_refused(capsys, ["--protocol", "gossip", "--quiet", *args], named, tmp_path / "r")


def test_the_installed_command_prints_no_traceback(tmp_path):
    cmd = [sys.executable, "-m", "p2p_emulator.cli", "--protocol", "gossip", "--latency", "fast", "--out", str(tmp_path / "r")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == "emulate: error: --latency: unknown latency model 'fast' (use a duration, uniform, normal or lognormal)"
    assert not (tmp_path / "r").exists()


def test_bad_config_value_exits_2(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("protocol: gossip\nrounds: lots\n")
    assert_refused(capsys, ["--config", str(tmp_path / "bad.yaml")], "--rounds 'lots'", tmp_path / "r")


def test_list_protocols(capsys):
    assert main(["--list-protocols"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert sorted(listed) == sorted(protocols()) and {"gossip", "dfedavgm", "dpsgd", "local"} <= set(listed)


LEARNING_BAD_INPUT = [
    (["--dataset", "fashion-mnist", "--data-root", "{tmp}/empty"], "{tmp}/empty"),
    (["--dataset", "cifar10", "--data-root", "{tmp}/empty"], "--download"),
    (["--dataset", "imagenet"], "imagenet"),
    (["--partition", "mapl:scenario=7"], "scenario"),
    (["--partition", "mapl:scenario=1,clusters=3"], "clusters"),
    (["--model", "transformer-xxl"], "transformer-xxl"),
    (["--norm", "layer"], "layer"),
    (["--mixing", "average"], "--mixing"),
    (["--model", "hetero-small"], "same architecture"),
]


@pytest.mark.parametrize("args,named", LEARNING_BAD_INPUT)
def test_bad_workload_input_exits_2_with_one_line(args, named, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert_refused(capsys, ["--protocol", "dfedavgm", "--nodes", "4", "--rounds", "1", "--quiet", "--no-plots", *args],
                   named.replace("{tmp}", str(tmp_path)), tmp_path / "r")


def test_rounds_zero_builds_partition_and_evaluates_once(tmp_path):
    out = tmp_path / "r"
    assert main(["--protocol", "local", "--dataset", "fashion-mnist", "--partition", "mapl:scenario=1",
                 "--nodes", "20", "--model", "hetero-small", "--rounds", "0", "--quiet", "--no-plots",
                 "--out", str(out)]) == 0
    partition = json.loads((out / "partition.json").read_text())
    assert [n["model"] for n in partition["nodes"][:4]] == ["cnn-small", "small-resnet", "small-dwsep", "small-mixer"]
    for n in partition["nodes"]:
        classes = range(5) if n["node"] < 10 else range(5, 10)
        assert n["cluster"] == (0 if n["node"] < 10 else 1)
        assert n["train"] == {str(c): 300 for c in classes} and n["test"] == {str(c): 15 for c in classes}
    metrics = _rows(out / "metrics.jsonl")
    assert sorted((r["round"], r["node"]) for r in metrics) == [(0, node) for node in range(20)]  # once, each
    assert all(0 <= r["test_acc"] <= 1 and 75 * r["test_acc"] == pytest.approx(round(75 * r["test_acc"]))
               for r in metrics)  # a share of its 5 x 15 test samples
    assert json.loads((out / "summary.json").read_text())["messages_total"] == 0


def _help_defaults(text: str, protocol: str, flag: str) -> str:
    section = " ".join(text.split(f"protocol options ({protocol})")[1].split("protocol options (")[0].split())
    return re.search(rf"{flag} \S+ .*?\(default: ([^)]*)\)", section).group(1)


def test_help_shows_every_protocols_own_defaults(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(f"protocol options ({name})" in text for name in protocols())
    assert [_help_defaults(text, name, "--lr") for name in ("dfedavgm", "mapl", "l2c")] == ["0.05", "0.003", "0.01"]
    assert [_help_defaults(text, name, "--timeout") for name in ("dfedavgm", "gossip")] == ["auto", "5.0"]


def test_help_for_one_protocol_shows_only_its_options(capsys):
    assert main(["--protocol", "gossip", "--help"]) == 0
    text = capsys.readouterr().out
    assert "protocol options (gossip)" in text and "--dim" in text
    assert "protocol options (mapl)" not in text and "--lr" not in text


def test_links_csv_columns_are_the_ledgers_counters():
    assert LINK_COLUMNS == ("src", "dst", *LINK_COUNTERS)


def test_a_flag_of_another_protocol_is_an_error_naming_both(tmp_path, capsys):
    assert main(["--protocol", "local", "--mixing", "uniform", "--out", str(tmp_path / "r")]) == 2
    line = assert_one_line_error(capsys, "--mixing")
    assert "'local'" in line and "dfedavgm" in line
    assert main(["--protocol", "gossip", "--lr", "0.1", "--out", str(tmp_path / "r")]) == 2
    assert "'gossip'" in assert_one_line_error(capsys, "--lr")
    assert not (tmp_path / "r").exists()
