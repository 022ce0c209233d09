"""What watching costs: a run with --watch and a page asking every second, against the same run unwatched;
and what one drawing of the page's state costs the server.

    ./dev bench watch [--repeats 3]

Two runs (WORKLOADS): the MAPL run of docs/plots-and-sweeps.md's screenshot (8 nodes, churn, samples, and
MAPL's two figures drawn as PNGs), and gossip on 2,000 nodes (60,000 metric rows, a 2,000 x 2,000 link
matrix drawn as 200 x 200 blocks). For each, the medians of REPEATS alternating pairs of fresh processes,
the watched one polled at the page's rate by a thread of this script (as a browser would, without one),
whole and until summary.json was written (after it, a watched run waits for the page's last poll);
then, on the watched run's finished directory, the server's first drawing after its warm-up (with the
extensions' PNGs, which a finished run always gets), a second one, and the bytes of the state it sends.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from p2p_emulator.analysis.charts import warm_up  # noqa: E402
from p2p_emulator.analysis.watch import POLL_SECONDS, RunPage  # noqa: E402

WORKLOADS = {
    "mapl, 8 nodes, 12 rounds, churn, samples": ["--protocol", "mapl", "--topology", "mesh", "--nodes", "8",
                                                 "--rounds", "12", "--churn", "up=3s,down=1s",
                                                 "--eval-every-seconds", "0.5"],
    "gossip, 2,000 nodes, 30 rounds": ["--protocol", "gossip", "--topology", "regular:d=4", "--nodes", "2000",
                                       "--rounds", "30"],
}


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def ask(port: int, done: threading.Event) -> None:
    """Ask for the state every POLL_SECONDS until `done`, as the page does."""
    version = -1
    while not done.wait(POLL_SECONDS):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/state.json?since={version}", timeout=30) as answer:
                version = json.load(answer)["version"]
        except (OSError, ValueError):
            continue  # not listening yet, or gone with the run


def timed(argv: list[str], watched: bool, run_dir: Path) -> tuple[float, float]:
    """Wall time of one fresh `emulate` process, and until it had written summary.json; watched: with --watch and a
    thread asking as the page does (a watched run then waits for the page to be sent the summary)."""
    port = free_port()
    done = threading.Event()
    asking = threading.Thread(target=ask, args=(port, done))
    if watched:
        argv = [*argv, "--watch", "--watch-port", str(port)]
        asking.start()
    start, since_epoch = time.perf_counter(), time.time()
    subprocess.run(argv, check=True, capture_output=True, cwd=HERE.parent)
    wall = time.perf_counter() - start
    done.set()
    if watched:
        asking.join()
    return wall, (run_dir / "summary.json").stat().st_mtime - since_epoch


def drawings(run_dir: Path) -> tuple[float, float, int]:
    """The first and a second drawing of a finished run's state (seconds), after the server's warm-up, and its
    bytes."""
    warm_up()
    page = RunPage(run_dir)
    start = time.perf_counter()
    state, _ = page.current(-1)
    first = time.perf_counter() - start
    page._seen, page._next_draw = (), 0.0  # as if a file had changed, and the pacing let it draw
    start = time.perf_counter()
    page.current(-1)
    return first, time.perf_counter() - start, len(state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    emulate = [str(Path(sys.executable).with_name("emulate"))]
    table = Table(title=f"whole processes, medians of {args.repeats} alternating pairs; the page's state, drawn once "
                        "more on the finished run")
    for column in ("run", "unwatched", "watched", "watched / unwatched", "to summary.json, watched / unwatched",
                   "first drawing", "drawing", "state"):
        table.add_column(column, justify="left" if column == "run" else "right")
    with tempfile.TemporaryDirectory() as out:
        run_dir = Path(out) / "run"
        for label, flags in WORKLOADS.items():
            run = [*emulate, *flags, "--quiet", "--no-plots", "--out", str(run_dir), "--overwrite"]
            times = [(timed(run, False, run_dir), timed(run, True, run_dir)) for _ in range(args.repeats)]
            plain, watched = (statistics.median(pair[k][0] for pair in times) for k in (0, 1))
            written = statistics.median(w[1] / p[1] for p, w in times)
            first, again, size = drawings(run_dir)
            table.add_row(label, f"{plain:.2f} s", f"{watched:.2f} s", f"{watched / plain:.3f}", f"{written:.3f}",
                          f"{first:.2f} s", f"{again:.2f} s", f"{size / 1000:.0f} kB")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
