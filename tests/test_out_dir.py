"""A run never mixes its files with an earlier run's, keeps its closed rounds on disk
whenever it stops, and ends on a signal with one line."""
import json
import random
import signal
import subprocess
import sys
import time

import pytest

from p2p_emulator.analysis.rundir import read_run, read_jsonl
from p2p_emulator.cli import main
from p2p_emulator.runs import execute
from p2p_emulator.settings import resolve
from emulator.protocol import NoOptions, Protocol, protocols
from tests.conftest import assert_one_line_error
from tests.forked import Forked

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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "links.csv", "metrics.jsonl", "summary.json"]
    run = read_run(tmp_path)
    assert (run.summary["nodes"], run.summary["rounds"], run.config["out"]) == (4, 2, str(tmp_path))
    assert sorted((row["round"], row["node"]) for row in run.metrics) == [(r, n) for r in range(2) for n in range(4)]
    assert len(run.links) == 4 * 3  # gossip's default topology, the mesh: every ordered pair


@pytest.mark.parametrize("where,named", [("file", "not a directory"), ("file/run", "Not a directory")])
def test_out_paths_that_cannot_be_a_directory_are_one_line_errors(tmp_path, capsys, where, named):
    (tmp_path / "file").write_text("")
    assert main([*GOSSIP, "--out", str(tmp_path / where)]) == 2
    assert_one_line_error(capsys, named)
    assert [p.name for p in tmp_path.iterdir()] == ["file"] and (tmp_path / "file").read_text() == ""  # untouched


# The run starts as from a terminal, with Ctrl-C's default handling (Python's KeyboardInterrupt), even where the
# tests run as a background job or under nohup: there SIGINT is ignored, the child inherits that, and Python
# installs its KeyboardInterrupt handler only where SIGINT's disposition is the default at start-up.
_MAIN = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
         "from p2p_emulator.cli import main; sys.exit(main(sys.argv[1:]))")


def _start(flags: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _MAIN, *map(str, flags)], stderr=subprocess.PIPE, text=True)


def _wait_for(path, run: subprocess.Popen | Forked, lines: int = 0) -> None:
    """Until `path` exists and holds `lines` whole lines."""
    deadline = time.monotonic() + 60
    while not (path.exists() and path.read_bytes().count(b"\n") >= lines):
        assert run.poll() is None and time.monotonic() < deadline, f"the run never wrote {lines} lines of {path.name}"
        time.sleep(0.01)


@pytest.mark.parametrize("sig,status,said", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_a_signal_ends_a_run_with_one_line_and_keeps_its_rounds(tmp_path, capsys, sig, status, said):
    out = tmp_path / "run"
    run = _start(["--protocol", "gossip", "--topology", "regular:d=4", "--nodes", "200", "--rounds", "100000",
                  "--quiet", "--out", out])
    try:
        # A round has closed once its 200 rows are on disk: the file exists from the os.open before their
        # write, and a signal in between (a busy machine can pause the run there) left 0 rounds to keep.
        _wait_for(out / "metrics.jsonl", run, lines=200)
        run.send_signal(sig)
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()  # a run the signal did not end must not outlive the test
    assert run.returncode == status
    assert err.strip().splitlines() == [f"emulate: {said}; the run directory is incomplete"]
    assert not (out / "summary.json").exists()
    kept = read_run(out, partial=True)
    assert kept.summary["rounds_completed"] >= 1 and len(kept.metrics) == 200 * kept.summary["rounds_completed"]
    assert sum(row["msgs_sent"] for row in kept.links) >= sum(row["msgs_sent"] for row in kept.metrics)
    assert main(["report", str(out), "--partial"]) == 0
    assert f"run (incomplete, {kept.summary['rounds_completed']} rounds)" in capsys.readouterr().out
    assert (out / "plots" / "error_vs_round.png").is_file()


KILLED = ["--protocol", "gossip", "--topology", "regular:d=4", "--nodes", "30", "--rounds", "30", "--trace",
          "--churn", "up=5,down=1", "--loss", "0.1", "--quiet", "--no-plots"]
LATE = ("msgs_received", "bytes_received")  # a round's messages may still arrive after it closed


def _whole_lines(text: str) -> tuple[list[str], str]:
    """The lines that end in a newline, and what follows the last one (a line cut by the kill, or "")."""
    body, newline, tail = text.rpartition("\n")
    return (body.split("\n") if newline else []), tail


def _without_late(line: str) -> dict:
    return {k: v for k, v in json.loads(line).items() if k not in LATE}


def test_a_run_killed_at_any_moment_keeps_whole_lines_of_its_closed_rounds(tmp_path, capsys):
    """20 kills at moments drawn over the run's length, as the uninterrupted run took it here: on a machine of
    any speed they land all through the run (a few after its end)."""
    run = Forked([*KILLED, "--out", tmp_path / "whole"])
    _wait_for(tmp_path / "whole" / "config.yaml", run)  # a kill's moment counts from there
    start = time.monotonic()
    run.wait()
    length = time.monotonic() - start
    assert run.poll() == 0
    whole = {name: (tmp_path / "whole" / name).read_text().splitlines() for name in ("metrics.jsonl", "messages.jsonl")}
    outcomes = []
    rng = random.Random(18)
    for k, moment in enumerate(rng.uniform(0, length) for _ in range(20)):
        out = tmp_path / f"killed{k}"
        run = Forked([*KILLED, "--out", out])
        try:
            _wait_for(out / "config.yaml", run)
            time.sleep(moment)
        finally:
            run.kill()
            run.wait()
        files, torn = {}, {}
        for path in out.glob("*.jsonl"):
            files[path.name], torn[path.name] = _whole_lines(path.read_text())
            assert all(isinstance(json.loads(line), dict) for line in files[path.name]), path.name
            # A SIGKILL inside one large write() may cut its last line (the kernel copies page by page):
            # the reader leaves it out, so an incomplete run never shows a partial row as whole.
            assert len(read_jsonl(path, torn_tail=bool(torn[path.name]))) == len(files[path.name])
        metrics = files.get("metrics.jsonl", [])
        assert [_without_late(line) for line in metrics] == [_without_late(line) for line in whole["metrics.jsonl"][:len(metrics)]]
        traced = files.get("messages.jsonl", [])
        assert traced == whole["messages.jsonl"][:len(traced)]
        if torn.get("messages.jsonl"):
            assert whole["messages.jsonl"][len(traced)].startswith(torn["messages.jsonl"]), "not a cut of the next row"
        finished = (out / "summary.json").exists()
        outcomes.append(finished)
        if not finished:
            capsys.readouterr()
            assert main(["report", str(out)]) == 2
            assert_one_line_error(capsys, "incomplete run")
    assert False in outcomes, "every kill came after the run finished: the moments test nothing"


class _LogsAfterItsRounds(Protocol):
    """Logs into its last round once its rounds are over: after that round closed, for the last node."""

    async def run(self, node):
        async for rnd in node.rounds():
            node.broadcast("x", rnd)
            await node.gather("x", timeout=0.01)
            node.log(value=rnd)
        node.log(after=True)


@pytest.mark.parametrize("protocol, flags", [
    ("gossip", {}),  # no closed round changes: the rows written at each close stay
    ("gossip", {"latency": "uniform:low=1ms,high=30ms", "timeout": 0.01}),  # late arrivals count in closed rounds
    (_LogsAfterItsRounds, {}),
])
def test_metrics_file_holds_the_rows_the_run_ends_with(tmp_path, protocol, flags):
    registry = protocols()
    settings = {"protocol": "gossip", "topology": "ring", "nodes": 6, "rounds": 4, "no_plots": True, "quiet": True,
                **flags}
    config, options = resolve(settings, registry)
    cls = registry[protocol] if isinstance(protocol, str) else protocol
    result = execute(config, options if isinstance(protocol, str) else NoOptions(), cls, tmp_path)
    assert read_jsonl(tmp_path / "metrics.jsonl") == result.metrics
    assert len(result.metrics) == 6 * 4
    if isinstance(protocol, str):  # with latencies over the timeout, messages land after their round closed
        late = sum(row["msgs_received"] - row["heard_from"] for row in result.metrics)
        assert (late > 0) == bool(flags)
    else:
        assert all(row.get("after") for row in result.metrics if row["round"] == 3)
