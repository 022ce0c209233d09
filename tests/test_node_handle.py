"""A protocol's node is a handle with the node API only: the network, the mailboxes and other nodes are not
reachable through it, not even by underscore attributes."""
import networkx as nx

from emulator.node import METHODS, PROPERTIES
from tests.conftest import emulate

ESCAPES = {
    "read another node's mailbox": lambda node: node._network.mailboxes[1].messages,
    "read it through the context": lambda node: node._context.network.mailboxes[1],
    "reach the mailbox attribute": lambda node: node._mailbox,
    "list all nodes": lambda node: node._context.recorder,
    "send as another node": lambda node: node._network.send(1, 2, "forged", 0, "hi"),
    "the instance dictionary": lambda node: node.__dict__,
    "vars()": lambda node: vars(node),
    "plant an attribute": lambda node: setattr(node, "_network", None),
}


def test_each_escape_from_the_node_handle_fails():
    outcomes, heard = {}, []

    async def run(node):
        if node.id == 0:
            for name, escape in ESCAPES.items():
                try:
                    escape(node)
                    outcomes[name] = "worked"
                except (AttributeError, TypeError):
                    outcomes[name] = "refused"
            node.send(1, "real", node.id)
        elif node.id == 2:
            while (message := await node.recv(timeout=1.0)) is not None:
                heard.append(message.kind)

    emulation = emulate(run, nx.path_graph(3))
    assert outcomes == dict.fromkeys(ESCAPES, "refused")
    assert heard == [] and emulation.ledger.totals()["messages_total"] == 1  # no forged message went out


def test_the_handle_offers_the_node_api_and_nothing_else():
    seen = {}

    async def run(node):
        seen[node.id] = ({name for name in dir(node) if not name.startswith("__")}, repr(node), node.id,
                         node.neighbours, node.num_nodes)

    emulate(run, nx.path_graph(3))
    names, text, ident, neighbours, n = seen[1]
    assert names == set(PROPERTIES) | set(METHODS)
    assert (text, ident, neighbours, n) == ("Node(1, round=0)", 1, [0, 2], 3)


def test_a_finished_run_leaves_no_node_behind():
    import gc
    import weakref


    async def run(node):
        return None

    emulation = emulate(run, nx.path_graph(3))
    refs = [weakref.ref(node) for node in emulation.nodes]
    del emulation
    gc.collect()
    assert all(ref() is None for ref in refs)  # the handles' table let them go
