"""Emulated time in the analysis: curves over the ticks of samples.jsonl (--eval-every-seconds), the report's
and a study's time columns, and the plots of time, bytes and idle fraction; checked on hand-made run directories
whose numbers are known, one small real run, and a run directory written before samples existed."""
import csv
import io
import json
import math

import numpy as np
import pytest
from rich.console import Console

from p2p_emulator import run
from p2p_emulator.analysis.plots import idle_figures, plot_run
from p2p_emulator.analysis.report import CSV_HEADERS, HEADERS, headers
from p2p_emulator.analysis.rundir import RunDirError, RunDirWriter, read_run
from p2p_emulator.analysis.study import StudyError, StudyRun, parse_metric, parse_table, tabulate
from p2p_emulator.cli import main

PNG = b"\x89PNG\r\n\x1a\n"
TICKS = [0.5, 1.0, 1.5, 2.0]
# node -> test_acc at each tick: the means over nodes are 0.2, 0.5, 0.7 and 0.9 (node 2 is not scored at 2.0)
ACC = {0: [0.1, 0.4, 0.6, 0.8], 1: [0.3, 0.6, 0.8, 1.0], 2: [0.2, 0.5, 0.7, None]}
SENT = {0: [100, 200, 300, 400], 1: [10, 20, 30, 40], 2: [1, 2, 3, None]}  # each node's bytes so far
IDLE = [0.5, 0.25, 0.0]


def _run_dir(path, samples=True, node_time=True, staleness=True):
    """A finished 3-node run of 2 rounds; optionally samples.jsonl, node_time and staleness in summary.json."""
    path.mkdir()
    writer = RunDirWriter(path)
    writer.config({"protocol": "dpsgd", "topology": "ring", "nodes": 3, "eval_every_seconds": 0.5})
    writer.jsonl("metrics.jsonl", [{"round": rnd, "node": i, "t": 1.0 * (rnd + 1), "test_acc": 0.3 + 0.2 * rnd,
                                    "bytes_sent": 50} for rnd in range(2) for i in range(3)])
    if samples:
        writer.jsonl("samples.jsonl", [
            {"t": t, "node": i, "step": k, "test_acc": ACC[i][k], "test_loss": 2.0 - ACC[i][k],
             "bytes_sent": SENT[i][k], "bytes_received": 0}
            for k, t in enumerate(TICKS) for i in range(3) if ACC[i][k] is not None])
    summary = {"protocol": "dpsgd", "nodes": 3, "rounds": 2, "bytes_total": 444, "emulated_seconds": 2.0,
               "wall_seconds": 0.1, "final": {"test_acc": 0.5}}
    if node_time:
        summary["node_time"] = {"compute_seconds": [1.0, 1.5, 2.0], "idle_seconds": [1.0, 0.5, 0.0],
                                "send_seconds": [0.0, 0.0, 0.0], "idle_fraction": IDLE}
    if staleness:
        summary["staleness"] = {"count": 6, "mean": 1.5, "median": 1.0, "p90": 3, "max": 4}
    writer.finish(summary)
    return path


@pytest.fixture
def sampled(tmp_path):
    return _run_dir(tmp_path / "sampled")


@pytest.fixture
def old(tmp_path):
    """A run directory from before emulated time was an axis: no samples, no node_time, no staleness."""
    return _run_dir(tmp_path / "old", samples=False, node_time=False, staleness=False)


def _csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _is_png(path):
    return path.is_file() and path.read_bytes()[:8] == PNG


# -- curves over time -----------------------------------------------------------------------------------------------

def test_curves_over_time_have_a_column_per_tick(sampled):
    r = read_run(sampled)
    assert [row["t"] for row in r.samples()][:3] == [0.5, 0.5, 0.5]
    timed = r.curves(axis="time")
    assert timed.metric == "test_acc" and timed.axis == "time"
    assert timed.x.tolist() == TICKS
    assert timed.mean == pytest.approx([0.2, 0.5, 0.7, 0.9])
    assert np.isnan(timed.values[2, 3])  # node 2 has no row at the last tick ...
    assert timed.cumulative_bytes.tolist() == [111, 222, 333, 443]  # ... but what it sent still counts
    by_round = r.curves()  # the round axis is what it was; x = the round numbers
    assert by_round.axis == "round" and by_round.x.tolist() == by_round.rounds.tolist() == [0, 1]
    assert by_round.mean == pytest.approx([0.3, 0.5])


@pytest.mark.parametrize("target, tick", [(0.5, 1), (0.51, 2), (0.7, 2), (0.9, 3), (0.1, 0)])
def test_time_to_target_is_the_first_tick_whose_mean_reaches_it(sampled, target, tick):
    assert read_run(sampled).time_to_target("test_acc", target) == (TICKS[tick], [111, 222, 333, 443][tick])


def test_a_target_never_reached_and_a_loss_reached_from_above(sampled):
    r = read_run(sampled)
    assert r.time_to_target("test_acc", 0.95) is None
    assert r.time_to_target("test_loss", 1.3) == (1.5, 333)  # mean loss 1.8, 1.5, 1.3, 1.1: at most 1.3


@pytest.mark.parametrize("at, expected", [(0.5, 0.2), (1.49, 0.5), (1.5, 0.7), (99, 0.9), (0.4, math.nan)])
def test_the_value_at_a_time_is_the_last_tick_at_or_before_it(sampled, at, expected):
    assert read_run(sampled).value_at(at) == pytest.approx(expected, nan_ok=True)


def test_a_run_without_samples_has_no_time_curves_and_keeps_its_round_target(old):
    r = read_run(old)
    assert r.samples() is None and r.curves(axis="time") is None and math.isnan(r.value_at(1.0))
    assert r.time_to_target("test_acc", 0.5) == (2.0, 300)  # the end of round 1, the bytes of rounds 0 and 1
    assert math.isnan(r.idle_fraction) and math.isnan(r.median_staleness) and r.node_time is None


def test_a_sample_row_without_time_is_named(sampled):
    with open(sampled / "samples.jsonl", "a") as fh:
        fh.write(json.dumps({"node": 0, "test_acc": 0.5}) + "\n")
    with pytest.raises(RunDirError, match="samples.jsonl: a row lacks a number t"):
        read_run(sampled).samples()


# -- emulate report ---------------------------------------------------------------------------------------------------

def test_report_gives_accuracy_at_times_time_and_bytes_to_target_idle_and_staleness(sampled, old, tmp_path):
    out = tmp_path / "report"
    assert main(["report", str(sampled), str(old), "--out", str(out), "--at", "1.2,2", "--target", "0.7"]) == 0
    new, before = _csv(out / "comparison.csv")
    assert float(new["test_acc_at_1.2s"]) == pytest.approx(0.5) and float(new["test_acc_at_2s"]) == pytest.approx(0.9)
    assert (float(new["target"]), float(new["time_to_target"]), float(new["bytes_to_target"])) == (0.7, 1.5, 333)
    assert float(new["idle_fraction"]) == pytest.approx(0.25) and float(new["median_staleness"]) == 1
    assert [before[k] for k in ("test_acc_at_1.2s", "time_to_target", "idle_fraction", "median_staleness")] == [""] * 4
    shown = (out / "comparison.md").read_text()
    assert "test_acc @ 1.2 s (%)" in shown and "time to test_acc ≥ 0.7" in shown and "| 1.500 s | 333 B |" in shown
    assert _is_png(out / "accuracy_vs_time.png") and _is_png(out / "accuracy_vs_bytes.png")


def test_report_defaults_to_half_way_and_the_end_and_a_target_every_run_reaches(sampled, tmp_path):
    shown, raw = headers([read_run(sampled)])
    assert raw[len(CSV_HEADERS):] == ["test_acc_at_1s", "test_acc_at_2s", "target", "time_to_target",
                                      "bytes_to_target", "idle_fraction", "median_staleness"]
    assert "time to test_acc ≥ 0.81" in shown  # 90% of the last tick's 0.9


@pytest.mark.parametrize("argv", [["--at", "0"], ["--at", "1,x"], ["--target", "nan"]])
def test_report_refuses_bad_times_and_targets_in_one_line(sampled, capsys, argv):
    assert main(["report", str(sampled), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("emulate report: error: ") and argv[0] in err[0]


def test_an_old_run_directory_reports_and_plots_as_before(old, tmp_path):
    assert headers([read_run(old)]) == (HEADERS, CSV_HEADERS)
    assert main(["report", str(old), str(old), "--out", str(tmp_path / "report")]) == 0
    assert list(_csv(tmp_path / "report" / "comparison.csv")[0]) == CSV_HEADERS
    assert {p.name for p in plot_run(old)} == {"test_acc_vs_round.png", "test_acc_vs_time.png",
                                               "test_acc_vs_bytes.png"}


# -- plots ------------------------------------------------------------------------------------------------------------

def test_a_sampled_run_plots_accuracy_against_time_and_bytes_and_each_nodes_idle_fraction(sampled):
    written = {p.name for p in plot_run(sampled)}
    assert {"accuracy_vs_time.png", "accuracy_vs_bytes.png", "idle_fraction.png", "test_acc_vs_round.png"} <= written
    assert all(_is_png(sampled / "plots" / name) for name in written)
    ((name, fig),) = idle_figures(read_run(sampled))
    assert [bar.get_height() for bar in fig.axes[0].patches] == IDLE  # a bar per node, its own fraction


def test_idle_fraction_of_many_nodes_is_drawn_per_block(tmp_path):
    path = _run_dir(tmp_path / "many", samples=False)
    summary = json.loads((path / "summary.json").read_text())
    summary["node_time"]["idle_fraction"] = [0.0, 1.0] * 500  # 1,000 nodes: blocks of 5
    (path / "summary.json").write_text(json.dumps(summary))
    ((_, fig),) = idle_figures(read_run(path))
    heights = [bar.get_height() for bar in fig.axes[0].patches]
    assert len(heights) == 200 and heights[:2] == pytest.approx([0.4, 0.6])


# -- study tables -----------------------------------------------------------------------------------------------------

def test_the_time_measures_of_a_study(sampled, old, tmp_path):
    r = read_run(sampled)
    values = {name: parse_metric(name, "grid.yaml").of(r) for name in (
        "acc_at:1.2", "acc_at:0.4", "time_to_target:0.7", "bytes_to_target:0.7", "time_to_target:1.3:test_loss",
        "time_to_target:0.95", "idle_fraction", "median_staleness")}
    assert values == pytest.approx({"acc_at:1.2": 0.5, "acc_at:0.4": math.nan, "time_to_target:0.7": 1.5,
                                    "bytes_to_target:0.7": 333, "time_to_target:1.3:test_loss": 1.5,
                                    "time_to_target:0.95": math.nan, "idle_fraction": 0.25,
                                    "median_staleness": 1.0}, nan_ok=True)
    axes = {"method": ["sampled", "old"]}
    spec = parse_table({"metric": ["acc_at:2", "time_to_target:0.7", "idle_fraction"], "target": 0.7}, axes,
                       "grid.yaml")
    (tmp_path / "out").mkdir()
    tabulate(tmp_path / "out", spec, axes, [StudyRun(sampled, {"method": "sampled"}), StudyRun(old, {"method": "old"})],
             Console(file=io.StringIO()))
    table = {row["method"]: row for row in _csv(tmp_path / "out" / "table.csv")}
    assert float(table["sampled"]["acc_at:2 mean"]) == pytest.approx(0.9) and table["old"]["acc_at:2 runs"] == "0"
    assert float(table["sampled"]["time_to_target:0.7 mean"]) == 1.5
    reached = {row["method"]: row for row in _csv(tmp_path / "out" / "time_to_target.csv")}
    assert float(reached["sampled"]["seconds mean"]) == 1.5  # the samples' tick, not a round's end
    assert reached["old"]["reached"] == "0"  # no samples: the rounds, whose means (0.3, 0.5) never reach 0.7
    assert (tmp_path / "out" / "plots" / "test_acc_by_time.png").is_file()


@pytest.mark.parametrize("metric", ["acc_at", "acc_at:0", "acc_at:soon", "time_to_target", "time_to_target:0.5:a-b",
                                    "idle_fraction:1"])
def test_a_time_measure_with_bad_arguments_is_refused_by_name(metric):
    with pytest.raises(StudyError, match=metric.split(":")[0]):
        parse_metric(metric, "grid.yaml")


# -- a real run -------------------------------------------------------------------------------------------------------

def test_a_real_run_with_samples_ends_with_its_time_plots_and_its_numbers_come_from_samples(tmp_path):
    result = run(protocol="dpsgd", topology="ring", nodes=4, rounds=3, model="mlp:hidden=16", eval_every_seconds=0.1,
                 compute_time="per-sample", quiet=True, out=str(tmp_path / "r"))  # rounds of a tenth of a second
    plots = {p.name for p in (result.out_dir / "plots").iterdir()}
    assert {"accuracy_vs_time.png", "accuracy_vs_bytes.png", "idle_fraction.png"} <= plots
    rows = [json.loads(line) for line in (result.out_dir / "samples.jsonl").read_text().splitlines()]
    ticks = sorted({row["t"] for row in rows})
    mean = {t: np.mean([row["test_acc"] for row in rows if row["t"] == t]) for t in ticks}
    r = read_run(result.out_dir)
    assert r.curves(axis="time").mean == pytest.approx([mean[t] for t in ticks])
    target = mean[ticks[1]]
    first = next(t for t in ticks if mean[t] >= target)
    assert r.time_to_target("test_acc", target) == pytest.approx(
        (first, sum(row["bytes_sent"] for row in rows if row["t"] == first)))
