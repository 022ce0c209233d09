"""Start-up: the whole `emulate` process against a plain PyTorch script doing the same work.

    ./dev bench startup [--repeats 5]

Two comparisons, each the median of REPEATS alternating pairs of fresh processes:
- the bare-loop workload: `emulate --protocol fedavg --topology star --nodes 17 --rounds 10` with the
  peers' settings (benchmarks/global_fedavg.py's WORKLOAD; the server holds no data, so 16 clients)
  against benchmarks/plain_fedavg.py, the same FedAvg written as a plain loop. Target: ratio <= 1.0.
- the command's own cost: the same run with `--rounds 0` against a script that imports torch and
  reads the digits' file as emulate does. Target: at most 0.2 s more.
Both emulate runs use --quiet --no-plots: the plain script draws and prints nothing either.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from global_fedavg import WORKLOAD  # noqa: E402

RUN = ["--protocol", "fedavg", "--topology", "star", "--nodes", "17", *WORKLOAD, "--quiet", "--no-plots"]
# import torch, then the digits read as emulate reads them (scikit-learn's CSV, without importing scikit-learn)
PLAIN_START = ("import gzip, importlib.util, pathlib, numpy, torch; "
               "csv = pathlib.Path(importlib.util.find_spec('sklearn').origin).with_name('datasets') / 'data/digits.csv.gz'; "
               "numpy.loadtxt(gzip.open(csv, 'rt'), delimiter=',')")
RATIO_TARGET = 1.0
OWN_COST_TARGET = 0.2  # seconds over import torch + the digits


def whole(argv: list[str]) -> float:
    """Wall time of one fresh process, from spawn to exit."""
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, cwd=HERE.parent)
    return time.perf_counter() - start


def pairs(first: list[str], second: list[str], repeats: int) -> tuple[float, float]:
    """Medians of `repeats` alternating runs of two commands."""
    times = [(whole(first), whole(second)) for _ in range(repeats)]
    return statistics.median(a for a, _ in times), statistics.median(b for _, b in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    emulate = [str(Path(sys.executable).with_name("emulate"))]
    console = Console(width=150)
    table = Table(title=f"whole processes, medians of {args.repeats} alternating pairs")
    for column in ("workload", "emulate", "plain", "emulate / plain", "emulate - plain", "target"):
        table.add_column(column, justify="left" if column in ("workload", "target") else "right")
    with tempfile.TemporaryDirectory() as out:
        run = [*emulate, *RUN, "--out", out, "--overwrite"]
        full = pairs([*run, "--rounds", "10"], [sys.executable, str(HERE / "plain_fedavg.py")], args.repeats)
        bare = pairs([*run, "--rounds", "0"], [sys.executable, "-c", PLAIN_START], args.repeats)
    for label, (mine, plain), target, met in (
            ("FedAvg, 16 clients, 10 rounds", full, f"ratio <= {RATIO_TARGET}", full[0] <= RATIO_TARGET * full[1]),
            ("--rounds 0 / import torch + the digits' file", bare, f"<= +{OWN_COST_TARGET} s",
             bare[0] - bare[1] <= OWN_COST_TARGET)):
        table.add_row(label, f"{mine:.2f} s", f"{plain:.2f} s", f"{mine / plain:.3f}", f"{mine - plain:+.2f} s",
                      f"{target} " + ("[green]met" if met else "[red]missed"))
    console.print(table)


if __name__ == "__main__":
    main()
