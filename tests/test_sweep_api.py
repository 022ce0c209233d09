"""sweep(): `emulate sweep --grid FILE` from Python."""
import pytest
import yaml

from emulator.errors import UsageError
from p2p_emulator.sweeps import sweep

GRID = {"base": {"protocol": "gossip", "nodes": 4, "rounds": 2, "no_plots": True},
        "grid": {"seed": [0, 1]}, "table": {"rows": "seed", "metric": "error"}}


def _grid_file(tmp_path, grid: dict):
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({**grid, "out": str(tmp_path / "study")}))
    return path


def test_sweep_returns_its_run_directories_and_tables(tmp_path):
    result = sweep(_grid_file(tmp_path, GRID))
    study = tmp_path / "study"
    assert result.out == study and result.runs == [study / "seed=0", study / "seed=1"]
    assert all((run / "summary.json").is_file() for run in result.runs)
    assert result.failed == [] and not (study / "failed.csv").exists()
    assert study / "table_error.csv" in result.written and all(path.is_file() for path in result.written)


def test_a_bad_grid_raises_a_one_line_usage_error(tmp_path):
    with pytest.raises(UsageError) as error:
        sweep(_grid_file(tmp_path, {**GRID, "base": {**GRID["base"], "rouns": 2}}))
    assert "--rouns" in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "study").exists()  # nothing ran
