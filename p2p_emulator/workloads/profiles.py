"""Device profiles: what a device charges per counted unit of work (emulator.work), by name or measured here.

- `reference`: this project's 2-core machine, calibrated once by `calibrate()` and kept below, so
  that a seed gives the same emulated times on every machine.
- `host`: this machine, calibrated by the same measurement (about 30 s) on first use and cached
  per processor model, thread count and torch version.
- a number of FLOP/s (`5e9`, `12G`): the reference device sped up or slowed down so that it
  trains resnet18 at that many FLOP/s, every other price scaled alike.

calibrate() times training steps of probe models (small models of the kinds the tool trains, and
the shipped ones at other batch sizes than the benchmark's) and fits the price of each count by
non-negative least squares on the relative error. `./dev bench compute_time` holds the fit
against the shipped models (docs/compute-model.md).
"""
from __future__ import annotations

import csv
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from emulator.work import PRICED, DeviceProfile, Work
from .lazy import LazyModule

torch = LazyModule("torch")

# calibrate() on the project's machine (2-core AMD EPYC VM, 2 threads, torch 2.14.1), 2026-11-28.
REFERENCE = DeviceProfile("reference", steps=0.000197, kernels=0.0, convolutions=0.000513, views=2.33e-05,
                          elements=1.23e-09, recurrent_steps=2.64e-05, matmul_flops=7.52e-12,
                          conv_flops=1.12e-11, recurrent_flops=1.09e-11)
# The reference device's training FLOP/s on resnet18 (28x28, batch 32): counted FLOPs over charged seconds. A
# profile given as FLOP/s is the reference scaled by FLOP/s over this.
REFERENCE_FLOPS = 7.7e10
PROBE_BATCHES = (8, 32, 128)
SHIPPED_BATCHES = (16, 64)
PROBE_SECONDS = 0.15  # wall time each probe job is sized to
REPEATS = 3


class ProfileError(ValueError):
    """A bad profile name or assignment; the message is one user-facing line."""


def node_profiles(text: str, num_nodes: int, calibrate: bool = True) -> tuple[DeviceProfile, ...]:
    """Each node's profile under --compute-profile `text`: one name or FLOP/s figure for all, or a CSV file with
    header node,profile (unlisted nodes: reference). calibrate=False only checks (host is not measured)."""
    path = Path(text.strip())
    if not path.is_file():
        return (profile(text.strip(), calibrate),) * num_nodes
    named = [REFERENCE] * num_nodes
    for row in _rows(path):
        node, device = _node(row, path, num_nodes), profile(str(row["profile"]).strip(), calibrate)
        if num_nodes:
            named[node] = device
    return tuple(named)


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or {"node", "profile"} - set(reader.fieldnames):
            raise ProfileError(f"{path}: expected a CSV with header node,profile")
        return list(reader)


def _node(row: dict, path: Path, num_nodes: int) -> int:
    try:
        node = int(row["node"])
    except (TypeError, ValueError):
        raise ProfileError(f"{path}: node {row['node']!r} is not a node id") from None
    if node < 0 or (num_nodes and node >= num_nodes):
        raise ProfileError(f"{path}: node {node} is not one of the run's nodes 0..{num_nodes - 1}")
    return node


def profile(name: str, calibrate: bool = True) -> DeviceProfile:
    """A named profile (reference, host) or a FLOP/s figure (5e9, 12G); host is measured only with calibrate."""
    if name == "reference" or (name == "host" and not calibrate):
        return REFERENCE
    if name == "host":
        return host()
    flops = _flops(name)
    return REFERENCE.scaled(flops / REFERENCE_FLOPS, f"{name} FLOP/s")


def _flops(text: str) -> float:
    scale = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}.get(text[-1:].upper(), 1.0)
    try:
        value = float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise ProfileError(f"{text!r}: use reference, host, FLOP/s such as 5e9 or 12G, or an existing CSV "
                           "file") from None
    if not 0 < value < float("inf"):
        raise ProfileError(f"{text!r}: FLOP/s must be positive and finite")
    return value


def host() -> DeviceProfile:
    """This machine's profile: calibrated once, then read from the cache."""
    path, key = cache_path(), host_key()
    cached = json.loads(path.read_text()) if path.exists() else {}
    if key not in cached:
        print(f"--compute-profile host: calibrating this machine once (about 30 s), cached in {path}", file=sys.stderr)
        cached[key] = calibrate().as_dict()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=1, sort_keys=True))
    return DeviceProfile(**{**cached[key], "name": "host"})


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "p2p-emulator" / "host-profiles.json"


def host_key() -> str:
    """What the calibration depends on: the processor, the threads a job uses and torch's version."""
    return f"{_cpu_model()} | {torch.get_num_threads()} threads | torch {torch.__version__}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate() -> DeviceProfile:
    """Seconds per count on this machine, fitted to the probes' measured training steps."""
    return fit(measure_probes())


def measure_probes() -> list[tuple[Work, float]]:
    """(counted work, measured wall seconds) of a training step of each probe at each of its batch sizes: the
    least of REPEATS timings taken in turns over all probes (interference only adds time, and a slow spell
    of the machine then slows one timing of many probes, not every timing of one)."""
    jobs = [_probe(make, shape, vocabulary, batch) for make, shape, vocabulary, batches in _probes()
            for batch in batches]
    walls = [[time_job() for _, time_job in jobs] for _ in range(REPEATS)]
    return [(work, min(timings)) for (work, _), timings in zip(jobs, zip(*walls))]


def fit(rows: list[tuple[Work, float]]) -> DeviceProfile:
    """The profile whose charges are nearest the measured seconds, in relative error (non-negative prices)."""
    from scipy.optimize import nnls  # noqa: PLC0415

    counts = np.array([[getattr(work, name) for name in PRICED] for work, _ in rows])
    seconds = np.array([wall for _, wall in rows])
    scale = np.where(counts.max(0) > 0, counts.max(0), 1.0)
    fit, _ = nnls(counts / scale / seconds[:, None], np.ones(len(rows)))  # relative error, each count scaled
    return DeviceProfile("host", *(float(f"{c:.3g}") for c in fit / scale))


def _probe(make, shape: tuple, vocabulary: int, batch: int):
    """(counted work of one training step of the probe at `batch`, a function timing one, in seconds)."""
    from .training import sgd  # noqa: PLC0415
    from .work import model_work  # noqa: PLC0415

    generator = torch.Generator().manual_seed(0)
    model = make()
    x = (torch.randint(0, vocabulary, (batch * 64, *shape), dtype=torch.uint8) if vocabulary
         else torch.randn((batch * 64, *shape), generator=generator))
    y = torch.randint(0, 10, (batch * 64,), generator=generator)
    work = model_work(model, x, y).training(batch, batch)

    def train(steps: int) -> float:  # an epoch over steps minibatches, as a node's local training runs
        start = time.perf_counter()
        sgd(model, x[:steps * batch], y[:steps * batch], epochs=1, steps=0, lr=0.01, momentum=0.9,
            weight_decay=5e-4, batch_size=batch, generator=generator)
        return time.perf_counter() - start

    steps = max(1, min(64, round(PROBE_SECONDS / max(train(1), 1e-6))))  # warms up, then sizes the job
    return work, lambda: train(steps) / steps


def _probes() -> list:
    """(build, sample shape, vocabulary, batch sizes) of each probe model: small models of the kinds the tool
    trains (MLPs, convolutional nets with pooling, normalisation, depthwise and residual layers, token mixing,
    LSTMs), then the models it ships, at other batch sizes than ./dev bench compute_time's."""
    return [*((*probe, PROBE_BATCHES) for probe in _generic_probes()), *_shipped_probes()]


def _shipped_probes() -> list:
    from .models import build_model  # noqa: PLC0415

    image = ((1, 28, 28), 10, 0)
    shipped = [("mlp", 0, ((64,), 10, 0)), ("cnn-small", 0, image), ("leaf-cnn", 0, ((1, 28, 28), 62, 0)),
               ("char-lstm:hidden=64", 0, ((80,), 80, 80)), ("char-lstm", 0, ((80,), 80, 80)),
               ("resnet18", 0, image), *(("hetero-small", node, image) for node in (1, 2, 3))]

    def builder(spec, node, shape, classes, vocabulary):
        return lambda: build_model(spec, shape, classes, node=node, num_nodes=4, vocabulary=vocabulary)
    return [(builder(spec, node, *data), data[0], data[2], SHIPPED_BATCHES) for spec, node, data in shipped]


def _generic_probes() -> list:
    """(build, sample shape, vocabulary) of the probes that are not shipped models."""
    nn = torch.nn

    def seeded(build):
        def make():
            torch.manual_seed(0)
            return build()
        return make

    def conv_bn(c_in: int, c_out: int, groups: int = 1):
        return [nn.Conv2d(c_in, c_out, 3, padding=1, groups=groups), nn.BatchNorm2d(c_out), nn.ReLU()]

    head = lambda features: [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(features, 10)]  # noqa: E731
    return [
        (seeded(lambda: nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))), (32,), 0),
        (seeded(lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                                      nn.Linear(64, 10))), (64,), 0),
        (seeded(lambda: nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                      nn.Linear(1024, 10))), (784,), 0),
        (seeded(lambda: nn.Sequential(nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                      nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))), (1, 28, 28), 0),
        (seeded(lambda: nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
                                      nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                                      *head(64))), (3, 16, 16), 0),
        (seeded(lambda: nn.Sequential(*conv_bn(8, 8), *conv_bn(8, 8), *conv_bn(8, 8), *head(8))), (8, 24, 24), 0),
        (seeded(lambda: nn.Sequential(*conv_bn(1, 16), *conv_bn(16, 16, groups=16), nn.Conv2d(16, 32, 1),
                                      nn.BatchNorm2d(32), nn.ReLU(), *head(32))), (1, 20, 20), 0),
        (seeded(lambda: nn.Sequential(*conv_bn(1, 16), _residual_type()(16), _residual_type()(16), *head(16))),
         (1, 14, 14), 0),
        (seeded(lambda: nn.Sequential(nn.Flatten(2), _residual_type()(16, mixing=True), nn.Flatten(),
                                      nn.Linear(16 * 48, 10))), (16, 48), 0),
        (seeded(lambda: _recurrent_type()(16, 128, 1)), (40,), 20),
        (seeded(lambda: _recurrent_type()(8, 32, 2)), (20,), 20),
    ]


@functools.cache
def _residual_type():
    nn = torch.nn

    class Residual(nn.Module):
        """x + f(x): two convolutions with BatchNorm, or (mixing) a LayerNorm and a token-mixing MLP."""

        def __init__(self, channels: int, mixing: bool = False):
            super().__init__()
            self.f = (nn.Sequential(nn.LayerNorm(48), nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 48)) if mixing
                      else nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels),
                                         nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1),
                                         nn.BatchNorm2d(channels)))

        def forward(self, x):
            return torch.relu(x + self.f(x))

    return Residual


@functools.cache
def _recurrent_type():
    nn = torch.nn

    class Recurrent(nn.Module):
        """An embedding, stacked LSTM layers and a linear read-out of the last step."""

        def __init__(self, embedding: int, hidden: int, layers: int):
            super().__init__()
            self.embed = nn.Embedding(20, embedding)
            self.lstm = nn.LSTM(embedding, hidden, layers, batch_first=True)
            self.out = nn.Linear(hidden, 10)

        def forward(self, x):
            return self.out(self.lstm(self.embed(x.long()))[0][:, -1])

    return Recurrent
