"""Secure aggregation on the FedAvg star (protocols/secagg.py): the sum is right, the masked inputs say
nothing, dropouts are recovered down to the threshold, every phase's bytes are its frames, and bad input
is refused."""
import asyncio
import collections
import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from emulator import wire
from emulator.seeds import Seeds
from p2p_emulator.cli import main
from p2p_emulator.workloads.models import build_model
from p2p_emulator.workloads.training import float_state
from protocols import secagg
from protocols import secagg_crypto as crypto
from protocols.secure_mixing import Part, SecureMixing
from tests.conftest import assert_one_line_error

STAR = ["--protocol", "fedavg", "--topology", "star", "--dataset", "digits", "--model", "mlp:hidden=16",
        "--normalize", "max", "--lr", "0.5", "--quiet", "--no-plots"]
ENTRIES = 64 * 16 + 16 + 16 * 10 + 10  # mlp:hidden=16 on 8x8 digits
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _run(out, *args):
    assert main([*STAR, *args, "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), rows


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _server_rows(rows):
    return [r for r in rows if r["node"] == 0]


# -- the protocol's arithmetic, client by client, without the network

def _clients(m: int, rnd: int = 0, seed: int = 0):
    """m clients' round keys, each with a model trained away from the common start."""
    start = build_model("mlp:hidden=16", (1, 8, 8), 10)
    clients = {}
    for u in range(1, m + 1):
        model = build_model("mlp:hidden=16", (1, 8, 8), 10)
        model.load_state_dict(start.state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p += torch.randn(p.shape, generator=torch.Generator().manual_seed(seed * 100 + u)) * 0.1
        keys = crypto.client_keys(Seeds(seed).numpy("k", u, rnd).bytes(96))
        clients[u] = SimpleNamespace(model=model, keys=keys, samples=10 * u)
    return float_state(start), clients


def _aggregate(m: int, t: int, silent_before_masking=(), silent_after_masking=(), rnd: int = 0):
    """The whole round among m clients (SecAgg, every client a neighbour of every other): (unmasked sum,
    the plain sum of the inputs of those whose masked input arrived)."""
    start, clients = _clients(m, rnd)
    public = {u: [c.keys["c"], c.keys["s"]] for u, c in clients.items()}
    sealed, held = {}, {}
    for u, c in clients.items():
        peers = {v: k for v, k in public.items() if v != u}
        sealed[u], own = crypto.share_secrets(c.keys, u, rnd, peers, t, u)
        held[u] = {u: own}
    for v, c in clients.items():
        peers = {u: k for u, k in public.items() if u != v}
        opened, refused = crypto.open_shares(c.keys, v, rnd, peers, {u: sealed[u][v] for u in sealed if u != v})
        assert refused == []
        held[v].update(opened)
    masked = {u: crypto.masked_input(c.model, start, c.samples, c.keys, u, rnd,
                                     {v: public[v][1] for v in clients if v != u}, m)[0]
              for u, c in clients.items() if u not in silent_before_masking}
    answers = {u: secagg.reveal(held[u], set(masked), u) for u in masked if u not in silent_after_masking}
    dropped = [v for v in clients if v not in masked]
    b_shares = {u: {h: a["b"][u] for h, a in answers.items() if u in a["b"]} for u in masked}
    s_shares = {v: {h: a["s"][v] for h, a in answers.items() if v in a["s"]} for v in dropped}
    seeds, private, wrong = crypto.recover(b_shares, s_shares, {v: public[v][1] for v in dropped})
    assert wrong == []
    total = np.zeros(ENTRIES + 1, dtype=crypto.RING)
    for y in masked.values():
        total += y
    survivors_of = {v: {u: public[u][1] for u in masked} for v in dropped}
    unmasked = crypto.unmask(total, rnd, seeds, private, survivors_of)
    plain = sum(crypto.update_vector(float_state(clients[u].model), start, clients[u].samples) for u in masked)
    return unmasked, plain


def test_the_unmasked_sum_is_the_plain_sum_to_the_fixed_point_precision():
    unmasked, plain = _aggregate(5, 3)
    values = crypto.from_ring(unmasked)
    assert values[-1] == plain[-1] == 10 + 20 + 30 + 40 + 50
    assert np.abs(values - plain).max() <= 5 * 2.0 ** -(crypto.FRACTION_BITS + 1)


def test_dropped_clients_masks_are_removed_and_silent_ones_still_count():
    # client 2 never sends its masked input (its pairwise masks are rebuilt from s_2's shares); client 4 sends
    # it, then falls silent (its self mask is rebuilt from the others' shares of b_4)
    unmasked, plain = _aggregate(6, 4, silent_before_masking={2}, silent_after_masking={4})
    values = crypto.from_ring(unmasked)
    assert values[-1] == 10 * (1 + 3 + 4 + 5 + 6)
    assert np.abs(values - plain).max() <= 5 * 2.0 ** -(crypto.FRACTION_BITS + 1)


def test_fewer_than_t_shares_do_not_rebuild_a_secret():
    secret = bytes(range(32))
    shares = crypto.split(secret, list(range(7)), 4, np.random.default_rng(0))
    assert crypto.join({h: shares[h] for h in (0, 3, 5, 6)}) == secret
    assert crypto.join({h: shares[h] for h in (1, 2, 4)}) != secret


def test_a_masked_input_looks_uniform_and_unrelated_to_the_update():
    start, clients = _clients(3)
    c = clients[1]
    peers = {v: clients[v].keys["s"] for v in (2, 3)}
    y, _ = crypto.masked_input(c.model, start, c.samples, c.keys, 1, 0, peers, 3)
    other_keys = crypto.client_keys(Seeds(7).numpy("k", 1, 0).bytes(96))
    y_again, _ = crypto.masked_input(c.model, start, c.samples, other_keys, 1, 0, peers, 3)  # same update, other seed
    x = crypto.to_ring(crypto.update_vector(float_state(c.model), start, c.samples))
    for masked in (y, y_again):
        top = (masked >> np.uint64(56)).astype(int)  # the top byte of each entry: uniform over 0..255
        assert stats.chisquare(np.bincount(top, minlength=256)).pvalue > 1e-4
        assert abs(stats.spearmanr(masked.astype(float), x.view(np.int64).astype(float)).statistic) < 0.1
    assert np.mean(y == y_again) < 1e-3
    assert abs(stats.spearmanr(y.astype(float), y_again.astype(float)).statistic) < 0.1


# -- through the emulated network

def test_what_the_server_receives_looks_uniform(tmp_path, monkeypatch):
    received = []
    masked_phase = secagg.SecureServer._masked

    async def recording(self, *args):
        masked = await masked_phase(self, *args)
        received.extend(masked.values())
        return masked
    monkeypatch.setattr(secagg.SecureServer, "_masked", recording)
    _run(tmp_path / "r", "--nodes", "5", "--rounds", "2", "--secure-aggregation", "secagg")
    assert len(received) == 8
    for y in received:
        assert stats.chisquare(np.bincount((y >> np.uint64(56)).astype(int), minlength=256)).pvalue > 1e-4
    later = received[4:]  # round 1's inputs start from the same global model: still unrelated to each other
    assert all(abs(stats.spearmanr(a.astype(float), b.astype(float)).statistic) < 0.1
               for i, a in enumerate(later) for b in later[i + 1:])


def test_secure_fedavg_learns_what_plain_fedavg_learns(tmp_path):
    _, plain = _run(tmp_path / "plain", "--nodes", "6", "--rounds", "2")
    for mode in ("secagg", "secagg+"):
        summary, rows = _run(tmp_path / mode, "--nodes", "6", "--rounds", "2", "--secure-aggregation", mode)
        assert summary["secagg_rounds_failed"] == 0
        for a, b in zip(plain, rows):
            assert (a["node"], a["round"]) == (b["node"], b["round"])
            assert b.get("test_acc") == a.get("test_acc")
            if "train_loss" in a:
                assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)


def test_silent_clients_after_masking_are_recovered(tmp_path):
    # 10 clients, 1 silent after its masked input each round: its input counts, its self mask is rebuilt
    _, plain = _run(tmp_path / "plain", "--nodes", "11", "--rounds", "2", "--timeout", "1")
    summary, rows = _run(tmp_path / "r", "--nodes", "11", "--rounds", "2", "--timeout", "1",
                         "--secure-aggregation", "secagg", "--secagg-dropout", "0.1")
    assert [r["heard_from"] for r in _server_rows(rows)] == [10, 10]
    assert [r["test_acc"] for r in _server_rows(rows)] == [r["test_acc"] for r in _server_rows(plain)]
    assert summary["secagg_rounds_failed"] == 0


@pytest.mark.parametrize("at,heard", [
    ("0.1s", [(9, 1), (9, 0)]),  # while training, after the share exchange (0.05 s): its s key is rebuilt
    ("0.2s", [(10, 0), (9, 0)]),  # after its masked input (0.196 s), before the unmask request: its b is rebuilt
])
def test_a_crashed_client_leaves_the_sum_of_the_masked_inputs_that_arrived(tmp_path, at, heard):
    assert Seeds(0).numpy("crash").choice(11, size=1, replace=False).tolist() == [6]  # seed 0: node 6 crashes
    crash = ["--nodes", "11", "--rounds", "2", "--timeout", "1", "--crash", f"0.1@{at}",
             "--compute-time", "per-sample"]  # 1 ms a training sample: the instants above
    _, plain = _run(tmp_path / "plain", *crash)
    _, rows = _run(tmp_path / "r", *crash, "--secure-aggregation", "secagg", "--trace")
    server = _server_rows(rows)
    assert [(r["heard_from"], r.get("secagg_dropped")) for r in server] == heard
    assert [r["test_acc"] for r in server] == [r["test_acc"] for r in _server_rows(plain)]  # plain FedAvg's sum
    masked = [m for m in _jsonl(tmp_path / "r" / "messages.jsonl") if m["kind"] == "secagg.masked" and m["src"] == 6]
    assert [m["round"] for m in masked] == ([] if at == "0.1s" else [0])


def test_below_the_threshold_the_round_fails_the_model_stays_and_the_next_round_runs(tmp_path):
    # 5 of 10 clients silent after masking, threshold 8: no unmasking, each round
    summary, rows = _run(tmp_path / "r", "--nodes", "11", "--rounds", "2", "--timeout", "1",
                         "--secure-aggregation", "secagg", "--secagg-threshold", "8", "--secagg-dropout", "0.5")
    server = _server_rows(rows)
    assert [r["secagg_failed"] for r in server] == [1, 1] and summary["secagg_rounds_failed"] == 2
    _, initial = _run(tmp_path / "initial", "--nodes", "11", "--rounds", "0")
    assert {r["test_acc"] for r in server} == {_server_rows(initial)[0]["test_acc"]}  # x never changed
    failures = _jsonl(tmp_path / "r" / "secagg.jsonl")
    assert [f["round"] for f in failures] == [0, 1]
    assert all(f["phase"] == "secagg.unmask" and "5 of 10 clients answered, below the threshold 8" in f["reason"]
               for f in failures)


# -- bytes

def _frame(kind, rnd, body) -> int:
    return len(wire.encode([kind, rnd, body]))


def _expected_bytes(mode: str, m: int, k: int, t: int) -> dict[str, int]:
    """Each phase's bytes in round 0, from its frames: m clients (ids 1..m), each with k neighbours."""
    ids = list(range(1, m + 1))
    key, ct, share = bytes(32), bytes(crypto.CIPHERTEXT_BYTES), bytes(crypto.SHARE_BYTES)
    listed = ids if mode == "secagg" else ids[:k]  # SecAgg broadcasts U1's keys, SecAgg+ sends the neighbours'
    survivors = ids if mode == "secagg" else ids[:k + 1]
    return {
        "secagg.keys": m * (_frame("secagg.keys", 0, {"round": 0, "c": key, "s": key})
                            + _frame("secagg.keys", 0, {"round": 0, "t": t, "keys": {v: [key, key] for v in listed}})),
        "secagg.shares": 2 * m * _frame("secagg.shares", 0, {"round": 0, "shares": {v: ct for v in ids[:k]}}),
        "secagg.masked": m * _frame("secagg.masked", 0, {"round": 0, "y": np.zeros(ENTRIES + 1, np.uint64)}),
        "secagg.unmask": m * (_frame("secagg.unmask", 0, {"round": 0, "survivors": survivors})
                              + _frame("secagg.unmask", 0, {"round": 0, "b": {u: share for u in survivors}, "s": {}})),
    }


@pytest.mark.parametrize("mode", ["secagg", "secagg+"])
def test_each_phase_is_exactly_its_frames_and_grows_as_the_paper_says(mode, tmp_path):
    ciphertexts = {}
    for m in (4, 8, 16):
        out = tmp_path / f"{mode}{m}"
        summary, _ = _run(out, "--nodes", str(m + 1), "--rounds", "1", "--trace", "--secure-aggregation", mode)
        plan = secagg.Plan.of(SimpleNamespace(secure_aggregation=mode, secagg_neighbours=0, secagg_threshold=0), m)
        measured = collections.Counter()
        for message in _jsonl(out / "messages.jsonl"):
            measured[message["kind"]] += message["bytes"]
        expected = _expected_bytes(mode, m, plan.k, plan.t)
        assert {kind: measured[kind] for kind in expected} == expected
        assert sum(measured.values()) == summary["bytes_total"]
        ciphertexts[m] = 2 * m * plan.k  # sealed shares up to the server and relayed down
    # SecAgg: 2 n (n - 1), quadratic; SecAgg+: 2 n k with k = 2 ceil(log2 n), n log n
    assert ciphertexts == ({4: 24, 8: 112, 16: 480} if mode == "secagg" else {4: 24, 8: 96, 16: 256})


# -- bad options, bad input

@pytest.mark.parametrize("args,named", [
    (["--secure-aggregation", "shamir"], "--secure-aggregation 'shamir'"),
    (["--secure-aggregation", "secagg", "--secagg-threshold", "6"], "--secagg-threshold 6"),
    (["--secure-aggregation", "secagg", "--nodes", "9", "--clients-per-round", "3", "--secagg-threshold", "5"],
     "--secagg-threshold 5"),
    (["--secure-aggregation", "secagg", "--secagg-threshold", "1"], "--secagg-threshold 1"),
    (["--secagg-threshold", "3"], "--secagg-threshold 3"),
    (["--secure-aggregation", "secagg+", "--secagg-neighbours", "3"], "--secagg-neighbours 3"),
    (["--secure-aggregation", "secagg+", "--secagg-neighbours", "6"], "--secagg-neighbours 6"),
    (["--secure-aggregation", "secagg", "--secagg-dropout", "1"], "--secagg-dropout 1"),
    (["--secure-aggregation", "secagg", "--nodes", "2"], "--secure-aggregation secagg"),
])
def test_bad_options_exit_2_with_one_line(tmp_path, capsys, args, named):
    argv = [*STAR, "--nodes", "5", "--rounds", "1", *args, "--out", str(tmp_path / "r")]
    assert main(argv) == 2
    assert_one_line_error(capsys, named)


def test_hostile_clients_are_refused_and_the_rounds_go_on(tmp_path):
    # stale: an attacker resends its first bodies, whose round is wrong from round 1 on; oversize: an extra key.
    # Seed 0: clients 1 and 7 attack.
    # Each attacker's keys are refused once (stale: round 1's, replaying round 0's; oversize: round 0's, and its
    # round-1 keys come after the server stopped waiting), and the server sums the other 8 clients' inputs in each
    # round the attack is on: an attacker refused but counted among the survivors would make heard_from 10.
    assert sorted(Seeds(0).numpy("adversaries").choice(11, size=2, replace=False).tolist()) == [1, 7]
    for kind, heard in (("stale", [10, 8]), ("oversize", [8, 8])):
        summary, rows = _run(tmp_path / kind, "--nodes", "11", "--rounds", "2", "--timeout", "1",
                             "--secure-aggregation", "secagg", "--adversaries", f"fraction=0.2,kind={kind}")
        assert summary["dropped_invalid"] == 2, kind
        assert [r["heard_from"] for r in _server_rows(rows)] == heard, kind
        assert [r["secagg_failed"] for r in _server_rows(rows)] == [0, 0]
        assert [r["masked"] for r in _jsonl(tmp_path / kind / "secagg.jsonl")] == heard, kind


def _node(rnd=3):
    return SimpleNamespace(round=rnd)


def test_each_check_refuses_what_it_should():
    key, node = crypto.key_pair(bytes(range(32)))[1], _node()
    assert secagg.keys_body(node)({"round": 3, "c": key, "s": key})
    assert not secagg.keys_body(node)({"round": 3, "c": key[:31], "s": key})  # a key not 32 bytes
    assert not secagg.keys_body(node)({"round": 2, "c": key, "s": key})  # replayed from an earlier round
    ok = np.zeros(9, np.uint64)
    assert secagg.masked_body(node, 9)({"round": 3, "y": ok})
    assert not secagg.masked_body(node, 9)({"round": 3, "y": ok.astype(np.int64)})
    assert not secagg.masked_body(node, 9)({"round": 3, "y": np.zeros(8, np.uint64)})
    assert not secagg.shares_body(node, [1, 2])({"round": 3, "shares": {5: bytes(crypto.CIPHERTEXT_BYTES)}})
    assert not secagg.unmask_body(node, [1], [])({"round": 3, "b": {1: b"\xff" * crypto.SHARE_BYTES}, "s": {}})


def test_a_tampered_replayed_or_redirected_share_fails_authentication():
    _, clients = _clients(3)
    public = {u: [c.keys["c"], c.keys["s"]] for u, c in clients.items()}
    sealed, _ = crypto.share_secrets(clients[1].keys, 1, 0, {2: public[2], 3: public[3]}, 2, 0)
    opened, refused = crypto.open_shares(clients[2].keys, 2, 0, {1: public[1]}, {1: sealed[2]})
    assert list(opened) == [1] and refused == []
    tampered = bytes([sealed[2][0] ^ 1]) + sealed[2][1:]
    assert crypto.open_shares(clients[2].keys, 2, 0, {1: public[1]}, {1: tampered}) == ({}, [1])
    assert crypto.open_shares(clients[2].keys, 2, 1, {1: public[1]}, {1: sealed[2]}) == ({}, [1])  # another round
    assert crypto.open_shares(clients[3].keys, 3, 0, {1: public[1]}, {1: sealed[2]}) == ({}, [1])  # not its share


LOW_ORDER = [bytes(32), (1).to_bytes(32, "little")]  # X25519 points of order 2 and 4: zero bytes out of any agreement


def test_a_low_order_public_key_is_refused_wherever_a_key_is_checked():
    good, node = crypto.key_pair(bytes(range(32)))[1], _node()
    assert secagg.public_key(good) and secagg.key_pair_list([good, good])
    for bad in LOW_ORDER:
        assert not secagg.public_key(bad)
        assert not secagg.keys_body(node)({"round": 3, "c": bad, "s": good})  # the server, from a client
        assert not secagg.keys_body(node)({"round": 3, "c": good, "s": bad})
        assert not secagg.key_pair_list([good, bad])  # a client, in the server's list


def test_a_client_advertising_a_low_order_key_is_refused_and_the_run_goes_on(tmp_path, monkeypatch):
    # client 2's c key is 32 zero bytes: accepted, it made every peer's key agreement raise and the run fail
    hostile, client_keys = Seeds(0).numpy("secagg.keys", 2, 0).bytes(96), crypto.client_keys
    monkeypatch.setattr(crypto, "client_keys", lambda m: {**client_keys(m), "c": bytes(32)} if m == hostile
                        else client_keys(m))
    summary, rows = _run(tmp_path / "r", "--nodes", "4", "--rounds", "1", "--timeout", "1",
                         "--secure-aggregation", "secagg")
    assert summary["dropped_invalid"] == 1
    assert [(r["heard_from"], r["secagg_failed"]) for r in _server_rows(rows)] == [(2, 0)]
    assert _jsonl(tmp_path / "r" / "secagg.jsonl") == [
        {"round": 0, "node": 0, "outcome": "ok", "clients": 3, "masked": 2, "dropped": 0}]


BODIES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.binary(max_size=200)
    | st.sampled_from([bytes(32), bytes(crypto.SHARE_BYTES), bytes(crypto.CIPHERTEXT_BYTES)]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["round", "c", "s", "t", "keys", "shares", "y", "b", "survivors", 1, 2]), inner, max_size=5), max_leaves=12)


@FUZZ
@given(BODIES)
def test_no_body_makes_a_check_raise_or_pass_unless_well_formed(body):
    node = _node()
    checks = [secagg.keys_body(node), secagg.shares_body(node, [1, 2]), secagg.masked_body(node, 4),
              secagg.unmask_body(node, [1, 2], [3])]
    for check in checks:
        accepted = check(body)
        assert accepted in (True, False)
        if accepted:
            assert isinstance(body, dict) and body["round"] == 3


@FUZZ
@given(st.binary(min_size=0, max_size=2 * crypto.CIPHERTEXT_BYTES))
def test_arbitrary_ciphertexts_are_refused_never_raised_on(ciphertext):
    _, clients = _clients(2)
    public = {1: [clients[1].keys["c"], clients[1].keys["s"]]}
    assert crypto.open_shares(clients[2].keys, 2, 0, public, {1: ciphertext}) == ({}, [1])


# -- a diverged client's input

def test_an_input_not_finite_or_past_the_range_of_its_sum_is_refused():
    for values, reason in ((np.array([1.0, np.nan, -np.inf]), "2 of 3 entries are not finite"),
                           (np.array([2.0**39, 1e300, 1.0]), "2 of 3 entries are beyond ±5.49756e+11, past which a "
                            "sum of 1 inputs could wrap")):
        with pytest.raises(crypto.Unrepresentable) as refused:  # a bare cast made each -2^39, silently
            crypto.to_ring(values)
        assert str(refused.value) == reason
    largest = (2.0**62 - 512) / 2**crypto.FRACTION_BITS  # the largest float within (2^63 - 1) // 2 steps
    y = crypto.to_ring(np.array([largest]), summands=2)
    assert (y + y).view(np.int64).tolist() == [2**63 - 1024]  # two of them sum without wrapping
    with pytest.raises(crypto.Unrepresentable, match=r"^1 of 1 entries are beyond ±2\.74878e\+11, past which a "
                       r"sum of 2 inputs could wrap$"):
        crypto.to_ring(np.array([2.0**38]), summands=2)


def _diverge(monkeypatch, job: str, node: int, value: float) -> None:
    """Node `node`'s model becomes `value` everywhere just before it masks its input (crypto's `job`)."""
    real = getattr(crypto, job)

    def diverged(model, *args):
        if args[3 if job == "masked_input" else 2] == node:  # its `me` argument
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(value)
        return real(model, *args)
    monkeypatch.setattr(crypto, job, diverged)


@pytest.mark.parametrize("value,reason", [
    (float("nan"), "1210 of 1211 entries are not finite"),
    (1e12, "1210 of 1211 entries are beyond ±1.83252e+11, past which a sum of 3 inputs could wrap"),
], ids=["nan", "1e12"])
def test_a_diverged_client_withholds_its_input_and_the_others_are_summed(tmp_path, monkeypatch, value, reason):
    # before, client 2's input went into the sum as -2^39 in each entry (NaN, and 1e12 n_2 past 2^39 alike)
    _diverge(monkeypatch, "masked_input", 2, value)
    summary, rows = _run(tmp_path / "r", "--nodes", "4", "--rounds", "1", "--timeout", "1",
                         "--secure-aggregation", "secagg")
    assert [(r["heard_from"], r["secagg_dropped"], r["secagg_failed"]) for r in _server_rows(rows)] == [(2, 1, 0)]
    assert _jsonl(tmp_path / "r" / "secagg.jsonl") == [
        {"round": 0, "node": 2, "outcome": "withheld", "phase": "secagg.masked", "reason": reason},
        {"round": 0, "node": 0, "outcome": "ok", "clients": 3, "masked": 2, "dropped": 1}]
    assert summary["secagg_rounds_failed"] == 0


# -- what a client checks in the server's messages (Bonawitz's rounds 1 and 4)

def _options(mode="secagg", threshold=0):
    return SimpleNamespace(secure_aggregation=mode, secagg_threshold=threshold, clients_per_round=0)


MINE = [b"c" * 32, b"s" * 32]
OTHERS = {v: [bytes([v]) * 32, bytes([v + 10]) * 32] for v in (2, 3, 4, 5)}


@pytest.mark.parametrize("mode,threshold,listed,t,fault", [
    ("secagg", 0, {1: MINE, **OTHERS}, 3, ""),
    ("secagg+", 0, OTHERS, 3, ""),  # SecAgg+ lists the neighbours only
    ("secagg", 2, {1: MINE, **OTHERS}, 2, ""),
    ("secagg", 0, OTHERS, 3, "the list of U1 leaves this client out or gives it other keys"),
    ("secagg+", 0, {1: OTHERS[2], **OTHERS}, 3, "the list of U1 leaves this client out or gives it other keys"),
    ("secagg", 4, {1: MINE, **OTHERS}, 3, "the threshold t = 3 is not the run's --secagg-threshold 4"),
    ("secagg", 0, {1: MINE, **OTHERS}, 2, "the threshold t = 2 is below max(2, a majority of the 5 holders of its "
                                          "secrets)"),
    ("secagg", 0, {1: MINE, **OTHERS}, 6, "the threshold t = 6 exceeds the 5 holders of its secrets"),
])
def test_a_client_refuses_a_key_list_that_round_1_forbids(mode, threshold, listed, t, fault):
    client = secagg.SecureClient(_options(mode, threshold), 0, [1, 2, 3, 4, 5])
    assert client.key_list_fault(1, MINE, listed, t) == fault


@pytest.mark.parametrize("threshold,listed,t,degree,fault", [
    (0, {1: MINE, **OTHERS}, 3, 5, ""),  # floor(5 / 2) + 1
    (0, {1: MINE, 2: OTHERS[2]}, 3, 4, "the threshold t = 3 exceeds the 2 holders of its secrets"),
    (0, OTHERS, 3, 5, "the list of U1 leaves this node out or gives it other keys"),
    (0, {1: OTHERS[2], **OTHERS}, 3, 5, "the list of U1 leaves this node out or gives it other keys"),
    (0, {1: MINE, **OTHERS}, 2, 5, "the threshold t = 2 is not the run's for an aggregator of 5 neighbours"),
    (0, {1: MINE, **OTHERS}, 2, 2, "the threshold t = 2 is not the run's for an aggregator of 2 neighbours"),
    (4, {1: MINE, **OTHERS}, 3, 5, "the threshold t = 3 is not the run's for an aggregator of 5 neighbours"),
    (6, {1: MINE, **OTHERS}, 6, 5, "the threshold t = 6 exceeds the 5 holders of its secrets"),
])
def test_a_contributor_refuses_an_aggregators_key_list_that_round_1_forbids(threshold, listed, t, degree, fault):
    mixing = SecureMixing(_options(threshold=threshold))
    part = Part({"c": MINE[0], "s": MINE[1]})
    assert mixing.key_list_fault(1, part, {"t": t, "degree": degree, "keys": listed}) == fault


def test_clients_refuse_a_threshold_other_than_the_runs_and_the_round_fails(tmp_path, monkeypatch):
    # the server announces t = 2 in a run of --secagg-threshold 3: before, every client shared its secrets 2-of-3
    of = secagg.Plan.of.__func__
    monkeypatch.setattr(secagg.Plan, "of", classmethod(lambda cls, o, n: dataclasses.replace(of(cls, o, n), t=2)))
    summary, rows = _run(tmp_path / "r", "--nodes", "4", "--rounds", "1", "--timeout", "1",
                         "--secure-aggregation", "secagg", "--secagg-threshold", "3")
    assert [r["secagg_refused"] for r in rows if r["node"] != 0] == [1, 1, 1]
    refusals = [{"round": 0, "node": u, "outcome": "refused", "phase": "secagg.keys",
                 "reason": "the threshold t = 2 is not the run's --secagg-threshold 3"} for u in (1, 2, 3)]
    assert _jsonl(tmp_path / "r" / "secagg.jsonl") == [*refusals, {
        "round": 0, "node": 0, "outcome": "failed", "phase": "secagg.shares",
        "reason": "0 of 3 clients answered, below the threshold 2", "clients": 3}]
    assert summary["secagg_rounds_failed"] == 1


@pytest.mark.parametrize("survivors,fault", [
    ([1, 2, 3], ""),
    ([1, 2, 4], "survivors [4] are not in U2"),  # 4 never shared with client 1
    ([1], "the survivors number 1, below the threshold 2"),
])
def test_a_client_refuses_survivors_that_round_4_forbids(survivors, fault):
    sent, records = [], []
    node = SimpleNamespace(id=1, round=0, num_nodes=5, send=lambda *message: sent.append(message),
                           record=lambda stream, **row: records.append(row))

    async def next_message(node, kind, valid):
        body = {"round": 0, "survivors": survivors}
        assert kind == secagg.UNMASK and valid(body)
        return SimpleNamespace(body=body)
    held = {u: bytes([u]) * 2 * crypto.SHARE_BYTES for u in (1, 2, 3)}
    client = secagg.SecureClient(_options(), 0, [1, 2, 3, 4])
    refused = asyncio.run(client._unmask(node, held, {1, 2, 3}, 2, next_message))
    assert (refused, len(sent)) == ((1, 0) if fault else (0, 1))
    assert records == ([{"outcome": "refused", "phase": "secagg.unmask", "reason": fault}] if fault else [])


def test_the_graph_of_secagg_plus_is_k_regular_and_symmetric():
    plan = secagg.Plan("secagg+", 50, 12, 7)
    graph = secagg.neighbourhoods(plan, list(range(1, 51)), np.random.default_rng(0))
    assert all(len(peers) == 12 for peers in graph.values())
    assert all(u in graph[v] for u, peers in graph.items() for v in peers)
    assert 12 == 2 * math.ceil(math.log2(50))


def test_a_secure_run_leaves_the_protocol_object_unchanged(tmp_path):
    from emulator.compute import ThreadExecutor
    from emulator.protocol import RunInfo, protocols
    from p2p_emulator.build import build_emulation, build_topology
    from p2p_emulator.settings import resolve
    from tests.test_isolation import fingerprint

    registry = protocols()
    config, options = resolve({"protocol": "fedavg", "topology": "star", "nodes": 5, "rounds": 2, "quiet": True,
                               "no_plots": True, "model": "mlp:hidden=16", "secure_aggregation": "secagg+"}, registry)
    graph, _ = build_topology(config)
    protocol = registry["fedavg"](options, RunInfo(5, 2, Seeds(0), graph, "cpu", tmp_path))
    before = fingerprint(vars(protocol))
    with ThreadExecutor(2) as executor:
        build_emulation(config, graph, protocol, executor).run()
    assert fingerprint(vars(protocol)) == before


def test_checkpoints_between_rounds_change_nothing(tmp_path):
    args = ["--nodes", "5", "--rounds", "3", "--secure-aggregation", "secagg"]
    _run(tmp_path / "plain", *args)
    _run(tmp_path / "checkpointed", *args, "--checkpoint-every", "1")
    assert _jsonl(tmp_path / "plain" / "metrics.jsonl") == _jsonl(tmp_path / "checkpointed" / "metrics.jsonl")


# -- the decentralized variant: DFedAvgM's mixing step, each node the server of its neighbourhood

MESH = ["--protocol", "dfedavgm", "--dataset", "digits", "--model", "mlp:hidden=16", "--quiet", "--no-plots"]


def _run_dfedavgm(out, *args):
    assert main([*MESH, *args, "--out", str(out)]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_secure_mixing_mixes_what_dfedavgm_mixes(tmp_path):
    args = ["--topology", "regular:d=4", "--nodes", "8", "--rounds", "2"]
    plain = _run_dfedavgm(tmp_path / "plain", *args)
    rows = _run_dfedavgm(tmp_path / "secure", *args, "--secure-aggregation", "secagg")
    for a, b in zip(plain, rows):
        assert (a["node"], a["round"], a["heard_from"]) == (b["node"], b["round"], b["heard_from"])
        assert b["test_acc"] == a["test_acc"]
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert b["consensus_distance"] == pytest.approx(a["consensus_distance"], rel=1e-4)


def test_secure_mixing_bytes_are_its_frames_2_n_d_squared_shares(tmp_path):
    n, d = 8, 4
    _run_dfedavgm(tmp_path / "r", "--topology", f"regular:d={d}", "--nodes", str(n), "--rounds", "1", "--trace",
                  "--secure-aggregation", "secagg")
    measured = collections.Counter()
    for message in _jsonl(tmp_path / "r" / "messages.jsonl"):
        measured[message["kind"]] += message["bytes"]
    key, ct, share, ids = bytes(32), bytes(crypto.CIPHERTEXT_BYTES), bytes(crypto.SHARE_BYTES), list(range(d))
    per_link = {  # n d directed links, one message of each kind each
        "secagg.keys": {"round": 0, "c": key, "s": key, "degree": d},
        "secagg.keys.list": {"round": 0, "t": 3, "degree": d, "keys": {v: [key, key] for v in ids}},
        "secagg.shares": {"round": 0, "shares": {v: ct for v in ids[1:]}},
        "secagg.shares.relay": {"round": 0, "shares": {v: ct for v in ids[1:]}},
        "secagg.masked": {"round": 0, "y": np.zeros(ENTRIES, np.uint64)},
        "secagg.unmask.request": {"round": 0, "survivors": ids},
        "secagg.unmask": {"round": 0, "b": {v: share for v in ids}, "s": {}},
    }
    assert dict(measured) == {kind: n * d * _frame(kind, 0, body) for kind, body in per_link.items()}
    # sealed shares: d - 1 from each member of each of the n cohorts, up and relayed down
    assert 2 * n * d * (d - 1) == 192


def test_a_node_silent_after_masking_is_recovered_in_each_neighbourhood(tmp_path):
    # 1 of 10 nodes silent after its masked input each round: in each neighbourhood holding it, its input counts
    # and its self mask is rebuilt from its neighbours' shares, so every node mixes what plain DFedAvgM mixes
    args = ["--topology", "regular:d=4", "--nodes", "10", "--rounds", "2", "--timeout", "1"]
    plain = _run_dfedavgm(tmp_path / "plain", *args)
    rows = _run_dfedavgm(tmp_path / "r", *args, "--secure-aggregation", "secagg", "--secagg-dropout", "0.1")
    records = _jsonl(tmp_path / "r" / "secagg.jsonl")
    assert len(records) == 20 and all(r["outcome"] == "ok" for r in records)
    assert {r["heard_from"] for r in rows} == {4}  # the silent node's input counts: it was masked
    assert [(r["node"], r["round"]) for r in rows] == [(r["node"], r["round"]) for r in plain]
    for a, b in zip(plain, rows):
        assert b["test_acc"] == a["test_acc"]
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)


def test_a_diverged_node_withholds_its_model_from_each_neighbourhood(tmp_path, monkeypatch):
    # node 2's model is NaN: its 4 aggregators (1, 3, 4, 5) each mix the other 3 (before: -2^39 in every entry).
    # Its own aggregation fails: its neighbours answer its unmask request only after waiting out its input, past
    # its timeout (the lockstep docs/secure-aggregation.md describes); its model is NaN anyway.
    _diverge(monkeypatch, "masked_model", 2, float("nan"))
    rows = _run_dfedavgm(tmp_path / "r", "--topology", "regular:d=4", "--nodes", "6", "--rounds", "1", "--timeout",
                         "1", "--secure-aggregation", "secagg")
    assert _jsonl(tmp_path / "r" / "secagg.jsonl") == [
        *({"round": 0, "node": 2, "outcome": "withheld", "phase": "secagg.masked", "aggregator": i,
           "reason": "1210 of 1210 entries are not finite"} for i in (1, 3, 4, 5)),
        {"round": 0, "node": 2, "outcome": "failed", "phase": "secagg.unmask",
         "reason": "0 of 4 neighbours answered, below the threshold 3", "clients": 4},
        {"round": 0, "node": 0, "outcome": "ok", "clients": 4, "masked": 4, "dropped": 0},
        *({"round": 0, "node": i, "outcome": "ok", "clients": 4, "masked": 3, "dropped": 1} for i in (4, 5, 1, 3))]
    assert [r["heard_from"] for r in rows] == [4, 3, 0, 3, 3, 3]


@pytest.mark.parametrize("args,named", [
    (["--topology", "ring", "--secure-aggregation", "secagg+"], "--secure-aggregation secagg+"),
    (["--topology", "ring", "--secure-aggregation", "secagg", "--sparsify", "topk:0.1"], "--secure-aggregation secagg"),
    (["--topology", "line", "--secure-aggregation", "secagg"], "node 0 has 1 neighbours"),
    (["--topology", "ring", "--secure-aggregation", "secagg", "--secagg-threshold", "3"], "--secagg-threshold 3"),
])
def test_bad_secure_mixing_options_exit_2_with_one_line(tmp_path, capsys, args, named):
    assert main([*MESH, "--nodes", "6", "--rounds", "1", *args, "--out", str(tmp_path / "r")]) == 2
    assert_one_line_error(capsys, named)


def test_the_two_directions_of_a_pair_never_share_a_nonce():
    """A pair's key serves both ways in a round: under one nonce, the same plaintext would seal to the same
    ciphertext body both ways (and AES-GCM's keystream and authenticator would leak)."""
    key, plaintext = bytes(range(32)), bytes(2 * crypto.SHARE_BYTES)
    there, back = crypto.seal(key, 3, 1, 2, plaintext), crypto.seal(key, 3, 2, 1, plaintext)
    assert there[:-crypto.TAG_BYTES] != back[:-crypto.TAG_BYTES]
    assert crypto.unseal(key, 3, 2, 1, back) == plaintext and crypto.unseal(key, 3, 1, 2, back) is None
