"""Named topologies: one small function each, n nodes labelled 0..n-1, undirected, no self-loops.

Random ones take `seed` and are deterministic for it. Parameters are typed so that
`build` can check and coerce the values of a `name:key=value` spec against them.
"""
from __future__ import annotations

import networkx as nx

from .errors import TopologyError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise TopologyError(message)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _grid_shape(name: str, n: int, rows: int | None) -> tuple[int, int]:
    """rows x cols with rows * cols = n; by default the most square such shape."""
    if rows is None:
        rows = max(d for d in _divisors(n) if d * d <= n)
        _require(rows > 1, f"{name}: n={n} has no rows x cols shape with both sides > 1; pick another n")
    _require(rows >= 1 and n % rows == 0,
             f"{name}: rows={rows} does not divide n={n}; choose rows from {_divisors(n)}")
    return rows, n // rows


def _integer_nodes(graph: nx.Graph) -> nx.Graph:
    # 2-D generators label nodes (row, col); row-major order gives node r*cols + c.
    return nx.convert_node_labels_to_integers(graph, ordering="sorted")


def mesh(n: int) -> nx.Graph:
    return nx.complete_graph(n)


def ring(n: int) -> nx.Graph:
    # Fewer than 3 nodes cannot form a cycle without a self-loop or a doubled edge.
    _require(n >= 3, f"ring: needs n >= 3, got n={n}")
    return nx.cycle_graph(n)


def line(n: int) -> nx.Graph:
    return nx.path_graph(n)


def star(n: int) -> nx.Graph:
    """Node 0 is the hub."""
    _require(n >= 2, f"star: needs n >= 2, got n={n}")
    return nx.star_graph(n - 1)


def grid(n: int, rows: int | None = None) -> nx.Graph:
    """2-D grid, node r*cols + c at row r, column c."""
    return _integer_nodes(nx.grid_2d_graph(*_grid_shape("grid", n, rows)))


def torus(n: int, rows: int | None = None) -> nx.Graph:
    """2-D periodic grid: 4-regular when both sides are >= 3, 3-regular along a side of 2."""
    shape = _grid_shape("torus", n, rows)
    _require(min(shape) >= 2, f"torus: a side of 1 is a ring; use 'ring' or choose rows from {_divisors(n)[1:-1]}")
    return _integer_nodes(nx.grid_2d_graph(*shape, periodic=True))


def regular(n: int, d: int = 4, seed: int = 0) -> nx.Graph:
    """Random d-regular graph."""
    _require(0 <= d < n, f"regular: needs 0 <= d < n, got d={d}, n={n}")
    _require(n * d % 2 == 0, f"regular: n*d must be even, got n={n}, d={d}")
    return nx.random_regular_graph(d, n, seed=seed)


def er(n: int, p: float = 0.3, seed: int = 0) -> nx.Graph:
    """Erdős–Rényi G(n, p)."""
    _require(0.0 <= p <= 1.0, f"er: p must be in [0, 1], got p={p}")
    return nx.gnp_random_graph(n, p, seed=seed)


def ws(n: int, k: int = 4, p: float = 0.1, seed: int = 0) -> nx.Graph:
    """Watts–Strogatz small world, retried until connected."""
    # networkx silently uses k//2 neighbours per side, so an odd k would mean k-1.
    _require(2 <= k < n and k % 2 == 0, f"ws: k must be even with 2 <= k < n, got k={k}, n={n}")
    _require(0.0 <= p <= 1.0, f"ws: p must be in [0, 1], got p={p}")
    try:
        return nx.connected_watts_strogatz_graph(n, k, p, seed=seed)
    except nx.NetworkXError as exc:
        raise TopologyError(f"ws: {exc} (n={n}, k={k}, p={p}); try a smaller p or larger k") from None


def ba(n: int, m: int = 2, seed: int = 0) -> nx.Graph:
    """Barabási–Albert preferential attachment, m edges per new node."""
    _require(1 <= m < n, f"ba: needs 1 <= m < n, got m={m}, n={n}")
    return nx.barabasi_albert_graph(n, m, seed=seed)


def exponential(n: int) -> nx.Graph:
    """Static exponential graph: node i linked to i ± 2^k mod n for k = 0..floor(log2(n-1))."""
    _require(n >= 2, f"exponential: needs n >= 2, got n={n}")
    # floor(log2(n-1)) exactly, without floating point.
    return nx.circulant_graph(n, [2 ** k for k in range((n - 1).bit_length())])


TOPOLOGIES = {f.__name__: f for f in (mesh, ring, line, star, grid, torus, regular, er, ws, ba, exponential)}
NAMES = tuple(TOPOLOGIES)
