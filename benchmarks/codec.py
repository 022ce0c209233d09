"""Wire codec throughput against a plain memcpy of the same bytes, measured in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/codec.py

For each payload: median over repetitions of encode+decode time (the frame a bytearray, as the
emulator passes it), and of one memcpy (numpy copyto between preallocated buffers) of the
payload's total tensor bytes. ratio = codec MB/s / memcpy MB/s; the target is >= 0.5.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from emulator.wire import decode, encode

MB = 1e6


def small_cnn_state_dict() -> dict[str, torch.Tensor]:
    """A VGG-style CNN with batch norm: 10 conv blocks + a linear head, 62 tensors."""
    state, c_in = {}, 3
    for i, c_out in enumerate((32, 32, 64, 64, 128, 128, 256, 256, 256, 256)):
        state[f"features.{i}.conv.weight"] = torch.randn(c_out, c_in, 3, 3)
        for key in ("weight", "bias", "running_mean", "running_var"):
            state[f"features.{i}.bn.{key}"] = torch.randn(c_out)
        state[f"features.{i}.bn.num_batches_tracked"] = torch.tensor(1000)
        c_in = c_out
    state["classifier.weight"] = torch.randn(10, c_in)
    state["classifier.bias"] = torch.randn(10)
    return state


def payload_bytes(obj) -> int:
    if isinstance(obj, dict):
        return sum(t.nbytes for t in obj.values())
    return obj.nbytes


def median_seconds(fn, reps: int) -> float:
    fn()  # warm up allocator and caches
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def codec_seconds(obj, reps: int) -> float:
    return median_seconds(lambda: decode(encode(obj)), reps)


def memcpy_seconds(nbytes: int, reps: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return median_seconds(lambda: np.copyto(dst, src), reps)


def main() -> int:
    torch.manual_seed(0)
    payloads = {
        "float32 tensor, 16 MB": torch.randn(4 * 2**20),
        "float32 tensor, 1 MB": torch.randn(2**18),
        "CNN state_dict, 62 tensors": small_cnn_state_dict(),
    }
    table = Table(title="wire codec: encode+decode vs memcpy (median of repetitions)")
    for column in ("payload", "MB", "encode+decode MB/s", "memcpy MB/s", "ratio"):
        table.add_column(column, justify="left" if column == "payload" else "right")
    for name, obj in payloads.items():
        nbytes = payload_bytes(obj)
        reps = max(20, min(500, int(2e9 / nbytes)))
        codec = nbytes / codec_seconds(obj, reps) / MB
        memcpy = nbytes / memcpy_seconds(nbytes, reps) / MB
        table.add_row(name, f"{nbytes / MB:.2f}", f"{codec:,.0f}", f"{memcpy:,.0f}",
                      f"{codec / memcpy:.2f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
