"""`emulate sweep --executor ray`: each run a Ray task, the same run directories as locally; a loopback-only Ray."""
import socket

import pytest

ray = pytest.importorskip("ray")

from tests.run_dirs import sweep_contents  # noqa: E402
from tests.test_parallel_sweeps import GRID, sweep_in, write_grid  # noqa: E402

# local_ray (tests/conftest.py): the local Ray that `emulate` starts itself, which a sweep joins; one for all the
# Ray tests.
pytestmark = pytest.mark.xdist_group("ray")


def _this_machines_address() -> str | None:
    """An address of this machine other than loopback (None without a network)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # a documentation address: nothing is sent
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_the_local_ray_listens_on_loopback_only(local_ray):
    host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
    assert host == "127.0.0.1" and {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
    outside = _this_machines_address()
    if outside is None:
        pytest.skip("no address other than loopback to try")
    socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()  # it does listen ...
    with pytest.raises(OSError):
        socket.create_connection((outside, int(port)), timeout=5).close()  # ... but not on the network


def test_ray_tasks_give_the_sequential_run_directories(local_ray, tmp_path, monkeypatch):
    sequential = tmp_path / "sequential"
    write_grid(sequential)
    assert sweep_in(sequential, monkeypatch) == 0
    on_ray = tmp_path / "ray"
    write_grid(on_ray, {**GRID, "executor": "ray", "resources": {"cpus": 1}})
    assert sweep_in(on_ray, monkeypatch) == 0
    expected, got = sweep_contents(sequential / "runs" / "sweep"), sweep_contents(on_ray / "runs" / "sweep")
    assert len(expected) >= 20 and got.keys() == expected.keys()
    assert [name for name in expected if got[name] != expected[name]] == []


def test_a_failed_ray_task_is_recorded_and_the_rest_run(local_ray, tmp_path, monkeypatch, capsys):
    grid = {**GRID, "base": {**GRID["base"], "protocol": "dfedavgm"},
            "grid": {"data": [{"dataset": "digits", "label": "digits"},
                              {"dataset": "fashion-mnist", "data_root": str(tmp_path / "none"), "label": "missing"}]}}
    write_grid(tmp_path, grid)
    assert sweep_in(tmp_path, monkeypatch, "--executor", "ray") == 1
    assert "1 of 2 runs failed" in capsys.readouterr().err
    assert (tmp_path / "runs" / "sweep" / "data=digits" / "summary.json").is_file()
    assert "none" in (tmp_path / "runs" / "sweep" / "failed.csv").read_text()
