"""PowerGossip as epfml/powergossip runs it: tensors of dimension <= 1 gossiped exactly (its
OnlyOnLargeParameters), the rest by warm-started power iteration scaled by --consensus-step (its
diffusion rate)."""
import json
import struct

import networkx as nx
import pytest
import torch

from emulator import wire
from p2p_emulator.cli import main
from p2p_emulator.workloads.models import build_model
from p2p_emulator.workloads.training import float_state
from protocols.powergossip import Carried, PowerGossip, PowerGossipOptions, layout
from tests.conftest import assert_refused, emulate

RING = ["--dataset", "digits", "--topology", "ring", "--quiet", "--no-plots"]
# degrees 1, 3, 2, 2: Metropolis-Hastings gives w = 1/4 on the edges at node 1 and 1/3 on 2-3
KITE = nx.Graph([(0, 1), (1, 2), (1, 3), (2, 3)])


class Small(torch.nn.Module):
    """A model with square matrices (a full-rank basis then projects exactly) and every kind of small
    tensor: biases, BatchNorm's weight, bias and running statistics (its int counter is not sent), a scalar."""

    def __init__(self, node: int):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.conv = torch.nn.Conv1d(2, 4, 2)  # 4 x 2 x 2: a 4 x 4 matrix
        self.bn = torch.nn.BatchNorm1d(4)
        self.scale = torch.nn.Parameter(torch.tensor(0.5))
        generator = torch.Generator().manual_seed(100 + node)
        with torch.no_grad():
            for value in self.state_dict().values():
                if value.is_floating_point():
                    value.copy_(torch.randn(value.shape, generator=generator))


SMALL = {"lin.bias", "conv.bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "scale"}
LARGE = {"lin.weight", "conv.weight"}


def _protocol(**options) -> PowerGossip:
    """The protocol's steps without its workload: power_step needs only the options."""
    protocol = PowerGossip.__new__(PowerGossip)
    protocol.options = PowerGossipOptions(timeout=1.0, **options)
    return protocol


def _drive(graph, *, rounds=1, power_steps=1, seed=0, trace=False, **options):
    """Power steps alone (no training) on `graph`: {(round, k, node): (state before, state after, heard)}."""
    protocol, log = _protocol(power_steps=power_steps, **options), {}

    async def run(node):
        model = node.keep(Small(node.id))
        carried = Carried(model)
        shapes, small = layout(await protocol.state(node, model))
        valid = protocol.checks(shapes, small)
        async for rnd in node.rounds():
            for k in range(power_steps):
                before = await protocol.state(node, model)
                check = valid[protocol.parity(carried.step), k == 0]
                heard = await protocol.power_step(node, model, carried, shapes, k, check)
                log[rnd, k, node.id] = before, await protocol.state(node, model), heard

    emulation = emulate(run, graph, rounds=rounds, seed=seed, trace=trace)
    return log, emulation


def _weights(graph) -> dict:
    return {(i, j): 1 / (1 + max(graph.degree[i], graph.degree[j])) for i in graph for j in graph[i]}


def _gossip(graph, states, names, rate) -> dict:
    """x_i + rate sum_j w_ij (x_j - x_i) for the tensors `names`, by hand."""
    w = _weights(graph)
    return {i: {name: states[i][name] + rate * sum(w[i, j] * (states[j][name] - states[i][name]) for j in graph[i])
                for name in names} for i in graph}


# -- (1) after a power step, the small tensors are exact gossip


@pytest.mark.parametrize("rate", [1.0, 1.308])
def test_small_tensors_are_gossiped_exactly_and_at_full_rank_so_is_everything(rate):
    log, _ = _drive(KITE, rank=4, consensus_step=rate)
    before = {i: log[0, 0, i][0] for i in KITE}
    assert set(before[0]) == SMALL | LARGE  # num_batches_tracked is not a float: never sent
    small, large = _gossip(KITE, before, SMALL, 1.0), _gossip(KITE, before, LARGE, rate)
    for i in KITE:
        after = log[0, 0, i][1]
        assert log[0, 0, i][2] == KITE.degree[i]
        for name in SMALL:  # the reference's SimpleGossip: w_ij alone, at diffusion rate 1
            assert torch.allclose(after[name], small[i][name], atol=1e-6), name
        for name in LARGE:  # a square orthonormal basis projects the whole difference: gamma w_ij (x_j - x_i)
            assert torch.allclose(after[name], large[i][name], atol=1e-5), name


@pytest.mark.parametrize("power_steps", [1, 2, 3])
def test_small_tensors_are_gossiped_once_a_round_in_its_first_power_step(power_steps):
    log, _ = _drive(KITE, rounds=2, power_steps=power_steps, rank=1, consensus_step=1.5)
    for rnd in range(2):
        before = {i: log[rnd, 0, i][0] for i in KITE}
        expected = _gossip(KITE, before, SMALL, 1.0)
        for i in KITE:
            for name in SMALL:
                assert torch.allclose(log[rnd, 0, i][1][name], expected[i][name], atol=1e-6), name
            for k in range(1, power_steps):  # later power steps leave them be
                assert all(torch.equal(log[rnd, k, i][0][name], log[rnd, k, i][1][name]) for name in SMALL)
                assert not all(torch.equal(log[rnd, k, i][0][name], log[rnd, k, i][1][name]) for name in LARGE)


# -- (3) --consensus-step scales the low-rank update, and only that


def test_the_consensus_step_scales_the_low_rank_update_and_not_the_exact_one():
    (one, _), (rate, _) = (_drive(KITE, rank=1, consensus_step=step) for step in (1.0, 0.4))
    for i in KITE:
        x = one[0, 0, i][0]
        assert all(torch.equal(x[name], rate[0, 0, i][0][name]) for name in x)  # the same start
        for name in LARGE:  # the same basis and products: the update is 0.4 times as large
            assert torch.allclose(rate[0, 0, i][1][name] - x[name], 0.4 * (one[0, 0, i][1][name] - x[name]),
                                  atol=1e-6), name
            assert not torch.equal(one[0, 0, i][1][name], x[name])
        for name in SMALL:
            assert torch.equal(rate[0, 0, i][1][name], one[0, 0, i][1][name]), name


@pytest.mark.parametrize("value", ["0", "-1", "-0.5"])
def test_a_consensus_step_that_is_not_positive_is_refused_in_one_line(value, tmp_path, capsys):
    assert_refused(capsys, [*RING, "--protocol", "powergossip", f"--consensus-step={value}"], "--consensus-step",
                   tmp_path / "run")


def test_the_consensus_step_is_an_option_with_its_default(tmp_path, capsys):
    assert main(["--protocol", "powergossip", "--help"]) == 0
    assert "powergossip: the diffusion rate" in capsys.readouterr().out
    out = tmp_path / "run"
    assert main([*RING, "--protocol", "powergossip", "--nodes", "4", "--rounds", "2", "--model", "mlp:hidden=8",
                 "--consensus-step", "1.308", "--out", str(out)]) == 0
    assert "consensus_step: 1.308" in (out / "config.yaml").read_text()


# -- (4) a pair keeps its sum


@pytest.mark.parametrize("rate", [0.6, 1.308])
def test_a_pair_keeps_its_sum_at_every_power_step(rate):
    log, _ = _drive(nx.path_graph(2), rounds=3, power_steps=2, rank=1, consensus_step=rate)
    for rnd in range(3):
        for k in range(2):
            (x0, y0, _), (x1, y1, _) = log[rnd, k, 0], log[rnd, k, 1]
            assert not torch.equal(x0["lin.weight"], y0["lin.weight"])  # it moved
            for name in x0:
                assert torch.allclose(x0[name] + x1[name], y0[name] + y1[name], atol=1e-6), (rnd, k, name)


def test_the_network_keeps_its_sum_on_an_irregular_graph():
    log, _ = _drive(KITE, rounds=2, power_steps=2, rank=2, consensus_step=1.308)
    for key in {(rnd, k) for rnd, k, _ in log}:
        for name in SMALL | LARGE:
            total = lambda when: sum(log[(*key, i)][when][name] for i in KITE)  # noqa: E731
            assert torch.allclose(total(0), total(1), atol=1e-5), (key, name)


# -- message checks


def test_a_body_must_carry_the_small_tensors_whole_in_the_first_power_step_only():
    state = float_state(Small(0))
    shapes, small = layout(state)
    checks = _protocol(rank=2, power_steps=2).checks(shapes, small)
    products = {name: torch.zeros(4, 2) for name in LARGE}
    exact = {name: torch.ones(value.shape) for name, value in state.items() if name in SMALL}
    body = {"degree": 3, "pair": [0, 0], "products": products}
    first, later = checks[0, True], checks[0, False]
    assert first({**body, "exact": exact}) and later(body)
    assert not first(body) and not later({**body, "exact": exact})  # missing, or one too many
    for name, bad in [("lin.bias", torch.ones(5)), ("lin.bias", torch.ones(1, 4)), ("scale", torch.ones(1)),
                      ("bn.running_var", torch.ones(4, dtype=torch.float64)),
                      ("bn.bias", torch.tensor([0.0, float("nan"), 0.0, 0.0]))]:
        assert not first({**body, "exact": {**exact, name: bad}}), name
    assert not first({**body, "exact": {k: v for k, v in exact.items() if k != "scale"}})


# -- (2) bytes on the ledger


def _payload(tensors) -> int:
    """Bytes of a frame's data: each tensor's entries, 16-aligned one after the other (emulator/wire.py)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    return sum(-(-n // 16) * 16 for n in sizes[:-1]) + sizes[-1]


def _bodies(state, rank: int, power_steps: int, step: int, degree: int) -> list[dict]:
    """The body of each power step of a round starting at power step `step`, with no exchange missed."""
    shapes, small = layout(state)
    bodies = []
    for k in range(power_steps):
        even = (step + k + power_steps) % 2 == 0
        products = {name: torch.zeros(n if even else m, min(m, n, rank)) for name, (m, n) in shapes.items()}
        body = {"degree": degree, "pair": [0, step + k], "products": products}
        bodies.append({**body, "exact": {name: torch.zeros_like(state[name]) for name in small}} if k == 0 else body)
    return bodies


def test_every_message_is_exactly_the_frame_of_its_body(tmp_path):
    out = tmp_path / "run"
    args = ["--nodes", "5", "--rounds", "4", "--model", "mlp:hidden=32", "--protocol", "powergossip",
            "--rank", "2", "--power-steps", "2", "--consensus-step", "1.308"]
    assert main([*RING, *args, "--trace", "--out", str(out)]) == 0
    messages = [json.loads(line) for line in (out / "messages.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    state = float_state(build_model("mlp:hidden=32", (1, 8, 8), 10))
    assert len(messages) == 5 * 2 * 4 * 2
    frames = {}
    for rnd in range(4):
        bodies = _bodies(state, rank=2, power_steps=2, step=2 * rnd, degree=2)
        frames[rnd] = [wire.encode([f"power-{k}", rnd, body]) for k, body in enumerate(bodies)]
        for k, (body, frame) in enumerate(zip(bodies, frames[rnd])):
            # 64 inputs, 32 hidden, 10 classes: weights as n x 2 (even) or m x 2 (odd); biases whole in power-0
            tensors = [*body["products"].values(), *body.get("exact", {}).values()]
            entries = {0: 64 * 2 + 32 * 2 + 32 + 10, 1: 32 * 2 + 10 * 2}[k]
            assert sum(t.numel() for t in tensors) == entries
            header, data = struct.unpack("<4sIQ", bytes(frame[:16]))[2] >> 40, _payload(tensors)
            assert len(frame) == 16 + -(-header // 16) * 16 + data
    for m in messages:
        assert m["bytes"] == len(frames[m["round"]][int(m["kind"][-1])]), m
    for row in metrics:  # per node and round: each of its 2 neighbours gets one frame per power step
        assert row["bytes_sent"] == 2 * sum(len(frame) for frame in frames[row["round"]])


def test_the_driven_steps_send_the_same_frames(tmp_path):
    """The same bodies on the ledger when power_step is driven directly, on an irregular graph."""
    _, emulation = _drive(KITE, rounds=2, power_steps=1, rank=1, trace=True)
    state = float_state(Small(0))
    for row in emulation.ledger.trace:
        body = _bodies(state, rank=1, power_steps=1, step=row.round, degree=KITE.degree[row.src])[0]
        assert row.fate == "delivered" and row.bytes == len(wire.encode([row.kind, row.round, body]))
    assert len(emulation.ledger.trace) == 2 * 2 * KITE.number_of_edges()
