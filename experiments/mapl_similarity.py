"""Why MAPL's graph missed the clusters with raw classifier rows: similarity rules and step rules, measured.

    PYTHONPATH=. python experiments/mapl_similarity.py [--rounds 40] [--seed 0]   # about 40 s

One run of `emulate --protocol mapl --nodes 10 --dataset digits --partition mapl:scenario=1
--model hetero-small --classifier-rows raw` (the paper's and the code's rule), recording
the classifiers every node compared at every graph step (by wrapping
CollaborationRow.learn; the run itself is unchanged). Its W stays near uniform, so every
node hears every other one to the end, and the recorded classifiers can be compared
offline under other rules:
1. c_ij within and across the clusters over the rounds, for the similarity over all K rows
   (raw), over the node's own classes only (held), both with the rows centred, and the norms
   rule (the classes' distances from the mean row, the default); "gap"
   is the smallest within-cluster c_ij minus the largest across-cluster one, over all
   nodes (positive: every node ranks its own cluster first).
2. The graph step replayed on those classifiers from the uniform row, with the authors'
   fresh Adam per call, one persistent Adam, and plain projected gradient steps: the
   worst node's and the mean weight on the own cluster at the end (no link is dropped in
   the replay, and W does not feed back into training).

It stays a script, not a grid file for `emulate sweep`: it wraps CollaborationRow.learn to record
what each graph step compared, which no run directory holds.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

import protocols.mapl as mapl
from p2p_emulator.analysis.rundir import read_run
from p2p_emulator.cli import main as emulate

ROWS = {  # name -> (classifier rows compared, only the node's own classes)
    "raw": ("raw", False), "held": ("raw", True), "centred": ("centred", False), "held, centred": ("centred", True),
    "norms": ("norms", False)}
STEPS = [("fresh Adam (code)", "fresh", 0.1), ("persistent Adam", "persistent", 0.1),
         ("persistent Adam", "persistent", 0.01), ("projected gradient", "sgd", 0.1),
         ("projected gradient", "sgd", 1.0)]


def record(rounds: int, seed: int, out: Path) -> dict[int, list]:
    """node -> [(own classifier, {neighbour: classifier}), one per graph step]."""
    calls: dict[int, list] = {}
    learn = mapl.CollaborationRow.learn

    def recording(row, own, options):
        calls.setdefault(row.me, []).append((own.clone(), dict(row.classifiers)))
        return learn(row, own, options)

    mapl.CollaborationRow.learn = recording
    try:
        assert emulate(["--protocol", "mapl", "--topology", "mesh", "--nodes", "10", "--dataset", "digits",
                        "--partition", "mapl:scenario=1", "--model", "hetero-small", "--rounds", str(rounds),
                        "--seed", str(seed), "--classifier-rows", "raw", "--quiet", "--no-plots",
                        "--out", str(out)]) == 0
    finally:
        mapl.CollaborationRow.learn = learn
    return calls


def similarity(own, other, rows: str, classes: list[int] | None) -> float:
    if classes is not None:
        if rows == "centred":
            own, other = own - own.mean(0), other - other.mean(0)
        return mapl.classifier_similarity(own[classes], other[classes], "raw")
    return mapl.classifier_similarity(own, other, rows)


def similarity_table(calls, clusters, held, first: int) -> None:
    """c_ij within and across the clusters at some of the graph steps (by round, the first at `first`)."""
    steps = len(next(iter(calls.values())))
    print("| round | " + " | ".join(f"{name}: within / across / gap" for name in ROWS) + " |")
    print("|---" * (len(ROWS) + 1) + "|")
    for t in sorted({*range(0, steps, max(1, steps // 6)), steps - 1}):
        cells = []
        for rows, own_classes in ROWS.values():
            within, across, gaps = [], [], []
            for i, history in calls.items():
                own, heard = history[t]
                c = {j: similarity(own, phi, rows, held[i] if own_classes else None) for j, phi in heard.items()}
                mine = [v for j, v in c.items() if clusters[j] == clusters[i]]
                theirs = [v for j, v in c.items() if clusters[j] != clusters[i]]
                within, across, gaps = within + mine, across + theirs, gaps + [min(mine) - max(theirs)]
            cells.append(f"{statistics.fmean(within):+.2f} / {statistics.fmean(across):+.2f} / {min(gaps):+.2f}")
        print(f"| {first + t} | " + " | ".join(cells) + " |")


def replay(calls, clusters, rows: str, step: str, lr: float) -> tuple[float, float]:
    """Graph steps from the uniform row on the recorded classifiers; (worst, mean) own-cluster weight."""
    options = mapl.MapLOptions(classifier_rows=rows, graph_lr=lr, graph_step="sgd" if step == "sgd" else "adam")
    masses = []
    for i, history in calls.items():
        nodes = [i, *sorted(history[0][1])]
        gamma = torch.full((len(nodes),), 1 / len(nodes))
        w = torch.full((len(nodes),), 1 / len(nodes), requires_grad=True)
        adam = torch.optim.Adam([w], lr=lr, betas=(options.adam_beta1, mapl.pml.ADAM_BETA2))
        for own, heard in history:
            c = torch.tensor([mapl.classifier_similarity(own, heard[j], rows) for j in nodes[1:]])
            s = mapl.dissimilarity(c, options.similarity)
            if step == "persistent":  # l_g without the log barrier, which has no gradient in the code
                loss = options.mu1 * (gamma * s * w).sum() + options.mu2 * options.beta * w.norm()
                w.grad, = torch.autograd.grad(loss, w)
                adam.step()
                with torch.no_grad():
                    w.copy_(mapl.project_simplex(w))
            else:
                w = mapl.learn_row(w.detach(), s, gamma, options)
        masses.append(sum(float(w.detach()[k]) for k, j in enumerate(nodes) if clusters[j] == clusters[i]))
    return min(masses), statistics.fmean(masses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="mapl-similarity-"))
    calls = record(args.rounds, args.seed, out)
    run = read_run(out)
    held = {n["node"]: sorted(int(k) for k in n["train"]) for n in run.partition["nodes"]}
    print(f"digits, scenario 1, M = 10, {args.rounds} rounds, seed {args.seed}, graph steps from round "
          f"{args.rounds // 4}; within-cluster weight of the run itself: "
          f"{run.summary['within_cluster_weight_mean']:.3f}\n")
    similarity_table(calls, run.clusters, held, args.rounds // 4)
    print("\n| step rule, lr | raw rows: worst / mean | centred rows: worst / mean | norms: worst / mean |\n"
          "|---|---|---|---|")
    for name, step, lr in STEPS:
        cells = [" / ".join(f"{v:.3f}" for v in replay(calls, run.clusters, rows, step, lr))
                 for rows in ("raw", "centred", "norms")]
        print(f"| {name}, {lr} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
