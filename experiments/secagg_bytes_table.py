"""The table of docs/secure-aggregation.md from a finished sweep of experiments/secagg_bytes.yaml: bytes per
round by phase and emulated seconds per round, then the fits of the key-exchange bytes (the keys and
shares phases) to a n^2 (SecAgg) and a n log2 n (SecAgg+), n the clients.

    .venv/bin/python experiments/secagg_bytes_table.py runs/secagg-bytes
"""
from __future__ import annotations

import collections
import json
import math
import sys
from pathlib import Path

import numpy as np

PHASES = ("model", "update", "secagg.keys", "secagg.shares", "secagg.masked", "secagg.unmask")
METHODS = ("fedavg", "secagg", "secagg+")


def phase_bytes(run: Path) -> dict[str, float]:
    """Bytes sent per round, by message kind."""
    config = json.loads((run / "summary.json").read_text())
    sent = collections.Counter()
    for line in (run / "messages.jsonl").open():
        message = json.loads(line)
        sent[message["kind"]] += message["bytes"]
    return {kind: sent[kind] / config["rounds"] for kind in PHASES}


def seconds_per_round(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return max(r["t"] for r in rows) / (max(r["round"] for r in rows) + 1)


def runs(folder: Path):
    for method in METHODS:
        for dropout in ("0.0", "0.1"):
            for nodes in (11, 51, 101):
                run = folder / f"method={method}__nodes={nodes}__secagg_dropout={dropout}"
                if (run / "summary.json").exists():
                    yield method, float(dropout), nodes - 1, run


def fit(ns: list[int], values: list[float], shape) -> tuple[float, float]:
    """(a, largest relative residual) of the least-squares fit values ~ a shape(n)."""
    x = np.array([shape(n) for n in ns], dtype=float)
    y = np.array(values, dtype=float)
    a = float(x @ y / (x @ x))
    return a, float(np.max(np.abs(a * x - y) / y))


def main(folder: Path) -> None:
    print("| method | dropout | clients | " + " | ".join(PHASES) + " | total | emulated s/round |")
    print("|---|---|---|" + "---|" * (len(PHASES) + 2))
    exchange = collections.defaultdict(dict)
    for method, dropout, n, run in runs(folder):
        by_phase = phase_bytes(run)
        cells = " | ".join(f"{by_phase[k]:,.0f}" for k in PHASES)
        print(f"| {method} | {dropout:.0%} | {n} | {cells} | {sum(by_phase.values()):,.0f} | "
              f"{seconds_per_round(run):.3f} |")
        if dropout == 0:
            exchange[method][n] = by_phase["secagg.keys"] + by_phase["secagg.shares"]
    for method, shape, name in (("secagg", lambda n: n * n, "a n^2"),
                                ("secagg+", lambda n: n * math.log2(n), "a n log2 n"),
                                ("secagg+", lambda n: n * 2 * math.ceil(math.log2(n)), "a n k, k = 2 ceil(log2 n)")):
        ns = sorted(exchange[method])
        if ns:
            a, residual = fit(ns, [exchange[method][n] for n in ns], shape)
            print(f"\n{method}: key-exchange bytes per round ~ {name}, a = {a:,.1f} bytes, "
                  f"largest relative residual {residual:.1%}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/secagg-bytes"))
