"""Every random stream comes from seeds.stream(seed, purpose, *key): distinct purposes and keys never share one."""
import itertools

import networkx as nx
import numpy as np

from emulator.seeds import Seeds, stream
from tests.conftest import emulate

PURPOSES = ("node.random", "node.numpy", "node.torch", "link", "wire", "churn", "crash", "churn.immune",
            "link.failures", "uplink", "downlink", "compute.speed", "topology", "partition", "model.assign",
            "model.init", "gossip.initial", "meta-l2c.encoder")


def _draw(seed, purpose, *key):
    return tuple(stream(seed, purpose, *key).generate_state(4))


def test_streams_for_different_purposes_nodes_and_seeds_differ():
    keys = [(), (0,), (1,), (0, 0), (0, 1), (1, 0), (199,)]
    draws = [_draw(seed, purpose, *key) for seed in (0, 1, 2**40) for purpose in PURPOSES for key in keys]
    assert len(set(draws)) == len(draws)


def test_a_stream_depends_only_on_seed_purpose_and_key():
    assert _draw(3, "churn", 5) == _draw(3, "churn", 5)
    seeds = Seeds(3)
    assert seeds.numpy("churn", 5).random(3).tolist() == Seeds(3).numpy("churn", 5).random(3).tolist()
    assert seeds.python("link", 0, 1).random() == Seeds(3).python("link", 0, 1).random()
    assert seeds.integer("node.torch", 2) == Seeds(3).integer("node.torch", 2) < 2**63


def test_the_old_collision_is_gone():
    # Once torch streams were seed*1_000_003+node and model init seed*100003+node: at seed 0 both gave node i's id.
    s = Seeds(0)
    assert len({s.integer("node.torch", i) for i in range(4)} | {s.integer("model.init", i) for i in range(4)}) == 8


def test_node_generators_differ_between_nodes_and_from_the_scenario():
    draws = {}

    async def run(node):
        draws[node.id] = (node.np_rng.random(4).tolist(), node.rng.random())

    emulate(run, nx.empty_graph(50))
    assert len({tuple(numpy) for numpy, _ in draws.values()}) == len({r for _, r in draws.values()}) == 50
    crash = Seeds(0).numpy("crash").random(4).tolist()
    assert all(numpy != crash for numpy, _ in draws.values())
    assert not np.allclose(*itertools.islice((numpy for numpy, _ in draws.values()), 2))
