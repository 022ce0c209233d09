"""What FedMN's router learns, from each run's decisions.jsonl (Pi per client per round): for the first
routed round and the last, the mean Pi, the spread of Pi between the components' mean Pi and within a
component, and at the end the share of Pi that rose and of clients whose route is every connection on.

    python experiments/fedmn_routing.py runs/fedmn-routing
"""
import sys
from itertools import combinations
from pathlib import Path
from statistics import mean

import numpy as np

from p2p_emulator.analysis import output
from p2p_emulator.analysis.rundir import read_run


def spread(rows: list[dict]) -> tuple[float, float]:
    """Mean |difference| of the components' mean Pi (between), and of a client's Pi to its component's (within)."""
    by_component = {}
    for row in rows:
        by_component.setdefault(row["component"], []).append(row["pi"])
    centres = {c: np.mean(pis, axis=0) for c, pis in by_component.items()}
    between = mean(float(np.abs(centres[a] - centres[b]).mean()) for a, b in combinations(sorted(centres), 2))
    within = mean(float(np.abs(np.array(pi) - centres[c]).mean()) for c, pis in by_component.items() for pi in pis)
    return between, within


def routing(path: Path) -> dict:
    run = read_run(path)
    config, rows = run.config, run.stream("decisions")
    first, last = config["pretrain_rounds"], max(row["round"] for row in rows)
    start = {row["node"]: row for row in rows if row["round"] == first}
    end = {row["node"]: row for row in rows if row["round"] == last}
    (between0, within0), (between1, within1) = spread(list(start.values())), spread(list(end.values()))
    return {
        "lr": config["lr"], "seed": str(config["seed"]),
        "pi, first routed round": mean(np.mean(row["pi"]) for row in start.values()),
        "pi, last round": mean(np.mean(row["pi"]) for row in end.values()),
        "pi that rose": mean(np.mean(np.array(end[n]["pi"]) > np.array(start[n]["pi"])) for n in end),
        "between / within, first": between0 / within0,
        "between / within, last": between1 / within1,
        "between, first": between0, "between, last": between1,
        "routes all on": mean(set(row["route"]) == {"1"} for row in end.values()),
    }


def main(root: str) -> None:
    runs = [routing(path.parent) for path in sorted(Path(root).glob("**/decisions.jsonl"))]
    columns = [key for key in runs[0] if key not in ("lr", "seed")]
    print("| lr | seeds | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 2) + "|")
    for lr in sorted({run["lr"] for run in runs}, reverse=True):
        group = [run for run in runs if run["lr"] == lr]
        cells = [output.spread([r[c] for r in group], ".3f") for c in columns]
        print(f"| {lr} | {','.join(sorted(r['seed'] for r in group))} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
