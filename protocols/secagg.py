"""Secure aggregation for FedAvg (--secure-aggregation secagg|secagg+): the server learns the sum of
the sampled clients' updates and nothing else of any one of them.

SecAgg is Bonawitz et al. (CCS 2017), the semi-honest (honest-but-curious) variant: no signatures
and no consistency check round. SecAgg+ is Bell et al. (CCS 2020): the same rounds, but each client
shares keys and masks with its k neighbours on a sparse graph the server draws each round.
A round r of FedAvg with secure aggregation, cohort U0 (the sampled clients), threshold t:
  0. the server sends the global model x, as plain FedAvg does;
  1. keys: each client u makes two X25519 key pairs, (c_u, c_u^PK) for the share exchange and
     (s_u, s_u^PK) for the masks, and a self-mask seed b_u, and sends c_u^PK, s_u^PK; the server
     waits for U1 (|U1| >= t) and sends each client its neighbours' public keys (SecAgg: U1's);
  2. shares: u splits s_u and b_u t-of-(|N(u)|+1) with Shamir over GF(2^521 - 1), keeps its own
     pair and seals each neighbour v's under AES-GCM with HKDF(X25519(c_u, c_v^PK)); the server
     relays each ciphertext to its recipient (U2, |U2| >= t); then every client trains;
  3. masked: u sends y_u = X_u + PRG(b_u) + sum_{v in N(u) cap U2} +-PRG(HKDF(X25519(s_u, s_v^PK))) in
     Z_{2^64} (+ for v > u), X_u the fixed-point n_u (x_u - x) and n_u; PRG is AES-256-CTR (U3, >= t);
  4. unmask: the server sends each u the survivors U3 (SecAgg+: those among N(u)); u returns its
     shares of b_v for survivors v and of s_v for dropped v in U2 - U3, never both for one v (U4 >= t);
     the server rebuilds each secret from t shares, checks each rebuilt s_v against s_v^PK, removes
     the self masks and the dropped clients' pairwise masks, and sets x <- x + sum X_u[:-1] / sum n_u.
A phase below t, or a secret with fewer than t shares, fails the round: the reason goes to
secagg.jsonl, x stays, the run goes on. Bodies failing their checks (a public key X25519 refuses
among them) are dropped as invalid on the ledger; a sealed share failing authentication is refused
and counted in secagg_refused, and so is a server's message failing Bonawitz's client checks (the
client in U1 with its keys, t the run's; U3 within U2 and at least t), its reason in secagg.jsonl.
A client whose input is not finite or so large that the cohort's sum could wrap (crypto.to_ring)
withholds it, the reason in secagg.jsonl: a dropout, not garbage in the sum.

Departures from Flower's SecAgg+ (its key agreement, cipher, Shamir, PRG and quantisation): the
table in docs/secure-aggregation.md. Departures from the papers:
- semi-honest only: no signing keys, no PKI, no consistency-check round (Bonawitz's round 3);
- secrets are drawn from the run's seed stream, so that a seed gives the same run (a deployment draws
  them from os.urandom); a pair's AES-GCM key is new each round and serves both directions, so each
  message's nonce is its sender and recipient;
- the field is GF(2^521 - 1) for every secret, and the input ring Z_{2^64} with 24 fractional bits;
  the client's input is its sample-weighted update and its sample count (FedAvg's weights), as
  Flower's SecAgg+ does, so the server learns only sum n_u;
- SecAgg+'s graph is a Harary graph H(k, |U0|) over a seeded random ordering of the cohort (each client
  takes the k/2 before and after it on a random ring), not Bell et al.'s Erdős–Rényi graph: every
  client has exactly k neighbours. k = 2 ceil(log2 |U0|) by default, Bell et al.'s O(log n) with
  constant 2 (their concrete parameters, for 40-bit statistical security, need hundreds of
  neighbours: above n here); the threshold is then over a neighbourhood and the client itself;
- SecAgg+ sends each client only its neighbours' keys and survivors (Bell et al.); SecAgg broadcasts
  the whole lists (Bonawitz);
- --secagg-dropout F silences, after their masked input, F of all clients drawn each round from the
  seed (the sampled ones among them drop): with every client sampled, exactly F of the cohort.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from emulator.errors import UsageError
from p2p_emulator.workloads.task import option_help

from . import secagg_crypto as crypto
from .common import CheckedOptions, check, entry_count, expects, node_ids

KEYS, SHARES, MASKED, UNMASK = "secagg.keys", "secagg.shares", "secagg.masked", "secagg.unmask"
MODES = ("none", "secagg", "secagg+")


@dataclass
class SecureAggregationOptions(CheckedOptions):
    secure_aggregation: str = field(default="none", metadata=option_help(
        "none, secagg (Bonawitz et al. 2017, semi-honest) or, fedavg only, secagg+ (Bell et al. 2020, k "
        "neighbours); dfedavgm: each node aggregates its neighbours securely"))
    secagg_threshold: int = field(default=0, metadata=option_help(
        "clients whose shares rebuild a secret (0: a majority of the holders: floor(n/2)+1 of a round's n "
        "clients; secagg+: of a client's k neighbours and itself)"))
    secagg_neighbours: int = field(default=0, metadata=option_help(
        "secagg+: each client's neighbours k, even (0: 2 ceil(log2 n), at most n-1)"))
    secagg_dropout: float = field(default=0.0, metadata=option_help(
        "fraction of the clients (dfedavgm: nodes), drawn each round from the seed, silent right after sending "
        "their masked input"))

    def validate(self):
        super().validate()
        check("secure-aggregation", repr(self.secure_aggregation), self.secure_aggregation in MODES,
              "choose none, secagg or secagg+")
        check("secagg-threshold", self.secagg_threshold, self.secagg_threshold == 0 or self.secagg_threshold >= 2,
              "must be at least 2 (0: a majority)")
        k = self.secagg_neighbours
        check("secagg-neighbours", k, k >= 0 and k % 2 == 0, "must be even and not negative (0: 2 ceil(log2 n))")
        check("secagg-dropout", self.secagg_dropout, 0 <= self.secagg_dropout < 1, "must be in [0, 1)")
        if self.secure_aggregation == "none":
            for flag, value in (("secagg-threshold", self.secagg_threshold), ("secagg-neighbours", k),
                                ("secagg-dropout", self.secagg_dropout)):
                check(flag, value, not value, "needs --secure-aggregation secagg or secagg+")
        elif self.secure_aggregation == "secagg":
            check("secagg-neighbours", self.secagg_neighbours, not self.secagg_neighbours,
                  "only secagg+ has neighbourhoods (secagg: every client)")


@dataclass(frozen=True)
class Plan:
    """A round's sizes: the cohort n, each client's neighbours k (n - 1 under SecAgg) and the threshold t."""
    mode: str
    n: int
    k: int
    t: int

    @classmethod
    def of(cls, options, n: int) -> "Plan":
        mode, k = options.secure_aggregation, n - 1
        if mode == "secagg+":
            k = options.secagg_neighbours or min(n - 1, 2 * math.ceil(math.log2(max(n, 2))))
        return cls(mode, n, k, options.secagg_threshold or (k + 1) // 2 + 1)

    def check(self, clients: str) -> None:
        """Refuse, in one line, sizes no round can meet; `clients` says where n comes from."""
        if self.n < 2:
            raise UsageError(f"--secure-aggregation {self.mode}: needs at least 2 clients a round ({clients})")
        check("secagg-neighbours", self.k, self.k <= self.n - 1, f"more than the other clients of a round ({clients})")
        holders = "clients of a round" if self.mode == "secagg" else "holders of each secret (k neighbours and itself)"
        check("secagg-threshold", self.t, self.t <= self.k + 1, f"larger than the {self.k + 1} {holders} ({clients})")


def neighbourhoods(plan: Plan, cohort: list[int], rng: np.random.Generator) -> dict[int, list[int]]:
    """Each client's neighbours: all the others (SecAgg, or k = n - 1), else a Harary graph H(k, n) on a
    random ring of the cohort: the k/2 clients on each side."""
    if plan.k >= len(cohort) - 1:
        return {u: [v for v in cohort if v != u] for u in cohort}
    ring = [cohort[i] for i in rng.permutation(len(cohort))]
    n, half = len(ring), plan.k // 2
    return {ring[i]: sorted(ring[(i + d) % n] for d in range(-half, half + 1) if d) for i in range(n)}


def dropping(node, clients: list[int], fraction: float) -> set[int]:
    """The clients --secagg-dropout silences after their masked input this round (the same on every node)."""
    count = round(fraction * len(clients))
    return set(node.seeds.numpy("secagg.dropout", node.round).choice(clients, size=count, replace=False).tolist())


# -- body checks

def this_round(node):
    rnd = node.round
    return lambda value: type(value) is int and value == rnd


def public_key(value) -> bool:
    """32 bytes X25519 can agree with: a low-order point (32 zero bytes, say) would make every agreement raise."""
    return isinstance(value, bytes) and len(value) == crypto.KEY_BYTES and crypto.agreeable(value)


def id_map(ids, item):
    """A dict {id: value} with ids among `ids` and each value passing `item`."""
    allowed = set(ids)
    return lambda d: isinstance(d, dict) and all(type(k) is int and k in allowed and item(v) for k, v in d.items())


def sealed(value) -> bool:
    return isinstance(value, bytes) and len(value) == crypto.CIPHERTEXT_BYTES


def key_pair_list(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(map(public_key, value))


# what the server accepts in each phase
def keys_body(node):
    return expects(round=this_round(node), c=public_key, s=public_key)


def shares_body(node, senders):
    return expects(round=this_round(node), shares=id_map(senders, sealed))


def masked_body(node, length: int):
    return expects(round=this_round(node), y=np.zeros(length, dtype=crypto.RING))


def unmask_body(node, survivors, dropped):
    return expects(round=this_round(node), b=id_map(survivors, crypto.is_share), s=id_map(dropped, crypto.is_share))


class Failed(Exception):
    """A round that cannot finish: its phase and why."""

    def __init__(self, phase: str, reason: str):
        super().__init__(f"{phase}: {reason}")
        self.phase, self.reason = phase, reason


# -- the server

class SecureServer:
    """The server's side of a round; the protocol object's options, no state of its own."""

    def __init__(self, options):
        self.options = options

    async def round(self, node, model, state: dict, sampled: list[int]) -> dict:
        """Run the phases after the model went out; the metrics to log. x stays if the round fails."""
        plan = Plan.of(self.options, len(sampled))
        graph = neighbourhoods(plan, sampled, node.seeds.numpy("secagg.graph", node.round))
        refused: list[int] = []
        waiting = sampled
        try:
            keys = await self._keys(node, plan, graph, sampled, refused)
            waiting = list(keys)
            sealed_by = await self._shares(node, plan, graph, keys, refused)
            waiting = list(sealed_by)
            masked = await self._masked(node, plan, graph, sealed_by, input_length(state))
            total = await self._unmask(node, plan, graph, keys, sealed_by, masked)
        except Failed as failure:
            # those still waiting for the server's next message of the round end it now
            notice = {KEYS: KEYS, SHARES: SHARES, MASKED: UNMASK}.get(failure.phase)
            if notice:
                node.broadcast(notice, None, to=waiting)
            node.record("secagg", outcome="failed", phase=failure.phase, reason=failure.reason, clients=len(sampled))
            return {"heard_from": 0, "secagg_failed": 1, "secagg_refused": len(refused)}
        await node.compute(crypto.add_average, model, total, work=0)
        dropped = len(sealed_by) - len(masked)
        node.record("secagg", outcome="ok", clients=len(sampled), masked=len(masked), dropped=dropped)
        return {"heard_from": len(masked), "secagg_failed": 0, "secagg_dropped": dropped,
                "secagg_refused": len(refused)}

    async def _gather(self, node, kind: str, plan: Plan, peers, valid) -> dict:
        got = await node.gather(kind, peers=sorted(peers), timeout=self.options.timeout, valid=valid)
        if len(got) < plan.t:
            raise Failed(kind, f"{len(got)} of {len(peers)} clients answered, below the threshold {plan.t}")
        return got

    async def _keys(self, node, plan, graph, sampled, refused) -> dict[int, list[bytes]]:
        """U1: {u: [c_u^PK, s_u^PK]}, each client told its neighbours' keys. Copied keys are refused."""
        got = await node.gather(KEYS, peers=sampled, timeout=self.options.timeout, valid=keys_body(node))
        seen = [k for m in got.values() for k in (m.body["c"], m.body["s"])]
        keys = {u: [m.body["c"], m.body["s"]] for u, m in got.items()
                if seen.count(m.body["c"]) == seen.count(m.body["s"]) == 1 and m.body["c"] != m.body["s"]}
        refused += sorted(set(got) - set(keys))
        if len(keys) < plan.t:
            raise Failed(KEYS, f"{len(keys)} of {len(sampled)} clients advertised keys, below the threshold {plan.t}")
        if plan.mode == "secagg":
            node.broadcast(KEYS, {"round": node.round, "t": plan.t, "keys": keys}, to=list(keys))
        else:
            for u in keys:
                node.send(u, KEYS, {"round": node.round, "t": plan.t,
                                    "keys": {v: keys[v] for v in graph[u] if v in keys}})
        return keys

    async def _shares(self, node, plan, graph, keys, refused) -> dict[int, dict[int, bytes]]:
        """U2: {u: {v: sealed shares for v}}, each relayed to its recipient. A bundle must hold exactly one
        ciphertext for each of the sender's neighbours in U1."""
        got = await self._gather(node, SHARES, plan, keys, shares_body(node, keys))
        bundles = {}
        for u, message in got.items():
            if set(message.body["shares"]) == {v for v in graph[u] if v in keys}:
                bundles[u] = message.body["shares"]
            else:
                refused.append(u)
        if len(bundles) < plan.t:
            raise Failed(SHARES, f"{len(bundles)} clients shared keys, below the threshold {plan.t}")
        for v in bundles:
            node.send(v, SHARES, {"round": node.round, "shares": {u: b[v] for u, b in bundles.items() if v in b}})
        return bundles

    async def _masked(self, node, plan, graph, bundles, length) -> dict[int, np.ndarray]:
        """U3: {u: y_u}; then each survivor is told who survived (SecAgg+: among its neighbours)."""
        got = await self._gather(node, MASKED, plan, bundles, masked_body(node, length))
        masked = {u: m.body["y"] for u, m in got.items()}
        if plan.mode == "secagg":
            node.broadcast(UNMASK, {"round": node.round, "survivors": sorted(masked)}, to=list(masked))
        else:
            for u in masked:
                mine = sorted(v for v in [u, *graph[u]] if v in masked)
                node.send(u, UNMASK, {"round": node.round, "survivors": mine})
        return masked

    async def _unmask(self, node, plan, graph, keys, bundles, masked) -> np.ndarray:
        """The sum of the survivors' inputs, from their masked inputs and at least t shares of each secret."""
        dropped = [v for v in bundles if v not in masked]
        got = await self._gather(node, UNMASK, plan, masked, unmask_body(node, masked, dropped))
        survivors_of = {v: {u: keys[u][1] for u in graph[v] if u in masked} for v in dropped}
        return await recover_sum(node, plan.t, keys, masked, got, survivors_of)


def secure(options) -> bool:
    """Whether a run aggregates securely (FedMN and D-PSGD, subclasses of FedAvg and DFedAvgM, have no such
    option)."""
    return isinstance(options, SecureAggregationOptions) and options.secure_aggregation != "none"


async def recover_sum(node, t: int, keys: dict, masked: dict, answers: dict, survivors_of: dict) -> np.ndarray:
    """sum_u y_u over the survivors, unmasked: each survivor's b and each dropped client's s rebuilt from t of
    the shares in `answers` (the unmask messages); survivors_of[v]: {u: s_u^PK} of the survivors that masked
    with dropped v."""
    b_shares = {u: {h: m.body["b"][u] for h, m in answers.items() if u in m.body["b"]} for u in masked}
    s_shares = {v: {h: m.body["s"][v] for h, m in answers.items() if v in m.body["s"]} for v in survivors_of}
    short = {u: len(s) for u, s in (*b_shares.items(), *s_shares.items()) if len(s) < t}
    if short:
        u, count = next(iter(short.items()))
        raise Failed(UNMASK, f"{len(short)} secrets have fewer than {t} shares (client {u}'s: {count})")
    seeds, private = await rebuild(node, t, first(b_shares, t), first(s_shares, t), keys)
    total = np.zeros(len(next(iter(masked.values()))), dtype=crypto.RING)
    with np.errstate(over="ignore"):
        for y in masked.values():
            total += y
    expansions = len(seeds) + sum(map(len, survivors_of.values()))
    return await node.compute(crypto.unmask, total, node.round, seeds, private, survivors_of,
                              work=crypto.work(expansions * (len(total) * crypto.PRG_ENTRY_WORK
                                                             + crypto.AGREEMENT_WORK)))


async def rebuild(node, t: int, b_shares, s_shares, keys) -> tuple[dict[int, bytes], dict[int, bytes]]:
    """The survivors' self-mask seeds and the dropped clients' s keys, each s checked against its public key."""
    seeds, private, wrong = await node.compute(
        crypto.recover, b_shares, s_shares, {v: keys[v][1] for v in s_shares},
        work=crypto.work((len(b_shares) + len(s_shares)) * (2 * t**2 * crypto.FIELD_WORK + crypto.INVERSE_WORK)
                         + len(s_shares) * crypto.AGREEMENT_WORK))
    if wrong:
        raise Failed(UNMASK, f"the rebuilt mask keys of clients {wrong} do not match their public keys")
    return seeds, private


def first(shares: dict[int, dict[int, bytes]], t: int) -> dict[int, dict[int, bytes]]:
    """t shares of each secret (those of the lowest holders): Lagrange needs no more."""
    return {u: dict(sorted(held.items())[:t]) for u, held in shares.items()}


def input_length(state: dict) -> int:
    """The input's entries: one per float entry of the model, and the sample count."""
    return entry_count(state) + 1


# -- a client

class SecureClient:
    """A client's side of a round, from the model it received to its unmask answer."""

    def __init__(self, options, server: int, clients: list[int]):
        self.options, self.server, self.clients = options, server, clients
        self.cohort = options.clients_per_round or len(clients)  # the most inputs a sum can hold

    def key_list_fault(self, me: int, mine: list[bytes], listed: dict, t: int) -> str:
        """Why this client refuses the server's key list (Bonawitz's round 1 checks), or "": the list must hold
        the client with its own keys (SecAgg+ lists only the neighbours: there, if at all), and t must be the
        run's: --secagg-threshold if set, else at least max(2, a majority of the holders the client sees), as
        the default always is (the client cannot tell the cohort's size); and at most those holders."""
        if listed.get(me, mine) != mine or (self.options.secure_aggregation == "secagg" and me not in listed):
            return "the list of U1 leaves this client out or gives it other keys"
        holders = len(set(listed) - {me}) + 1
        fixed = self.options.secagg_threshold
        if fixed and t != fixed:
            return f"the threshold t = {t} is not the run's --secagg-threshold {fixed}"
        if not fixed and t < max(2, holders // 2 + 1):
            return f"the threshold t = {t} is below max(2, a majority of the {holders} holders of its secrets)"
        if t > holders:
            return f"the threshold t = {t} exceeds the {holders} holders of its secrets"
        return ""

    async def round(self, node, protocol, model, data, start: dict, next_message) -> dict:
        """Keys, shares, training, masked input, unmask; the metrics to log ({} if the round was abandoned)."""
        keys = await node.compute(crypto.client_keys, node.seeds.numpy("secagg.keys", node.id, node.round).bytes(96),
                                  work=crypto.work(2 * crypto.AGREEMENT_WORK))
        node.send(self.server, KEYS, {"round": node.round, "c": keys["c"], "s": keys["s"]})
        message = await next_message(node, KEYS, expects(round=this_round(node), t=int,
                                                         keys=id_map(range(node.num_nodes), key_pair_list)))
        if message is None:
            return {}
        t, listed = message.body["t"], message.body["keys"]
        fault = self.key_list_fault(node.id, [keys["c"], keys["s"]], listed, t)
        if fault:
            record_refusal(node, KEYS, fault)
            return {"secagg_refused": 1}  # this client sits the round out
        peers = {v: k for v, k in listed.items() if v != node.id}
        exchanged = await self._share(node, keys, peers, t, next_message)
        if exchanged is None:
            return {}
        held, mask_peers, refused = exchanged
        loss = await protocol.train(node, model, data)
        length = input_length(start)
        y, fault = await node.compute(crypto.masked_input, model, start, len(data.train_y), keys, node.id,
                                      node.round, mask_peers, self.cohort,
                                      work=crypto.work((len(mask_peers) + 1) * length * crypto.PRG_ENTRY_WORK
                                                       + len(mask_peers) * crypto.AGREEMENT_WORK))
        if y is None:  # a dropout from here on: the server rebuilds its s key and sums the others' inputs
            node.record("secagg", outcome="withheld", phase=MASKED, reason=fault)
            return {"train_loss": loss, "params_sent": 0, "secagg_refused": len(refused)}
        node.send(self.server, MASKED, {"round": node.round, "y": y})
        refusals = 0
        if node.id not in dropping(node, self.clients, self.options.secagg_dropout):  # else silent, as if offline
            refusals = await self._unmask(node, held, {node.id, *mask_peers}, t, next_message)
        return {"train_loss": loss, "params_sent": length, "secagg_refused": len(refused) + refusals}

    async def _share(self, node, keys: dict, peers: dict, threshold: int, next_message):
        """Send the sealed shares, open those relayed: ({sender: its shares for this client}, {v: s_v^PK} of
        U2's peers, [senders whose shares failed authentication]); None if the server gave up."""
        r = node.round
        sealed_out, own = await node.compute(
            crypto.share_secrets, keys, node.id, r, peers, threshold, node.seeds.integer("secagg.shamir", node.id, r),
            work=crypto.work(len(peers) * (crypto.AGREEMENT_WORK + crypto.SEAL_WORK
                                           + 2 * threshold * crypto.FIELD_WORK)))
        node.send(self.server, SHARES, {"round": r, "shares": sealed_out})
        message = await next_message(node, SHARES, expects(round=this_round(node), shares=id_map(peers, sealed)))
        if message is None:
            return None
        relayed = message.body["shares"]
        held, refused = await node.compute(crypto.open_shares, keys, node.id, r, peers, relayed,
                                           work=crypto.work(len(relayed) * (crypto.AGREEMENT_WORK + crypto.SEAL_WORK)))
        held[node.id] = own
        # every sender in U2 masks with this client, whether or not its shares opened
        return held, {u: peers[u][1] for u in relayed}, refused

    async def _unmask(self, node, held: dict, shared: set[int], t: int, next_message) -> int:
        """Reveal the shares the survivors call for, unless the list fails round 4's checks (survivors_fault:
        `shared` is U2 as this client saw it, itself included); 1 if it refused the list."""
        message = await next_message(node, UNMASK, expects(round=this_round(node), survivors=node_ids(node.num_nodes)))
        if message is None:
            return 0
        survivors = set(message.body["survivors"])
        fault = survivors_fault(survivors, shared, t)
        if fault:
            record_refusal(node, UNMASK, fault)
            return 1
        node.send(self.server, UNMASK, {"round": node.round, **reveal(held, survivors, node.id)})
        return 0


def survivors_fault(survivors: set[int], shared: set[int], t: int) -> str:
    """Why a client refuses the survivors U3 it is sent (Bonawitz's round 4 checks), or "": U3 must lie within U2
    as the client saw it (`shared`) and hold at least t clients: the server cannot unmask a sum of fewer than t
    inputs by naming fewer survivors, or by padding the list with ids that never shared."""
    if not survivors <= shared:
        return f"survivors {sorted(survivors - shared)} are not in U2"
    if len(survivors) < t:
        return f"the survivors number {len(survivors)}, below the threshold {t}"
    return ""


def record_refusal(node, phase: str, reason: str, **where) -> None:
    """A client's refusal of a server's message, in secagg.jsonl."""
    node.record("secagg", outcome="refused", phase=phase, **where, reason=reason)


def reveal(held: dict[int, bytes], survivors: set[int], me: int) -> dict[str, dict[int, bytes]]:
    """The shares a client gives up: b of each survivor, s of each one that dropped; never both for one client,
    and never its own s."""
    half = crypto.SHARE_BYTES
    return {"b": {u: pair[half:] for u, pair in held.items() if u in survivors},
            "s": {u: pair[:half] for u, pair in held.items() if u not in survivors and u != me}}
