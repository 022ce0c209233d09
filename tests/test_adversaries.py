"""Adversarial senders and robust aggregation."""
import math

import networkx as nx
import numpy as np
import pytest
import torch

from emulator import wire
from protocols.common import like
from tests.conftest import emulate
from p2p_emulator.workloads.training import aggregate

BODY = {"x": np.arange(1.0, 4.0), "degree": 2, "tags": ["a"]}


def _two_rounds(attack: str, log: list, valid=None):
    """Every node sends BODY to every neighbour for two rounds and logs what it takes."""
    async def run(node):
        async for _ in node.rounds():
            node.broadcast("m", BODY)
            heard = await node.gather("m", timeout=1.0, valid=valid)
            log.extend((node.round, message.src, message.body, message.size) for message in heard.values())
    emulation = emulate(run, nx.complete_graph(4), rounds=2, adversaries=f"fraction=0.5,kind={attack}")
    bad = emulation.network.adversaries.nodes
    assert len(bad) == 2  # half of 4: with none, every check below of what they send would hold vacuously
    return bad, emulation


# 3 of 10 nodes as today's code draws them from seeds 0, 1 and 2 (numpy's choice on the "adversaries" stream)
DRAWN = {0: {1, 2, 6}, 1: {0, 2, 6}, 2: {1, 3, 4}}


@pytest.mark.parametrize("seed", sorted(DRAWN))
def test_the_adversaries_are_drawn_from_the_seed(seed):
    chosen = [emulate(lambda node: _noop(), nx.complete_graph(10), seed=seed,
                      adversaries="fraction=0.3,kind=nan").network.adversaries.nodes for _ in range(2)]
    assert chosen == [DRAWN[seed]] * 2  # the same seed, the same 3 nodes; not the first 3, not a fixed set
    assert len({frozenset(nodes) for nodes in DRAWN.values()}) == len(DRAWN)  # each seed its own set


async def _noop():
    return None


def test_signflip_negates_the_floats_and_leaves_the_rest():
    log = []
    bad, _ = _two_rounds("signflip", log)
    assert len(log) == 2 * 4 * 3  # every message of both rounds was taken
    for _, src, body, _ in log:
        assert body["x"].tolist() == ([-1.0, -2.0, -3.0] if src in bad else [1.0, 2.0, 3.0])
        assert body["degree"] == 2 and body["tags"] == ["a"]


def test_noise_and_random_keep_shape_and_dtype_but_not_values():
    for attack in ("noise:std=1", "random"):
        log = []
        bad, _ = _two_rounds(attack, log)
        forged = [body["x"] for _, src, body, _ in log if src in bad]
        assert forged and all(x.shape == (3,) and x.dtype == np.float64 for x in forged)
        assert all(not np.array_equal(x, BODY["x"]) for x in forged)


def test_nan_bodies_are_dropped_as_invalid_by_a_checking_receiver():
    log = []
    bad, emulation = _two_rounds("nan", log, valid=like(BODY))
    assert all(src not in bad for _, src, _, _ in log)
    assert emulation.ledger.totals()["dropped_invalid"] == 2 * 2 * 3  # 2 adversaries x 3 receivers x 2 rounds


def test_stale_repeats_the_first_body_and_oversize_costs_bytes():
    sent = {0: {"x": np.zeros(2)}, 1: {"x": np.ones(2)}}
    log = []

    async def run(node):
        async for rnd in node.rounds():
            node.broadcast("m", sent[rnd])
            heard = await node.gather("m", timeout=1.0)
            log.extend((rnd, m.src, m.body["x"].tolist()) for m in heard.values())

    emulation = emulate(run, nx.complete_graph(4), rounds=2, adversaries="fraction=0.5,kind=stale")
    bad = emulation.network.adversaries.nodes
    assert len(bad) == 2 and len(log) == 2 * 4 * 3
    assert all(x == ([0.0, 0.0] if src in bad or rnd == 0 else [1.0, 1.0]) for rnd, src, x in log)
    log = []
    bad, _ = _two_rounds("oversize", log)
    assert len(log) == 2 * 4 * 3
    padding = np.zeros(8 * 24 // 4 + 1, np.float32)  # 8 bytes of float32 zeros per float byte of BODY (3 float64)
    for rnd, src, body, size in log:
        sent = {**BODY, "padding": padding} if src in bad else BODY
        assert size == len(wire.encode(["m", rnd, sent])), (src, size)
        assert body.keys() == sent.keys() and body["x"].tolist() == [1.0, 2.0, 3.0]


def test_robust_rules_on_known_values():
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    others = [{"weight": torch.tensor([[v]])} for v in (2.0, 3.0, 100.0, -50.0)]
    for rule, param, expected in (("median", 0, 2.0), ("trimmed", 0.2, 2.0), ("krum", 1, 2.0)):
        with torch.no_grad():
            model.weight.fill_(1.0)
        aggregate(model, others, rule, param)
        assert model.weight.item() == pytest.approx(expected), rule
    with torch.no_grad():
        model.weight.fill_(1.0)
    aggregate(model, [{"weight": torch.tensor([[3.0]])}], "median", 0)
    assert model.weight.item() == 2.0  # two values: the mean of the middle pair
    assert not math.isnan(model.weight.item())


DFEDAVGM = ["--protocol", "dfedavgm", "--dataset", "digits", "--partition", "iid", "--nodes", "10",
            "--topology", "regular:d=6", "--rounds", "8", "--model", "mlp", "--quiet", "--no-plots",
            "--adversaries", "fraction=0.3,kind=signflip"]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_median_holds_where_the_mean_breaks(tmp_path, seed):
    from p2p_emulator.analysis.rundir import read_run
    from p2p_emulator.analysis.study import honest_acc
    from p2p_emulator.cli import main

    accuracy = {}
    for rule in ("mean", "median"):
        out = tmp_path / rule
        assert main([*DFEDAVGM, "--seed", str(seed), "--aggregate", rule, "--out", str(out)]) == 0
        accuracy[rule] = honest_acc(read_run(out))
    assert accuracy["mean"] < 0.3 < 0.7 < accuracy["median"], accuracy
