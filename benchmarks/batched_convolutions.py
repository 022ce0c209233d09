"""Why the batched executor runs models with convolutions node by node on a CPU: the two ways, timed.

    ./dev bench batched_convolutions [--nodes 16] [--samples 320] [--scored 2048]

--nodes cnn-small models on 28x28 inputs (random: only the time is measured), one torch thread:
an epoch of --samples samples each by p2p_emulator.workloads.training.sgd, node after node, against
p2p_emulator.workloads.batched.sgd_together (vmap, which runs a convolution over stacked weights as a grouped
convolution); then --scored samples each scored by accuracy against accuracy_together.
"""
from __future__ import annotations

import argparse
import time

import torch

from p2p_emulator.workloads.batched import accuracy_together, sgd_together
from p2p_emulator.workloads.models import build_model
from p2p_emulator.workloads.training import accuracy, sgd


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def calls(nodes: int, samples: int, train: bool) -> list[tuple[tuple, dict]]:
    """Fresh models and data for every node, as the jobs' (args, kwargs)."""
    out = []
    for i in range(nodes):
        model = build_model("cnn-small", (1, 28, 28), 10)
        x, y = torch.randn(samples, 1, 28, 28), torch.randint(0, 10, (samples,))
        kwargs = dict(epochs=1, steps=0, lr=0.05, momentum=0.9, weight_decay=5e-4, batch_size=32,
                      generator=torch.Generator().manual_seed(i)) if train else {}
        out.append(((model, x, y), kwargs))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--samples", type=int, default=320)
    parser.add_argument("--scored", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for name, train, single, together in (("an epoch of SGD", True, sgd, sgd_together),
                                          ("scoring", False, accuracy, accuracy_together)):
        samples = args.samples if train else args.scored
        one_by_one, all_at_once = calls(args.nodes, samples, train), calls(args.nodes, samples, train)
        alone = timed(lambda: [single(*a, **kw) for a, kw in one_by_one])
        batched = timed(lambda: together(all_at_once))
        print(f"{name}, {args.nodes} cnn-small models x {samples} samples: node by node {alone:.1f} s, "
              f"batched {batched:.1f} s ({batched / alone:.2f}x)")


if __name__ == "__main__":
    main()
