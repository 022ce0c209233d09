"""DFedAvgM as a bare sequential PyTorch loop, without the emulator: the baseline of benchmarks/overhead.py.

Same data, partition, models, local SGD and Metropolis-Hastings averaging as
`emulate --protocol dfedavgm`, node after node, with no messages or clock.
Prints one JSON line: {"wall_seconds": ..., "test_acc": ...}.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import topologies
from emulator.seeds import Seeds
from p2p_emulator.workloads.datasets import load_dataset, normalise
from p2p_emulator.workloads.models import build_model
from p2p_emulator.workloads.partitions import make_partition
from p2p_emulator.workloads.training import accuracy, float_state, mix, sgd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--nodes", 8), ("--rounds", 3), ("--seed", 0), ("--batch-size", 32)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--partition", default="mapl:scenario=1")
    parser.add_argument("--topology", default="ring")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    data = load_dataset(args.dataset)
    seeds = Seeds(args.seed)  # the emulator's streams
    part = make_partition(args.partition, data.train_y.numpy(), data.test_y.numpy(), args.nodes,
                          data.num_classes, seeds.stream("partition"))
    graph = topologies.build(args.topology, args.nodes, seeds.integer("topology"))
    weights = topologies.mixing_weights(graph, "mh")
    take = lambda x, y, idx: (normalise(x[torch.as_tensor(idx)], data), y[torch.as_tensor(idx)])
    train = [take(data.train_x, data.train_y, n.train) for n in part.nodes]
    test = [take(data.test_x, data.test_y, n.test) for n in part.nodes]
    models = [build_model("cnn-small", data.shape, data.num_classes, node=i, num_nodes=args.nodes,
                          init_seed=seeds.integer("model.init")) for i in range(args.nodes)]  # dfedavgm's common start
    generators = [torch.Generator().manual_seed(seeds.integer("node.torch", i)) for i in range(args.nodes)]

    start = time.perf_counter()
    for _ in range(args.rounds):
        for i, model in enumerate(models):
            sgd(model, *train[i], epochs=1, steps=0, lr=args.lr, momentum=0.9, weight_decay=5e-4,
                batch_size=args.batch_size, generator=generators[i])
        states = [float_state(m) for m in models]
        for i, model in enumerate(models):
            mix(model, weights[i][i], [(w, states[j]) for j, w in weights[i].items() if j != i])
        accuracies = [accuracy(m, *test[i]) for i, m in enumerate(models)]
    wall = time.perf_counter() - start
    print(json.dumps({"wall_seconds": wall, "test_acc": sum(accuracies) / len(accuracies)}))


if __name__ == "__main__":
    main()
