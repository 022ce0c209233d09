"""What large runs rely on: models without what their protocol never uses, shared frames, runs that
keep their results, and a start that loads no more than the run needs."""
import json
import math
import subprocess
import sys

import networkx as nx
import numpy as np
import pytest

from p2p_emulator.analysis.rundir import final_metrics
from p2p_emulator.cli import main
from emulator import wire
from emulator.protocol import RunInfo, protocols
from emulator.seeds import Seeds
from tests.conftest import network, nodes


def _protocol(name: str, tmp_path, **options):
    cls = protocols()[name]
    run_info = RunInfo(4, 1, Seeds(0), nx.complete_graph(4), "cpu", tmp_path)
    return cls(cls.Options(**options), run_info)


def _parameter_names(model) -> set[str]:
    return {name.split(".")[0] for name, _ in model.named_parameters()}


@pytest.mark.parametrize("name", ["dfedavgm", "dpsgd", "local", "l2c", "gossip-learning"])
def test_models_carry_no_projection_head_unless_mapl_builds_them(tmp_path, name):
    model = _protocol(name, tmp_path, model="mlp").workload.model(0)
    assert _parameter_names(model) == {"backbone", "classifier"}


def test_mapl_models_carry_the_projection_head(tmp_path):
    model = _protocol("mapl", tmp_path, model="mlp", d_p=8, projection_hidden=16).workload.model(0)
    assert _parameter_names(model) == {"backbone", "projection", "classifier"}
    assert model.projection[-1].out_features == 8


# -- frames ----------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("k", [1, 3, 6])
async def test_a_broadcast_encodes_once_and_receivers_decode_their_own_copies(clock, monkeypatch, k):
    calls = []
    encode = wire.encode
    monkeypatch.setattr(wire, "encode", lambda *a, **kw: calls.append(1) or encode(*a, **kw))
    net = network(clock, nx.star_graph(k))
    hub, *leaves = nodes(net)
    hub.broadcast("x", {"v": np.zeros(250, np.float32)})
    await hub.sleep(1.0)
    waiting = [net.mailboxes[leaf.id].messages[0] for leaf in leaves]
    assert len(calls) == 1 and len({id(m.frame) for m in waiting}) == 1  # one frame, shared
    assert all(m.body is None for m in waiting)  # nothing decoded before the receiver takes it
    bodies = [(await leaf.recv(timeout=0)).body for leaf in leaves]
    bodies[0]["v"][0] = 7  # a receiver's copy is its own
    assert all(not body["v"].any() for body in bodies[1:])
    assert all(m.frame is None for m in waiting)  # taken: the frame reference goes
    assert net.ledger.totals()["bytes_delivered"] == k * waiting[0].size


@pytest.mark.asyncio
async def test_a_frame_that_fails_to_decode_when_taken_is_a_corrupt_drop_not_a_delivery(clock):
    net = network(clock, nx.path_graph(2))
    _, receiver = nodes(net)
    net.transmit(0, 1, "x", 0, wire.encode(["y", 0, 1]))  # intact bytes, but tagged as another kind
    await receiver.sleep(1.0)
    assert net.ledger.totals()["messages_delivered"] == 1
    assert await receiver.recv(timeout=0) is None
    totals = net.ledger.totals()
    assert (totals["messages_delivered"], totals["bytes_delivered"], totals["dropped_corrupt"]) == (0, 0, 1)
    assert net.ledger.node_round(1, 0)["msgs_received"] == 0


# -- runs that keep their results ---------------------------------------------------------


def test_nodes_without_test_samples_report_no_accuracy_and_the_run_finishes(tmp_path):
    # digits holds 359 test samples: an iid local split over 380 nodes leaves 21 with none
    status = main(["--protocol", "local", "--nodes", "380", "--rounds", "1", "--model", "mlp:hidden=8",
                   "--partition", "iid", "--test-set", "local", "--quiet", "--no-plots", "--out", str(tmp_path)])
    assert status == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reporting = [row["test_acc"] for row in rows if "test_acc" in row]
    assert len(reporting) == 359
    final = json.loads((tmp_path / "summary.json").read_text())["final"]
    assert final["test_acc_nodes"] == 359 and final["test_acc"] == pytest.approx(sum(reporting) / 359)


@pytest.mark.parametrize("nodes_count,missing", [(1, 0), (5, 2), (50, 49), (200, 10)])
def test_final_metrics_are_taken_over_the_nodes_that_report_them(nodes_count, missing):
    rows = [{"round": 0, "node": i, "test_acc": 0.0} for i in range(nodes_count)]
    rows += [{"round": 1, "node": i, **({"test_acc": i / nodes_count} if i >= missing else {}),
              "error": math.nan if i % 2 else 1.0} for i in range(nodes_count)]
    final = final_metrics(rows)
    values = [i / nodes_count for i in range(missing, nodes_count)]
    assert final["test_acc_nodes"] == len(values) and final["test_acc"] == pytest.approx(sum(values) / len(values))
    assert final["test_acc_worst10"] == pytest.approx(values[0] if len(values) < 20 else
                                                      sum(values[:len(values) // 10]) / (len(values) // 10))
    assert final["error"] == 1.0 and all(math.isfinite(v) for v in final.values())


def test_a_failure_after_the_last_round_still_writes_the_run_directory(tmp_path, monkeypatch, capsys):
    gossip = protocols()["gossip"]

    def broken(self, records):
        raise KeyError("oops")

    monkeypatch.setattr(gossip, "summary", broken)
    status = main(["--protocol", "gossip", "--nodes", "6", "--rounds", "3", "--quiet", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1 and "gossip summary failed: KeyError" in err[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["final"]["error"] >= 0 and "KeyError" in summary["errors"][0]
    assert (tmp_path / "plots").is_dir()


# -- start-up ---------------------------------------------------------------------------------

HEAVY = ("torch", "torchvision", "matplotlib")


@pytest.mark.parametrize("argv", [["--list-protocols"], ["--help"], ["--protocol", "mapl", "--help"],
                                  ["--protocol", "gossip", "--nodes", "8", "--rounds", "2", "--quiet", "--no-plots"]])
def test_help_listing_and_gossip_import_no_torch_or_matplotlib(tmp_path, argv):
    argv = [*argv, "--out", str(tmp_path)] if "--nodes" in argv else argv
    script = ("import sys, contextlib, io\nfrom p2p_emulator.cli import main\n"
              f"with contextlib.redirect_stdout(io.StringIO()):\n    status = main({argv!r})\n"
              f"print(status, sorted(m for m in {HEAVY!r} if m in sys.modules))")
    printed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert printed.strip() == "0 []"


@pytest.mark.parametrize("protocol, model, rounds, loaded", [
    ("dfedavgm", "mlp", 0, ["torch"]),
    ("local", "hetero-small", 0, ["torch", "torch._dynamo", "torchvision"]),  # small-resnet, small-dwsep: its blocks
    ("dfedavgm", "mlp", 1, ["torch", "torch._dynamo"]),
])
def test_a_learning_run_imports_only_what_it_uses_and_before_its_nodes_start(tmp_path, protocol, model, rounds, loaded):
    """torchvision only for the architectures built from its blocks; matplotlib (and plots) never for a run of
    no rounds; torch._dynamo, which torch.optim imports with the first optimizer (about a second), before the
    nodes start when they train: inside their first jobs that second would be measured and charged to them, and
    never without training (counting a model's work runs no optimizer). scikit-learn never: the digits are read
    from its file, as its import takes longer than a small run."""
    argv = ["--protocol", protocol, "--dataset", "digits", "--nodes", "4", "--rounds", str(rounds), "--model", model,
            "--quiet", "--out", str(tmp_path), *(["--no-plots"] if rounds else [])]
    modules = (*HEAVY, "torch._dynamo", "sklearn")
    script = ("import sys\nfrom emulator.emulation import Emulation\nfrom p2p_emulator.cli import main\nrun = Emulation.run\n"
              "def watched(self):\n"
              f"    print('at start', sorted(m for m in {modules!r} if m in sys.modules))\n"
              "    return run(self)\n"
              f"Emulation.run = watched\nstatus = main({argv!r})\n"
              f"print('at end', status, sorted(m for m in {modules!r} if m in sys.modules))")
    printed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert f"at start {loaded!r}" in printed
    assert f"at end 0 {loaded!r}" in printed
    if not rounds:
        assert not (tmp_path / "plots").exists()  # no rounds, no curve to draw
