"""Counted compute time: work counted from the model, priced by a device profile (docs/compute-model.md)."""
import json

import pytest
import torch

from emulator.work import Work
from p2p_emulator.cli import main
from p2p_emulator.workloads import profiles
from p2p_emulator.workloads.models import build_model
from p2p_emulator.workloads.work import model_work
from tests.conftest import assert_refused

RUN = ["--protocol", "dfedavgm", "--topology", "ring", "--nodes", "4", "--rounds", "2", "--dataset", "digits",
       "--model", "mlp:hidden=16", "--quiet", "--no-plots"]


def _work(spec, shape, classes=10, vocabulary=0):
    model = build_model(spec, shape, classes, vocabulary=vocabulary)
    x = torch.randint(0, vocabulary, (6, *shape)) if vocabulary else torch.randn(6, *shape)
    return model_work(model, x, torch.randint(0, classes, (6,)))


def test_training_work_counts_the_models_flops_forward_and_backward():
    """A linear layer's training step is 2*in*out FLOPs per sample forward and twice that backward (the input
    needs no gradient: the first layer's backward is the weight gradient only, 2*in*out); an LSTM layer of H units
    reading I is 2*4H*(I+H) per step forward, counted although torch's formulas see nothing of oneDNN's kernel."""
    mlp = _work("mlp:hidden=16", (64,))
    per_sample = mlp.training(100, 10).matmul_flops / 100
    first, second = 2 * 64 * 16, 2 * 16 * 10  # forward of each linear layer, per sample
    assert per_sample == first * 2 + second * 3  # forward + weight gradient (+ the second's input gradient)
    assert mlp.training(100, 10).steps == 10 and mlp.training(101, 10).steps == 11
    assert mlp.scoring(100).matmul_flops == pytest.approx(100 * (first + second))
    lstm = _work("char-lstm:hidden=32", (80,), 80, 80).scoring(1)
    layers = 2 * 4 * 32 * ((8 + 32) + (32 + 32))  # two layers: the first reads the 8-dimensional embedding
    assert lstm.recurrent_flops == pytest.approx(80 * layers)


def test_a_profile_prices_each_count_and_a_flops_figure_scales_the_reference():
    work = Work(kernels=10, matmul_flops=1e9, reference_seconds=0.5)
    ref = profiles.REFERENCE
    assert ref.seconds(work) == pytest.approx(10 * ref.kernels + 1e9 * ref.matmul_flops + 0.5)
    half = profiles.profile(repr(profiles.REFERENCE_FLOPS / 2))
    assert half.seconds(work) == pytest.approx(2 * ref.seconds(work))
    assert profiles.profile("12G").matmul_flops == pytest.approx(1 / 12e9 * profiles.REFERENCE_FLOPS
                                                                 * ref.matmul_flops)


def _metrics(out):
    return [(out / name).read_bytes() for name in ("metrics.jsonl", "links.csv")]


def test_the_reference_profile_gives_the_same_run_whatever_this_host_measures(tmp_path, monkeypatch):
    """Another host's calibration (faked: ten times slower) moves --compute-profile host runs, never the default."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main([*RUN, "--out", str(tmp_path / "before")]) == 0
    slow = profiles.REFERENCE.scaled(0.1, "host")
    monkeypatch.setattr(profiles, "calibrate", lambda: slow)
    assert main([*RUN, "--compute-profile", "host", "--out", str(tmp_path / "host")]) == 0
    assert main([*RUN, "--out", str(tmp_path / "after")]) == 0
    assert _metrics(tmp_path / "before") == _metrics(tmp_path / "after")
    busy = {name: json.loads((tmp_path / name / "summary.json").read_text())["node_time"]["compute_seconds"]
            for name in ("before", "host")}
    assert busy["host"] == pytest.approx([10 * s for s in busy["before"]])
    assert profiles.host_key() in json.loads(profiles.cache_path().read_text())  # calibrated once, cached


def test_a_profile_file_slows_the_nodes_it_names(tmp_path):
    fleet = tmp_path / "fleet.csv"
    fleet.write_text(f"node,profile\n2,{profiles.REFERENCE_FLOPS / 10!r}\n")
    for name, extra in (("even", []), ("fleet", ["--compute-profile", str(fleet)])):
        assert main([*RUN, *extra, "--out", str(tmp_path / name)]) == 0
    busy = {name: json.loads((tmp_path / name / "summary.json").read_text())["node_time"]["compute_seconds"]
            for name in ("even", "fleet")}
    assert busy["fleet"][2] > 5 * busy["even"][2]
    assert [busy["fleet"][i] for i in (0, 1, 3)] == pytest.approx([busy["even"][i] for i in (0, 1, 3)])


@pytest.mark.parametrize("argv, named", [
    (["--compute-time", "model"], "renamed per-sample"),
    (["--compute-profile", "fast"], "--compute-profile"),
    (["--compute-profile=-3G"], "positive"),
])
def test_bad_compute_settings_are_refused_in_one_line(capsys, tmp_path, argv, named):
    assert_refused(capsys, [*RUN, *argv], named, tmp_path / "r")


def test_a_profile_file_naming_a_node_the_run_lacks_is_refused(capsys, tmp_path):
    fleet = tmp_path / "fleet.csv"
    fleet.write_text("node,profile\n7,host\n")
    assert_refused(capsys, [*RUN, "--compute-profile", str(fleet)], "node 7", tmp_path / "r")


def test_a_synchronous_protocol_waits_out_its_slowest_neighbours_compute(tmp_path):
    """A straggler's round (4 x 1 s per training sample, minutes) outlasts --timeout 60 and the auto timer: the wait
    is lengthened by the longest round of compute, so every node hears both ring neighbours every round."""
    for given in ("60", "auto"):
        out = tmp_path / given
        assert main([*RUN, "--compute-time", "per-sample", "--compute-cost", "1s", "--compute-speed",
                     "stragglers:fraction=0.25,slowdown=4", "--timeout", given, "--out", str(out)]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [row["heard_from"] for row in rows] == [2] * 8
        timeout = json.loads((out / "summary.json").read_text())["timeout"]
        assert timeout["longest_compute"] > 60
        if given == "60":
            assert timeout["given"] == 60
            assert timeout["waited"] == pytest.approx(timeout["given"] + timeout["longest_compute"])
        else:
            assert timeout["given"] == "auto" and timeout["waited"].startswith("auto + ")
