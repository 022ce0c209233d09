"""--executor batched against --executor thread on the same runs, measured in one go.

    ./dev bench batched [--cases mlp64 mlp256 cnn16 dfedavgm48 dpsgd48 gossip48 choco48] [--repeat 1]

Each run is a case's protocol on regular:d=4 (defaults otherwise: every node scored on the whole
test split every round), once per executor, each in its own `emulate` process with the default
workers. The figure is the ratio of the emulations' wall times (summary.json's wall_seconds),
taken in the same invocation, and the batched run's wall split into its jobs' seconds and
the rest (on the batched executor jobs run on the event loop's thread, unbatchable ones
excepted); with --repeat K each run is made K times, alternating the
executors, and the least wall time of each is kept. The two runs' traffic (links.csv and
messages.jsonl) must be byte-identical, and the table says so.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from p2p_emulator.settings import cores

CASES = {
    "mlp64": ["--protocol", "dfedavgm", "--dataset", "digits", "--model", "mlp:hidden=64", "--nodes", "64",
              "--rounds", "10"],
    "mlp256": ["--protocol", "dfedavgm", "--dataset", "digits", "--model", "mlp:hidden=64", "--nodes", "256",
               "--rounds", "10"],
    "cnn16": ["--protocol", "dfedavgm", "--dataset", "fashion-mnist", "--model", "cnn-small", "--nodes", "16",
              "--rounds", "3"],
}
# One setting, one run per protocol, side by side: CHOCO (momentum carried between rounds, compressed gossip) beside
# protocols that average whole models.
PROTOCOL_RUN = ["--dataset", "digits", "--model", "mlp:hidden=32", "--nodes", "48", "--rounds", "6", "--seed", "5"]
CASES.update({f"{short}48": ["--protocol", protocol, *PROTOCOL_RUN] for short, protocol in (
    ("dfedavgm", "dfedavgm"), ("dpsgd", "dpsgd"), ("gossip", "gossip-learning"), ("choco", "choco"))})
EXECUTORS = ("thread", "batched")


def emulate(out: Path, case: list[str], executor: str) -> dict:
    """One run in its own process; its summary.json."""
    argv = [sys.executable, "-m", "p2p_emulator.cli", "--topology", "regular:d=4", *case,
            "--executor", executor, "--trace", "--quiet", "--no-plots", "--overwrite", "--out", str(out)]
    subprocess.run(argv, check=True, cwd=Path(__file__).parents[1])
    return json.loads((out / "summary.json").read_text())


def same_traffic(a: Path, b: Path) -> bool:
    return all((a / name).read_bytes() == (b / name).read_bytes() for name in ("links.csv", "messages.jsonl"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    table = Table(title="regular:d=4: --executor batched against --executor thread")
    for column in ("run", "thread wall", "batched wall", "batched / thread", "peak RSS thread / batched",
                   "final test_acc thread / batched", "traffic identical"):
        table.add_column(column)
    parts = Table(title="What the wall time is made of (summary.json: executor.job_seconds)")
    for column in ("run", "thread: seconds in jobs", "batched: seconds in jobs",
                   "batched: the rest (messages, nodes, records)"):
        parts.add_column(column)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.cases:
            best: dict[str, dict] = {}
            for _ in range(args.repeat):
                for executor in EXECUTORS:
                    summary = emulate(Path(scratch) / executor, CASES[name], executor)
                    if executor not in best or summary["wall_seconds"] < best[executor]["wall_seconds"]:
                        best[executor] = summary
            thread, batch = best["thread"], best["batched"]
            table.add_row(
                name, f"{thread['wall_seconds']:.2f} s", f"{batch['wall_seconds']:.2f} s",
                f"{batch['wall_seconds'] / thread['wall_seconds']:.2f}",
                f"{thread['executor']['driver_peak_rss'] / 2**20:.0f} / "
                f"{batch['executor']['driver_peak_rss'] / 2**20:.0f} MiB",
                f"{thread['final']['test_acc']:.4f} / {batch['final']['test_acc']:.4f}",
                "yes" if same_traffic(Path(scratch) / "thread", Path(scratch) / "batched") else "NO")
            jobs = batch["executor"]["job_seconds"]
            parts.add_row(name, f"{sum(thread['executor']['job_seconds'].values()):.3f} (on {cores()} threads)",
                          ", ".join(f"{job} {seconds:.3f}" for job, seconds in jobs.items()),
                          # jobs that ran alone ran on the pool, beside the rest: no split then
                          f"{batch['wall_seconds'] - sum(jobs.values()):.3f} s" if batch["executor"]["batches"] else "-")
    console = Console(width=160)
    console.print(table)
    console.print(parts)
    console.print({name: " ".join(CASES[name]) for name in args.cases})
    print(f"bench wall: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
