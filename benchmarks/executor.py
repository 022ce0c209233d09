"""--executor thread against --executor ray (a local Ray, 2 workers) on the same run, measured in one go.

    ./dev bench executor [--nodes 50] [--rounds 3] [--jobs 300]

The run: dfedavgm with cnn-small on FashionMNIST (digits where it is missing), regular:d=4,
every node scored on the whole test split at the last round. Each executor runs it in its
own `emulate` process; the figures that matter are ratios taken in the same invocation.
Then a no-op job on a kept model, one at a time and many at once, gives the per-job
overhead and how many jobs per second one driver dispatches, and one-thread SGD steps give
the training seconds per sample that docs/scale-out.md divides by the driver's costs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from emulator.clock import VirtualClock
from emulator.compute import Compute, ComputeModel, ThreadExecutor
from p2p_emulator.workloads.datasets import DatasetError, load_dataset


def dataset() -> str:
    try:
        load_dataset("fashion-mnist", None, False)
        return "fashion-mnist"
    except DatasetError:
        return "digits"


def emulate(out: Path, nodes: int, rounds: int, data: str, executor: list[str]) -> dict:
    """One run in its own process; its summary.json, with the process's wall time."""
    argv = [sys.executable, "-m", "p2p_emulator.cli", "--protocol", "dfedavgm", "--model", "cnn-small", "--dataset", data,
            "--topology", "regular:d=4", "--nodes", str(nodes), "--rounds", str(rounds), "--eval-every", str(rounds),
            "--quiet", "--no-plots", "--out", str(out), *executor]
    start = time.perf_counter()
    subprocess.run(argv, check=True, cwd=Path(__file__).parents[1])
    summary = json.loads((out / "summary.json").read_text())
    summary["process_wall"] = time.perf_counter() - start
    return summary


def noop(model) -> None:
    """A job that touches the kept model and does nothing: what remains is the executor's own cost."""
    return None


def job_overhead(executor, jobs: int) -> tuple[float, float]:
    """(seconds per job one at a time, jobs per second with all of them in flight) on a small kept model."""
    import torch

    compute = Compute(ComputeModel("per-sample", 0.0, 1.0, (1.0,) * 2), None, executor=executor)
    model = compute.keep(0, torch.nn.Linear(64, 10))

    # work 1 at no cost per unit: charged nothing, but a compute job (work 0 would run at once, inline)
    async def one_at_a_time():
        for _ in range(jobs):
            await compute.run(0, noop, (model,), {}, 1)

    async def all_at_once():
        await asyncio.gather(*(compute.run(0, noop, (model,), {}, 1) for _ in range(jobs)))

    timings = []
    for body in (one_at_a_time, all_at_once):
        clock = compute.clock = VirtualClock()
        start = time.perf_counter()
        clock.run(body())
        timings.append(time.perf_counter() - start)
    return timings[0] / jobs, jobs / timings[1]


def seconds_per_sample(model: str, steps: int = 6, batch: int = 32) -> float:
    """One-thread SGD on 28x28 grey images: training seconds per sample (the first step, warm-up, not counted)."""
    import torch

    from p2p_emulator.workloads.models import build_model
    from p2p_emulator.workloads.training import sgd

    torch.set_num_threads(1)
    net = build_model(model, (1, 28, 28), 10)
    x, y = torch.randn((steps + 1) * batch, 1, 28, 28), torch.randint(0, 10, ((steps + 1) * batch,))

    def train(part: slice) -> None:
        sgd(net, x[part], y[part], epochs=1, steps=0, lr=0.01, momentum=0.9, weight_decay=0, batch_size=batch,
            generator=torch.Generator().manual_seed(0))

    train(slice(None, batch))
    start = time.perf_counter()
    train(slice(batch, None))
    return (time.perf_counter() - start) / (steps * batch)


def overheads(jobs: int) -> dict[str, tuple[float, float]]:
    from emulator.ray_executor import RayExecutor

    with ThreadExecutor(2) as threads:
        thread = job_overhead(threads, jobs)
    with RayExecutor(nodes=2, address="", workers=2, cpus_per_worker=1, gpus_per_worker=0) as workers:
        job_overhead(workers, 20)  # warm: the first round trips set up Ray's connections
        ray = job_overhead(workers, jobs)
    return {"thread": thread, "ray": ray}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=300)
    args = parser.parse_args()
    console = Console(width=130)
    data = dataset()
    with tempfile.TemporaryDirectory() as tmp:
        thread = emulate(Path(tmp) / "thread", args.nodes, args.rounds, data, ["--workers", "2"])
        ray = emulate(Path(tmp) / "ray", args.nodes, args.rounds, data, ["--executor", "ray", "--ray-workers", "2"])
        same = all((Path(tmp) / "thread" / name).read_bytes() == (Path(tmp) / "ray" / name).read_bytes()
                   for name in ("metrics.jsonl", "links.csv"))
    per_job = overheads(args.jobs)
    report(console, args, data, thread, ray, same, per_job)
    console.print("one-thread training, ms per sample: " + ", ".join(
        f"{model} {seconds_per_sample(model) * 1e3:.2f}" for model in ("cnn-small", "resnet18")))


def report(console, args, data, thread, ray, same, per_job) -> None:
    mib = 2**20
    ex = ray["executor"]
    protocol_bytes = ray["bytes_total"] / args.rounds
    moved = (ex["bytes_to_workers"] + ex["bytes_from_workers"]) / args.rounds
    table = Table(title=f"dfedavgm, cnn-small, {data}, regular:d=4, {args.nodes} nodes x {args.rounds} rounds")
    for column in ("", "thread (2 threads)", "ray (local, 2 workers)", "ray / thread"):
        table.add_column(column, justify="right")
    table.add_row("emulation wall s", f"{thread['wall_seconds']:.1f}", f"{ray['wall_seconds']:.1f}",
                  f"{ray['wall_seconds'] / thread['wall_seconds']:.2f}")
    table.add_row("process wall s (with start-up)", f"{thread['process_wall']:.1f}", f"{ray['process_wall']:.1f}",
                  f"{ray['process_wall'] / thread['process_wall']:.2f}")
    table.add_row("driver CPU s (thread: with compute)", f"{thread['executor']['driver_cpu_seconds']:.1f}",
                  f"{ex['driver_cpu_seconds']:.1f}", "")
    per_node_round = ex["driver_cpu_seconds"] / args.nodes / args.rounds
    table.add_row("driver CPU ms per node-round", "", f"{per_node_round * 1e3:.1f}", "")
    table.add_row("driver peak RSS MiB", f"{thread['executor']['driver_peak_rss'] / mib:.0f}",
                  f"{ex['driver_peak_rss'] / mib:.0f}", "")
    table.add_row("worker peak RSS MiB", "(in the driver)", " / ".join(f"{r / mib:.0f}" for r in ex["worker_peak_rss"]),
                  "")
    table.add_row("per-job round trip ms", f"{per_job['thread'][0] * 1e3:.2f}", f"{per_job['ray'][0] * 1e3:.2f}",
                  f"+{(per_job['ray'][0] - per_job['thread'][0]) * 1e3:.2f} ms")
    table.add_row("jobs/s, all in flight", f"{per_job['thread'][1]:.0f}", f"{per_job['ray'][1]:.0f}", "")
    table.add_row("driver<->worker MB per round", "0", f"{moved / 1e6:.1f}", f"{moved / protocol_bytes:.2f} x protocol")
    table.add_row("protocol MB per round (ledger)", f"{thread['bytes_total'] / args.rounds / 1e6:.1f}",
                  f"{protocol_bytes / 1e6:.1f}", "")
    table.add_row("kept once (models, data) MB", "", f"{ex['bytes_kept'] / 1e6:.1f}", "")
    table.add_row("jobs", "", str(ex["jobs"]), "")
    table.add_row("metrics.jsonl and links.csv", "", "identical" if same else "DIFFER", "")
    console.print(table)


if __name__ == "__main__":
    main()
