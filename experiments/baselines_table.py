"""The baselines on one workload: accuracy against bytes for dfedavgm, dpsgd, gossip learning, FedAvg and Local.

    PYTHONPATH=. python experiments/baselines_table.py [--out runs/baselines] [--seeds 0 1 2]
                                                       [--nodes 16] [--rounds 100]

Digits, IID, the MLP 64-64-10 (`mlp:hidden=64`), one local epoch per round of SGD
with lr 0.05, momentum 0.9 and weight decay 5e-4 (D-PSGD: its one plain SGD step per
round), every node from one x0 (Local: its own), all scored on the whole test split.
The peer-to-peer protocols run on a ring of --nodes; FedAvg on a star of --nodes
clients plus a server, every client every round. Accuracy is the mean over nodes at the last round
(FedAvg: the server's global model), MB the bytes sent by all nodes, msgs/round the
messages per round.

Every run goes through app.cli.main into OUT/<name>-s<seed> (kept: a rerun reuses
finished runs); the Markdown table is OUT/baselines_table.md (also printed).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from analysis.output import markdown, spread
from app.sweep import run_once

WORKLOAD = ["--dataset", "digits", "--partition", "iid", "--model", "mlp:hidden=64"]
SGD = ["--lr", "0.05", "--momentum", "0.9", "--weight-decay", "5e-4"]
RING = ["--topology", "ring", "--nodes", "NODES"]  # NODES: the node count
METHODS = [  # (run name, table label, flags)
    ("local", "local (no communication)", ["--protocol", "local", *RING, *SGD]),
    ("dpsgd", "dpsgd (1 step/round), ring", ["--protocol", "dpsgd", *RING]),
    ("gossip-learning", "gossip learning, ring", ["--protocol", "gossip-learning", *RING, *SGD]),
    ("dfedavgm", "dfedavgm, ring", ["--protocol", "dfedavgm", *RING, *SGD]),
    ("fedavg", "fedavg, star + server", ["--protocol", "fedavg", "--topology", "star", "--nodes", "NODES+1", *SGD]),
]


def flags_for(flags: list[str], nodes: int) -> list[str]:
    return [str(nodes) if f == "NODES" else str(nodes + 1) if f == "NODES+1" else f for f in flags]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/baselines")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args(argv)
    out = Path(args.out)
    rows = []
    for name, label, flags in METHODS:
        summaries = [run_once(out / f"{name}-s{seed}", [*flags_for(flags, args.nodes), *WORKLOAD, "--rounds",
                                                        str(args.rounds), "--seed", str(seed)])
                     for seed in args.seeds]
        rows.append([label, spread([s["final"]["test_acc"] for s in summaries], ".4f"),
                     f"{summaries[0]['bytes_total'] / 1e6:,.1f}", f"{summaries[0]['messages_total'] / args.rounds:g}",
                     spread([s["emulated_seconds"] for s in summaries], ".1f")])
    report = (f"# Baselines: digits, IID, mlp:hidden=64, {args.nodes} nodes, {args.rounds} rounds\n\n"
              + markdown(["protocol", "test acc (mean ± std over seeds)", "MB sent", "msgs/round", "emulated s"],
                         rows)
              + f"\n\nSeeds: {', '.join(map(str, args.seeds))}.\n")
    (out / "baselines_table.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
