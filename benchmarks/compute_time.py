"""Counted compute time against the clock on the wall: one training job per model and batch size.

    ./dev bench compute_time [--profile host|reference] [--batches 10,32,128] [--seconds 0.4] [--json FILE]

For each model (mlp on digits' 8x8 features, cnn-small, leaf-cnn, resnet18 and the four
hetero-small backbones on FashionMNIST-shaped 28x28 images, char-lstm at hidden 64 and 256 on
80-character sequences) and batch size, one local-SGD job (training.sgd, one epoch) sized to
about --seconds of wall time is charged by the profile (`host`: calibrated on this machine, the
cached calibration reused) and run, the least wall time of three runs taken as measured (interference
only adds time). Prints
charged/measured per job, and the median and worst |charged/measured - 1| over all of them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from p2p_emulator.workloads.models import build_model
from p2p_emulator.workloads.profiles import profile
from p2p_emulator.workloads.training import sgd
from p2p_emulator.workloads.work import model_work

IMAGE = ((1, 28, 28), 10, 0)  # FashionMNIST's sample shape, classes; no vocabulary
# (label, model spec, node of a hetero pool, (sample shape, classes, vocabulary))
MODELS = [("mlp", "mlp", 0, ((64,), 10, 0)), ("cnn-small", "cnn-small", 0, IMAGE),
          ("leaf-cnn", "leaf-cnn", 0, ((1, 28, 28), 62, 0)),
          ("char-lstm:hidden=64", "char-lstm:hidden=64", 0, ((80,), 80, 80)),
          ("char-lstm:hidden=256", "char-lstm:hidden=256", 0, ((80,), 80, 80)), ("resnet18", "resnet18", 0, IMAGE),
          *((f"hetero-small/{arch}", "hetero-small", i, IMAGE)
            for i, arch in enumerate(("cnn-small", "small-resnet", "small-dwsep", "small-mixer")))]


def samples(shape: tuple, classes: int, vocabulary: int, n: int, generator: torch.Generator):
    x = (torch.randint(0, vocabulary, (n, *shape), dtype=torch.uint8, generator=generator) if vocabulary
         else torch.randn((n, *shape), generator=generator))
    return x, torch.randint(0, classes, (n,), generator=generator)


def job(model, x, y, batch: int) -> float:
    """Wall seconds of one epoch of local SGD over (x, y)."""
    start = time.perf_counter()
    sgd(model, x, y, epochs=1, steps=0, lr=0.01, momentum=0.9, weight_decay=5e-4, batch_size=batch,
        generator=torch.Generator().manual_seed(1))
    return time.perf_counter() - start


def prepare(spec: str, node: int, data: tuple, batch: int, seconds: float) -> dict:
    """One job: its model, samples (about `seconds` of wall time of local SGD) and counted work."""
    shape, classes, vocabulary = data
    model = build_model(spec, shape, classes, node=node, num_nodes=4, vocabulary=vocabulary)
    generator = torch.Generator().manual_seed(0)
    x, y = samples(shape, classes, vocabulary, 4 * batch, generator)
    work = model_work(model, x, y)
    one = job(model, x[:2 * batch], y[:2 * batch], batch) / 2  # warms up; sizes the job
    n = batch * max(2, min(100, round(seconds / max(one, 1e-6))))
    x, y = samples(shape, classes, vocabulary, n, generator)
    return {"model": model, "x": x, "y": y, "batch": batch, "work": work.training(n, batch), "samples": n}


def measure(jobs: list[dict], device, repeats: int = 3) -> list[dict]:
    """Each job's charge and its least wall time of `repeats`, timed in turns over all jobs (interference only
    adds time; a slow spell of the machine then slows one timing of many jobs, not every timing of one)."""
    walls = [[job(j["model"], j["x"], j["y"], j["batch"]) for j in jobs] for _ in range(repeats)]
    rows = []
    for j, timings in zip(jobs, zip(*walls)):
        charged, measured = device.seconds(j["work"]), min(timings)
        rows.append({"arch": j["model"].arch, "batch": j["batch"], "samples": j["samples"], "charged": charged,
                     "measured": measured, "ratio": charged / measured})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="host")
    parser.add_argument("--batches", default="10,32,128")
    parser.add_argument("--seconds", type=float, default=0.4)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    device = profile(args.profile)
    cases = [(label, spec, node, data, int(b)) for label, spec, node, data in MODELS for b in args.batches.split(",")]
    jobs = [prepare(spec, node, data, batch, args.seconds) for _, spec, node, data, batch in cases]
    rows = [{"label": label, "model": spec, **row} for (label, spec, *_), row in zip(cases, measure(jobs, device))]
    table = Table("model", "batch", "samples", "charged s", "measured s", "charged/measured",
                  title=f"compute time, profile {args.profile}, {torch.get_num_threads()} threads")
    for r in rows:
        table.add_row(r["label"], str(r["batch"]), str(r["samples"]), f"{r['charged']:.4f}", f"{r['measured']:.4f}",
                      f"{r['ratio']:.3f}")
    console = Console()
    console.print(table)
    errors = [abs(r["ratio"] - 1) for r in rows]
    console.print(f"|charged/measured - 1|: median {statistics.median(errors):.3f}, worst {max(errors):.3f} "
                  f"over {len(rows)} jobs; profile {device}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": device.as_dict(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
