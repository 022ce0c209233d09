"""Does FedLinked's cross-utility A find the related tasks? After pretraining by variant, then over rounds and sizes.

    PYTHONPATH=. python experiments/fedlinked_ranking.py [--out runs/fedlinked-ranking] [--seeds 0 ... 9]

Digits, the default `fedlinked` partition (groups=2, classes=4, samples=200), `fedlinked` on a star.
First table, three clients (M0: classes 0-3, M1: 1-4, M2: 5-8), one round, --seeds: per variant
(--standardise and --procrustes on/off; heterogeneous backbones with --model hetero-small) the seeds on
which (M0, M1) has the largest A_kj + A_jk of the three pairs in round 0, i.e. from the pretrained models
(chance: 1 in 3). Second table, 9 clients for 6 rounds and 30 clients for 3 rounds, the first two seeds
of --seeds: the share of clients whose highest A_kj is a member of their own group, in round 0 and in the
last round, and the mean A_kj within and across groups in the last round. Runs go into OUT/<variant>-s<seed>
(a rerun reuses finished runs); the Markdown is OUT/fedlinked_ranking.md (also printed).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from analysis.output import markdown
from analysis.rundir import Run, load_run
from app.sweep import run_once
from experiments.fedlinked_table import related_first, utility

STAR = ["--protocol", "fedlinked", "--topology", "star"]
PAIRS = [  # (name, --standardise, --procrustes, more flags)
    ("standardise-on-procrustes-on", "on", "on", []),
    ("standardise-on-procrustes-off", "on", "off", []),
    ("standardise-off-procrustes-on", "off", "on", []),
    ("standardise-off-procrustes-off", "off", "off", []),
    ("hetero-small", "on", "on", ["--model", "hetero-small"]),
]
GROUPS = [  # (name, clients, rounds, more flags)
    ("9-clients", 9, 6, []),
    ("9-clients-dist-1", 9, 6, ["--dist-epochs", "1"]),
    ("9-clients-dist-1-eta-0.5", 9, 6, ["--dist-epochs", "1", "--eta", "0.5"]),
    ("30-clients", 30, 3, []),
]


def runs(out: Path, name: str, seeds: list[int], argv: list[str]) -> list[Run]:
    paths = [out / f"{name}-s{seed}" for seed in seeds]
    for path, seed in zip(paths, seeds):
        run_once(path, [*argv, "--seed", str(seed)])
    return [load_run(path) for path in paths]


def group_rows(run: Run, rnd: int) -> tuple[list[bool], list[float], list[float]]:
    """In round `rnd`: per client, whether its highest A_kj is a group mate; A_kj within and across groups."""
    group = {part + 1: cluster for part, cluster in run.clusters.items()}  # the star's client c holds part c - 1
    first, within, across = [], [], []
    for row in (r for r in run.stream("utility") if r["round"] == rnd):
        j, column = row["client"], {int(k): a for k, a in row["utility"].items()}
        first.append(group[max(column, key=column.get)] == group[j])
        for k, a in column.items():
            (within if group[k] == group[j] else across).append(a)
    return first, within, across


def group_row(name: str, clients: int, rounds: int, loaded: list[Run]) -> list[str]:
    start = [group_rows(run, 0)[0] for run in loaded]
    last = [group_rows(run, rounds - 1) for run in loaded]
    first = [f for run in start for f in run]
    first_last = [f for run, _, _ in last for f in run]
    within = np.mean([a for _, w, _ in last for a in w])
    across = np.mean([a for _, _, c in last for a in c])
    return [name, str(clients), str(rounds), f"{sum(first)}/{len(first)}", f"{sum(first_last)}/{len(first_last)}",
            f"{within:.4f}", f"{across:.4f}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/fedlinked-ranking")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    args = parser.parse_args(argv)
    out = Path(args.out)
    pairs = []
    for name, standardise, procrustes, flags in PAIRS:
        loaded = runs(out, name, args.seeds, [*STAR, "--nodes", "4", "--rounds", "1", "--standardise", standardise,
                                              "--procrustes", procrustes, *flags])
        pairs.append([standardise, procrustes, " ".join(flags) or "cnn-small", related_first(
            [utility(run, 0) for run in loaded])])
    groups = []
    for name, clients, rounds, flags in GROUPS:
        star_argv = [*STAR, "--nodes", str(clients + 1), "--rounds", str(rounds), *flags]
        groups.append(group_row(name, clients, rounds, runs(out, name, args.seeds[:2], star_argv)))
    report = (markdown(["--standardise", "--procrustes", "model", "seeds with the related pair first"], pairs)
              + "\n\n" + markdown(["run", "clients", "rounds", "group mate first, round 0",
                                   "group mate first, last round", "mean A within groups, last round",
                                   "mean A across groups, last round"], groups) + "\n")
    (out / "fedlinked_ranking.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
