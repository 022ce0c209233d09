"""`emulate watch` and `--watch`: the page follows a run directory as it streams, in a real browser."""
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import assert_one_line_error, assert_refused
from p2p_emulator.analysis.rundir import final_metrics
from p2p_emulator.analysis import watch
from p2p_emulator.analysis.watch import RunPage, main as watch_main
from p2p_emulator.cli import main

CHROMIUM = shutil.which("chromium")
BROWSER_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]  # no connection attempts out of this machine
ROUNDS = 8


def _rows(rounds: range) -> list[dict]:
    return [{"round": r, "node": n, "t": 0.5 * (r + 1), "test_acc": 0.1 * r + 0.05 * n, "bytes_sent": 100 * (n + 1)}
            for r in rounds for n in range(2)]


def _append(path, rows) -> None:
    with open(path / "metrics.jsonl", "a") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows)


def _state(page: RunPage, since: int) -> dict:
    return json.loads(page.current(since)[0])


def test_the_state_follows_the_run_directory_as_it_streams(tmp_path, monkeypatch):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"protocol": "gossip", "topology": "ring", "nodes": 2}))
    monkeypatch.setattr(watch, "DRAW_SHARE", 0)  # every change drawn at once ...
    page = RunPage(tmp_path)
    _append(tmp_path, _rows(range(2)))
    state = _state(page, -1)
    assert state["status"] == "running" and "incomplete, 2 rounds" in state["name"]
    centre = state["charts"]["metric-round"]["data"][2]
    assert centre["x"] == [0, 1] and centre["y"] == pytest.approx([0.025, 0.125])
    assert _state(page, state["version"]) == {"version": state["version"]}  # nothing new: nothing sent
    monkeypatch.setattr(watch, "DRAW_SHARE", 1e6)  # ... until a drawing puts the next one far off
    _append(tmp_path, _rows(range(2, 3)))
    state = _state(page, state["version"])
    assert state["charts"]["metric-round"]["data"][2]["x"] == [0, 1, 2]
    _append(tmp_path, _rows(range(3, 5)))
    assert _state(page, state["version"]) == {"version": state["version"]}  # new rounds wait for it ...
    (tmp_path / "summary.json").write_text(json.dumps({"final": final_metrics(_rows(range(5))), "nodes": 2,
                                                       "bytes_total": 1500, "emulated_seconds": 2.5}))
    state = _state(page, state["version"])  # ... but the summary does not
    assert state["status"] == "finished" and state["name"] == tmp_path.name
    assert state["charts"]["metric-round"]["data"][2]["x"] == [0, 1, 2, 3, 4]
    report = dict(zip(state["report"]["headers"], state["report"]["cells"]))
    assert report["final mean ± std"] == "42.50 ± 2.50" and report["total bytes"] == "1.50 kB"


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as free:
        return free.getsockname()[1]


def test_watch_serves_the_run_from_its_start_and_stops_once_the_summary_was_sent(tmp_path):
    """--watch end to end without a browser: a client asking as the page does gets every state, the last the
    finished run's; then the run returns and nothing listens on the port any more."""
    port, out, status, states = _free_port(), tmp_path / "run", [], []
    run = threading.Thread(target=lambda: status.append(main([
        "--protocol", "gossip", "--nodes", "4", "--rounds", "3", "--out", str(out), "--quiet", "--no-plots",
        "--watch", "--watch-port", str(port)])))
    run.start()
    while run.is_alive() and not (states and states[-1].get("status") == "finished"):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/state.json", timeout=10) as answer:
                states.append(json.load(answer))
        except OSError:
            time.sleep(0.05)  # not listening yet
    run.join(timeout=30)
    assert status == [0] and states[-1]["status"] == "finished" and not _listening(port)
    assert states[-1]["charts"]["metric-round"]["data"][2]["x"] == [0, 1, 2]


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, which init has yet to reap, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_the_server_of_a_killed_run_stops(tmp_path):
    """`emulate watch --follow PID` stops once the run's process is gone, summary.json or not."""
    (tmp_path / "config.yaml").write_text("protocol: gossip\n")
    run = subprocess.Popen([sys.executable, "-c", "import os, subprocess, sys, time; print(subprocess.Popen(["
                            "sys.executable, '-m', 'p2p_emulator.analysis.watch', sys.argv[1], '--follow', "
                            "str(os.getpid())]).pid, flush=True); time.sleep(60)", str(tmp_path)],
                           stdout=subprocess.PIPE, text=True)
    server = int(run.stdout.readline())
    assert _alive(server)
    run.kill()
    run.wait()
    run.stdout.close()
    deadline = time.monotonic() + 20
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert watch_main([str(tmp_path / "absent")]) == 2
    assert_one_line_error(capsys, "no such run directory")
    assert watch_main([str(tmp_path)]) == 2
    assert_one_line_error(capsys, "not a run directory")
    assert_refused(capsys, ["--protocol", "gossip", "--nodes", "3", "--watch-port", "8050"], "--watch-port",
                   tmp_path / "run")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        assert_refused(capsys, ["--protocol", "gossip", "--nodes", "3", "--watch", "--watch-port", port],
                       "--watch-port", tmp_path / "run")
    assert_refused(capsys, ["--protocol", "gossip", "--nodes", "3", "--watch", "--transport", "tcp"], "--watch",
                   tmp_path / "run")


@pytest.fixture
def browser():
    playwright = pytest.importorskip("playwright.sync_api")
    if CHROMIUM is None:
        pytest.skip("Debian package chromium not installed (./dev installs it)")
    with playwright.sync_playwright() as driver:
        chromium = driver.chromium.launch(executable_path=CHROMIUM, args=BROWSER_FLAGS)
        yield chromium
        chromium.close()


def test_the_page_gains_points_while_a_run_goes_and_shows_its_summary(tmp_path, browser):
    """A run on the real clock (rounds of about 1.3 s, so that a loaded machine still shows several), watched from
    its start to its summary."""
    port, out, status = _free_port(), tmp_path / "run", []
    run = threading.Thread(target=lambda: status.append(main([
        "--protocol", "fedavg", "--topology", "star", "--nodes", "5", "--rounds", str(ROUNDS), "--clock", "real",
        "--latency", "300ms", "--out", str(out), "--quiet", "--no-plots", "--watch", "--watch-port", str(port)])))
    run.start()
    page = browser.new_page()
    try:
        while run.is_alive() and not _listening(port):  # the run binds it once its settings are checked
            time.sleep(0.05)
        page.goto(f"http://127.0.0.1:{port}/")
        counts = []  # the accuracy chart's points, each time the page is looked at before the summary shows
        while page.is_hidden("#summary") and run.is_alive():
            counts.append(page.evaluate("() => document.getElementById('chart-metric-round')?.data?.[2].x.length"))
            time.sleep(0.25)
        page.wait_for_selector("#summary:not([hidden])", timeout=30_000)
        seen = sorted({c for c in counts if c})
        assert len(seen) >= 2 and seen[-1] < ROUNDS, counts  # it gained points while the run went
        assert page.evaluate("document.getElementById('chart-metric-round').data[2].x.length") == ROUNDS
        final = json.loads((out / "summary.json").read_text())["final"]
        cells = dict(zip(page.locator("#summary-table th").all_inner_texts(),
                         page.locator("#summary-table td").all_inner_texts()))
        assert cells["final mean ± std"] == f"{100 * final['test_acc']:.2f} ± {100 * final['test_acc_std']:.2f}"
    finally:
        run.join(timeout=60)
    assert status == [0]
