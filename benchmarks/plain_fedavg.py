"""FedAvg as a plain PyTorch script, the way the peers' examples write it: the bare loop of
`./dev bench startup`. It imports nothing from this project, so its process pays only for torch,
scikit-learn's digits and the training.

    python benchmarks/plain_fedavg.py [--clients 16 --rounds 10 --seed 0]

The peers' workload: digits (20% of each class held out as test), IID shards, an MLP 64-64-10,
torch.optim.SGD (lr 0.5, no momentum, no weight decay), batch 32, one local epoch per round,
inputs divided by 16 (the largest value), the sample-weighted average of the clients' models,
and the global model scored on the test split after every round.
Prints one JSON line: {"test_acc": ..., "rounds": ...}.
"""
from __future__ import annotations

import argparse
import copy
import json

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn


def split(seed: int, clients: int):
    """Train and test tensors, the train rows cut into `clients` IID shards."""
    digits = load_digits()
    x = torch.as_tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.as_tensor(digits.target)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for c in range(10):
        members = np.flatnonzero(digits.target == c)
        test[rng.permutation(members)[:round(0.2 * len(members))]] = True
    train = rng.permutation(np.flatnonzero(~test))
    shards = [(x[idx], y[idx]) for idx in np.array_split(train, clients)]
    return shards, (x[test], y[test])


def local_epoch(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float, batch: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    order = torch.randperm(len(y))
    for start in range(0, len(y), batch):
        idx = order[start:start + batch]
        optimizer.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--clients", 16), ("--rounds", 10), ("--seed", 0), ("--batch-size", 32)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    shards, (test_x, test_y) = split(args.seed, args.clients)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    total = sum(len(y) for _, y in shards)
    acc = float("nan")
    for _ in range(args.rounds):
        states = []
        for x, y in shards:
            local = copy.deepcopy(model)
            local_epoch(local, x, y, args.lr, args.batch_size)
            states.append((len(y) / total, local.state_dict()))
        model.load_state_dict({k: sum(w * s[k] for w, s in states) for k in states[0][1]})
        with torch.no_grad():
            acc = (model(test_x).argmax(1) == test_y).float().mean().item()
    print(json.dumps({"test_acc": acc, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
