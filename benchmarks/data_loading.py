"""Cost of MAPL's input pipeline against the training step it feeds, on one CPU thread.

    PYTHONPATH=. python benchmarks/data_loading.py [--steps 30] [--batch 64]

Input side, per step: gather a batch from the uint8 training tensor by random
indices, scale to 0..1, draw two augmented views (p2p_emulator.workloads.augment.TwoViews),
standardise both. Training side: a cnn-small MAPL step (both views forward,
cross-entropy + supervised contrastive loss on the projections, backward, Adam),
with the spec's head (d_z = d_p = 512, hidden 4096) and the CPU head (128/128/512),
and a plain one-view cross-entropy + SGD step. Target: input / step <= 0.20.
FashionMNIST comes from p2p_emulator.workloads.datasets when its files are there (random
uint8 data of that shape otherwise); the RGB row uses random CIFAR-shaped data,
the only case where colour jitter runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from p2p_emulator.workloads.augment import TwoViews
from p2p_emulator.workloads.models import build_model

MAPL_HEADS = {"MAPL step, spec head 512/512/4096": (512, 512, 4096), "MAPL step, CPU head 128/128/512": (128, 128, 512)}


def fashion_mnist() -> tuple[str, torch.Tensor, torch.Tensor, float, float]:
    try:
        from p2p_emulator.workloads.datasets import load_dataset

        ds = load_dataset("fashion-mnist")
        return "fashion-mnist", ds.train_x, ds.train_y, ds.mean[0], ds.std[0]
    except Exception as exc:  # missing module or files: the shape is what matters for timing
        print(f"fashion-mnist unavailable ({exc}); using random uint8 data of its shape")
        return synthetic((1, 28, 28), 60000)


def synthetic(shape: tuple[int, int, int], n: int) -> tuple[str, torch.Tensor, torch.Tensor, float, float]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=g)
    return f"random {'x'.join(map(str, shape))}", x, torch.randint(0, 10, (n,), generator=g), 0.5, 0.25


def median_ms(fn, steps: int) -> float:
    for _ in range(3):  # warm-up: allocator, first-call dispatch
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def supcon(p: torch.Tensor, y: torch.Tensor, tau: float = 0.1) -> torch.Tensor:
    """Supervised contrastive loss over all 2B views (positives: same label)."""
    p = F.normalize(p, dim=1)
    sim = (p @ p.T / tau).fill_diagonal_(-1e9)
    positives = (y[:, None] == y[None, :]).fill_diagonal_(False)
    log_prob = sim.log_softmax(1)
    return -(log_prob * positives).sum(1).div(positives.sum(1).clamp(min=1)).mean()


def measure(train_x, train_y, mean, std, batch, steps) -> list[tuple[str, float]]:
    shape = tuple(train_x.shape[1:])
    g = torch.Generator().manual_seed(1)
    views = TwoViews(shape, g)
    batch_x = {}

    def load():
        idx = torch.randint(len(train_x), (batch,), generator=g)
        a, b = views(train_x[idx].float() / 255)
        batch_x["x"], batch_x["y"] = (torch.cat([a, b]) - mean) / std, train_y[idx].repeat(2)

    rows = [("gather + normalise + two views", median_ms(load, steps))]
    for label, (d_z, d_p, hidden) in MAPL_HEADS.items():
        model = build_model("cnn-small", shape, 10, d_z=d_z, d_p=d_p, hidden=hidden)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.5, 0.999))

        def mapl_step():
            z = model.features(batch_x["x"])
            loss = F.cross_entropy(model.classifier(z), batch_x["y"]) + supcon(model.project(z), batch_x["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()

        rows.append((label, median_ms(mapl_step, steps)))
    model = build_model("cnn-small", shape, 10)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def plain_step():
        loss = F.cross_entropy(model(batch_x["x"][:batch]), batch_x["y"][:batch])
        sgd.zero_grad()
        loss.backward()
        sgd.step()

    rows.append(("plain step: one view, CE, SGD", median_ms(plain_step, steps)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = Table(title=f"cnn-small, batch {args.batch}, 1 thread, median of {args.steps} steps")
    for column in ("data", "stage", "ms / step", "input / stage"):
        table.add_column(column, justify="right" if column != "stage" else "left")
    for name, x, y, mean, std in (fashion_mnist(), synthetic((3, 32, 32), 50000)):
        (input_label, input_ms), *steps = measure(x, y, mean, std, args.batch, args.steps)
        table.add_row(name, input_label, f"{input_ms:.2f}", "")
        for label, ms in steps:
            ratio = input_ms / ms
            table.add_row("", label, f"{ms:.1f}", f"[{'green' if ratio <= 0.2 else 'red'}]{ratio:.3f}")
        table.add_section()
    Console().print(table)


if __name__ == "__main__":
    main()
