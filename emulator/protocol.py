"""What a protocol is, and the registry that finds one by name.

A protocol is a class with a per-node coroutine `run(node)`; what a node keeps
lives in that coroutine (its locals, or objects it makes), never on the protocol
object, which every node shares. Its tunable options are a dataclass `Options`;
every field becomes a CLI flag and a config key. Protocols live as modules of
the `protocols` package, which is imported on first lookup, so adding a protocol
is adding one file there. Another installed package adds its own through the
entry-point group `p2p_emulator.protocols` (`name = "package.module:Class"`).
"""
from __future__ import annotations

import functools
import importlib
import json
import pkgutil
import warnings
from dataclasses import dataclass, replace
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import networkx as nx

from .seeds import Seeds
from .timeout import Adaptive

if TYPE_CHECKING:
    from .node import Node

PROTOCOL_PACKAGE = "protocols"
PLUGIN_GROUP = "p2p_emulator.protocols"
_REGISTRY: dict[str, type["Protocol"]] = {}


@dataclass
class NoOptions:
    pass


@dataclass
class RunInfo:
    """What a protocol may know about the run when it sets itself up (read-only during the run)."""
    num_nodes: int
    rounds: int
    seeds: Seeds
    graph: nx.Graph
    device: str
    out_dir: Path
    console: Any = None
    state_in_process: bool = True  # nodes' models live in this process (False: on a cluster's workers)
    duration: float = 0.0  # --duration (0: none)
    time_varying: bool = False  # a --topology-schedule changes the graph during the run
    # charge(node, work): the emulated seconds node's job of that Work is charged (None under measured time)
    charge: Callable[[int, Any], float] | None = None

    def write_json(self, name: str, obj: Any) -> None:
        """Write `obj` as strict JSON to the file `name` of the run directory (partition.json, ...)."""
        (self.out_dir / name).write_text(json.dumps(obj, indent=1, allow_nan=False) + "\n")  # strict JSON


class Protocol:
    """A protocol: `run(node)` is what every node does, as a coroutine; the object is shared by all nodes.

    Subclass it, set `Options` to a dataclass of the protocol's settings (each field becomes a flag
    and a config key; its `help` metadata the flag's help), and register it with `@register(name)`.
    `self.options` holds the options of the run and `self.run_info` what the protocol may know about
    the run (a RunInfo). Set `checkpointable = True` once every node keeps what it carries between
    rounds in `node.carry(...)`; then `--checkpoint-every` works.
    """
    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    # Whether each node keeps what it carries between rounds in node.carry(...) (then --checkpoint-every works).
    checkpointable: ClassVar[bool] = False
    # Whether nodes go at their own pace (no rounds in common): then it runs to --duration, its nodes' rows are
    # their own steps, and the summary's final metrics are each node's last.
    asynchronous: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "checkpoints" in vars(cls):  # the name before 0.2: a plugin that sets it would silently lose resume
            raise TypeError(f"{cls.__name__}: Protocol.checkpoints is now Protocol.checkpointable")

    def __init__(self, options: Any, run_info: RunInfo):
        self.options, self.run_info = adaptive(options), run_info

    async def run(self, node: "Node") -> None:
        """What one node does for the whole run: typically `async for rnd in node.rounds(): ...`."""
        raise NotImplementedError

    async def run_no_rounds(self, node: "Node") -> None:
        """What a node does in a run with --rounds 0 (set up and report, e.g. evaluate once)."""

    def observe(self, rnd: int, snapshots: dict[int, Any]) -> dict[int, dict[str, Any]]:
        """Metrics computed across nodes from their round-`rnd` snapshots (an observer, no messages)."""
        return {}

    def summary(self, records: dict[str, list[dict]]) -> dict[str, Any]:
        """Extra entries for summary.json, derived from what the nodes recorded.

        `records` maps each stream of node.record to its rows, {"round", "node", **row},
        in recording order. The protocol object is shared by every node and is not
        written to during a run, so facts about the whole run come from here.
        """
        return {}

    def shared_summary(self, records: dict[str, list[dict]]) -> dict[str, Any]:
        """Entries for summary.json that a family of protocols shares (its base class's), beside summary()'s."""
        return {}

    def render(self, console, summary: dict[str, Any]) -> None:
        """Print anything worth seeing after the summary table (a rich Console), from summary.json's entries."""


def adaptive(options: Any) -> Any:
    """The options with --timeout auto as the waits nodes make of it (emulator.timeout.Adaptive)."""
    if getattr(options, "timeout", None) == "auto":
        return replace(options, timeout=Adaptive())
    return options


def register(name: str):
    """Class decorator: make a protocol available as `--protocol name`."""
    def decorate(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"protocol {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return decorate


class PluginWarning(UserWarning):
    """An installed package's protocol could not be loaded; the others still run."""


def protocols() -> dict[str, type[Protocol]]:
    """All registered protocols, importing the protocol package's modules and the plugins first."""
    package = importlib.import_module(PROTOCOL_PACKAGE)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{PROTOCOL_PACKAGE}.{module.name}")
    _load_plugins()
    return dict(sorted(_REGISTRY.items()))


@functools.cache  # once per process: a broken plugin is reported once
def _load_plugins() -> None:
    for entry in entry_points(group=PLUGIN_GROUP):
        try:
            cls = entry.load()
            if not (isinstance(cls, type) and issubclass(cls, Protocol)):
                raise TypeError(f"{cls!r} is not a subclass of emulator.protocol.Protocol")
            register(entry.name)(cls)
        except Exception as exc:  # any failure of someone else's code: name it, keep the built-in protocols
            message = f"{type(exc).__name__}: {exc}".splitlines()[0]
            warnings.warn(f"protocol plugin {entry.name!r} ({entry.value}) not loaded: {message}", PluginWarning)
