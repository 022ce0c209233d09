"""Wire codec throughput against a plain memcpy of the same bytes, measured in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/codec.py

Per payload: encode+decode (the frame stays a bytearray, as the emulator passes it) and one memcpy
(numpy copyto between preallocated, hot buffers) of the payload's total tensor bytes, each timed in
5 alternating rounds of repetitions; the table shows the median of the round medians.
ratio = codec MB/s / memcpy MB/s; the target is >= 0.5.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from emulator.wire import decode, encode, keep_large_frames_in_the_heap

MB = 1e6


def vgg_state_dict(widths: tuple[int, ...], conv_bias: bool) -> dict[str, torch.Tensor]:
    """The state_dict of a CIFAR-10 VGG with batch norm: conv blocks and a linear head."""
    state, c_in = {}, 3
    for i, c_out in enumerate(widths):
        state[f"features.{i}.conv.weight"] = torch.randn(c_out, c_in, 3, 3)
        if conv_bias:
            state[f"features.{i}.conv.bias"] = torch.randn(c_out)
        for key in ("weight", "bias", "running_mean", "running_var"):
            state[f"features.{i}.bn.{key}"] = torch.randn(c_out)
        state[f"features.{i}.bn.num_batches_tracked"] = torch.tensor(1000)
        c_in = c_out
    state["classifier.weight"] = torch.randn(10, c_in)
    state["classifier.bias"] = torch.randn(10)
    return state


def median_seconds(fn, reps: int) -> float:
    fn()  # warm up allocator and caches
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(obj, nbytes: int, reps: int, rounds: int = 5) -> tuple[float, float]:
    """(codec, memcpy) seconds: medians of per-round medians; rounds alternate so load hits both."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    codec, memcpy = [], []
    for _ in range(rounds):
        codec.append(median_seconds(lambda: decode(encode(obj)), reps))
        memcpy.append(median_seconds(lambda: np.copyto(dst, src), reps))
    return statistics.median(codec), statistics.median(memcpy)


def main() -> int:
    keep_large_frames_in_the_heap()  # as the emulate command does
    torch.manual_seed(0)
    payloads = [
        ("float32 tensor", torch.randn(4 * 2**20)),
        ("float32 tensor", torch.randn(2**18)),
        ("VGG-11-BN state_dict", vgg_state_dict((64, 128, 256, 256, 512, 512, 512, 512), True)),
        ("slim VGG-BN state_dict",
         vgg_state_dict((32, 32, 64, 64, 128, 128, 256, 256, 256, 256), False)),
    ]
    table = Table(title="wire codec: encode+decode vs memcpy of the same bytes (medians)")
    for column in ("payload", "tensors", "MB", "encode+decode MB/s", "memcpy MB/s", "ratio"):
        table.add_column(column, justify="left" if column == "payload" else "right")
    for name, obj in payloads:
        tensors = list(obj.values()) if isinstance(obj, dict) else [obj]
        nbytes = sum(t.nbytes for t in tensors)
        codec, memcpy = compare(obj, nbytes, reps=max(10, min(100, int(5e8 / nbytes))))
        table.add_row(name, str(len(tensors)), f"{nbytes / MB:.2f}", f"{nbytes / codec / MB:,.0f}",
                      f"{nbytes / memcpy / MB:,.0f}", f"{memcpy / codec:.2f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
