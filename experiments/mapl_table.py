"""MAPL, paper Tables 1 and 4 at CPU scale: accuracy per scenario, bytes against DFedAvgM, messages saved by CGL.

    PYTHONPATH=. python experiments/mapl_table.py [--out runs/mapl-table] [--dataset fashion-mnist]
        [--nodes 20] [--rounds 20] [--scenarios 1 2 3 4] [--seeds 0] [--samples 100] [--local-epochs 1]
        [--methods local dfedavgm mapl-no-cgl mapl mapl-plus]

The defaults are the CPU scale (about 35 minutes for the 20 runs on 2 cores); the paper
trains 300 samples per class for 400 rounds, about 3 hours per MAPL run here.

Every run: a mesh of --nodes nodes, partition mapl:scenario=S (2 clusters; --samples
training samples per class per node in scenarios 1-2, a count drawn from
[samples/3, samples) in 3-4 as the paper's [100, 300); 15 test samples per class),
--rounds rounds, --local-epochs epochs per round for every method, d_z = 128.
Methods: Local (hetero-small backbones, its own SGD defaults), DFedAvgM (cnn-small on
every node: averaging needs one architecture), MAPL w/o CGL (uniform W, no classifier
sent), MAPL (hetero-small, protocol defaults, graph learning from rounds // 4) and
MAPL+ (cnn-small on every node, so that backbones are averaged with W as well).

Accuracy cells: mean over nodes of each node's test accuracy at the last round
(% , averaged over seeds), with the std over nodes in brackets, as the paper's
Table 1. Bytes: MAPL bytes per round over DFedAvgM's on the same mesh; messages:
MAPL's against MAPL w/o CGL's (the paper's Table 4: 152,000 -> 101,000, -34%, for
20 nodes and 400 rounds), drop notices included.

Every run goes through app.cli.main into OUT/<method>-sc<S>-s<seed> (a finished
run is reused); the report is OUT/mapl_table.md (also printed) and OUT/mapl_table.csv.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

from analysis.rundir import read_jsonl
from app.sweep import run_once

METHODS = [  # (run directory name, row label, protocol and flags)
    ("local", "Local", ["--protocol", "local", "--model", "hetero-small"]),
    ("dfedavgm", "DFedAvgM (cnn-small)", ["--protocol", "dfedavgm", "--model", "cnn-small"]),
    ("mapl-no-cgl", "MAPL w/o CGL", ["--protocol", "mapl", "--model", "hetero-small", "--mapl-no-cgl"]),
    ("mapl", "MAPL", ["--protocol", "mapl", "--model", "hetero-small"]),
    ("mapl-plus", "MAPL+ (cnn-small)", ["--protocol", "mapl+", "--model", "cnn-small"]),
]
# Paper Table 1, heterogeneous models, FashionMNIST, 20 nodes, 400 rounds: mean (± std) %.
PAPER_FASHION_MNIST = {
    "Local": {1: "91.27 (± 4.96)", 2: "86.52 (± 3.77)", 3: "89.67 (± 5.43)", 4: "83.62 (± 4.24)"},
    "MAPL": {1: "90.80 (± 5.13)", 2: "87.19 (± 3.67)", 3: "89.87 (± 5.79)", 4: "84.09 (± 4.84)"},
}


def partition(scenario: int, samples: int) -> str:
    return f"mapl:scenario={scenario},samples={samples},low={max(1, samples // 3)},high={samples}"


def collect(args) -> dict[tuple[str, int], list[dict]]:
    """Summaries by (method, scenario), one per seed."""
    results = {}
    for scenario in args.scenarios:
        common = ["--dataset", args.dataset, "--topology", "mesh", "--nodes", str(args.nodes),
                  "--rounds", str(args.rounds), "--partition", partition(scenario, args.samples),
                  "--local-epochs", str(args.local_epochs), "--d-z", "128"]
        for slug, _, flags in methods(args):
            results[slug, scenario] = [run_once(Path(args.out) / f"{slug}-sc{scenario}-s{seed}",
                                           [*flags, *common, "--seed", str(seed)]) for seed in args.seeds]
    return results


def methods(args) -> list[tuple[str, str, list[str]]]:
    return [method for method in METHODS if method[0] in args.methods]


def mean(summaries: list[dict], key) -> float:
    return statistics.fmean(key(s) for s in summaries)


def accuracy(summaries: list[dict]) -> str:
    return (f"{100 * mean(summaries, lambda s: s['final']['test_acc']):.2f} "
            f"(± {100 * mean(summaries, lambda s: s['final']['test_acc_std']):.2f})")


def accuracy_table(results, args) -> list[str]:
    columns = [f"Sc. {s}" for s in args.scenarios]
    lines = [f"| method | {' | '.join(columns)} |", "|---" * (len(columns) + 1) + "|"]
    for slug, label, _ in methods(args):
        lines.append(f"| {label} | {' | '.join(accuracy(results[slug, s]) for s in args.scenarios)} |")
    if args.dataset == "fashion-mnist":
        for label, row in PAPER_FASHION_MNIST.items():
            lines.append(f"| paper: {label} (400 rounds, paper backbones) | "
                         f"{' | '.join(row[s] for s in args.scenarios)} |")
    return lines


def seed_table(results, args) -> list[str]:
    """Each method's mean over nodes per seed: the spread the seed alone gives."""
    columns = [f"Sc. {s}" for s in args.scenarios]
    lines = [f"| method: mean over seeds (seed {', '.join(map(str, args.seeds))}) | {' | '.join(columns)} |",
             "|---" * (len(columns) + 1) + "|"]
    for slug, label, _ in methods(args):
        cells = []
        for s in args.scenarios:
            values = [100 * summary["final"]["test_acc"] for summary in results[slug, s]]
            cells.append(f"{statistics.fmean(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return lines


def traffic_table(results, args) -> list[str]:
    lines = ["| scenario | MAPL bytes/round | DFedAvgM bytes/round | MAPL / DFedAvgM | "
             "messages w/o CGL | messages MAPL | saved by CGL |", "|---|---|---|---|---|---|---|"]
    for s in args.scenarios:
        mapl = mean(results["mapl", s], lambda x: x["bytes_total"]) / args.rounds
        dfedavgm = mean(results["dfedavgm", s], lambda x: x["bytes_total"]) / args.rounds
        dense = mean(results["mapl-no-cgl", s], lambda x: x["messages_total"])
        sparse = mean(results["mapl", s], lambda x: x["messages_total"])
        lines.append(f"| {s} | {mapl:,.0f} | {dfedavgm:,.0f} | {mapl / dfedavgm:.4f} | {dense:,.0f} | "
                     f"{sparse:,.0f} | {100 * (1 - sparse / dense):.0f}% |")
    return lines


def message_bytes(out: Path, rnd: int) -> int:
    """Bytes per message sent in round `rnd` of a run, from the ledger columns of metrics.jsonl."""
    rows = [row for row in read_jsonl(out / "metrics.jsonl") if row["round"] == rnd]
    return sum(row["bytes_sent"] for row in rows) // sum(row["msgs_sent"] for row in rows)


def message_sizes(args) -> str:
    """One message on a directed edge, read from the first scenario's and seed's runs."""
    first = f"sc{args.scenarios[0]}-s{args.seeds[0]}"
    mapl, dfedavgm = (Path(args.out) / f"{slug}-{first}" for slug in ("mapl", "dfedavgm"))
    return (f"Bytes per message on a directed edge (ledger, Sc. {args.scenarios[0]}, seed {args.seeds[0]}): "
            f"MAPL {message_bytes(mapl, 1):,} in round 1 (prototypes), "
            f"{message_bytes(mapl, args.rounds - 1):,} in the last round (prototypes and classifier); "
            f"DFedAvgM {message_bytes(dfedavgm, 1):,}.")


def write_csv(path: Path, results, args) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["method", "scenario", "seeds", "test_acc", "test_acc_std_over_nodes", "bytes_total",
                         "messages_total", "within_cluster_weight", "wall_seconds"])
        for (slug, scenario), summaries in results.items():
            within = [s["within_cluster_weight_mean"] for s in summaries if "within_cluster_weight_mean" in s]
            writer.writerow([slug, scenario, " ".join(map(str, args.seeds)),
                             mean(summaries, lambda s: s["final"]["test_acc"]),
                             mean(summaries, lambda s: s["final"]["test_acc_std"]),
                             mean(summaries, lambda s: s["bytes_total"]),
                             mean(summaries, lambda s: s["messages_total"]),
                             statistics.fmean(within) if within else "",
                             mean(summaries, lambda s: s["wall_seconds"])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/mapl-table")
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--scenarios", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--samples", type=int, default=100, help="training samples per class per node (paper: 300)")
    parser.add_argument("--local-epochs", type=int, default=1, help="local epochs per round (paper: 1)")
    parser.add_argument("--methods", nargs="+", default=[slug for slug, _, _ in METHODS],
                        choices=[slug for slug, _, _ in METHODS])
    args = parser.parse_args(argv)
    results = collect(args)
    report = [f"# MAPL on {args.dataset}: {args.nodes} nodes, mesh, {args.rounds} rounds, "
              f"{args.samples} samples per class, {args.local_epochs} local epochs, seeds {args.seeds}", "",
              "## Test accuracy %, mean over nodes (± std over nodes) at the last round", "",
              *accuracy_table(results, args), ""]
    if len(args.seeds) > 1:
        report += ["## Test accuracy % per seed (mean over nodes)", "", *seed_table(results, args), ""]
    if "mapl" in args.methods:
        within = {s: (mean(results["mapl", s], lambda x: x["within_cluster_weight_mean"]),
                      min(min(x["within_cluster_weight"].values()) for x in results["mapl", s]))
                  for s in args.scenarios}
        report += ["MAPL's learned W, weight on the own cluster (mean over nodes and seeds; worst node of any seed): "
                   + ", ".join(f"Sc. {s}: {m:.2f} (worst {w:.2f})" for s, (m, w) in within.items()), ""]
    if {"mapl", "mapl-no-cgl", "dfedavgm"} <= set(args.methods):
        report += ["## Traffic (all nodes; mean over seeds)", "", *traffic_table(results, args), "",
                   message_sizes(args), ""]
    report.append(f"Command: `PYTHONPATH=. python experiments/mapl_table.py {' '.join(argv or sys.argv[1:])}`".rstrip())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mapl_table.md").write_text("\n".join(report) + "\n")
    write_csv(out / "mapl_table.csv", results, args)
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
