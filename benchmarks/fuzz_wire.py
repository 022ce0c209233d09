"""Fuzz the wire decoder: mutated real frames, checksums off, for --seconds.

    ./dev bench fuzz_wire [--seconds 60] [--seed 0]

Frames come from what the protocols send (a model's state dict, compressed q8, q4,
fp16 and bf16 tensors, numpy arrays, nested bodies); each input is one of them with
random bit flips, byte overwrites, truncation, duplication or a spliced second frame.
decode(frame, checksum=False) must return or raise WireError: anything else is a
finding, saved under fuzz_findings/ with its traceback. Also reported: inputs per
second and the slowest single decode (a bound check done after the arithmetic shows
up there as a decode that takes seconds).
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from emulator.wire import WireError, decode, encode  # noqa: E402


def corpus() -> list[bytes]:
    rng = np.random.default_rng(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    state = {name: t.detach() for name, t in model.state_dict().items()}
    frames = [encode(["model", 3, {"state": state, "degree": 4}])]
    for compress in ("q8", "q4", "fp16", "bf16"):
        frames.append(encode(["model", 1, {"state": state}], compress=compress, rng=rng))
    frames.append(encode(["x", 7, {"x": rng.standard_normal(8), "ids": np.arange(5, dtype=np.int16)}]))
    frames.append(encode(["notice", 0, [1, "two", 3.0, None, True, b"\x00", {"k": [1, 2]}]]))
    return [bytes(frame) for frame in frames]


def mutate(frame: bytes, frames: list[bytes], rng: np.random.Generator) -> bytes:
    data = bytearray(frame)
    for _ in range(int(rng.integers(1, 5))):
        kind = int(rng.integers(6))
        at = int(rng.integers(len(data))) if data else 0
        if kind == 0 and data:
            data[at] ^= 1 << int(rng.integers(8))
        elif kind == 1 and data:
            data[at] = int(rng.integers(256))
        elif kind == 2:
            del data[at:]
        elif kind == 3:
            data[at:at] = data[at:at + int(rng.integers(1, 64))]
        elif kind == 4:
            other = frames[int(rng.integers(len(frames)))]
            data[at:] = other[int(rng.integers(len(other))):]
        elif data:  # a field of the prefix or header set to an extreme
            data[at:at + 4] = rng.choice([b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x7f\xff\xff\xff"])
    return bytes(data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng, frames = np.random.default_rng(args.seed), corpus()
    counts = {"inputs": 0, "decoded": 0, "refused": 0, "findings": 0}
    slowest, end = (0.0, b""), time.perf_counter() + args.seconds
    findings = Path("fuzz_findings")
    while time.perf_counter() < end:
        for _ in range(200):
            frame = mutate(frames[int(rng.integers(len(frames)))], frames, rng)
            start = time.perf_counter()
            try:
                decode(frame, checksum=False)
                counts["decoded"] += 1
            except WireError:
                counts["refused"] += 1
            except Exception:  # noqa: BLE001 - the finding this bench is for
                counts["findings"] += 1
                findings.mkdir(exist_ok=True)
                (findings / f"{counts['inputs']}.bin").write_bytes(frame)
                (findings / f"{counts['inputs']}.txt").write_text(traceback.format_exc())
            took = time.perf_counter() - start
            slowest = max(slowest, (took, frame))
            counts["inputs"] += 1
    table = Table(title=f"wire fuzzing, {args.seconds:.0f} s, seed {args.seed}")
    for column in ("inputs", "inputs/s", "decoded", "refused (WireError)", "findings", "slowest decode"):
        table.add_column(column, justify="right")
    table.add_row(f"{counts['inputs']:,}", f"{counts['inputs'] / args.seconds:,.0f}", f"{counts['decoded']:,}",
                  f"{counts['refused']:,}", str(counts["findings"]),
                  f"{slowest[0] * 1e3:.2f} ms ({len(slowest[1]):,} B)")
    Console().print(table)
    return 1 if counts["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
