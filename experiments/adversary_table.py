"""DFedAvgM under sign-flip adversaries: mean against median and trimmed-mean aggregation.

    PYTHONPATH=. python experiments/adversary_table.py [--out runs/adversaries] [--seeds 0 1 2]
                                                       [--nodes 20] [--rounds 20]

digits IID on a regular:d=6 graph, an MLP, 0%, 10% and 30% of the nodes sending
-x instead of their model (--adversaries fraction=F,kind=signflip), each node
combining what it heard by --aggregate mean, median or trimmed:0.2. The figure is
the final test accuracy over the honest nodes (the adversaries' own models are not
counted), mean ± std over seeds. Every run goes through app.cli.main into
OUT/<name>-s<seed>; the Markdown table is OUT/adversary_table.md (also printed).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from analysis.output import markdown, spread
from analysis.rundir import load_run
from app.sweep import run_once

FRACTIONS = (0.0, 0.1, 0.3)
AGGREGATES = ("mean", "median", "trimmed:0.2")
BASE = ["--protocol", "dfedavgm", "--dataset", "digits", "--partition", "iid", "--topology", "regular:d=6",
        "--model", "mlp"]


def honest_accuracy(out: Path) -> float:
    run = load_run(out)
    adversaries = set(run.summary.get("adversaries", []))
    last = max(row["round"] for row in run.metrics)
    return statistics.fmean(row["test_acc"] for row in run.metrics
                            if row["round"] == last and row["node"] not in adversaries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/adversaries"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    rows = []
    for fraction in FRACTIONS:
        row = [f"{fraction:.0%}"]
        for rule in AGGREGATES:
            accuracies = []
            for seed in args.seeds:
                out = args.out / f"f{fraction}-{rule.replace(':', '')}-s{seed}"
                run_once(out, [*BASE, "--nodes", str(args.nodes), "--rounds", str(args.rounds), "--seed", str(seed),
                               "--aggregate", rule, "--adversaries", f"fraction={fraction},kind=signflip"])
                accuracies.append(honest_accuracy(out))
            row.append(spread(accuracies, ".3f"))
        rows.append(row)
    table = markdown(["sign-flip adversaries", *(f"--aggregate {rule}" for rule in AGGREGATES)], rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adversary_table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
