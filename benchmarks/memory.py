"""Memory per node, per protocol: the peak RSS of a run at two sizes, each in a fresh process.

    ./dev bench memory [--small 16] [--large 64] [--rounds 2] [--model cnn-small]

Bytes per node = (peak RSS at --large nodes - peak RSS at --small nodes) / (large - small):
what one more node costs, with the imports and the dataset (the same at both sizes) taken
out. Every run: digits (iid), `regular:d=4` (fedavg: a star with its server), --rounds
rounds, --no-plots. Also printed: the model's parameter bytes, for scale.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from rich.console import Console
from rich.table import Table
from scale import peak_rss  # this folder is on sys.path when a benchmark runs

PROTOCOLS = ("gossip", "push-sum", "local", "dpsgd", "dfedavgm", "gossip-learning", "fedavg", "l2c",
             "meta-l2c", "mapl", "mapl+", "choco", "powergossip")


def flags(protocol: str, nodes: int, rounds: int, model: str) -> list[str]:
    common = ["--protocol", protocol, "--nodes", str(nodes), "--rounds", str(rounds), "--no-plots", "--quiet"]
    if protocol in ("gossip", "push-sum"):
        return [*common, "--topology", "regular:d=4"]
    topology = "star" if protocol == "fedavg" else "regular:d=4"
    return [*common, "--topology", topology, "--dataset", "digits", "--partition", "iid", "--model", model]


def child(argv: list[str]) -> dict:
    from p2p_emulator.cli import main as emulate

    with tempfile.TemporaryDirectory() as out:
        status = emulate([*argv, "--out", out])
    return {"status": status, "peak": peak_rss()}


def peak(argv: list[str]) -> int:
    done = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == 0, f"emulate {' '.join(argv)} exited with {result['status']}"
    return result["peak"]


def model_bytes(model: str) -> int:
    from p2p_emulator.workloads.models import build_model

    return sum(p.numel() * p.element_size() for p in build_model(model, (1, 8, 8), 10).parameters())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2:])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=16)
    parser.add_argument("--large", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="cnn-small")
    parser.add_argument("--protocols", nargs="+", default=list(PROTOCOLS))
    args = parser.parse_args()
    table = Table(title=f"memory per node: ({args.large} - {args.small} nodes), {args.rounds} rounds, "
                        f"{args.model} on digits ({model_bytes(args.model) / 1024:,.0f} KiB of parameters)")
    for column in ("protocol", f"peak RSS, {args.small} nodes", f"peak RSS, {args.large} nodes", "per node"):
        table.add_column(column, justify="left" if column == "protocol" else "right")
    for protocol in args.protocols:
        small = peak(flags(protocol, args.small, args.rounds, args.model))
        large = peak(flags(protocol, args.large, args.rounds, args.model))
        table.add_row(protocol, f"{small / 2**20:,.0f} MiB", f"{large / 2**20:,.0f} MiB",
                      f"{(large - small) / (args.large - args.small) / 1024:,.0f} KiB")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
