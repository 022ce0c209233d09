"""Accuracy and bytes against churn rate, for DFedAvgM and MAPL.

    PYTHONPATH=. python experiments/churn_study.py [--out runs/churn-study] [--seeds 0 1 2]
                                                   [--nodes 20] [--rounds 20]

20 nodes on a random 4-regular graph, digits split as MAPL's scenario 1 (two clusters
of nodes with disjoint classes; "s1") and, for DFedAvgM, also IID; each protocol with
its defaults otherwise (DFedAvgM: cnn-small on every node; MAPL: hetero-small
backbones, d_z = d_p = 128, head width 512). A round takes about 0.15 s
(DFedAvgM) to 0.3 s (MAPL) of emulated time; a neighbour silent for 0.5 s (--timeout)
is left out of that round. Churn levels (exponential up/down periods per node):
none; mild, up 4 s / down 1 s (a node is offline about 20% of the time); heavy,
up 1 s / down 1 s (about 50%). "offline" is the measured share of node-time spent
offline (availability.jsonl). Accuracy at the last round, mean over nodes and seeds
(± std over seeds when there are several), on the whole test split for iid and on each
node's own split for s1 (--test-set auto).

Every run goes through app.cli.main into OUT/<setup>-<level>-s<seed> (kept:
a rerun reuses finished runs); the Markdown table is OUT/churn_study.md (also printed).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from analysis.output import spread
from app.sweep import run_once

LEVELS = [("none", "none"), ("mild", "up=4s,down=1s"), ("heavy", "up=1s,down=1s")]
SETUPS = [  # (run name, table label, flags)
    ("dfedavgm-iid", "dfedavgm, iid", ["--protocol", "dfedavgm", "--partition", "iid"]),
    ("dfedavgm-s1", "dfedavgm, s1",
     ["--protocol", "dfedavgm", "--partition", "mapl:scenario=1", "--model", "cnn-small"]),
    ("mapl-s1", "mapl, s1", ["--protocol", "mapl", "--partition", "mapl:scenario=1"]),
]
COMMON = ["--dataset", "digits", "--topology", "regular:d=4", "--timeout", "0.5"]


def offline_share(out: Path, nodes: int, end: float) -> float:
    path = out / "availability.jsonl"
    if not path.exists():
        return 0.0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    down = sum(min(end, row["t_up"] if row["t_up"] is not None else end) - row["t_down"] for row in rows)
    return down / (nodes * end)


def measure(out: Path, nodes: int) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    return {"acc": summary["final"]["test_acc"], "worst": summary["final"]["test_acc_worst10"],
            "mb": summary["bytes_total"] / 1e6, "mb_delivered": summary["bytes_delivered"] / 1e6,
            "offline_drops": summary["dropped_offline"],
            "heard": summary["final"]["heard_from"], "time": summary["emulated_seconds"],
            "offline": offline_share(out, nodes, summary["emulated_seconds"])}


def table(results: dict, seeds: list[int]) -> str:
    lines = ["| protocol, data | churn | offline | test acc | worst 10% | MB sent | MB delivered | offline drops "
             "| heard from | emulated s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (label, level, spec), runs in results.items():
        col = {key: [r[key] for r in runs] for key in runs[0]}
        lines.append(f"| {label} | {level} ({spec}) | {spread(col['offline'], '.0%')} | {spread(col['acc'], '.3f')} | "
                     f"{spread(col['worst'], '.3f')} | {spread(col['mb'], '.1f')} | {spread(col['mb_delivered'], '.1f')} | "
                     f"{spread(col['offline_drops'], '.0f')} | "
                     f"{spread(col['heard'], '.2f')} | {spread(col['time'], '.1f')} |")
    return "\n".join(lines) + f"\n\nSeeds: {', '.join(map(str, seeds))}.\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/churn-study")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    out = Path(args.out)
    results: dict = {}
    for name, label, setup in SETUPS:
        for level, spec in LEVELS:
            for seed in args.seeds:
                flags = [*setup, *COMMON, "--nodes", str(args.nodes), "--rounds", str(args.rounds),
                         "--seed", str(seed), "--churn", spec]
                path = out / f"{name}-{level}-s{seed}"
                run_once(path, flags)
                results.setdefault((label, level, spec), []).append(measure(path, args.nodes))
    report = table(results, args.seeds)
    (out / "churn_study.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
