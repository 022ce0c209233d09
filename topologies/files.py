"""Topology files: edge lists (plain or CSV with a header) and GraphML.

Edge attributes are kept as written (numbers or strings such as "5ms"); the
emulator interprets units. Nodes are renumbered 0..n-1 in sorted order of their
file labels (numeric order when all labels are integers); when that changes any
node, its file label is kept as node attribute `label`. A GraphML file that
declares directed edges gives an `nx.DiGraph`.
"""
from __future__ import annotations

import csv
import math
import re
from pathlib import Path
from xml.etree.ElementTree import ParseError

import networkx as nx

from .errors import TopologyError
from .values import parse_value

GRAPHML_SUFFIXES = (".graphml", ".xml")
SUFFIXES = (".txt", ".edgelist", ".csv") + GRAPHML_SUFFIXES


def looks_like_path(spec: str) -> bool:
    return ("/" in spec or "\\" in spec or spec.lower().endswith(SUFFIXES)
            or Path(spec).is_file())


def read(path: str) -> nx.Graph:
    graph = _read_graphml(path) if path.lower().endswith(GRAPHML_SUFFIXES) else _read_edgelist(path)
    _check(graph, path)
    graph.graph["source"] = path
    return _renumber(graph)


def _read_graphml(path: str) -> nx.Graph:
    try:
        return nx.read_graphml(path)
    except OSError as exc:
        raise TopologyError(f"cannot read topology file {path}: {exc.strerror or exc}") from None
    except (ParseError, nx.NetworkXError, ValueError, KeyError) as exc:
        # ElementTree's ParseError message already names the line and column.
        raise TopologyError(f"{path}: malformed GraphML: {exc}") from None


def numbered_lines(path: str, what: str = "topology file", error: type[Exception] = TopologyError):
    """The non-blank lines of a UTF-8 text file as (line number, text), `#` comments removed."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise error(f"{path}: not a UTF-8 text file") from None
    lines = [(number, line.split("#", 1)[0].strip()) for number, line in enumerate(text.splitlines(), 1)]
    return [(number, line) for number, line in lines if line]


def _read_edgelist(path: str) -> nx.Graph:
    lines = numbered_lines(path)
    header = [field.strip() for field in next(csv.reader([lines[0][1]]))] if lines else []
    if [field.lower() for field in header[:2]] == ["src", "dst"]:
        rows = _csv_rows(path, header, lines[1:])
    else:
        rows = (_edgelist_row(path, number, line) for number, line in lines)
    graph, first_line = nx.Graph(), {}
    for number, u, v, attrs in rows:
        if u == v:
            raise TopologyError(f"{path}:{number}: self-loop at node {u}")
        # An undirected edge given twice would silently lose one set of attributes.
        earlier = first_line.setdefault(frozenset((u, v)), number)
        if earlier != number:
            raise TopologyError(f"{path}:{number}: edge {u}-{v} already given on line {earlier}")
        graph.add_edge(u, v, **attrs)
    graph.graph["edge_lines"] = first_line  # {file labels} -> line, for errors about an edge's attributes
    return graph


def _edgelist_row(path: str, number: int, line: str):
    fields = re.split(r"[\s,]+", line)
    if len(fields) < 2 or "=" in fields[0] + fields[1]:
        raise TopologyError(f"{path}:{number}: expected 'u v [key=value ...]', got {line!r}")
    attrs = {}
    for field in fields[2:]:
        key, sep, value = field.partition("=")
        if not (key and sep):
            raise TopologyError(f"{path}:{number}: expected key=value, got {field!r}")
        attrs[key] = parse_value(value)
    return number, fields[0], fields[1], attrs


def _csv_rows(path: str, header: list[str], lines):
    for number, line in lines:
        fields = [field.strip() for field in next(csv.reader([line]))]
        if len(fields) != len(header):
            raise TopologyError(f"{path}:{number}: expected {len(header)} fields "
                                f"({','.join(header)}), got {len(fields)}")
        # An empty cell means "use the emulator's default" for that edge.
        attrs = {key: parse_value(value) for key, value in zip(header[2:], fields[2:]) if value}
        yield number, fields[0], fields[1], attrs


def _check(graph: nx.Graph, path: str) -> None:
    if graph.number_of_nodes() == 0:
        raise TopologyError(f"{path}: no edges found")
    if graph.is_multigraph():
        raise TopologyError(f"{path}: parallel edges between the same nodes; keep one edge per pair")
    loop = next(nx.selfloop_edges(graph), None)
    if loop:
        raise TopologyError(f"{path}: self-loop at node {loop[0]}")


def _renumber(graph: nx.Graph) -> nx.Graph:
    """Nodes 0..n-1 in sorted label order, iterated in that order."""
    labels = {u: _as_int(u) for u in graph}
    if None in labels.values() or len(set(labels.values())) < len(labels):
        labels = {u: str(u) for u in graph}
    order = sorted(graph, key=labels.__getitem__)
    ids = {u: i for i, u in enumerate(order)}
    changed = [labels[u] for u in order] != list(range(len(order)))
    out = graph.__class__(**graph.graph)
    out.add_nodes_from((ids[u], {**graph.nodes[u], "label": labels[u]} if changed else graph.nodes[u])
                       for u in order)
    out.add_edges_from((ids[u], ids[v], data) for u, v, data in graph.edges(data=True))
    return out


def _as_instant(label: str) -> float | None:
    """A schedule file's t: finite seconds, or None."""
    try:
        value = float(label)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _as_int(label) -> int | None:
    try:
        return int(label)
    except ValueError:
        return None


SCHEDULE_HEADERS = {("round", "src", "dst"): False, ("round", "sender", "receiver"): True,
                    ("t", "src", "dst"): False, ("t", "sender", "receiver"): True}


def read_schedule(path: str) -> tuple[dict, int, int, bool]:
    """A topology schedule file: CSV, one edge per row, rounds 0, 1, ... in any order, or instants.

    Header `round,src,dst`: undirected edges; `round,sender,receiver`: directed ones; `t,...`
    instead of `round,...`: the graph from each instant t (emulated seconds) to the next, the
    first at t = 0. Returns (the graph of each round or instant that has rows, the period
    max(round) + 1 (0 for instants), n = max(node) + 1, directed); a round without rows has no
    edges. Lines may carry `#` comments.
    """
    lines = numbered_lines(path, "schedule file")
    header = tuple(field.strip().lower() for field in lines[0][1].split(",")) if lines else ()
    if header not in SCHEDULE_HEADERS:
        raise TopologyError(f"{path}: expected a header 'round,src,dst' (undirected) or "
                            f"'round,sender,receiver' (directed), or 't,...' for instants in emulated seconds")
    directed, timed = SCHEDULE_HEADERS[header], header[0] == "t"
    edges = [_schedule_row(path, number, line, timed) for number, line in lines[1:]]
    if not edges:
        raise TopologyError(f"{path}: no edges found")
    n = 1 + max(max(u, v) for _, u, v in edges)
    graphs: dict = {}
    for key, u, v in edges:
        if key not in graphs:
            graphs[key] = empty_round(path, key, n, directed)
        graphs[key].add_edge(u, v)
    if timed and 0.0 not in graphs:
        raise TopologyError(f"{path}: the first instant must be t = 0 (the graph the run starts on)")
    return graphs, 0 if timed else 1 + max(graphs), n, directed


def empty_round(path: str, rnd: int, n: int, directed: bool) -> nx.Graph:
    """Round `rnd` of a schedule file before its edges: n nodes, no edges."""
    graph = nx.DiGraph() if directed else nx.Graph()
    graph.add_nodes_from(range(n))
    graph.graph["name"] = f"{path} (round {rnd})"
    return graph


def _schedule_row(path: str, number: int, line: str, timed: bool = False) -> tuple:
    fields = [field.strip() for field in line.split(",")]
    values = [_as_instant(fields[0]) if timed and fields else None, *map(_as_int, fields[1:])] if timed else \
        [_as_int(field) for field in fields]
    if len(fields) != 3 or None in values or min(values) < 0:
        first = "t" if timed else "round"
        raise TopologyError(f"{path}:{number}: expected '{first},node,node' with nodes whole numbers >= 0"
                            f"{' and t seconds >= 0' if timed else ' and rounds too'}, got {line!r}")
    rnd, u, v = values
    if u == v:
        raise TopologyError(f"{path}:{number}: self-loop at node {u}")
    return rnd, u, v
