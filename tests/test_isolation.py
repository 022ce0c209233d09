"""Nodes share nothing but messages: a run leaves the protocol object exactly as it was set up."""
import dataclasses
import hashlib
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
import torch
from rich.console import Console

from emulator.compute import ThreadExecutor
from p2p_emulator.build import build_emulation, build_topology
from p2p_emulator.settings import resolve
from emulator.emulation import Emulation
from emulator.node import Node
from emulator.protocol import RunInfo, protocols
from emulator.seeds import Seeds
from protocols.fedavg import ServerAndClients

REGISTRY = protocols()


def fingerprint(value, seen=None):
    """A comparable digest of everything reachable from `value` (tensors by content)."""
    seen = set() if seen is None else seen
    if isinstance(value, (str, int, float, bool, type(None), Path)):
        return repr(value)
    if id(value) in seen or isinstance(value, Console):
        return type(value).__name__
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        digest = hashlib.sha1(value.detach().cpu().numpy().tobytes()).hexdigest()
        return ("tensor", str(value.dtype), tuple(value.shape), digest)
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, hashlib.sha1(value.tobytes()).hexdigest())
    if isinstance(value, nx.Graph):
        return ("graph", sorted(value.nodes(data=True), key=repr), sorted(value.edges(data=True), key=repr))
    if isinstance(value, torch.nn.Module):
        return ("module", fingerprint(value.state_dict(), seen))
    if isinstance(value, dict):
        return ("dict", sorted((repr(k), fingerprint(v, seen)) for k, v in value.items()))
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [fingerprint(v, seen) for v in value]
        return (type(value).__name__, sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items)
    if hasattr(value, "__dict__") and not callable(value):
        return (type(value).__name__, fingerprint(vars(value), seen))
    if dataclasses.is_dataclass(value):  # field by field: a temporary dict's id could be reused by a later object
        return (type(value).__name__, [(f.name, fingerprint(getattr(value, f.name), seen))
                                       for f in dataclasses.fields(value)])
    return type(value).__name__


def _settings(name: str) -> dict:
    fields = {f.name for f in dataclasses.fields(REGISTRY[name].Options)}
    settings = {"protocol": name, "nodes": 4, "rounds": 2, "quiet": True, "no_plots": True}
    if issubclass(REGISTRY[name], ServerAndClients):  # a server and four clients (two clusters of two)
        settings.update(topology="star", nodes=5)
    if REGISTRY[name].asynchronous:  # it runs to a horizon: with --rounds too, whichever comes first
        settings["duration"] = 5.0
    if "model" in fields and name not in ("mapl", "mapl+"):
        settings["model"] = "mlp:hidden=16"
    if "local_epochs" in fields:
        settings["local_epochs"] = 1
    return settings


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_a_run_leaves_the_protocol_object_unchanged(tmp_path, name):
    config, options = resolve(_settings(name), REGISTRY)
    graph, _ = build_topology(config)
    run_info = RunInfo(graph.number_of_nodes(), config.rounds, Seeds(config.seed), graph, "cpu", tmp_path,
                       duration=config.duration)
    protocol = REGISTRY[name](options, run_info)
    before = fingerprint(vars(protocol))
    with ThreadExecutor(2) as executor:
        emulation = build_emulation(config, graph, protocol, executor)
        rows = emulation.run()
    assert {row["round"] for row in rows} == {0, 1}
    assert fingerprint(vars(protocol)) == before


def test_the_fingerprint_sees_a_write_into_shared_state():
    state = {"rows": {0: [0.5, 0.5]}, "w": torch.zeros(2)}
    before = fingerprint(state)
    state["rows"][1] = [1.0]
    assert fingerprint(state) != before
    state = {"w": torch.zeros(2)}
    before = fingerprint(state)
    state["w"][0] = 1.0
    assert fingerprint(state) != before


def test_a_node_holds_no_other_node_and_not_the_emulation():
    graph = nx.path_graph(3)
    config, options = resolve({"protocol": "gossip", "nodes": 3, "rounds": 1}, REGISTRY)
    run_info = RunInfo(3, 1, Seeds(0), graph, "cpu", Path("."))
    with ThreadExecutor(1) as executor:
        emulation = build_emulation(config, graph, REGISTRY["gossip"](options, run_info), executor)
    for node in emulation.nodes:
        reachable = [getattr(node, name) for name in Node.__slots__ if name != "__weakref__"]
        reachable += [getattr(held, f.name) for held in reachable if dataclasses.is_dataclass(held)
                      for f in dataclasses.fields(held)]
        assert not any(isinstance(value, (Node, Emulation)) for value in reachable)
