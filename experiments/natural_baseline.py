"""The most-frequent-class baseline of a sweep's runs: what always answering the most frequent training
label scores, as a mean over the nodes' own test splits (nodes without test samples left out).

    python experiments/natural_baseline.py runs/natural-fortunes
"""
import sys
from collections import Counter
from pathlib import Path
from statistics import mean

from p2p_emulator.analysis.rundir import read_run


def baseline(partition: dict) -> float:
    nodes = partition["nodes"]
    train = sum((Counter(n["train"]) for n in nodes), Counter())
    mode = max(train, key=train.get)
    return mean(n["test"].get(mode, 0) / sum(n["test"].values()) for n in nodes if n["test"])


def main(root: str) -> None:
    seen = {}
    for path in sorted(Path(root).glob("**/partition.json")):
        run = read_run(path.parent)
        seed = str(run.config["seed"])
        if run.partition.get("partition", "").startswith("natural") and seed not in seen:
            seen[seed] = baseline(run.partition)
    for seed, value in sorted(seen.items()):
        print(f"seed {seed}: {100 * value:.1f}%")
    print(f"mean: {100 * mean(seen.values()):.1f}%")


if __name__ == "__main__":
    main(sys.argv[1])
