"""Plots of a run, `emulate report` and `emulate sweep` on small real runs."""
import csv
import functools
import json
import math
import shlex
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml

from p2p_emulator import runners
from p2p_emulator.analysis.plots import plot_run
from p2p_emulator.cli import main
from p2p_emulator.sweeps import flags
from protocols.analysis.learned_graph import shown_rounds

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DFEDAVGM = ["--protocol", "dfedavgm", "--topology", "ring", "--nodes", "4", "--rounds", "2", "--dataset", "digits",
            "--local-steps", "2", "--quiet"]
GOSSIP = ["--protocol", "gossip", "--topology", "ring", "--nodes", "4", "--rounds", "2", "--quiet", "--no-plots"]


def _is_png(path):
    return path.is_file() and path.stat().st_size > len(PNG_SIGNATURE) and path.read_bytes()[:8] == PNG_SIGNATURE


def _csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    assert main([*DFEDAVGM, "--out", str(tmp / "dfedavgm")]) == 0  # with its end-of-run plots
    assert main([*GOSSIP, "--out", str(tmp / "gossip")]) == 0
    return tmp


def test_a_run_ends_with_every_applicable_plot(runs):
    plots = runs / "dfedavgm" / "plots"
    expected = {"test_acc_vs_round.png", "test_acc_vs_time.png", "test_acc_vs_bytes.png",
                "link_bytes_matrix.png", "link_bytes_topology.png", "idle_fraction.png"}
    assert {p.name for p in plots.iterdir()} == expected  # no graph.jsonl, no availability.jsonl: no such plots
    assert all(_is_png(plots / name) for name in expected)


def test_a_run_without_accuracy_plots_its_main_metric(runs):
    written = plot_run(runs / "gossip")
    assert {p.name for p in written} >= {"error_vs_round.png", "error_vs_time.png", "error_vs_bytes.png"}
    assert all(_is_png(p) for p in written)


def _graph_rows(num_nodes, rounds):
    """Uniform W in round 0 (warm-up), then each node favours its successor more every round."""
    rows = []
    for rnd in range(rounds):
        for i in range(num_nodes):
            favour = 0.0 if rnd == 0 else 0.1 * rnd
            weights = {str(j): 1 / num_nodes for j in range(num_nodes)}
            weights[str((i + 1) % num_nodes)] += favour
            weights[str(i)] -= favour
            rows.append({"round": rnd, "node": i, "weights": weights})
    return rows


def test_learned_graph_and_availability_plots(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "dfedavgm", run)
    shutil.rmtree(run / "plots")
    (run / "graph.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _graph_rows(4, 5)))
    (run / "availability.jsonl").write_text(json.dumps({"node": 1, "t_down": 0.1, "t_up": 0.3}) + "\n"
                                            + json.dumps({"node": 2, "t_down": 0.2, "t_up": None}) + "\n")
    written = {p.name for p in plot_run(run)}
    assert {"learned_graph.png", "availability.png", "test_acc_vs_round.png"} <= written
    assert _is_png(run / "plots" / "learned_graph.png") and _is_png(run / "plots" / "availability.png")
    import matplotlib.pyplot as plt

    assert plt.get_fignums() == []  # no figure left open


def test_learned_graph_shows_first_round_after_warm_up_middle_and_last():
    def rows(rnd, weights):
        return [{"round": rnd, "node": i, "weights": {str(j): w for j, w in enumerate(row)}}
                for i, row in enumerate(weights)]

    uniform = [[1 / 3] * 3] * 3
    learned = [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]  # zero weights are recorded: uneven
    history = rows(0, uniform) + rows(1, uniform) + [r for rnd in range(2, 7) for r in rows(rnd, learned)]
    assert shown_rounds(history) == [2, 4, 6]
    assert shown_rounds(rows(0, uniform) + rows(1, uniform)) == [0, 1]  # never learned: from the first round


def test_missing_or_broken_optional_files_skip_only_their_plots(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "dfedavgm", run)
    shutil.rmtree(run / "plots")
    (run / "links.csv").unlink()
    (run / "graph.jsonl").write_text("{not json\n")
    with pytest.warns(UserWarning, match="graph.jsonl"):
        written = {p.name for p in plot_run(run)}
    assert written == {"test_acc_vs_round.png", "test_acc_vs_time.png", "test_acc_vs_bytes.png", "idle_fraction.png"}


def test_an_installed_extension_adds_figures_and_measures_and_a_broken_one_costs_one_line(runs, tmp_path,
                                                                                          monkeypatch):
    from importlib import metadata

    from p2p_emulator.analysis import extensions
    from p2p_emulator.analysis.drawing import new_figure
    from p2p_emulator.analysis.measures import Measure
    from p2p_emulator.analysis.rundir import read_run
    from p2p_emulator.analysis.study import parse_metric

    def node_count_figures(run):
        fig = new_figure()
        fig.add_subplot().bar([0], [run.num_nodes])
        yield "node_count.png", fig

    third_party = extensions.Extension(figures=(node_count_figures,),
                                       measures={"node_count": Measure(lambda run: run.num_nodes, "node_count")})
    installed = [metadata.EntryPoint("broken", "not_installed:EXTENSION", extensions.GROUP),
                 metadata.EntryPoint("counts", "counts:EXTENSION", extensions.GROUP)]

    def load(entry):
        if entry.name == "broken":
            raise ModuleNotFoundError("No module named 'not_installed'")
        return third_party

    monkeypatch.setattr(metadata.EntryPoint, "load", load)
    monkeypatch.setattr(extensions, "entry_points", lambda group: installed)
    monkeypatch.setattr(extensions, "extensions", functools.cache(extensions.extensions.__wrapped__))
    run = tmp_path / "run"
    shutil.copytree(runs / "dfedavgm", run)
    shutil.rmtree(run / "plots")
    with pytest.warns(extensions.ExtensionWarning) as caught:
        written = {p.name for p in plot_run(run)}
    assert [str(w.message) for w in caught] == [
        "analysis extension 'broken' (not_installed:EXTENSION) not loaded: "
        "ModuleNotFoundError: No module named 'not_installed'"]
    assert written == {"test_acc_vs_round.png", "test_acc_vs_time.png", "test_acc_vs_bytes.png",
                       "link_bytes_matrix.png", "link_bytes_topology.png", "node_count.png", "idle_fraction.png"}
    assert parse_metric("node_count", "grid.yaml").of(read_run(run)) == 4


def test_report_on_two_runs_overlays_them_and_writes_the_table(runs, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["report", str(runs / "dfedavgm"), str(runs / "gossip"), "--out", str(out)]) == 0
    rows = _csv(out / "comparison.csv")
    assert [r["run"] for r in rows] == ["dfedavgm", "gossip"]
    assert [r["protocol"] for r in rows] == ["dfedavgm", "gossip"]
    for row in rows:
        summary = json.loads((runs / row["run"] / "summary.json").read_text())
        assert float(row["bytes_total"]) == summary["bytes_total"]
        assert float(row["bytes_per_node"]) == summary["bytes_total"] / 4
    assert float(rows[0]["final_mean"]) == pytest.approx(
        json.loads((runs / "dfedavgm" / "summary.json").read_text())["final"]["test_acc"])
    assert rows[1]["metric"] == "error"
    markdown = (out / "comparison.md").read_text()
    assert "| dfedavgm |" in markdown and "| gossip |" in markdown
    assert _is_png(out / "test_acc_vs_round.png") and _is_png(out / "error_vs_bytes.png")
    assert "dfedavgm" in capsys.readouterr().out


def test_report_on_one_run_re_renders_its_plots(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "gossip", run)
    assert main(["report", str(run)]) == 0
    assert _is_png(run / "plots" / "error_vs_round.png")


def test_report_names_each_bad_run_in_one_line_and_reports_the_rest(runs, tmp_path, capsys):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(runs / "gossip", corrupt)
    (corrupt / "summary.json").write_text("{truncated")
    out = tmp_path / "report"
    status = main(["report", str(runs / "gossip"), str(tmp_path / "missing"), str(corrupt),
                   str(runs / "dfedavgm"), "--out", str(out)])
    assert status == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2
    assert "missing" in errors[0] and "corrupt" in errors[1]
    assert all(line.startswith("emulate report: error: ") for line in errors)
    assert [r["run"] for r in _csv(out / "comparison.csv")] == ["gossip", "dfedavgm"]


GRID = {
    "base": {"protocol": "gossip", "topology": "ring", "nodes": 4, "rounds": 2, "no_plots": True},
    "grid": {
        "method": [{"mixing": "mh", "label": "Metropolis-Hastings"},
                   {"mixing": "uniform", "trace": True, "label": "uniform w/ trace"}],
        "seed": [0, 1],
    },
    "table": {"rows": "method", "metric": ["error", "bytes_total"]},
}


@pytest.mark.parametrize("change", [{"rounds": 3}, {"latency": "5ms"}])
def test_a_sweep_reruns_the_runs_whose_settings_changed_and_says_so(tmp_path, monkeypatch, capsys, change):
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text(yaml.safe_dump({**GRID, "out": str(tmp_path / "sweep")}))
    assert main(["sweep", "--grid", str(grid_file)]) == 0
    calls = []
    run_job = runners.run_job
    monkeypatch.setattr(runners, "run_job", lambda argv: calls.append(argv) or run_job(argv))
    assert main(["sweep", "--grid", str(grid_file)]) == 0 and calls == []  # all current: nothing reruns
    grid_file.write_text(yaml.safe_dump({**GRID, "base": {**GRID["base"], **change}, "out": str(tmp_path / "sweep")}))
    capsys.readouterr()
    assert main(["sweep", "--grid", str(grid_file)]) == 0
    assert len(calls) == 4 and capsys.readouterr().err.count("its settings changed since it ran") == 4
    summary = json.loads((tmp_path / "sweep" / "method=Metropolis-Hastings__seed=0" / "summary.json").read_text())
    assert summary["rounds"] == change.get("rounds", 2)


def test_sweep_runs_what_is_not_finished_and_tabulates_over_seeds(tmp_path, monkeypatch):
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text(yaml.safe_dump({**GRID, "out": str(tmp_path / "sweep")}))
    done = tmp_path / "sweep" / "method=Metropolis-Hastings__seed=1"
    assert main([*GOSSIP, "--mixing", "mh", "--seed", "1", "--out", str(done)]) == 0
    finished_at = (done / "summary.json").stat().st_mtime_ns
    calls = []
    run_job = runners.run_job
    monkeypatch.setattr(runners, "run_job", lambda argv: calls.append(argv) or run_job(argv))
    assert main(["sweep", "--grid", str(grid_file)]) == 0
    assert len(calls) == 3
    assert (done / "summary.json").stat().st_mtime_ns == finished_at
    names = ["method=Metropolis-Hastings__seed=0", "method=uniform-w-trace__seed=0", "method=uniform-w-trace__seed=1"]
    assert sorted(argv[argv.index("--out") + 1].rsplit("/", 1)[1] for argv in calls) == names
    traced = tmp_path / "sweep" / "method=uniform-w-trace__seed=0"
    assert (traced / "messages.jsonl").is_file()  # `trace: true` became the bare flag --trace
    assert yaml.safe_load((traced / "config.yaml").read_text())["mixing"] == "uniform"

    table = {row["method"]: row for row in _csv(tmp_path / "sweep" / "table_error.csv")}
    assert list(table) == ["Metropolis-Hastings", "uniform w/ trace"]
    errors = [json.loads((tmp_path / "sweep" / f"method=uniform-w-trace__seed={s}" / "summary.json")
                         .read_text())["final"]["error"] for s in (0, 1)]
    row = table["uniform w/ trace"]
    assert float(row["error mean"]) == pytest.approx(statistics.fmean(errors))
    assert float(row["error std"]) == pytest.approx(statistics.stdev(errors))
    assert row["error runs"] == "2"
    assert "± " in (tmp_path / "sweep" / "table_error.md").read_text()
    assert (tmp_path / "sweep" / "table_bytes_total.md").is_file()
    assert len(_csv(tmp_path / "sweep" / "runs.csv")) == 4

    calls.clear()
    assert main(["sweep", "--grid", str(grid_file)]) == 0  # everything finished: a rerun only tabulates
    assert calls == []


def test_bool_settings_become_bare_flags():
    assert flags({"protocol": "mapl", "mapl_no_cgl": True, "trace": False, "seed": 0}) == \
        ["--protocol", "mapl", "--mapl-no-cgl", "--seed", "0"]


BAD_GRIDS = [
    ("grid: [unclosed\n", "not valid YAML"),
    ("base: {protocol: gossip}\n", "grid"),
    ("grid: {seed: []}\n", "seed"),
    ("base: {protocol: gossip, rouns: 2}\ngrid: {seed: [0]}\n", "--rouns"),
    ("base: {protocol: gossip}\ngrid: {seed: [0]}\ntable: {rows: method}\n", "method"),
    ("base: {protocol: gossip, out: x}\ngrid: {seed: [0]}\n", "out"),
    ("grid: {seed: [0]}\nextra: 1\n", "extra"),
    ("grid: {seed: [0]}\njobs: 0\n", "jobs"),
    ("grid: {seed: [0]}\njobs: many\n", "jobs"),
    ("grid: {seed: [0]}\nexecutor: dask\n", "executor"),
    ("grid: {seed: [0]}\nresources: {cpus: 0}\n", "cpus"),
    ("grid: {seed: [0]}\nresources: {memory: lots}\n", "memory"),
    ("grid: {seed: [0]}\nresources: {disks: 2}\n", "resources"),
]


@pytest.mark.parametrize("text,named", BAD_GRIDS)
def test_a_bad_grid_file_exits_2_with_one_line(text, named, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "grid.yaml").write_text(text)
    assert main(["sweep", "--grid", "grid.yaml"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("emulate sweep: error: ") and named in lines[0], lines
    assert not (tmp_path / "runs").exists()


def test_ready_made_experiments_are_valid_grids(tmp_path, capsys, monkeypatch):
    """--dry-run on each: one `todo  emulate ... --out OUT/RUN` line per combination of its (sub-)grids' axes,
    each run in its own directory under the grid's out, and nothing written (from an empty folder: all todo)."""
    grids = sorted(Path(__file__).parent.parent.joinpath("experiments").glob("*.yaml"))
    assert grids
    monkeypatch.chdir(tmp_path)
    for grid in grids:
        assert main(["sweep", "--grid", str(grid), "--dry-run"]) == 0, grid
        lines = capsys.readouterr().out.splitlines()
        data = yaml.safe_load(grid.read_text())
        subgrids = data["grid"] if isinstance(data["grid"], list) else [data["grid"]]
        assert len(lines) == sum(math.prod(map(len, axes.values())) for axes in subgrids), grid
        assert all(line.startswith("todo  emulate --") for line in lines), grid
        outs = [Path(argv[argv.index("--out") + 1]) for argv in map(shlex.split, lines)]
        assert len(set(outs)) == len(outs), grid
        assert {out.parent for out in outs} == {Path(data.get("out") or f"runs/sweep-{grid.stem}")}, grid
    assert list(tmp_path.iterdir()) == []


def test_a_sweeps_round_plot_joins_the_scored_rounds_of_eval_every():
    from p2p_emulator.analysis.study_plots import over_runs
    from p2p_emulator.analysis.rundir import Curves

    nan = float("nan")
    scored = [[nan, 0.5, nan, 0.7], [nan, 0.6, nan, 0.8]]  # --eval-every 2: rounds 1 and 3 scored
    curves = [Curves("test_acc", np.arange(4), np.array([row]), np.zeros((1, 4)), np.zeros(4)) for row in scored]
    rounds, mean, std = over_runs(curves)
    assert rounds.tolist() == [1, 3] and mean == pytest.approx([0.55, 0.75]) and std == pytest.approx([0.0707, 0.0707],
                                                                                                       abs=1e-4)
