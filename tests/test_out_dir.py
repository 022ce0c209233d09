"""A run never mixes its files with an earlier run's, and ends on a signal with one line."""
import signal
import subprocess
import sys
import time

import pytest

from app.cli import main
from tests.conftest import assert_one_line_error

GOSSIP = ["--protocol", "gossip", "--nodes", "4", "--rounds", "2", "--quiet"]


def test_an_out_directory_holding_a_run_is_refused(tmp_path, capsys):
    assert main([*GOSSIP, "--out", str(tmp_path)]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    capsys.readouterr()
    assert main([*GOSSIP, "--nodes", "6", "--out", str(tmp_path)]) == 2
    assert_one_line_error(capsys, "--overwrite")
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before  # untouched


def test_overwrite_leaves_no_file_of_the_old_run(tmp_path):
    assert main([*GOSSIP, "--trace", "--out", str(tmp_path)]) == 0
    (tmp_path / "notes.txt").write_text("mine")
    assert main([*GOSSIP, "--nodes", "6", "--overwrite", "--no-plots", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "links.csv", "metrics.jsonl",
                                                         "summary.json"]
    assert '"nodes": 6' in (tmp_path / "summary.json").read_text()


def test_an_empty_out_directory_is_used(tmp_path):
    assert main([*GOSSIP, "--no-plots", "--out", str(tmp_path)]) == 0


@pytest.mark.parametrize("where,named", [("file", "not a directory"), ("file/run", "Not a directory")])
def test_out_paths_that_cannot_be_a_directory_are_one_line_errors(tmp_path, capsys, where, named):
    (tmp_path / "file").write_text("")
    assert main([*GOSSIP, "--out", str(tmp_path / where)]) == 2
    assert_one_line_error(capsys, named)


@pytest.mark.parametrize("sig,status,said", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_a_signal_ends_a_run_with_one_line(tmp_path, sig, status, said):
    out = tmp_path / "run"
    run = subprocess.Popen([sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main(sys.argv[1:]))",
                            "--protocol", "gossip", "--topology", "regular:d=4", "--nodes", "2000",
                            "--rounds", "100000", "--quiet", "--out", str(out)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not out.exists():  # the run directory is made once the settings are checked
            assert run.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.05)
        time.sleep(1.0)  # into the rounds
        run.send_signal(sig)
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()  # a run the signal did not end must not outlive the test
    assert run.returncode == status
    assert err.strip().splitlines() == [f"emulate: {said}; the run directory is incomplete"]
    assert not (out / "summary.json").exists()
