"""p2p-emulator: how a decentralized learning protocol behaves on an emulated network.

The public Python API is the names of this module; import them from here, by this name:

    import p2p_emulator as emu

    result = emu.run(protocol="gossip", topology="ring", nodes=8, rounds=5, quiet=True)
    rows = emu.read_run(result.out_dir).metrics     # metrics.jsonl: one dict per node per round
    study = emu.sweep("grid.yaml")                  # a grid of runs, then its tables
    emu.report([result.out_dir], out="report")      # plots and a comparison table

For protocol authors: `Protocol`, `register`, `RunInfo` and `Node` (the API a protocol's
`run(node)` gets), and `Extension` and `Measure` for a protocol's own figures and measures. Every other module of this package, and of `emulator`, `protocols` and
`topologies`, is internal: it may change in any release.

The names load on first use, so `import p2p_emulator` stays cheap (no torch, no matplotlib).
"""
from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

try:
    __version__ = version("p2p-emulator")  # the one place the version lives is pyproject.toml
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"

_API = {  # public name -> the module that defines it
    "run": "p2p_emulator.runs", "RunResult": "p2p_emulator.runs",
    "sweep": "p2p_emulator.sweeps", "SweepResult": "p2p_emulator.sweeps",
    "report": "p2p_emulator.analysis.report",
    "read_run": "p2p_emulator.analysis.rundir", "Run": "p2p_emulator.analysis.rundir",
    "Curves": "p2p_emulator.analysis.rundir", "RunDirError": "p2p_emulator.analysis.rundir",
    "Extension": "p2p_emulator.analysis.extensions", "Measure": "p2p_emulator.analysis.measures",
    "Protocol": "emulator.protocol", "register": "emulator.protocol", "RunInfo": "emulator.protocol",
    "Node": "emulator.node",
    "UsageError": "emulator.errors",
}
__all__ = ["__version__", *_API]

if TYPE_CHECKING:  # what type checkers and the API reference see
    from emulator.errors import UsageError
    from emulator.node import Node
    from emulator.protocol import Protocol, RunInfo, register
    from p2p_emulator.analysis.extensions import Extension
    from p2p_emulator.analysis.measures import Measure
    from p2p_emulator.analysis.report import report
    from p2p_emulator.analysis.rundir import Curves, Run, RunDirError, read_run
    from p2p_emulator.runs import RunResult, run
    from p2p_emulator.sweeps import SweepResult, sweep


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'p2p_emulator' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
