"""DFedAvgM's mixing step under secure aggregation (dfedavgm --secure-aggregation secagg): node i learns
sum_{j in N(i)} w_ij x_j, not its neighbours' models.

Each node is the SecAgg server (Bonawitz et al., CCS 2017, semi-honest: protocols/secagg.py) of its own
neighbourhood and a client of each neighbour's aggregation, with fresh keys and self-mask seeds for each
(a secret revealed in one aggregation must not unmask the node in another). All nodes run the phases in
lockstep; in each, a node sends as a contributor, then gathers and answers as the aggregator:
  1. keys: j sends each neighbour i its public keys for i's aggregation and its degree; i sends back
     U1(i)'s keys, its own degree and t_i;
  2. shares: j seals its shares for the other members of each cohort it is in; each aggregator relays;
  3. masked: j sends i y = w_ij x_j + masks, w_ij from the two degrees (DFedAvgM's row);
  4. unmask: i names its survivors U3(i), they reveal their shares, and
     x_i <- (1 - sum_{j in U3(i)} w_ij) x_i + sum_{j in U3(i)} w_ij x_j: a silent neighbour's weight stays.
Below t_i in a phase, i keeps its own model that round and records why in secagg.jsonl.
Departures: those of protocols/secagg.py; the threshold is over a neighbourhood (floor(d_i/2) + 1, at
least 2, so every node needs two neighbours); undirected graphs only; no --sparsify, no robust rule.
As SecAgg's clients do, j refuses a key list failing round 1's checks (key_list_fault), withholds an input
to_ring refuses (a dropout of i's aggregation) and refuses survivors failing round 4's checks, each recorded
in secagg.jsonl with the aggregator i; unlike them, it counts none in its row, nor the shares that fail to open.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from emulator.errors import UsageError
from topologies import neighbour_weight

from . import secagg_crypto as crypto
from .common import entry_count, expects, node_ids, positive_int
from .secagg import (Failed, dropping, id_map, key_pair_list, masked_body, public_key, record_refusal, recover_sum,
                     reveal, sealed, shares_body, survivors_fault, this_round, unmask_body)

KEYS, KEY_LIST = "secagg.keys", "secagg.keys.list"  # to the aggregator, back to the contributors
SHARES, RELAYED = "secagg.shares", "secagg.shares.relay"
MASKED = "secagg.masked"
SURVIVORS, UNMASK = "secagg.unmask.request", "secagg.unmask"
NOTICE = {KEYS: KEY_LIST, SHARES: RELAYED, MASKED: SURVIVORS}  # what contributors wait for after each phase


def threshold(options, degree: int) -> int:
    return options.secagg_threshold or max(2, degree // 2 + 1)


def check_neighbourhoods(graph, options) -> None:
    """Refuse, in one line, a graph on which some aggregation can never reach its threshold."""
    if graph.is_directed():
        raise UsageError("--secure-aggregation secagg: dfedavgm needs an undirected topology (a neighbourhood is "
                         "both whom a node sends to and whom it hears)")
    node, degree = min(graph.degree, key=lambda pair: (pair[1], pair[0]))
    if degree < threshold(options, degree):
        flag = f"--secagg-threshold {options.secagg_threshold}" if options.secagg_threshold else \
            "--secure-aggregation secagg"
        raise UsageError(f"{flag}: node {node} has {degree} neighbours, fewer than the threshold "
                         f"{threshold(options, degree)} (every node needs at least 2)")


@dataclass
class Part:
    """A node's part in one neighbour's aggregation."""
    keys: dict
    peers: dict = field(default_factory=dict)  # v: [c_v^PK, s_v^PK], the other members of U1(i)
    t: int = 0
    weight: float = 0.0  # w_ij
    held: dict = field(default_factory=dict)  # sender: its shares for this node
    maskers: dict = field(default_factory=dict)  # v: s_v^PK, the other members of U2(i)


@dataclass
class Cohort:
    """A node's own aggregation, phase by phase."""
    t: int
    length: int  # entries of a model's float tensors
    failure: Failed | None = None
    keys: dict = field(default_factory=dict)  # U1: j -> [c_j^PK, s_j^PK]
    weights: dict = field(default_factory=dict)  # j -> w_ij
    bundles: dict = field(default_factory=dict)  # U2: j -> {v: sealed shares}
    masked: dict = field(default_factory=dict)  # U3: j -> y_j


class SecureMixing:
    """One node's round of secure mixing; the protocol object's options, no state of its own."""

    def __init__(self, options):
        self.options = options

    async def mix(self, node, model, state: dict) -> int:
        """Phases 1-4 in both roles; returns how many neighbours' models were mixed in (0: the aggregation
        failed, x_i stays)."""
        peers = node.neighbours
        own = Cohort(threshold(self.options, len(peers)), entry_count(state))
        parts = await self._advertise(node, peers)
        await self._step(node, own, self._list_keys, peers)
        parts = await self._share(node, parts, len(peers))
        await self._step(node, own, self._relay)
        parts = await self._open(node, parts)
        parts = await self._send_masked(node, model, parts, own.length)
        await self._step(node, own, self._name_survivors)
        if node.id not in dropping(node, list(range(node.num_nodes)), self.options.secagg_dropout):
            await self._reveal(node, parts)  # else silent from here on, in every aggregation it is in
        await self._step(node, own, self._mix_in, model)
        return self._report(node, own, len(peers))

    async def _step(self, node, own: Cohort, step, *args) -> None:
        """An aggregator's step, unless its aggregation failed before; a failure tells those waiting."""
        if own.failure is not None:
            return
        try:
            await step(node, own, *args)
        except Failed as failure:
            own.failure = failure
            if failure.phase in NOTICE:
                node.broadcast(NOTICE[failure.phase], None, to=node.neighbours)

    def _report(self, node, own: Cohort, degree: int) -> int:
        if own.failure is not None:
            node.record("secagg", outcome="failed", phase=own.failure.phase, reason=own.failure.reason,
                        clients=degree)
            return 0
        node.record("secagg", outcome="ok", clients=degree, masked=len(own.masked),
                    dropped=len(own.bundles) - len(own.masked))
        return len(own.masked)

    async def _gather(self, node, kind: str, peers, valid, slack: int = 1) -> dict:
        """What `peers` sent of `kind` within `slack` timeouts."""
        return await node.gather(kind, peers=sorted(peers), timeout=slack * self.options.timeout, valid=valid)

    # -- the contributor's side

    async def _advertise(self, node, peers) -> dict[int, Part]:
        """Phase 1: fresh keys for each neighbour's aggregation."""
        material = {i: node.seeds.numpy("secagg.keys", node.id, node.round, i).bytes(96) for i in peers}
        keys = await node.compute(aggregation_keys, material, work=crypto.work(2 * len(peers) * crypto.AGREEMENT_WORK))
        for i in peers:
            node.send(i, KEYS, {"round": node.round, "c": keys[i]["c"], "s": keys[i]["s"], "degree": len(peers)})
        return {i: Part(keys[i]) for i in peers}

    async def _share(self, node, parts: dict[int, Part], degree: int) -> dict[int, Part]:
        """Phase 2: the aggregations that listed this node; its sealed shares to each."""
        body = expects(round=this_round(node), t=int, degree=positive_int,
                       keys=id_map(range(node.num_nodes), key_pair_list))
        # a neighbour may start its round a timeout late (it waited out a silent node) and then wait for keys
        lists = await self._gather(node, KEY_LIST, parts, lambda b: b is None or body(b), slack=2)
        joined = {}
        for i, message in lists.items():
            listed = message.body
            if listed is None:
                continue
            fault = self.key_list_fault(node.id, parts[i], listed)
            if fault:
                record_refusal(node, KEY_LIST, fault, aggregator=i)
                continue
            part = joined[i] = parts[i]
            part.peers = {v: k for v, k in listed["keys"].items() if v != node.id}
            part.t, part.weight = listed["t"], neighbour_weight(self.options.mixing, listed["degree"], degree)
            sealed_out, own_share = await node.compute(
                crypto.share_secrets, part.keys, node.id, node.round, part.peers, part.t,
                node.seeds.integer("secagg.shamir", node.id, node.round, i),
                work=crypto.work(len(part.peers) * (crypto.AGREEMENT_WORK + crypto.SEAL_WORK
                                                    + 2 * part.t * crypto.FIELD_WORK)))
            part.held[node.id] = own_share
            node.send(i, SHARES, {"round": node.round, "shares": sealed_out})
        return joined

    def key_list_fault(self, me: int, part: Part, listed: dict) -> str:
        """Why this node refuses an aggregator's key list (round 1's checks, as the star's clients make them), or
        "": the list must hold the node with its keys for that aggregation, and t must be the run's threshold for
        the aggregator's degree, which no fewer than the listed may be, and at most the listed."""
        holders, t, degree = len(listed["keys"]), listed["t"], listed["degree"]
        if listed["keys"].get(me) != [part.keys["c"], part.keys["s"]]:
            return "the list of U1 leaves this node out or gives it other keys"
        if degree < holders or t != threshold(self.options, degree):
            return f"the threshold t = {t} is not the run's for an aggregator of {degree} neighbours"
        if t > holders:
            return f"the threshold t = {t} exceeds the {holders} holders of its secrets"
        return ""

    async def _open(self, node, parts: dict[int, Part]) -> dict[int, Part]:
        """Phase 2's end: the relayed shares of each aggregation still on, opened."""
        relays = await self._gather(node, RELAYED, parts, lambda b: b is None or expects(
            round=this_round(node), shares=id_map(range(node.num_nodes), sealed))(b), slack=2)
        on = {}
        for i, message in relays.items():
            part = parts[i]
            if message.body is None or not set(message.body["shares"]) <= set(part.peers):
                continue
            relayed = message.body["shares"]
            held, _ = await node.compute(crypto.open_shares, part.keys, node.id, node.round, part.peers, relayed,
                                         work=crypto.work(len(relayed) * (crypto.AGREEMENT_WORK + crypto.SEAL_WORK)))
            part.held.update(held)
            part.maskers = {u: part.peers[u][1] for u in relayed}
            on[i] = part
        return on

    async def _send_masked(self, node, model, parts: dict[int, Part], length: int) -> dict[int, Part]:
        """Phase 3: the masked w_ij x_j to each aggregation still on; those it went to. An input that cannot be one
        of the cohort's (secagg_crypto.to_ring) is withheld: a dropout there, not garbage in the sum."""
        sent = {}
        for i, part in parts.items():
            y, fault = await node.compute(crypto.masked_model, model, part.weight, part.keys, node.id,
                                          node.round, part.maskers, len(part.peers) + 1,
                                          work=crypto.work((len(part.maskers) + 1) * length * crypto.PRG_ENTRY_WORK
                                                           + len(part.maskers) * crypto.AGREEMENT_WORK))
            if y is None:
                node.record("secagg", outcome="withheld", phase=MASKED, aggregator=i, reason=fault)
                continue
            node.send(i, MASKED, {"round": node.round, "y": y})
            sent[i] = part
        return sent

    async def _reveal(self, node, parts: dict[int, Part]) -> None:
        """Phase 4: to each aggregator that asks, the shares of its survivors' b and its dropped members' s,
        unless its survivors fail round 4's checks (survivors_fault)."""
        body = expects(round=this_round(node), survivors=node_ids(node.num_nodes))
        requests = await self._gather(node, SURVIVORS, parts, lambda b: b is None or body(b), slack=2)
        for i, message in requests.items():
            if message.body is None:
                continue
            part, survivors = parts[i], set(message.body["survivors"])
            fault = survivors_fault(survivors, {node.id, *part.maskers}, part.t)
            if fault:
                record_refusal(node, SURVIVORS, fault, aggregator=i)
                continue
            node.send(i, UNMASK, {"round": node.round, **reveal(part.held, survivors, node.id)})

    # -- the aggregator's side

    @staticmethod
    def _enough(own: Cohort, phase: str, got: dict, of: int) -> None:
        if len(got) < own.t:
            raise Failed(phase, f"{len(got)} of {of} neighbours answered, below the threshold {own.t}")

    async def _list_keys(self, node, own: Cohort, peers) -> None:
        got = await self._gather(node, KEYS, peers, expects(
            round=this_round(node), c=public_key, s=public_key, degree=positive_int), slack=2)
        self._enough(own, KEYS, got, len(peers))
        own.keys = {j: [m.body["c"], m.body["s"]] for j, m in got.items()}
        own.weights = {j: neighbour_weight(self.options.mixing, len(peers), m.body["degree"]) for j, m in got.items()}
        node.broadcast(KEY_LIST, {"round": node.round, "t": own.t, "degree": len(peers), "keys": own.keys},
                       to=list(own.keys))

    async def _relay(self, node, own: Cohort) -> None:
        got = await self._gather(node, SHARES, own.keys, shares_body(node, own.keys))
        own.bundles = {u: m.body["shares"] for u, m in got.items() if set(m.body["shares"]) == set(own.keys) - {u}}
        self._enough(own, SHARES, own.bundles, len(own.keys))
        for v in own.bundles:
            node.send(v, RELAYED, {"round": node.round,
                                   "shares": {u: b[v] for u, b in own.bundles.items() if u != v}})

    async def _name_survivors(self, node, own: Cohort) -> None:
        got = await self._gather(node, MASKED, own.bundles, masked_body(node, own.length))
        self._enough(own, MASKED, got, len(own.bundles))
        own.masked = {u: m.body["y"] for u, m in got.items()}
        node.broadcast(SURVIVORS, {"round": node.round, "survivors": sorted(own.masked)}, to=list(own.masked))

    async def _mix_in(self, node, own: Cohort, model) -> None:
        dropped = [v for v in own.bundles if v not in own.masked]
        got = await self._gather(node, UNMASK, own.masked, unmask_body(node, own.masked, dropped))
        self._enough(own, UNMASK, got, len(own.masked))
        survivors_of = {v: {u: own.keys[u][1] for u in own.masked} for v in dropped}
        total = await recover_sum(node, own.t, own.keys, own.masked, got, survivors_of)
        self_weight = 1.0 - sum(own.weights[j] for j in own.masked)
        await node.compute(crypto.mix_sum, model, self_weight, total, work=0)


def aggregation_keys(material: dict[int, bytes]) -> dict[int, dict[str, bytes]]:
    """A node's round secrets for each neighbour's aggregation (a job)."""
    return {i: crypto.client_keys(m) for i, m in material.items()}
