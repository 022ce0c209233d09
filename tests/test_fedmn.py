"""FedMN: the modular network's wiring, block-wise traffic and averaging, the binary Concrete
relaxation, and both deployments run as a user runs them."""
import json

import numpy as np
import pytest
import torch

from p2p_emulator.cli import main
from emulator import wire
from protocols.fedmn import average_modules, draw_decision, routed_sgd
from experiments.fedmn_routing import spread
from tests.conftest import assert_one_line_error
from p2p_emulator.workloads.modular import active_modules, binary_concrete, build_modular, connections
from p2p_emulator.workloads.partitions import make_partition
from p2p_emulator.workloads.training import float_state

SMALL = ["--dataset", "digits", "--model", "cnn-small:channels=8,16", "--d-z", "32", "--momentum", "0.9",
         "--quiet", "--no-plots"]
WIDTHS = (2, 2, 2)


def _run(out, *args):
    assert main([*args, "--out", str(out)]) == 0
    return (json.loads((out / "summary.json").read_text()), _jsonl(out / "metrics.jsonl"))


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _network(seed=0):
    return build_modular("cnn-small:channels=8,16", WIDTHS, (1, 8, 8), 10, d_z=32, norm="batch", dropout=0.1,
                         init_seed=seed)


# -- the network

def test_a_module_is_active_only_on_a_path_from_input_to_prediction():
    # E = 2*2 + 2*2 + 2: C1 (blocks x encoders), C2 (outputs x blocks), then the output row
    assert connections(WIDTHS) == 10 and connections((3, 4, 2)) == 22
    assert active_modules(WIDTHS, [1] * 10) == [(l, j) for l in range(3) for j in range(2)]
    # encoder 0 -> block 0 -> output 0 -> prediction
    assert active_modules(WIDTHS, [1, 0, 0, 0, 1, 0, 0, 0, 1, 0]) == [(0, 0), (1, 0), (2, 0)]
    # the same path, but output 0 does not reach the prediction: nothing is active
    assert active_modules(WIDTHS, [1, 0, 0, 0, 1, 0, 0, 0, 0, 1]) == []
    # both encoders feed block 1; output 1 reads block 1
    assert active_modules(WIDTHS, [0, 0, 1, 1, 0, 0, 0, 1, 0, 1]) == [(0, 0), (0, 1), (1, 1), (2, 1)]


def test_only_active_modules_get_a_gradient_and_cut_connections_change_nothing():
    network = _network()
    network.train()
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,))
    gates = torch.tensor([1.0, 0, 0, 0, 1, 0, 0, 0, 1, 0], requires_grad=True)
    torch.nn.functional.cross_entropy(network(x, gates), y).backward()
    active = ("layers.0.0.", "layers.1.0.", "layers.2.0.")
    trained = [name for name, p in network.named_parameters() if p.grad is not None and not name.startswith("router")]
    assert all(name.startswith(active) for name in trained)
    assert all(any(name.startswith(prefix) for name in trained) for prefix in active)
    network.eval()
    before = network(x, gates.detach())
    with torch.no_grad():
        network.layers[1][1][0].weight.add_(1.0)  # an inactive block
    assert torch.equal(network(x, gates.detach()), before)


# -- the binary Concrete relaxation

def test_the_concrete_sample_tends_to_the_bernoulli_decision_as_tau_falls():
    generator = torch.Generator().manual_seed(0)
    pi = torch.full((20000,), 0.3)
    noise = torch.rand(20000, generator=generator)
    hard = binary_concrete(pi, noise, 1.0) > 0.5  # the decision is a Bernoulli(pi) draw at any tau
    assert abs(hard.float().mean().item() - 0.3) < 0.01
    for tau, gap in ((0.1, 0.05), (0.01, 0.005)):
        soft = binary_concrete(pi, noise, tau)
        assert (soft - hard.float()).abs().median() < gap


@pytest.mark.parametrize("pi,u,tau", [(0.3, 0.6, 1.0), (0.8, 0.25, 0.5), (0.5, 0.45, 0.1)])
def test_the_concrete_gradient_wrt_pi_matches_finite_differences(pi, u, tau):
    p = torch.tensor(pi, dtype=torch.float64, requires_grad=True)
    noise = torch.tensor(u, dtype=torch.float64)
    binary_concrete(p, noise, tau).backward()
    h = 1e-6
    numeric = (binary_concrete(torch.tensor(pi + h, dtype=torch.float64), noise, tau)
               - binary_concrete(torch.tensor(pi - h, dtype=torch.float64), noise, tau)) / (2 * h)
    assert torch.isfinite(p.grad) and p.grad != 0
    assert abs(p.grad.item() - numeric.item()) < 1e-6 * max(1.0, abs(numeric.item()))


# -- aggregation

def test_a_module_is_averaged_only_over_the_clients_for_which_it_was_active():
    network = _network()
    state = float_state(network)
    block, output = "layers.1.0.0.bias", "layers.2.1.bias"
    a = {block: torch.full_like(state[block], 2.0), output: torch.full_like(state[output], 4.0)}
    b = {block: torch.full_like(state[block], 8.0)}  # client b did not use output 1
    untouched = state["layers.1.1.0.bias"].clone()  # nobody used block (1, 1)
    average_modules(network, [(1, a), (3, b)])
    after = float_state(network)
    assert torch.equal(after[block], torch.full_like(state[block], 0.25 * 2 + 0.75 * 8))
    assert torch.equal(after[output], torch.full_like(state[output], 4.0))  # only a: weight 1, not 1/4
    assert torch.equal(after["layers.1.1.0.bias"], untouched)


# -- runs

@pytest.fixture(scope="module", params=["train", "frozen"])
def star(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("fedmn") / "star"
    args = [*SMALL, "--protocol", "fedmn", "--topology", "star", "--nodes", "7", "--rounds", "4",
            "--pretrain-rounds", "1", "--partition", "mixture:components=2", "--trace", "--router", request.param]
    return (*_run(out, *args), out, args)


def test_only_active_modules_and_a_trained_hypernetwork_cross_the_wire_exactly(star):
    summary, metrics, out, args = star
    reference = float_state(_network())
    decision = {(r["round"], r["node"]): [int(c) for c in r["decision"]] for r in metrics if "decision" in r}
    clients = json.loads((out / "partition.json").read_text())["nodes"]
    samples = {n["node"] + 1: sum(n["train"].values()) for n in clients}  # client k holds part k - 1
    trained = args[-1] == "train"
    router = [k for k in reference if k.startswith("router.") and trained]  # a frozen one never travels
    params = {}  # (round, sender) -> tensor entries sent

    def modules(bits):
        prefixes = tuple(f"layers.{layer}.{j}." for layer, j in active_modules(WIDTHS, bits))
        return [k for k in reference if k.startswith(prefixes)]

    def size(kind, rnd, body):
        return len(wire.encode([kind, rnd, body]))

    messages = _jsonl(out / "messages.jsonl")
    assert messages and summary["messages_total"] == len(messages)
    for m in messages:
        rnd, client = m["round"], max(m["src"], m["dst"])
        bits = decision[rnd, client]
        routed = rnd >= 1
        pick = lambda names: {k: reference[k] for k in names}  # noqa: E731
        expected = {
            "model": {"state": pick(router if routed else modules(bits))},
            "decision": {"decision": bits},
            "blocks": {"state": pick(modules(bits))},
            "update": {"state": pick(modules(bits) + (router if routed else [])), "samples": samples[client],
                       "decision": bits},
        }[m["kind"]]
        assert m["bytes"] == size(m["kind"], rnd, expected), m
        entries = sum(t.numel() for t in expected.get("state", {}).values())
        params[rnd, m["src"]] = params.get((rnd, m["src"]), 0) + entries
    assert {(r["round"], r["node"]): r["params_sent"] for r in metrics} == params
    kinds = {(m["round"], m["kind"]) for m in messages}
    assert (0, "decision") not in kinds and (1, "decision") in kinds  # pretraining sends whole networks
    phases = summary["bytes_by_phase"]
    assert phases["pretrain"]["rounds"] == 1 and phases["fedmn"]["rounds"] == 3
    assert phases["pretrain"]["bytes_sent"] + phases["fedmn"]["bytes_sent"] == summary["bytes_total"]


def test_a_frozen_router_keeps_each_clients_pi_and_a_trained_one_moves_it(star):
    _, _, out, args = star
    pis = {}  # node -> its Pi in routed rounds 1, 2, 3
    for row in _jsonl(out / "decisions.jsonl"):
        if row["round"] >= 1:
            pis.setdefault(row["node"], []).append(row["pi"])
    assert sorted(pis) == list(range(1, 7)) and all(len(seen) == 3 for seen in pis.values())
    frozen = args[-1] == "frozen"  # Pi from the initial hypernetwork on the client's own data: the same every round
    assert all((seen[0] == seen[1] == seen[2]) == frozen for seen in pis.values())


@pytest.mark.parametrize("routed", [False, True])
def test_the_hypernetwork_trains_only_in_a_routed_round(routed):
    network = _network()
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 1, 8, 8, generator=generator), torch.randint(0, 10, (8,), generator=generator)
    draw_decision(network, x, y, generator)
    network.decision.fill_(1.0)
    before = float_state(network)
    routed_sgd(network, x, y, routed=routed, tau=1.0, generator=generator, epochs=1, steps=0, lr=0.1, momentum=0.9,
               weight_decay=5e-4, batch_size=4)
    changed = {k for k, v in float_state(network).items() if not torch.equal(before[k], v)}
    router = {k for k in before if k.startswith("router.")}
    assert changed - router == set(before) - router  # every module trains either way
    assert changed & router == (router if routed else set())


def test_an_empty_decision_under_a_frozen_router_trains_nothing():
    network = _network()
    network.decision.zero_()
    before = float_state(network)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    loss, seen = routed_sgd(network, x, y, routed=False, tau=1.0, generator=torch.Generator().manual_seed(0),
                            epochs=1, steps=0, lr=0.1, momentum=0.9, weight_decay=0.0, batch_size=4)
    assert seen == 0 and loss == pytest.approx(np.log(10))  # no path: uniform logits
    assert all(torch.equal(before[k], v) for k, v in float_state(network).items())


def test_a_seed_gives_the_same_run(star, tmp_path):
    _, _, out, args = star
    _run(tmp_path / "again", *args)
    for name in ("metrics.jsonl", "links.csv", "messages.jsonl", "decisions.jsonl"):
        assert (tmp_path / "again" / name).read_text() == (out / name).read_text()


@pytest.mark.parametrize("seed", [0, 1])
def test_the_trained_router_reads_each_component_yet_routes_them_alike(tmp_path, seed):
    """Not the paper's component-specific routes: docs/fedmn.md, "What the router learns"."""
    # 100 samples a client, half the partition's default: on seeds 0 to 3 between stays at least 1.45 times its
    # bound, every Pi rises and their mean by 0.31 or more. At 64 samples Pi barely rises; fewer clients or
    # rounds bring some seed to a bound.
    out = tmp_path / "mix"
    summary, _ = _run(out, *SMALL, "--protocol", "fedmn", "--topology", "star", "--nodes", "11", "--rounds", "24",
                      "--pretrain-rounds", "4", "--partition", "mixture:components=2,samples=100", "--seed", str(seed))
    rows = _jsonl(out / "decisions.jsonl")
    by_round = {t: {row["node"]: row for row in rows if row["round"] == t} for t in range(4, 24)}
    assert all(sorted(clients) == list(range(1, 11)) for clients in by_round.values())
    for clients in by_round.values():  # Pi is a function of the client's data: it sets the components apart
        between, within = spread(list(clients.values()))
        assert between > max(1.5 * within, 1e-3)  # 1e-3: ten times the resolution Pi is recorded at
    first, last = by_round[4], by_round[23]  # ... but Pi rises on every component alike
    rose = [b > a for n in first for a, b in zip(first[n]["pi"], last[n]["pi"])]
    assert sum(rose) >= 0.9 * len(rose)
    assert np.mean([row["pi"] for row in last.values()]) > np.mean([row["pi"] for row in first.values()]) + 0.2
    assert summary["majority_routes"]["0"] == summary["majority_routes"]["1"]
    assert summary["route_agreement"] == 1.0


def test_fedmn_p2p_runs_under_churn_without_deadlock(tmp_path):
    summary, metrics = _run(tmp_path / "churn", *SMALL, "--protocol", "fedmn-p2p", "--topology", "regular:d=4",
                            "--nodes", "8", "--rounds", "6", "--pretrain-rounds", "2", "--partition",
                            "mixture:components=2", "--churn", "up=0.6s,down=0.3s", "--timeout", "0.3")
    assert summary["dropped_offline"] > 0  # churn did cut messages
    assert {r["round"] for r in metrics} == set(range(6))
    assert all(r["phase"] == ("pretrain" if r["round"] < 2 else "fedmn") for r in metrics if "phase" in r)
    assert any(r["heard_from"] < 4 for r in metrics if "heard_from" in r)


@pytest.mark.parametrize("flags,named", [
    (["--modules", "2"], "--modules"),
    (["--modules", "2,x"], "--modules"),
    (["--modules", "2,0,2"], "--modules"),
    (["--model", "hetero-small"], "--model"),
    (["--dropout", "1"], "--dropout"),
    (["--tau-end", "0"], "--tau-end"),
    (["--pretrain-rounds", "-1"], "--pretrain-rounds"),
    (["--router", "fixed"], "--router"),
    (["--partition", "mixture:components=11"], "components"),
    (["--partition", "mixture:alpha=0"], "alpha"),
])
def test_bad_settings_are_one_line_and_exit_2(tmp_path, capsys, flags, named):
    out = tmp_path / "bad"
    assert main([*SMALL, "--protocol", "fedmn", "--topology", "star", "--nodes", "5", *flags, "--out", str(out)]) == 2
    assert_one_line_error(capsys, named)
    assert not (out / "summary.json").exists()


# -- the mixture partition

@pytest.mark.parametrize("seed,nodes,components", [(0, 10, 3), (1, 20, 2), (2, 7, 5)])
def test_mixture_clients_draw_from_their_components_in_proportion(seed, nodes, components):
    train_y, test_y = np.repeat(np.arange(10), 6000), np.repeat(np.arange(10), 1000)
    p = make_partition(f"mixture:components={components},samples=300", train_y, test_y, nodes, 10, seed)
    blocks = np.array_split(np.arange(10), components)
    everything = np.concatenate([n.train for n in p.nodes])
    assert len(np.unique(everything)) == len(everything)
    for node in p.nodes:
        assert len(node.train) == 300 and abs(sum(node.weights) - 1) < 1e-5
        assert node.cluster == int(np.argmax(node.weights))
        shares = [np.isin(train_y[node.train], block).mean() for block in blocks]
        assert np.allclose(shares, node.weights, atol=len(blocks[0]) / 300 + 1 / 300)
    record = p.to_json("x", train_y, test_y, ["m"] * nodes)
    assert [n["weights"] for n in record["nodes"]] == [n.weights for n in p.nodes]
