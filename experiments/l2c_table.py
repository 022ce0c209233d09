"""L2C and meta-L2C on digits: task identification (paper Fig. 4) and accuracy against local and D-PSGD.

    PYTHONPATH=. python experiments/l2c_table.py [--out runs/l2c-table] [--seeds 0 1 2]
                                                 [--nodes 20] [--rounds 20] [--dataset digits]

1. Identification: 15 nodes on a mesh, five 2-class tasks of 3 nodes
   (mapl:scenario=1,clusters=5), 10 rounds with the protocol defaults. Reports the
   share of nodes whose two largest non-self weights are their same-task peers
   after round 10 (summary.json task_identification) and the first round where
   that share reaches 80% (from graph.jsonl).
2. Accuracy: --nodes nodes on a mesh, shards:n=2, --rounds rounds: l2c and
   meta-l2c with their defaults (prune half the neighbours after round 10),
   local and D-PSGD with the same local SGD (5 epochs, lr 0.01, batch 10, no
   momentum, GroupNorm) on all their data (no validation split), and D-PSGD
   with its own defaults (one SGD step per round).

Every run goes through app.cli.main into OUT/<name>-s<seed>; the Markdown
report is OUT/l2c_table.md (also printed).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from analysis.output import spread
from app.sweep import run_once
from protocols.l2c import same_task_on_top

IDENTIFICATION = ["--topology", "mesh", "--nodes", "15", "--rounds", "10",
                  "--partition", "mapl:scenario=1,clusters=5", "--prune", "0"]
SAME_SGD = ["--local-epochs", "5", "--lr", "0.01", "--batch-size", "10", "--momentum", "0",
            "--weight-decay", "5e-4", "--norm", "group", "--val-fraction", "0"]
METHODS = [  # (run directory name, row label, protocol, extra flags, what the row says)
    ("l2c", "l2c", "l2c", [], "defaults: 5 epochs, lr 0.01, batch 10, 20% val, prune 0.5 after round 10"),
    ("meta-l2c", "meta-l2c", "meta-l2c", [], "defaults as l2c; encoder 10,5, gossip-averaged"),
    ("local", "local", "local", SAME_SGD, "same local SGD as l2c, all data for training"),
    ("dpsgd-5ep", "dpsgd (5 epochs)", "dpsgd", [*SAME_SGD, "--local-steps", "0"],
     "same local SGD as l2c, then MH averaging"),
    ("dpsgd", "dpsgd (1 step)", "dpsgd", ["--norm", "group"], "its defaults: 1 SGD step per round, lr 0.05, batch 32"),
]


def first_identified_round(out: Path, share: float = 0.8) -> int | None:
    """The first round whose mixing weights put every same-task peer on top for `share` of the nodes."""
    clusters = {n["node"]: n["cluster"] for n in json.loads((out / "partition.json").read_text())["nodes"]}
    by_round: dict[int, list[bool]] = {}
    for line in (out / "graph.jsonl").read_text().splitlines():
        row = json.loads(line)
        weights = {int(j): w for j, w in row["weights"].items()}
        peers = {j for j in weights if j != row["node"] and clusters[j] == clusters[row["node"]]}
        by_round.setdefault(row["round"], []).append(same_task_on_top(row["node"], weights, peers))
    return next((rnd for rnd, hits in sorted(by_round.items()) if statistics.fmean(hits) >= share), None)


def identification_table(out: Path, seeds: list[int], dataset: str) -> list[str]:
    lines = ["| method | identified after 10 rounds (share of nodes) | first round with >= 80% | seeds |",
             "|---|---|---|---|"]
    for protocol in ("l2c", "meta-l2c"):
        shares, firsts = [], []
        for seed in seeds:
            rundir = out / f"identify-{protocol}-s{seed}"
            summary = run_once(rundir, ["--protocol", protocol, *IDENTIFICATION, "--dataset", dataset, "--seed", str(seed)])
            shares.append(summary["task_identification"])
            firsts.append(first_identified_round(rundir))
        lines.append(f"| {protocol} | {' / '.join(f'{s:.2f}' for s in shares)} | "
                     f"{' / '.join('never' if f is None else str(f) for f in firsts)} | {seeds} |")
    return lines


def accuracy_table(out: Path, seeds: list[int], nodes: int, rounds: int, dataset: str) -> list[str]:
    common = ["--topology", "mesh", "--nodes", str(nodes), "--rounds", str(rounds), "--dataset", dataset,
              "--partition", "shards:n=2"]
    lines = ["| method | test acc % (mean ± std over seeds) | worst 10% nodes % | MB sent per node | "
             "wall s per run | settings |", "|---|---|---|---|---|---|"]
    for slug, label, protocol, flags, note in METHODS:
        acc, worst, sent, wall = [], [], [], []
        for seed in seeds:
            summary = run_once(out / f"{slug}-s{seed}", ["--protocol", protocol, *common, *flags, "--seed", str(seed)])
            acc.append(summary["final"]["test_acc"])
            worst.append(summary["final"]["test_acc_worst10"])
            sent.append(summary["bytes_total"] / nodes / 1e6)
            wall.append(summary["wall_seconds"])
        accuracy, worst10 = spread([100 * a for a in acc], ".2f"), spread([100 * w for w in worst], ".2f")
        lines.append(f"| {label} | {accuracy} | {worst10} | {statistics.fmean(sent):.0f} | "
                     f"{statistics.fmean(wall):.0f} | {note} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/l2c-table")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--dataset", default="digits")
    args = parser.parse_args(argv)
    out = Path(args.out)
    report = [f"# L2C on {args.dataset}", "",
              "## Task identification (15 nodes, mesh, five 2-class tasks x 3 nodes, 10 rounds)", "",
              *identification_table(out, args.seeds, args.dataset), "",
              f"## Accuracy ({args.nodes} nodes, mesh, shards:n=2, {args.rounds} rounds)", "",
              *accuracy_table(out, args.seeds, args.nodes, args.rounds, args.dataset), "",
              f"Command: `PYTHONPATH=. python experiments/l2c_table.py {' '.join(argv or sys.argv[1:])}`".rstrip()]
    out.mkdir(parents=True, exist_ok=True)
    (out / "l2c_table.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
