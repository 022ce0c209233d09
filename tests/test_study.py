"""A sweep's tables and plots (p2p_emulator/analysis/study.py), checked against the run directories' own numbers."""
import csv
import io
import json
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from rich.console import Console

from p2p_emulator.analysis.study_plots import pareto_front
from p2p_emulator.analysis.study import StudyError, parse_table, tabulate
from p2p_emulator.cli import main
from p2p_emulator.sweeps import GridError, axis_labels, check_settings, load_grid, points, study_runs

QUIET = Console(file=io.StringIO())
EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
# Two methods x two seeds of a few rounds; the mesh has an adversary and churn.
GRID = {
    "base": {"protocol": "dfedavgm", "dataset": "digits", "nodes": 4, "rounds": 3, "model": "mlp:hidden=16",
             "compute_time": "per-sample", "no_plots": True},  # rounds of a tenth of a second: churn hits
    "grid": {
        "method": [{"topology": "ring", "label": "ring"},
                   {"topology": "mesh", "adversaries": "fraction=0.25,kind=signflip", "churn": "up=1s,down=0.5s",
                    "timeout": 0.5, "label": "mesh"}],
        "seed": [0, 1],
    },
    "table": {"rows": "method",
              "metric": ["test_acc", "bytes_per_round", "bytes_per_round:1-2", "messages_per_round",
                         "bytes_per_message:last", "honest_acc", "offline_share"],
              "relative_to": {"bytes_per_round": "ring"}},
}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The grid swept once; its folder."""
    where = tmp_path_factory.mktemp("study")
    (where / "grid.yaml").write_text(yaml.safe_dump({**GRID, "out": str(where / "out")}))
    assert main(["sweep", "--grid", str(where / "grid.yaml")]) == 0
    return where


def _csv(path: Path) -> dict[str, dict[str, str]]:
    """Rows of a table's CSV by their first column."""
    with open(path, newline="") as fh:
        return {row[next(iter(row))]: row for row in csv.DictReader(fh)}


def _runs(out: Path, method: str) -> list[Path]:
    return [out / f"method={method}__seed={seed}" for seed in (0, 1)]


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _offline_share(run: Path) -> float:
    summary = _summary(run)
    end = summary["emulated_seconds"]
    file = run / "availability.jsonl"  # only with churn
    spells = [json.loads(line) for line in file.read_text().splitlines()] if file.is_file() else []
    down = sum(min(end, spell["t_up"] if spell["t_up"] is not None else end) - spell["t_down"] for spell in spells)
    return down / (summary["nodes"] * end)


def _honest_acc(run: Path) -> float:
    adversaries = set(_summary(run).get("adversaries", []))
    return statistics.fmean(row["test_acc"] for row in _metrics(run) if row["round"] == 2
                            and row["node"] not in adversaries)


def _bytes_in_round(run: Path, rnd: int) -> int:
    return sum(row["bytes_sent"] for row in _metrics(run) if row["round"] == rnd)


def _per_message_last(run: Path) -> float:
    last = [row for row in _metrics(run) if row["round"] == 2]
    return sum(row["bytes_sent"] for row in last) / sum(row["msgs_sent"] for row in last)


BY_HAND = {  # metric -> its value from a run directory's own files
    "bytes_per_round": lambda run: _summary(run)["bytes_total"] / _summary(run)["rounds"],
    "bytes_per_round:1-2": lambda run: (_bytes_in_round(run, 1) + _bytes_in_round(run, 2)) / 2,
    "messages_per_round": lambda run: _summary(run)["messages_total"] / _summary(run)["rounds"],
    "bytes_per_message:last": _per_message_last,
    "honest_acc": _honest_acc,
    "offline_share": _offline_share,
}


@pytest.mark.parametrize("metric", BY_HAND)
def test_each_cell_is_the_mean_and_std_over_seeds_of_the_measure(sweep, metric):
    table = _csv(sweep / "out" / "table.csv")
    for method in ("ring", "mesh"):
        values = [BY_HAND[metric](run) for run in _runs(sweep / "out", method)]
        assert float(table[method][f"{metric} mean"]) == pytest.approx(statistics.fmean(values))
        assert float(table[method][f"{metric} std"]) == pytest.approx(statistics.stdev(values), abs=1e-12)
        assert table[method][f"{metric} runs"] == "2"


def test_the_measures_see_what_the_runs_did(sweep):
    mesh = _runs(sweep / "out", "mesh")
    assert all(_summary(run)["adversaries"] for run in mesh)  # honest_acc leaves a node out
    assert all(0 < _offline_share(run) < 1 for run in mesh)
    table = _csv(sweep / "out" / "table.csv")
    assert float(table["ring"]["offline_share mean"]) == 0  # no churn, no availability.jsonl


def test_a_summary_key_is_read_from_the_final_metrics(sweep):
    table = _csv(sweep / "out" / "table_test_acc.csv")  # each metric also alone, as with columns
    accuracies = [_summary(run)["final"]["test_acc"] for run in _runs(sweep / "out", "ring")]
    assert float(table["ring"]["test_acc mean"]) == pytest.approx(statistics.fmean(accuracies))
    shown = (sweep / "out" / "table.md").read_text()
    assert f"{100 * statistics.fmean(accuracies):.2f} ± " in shown  # accuracy in percent


def test_a_ratio_to_a_reference_row(sweep):
    table = _csv(sweep / "out" / "table.csv")
    mean = {m: statistics.fmean(BY_HAND["bytes_per_round"](run) for run in _runs(sweep / "out", m))
            for m in ("ring", "mesh")}
    assert float(table["ring"]["bytes_per_round / ring"]) == 1
    assert float(table["mesh"]["bytes_per_round / ring"]) == pytest.approx(mean["mesh"] / mean["ring"])
    assert mean["mesh"] > mean["ring"]  # the ratio compares different traffic


FEDLINKED = {  # three clients (M0 and M1 in one group, M2 in another) and a server, small enough for a test
    "base": {"topology": "star", "nodes": 4, "rounds": 2, "dataset": "digits",
             "partition": "fedlinked:groups=2,classes=4,samples=30", "init_epochs": 1,
             "local_epochs": 1, "dist_epochs": 1, "public_subsample": 20, "no_plots": True},
    "grid": {"method": [{"protocol": "fedlinked", "label": "fedlinked"}], "seed": [0, 1, 2]},
    "table": {"metric": ["client_acc:0", "client_acc:2", "related_pair_first:0", "utility:0:2:1"]},
}


def _fedlinked_by_hand(run: Path) -> dict[str, float]:
    last = {row["node"]: row["test_acc"] for row in _metrics(run) if row["round"] == 1 and "test_acc" in row}
    assert sorted(last) == [1, 2, 3]  # the server (node 0) scores nothing: client k is node k + 1
    a = {(row["client"], int(k)): value for row in map(json.loads, (run / "utility.jsonl").read_text().splitlines())
         if row["round"] == 0 for k, value in row["utility"].items()}  # (j, k) -> A_kj
    group = {part["node"] + 1: part["cluster"] for part in json.loads((run / "partition.json").read_text())["nodes"]}
    j, k = max([(1, 2), (1, 3), (2, 3)], key=lambda pair: a[pair] + a[pair[::-1]])
    return {"client_acc:0": last[1], "client_acc:2": last[3], "related_pair_first:0": group[j] == group[k],
            "utility:0:2:1": a[3, 2]}


def test_fedlinked_measures_read_utility_jsonl(tmp_path):
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump({**FEDLINKED, "out": str(tmp_path / "out")}))
    assert main(["sweep", "--grid", str(tmp_path / "grid.yaml")]) == 0
    by_hand = [_fedlinked_by_hand(tmp_path / "out" / f"method=fedlinked__seed={seed}") for seed in (0, 1, 2)]
    row = _csv(tmp_path / "out" / "table.csv")["fedlinked"]
    for metric in FEDLINKED["table"]["metric"]:
        assert float(row[f"{metric} mean"]) == pytest.approx(statistics.fmean(seed[metric] for seed in by_hand))
    related = sum(seed["related_pair_first:0"] for seed in by_hand)
    assert f" {related}/3 |" in (tmp_path / "out" / "table.md").read_text()  # how many runs, not a mean


# Plain FedAvg and SecAgg on a star of three clients, every message traced: bytes and messages by kind.
SECAGG = {
    "base": {"protocol": "fedavg", "topology": "star", "nodes": 4, "rounds": 2, "dataset": "digits",
             "model": "mlp:hidden=16", "trace": True, "no_plots": True},
    "grid": {"method": [{"secure_aggregation": "none", "label": "fedavg"},
                        {"secure_aggregation": "secagg", "label": "secagg"}]},
    "table": {"metric": ["kind_bytes_per_round:model", "kind_bytes_per_round:update",
                         "kind_bytes_per_round:secagg.keys", "kind_messages_per_round:secagg.shares",
                         "bytes_per_round", "seconds_per_round"]},
}


@pytest.fixture(scope="module")
def secagg_sweep(tmp_path_factory):
    """SECAGG swept once; its grid file."""
    where = tmp_path_factory.mktemp("secagg")
    (where / "grid.yaml").write_text(yaml.safe_dump({**SECAGG, "out": str(where / "out")}))
    assert main(["sweep", "--grid", str(where / "grid.yaml")]) == 0
    return where / "grid.yaml"


def _by_kind(run: Path) -> dict[str, list[int]]:
    """Kind -> [messages, bytes] over messages.jsonl."""
    sent: dict[str, list[int]] = {}
    for message in map(json.loads, (run / "messages.jsonl").read_text().splitlines()):
        count = sent.setdefault(message["kind"], [0, 0])
        count[0], count[1] = count[0] + 1, count[1] + message["bytes"]
    return sent


def test_bytes_and_messages_by_kind_are_messages_jsonl_s_per_round(secagg_sweep):
    out = secagg_sweep.parent / "out"
    table = _csv(out / "table.csv")
    fedavg, secagg = _by_kind(out / "method=fedavg"), _by_kind(out / "method=secagg")
    assert set(fedavg) == {"model", "update"} and "update" not in secagg  # SecAgg sends masked inputs instead
    for method, sent in (("fedavg", fedavg), ("secagg", secagg)):
        row = table[method]
        for kind in ("model", "update", "secagg.keys"):
            assert float(row[f"kind_bytes_per_round:{kind} mean"]) == sent.get(kind, [0, 0])[1] / 2  # 2 rounds
        assert float(row["kind_messages_per_round:secagg.shares mean"]) == sent.get("secagg.shares", [0, 0])[0] / 2
        summary = _summary(out / f"method={method}")
        assert sum(size for _, size in sent.values()) == summary["bytes_total"]  # nothing dropped: kinds add up
        assert float(row["seconds_per_round mean"]) == summary["emulated_seconds"] / 2
    assert secagg["secagg.keys"][1] > 0
    assert "| fedavg | 15.10 kB | 15.10 kB | 0 B |" in (out / "table.md").read_text()  # a kind not sent: 0, not —
    alone = _csv(out / "table_kind_bytes_per_round-secagg.keys.csv")  # its own file: the dot is no suffix
    assert float(alone["secagg"]["kind_bytes_per_round:secagg.keys mean"]) == secagg["secagg.keys"][1] / 2


def test_a_kind_no_run_sent_is_one_line_naming_the_kinds_sent(secagg_sweep, capsys):
    grid = yaml.safe_load(secagg_sweep.read_text())
    grid["table"] = {"metric": ["kind_bytes_per_round:secagg.key"]}  # misspelt: it would read as 0 everywhere
    secagg_sweep.with_name("misspelt.yaml").write_text(yaml.safe_dump(grid))
    assert main(["sweep", "--grid", str(secagg_sweep.with_name("misspelt.yaml"))]) == 2  # the runs are done: no rerun
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "no run sent a message of kind 'secagg.key'" in error
    assert "model, secagg.keys, secagg.masked, secagg.shares, secagg.unmask, update" in error


def test_a_kind_measure_needs_the_trace(sweep, tmp_path, capsys):
    grid = {**SECAGG, "base": {**SECAGG["base"], "trace": False}, "out": str(tmp_path / "out")}
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid))
    assert main(["sweep", "--grid", str(tmp_path / "grid.yaml")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "'kind_bytes_per_round:model' needs trace: true (--trace)" in error
    assert not (tmp_path / "out").exists()  # refused before any run
    spec, axes, runs = _study(sweep, {"rows": "method", "metric": "kind_messages_per_round:model"})  # untraced runs
    with pytest.raises(StudyError, match="has no messages.jsonl: the measure needs runs made with --trace"):
        tabulate(tmp_path, spec, axes, runs, QUIET)


def _study(sweep, table: dict):
    grid = load_grid(sweep / "grid.yaml")
    axes = axis_labels(grid.axes)
    return parse_table(table, axes, "grid.yaml"), axes, study_runs(grid, points(grid))


def test_with_columns_a_table_per_metric_and_per_ratio(sweep, tmp_path):
    spec, axes, runs = _study(sweep, {"rows": "method", "columns": "seed", "metric": ["bytes_per_round"],
                                      "relative_to": {"bytes_per_round": "ring"}})
    tabulate(tmp_path, spec, axes, runs, QUIET)
    ratio = _csv(tmp_path / "table_bytes_per_round_over_ring.csv")
    for seed in ("0", "1"):
        ring, mesh = (BY_HAND["bytes_per_round"](sweep / "out" / f"method={m}__seed={seed}") for m in ("ring", "mesh"))
        assert float(ratio["mesh"][seed]) == pytest.approx(mesh / ring)
        assert _csv(tmp_path / "table_bytes_per_round.csv")["mesh"][f"{seed} runs"] == "1"


def _time_to_target(run: Path, target: float) -> tuple[float, int] | None:
    """By hand: the first round whose mean test accuracy over nodes reaches target; when its last node ended it,
    and the bytes all nodes sent up to then."""
    rows = _metrics(run)
    for rnd in sorted({row["round"] for row in rows}):
        these = [row for row in rows if row["round"] == rnd]
        if statistics.fmean(row["test_acc"] for row in these) >= target:
            return max(row["t"] for row in these), sum(row["bytes_sent"] for row in rows if row["round"] <= rnd)
    return None


def test_time_to_target_from_metrics_jsonl(sweep, tmp_path):
    ring = _runs(sweep / "out", "ring")
    first_round = [statistics.fmean(row["test_acc"] for row in _metrics(run) if row["round"] == 1) for run in ring]
    target = max(first_round)  # one seed reaches it by round 1, the other maybe later
    spec, axes, runs = _study(sweep, {"rows": "method"})
    tabulate(tmp_path, replace(spec, target=target), axes, runs, QUIET)
    row = _csv(tmp_path / "time_to_target.csv")["ring"]
    hits = [hit for hit in (_time_to_target(run, target) for run in ring) if hit is not None]
    assert hits and row["reached"] == str(len(hits)) and row["runs"] == "2"
    assert float(row["seconds mean"]) == pytest.approx(statistics.fmean(t for t, _ in hits))
    assert float(row["bytes mean"]) == pytest.approx(statistics.fmean(b for _, b in hits))


def test_a_target_never_reached(sweep, tmp_path):
    spec, axes, runs = _study(sweep, {"rows": "method", "target": 1.5})
    tabulate(tmp_path, spec, axes, runs, QUIET)
    assert _csv(tmp_path / "time_to_target.csv")["mesh"]["reached"] == "0"
    assert "| mesh | not reached | not reached | 0/2 |" in (tmp_path / "time_to_target.md").read_text()


def test_the_plots_of_a_study(sweep):
    assert {p.name for p in (sweep / "out" / "plots").iterdir()} == {"test_acc_by_round.png", "test_acc_frontier.png"}


def test_the_pareto_front_keeps_what_nothing_cheaper_beats():
    cost = np.array([0.0, 10, 10, 20, 30, 40])
    value = np.array([0.5, 0.6, 0.7, 0.65, 0.9, 0.9])
    assert list(pareto_front(cost, value)) == [0, 2, 4]


AXES = {"method": ["ring", "mesh"], "seed": ["0", "1"]}
BAD_TABLES = [
    ({"rows": "protocol"}, "rows 'protocol' is not an axis"),
    ({"rows": "method", "columns": "method"}, "different axes"),
    ({"metric": "bytes_per_rond:1-2"}, "no measure 'bytes_per_rond'"),
    ({"metric": "client_acc"}, "expected client_acc:K"),
    ({"metric": "bytes_per_round:5"}, "expected bytes_per_round or bytes_per_round:FIRST-LAST"),
    ({"metric": "kind_bytes_per_round"}, "expected kind_bytes_per_round:KIND"),
    ({"metric": "kind_messages_per_round:"}, "expected kind_messages_per_round:KIND"),
    ({"metric": "task_identified_round:2"}, "0 < SHARE <= 1"),
    ({"metric": "test_acc", "relative_to": {"bytes_total": "ring"}}, "'bytes_total' is not one of the table's"),
    ({"metric": "bytes_total", "relative_to": {"bytes_total": "FedAvg"}}, "'FedAvg' is not a label of method"),
    ({"rows": ["method", "seed"], "metric": "bytes_total", "relative_to": {"bytes_total": "ring"}}, "one axis"),
    ({"target": "high"}, "target: expected a number"),
    ({"colums": "seed"}, "expected a mapping of rows, columns"),
]


@pytest.mark.parametrize("table,named", BAD_TABLES)
def test_a_bad_table_option_is_one_line_naming_it(table, named):
    with pytest.raises(StudyError) as error:
        parse_table(table, AXES, "grid.yaml")
    message = str(error.value)
    assert message.startswith("grid.yaml: table: ") and named in message and "\n" not in message


def test_every_ready_made_grid_loads_and_its_runs_resolve():
    grids = sorted(EXPERIMENTS.glob("*.yaml"))
    assert len(grids) >= 12
    for path in [*grids, *sorted(EXPERIMENTS.parent.joinpath("benchmarks").glob("*.yaml"))]:  # and the bench's
        grid = load_grid(path)
        check_settings(grid, points(grid))


SUB_GRIDS = {
    "base": {"protocol": "dfedavgm", "dataset": "digits", "rounds": 2, "model": "mlp:hidden=16", "no_plots": True},
    "grid": [
        {"size": [{"nodes": 4, "label": "4 nodes"}, {"nodes": 6, "label": "6 nodes"}],
         "method": [{"topology": "ring", "label": "ring"}], "seed": [0, 1]},
        {"size": [{"nodes": 4, "label": "4 nodes"}], "method": [{"topology": "mesh", "label": "mesh"}], "seed": [0, 1]},
    ],
    "table": {"rows": ["size", "method"], "metric": ["bytes_total", "params_sent"]},
}


def test_a_grid_of_sub_grids_runs_their_union_and_tabulates_only_its_combinations(tmp_path):
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump({**SUB_GRIDS, "out": str(tmp_path / "out")}, sort_keys=False))
    assert main(["sweep", "--grid", str(tmp_path / "grid.yaml")]) == 0
    made = sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir() and p.name != "plots")
    assert made == [f"size={n}-nodes__method={m}__seed={s}" for n, m in (("4", "mesh"), ("4", "ring"), ("6", "ring"))
                    for s in (0, 1)]
    with open(tmp_path / "out" / "table.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["size"], r["method"]) for r in rows] == [("4 nodes", "ring"), ("4 nodes", "mesh"), ("6 nodes", "ring")]
    for row in rows:
        runs = [tmp_path / "out" / f"size={row['size'].replace(' ', '-')}__method={row['method']}__seed={s}"
                for s in (0, 1)]
        by_hand = statistics.fmean(_summary(run)["bytes_total"] for run in runs)
        assert float(row["bytes_total mean"]) == pytest.approx(by_hand)
        assert row["params_sent mean"] == ""  # dfedavgm logs no params_sent: no count, not 0
    assert (tmp_path / "out" / "plots" / "test_acc_frontier.png").exists()


def test_sub_grids_must_name_the_same_axes(tmp_path):
    grid = {**SUB_GRIDS, "grid": [SUB_GRIDS["grid"][0], {"method": [{"topology": "mesh"}], "seed": [0]}]}
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid, sort_keys=False))
    with pytest.raises(GridError, match="every sub-grid must list the same axes in the same order"):
        load_grid(tmp_path / "grid.yaml")
