"""Baselines as the literature runs them: one x0, the whole test split, shaped models, input scaling."""
import importlib.util
import json
from pathlib import Path

import networkx as nx
import pytest
import torch

from emulator.seeds import Seeds
from p2p_emulator.cli import main
from emulator.protocol import RunInfo
from p2p_emulator.workloads.datasets import load_dataset
from p2p_emulator.workloads.models import build_model, parameter_count
from p2p_emulator.workloads.task import Workload, WorkloadOptions
from p2p_emulator.workloads.training import float_state

from tests.conftest import assert_one_line_error

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "global_fedavg.py"
DIGITS_TEST = len(load_dataset("digits").test_y)


def _workload(tmp_path, nodes=4, **options) -> Workload:
    run_info = RunInfo(nodes, 1, Seeds(0), nx.complete_graph(nodes), "cpu", tmp_path)
    return Workload(WorkloadOptions(**options), run_info)


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("model", ["cnn-small", "mlp", "mlp:hidden=64"])
def test_common_start_gives_every_node_one_x0_and_independent_does_not(tmp_path, model):
    common = _workload(tmp_path, model=model, init="common")
    states = [float_state(common.model(i)) for i in range(4)]
    assert all(_same(states[0], s) for s in states[1:])
    independent = _workload(tmp_path, model=model, init="independent")
    others = [float_state(independent.model(i)) for i in range(4)]
    assert not any(_same(state, states[0]) for state in others)  # x0 is a draw of its own
    assert not any(_same(others[0], s) for s in others[1:])


@pytest.mark.parametrize("partition,expected", [("iid", "global"), ("dirichlet:alpha=0.5", "global"),
                                                ("mapl:scenario=1", "local"), ("shards:n=2", "local"),
                                                ("classes:k=2", "local")])
def test_auto_test_set_is_global_for_iid_and_dirichlet_only(tmp_path, partition, expected):
    workload = _workload(tmp_path, partition=partition)
    assert workload.test_set == expected
    assert json.loads((tmp_path / "partition.json").read_text())["test_set"] == expected
    sizes = {len(workload.data(i).test_y) for i in range(4)}
    assert (sizes == {DIGITS_TEST}) == (expected == "global")


def test_global_test_split_is_the_whole_split_and_shared(tmp_path):
    workload = _workload(tmp_path, nodes=16, test_set="global", partition="mapl:scenario=1")
    first, second = workload.data(0), workload.data(15)
    assert len(first.test_y) == DIGITS_TEST and first.test_x is second.test_x  # one copy for all nodes


@pytest.mark.parametrize("mode,low,high", [("max", 0.0, 1.0), ("none", 0.0, 255.0)])
def test_normalize_scales_inputs(tmp_path, mode, low, high):
    x = _workload(tmp_path, normalize=mode).data(0).train_x
    assert x.min() == low and x.max() == high
    standard = _workload(tmp_path).data(0).train_x
    assert abs(standard.mean()) < 0.2 and standard.max() > 1.5


@pytest.mark.parametrize("spec,layers", [("mlp:hidden=64", [(64, 64), (10, 64)]),
                                         ("mlp:hidden=64,32", [(64, 64), (32, 64), (10, 32)])])
def test_shaped_mlp_is_the_literature_mlp_with_biases(spec, layers):
    model = build_model(spec, (1, 8, 8), 10)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [tuple(m.weight.shape) for m in linears] == layers
    assert all(m.bias is not None for m in linears)
    assert not hasattr(model, "projection")
    assert parameter_count(model) == sum(o * i + o for o, i in layers)


def test_shaped_cnn_has_the_asked_widths():
    model = build_model("cnn-small:channels=8,16,24", (1, 8, 8), 10, d_z=32)
    convs = [m.out_channels for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs == [8, 16, 24]
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize("flags,named", [
    (["--model", "mlp:hidden=0"], "positive integers"),
    (["--model", "mlp:width=64"], "mlp:hidden"),
    (["--model", "resnet18:hidden=64"], "take parameters"),
    (["--model", "cnn-small:channels=8,8,8,8"], "at most 3"),
    (["--init", "shared"], "--init"),
    (["--test-set", "all"], "--test-set"),
    (["--normalize", "minmax"], "--normalize"),
    (["--eval-every", "0"], "--eval-every"),
    (["--model", "hetero-small"], "dfedavgm averages models"),
])
def test_bad_baseline_settings_exit_2_with_one_line(tmp_path, capsys, flags, named):
    assert main(["--protocol", "dfedavgm", "--rounds", "1", "--quiet", "--out", str(tmp_path / "r"), *flags]) == 2
    assert_one_line_error(capsys, named)


def test_hidden_is_no_longer_a_dfedavgm_flag(tmp_path, capsys):
    assert main(["--protocol", "dfedavgm", "--hidden", "64", "--out", str(tmp_path / "r")]) == 2
    assert_one_line_error(capsys, "--hidden")


def _reference():
    spec = importlib.util.spec_from_file_location("global_fedavg", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("nodes,rounds,seed", [(8, 3, 0), (16, 4, 1), (32, 2, 2)])
def test_global_averaging_matches_a_plain_fedavg_loop(tmp_path, nodes, rounds, seed):
    """dfedavgm on a mesh with uniform mixing is FedAvg: same accuracy as a bare loop within a point."""
    bench = _reference()
    out = tmp_path / "r"
    assert main(["--protocol", "dfedavgm", "--topology", "mesh", "--mixing", "uniform", "--nodes", str(nodes),
                 "--rounds", str(rounds), "--seed", str(seed), *bench.WORKLOAD, "--quiet", "--no-plots",
                 "--out", str(out)]) == 0
    ours = json.loads((out / "summary.json").read_text())["final"]
    assert ours["test_acc_std"] < 1e-9  # every node holds the global average
    assert ours["test_acc"] == pytest.approx(bench.reference(nodes, rounds, seed)["acc"], abs=0.01)
