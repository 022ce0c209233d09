"""Every JSON and JSONL file of a run directory is strict JSON: NaN and infinities are null, and counted."""
import json
import math
from pathlib import Path

from p2p_emulator.analysis.rundir import RunDirWriter, read_run


def strict(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def assert_strict(run_dir: Path) -> None:
    for path in run_dir.glob("*.json"):
        strict(path.read_text())
    for path in run_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            strict(line)


def test_non_finite_values_are_written_as_null_and_counted(tmp_path):
    writer = RunDirWriter(tmp_path)
    writer.config({"protocol": "gossip", "topology": "ring", "nodes": 2})
    writer.append("metrics.jsonl", [{"round": 0, "node": 0, "t": 1.0, "loss": math.nan},
                                    {"round": 0, "node": 1, "t": 1.0, "loss": 0.5, "w": [1.0, math.inf]}])
    writer.append("graph.jsonl", [{"round": 0, "node": 0, "weights": {"0": -math.inf}}])
    writer.finish({"final": {"loss": 0.5}, "extra": math.nan})
    assert_strict(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["non_finite_as_null"] == {"metrics.jsonl": {"loss": 1, "w": 1}, "graph.jsonl": {"weights": 1},
                                             "summary.json": {"extra": 1}}
    run = read_run(tmp_path)
    assert math.isnan(run.curves("loss").values[0, 0]) and run.curves("loss").values[1, 0] == 0.5


def test_a_finite_run_says_nothing_of_nulls(tmp_path):
    writer = RunDirWriter(tmp_path)
    writer.jsonl("metrics.jsonl", [{"round": 0, "node": 0, "loss": 1.0}])
    writer.finish({"final": {}})
    assert "non_finite_as_null" not in json.loads((tmp_path / "summary.json").read_text())
