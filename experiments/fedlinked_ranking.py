"""Does FedLinked's cross-utility A rank the related pair first after pretraining? Per variant, over seeds.

    PYTHONPATH=. python experiments/fedlinked_ranking.py [--out runs/fedlinked-ranking] [--seeds 0 ... 9]

`emulate --protocol fedlinked --topology star --nodes 4 --rounds 1` on digits with the default
`fedlinked` partition (M0: classes 0-3, M1: 1-4, M2: 5-8), for each of --standardise on/off and
--procrustes on/off: the number of seeds on which (M0, M1) has the largest A_kj + A_jk of the three
pairs in round 0, i.e. from the pretrained models (chance: 1 in 3). Runs go into OUT/<variant>-s<seed>
(a rerun reuses finished runs); the Markdown is OUT/fedlinked_ranking.md (also printed).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from analysis.output import markdown
from app.sweep import run_once

from experiments.fedlinked_table import related_first, utility

VARIANTS = [(standardise, procrustes) for standardise in ("on", "off") for procrustes in ("on", "off")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/fedlinked-ranking")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    args = parser.parse_args(argv)
    out, rows = Path(args.out), []
    for standardise, procrustes in VARIANTS:
        runs = [out / f"standardise-{standardise}-procrustes-{procrustes}-s{seed}" for seed in args.seeds]
        for run, seed in zip(runs, args.seeds):
            run_once(run, ["--protocol", "fedlinked", "--topology", "star", "--nodes", "4", "--rounds", "1",
                           "--standardise", standardise, "--procrustes", procrustes, "--seed", str(seed)])
        rows.append([standardise, procrustes, related_first([utility(run, 0) for run in runs])])
    report = markdown(["--standardise", "--procrustes", "seeds with the related pair first"], rows) + "\n"
    (out / "fedlinked_ranking.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
