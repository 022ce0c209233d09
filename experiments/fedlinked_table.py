"""FedLinked against separated learning and FedAvg: per-client accuracy, the cross-utility A, and bytes per round.

    PYTHONPATH=. python experiments/fedlinked_table.py [--dataset digits] [--out runs/fedlinked-digits]
                                                       [--seeds 0 1 2] [--rounds 10]

The report's Table 4.2 layout at CPU scale: `fedlinked:groups=2,classes=4`, so M0 learns classes
0-3, M1 1-4 (related) and M2 5-8 (distinct); 25% of every class is the public unlabelled set X0, and
each client keeps 10% of its samples for early stopping and 10% for rollback. --dataset digits: 60
samples per client, X0 is 359 images, all sent each round. --dataset fashion-mnist: 200 samples per
client, X0 is 15,000 images, of which each round sends --public-subsample 500. cnn-small with
d_z = 128, SGD with lr 0.05 and momentum 0.9; every client is scored on its own test split after the
last round (FedLinked: after its rollback). Rows:
- local: the `local` protocol, --local-epochs 5 per round, no early stopping or rollback;
- separated: fedlinked --eta 0, the report's separated learning (the same pretraining, early
  stopping and rollback as FedLinked, no messages);
- fedavg: a server and the three clients, --local-epochs 5, the whole model averaged;
- fedlinked: on a star (server = node 0), with the Procrustes maps B, without them (--procrustes off),
  and on the report's raw representations (--standardise off); with --public-subsample 100 and 25;
- fedlinked-p2p: on the triangle of the three clients.
Local and the peer-to-peer rows run on three nodes, the star rows on four. "related first" counts the
seeds on which the related pair (M0, M1) has the largest A_kj + A_jk of the three pairs, in round 0
(after pretraining) and in the last round. MB/round is all nodes' bytes over the rounds. The mean A
(over seeds) of the fedlinked row follows, in round 0 and in the last round. Every run goes through
app.cli.main into OUT/<name>-s<seed> (a rerun reuses finished runs); the Markdown is OUT/fedlinked_table.md.
The subsample rows send 100 and 25 public samples a round on either dataset.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from analysis.output import markdown, spread
from analysis.plots import utility_matrices
from analysis.rundir import Run, load_run
from app.sweep import run_once

WORKLOAD = ["--public-fraction", "0.25", "--val-fraction", "0.1", "--rollback-fraction", "0.1",
            "--model", "cnn-small", "--d-z", "128", "--lr", "0.05", "--momentum", "0.9", "--test-set", "local"]
DATASETS = {  # --dataset: (samples per client, the public samples sent per round: 0 for all)
    "digits": (60, 0),
    "fashion-mnist": (200, 500),
}
STAR = ["--topology", "star", "--nodes", "4"]
PEERS = ["--topology", "mesh", "--nodes", "3"]
METHODS = [  # (run name, table label, flags)
    ("local", "local", ["--protocol", "local", *PEERS, "--local-epochs", "5"]),
    ("separated", "separated (fedlinked --eta 0)", ["--protocol", "fedlinked", *STAR, "--eta", "0"]),
    ("fedavg", "fedavg, star", ["--protocol", "fedavg", *STAR, "--local-epochs", "5"]),
    ("fedlinked", "fedlinked, star", ["--protocol", "fedlinked", *STAR]),
    ("no-b", "fedlinked without B, star", ["--protocol", "fedlinked", *STAR, "--procrustes", "off"]),
    ("raw", "fedlinked on raw representations, star", ["--protocol", "fedlinked", *STAR, "--standardise", "off"]),
    ("sub100", "fedlinked, --public-subsample 100", ["--protocol", "fedlinked", *STAR, "--public-subsample", "100"]),
    ("sub25", "fedlinked, --public-subsample 25", ["--protocol", "fedlinked", *STAR, "--public-subsample", "25"]),
    ("p2p", "fedlinked-p2p, triangle", ["--protocol", "fedlinked-p2p", *PEERS]),
]


def client_accuracy(run: Run) -> list[float]:
    """Last-round test accuracy of M0, M1, M2: the nodes that score, in id order."""
    metrics = run.metrics
    last = max(r["round"] for r in metrics)
    return [r["test_acc"] for r in sorted(metrics, key=lambda r: r["node"]) if r["round"] == last and "test_acc" in r]


def utility(run: Run, rnd: int | None) -> np.ndarray | None:
    """A[j, k] = A_kj over the three clients (M0, M1, M2) in round `rnd` (None: the last); None without A."""
    rows = run.stream("utility")
    if not rows:
        return None
    matrices = utility_matrices(rows, 4)  # node ids up to 3
    matrix = matrices[max(matrices) if rnd is None else rnd]
    return matrix[1:, 1:] if run.protocol == "fedlinked" else matrix[:3, :3]  # the star's clients: nodes 1-3


def mb_per_round(run: Run) -> float:
    return run.summary["bytes_total"] / run.summary["rounds"] / 1e6


def related_first(matrices: list[np.ndarray | None]) -> str:
    """Seeds on which the pair (M0, M1) has the largest A_kj + A_jk."""
    if any(m is None for m in matrices):
        return "–"
    wins = sum(max([(0, 1), (0, 2), (1, 2)], key=lambda p: m[p] + m[p[::-1]]) == (0, 1) for m in matrices)
    return f"{wins}/{len(matrices)}"


def row(label: str, runs: list[Run], fedavg_mb: float) -> list[str]:
    accuracy = np.array([client_accuracy(run) for run in runs])  # seeds x clients
    mb = statistics.fmean(mb_per_round(run) for run in runs)
    return [label, *(spread(list(accuracy[:, m]), ".3f") for m in range(3)), spread(list(accuracy.mean(1)), ".3f"),
            related_first([utility(run, 0) for run in runs]), related_first([utility(run, None) for run in runs]),
            f"{mb:.3f}", f"{mb / fedavg_mb:.2f}"]


def mean_utility(runs: list[Run], rnd: int | None) -> str:
    mean = np.mean([np.nan_to_num(utility(run, rnd)) for run in runs], axis=0)  # the diagonal is empty
    names = ["M0", "M1", "M2"]
    return markdown(["j \\ k", *names], [[names[j], *("–" if j == k else f"{mean[j, k]:.3f}" for k in range(3))]
                                         for j in range(3)])


def workload(dataset: str, name: str) -> list[str]:
    samples, sent = DATASETS[dataset]
    subsample = [] if name.startswith("sub") or not sent else ["--public-subsample", str(sent)]
    return ["--dataset", dataset, "--partition", f"fedlinked:groups=2,classes=4,samples={samples}", *WORKLOAD,
            *(subsample if name not in ("local", "fedavg") else [])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="digits")
    parser.add_argument("--out", default=None, help="default: runs/fedlinked-DATASET")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    out = Path(args.out or f"runs/fedlinked-{args.dataset}")
    runs = {}
    for name, label, flags in METHODS:
        paths = [out / f"{name}-s{seed}" for seed in args.seeds]
        for path, seed in zip(paths, args.seeds):
            run_once(path, [*flags, *workload(args.dataset, name), "--rounds", str(args.rounds), "--seed", str(seed)])
        runs[name] = (label, [load_run(path) for path in paths])  # each read once
    fedavg_mb = statistics.fmean(mb_per_round(run) for run in runs["fedavg"][1])
    rows = [row(label, loaded, fedavg_mb) for label, loaded in runs.values()]
    samples, sent = DATASETS[args.dataset]
    report = (f"# FedLinked: {args.dataset}, fedlinked:groups=2,classes=4,samples={samples}, "
              f"{sent or 'all'} public samples a round, {args.rounds} rounds\n\n"
              + markdown(["method", "M0 (0-3)", "M1 (1-4)", "M2 (5-8)", "mean", "related first, round 0",
                          "related first, last round", "MB/round", "× fedavg bytes"], rows)
              + "\n\nMean A over seeds (fedlinked, star); row j, column k: A_kj, how useful k is to j.\n\n"
              + "Round 0 (after pretraining):\n\n" + mean_utility(runs["fedlinked"][1], 0)
              + f"\n\nLast round ({args.rounds - 1}):\n\n" + mean_utility(runs["fedlinked"][1], None)
              + f"\n\nSeeds: {', '.join(map(str, args.seeds))}.\n")
    (out / "fedlinked_table.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
