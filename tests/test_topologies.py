import warnings

import networkx as nx
import pytest

import topologies
from topologies import TopologyError, TopologyWarning, build, mixing_weights


def edges(graph):
    return {frozenset(edge) for edge in graph.edges}


def degrees(graph):
    return sorted(d for _, d in graph.degree)


# -- named topologies --------------------------------------------------------

@pytest.mark.parametrize("spec, n, num_edges, degree_set", [
    ("mesh", 8, 28, {7}),
    ("ring", 16, 16, {2}),
    ("line", 5, 4, {1, 2}),
    ("star", 9, 8, {1, 8}),
    ("grid", 12, 17, {2, 3, 4}),          # 3 x 4
    ("torus", 16, 32, {4}),
    ("regular:d=4", 10, 20, {4}),
    ("regular", 10, 20, {4}),             # d defaults to 4
    ("exponential", 16, 56, {7}),         # offsets 1, 2, 4 give 2 peers each, 8 gives 1
    ("ws:k=4,p=0.1", 16, 32, None),
    ("ba:m=2", 16, 28, None),             # m(n - m) for networkx's star-seeded BA
])
def test_named_topology_shape(spec, n, num_edges, degree_set):
    graph = build(spec, n, seed=1)
    assert type(graph) is nx.Graph
    assert list(graph.nodes) == list(range(n))
    assert graph.number_of_edges() == num_edges
    assert nx.number_of_selfloops(graph) == 0
    if degree_set is not None:
        assert set(degrees(graph)) == degree_set


def test_every_name_builds():
    assert set(topologies.NAMES) == {"mesh", "ring", "line", "star", "grid", "torus",
                                     "regular", "er", "ws", "ba", "exponential"}
    for name in topologies.NAMES:
        assert build(name, 16, seed=0).number_of_nodes() == 16


def test_star_hub_is_node_0():
    graph = build("star", 6, seed=0)
    assert graph.degree[0] == 5
    assert all(graph.degree[i] == 1 for i in range(1, 6))


def test_grid_is_most_square_and_row_major():
    assert set(build("grid", 12, 0)[0]) == {1, 4}         # 3 rows x 4 cols
    assert set(build("grid:rows=2", 12, 0)[0]) == {1, 6}  # 2 rows x 6 cols
    assert set(build("grid:rows=1", 5, 0)[2]) == {1, 3}   # a line


@pytest.mark.parametrize("n, neighbours_of_0", [
    (16, {1, 2, 4, 8, 15, 14, 12}),
    (9, {1, 2, 4, 8, 7, 5}),      # n-1 = 8: offset 8 still included, and 8 == -1 mod 9
    (8, {1, 2, 4, 7, 6}),         # n-1 = 7: offsets 1, 2, 4 only
])
def test_exponential_neighbours(n, neighbours_of_0):
    graph = build("exponential", n, 0)
    assert set(graph[0]) == neighbours_of_0
    assert set(degrees(graph)) == {len(neighbours_of_0)}


@pytest.mark.parametrize("spec", ["regular:d=4", "er:p=0.3", "ws", "ba"])
def test_random_topologies_are_deterministic(spec):
    assert edges(build(spec, 20, seed=7)) == edges(build(spec, 20, seed=7))


@pytest.mark.parametrize("spec", ["regular:d=4", "er:p=0.3"])
def test_random_topologies_depend_on_seed(spec):
    assert edges(build(spec, 20, seed=7)) != edges(build(spec, 20, seed=8))


# -- spec parsing and errors ---------------------------------------------------

def test_parse_types():
    assert topologies.parse("ws:k=4,p=0.1") == ("ws", {"k": 4, "p": 0.1})
    assert topologies.parse(" Ring ") == ("ring", {})
    assert topologies.parse("x:a=b") == ("x", {"a": "b"})


def test_int_accepted_for_float_parameter():
    assert build("er:p=1", 5, 0).number_of_edges() == 10


@pytest.mark.parametrize("spec, n, fragment", [
    ("rnig", 8, "'rnig'"),
    ("regular:q=1", 8, "'q'"),
    ("ring:x=1", 8, "'x'"),
    ("regular:d=3", 9, "n*d must be even"),
    ("regular:d=8", 8, "d=8"),
    ("regular:d=2.5", 8, "2.5"),
    ("er:p=abc", 8, "'abc'"),
    ("er:p=1.5", 8, "p=1.5"),
    ("ws:k=3", 10, "k=3"),
    ("ba:m=10", 10, "m=10"),
    ("grid:rows=3", 16, "rows=3"),
    ("grid", 7, "n=7"),
    ("torus:rows=1", 16, "torus"),
    ("ring", 2, "n=2"),
    ("ring", None, "ring"),
    ("regular:d", 8, "'d'"),
    ("regular:d=4,d=4", 8, "twice"),
])
def test_bad_specs_raise(spec, n, fragment):
    with pytest.raises(TopologyError) as info:
        build(spec, n, seed=0)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_name_lists_choices():
    with pytest.raises(TopologyError, match="mesh, ring, line"):
        build("hypercube", 8, 0)


def test_topology_error_is_value_error():
    assert issubclass(TopologyError, ValueError)


# -- files -----------------------------------------------------------------------

def test_edge_list_with_attributes(tmp_path):
    path = tmp_path / "net.txt"
    path.write_text("# a triangle\n"
                    "0 1 latency=5ms loss=0.01\n"
                    "1,2,bandwidth=10Mbps,queue=4  # inline comment\n"
                    "\n"
                    "2 0\n")
    graph = build(str(path), None, 0)
    assert list(graph.nodes) == [0, 1, 2]
    assert graph.edges[0, 1] == {"latency": "5ms", "loss": 0.01}
    assert graph.edges[1, 2] == {"bandwidth": "10Mbps", "queue": 4}
    assert graph.edges[2, 0] == {}
    assert "label" not in graph.nodes[0]


def test_csv_with_header(tmp_path):
    path = tmp_path / "net.csv"
    path.write_text("src,dst,latency,bandwidth,loss\n0,1,5ms,,0.1\n1,2,1ms,1Gbps,\n")
    graph = build(str(path), 3, 0)
    assert graph.edges[0, 1] == {"latency": "5ms", "loss": 0.1}
    assert graph.edges[1, 2] == {"latency": "1ms", "bandwidth": "1Gbps"}


def test_csv_wrong_field_count_names_line(tmp_path):
    path = tmp_path / "net.csv"
    path.write_text("src,dst,latency\n0,1,5ms\n1,2\n")
    with pytest.raises(TopologyError, match=r"net\.csv:3:"):
        build(str(path), None, 0)


def test_graphml_round_trip(tmp_path):
    original = nx.Graph()
    original.add_edge(0, 1, latency="5ms", loss=0.01, bandwidth=10_000_000)
    original.add_edge(1, 2, latency="2ms")
    original.add_node(3)
    original.add_edge(2, 3)
    path = tmp_path / "net.graphml"
    nx.write_graphml(original, path)
    graph = build(str(path), 4, 0)
    assert type(graph) is nx.Graph
    assert list(graph.nodes) == [0, 1, 2, 3]
    assert sorted(graph.edges(data=True)) == sorted(original.edges(data=True))


def test_directed_graphml_gives_digraph(tmp_path):
    original = nx.DiGraph([(0, 1), (1, 2), (2, 0)])
    path = tmp_path / "net.xml"
    nx.write_graphml(original, path)
    graph = build(str(path), None, 0)
    assert graph.is_directed()
    assert set(graph.edges) == {(0, 1), (1, 2), (2, 0)}


def test_file_nodes_relabelled_in_sorted_order(tmp_path):
    path = tmp_path / "net.edgelist"
    path.write_text("10 2\n2 7\n")           # numeric order 2, 7, 10 (string order would be 10, 2, 7)
    graph = build(str(path), None, 0)
    assert list(graph.nodes) == [0, 1, 2]
    assert [graph.nodes[i]["label"] for i in range(3)] == [2, 7, 10]
    assert edges(graph) == {frozenset({2, 0}), frozenset({0, 1})}


def test_string_labels_relabelled(tmp_path):
    path = tmp_path / "net.txt"
    path.write_text("bob alice latency=1ms\n")
    graph = build(str(path), None, 0)
    assert [graph.nodes[i]["label"] for i in range(2)] == ["alice", "bob"]
    assert graph.edges[0, 1] == {"latency": "1ms"}


def test_existing_file_without_suffix_is_read(tmp_path, monkeypatch):
    (tmp_path / "mynet").write_text("0 1\n")
    monkeypatch.chdir(tmp_path)
    assert build("mynet", None, 0).number_of_edges() == 1


def test_file_node_count_mismatch(tmp_path):
    path = tmp_path / "net.txt"
    path.write_text("0 1\n1 2\n")
    with pytest.raises(TopologyError, match="3 nodes but n=5"):
        build(str(path), 5, 0)


def test_missing_file_names_path(tmp_path):
    path = tmp_path / "absent.txt"
    with pytest.raises(TopologyError, match="absent.txt"):
        build(str(path), None, 0)


@pytest.mark.parametrize("text, fragment", [
    ("0 1\n0 2\n1 2 latency\n", ":3:"),     # attribute without '='
    ("0 1\n\n# gap\n7\n", ":4:"),           # one node only
    ("0 1\n1 1\n", ":2: self-loop"),
    ("0 1\n1 0 latency=1ms\n", ":2: edge 1-0 already given on line 1"),
])
def test_malformed_edge_list_names_line(tmp_path, text, fragment):
    path = tmp_path / "net.txt"
    path.write_text(text)
    with pytest.raises(TopologyError) as info:
        build(str(path), None, 0)
    assert str(path) + fragment in str(info.value)


def test_malformed_graphml(tmp_path):
    path = tmp_path / "net.graphml"
    path.write_text("<graphml><graph>\n<node id='a'>\n</graph>")
    with pytest.raises(TopologyError, match="net.graphml.*line 3"):
        build(str(path), None, 0)


def test_empty_file(tmp_path):
    path = tmp_path / "net.txt"
    path.write_text("# nothing\n")
    with pytest.raises(TopologyError, match="no edges"):
        build(str(path), None, 0)


# -- connectivity ------------------------------------------------------------------

def test_disconnected_graph_warns(tmp_path):
    path = tmp_path / "net.txt"
    path.write_text("0 1\n2 3\n4 5\n")
    with pytest.warns(TopologyWarning, match="3 components"):
        graph = build(str(path), None, 0)
    assert graph.number_of_nodes() == 6


def test_connected_graph_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build("ring", 8, 0)


def test_describe():
    assert topologies.describe(build("ring", 16, 0)) == "ring: 16 nodes, 16 edges, degree 2..2, connected"
    with pytest.warns(TopologyWarning):
        graph = build("er:p=0", 4, 0)
    assert topologies.describe(graph) == "er:p=0: 4 nodes, 0 edges, degree 0..0, disconnected (4 components)"


# -- mixing weights ------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["star", "ba", "er:p=0.4", "grid", "line"])
def test_mh_is_symmetric_and_doubly_stochastic(spec):
    graph = build(spec, 12, seed=3)
    weights = mixing_weights(graph, "mh")
    for i, row in weights.items():
        assert set(row) == set(graph[i]) | {i}
        assert sum(row.values()) == pytest.approx(1.0)
        assert all(w >= 0 for w in row.values())
        for j, w in row.items():
            assert weights[j][i] == pytest.approx(w)


def test_mh_on_star_matches_formula():
    weights = mixing_weights(build("star", 5, 0))          # hub degree 4, leaves degree 1
    assert topologies.metropolis_hastings(1, 4) == pytest.approx(0.2)
    assert weights[0] == pytest.approx({0: 0.2, 1: 0.2, 2: 0.2, 3: 0.2, 4: 0.2})
    assert weights[3] == pytest.approx({0: 0.2, 3: 0.8})


def test_uniform_weights():
    ring = mixing_weights(build("ring", 6, 0), "uniform")
    assert ring[0] == pytest.approx({5: 1 / 3, 0: 1 / 3, 1: 1 / 3})
    star = mixing_weights(build("star", 5, 0), "uniform")
    assert star[0] == pytest.approx({i: 0.2 for i in range(5)})
    assert star[2] == pytest.approx({0: 0.5, 2: 0.5})


def test_uniform_weights_on_directed_graph_use_in_neighbours():
    weights = mixing_weights(nx.DiGraph([(0, 1), (2, 1)]), "uniform")
    assert weights[1] == pytest.approx({0: 1 / 3, 1: 1 / 3, 2: 1 / 3})
    assert weights[0] == {0: 1.0}


def test_mixing_errors():
    with pytest.raises(TopologyError, match="'nope'"):
        mixing_weights(build("ring", 4, 0), "nope")
    with pytest.raises(TopologyError, match="undirected"):
        mixing_weights(nx.DiGraph([(0, 1)]), "mh")


# -- time-varying helpers ---------------------------------------------------------------

@pytest.mark.parametrize("t", range(6))
def test_one_peer_exponential_n8(t):
    graph = topologies.one_peer_exponential(8, t)
    offset = [1, 2, 4][t % 3]
    assert list(graph.nodes) == list(range(8))
    assert edges(graph) == {frozenset({i, (i + offset) % 8}) for i in range(8)}
    # i + 4 and i - 4 coincide: that round is a perfect matching.
    assert set(degrees(graph)) == ({1} if offset == 4 else {2})


def test_one_peer_exponential_non_power_of_two():
    # n = 12: floor(log2 12) = 3, so offsets cycle 1, 2, 4.
    offsets = [{abs(u - v) % 12 for u, v in topologies.one_peer_exponential(12, t).edges} for t in range(4)]
    assert offsets == [{1, 11}, {2, 10}, {4, 8}, {1, 11}]


def test_resample_changes_every_period():
    graphs = [edges(topologies.resample("regular:d=3", 12, 5, r, every=3)) for r in range(7)]
    assert graphs[0] == graphs[1] == graphs[2]
    assert graphs[3] == graphs[4] == graphs[5]
    assert graphs[0] != graphs[3] != graphs[6]
    assert graphs[6] == edges(topologies.resample("regular:d=3", 12, 5, 8, every=3))
    assert graphs[0] != edges(topologies.resample("regular:d=3", 12, 6, 0, every=3))


def test_resample_rejects_zero_period():
    with pytest.raises(TopologyError, match="every"):
        topologies.resample("ring", 4, 0, 0, every=0)
