"""Scale: gossip on a large random regular graph, through the `emulate` command in-process.

    python benchmarks/scale.py [--nodes 10000 --degree 4 --rounds 20]

Reports wall time, peak memory (max RSS of this process) and messages per second.
Targets for 10,000 nodes, degree 4, 20 rounds: under 60 s and under 2 GiB.
"""
from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from app.cli import main as emulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--degree", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        status = emulate(["--protocol", "gossip", "--topology", f"regular:d={args.degree}", "--nodes", str(args.nodes),
                          "--rounds", str(args.rounds), "--dim", "8", "--quiet", "--no-plots", "--out", out])
        wall = time.perf_counter() - start
        summary = json.loads((Path(out) / "summary.json").read_text())
    assert status == 0
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    table = Table(title=f"gossip, {args.nodes:,} nodes, random {args.degree}-regular, {args.rounds} rounds")
    for column in ("quantity", "value", "target"):
        table.add_column(column)
    table.add_row("wall time", f"{wall:.1f} s", "< 60 s")
    table.add_row("peak memory (max RSS)", f"{peak_gib:.2f} GiB", "< 2 GiB")
    table.add_row("messages delivered", f"{summary['messages_delivered']:,}", "")
    table.add_row("messages per wall second", f"{summary['messages_delivered'] / wall:,.0f}", "")
    table.add_row("final consensus error", f"{summary['final']['error']:.2e}", "")
    Console().print(table)


if __name__ == "__main__":
    main()
