"""--log-to: what TensorBoard's and MLflow's own readers see of a run is what its run directory holds."""
import json
import statistics

import pytest
import yaml

from conftest import assert_refused
from p2p_emulator.analysis import trackers
from p2p_emulator.cli import main
from p2p_emulator.sweeps import sweep

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

ROUNDS = 3


def _means(rows: list[dict], metric: str) -> dict[int, float]:
    rounds = sorted({row["round"] for row in rows})
    return {r: statistics.fmean(row[metric] for row in rows if row["round"] == r and metric in row) for r in rounds
            if any(metric in row for row in rows if row["round"] == r)}


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A learning run with samples, logged to both trackers; its folder, TensorBoard's and MLflow's."""
    root = tmp_path_factory.mktemp("trackers")
    assert main(["--protocol", "dfedavgm", "--topology", "ring", "--nodes", "4", "--rounds", str(ROUNDS),
                 "--eval-every-seconds", "0.05", "--out", str(root / "run"), "--quiet", "--no-plots",
                 "--log-to", f"tensorboard:{root / 'tb'},mlflow:{root / 'mlruns'}"]) == 0
    events = EventAccumulator(str(root / "tb" / "run"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    client = MlflowClient(tracking_uri=(root / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name(trackers.SINGLE_RUNS).experiment_id])
    return root / "run", events, client, run


def test_tensorboard_reads_the_metrics_of_metrics_jsonl(logged):
    run_dir, events, _, _ = logged
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for metric in ("test_acc", "train_loss", "bytes_sent"):
        seen = {e.step: e.value for e in events.Scalars(f"{metric}/mean")}
        assert seen == pytest.approx(_means(rows, metric), rel=1e-6)  # TensorBoard keeps 32-bit floats
    for node in range(4):
        seen = {e.step: e.value for e in events.Scalars(f"test_acc/node_{node}")}
        assert seen == pytest.approx({r["round"]: r["test_acc"] for r in rows if r["node"] == node and "test_acc" in r},
                                     rel=1e-6)
    total = [e.value for e in events.Scalars("bytes_sent/total")]
    assert total[-1] == json.loads((run_dir / "summary.json").read_text())["bytes_total"] == sum(
        r["bytes_sent"] for r in rows)
    settings = events.Tensors("settings/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "protocol: dfedavgm" in settings


def test_mlflow_reads_the_same_values_exactly(logged):
    run_dir, _, client, run = logged
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "test_acc/mean")}
    assert history == pytest.approx(_means(rows, "test_acc"), rel=1e-12)  # numpy's mean: the last bit may differ
    node = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "test_acc/node_2")}
    assert node == {r["round"]: r["test_acc"] for r in rows if r["node"] == 2 and "test_acc" in r}
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    ticks = sorted({row["t"] for row in samples})
    sampled = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "sampled/test_acc/mean")}
    assert sampled == pytest.approx({k: statistics.fmean(r["test_acc"] for r in samples if r["t"] == t)
                                     for k, t in enumerate(ticks)}, rel=1e-12)
    final = json.loads((run_dir / "summary.json").read_text())["final"]
    assert run.data.metrics["final/test_acc"] == final["test_acc"]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert run.data.params["protocol"] == "dfedavgm" and run.data.params["rounds"] == str(config["rounds"])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"


def test_a_study_logs_each_run_grouped_under_its_name(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({
        "base": {"protocol": "gossip", "topology": "ring", "nodes": 4, "rounds": 2, "no_plots": True},
        "grid": {"seed": [0, 1]}, "out": str(tmp_path / "study"),
        "log_to": f"tensorboard:{tmp_path / 'tb'},mlflow:{tmp_path / 'mlruns'}", "table": {"rows": "seed"}}))
    assert not sweep(grid).failed
    assert not sweep(grid).failed  # again: its runs are finished and logged, so nothing is logged twice
    assert sorted(p.name for p in (tmp_path / "tb" / "study").iterdir()) == ["seed=0", "seed=1"]
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    runs = client.search_runs([client.get_experiment_by_name("study").experiment_id])
    assert sorted((r.info.run_name, r.data.tags["axis.seed"]) for r in runs) == [("seed=0", "0"), ("seed=1", "1")]


def test_a_study_logs_its_runs_finished_before_it_had_trackers(tmp_path):
    grid = tmp_path / "grid.yaml"
    settings = {"base": {"protocol": "gossip", "topology": "ring", "nodes": 4, "rounds": 2, "no_plots": True},
                "grid": {"seed": [0]}, "out": str(tmp_path / "study"), "table": {"rows": "seed"}}
    grid.write_text(yaml.safe_dump(settings))
    assert not sweep(grid).failed
    grid.write_text(yaml.safe_dump({**settings, "log_to": f"tensorboard:{tmp_path / 'tb'}"}))
    assert not sweep(grid).failed
    assert [p.name for p in (tmp_path / "tb" / "study").iterdir()] == ["seed=0"]


def test_bad_or_missing_trackers_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    assert_refused(capsys, ["--protocol", "gossip", "--log-to", "wandb:x"], "--log-to 'wandb:x'", tmp_path / "a")
    assert_refused(capsys, ["--protocol", "gossip", "--log-to", "tensorboard"], "tensorboard:DIR", tmp_path / "a")
    monkeypatch.setattr(trackers, "installed", lambda module: False)
    assert_refused(capsys, ["--protocol", "gossip", "--log-to", "mlflow"], "p2p-emulator[mlflow]", tmp_path / "a")


def test_a_tracker_that_fails_after_the_run_is_one_line_and_exit_1(tmp_path, capsys):
    (tmp_path / "tb").write_text("a file, not a folder")
    assert main(["--protocol", "gossip", "--nodes", "3", "--rounds", "1", "--out", str(tmp_path / "run"), "--quiet",
                 "--no-plots", "--log-to", f"tensorboard:{tmp_path / 'tb'}"]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--log-to failed" in line and (tmp_path / "run" / "summary.json").is_file()
