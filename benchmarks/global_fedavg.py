"""Global averaging like for like: the emulator against a plain PyTorch FedAvg loop.

    python benchmarks/global_fedavg.py [--sizes 16x10 64x5 --seed 0]

The workload other simulators run: digits, IID, an MLP 64-64-10, plain SGD
(lr 0.5, no momentum, no weight decay), batch 32, one local epoch per round,
inputs divided by 255, every node starting from one x0, scored on the whole
test split. Rows per size:
- dfedavgm on a mesh with uniform mixing (every node averages all models each round);
- the same with --init independent, the old behaviour, for contrast;
- fedavg on a star (a server node aggregates the sample-weighted average);
- a plain PyTorch FedAvg loop over the same shards (sample-weighted), with the same
  x0 and per-node shuffling seeds, no emulator: the reference.
Each emulator run is its own process: wall time of the process and the run's own
(`summary.json` wall_seconds), peak RSS, final accuracy, messages and bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

HERE = Path(__file__).resolve().parent
WORKLOAD = ["--dataset", "digits", "--partition", "iid", "--model", "mlp:hidden=64", "--lr", "0.5",
            "--momentum", "0", "--weight-decay", "0", "--batch-size", "32", "--local-epochs", "1",
            "--normalize", "max", "--test-set", "global"]


def emulate(flags: list[str]) -> dict:
    """Run `emulate` in a child process; its summary plus process wall time and peak RSS."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "p2p_emulator.cli", *flags, "--quiet", "--no-plots",
                                  "--out", out], cwd=HERE.parent)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        if status != 0:
            sys.exit(f"emulate {' '.join(flags)} failed with status {status}")
        summary = json.loads((Path(out) / "summary.json").read_text())
    return {"process_s": wall, "internal_s": summary["wall_seconds"], "rss_mib": usage.ru_maxrss / 1024,
            "acc": summary["final"]["test_acc"], "messages": summary["messages_total"],
            "bytes": summary["bytes_total"]}


def reference(nodes: int, rounds: int, seed: int) -> dict:
    """Plain FedAvg: a loop over the clients' shards, then the sample-weighted average."""
    from emulator.seeds import Seeds
    from p2p_emulator.workloads.datasets import load_dataset
    from p2p_emulator.workloads.partitions import make_partition

    data = load_dataset("digits")
    seeds = Seeds(seed)  # the emulator's streams: same partition, x0 and shuffling
    part = make_partition("iid", data.train_y.numpy(), data.test_y.numpy(), nodes, data.num_classes,
                          seeds.stream("partition"))
    shards = [(data.train_x[torch.as_tensor(n.train)].float() / 255, data.train_y[torch.as_tensor(n.train)])
              for n in part.nodes]
    test_x, test_y = data.test_x.float() / 255, data.test_y
    torch.set_num_threads(1)  # as each of the emulator's compute workers on 2 cores
    _train(_mlp(), *shards[0], torch.Generator())  # warm up, as the emulator's setup does before its clock
    start = time.perf_counter()
    torch.manual_seed(seeds.integer("model.init"))  # the emulator's x0 for --init common
    model = _mlp()
    generators = [torch.Generator().manual_seed(seeds.integer("node.torch", i)) for i in range(nodes)]
    for _ in range(rounds):
        states, sizes = [], []
        for (x, y), generator in zip(shards, generators):
            local = _train(_copy(model), x, y, generator)
            states.append(local.state_dict())
            sizes.append(len(y))
        total = sum(sizes)
        model.load_state_dict({k: sum(s[k] * n / total for s, n in zip(states, sizes)) for k in states[0]})
    with torch.no_grad():
        acc = (model(test_x).argmax(1) == test_y).float().mean().item()
    return {"process_s": float("nan"), "internal_s": time.perf_counter() - start, "rss_mib": float("nan"),
            "acc": acc, "messages": 0, "bytes": 0}


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _copy(model: nn.Module) -> nn.Module:
    clone = _mlp()
    clone.load_state_dict(model.state_dict())
    return clone


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> nn.Module:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    order = torch.randperm(len(y), generator=generator)
    for start in range(0, len(y), 32):
        idx = order[start:start + 32]
        optimizer.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["16x10", "64x5"], help="NODESxROUNDS")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    table = Table(title="digits, IID, MLP 64-64-10, SGD lr 0.5, batch 32, 1 epoch/round, global test split")
    for column in ("nodes x rounds", "run", "process wall s", "internal wall s", "peak RSS MiB",
                   "final acc", "vs reference", "messages", "bytes"):
        table.add_column(column, justify="right")
    for size in args.sizes:
        nodes, rounds = (int(v) for v in size.split("x"))
        rest = ["--rounds", str(rounds), "--seed", str(args.seed), *WORKLOAD]
        mesh = ["--protocol", "dfedavgm", "--topology", "mesh", "--mixing", "uniform", "--nodes", str(nodes), *rest]
        runs = {
            "plain PyTorch FedAvg (reference)": reference(nodes, rounds, args.seed),
            "dfedavgm, mesh, uniform mixing": emulate(mesh),
            "  same, --init independent": emulate([*mesh, "--init", "independent"]),
            # One more node: the server holds no data, so the clients hold the same shards.
            "fedavg, star (server + clients)": emulate(["--protocol", "fedavg", "--topology", "star",
                                                        "--nodes", str(nodes + 1), *rest]),
        }
        ref = runs["plain PyTorch FedAvg (reference)"]["acc"]
        for label, r in runs.items():
            table.add_row(size, label, f"{r['process_s']:.2f}", f"{r['internal_s']:.2f}", f"{r['rss_mib']:.0f}",
                          f"{r['acc']:.4f}", f"{r['acc'] - ref:+.4f}", str(r["messages"]), f"{r['bytes']:,}")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
