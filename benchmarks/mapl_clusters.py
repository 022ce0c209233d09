"""MAPL's learned graph against the two clusters of scenario 1, over seeds and horizons.

    ./dev bench mapl_clusters [--rules norms centred raw] [--only digits|fashion-mnist] [--rounds R ...] [--seeds S ...]
                              [--jobs 2] [--out DIR]

Each cell is one run of the user's command with nothing tuned (T_thr = rounds // 4):
    emulate --topology mesh --protocol mapl --nodes M --partition mapl:scenario=1 --model hetero-small
            --rounds R --seed S --classifier-rows RULE
- digits: M = 10, seeds 0-4, rounds 20, 40 and 120 (about 15 minutes for one rule on 2 cores);
- fashion-mnist: M = 20, seeds 0-2, rounds 20 and 40, at the CPU scale of experiments/mapl_table_sc12.yaml
  (100 training samples per class, one local epoch, d_z = 128; about 40 minutes per rule).
For each rule: the worst node's weight on its own cluster at the last round (w_ii included),
the mean over nodes, the share of its own cluster's neighbours a node still links to at
the last round (worst node / mean: a node that dropped them all scores weight 1 but
share 0), and the last round's mean similarity c_ij within and across the clusters
(across: "-" once every node has dropped the other cluster). `norms` is the
default rule, `centred` the one before it, `raw` the paper's and the authors' code's.
Last, per rule, the runs that end with every node weighing exactly its own cluster (its
whole cluster, nothing else): the check of tests/test_mapl_clusters.py at every seed and
horizon, 120 rounds included (the suite runs three of these cells, cut two rounds past T_thr).

Runs go to DIR/<dataset>-r<R>-s<S>-<rule> (default: a fresh temporary directory); with
--out, a directory that already holds a finished run is reused, not rerun.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from emulator.protocol import protocols  # noqa: E402
from p2p_emulator import cli  # noqa: E402
from p2p_emulator.analysis.rundir import Run, read_run  # noqa: E402
from p2p_emulator.settings import config_hash  # noqa: E402
from p2p_emulator.sweeps import is_current  # noqa: E402
from protocols.analysis.learned_graph import cluster_similarity  # noqa: E402

SETUPS = {  # dataset -> (nodes, seeds, horizons, extra flags)
    "digits": (10, range(5), (20, 40, 120), ["--partition", "mapl:scenario=1"]),
    "fashion-mnist": (20, range(3), (20, 40), ["--partition", "mapl:scenario=1,samples=100,low=33,high=100",
                                               "--local-epochs", "1", "--d-z", "128"]),
}


def argv(dataset: str, rounds: int, seed: int, rule: str) -> list[str]:
    nodes, _, _, extra = SETUPS[dataset]
    return ["--topology", "mesh", "--protocol", "mapl", "--nodes", str(nodes), "--dataset", dataset,
            "--model", "hetero-small", "--rounds", str(rounds), "--seed", str(seed),
            "--classifier-rows", rule, *extra]


def kept(row: dict, clusters: dict[int, int]) -> float:
    """The share of node i's own-cluster neighbours it still puts weight on (graph.jsonl row)."""
    i = int(row["node"])
    own = [w for j, w in row["weights"].items() if int(j) != i and clusters[int(j)] == clusters[i]]
    return sum(w > 0 for w in own) / len(own)


def exact(row: dict, clusters: dict[int, int]) -> bool:
    """Node i puts weight on each neighbour of its own cluster and on no other (graph.jsonl row)."""
    i = int(row["node"])
    return all((w > 0) == (clusters[int(j)] == clusters[i]) for j, w in row["weights"].items())


def run_once(out: Path, flags: list[str]) -> Run:
    """`emulate FLAGS` into `out`, quiet and without plots, unless `out` holds a finished run of these settings."""
    if not is_current(out, config_hash(*cli.resolve(flags, protocols()))):
        status = cli.main([*flags, "--out", str(out), "--quiet", "--no-plots", "--overwrite"])
        if status != 0:
            raise RuntimeError(f"run {out}: emulate exited with status {status}")
    return read_run(out)


def measure(out: Path, flags: list[str]) -> dict:
    """One run (or the finished one at `out`): within-cluster mass, links kept and last-round similarities."""
    run = run_once(out, flags)
    rows = run.stream("graph") or []
    last = [r for r in rows if r["round"] == max(r["round"] for r in rows)]
    similarity = cluster_similarity(last, run.clusters)
    mass = run.summary["within_cluster_weight"].values()
    links = [kept(r, run.clusters) for r in last]
    return {"worst": min(mass), "mean": statistics.fmean(mass), "kept": (min(links), statistics.fmean(links)),
            "exact": all(exact(r, run.clusters) for r in last),
            **{side: values[0] if values else None for side, (_, values) in similarity.items()}}


def cells(args) -> list[tuple[str, int, int, str]]:
    datasets = [args.only] if args.only else list(SETUPS)
    return [(dataset, rounds, seed, rule) for dataset in datasets for rounds in args.rounds or SETUPS[dataset][2]
            for seed in (SETUPS[dataset][1] if args.seeds is None else args.seeds) for rule in args.rules]


def number(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(results: dict, args) -> tuple[list[str], list[list[str]]]:
    """Column names and rows: one row per (dataset, rounds, seed), five cells per rule."""
    columns = ["dataset", "M", "rounds (T_thr)", "seed"]
    columns += [f"{rule}: {column}" for rule in args.rules for column in ("worst", "mean", "kept", "c within", "c across")]
    rows = []
    for dataset, rounds, seed in dict.fromkeys((d, r, s) for d, r, s, _ in results):
        row = [dataset, str(SETUPS[dataset][0]), f"{rounds} ({rounds // 4})", str(seed)]
        for rule in args.rules:
            m = results[dataset, rounds, seed, rule]
            row += [number(m["worst"]), number(m["mean"]), " / ".join(f"{k:.2f}" for k in m["kept"]),
                    number(m["within cluster"]),
                    number(m["across clusters"])]
        rows.append(row)
    return columns, rows


def show(columns: list[str], rows: list[list[str]], out: Path) -> None:
    """Print the table, and write it as markdown to OUT/mapl_clusters.md for the README."""
    title = "MAPL scenario 1: weight on the own cluster at the last round (worst node / mean)"
    terminal = Table(*columns, title=title)
    for row in rows:
        terminal.add_row(*row)
    Console(width=200).print(terminal)
    lines = [f"| {' | '.join(columns)} |", "|---" * len(columns) + "|", *(f"| {' | '.join(r)} |" for r in rows)]
    (out / "mapl_clusters.md").write_text("\n".join(lines) + "\n")
    print(f"runs and mapl_clusters.md: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", nargs="+", default=["norms", "raw"], choices=["norms", "centred", "raw"])
    parser.add_argument("--only", choices=list(SETUPS))
    parser.add_argument("--rounds", type=int, nargs="+", help="these horizons (default: each dataset's)")
    parser.add_argument("--seeds", type=int, nargs="+", help="these seeds (default: each dataset's)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (processes)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="mapl-clusters-"))
    todo = cells(args)
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = {cell: pool.submit(measure, out / "{}-r{}-s{}-{}".format(*cell), argv(*cell)) for cell in todo}
        results = {cell: future.result() for cell, future in futures.items()}
    show(*table(results, args), out)
    for rule in args.rules:
        done = [cell for cell in results if cell[3] == rule]
        whole = sum(results[cell]["exact"] for cell in done)
        colour = "green" if whole == len(done) else "red"
        Console().print(f"{rule}: [{colour}]{whole} of {len(done)} runs[/] end with every node weighing its whole "
                        "cluster and nothing else")


if __name__ == "__main__":
    main()
