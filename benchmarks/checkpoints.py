"""What --checkpoint-every costs: wall time, disk per checkpoint, and the emulated time the barrier adds.

    ./dev bench checkpoints [--cases dfedavgm100 mapl20] [--every 1]

Each case runs twice in its own `emulate` process, without and with --checkpoint-every,
in the same invocation: the wall-time ratio, the checkpoint file's size (the last one
written; each replaces the one before), the barriers met and barrier_seconds (emulated
time between each barrier's first arrival and its release), and the emulated run time
both ways.
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

CASES = {
    "dfedavgm100": ["--protocol", "dfedavgm", "--topology", "regular:d=4", "--nodes", "100", "--rounds", "3",
                    "--model", "cnn-small", "--dataset", "fashion-mnist", "--local-steps", "5", "--test-set", "local"],
    "mapl20": ["--protocol", "mapl", "--topology", "mesh", "--nodes", "20", "--rounds", "4", "--model", "hetero-small",
               "--partition", "mapl:scenario=1", "--local-epochs", "1"],
}


def emulate(out: Path, flags: list[str]) -> tuple[dict, float]:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "p2p_emulator.cli", *flags, "--quiet", "--no-plots", "--out", str(out)], check=True,
                   cwd=Path(__file__).parents[1])
    return json.loads((out / "summary.json").read_text()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--every", type=int, default=1)
    args = parser.parse_args()
    table = Table(title=f"--checkpoint-every {args.every} against no checkpoints")
    for column in ("run", "emulation wall without / with", "ratio", "writing checkpoints", "checkpoint file", "barriers",
                   "barrier_seconds (emulated)", "emulated seconds without / with"):
        table.add_column(column)
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.cases:
            plain, _ = emulate(Path(scratch) / name / "plain", CASES[name])
            out = Path(scratch) / name / "checkpointed"
            checked, _ = emulate(out, [*CASES[name], "--checkpoint-every", str(args.every)])
            barriers = checked["checkpoints"]
            table.add_row(name, f"{plain['wall_seconds']:.2f} / {checked['wall_seconds']:.2f} s",
                          f"{checked['wall_seconds'] / plain['wall_seconds']:.3f}",
                          f"{barriers['write_seconds']:.2f} s",
                          f"{(out / 'checkpoint').stat().st_size / 2**20:.1f} MiB", str(barriers["barriers"]),
                          f"{barriers['barrier_seconds']:.3f} s",
                          f"{plain['emulated_seconds']:.3f} / {checked['emulated_seconds']:.3f} s")
    Console(width=160).print(table)
    console = Console(width=160)
    console.print({name: " ".join(CASES[name]) for name in args.cases})


if __name__ == "__main__":
    main()
