"""Emulator overhead: `emulate --protocol dfedavgm` against the bare loop in benchmarks/bare_dfedavgm.py.

    python benchmarks/overhead.py [--nodes 8 --rounds 3 --dataset fashion-mnist]

Both run the identical training and averaging (cnn-small, same partition, seeds
and MH weights); the emulator also encodes, sends, decodes and accounts every
model. Both use one compute worker with one torch thread (OMP_NUM_THREADS=1;
contended intra-op threads would swamp the comparison), so only the network
layer differs. The figure is the ratio of their training-loop wall times.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="8")
    parser.add_argument("--rounds", default="3")
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--partition", default="mapl:scenario=1")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["--nodes", args.nodes, "--rounds", args.rounds, "--dataset", args.dataset, "--partition", args.partition]
    bare = json.loads(subprocess.run([sys.executable, str(HERE / "bare_dfedavgm.py"), *common], check=True,
                                     capture_output=True, text=True, cwd=HERE.parent, env=env).stdout)
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "p2p_emulator.cli", "--protocol", "dfedavgm", "--topology", "ring",
                        "--model", "cnn-small", "--workers", "1", *common, "--quiet", "--no-plots", "--out", out],
                       check=True, cwd=HERE.parent, env=env)
        summary = json.loads((Path(out) / "summary.json").read_text())
    table = Table(title=f"dfedavgm, {args.nodes} nodes, {args.rounds} rounds, cnn-small on {args.dataset}")
    for column in ("run", "training-loop wall time", "final test_acc"):
        table.add_column(column)
    table.add_row("bare PyTorch loop", f"{bare['wall_seconds']:.2f} s", f"{bare['test_acc']:.4f}")
    table.add_row("emulate", f"{summary['wall_seconds']:.2f} s", f"{summary['final']['test_acc']:.4f}")
    table.add_row("ratio emulate / bare", f"{summary['wall_seconds'] / bare['wall_seconds']:.3f}", "")
    Console().print(table)


if __name__ == "__main__":
    main()
