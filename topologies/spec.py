"""`build`: a topology spec (`name:key=value,...` or a file path) to a graph, and `describe`."""
from __future__ import annotations

import inspect
import typing
import warnings

import networkx as nx

from emulator import units

from . import files
from .errors import TopologyError, TopologyWarning
from .graphs import NAMES, TOPOLOGIES
from .values import parse_value


def build(spec: str, n: int | None, seed: int) -> nx.Graph:
    """The graph for `spec`: nodes 0..n-1, no self-loops; undirected unless a GraphML file says directed.

    Warns with TopologyWarning when the graph is disconnected; raises TopologyError
    when it cannot be built.
    """
    spec = spec.strip()
    graph = _from_file(spec, n) if files.looks_like_path(spec) else _from_name(spec, n, seed)
    graph.graph["name"] = spec
    connectivity = _connectivity(graph)
    if connectivity != "connected":
        warnings.warn(f"topology {spec} is {connectivity}", TopologyWarning, stacklevel=2)
    return graph


def parse(spec: str) -> tuple[str, dict[str, int | float | str]]:
    """'ws:k=4,p=0.1' -> ('ws', {'k': 4, 'p': 0.1})."""
    try:
        parsed = units.read_spec(spec)
    except units.SpecError as exc:
        raise _bad_parameter(exc.item, spec) from None
    params = {}
    for key, value in parsed.items:
        if not value:
            raise _bad_parameter(f"{key}=", spec)
        if key in params:
            raise TopologyError(f"parameter {key!r} given twice in {spec!r}")
        params[key] = parse_value(value)
    return parsed.name.lower(), params


def _bad_parameter(item: str, spec: str) -> TopologyError:
    return TopologyError(f"bad parameter {item!r} in {spec!r}: expected key=value")


def describe(graph: nx.Graph) -> str:
    """One line, e.g. 'ring: 16 nodes, 16 edges, degree 2..2, connected'."""
    degrees = [d for _, d in (graph.out_degree if graph.is_directed() else graph.degree)]
    kind = "directed, " if graph.is_directed() else ""
    return (f"{graph.graph.get('name', 'graph')}: {kind}{graph.number_of_nodes()} nodes, "
            f"{graph.number_of_edges()} edges, {'out-' if kind else ''}degree "
            f"{min(degrees, default=0)}..{max(degrees, default=0)}, {_connectivity(graph)}")


def _from_file(path: str, n: int | None) -> nx.Graph:
    graph = files.read(path)
    if n is not None and graph.number_of_nodes() != n:
        raise TopologyError(f"{path} has {graph.number_of_nodes()} nodes but n={n}; "
                            f"leave n unset to use the file's node count")
    return graph


def _from_name(spec: str, n: int | None, seed: int) -> nx.Graph:
    name, params = parse(spec)
    function = TOPOLOGIES.get(name)
    if function is None:
        raise TopologyError(f"unknown topology {name!r}; choose one of {', '.join(NAMES)}, "
                            f"or give a path to an edge-list or GraphML file")
    if n is None or n < 1:
        raise TopologyError(f"topology {name!r} needs a number of nodes n >= 1, got {n}")
    parameters = _parameters(function)
    kwargs = {key: _coerce(name, key, value, parameters) for key, value in params.items()}
    if "seed" in inspect.signature(function).parameters:
        kwargs["seed"] = seed
    return function(n, **kwargs)


def _parameters(function) -> dict[str, type]:
    """The user-settable parameters of a topology function and their types (int or float)."""
    hints = typing.get_type_hints(function)
    return {key: float if float in (hint, *typing.get_args(hint)) else int
            for key, hint in hints.items() if key not in ("n", "seed", "return")}


def _coerce(name: str, key: str, value, parameters: dict[str, type]):
    if key not in parameters:
        valid = f"valid parameters: {', '.join(parameters)}" if parameters else f"{name!r} takes none"
        raise TopologyError(f"unknown parameter {key!r} for {name!r}; {valid}")
    kind = parameters[key]
    # int is acceptable where a float is expected (p=1), not the other way round.
    if isinstance(value, str) or (kind is int and not isinstance(value, int)):
        raise TopologyError(f"{name}: {key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def _connectivity(graph: nx.Graph) -> str:
    """'connected', 'weakly connected ...' (directed only) or 'disconnected (k components)'."""
    if graph.number_of_nodes() == 0:
        return "connected"
    if not graph.is_directed():
        components = nx.number_connected_components(graph)
    elif nx.is_strongly_connected(graph):
        return "connected"
    else:
        components = nx.number_weakly_connected_components(graph)
        if components == 1:
            return "weakly connected (some nodes cannot reach others)"
    return "connected" if components == 1 else f"disconnected ({components} components)"
