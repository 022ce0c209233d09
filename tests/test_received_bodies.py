"""What a node accepts from the wire: protocols check bodies with one helper, and a rejected body is a
drop (cause invalid) that never raises out of the node."""
import math

import networkx as nx
import numpy as np
import pytest
import torch

from protocols.common import expects, like
from tests.conftest import emulate

STATE = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}


@pytest.mark.parametrize("body, accepted", [
    ({"state": {"w": torch.ones(2, 3), "b": torch.ones(3)}, "degree": 4}, True),
    ({"state": {"w": torch.ones(2, 3), "b": torch.ones(3)}}, False),  # a key missing
    ({"state": {"w": torch.ones(2, 3), "b": torch.ones(3)}, "degree": 4, "x": 1}, False),  # one too many
    ({"state": {"w": torch.ones(3, 2), "b": torch.ones(3)}, "degree": 4}, False),  # transposed
    ({"state": {"w": torch.ones(2, 3, dtype=torch.float64), "b": torch.ones(3)}, "degree": 4}, False),
    ({"state": {"w": torch.full((2, 3), math.nan), "b": torch.ones(3)}, "degree": 4}, False),
    ({"state": {"w": torch.ones(2, 3), "B": torch.ones(3)}, "degree": 4}, False),  # a renamed key
    ({"state": {"w": torch.ones(2, 3), "b": torch.ones(3)}, "degree": True}, False),  # a bool for an int
    ({"state": {"w": torch.ones(2, 3), "b": torch.ones(3)}, "degree": {}}, False),
    ([1, 2], False), (None, False), (b"x", False),
])
def test_a_body_is_checked_against_the_nodes_own(body, accepted):
    assert like({"state": STATE, "degree": 2})(body) is accepted


def test_optional_fields_numbers_and_arrays():
    check = expects(optional=("samples",), x=np.zeros(4), samples=int, t=float)
    assert check({"x": np.ones(4), "t": 0.5}) and check({"x": np.ones(4), "t": 1, "samples": 3})
    assert not check({"x": np.ones(4), "t": math.inf})
    assert not check({"x": np.array([1.0, math.nan, 0, 0]), "t": 0.5})
    assert not check({"x": np.ones(5), "t": 0.5}) and not check({"x": np.ones(4, np.float32), "t": 0.5})
    assert like([0.5, 1.0])([2.0, 3]) and not like([0.5, 1.0])([2.0]) and not like([0.5, 1.0])([math.nan, 1.0])


def _bodies(sent, valid, log):
    """Node 0 sends each body of `sent` to node 1, which gathers round by round with `valid`."""
    async def run(node):
        async for rnd in node.rounds():
            if node.id == 0:
                node.send(1, "m", sent[rnd])
            else:
                log.append(await node.gather("m", timeout=1.0, valid=valid))
    return run


def test_a_rejected_body_is_an_invalid_drop_on_the_ledger_and_in_the_trace():
    log = []
    sent = [{"x": np.ones(3)}, {"x": np.ones(4)}, {"x": np.full(3, np.inf)}, {"x": np.zeros(3)}]
    emulation = emulate(_bodies(sent, like({"x": np.zeros(3)}), log), nx.path_graph(2), rounds=4, trace=True)
    assert [sorted(heard) for heard in log] == [[0], [], [], [0]]
    totals = emulation.ledger.totals()
    assert totals["dropped_invalid"] == 2 and totals["messages_delivered"] == 2
    assert [row.fate for row in emulation.ledger.trace] == ["delivered", "invalid", "invalid", "delivered"]
    assert [row["msgs_received"] for row in emulation.rows if row["node"] == 1] == [1, 0, 0, 1]


def test_a_check_that_raises_rejects_instead_of_ending_the_node():
    log = []

    def check(body):
        return body["x"] > 0  # a KeyError or TypeError on a hostile body

    emulation = emulate(_bodies([{"x": 1}, {"y": 1}, [], {"x": 2}], check, log), nx.path_graph(2), rounds=4)
    assert [sorted(heard) for heard in log] == [[0], [], [], [0]]
    assert emulation.ledger.totals()["dropped_invalid"] == 2
