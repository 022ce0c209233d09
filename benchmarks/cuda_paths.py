"""The CUDA paths, on a machine with a GPU: --device cuda (thread executor, one GPU worker), the batched
executor on the GPU, and DP-SGD's per-sample gradients there, each against the same run on the CPU; and
LEAF's full char-LSTM on the fortunes text (natural partition), where a GPU should pay.

    ./dev bench cuda_paths [--out DIR] [--only WORD] [--fortunes DIR]

Each run is its own `emulate` process. The table gives each run's wall time (summary.json's
wall_seconds), final mean test accuracy and bytes sent, and whether its traffic (links.csv) is
byte-identical to its CPU twin's (blank where --only left the twin out): the ledger must not depend on
where the tensors live. Accuracy may differ in the last digits (GPU kernels round differently).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

DFEDAVGM = ["--protocol", "dfedavgm", "--topology", "regular:d=4", "--dataset", "digits", "--nodes", "64",
            "--rounds", "10"]
CASES = {  # name: (arguments, the CPU twin's name)
    "dfedavgm cnn-small cpu thread": ([*DFEDAVGM, "--model", "cnn-small"], None),
    "dfedavgm cnn-small cuda thread": ([*DFEDAVGM, "--model", "cnn-small", "--device", "cuda"],
                                       "dfedavgm cnn-small cpu thread"),
    "dfedavgm cnn-small cpu batched": ([*DFEDAVGM, "--model", "cnn-small", "--executor", "batched"], None),
    "dfedavgm cnn-small cuda batched": ([*DFEDAVGM, "--model", "cnn-small", "--executor", "batched",
                                        "--device", "cuda"], "dfedavgm cnn-small cpu batched"),
    "fedavg dp-sgd cpu": (["--protocol", "fedavg", "--topology", "star", "--nodes", "9", "--rounds", "5",
                           "--norm", "group", "--dp", "clip=1,noise=1"], None),
    "fedavg dp-sgd cuda": (["--protocol", "fedavg", "--topology", "star", "--nodes", "9", "--rounds", "5",
                            "--norm", "group", "--dp", "clip=1,noise=1", "--device", "cuda"], "fedavg dp-sgd cpu"),
    "mapl default cpu": (["--rounds", "5"], None),
    "mapl default cuda": (["--rounds", "5", "--device", "cuda"], "mapl default cpu"),
}
# The study of experiments/natural_fortunes.yaml (FedAvg row) with LEAF's full 256-unit char-LSTM, 6 rounds.
CHAR_LSTM = ["--protocol", "fedavg", "--topology", "star", "--nodes", "21", "--dataset", "fortunes",
             "--partition", "natural:nodes=20,samples=150,test=50", "--model", "char-lstm", "--rounds", "6",
             "--local-epochs", "2", "--batch-size", "10", "--lr", "0.5", "--momentum", "0.9", "--local-steps", "0"]
TEXT_CASES = {
    "fedavg char-lstm cpu thread": (CHAR_LSTM, None),
    "fedavg char-lstm cuda thread": ([*CHAR_LSTM, "--device", "cuda"], "fedavg char-lstm cpu thread"),
    "fedavg char-lstm cuda batched": ([*CHAR_LSTM, "--device", "cuda", "--executor", "batched"],
                                      "fedavg char-lstm cpu thread"),
}


def emulate(out: Path, args: list[str]) -> dict:
    argv = [sys.executable, "-m", "p2p_emulator.cli", *args, "--quiet", "--no-plots", "--overwrite", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="keep the run directories here (default: a temporary one)")
    parser.add_argument("--only", default="", help="run only the cases whose name holds this word")
    parser.add_argument("--fortunes", default="", help="the fortunes folder, where the Debian package is missing")
    args = parser.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="cuda_paths-"))
    table = Table("run", "wall s", "test_acc", "bytes", "links.csv as on the CPU", title="CUDA paths")
    text_root = ["--data-root", args.fortunes] if args.fortunes else []
    cases = {**CASES, **{name: ([*case, *text_root], twin) for name, (case, twin) in TEXT_CASES.items()}}
    ran = {}  # name: its run directory, for the runs of this call that finished
    for name, (case, twin) in cases.items():
        if args.only not in name:
            continue
        out = root / name.replace(" ", "_")
        summary = emulate(out, case)
        if "error" in summary:
            table.add_row(name, "-", "-", "-", summary["error"])
            continue
        ran[name] = out
        same = "" if twin not in ran else str(
            (out / "links.csv").read_bytes() == (ran[twin] / "links.csv").read_bytes())
        table.add_row(name, f"{summary['wall_seconds']:.1f}", f"{summary['final'].get('test_acc', float('nan')):.4f}",
                      f"{summary['bytes_total']:,}", same)
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
