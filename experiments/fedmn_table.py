"""FedMN against Local and FedAvg: personalised accuracy, bytes per round, and how clients of one component route.

    PYTHONPATH=. python experiments/fedmn_table.py [--out runs/fedmn] [--seeds 0 1 2] [--clients 10] [--rounds 40]

Digits, `mixture:components=3` (each client a Dirichlet(0.4) mixture of three class-conditional
components), cnn-small with d_z = 128, one local epoch per round of SGD with lr 0.05 and momentum 0.9,
every client scored on its own test split at the last round. FedMN's network is [2 x 2 x 2] with
cnn-small encoders; its first --pretrain rounds (5) are FedAvg on the whole network, as the paper
pretrains. FedAvg and FedMN run on a star of --clients clients plus a server (node 0); Local and
FedMN-P2P on --clients nodes (FedMN-P2P on a 4-regular graph). "fedavg, whole network" is fedmn
with every round a pretraining round: FedAvg sending the whole modular network.

MB/round is all nodes' bytes per round, over FedMN's routed rounds for the FedMN rows; "first 5" is over
the first five routed rounds (rounds 5-9 for every row), while the router is still undecided. Agreement is
the share of clients whose last route (Pi > 1/2) and last drawn decision V are their component's most
common one. Every run goes through app.cli.main into OUT/<name>-s<seed> (a rerun reuses finished
runs); the Markdown table is OUT/fedmn_table.md (also printed).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from analysis.output import markdown, spread
from analysis.rundir import load_run
from app.sweep import run_once

PRETRAIN = 5
WORKLOAD = ["--dataset", "digits", "--partition", "mixture:components=3", "--model", "cnn-small", "--d-z", "128",
            "--lr", "0.05", "--momentum", "0.9", "--test-set", "local"]
STAR = ["--topology", "star", "--nodes", "CLIENTS+1"]
PEERS = ["--nodes", "CLIENTS"]
METHODS = [  # (run name, table label, flags)
    ("local", "local", ["--protocol", "local", "--topology", "ring", *PEERS]),
    ("fedavg", "fedavg (cnn-small), star", ["--protocol", "fedavg", *STAR]),
    ("fedavg-whole", "fedavg, whole network, star", ["--protocol", "fedmn", *STAR, "--pretrain-rounds", "ROUNDS"]),
    ("fedmn", "fedmn, star", ["--protocol", "fedmn", *STAR, "--pretrain-rounds", str(PRETRAIN)]),
    ("fedmn-p2p", "fedmn-p2p, 4-regular", ["--protocol", "fedmn-p2p", "--topology", "regular:d=4", *PEERS,
                                           "--pretrain-rounds", str(PRETRAIN)]),
]


def flags_for(flags: list[str], clients: int, rounds: int) -> list[str]:
    values = {"CLIENTS": str(clients), "CLIENTS+1": str(clients + 1), "ROUNDS": str(rounds)}
    return [values.get(f, f) for f in flags]


def per_round(summary: dict) -> float:
    """MB per round: over the routed rounds when the run has them."""
    phase = summary.get("bytes_by_phase", {}).get("fedmn")
    if phase:
        return phase["bytes_sent"] / phase["rounds"] / 1e6
    return summary["bytes_total"] / summary["rounds"] / 1e6


def early(run: Path) -> float:
    """MB per round over rounds PRETRAIN .. PRETRAIN + 4."""
    rounds = range(PRETRAIN, PRETRAIN + 5)
    return sum(r["bytes_sent"] for r in load_run(run).metrics if r["round"] in rounds) / len(rounds) / 1e6


def row(label: str, runs: list[Path], fedavg_mb: float) -> list[str]:
    summaries = [load_run(run).summary for run in runs]
    mb = statistics.fmean(per_round(s) for s in summaries)
    agreement = [spread([s[key] for s in summaries], ".2f") if key in summaries[0] else "–"
                 for key in ("route_agreement", "decision_agreement")]
    return [label, spread([s["final"]["test_acc"] for s in summaries], ".3f"),
            f"{statistics.fmean(s['final']['test_acc_std'] for s in summaries):.3f}",
            f"{mb:.2f}", f"{mb / fedavg_mb:.2f}", f"{statistics.fmean(early(run) for run in runs):.2f}", *agreement]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/fedmn")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)
    out = Path(args.out)
    runs = {}
    for name, label, flags in METHODS:
        runs[name] = (label, [out / f"{name}-s{seed}" for seed in args.seeds])
        for run, seed in zip(runs[name][1], args.seeds):
            run_once(run, [*flags_for(flags, args.clients, args.rounds), *WORKLOAD, "--rounds", str(args.rounds),
                           "--seed", str(seed)])
    fedavg_mb = statistics.fmean(per_round(load_run(run).summary) for run in runs["fedavg"][1])
    rows = [row(label, paths, fedavg_mb) for label, paths in runs.values()]
    report = (f"# FedMN: digits, mixture:components=3, {args.clients} clients, {args.rounds} rounds\n\n"
              + markdown(["method", "test acc (client mean, ± over seeds)", "std over clients", "MB/round",
                          "× fedavg bytes", "MB/round, first 5", "route agreement", "decision agreement"], rows)
              + f"\n\nSeeds: {', '.join(map(str, args.seeds))}.\n")
    (out / "fedmn_table.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
