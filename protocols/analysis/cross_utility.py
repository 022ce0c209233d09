"""utility.jsonl, FedLinked's cross-utility A (A_kj: how useful client k's representations are to client j):
`utility.png` and the measures of whether A finds the related tasks (the partition's groups)."""
from __future__ import annotations

import itertools
import math
import statistics

import numpy as np

from p2p_emulator.analysis.drawing import Figures, label_nodes, new_figure, node_image
from p2p_emulator.analysis.extensions import Extension
from p2p_emulator.analysis.measures import ROUND, Measure, per, round_or_last, whole_number
from p2p_emulator.analysis.rundir import Run


def utility_matrices(rows: list[dict], n: int) -> dict[int, np.ndarray]:
    """utility.jsonl rows -> round -> A, row j holding j's column (A[j, k] = A_kj: how useful k is to j);
    NaN where j heard nothing from k."""
    matrices: dict[int, np.ndarray] = {}
    for row in rows:
        matrix = matrices.setdefault(int(row["round"]), np.full((n, n), np.nan))
        for k, a in row["utility"].items():
            matrix[int(row["client"]), int(k)] = float(a)
    return matrices


def utility_figures(run: Run) -> Figures:
    """FedLinked's cross-utility A as heatmaps: the first round, two between and the last."""
    rows = run.stream("utility")
    if not rows:
        return
    n = max([run.num_nodes, *(int(r["client"]) + 1 for r in rows), *(int(k) + 1 for r in rows for k in r["utility"])])
    matrices = utility_matrices(rows, n)
    rounds = sorted(matrices)
    shown = sorted({rounds[round(q * (len(rounds) - 1))] for q in (0, 1 / 3, 2 / 3, 1)})
    values = np.concatenate([matrices[r][np.isfinite(matrices[r])] for r in shown])
    if not values.size:
        return
    fig = new_figure(4.2 * len(shown) + 0.8, 4.2)
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    for ax, rnd in zip(axes, shown):
        image = node_image(ax, matrices[rnd], 1, cmap="viridis", vmin=values.min(), vmax=values.max())
        ax.set_title(f"round {rnd}", fontsize=9)
        label_nodes(ax, n, 1, "k (whose representations)", "j (whose target)" if ax is axes[0] else "")
    fig.colorbar(image, ax=list(axes), label="A_kj")
    fig.suptitle(f"{run.name}: cross-utility A over rounds ({run.protocol})", fontsize=10)
    yield "utility.png", fig


def _utility(run: Run, rnd: int | None) -> tuple[np.ndarray, list[int]] | None:
    """FedLinked's A over the clients in round `rnd` (None: the last), A[j, k] = A_kj, clients in id order, and each
    client's group (client p holds partition part p); None without utility.jsonl, clusters or that round."""
    rows, clusters = run.stream("utility"), run.clusters
    if not rows or not clusters:
        return None
    clients = sorted({int(row["client"]) for row in rows})
    n = 1 + max([*clients, *(int(k) for row in rows for k in row["utility"])])
    matrices = utility_matrices(rows, n)
    rnd = max(matrices) if rnd is None else rnd
    if rnd not in matrices:
        return None
    return matrices[rnd][np.ix_(clients, clients)], [clusters.get(p) for p in range(len(clients))]


def related_pair_first(run: Run, rnd: int | None) -> float:
    """1 if the pair of clients with the largest A_kj + A_jk is one group's, else 0."""
    found = _utility(run, rnd)
    if found is None:
        return math.nan
    a, group = found
    j, k = max(itertools.combinations(range(len(group)), 2), key=lambda pair: a[pair] + a[pair[::-1]])
    return float(group[j] == group[k])


def group_mate_first(run: Run, rnd: int | None) -> float:
    """The share of clients whose highest A_kj is a member of their own group."""
    found = _utility(run, rnd)
    if found is None:
        return math.nan
    a, group = found
    heard = [j for j in range(len(group)) if np.isfinite(a[j]).any()]
    return per(sum(group[int(np.nanargmax(a[j]))] == group[j] for j in heard), len(heard))


def _utility_mean(run: Run, rnd: int | None, within: bool) -> float:
    found = _utility(run, rnd)
    if found is None:
        return math.nan
    a, group = found
    values = [a[j, k] for j, k in itertools.permutations(range(len(group)), 2)
              if (group[j] == group[k]) == within and np.isfinite(a[j, k])]
    return statistics.fmean(values) if values else math.nan


def utility(run: Run, rnd: int | None, j: int, k: int) -> float:
    """A_kj in round `rnd` (None: the last), clients j and k from 0 in id order; NaN for j == k or no such client."""
    found = _utility(run, rnd)
    return float(found[0][j, k]) if found and max(j, k) < len(found[1]) and j != k else math.nan


EXTENSION = Extension(
    figures=(utility_figures,),
    measures={
        "related_pair_first": Measure(related_pair_first, f"related_pair_first:ROUND ({ROUND})", (round_or_last,),
                                      counted=True),
        "group_mate_first": Measure(group_mate_first, f"group_mate_first:ROUND ({ROUND})", (round_or_last,)),
        "utility_within": Measure(lambda run, rnd: _utility_mean(run, rnd, True), f"utility_within:ROUND ({ROUND})",
                                  (round_or_last,)),
        "utility_across": Measure(lambda run, rnd: _utility_mean(run, rnd, False), f"utility_across:ROUND ({ROUND})",
                                  (round_or_last,)),
        "utility": Measure(utility, f"utility:ROUND:J:K (A_kj of clients J and K from 0; {ROUND})",
                           (round_or_last, whole_number, whole_number)),
    },
)
