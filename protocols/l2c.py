"""L2C (Li, Zhou, Tian, Tao; 2022): learning to collaborate with learnable mixing weights.

Every node keeps a personal model theta_i (all nodes start from the same theta^0,
so their updates live in one parameter space) and logits alpha_i over itself and
its neighbours. Round t at node i (Algorithm 1):
  1. theta~ = theta_i; local SGD on the train split.
  2. Delta_i = theta_i - theta~ (the paper's sign); send it to the neighbours that
     still listen to i.
  3. w_i = softmax(alpha_i) over {i} and the neighbours whose update arrived.
  4. theta_i <- theta_i - sum_j w_ij Delta_j (self included).
  5. One Adam step on alpha_i down the hypergradient of the validation loss at
     the new theta_i: dL/dw_ij = -<grad L_val(theta_i), Delta_j>, chained through
     the softmax. The new alpha applies from the next round. The paper's "Adam,
     weight decay 0.01" is read as decoupled decay (AdamW): hypergradients can be
     as small as 1e-6, and decay added to the gradient (torch's Adam) then
     dominates it, so Adam's normalised steps drive the parameters to 0 (meta-L2C's
     encoder collapsed to uniform weights that way on 20 nodes, shards:n=2).
  6. At round T0 node i drops the K0 neighbours with the smallest w_ij of that
     round (one it did not hear from counts as 0) and tells every neighbour which
     ones it keeps; from round T0 + 1 a node sends only to the neighbours that
     kept it, so the bytes of the model updates fall to (kept)/(original).

The mixing weights of every round go to graph.jsonl. When the partition knows
the tasks (e.g. mapl:scenario=1,clusters=5), summary.json says per node whether
its largest non-self weights are exactly its same-task neighbours.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from emulator.compute import Resident
from emulator.errors import UsageError
from emulator.protocol import register
from p2p_emulator.workloads.lazy import LazyModule
from p2p_emulator.workloads.training import difference, inner, loss_gradient

from .common import LearningProtocol, SGDOptions, TimeoutOptions, check, default, last_rows, like, node_ids

torch = LazyModule("torch")


@dataclass
class L2COptions(TimeoutOptions, SGDOptions):
    partition: str = default(SGDOptions, "partition", "shards:n=2")
    val_fraction: float = default(SGDOptions, "val_fraction", 0.2)
    norm: str = default(SGDOptions, "norm", "group")  # the paper replaces BatchNorm by GroupNorm
    local_epochs: int = default(SGDOptions, "local_epochs", 5)
    lr: float = default(SGDOptions, "lr", 0.01)
    momentum: float = default(SGDOptions, "momentum", 0.0)
    batch_size: int = default(SGDOptions, "batch_size", 10)
    alpha_lr: float = field(default=0.1, metadata={
        "help": "AdamW learning rate of the mixing parameters (L2C: logits alpha; meta-L2C: the encoder)"})
    alpha_weight_decay: float = field(default=0.01, metadata={
        "help": "AdamW (decoupled) weight decay of the mixing parameters"})
    prune_round: int = field(default=10, metadata={"help": "T0: the round (from 0) after which nodes prune"})
    prune: str = field(default="0.5", metadata={
        "help": "K0: neighbours each node drops at T0, a count (3) or a fraction of its neighbours (0.5); 0: never"})

    def validate(self):
        super().validate()
        if self.model in ("hetero", "hetero-small"):
            raise UsageError(f"--model {self.model}: L2C mixes model updates, so every node needs the same model")
        check("alpha-lr", self.alpha_lr, self.alpha_lr > 0, "must be positive")
        check("alpha-weight-decay", self.alpha_weight_decay, self.alpha_weight_decay >= 0, "must not be negative")
        check("prune-round", self.prune_round, self.prune_round >= 0, "must not be negative")
        check("val-fraction", self.val_fraction, 0 < self.val_fraction < 1, "L2C needs a validation split, in (0, 1)")
        prune_count(self.prune, 1)


def prune_count(spec: str, degree: int) -> int:
    """K0 for a node of `degree` neighbours: an integer is a count, a decimal a fraction of the degree."""
    try:
        value = int(spec) if spec.strip().lstrip("+").isdigit() else float(spec)
    except ValueError:
        raise UsageError(f"--prune {spec!r}: expected a count (3) or a fraction (0.5)") from None
    if isinstance(value, float) and not 0 <= value <= 1 or value < 0:
        raise UsageError(f"--prune {spec!r}: a fraction must lie in [0, 1] and a count must not be negative")
    return min(degree, value if isinstance(value, int) else round(value * degree))


def aggregate(model, start: dict, updates: list[dict], weights: torch.Tensor) -> None:
    """theta <- theta^t - sum_j w_j Delta_j, in place (eq. 2)."""
    with torch.no_grad():
        model.load_state_dict({name: value - sum(w * u[name] for w, u in zip(weights.tolist(), updates))
                               for name, value in start.items()}, strict=False)


def hypergradient(model, start: dict, updates: list[dict], weights: torch.Tensor, val_x, val_y):
    """Aggregate into model; return L_val at the result and dL_val/dw_j = -<grad L_val, Delta_j>."""
    aggregate(model, start, updates, weights)
    loss, grad = loss_gradient(model, val_x, val_y)
    return loss, torch.tensor([-inner(grad, u) for u in updates], dtype=weights.dtype)


def backpropagate(mixer, model, start: dict, bodies: dict[int, dict], val_x, val_y) -> tuple[torch.Tensor, float]:
    """Mix the bodies' updates into model with the mixer's weights; put dL_val/d(mixer) in its .grad.

    dL/dw_j comes from hypergradient(); autograd chains it through the mixer's weights.
    """
    weights = mixer.weights(bodies)
    val_loss, dloss_dw = hypergradient(model, start, [body["update"] for body in bodies.values()],
                                       weights.detach(), val_x, val_y)
    (weights * dloss_dw).sum().backward()
    return weights.detach(), val_loss


def collaborate(mixer, model, start: dict, bodies: dict[int, dict], val_x, val_y) -> tuple[dict[int, float], float]:
    """Steps 3-5: mix the updates with the mixer's weights, then one Adam step on the mixer."""
    mixer.optimizer.zero_grad()
    weights, val_loss = backpropagate(mixer, model, start, bodies, val_x, val_y)
    mixer.optimizer.step()
    return dict(zip(bodies, weights.tolist())), val_loss


def same_task_on_top(node: int, weights: dict[int, float], peers: set[int]) -> bool:
    """Are the len(peers) largest weights of `node` on others exactly those of its same-task peers?"""
    ranked = sorted((j for j in weights if j != node), key=lambda j: -weights[j])
    return set(ranked[:len(peers)]) == peers


@dataclass
class Carried:
    """What a node carries from round to round: its model, its mixer (alpha_i or meta-L2C's encoder, with
    their optimiser), whom it still hears from and whom it still sends to."""
    model: Resident
    mixer: Resident
    sources: list
    listeners: list


class MixingLogits:
    """L2C's alpha_i: one logit per member of {i} and N(i), initially equal, trained by AdamW."""

    def __init__(self, members: list[int], lr: float, weight_decay: float):
        self.index = {j: k for k, j in enumerate(members)}
        self.alpha = torch.zeros(len(members), requires_grad=True)
        self.optimizer = torch.optim.AdamW([self.alpha], lr=lr, weight_decay=weight_decay)

    def weights(self, bodies: dict[int, dict]) -> torch.Tensor:
        return torch.softmax(self.alpha[[self.index[j] for j in bodies]], 0)


@register("l2c")
class L2C(LearningProtocol):
    """L2C: personal models mix neighbours' updates with weights learnt on a validation split; prunes at T0."""
    dp_refused = "learns its mixing weights from its private validation split"
    Options = L2COptions
    averages_models = True
    state_copies = 7.2
    checkpointable = True

    # -- what L2C and meta-L2C do differently ---------------------------------
    def mixer(self, node, origin: dict):
        o = self.options
        return MixingLogits([node.id, *node.neighbours], o.alpha_lr, o.alpha_weight_decay)

    def message(self, start: dict, now: dict, origin: dict) -> dict:
        """What node i sends each round: its update Delta_i (now: its state after local training)."""
        return {"update": difference(start, now)}

    async def share(self, node, mixer) -> None:
        """Anything to agree on after the mixing step (L2C: nothing)."""

    # -- the round -------------------------------------------------------------
    async def run(self, node):
        o = self.options
        # --init common (the default): updates from one starting point are comparable.
        model, data = self.hold(node)
        origin = await self.state(node, model)
        mixer = node.keep(self.mixer(node, origin))
        neighbours = list(node.neighbours)  # N(i) at the start, which K0 counts
        state = node.carry(Carried(model, mixer, sources=list(neighbours), listeners=list(neighbours)))
        pruning = float(o.prune) > 0  # then every node sends its T0 notice, even one that drops no one
        async for rnd in node.rounds():
            sources, listeners = state.sources, state.listeners
            start = await self.state(node, model)
            loss = await self.train(node, model, data)
            if pruning and rnd == o.prune_round + 1:
                listeners = state.listeners = await self.still_listening(node, listeners)
            own = self.message(start, await self.state(node, model), origin)
            node.broadcast("update", own, to=[j for j in node.neighbours if j in listeners])
            heard = await node.gather("update", peers=[j for j in sources if j in node.neighbours],
                                      timeout=o.timeout, valid=like(own))
            bodies = {node.id: own, **{j: m.body for j, m in heard.items()}}
            weights, val_loss = await node.compute(collaborate, mixer, model, start, bodies, data.val_x, data.val_y,
                                                   work=data.work.training(len(data.val_y), max(len(data.val_y), 1)))
            heard_from = len(heard)
            del heard, bodies  # mixed: the neighbours' updates go now, not at the next round's gather
            node.record("graph", weights={str(j): w for j, w in weights.items()})
            await self.share(node, mixer)
            if pruning and rnd == o.prune_round:
                state.sources = self.prune(node, sources, weights, len(neighbours))
            node.snapshot(await self.state(node, model))
            node.log(train_loss=loss, val_loss=val_loss, **await self.evaluate(node, model, data),
                     heard_from=heard_from)

    def prune(self, node, sources: list[int], weights: dict[int, float], degree: int) -> list[int]:
        """Drop the K0 sources of smallest weight (K0 of the `degree` neighbours i started with); tell every
        neighbour whom i still listens to."""
        drop = prune_count(self.options.prune, degree)
        ranked = sorted(sources, key=lambda j: (weights.get(j, 0.0), j))
        kept = sorted(ranked[drop:])
        node.broadcast("listening", kept)
        return kept

    async def still_listening(self, node, listeners: list[int]) -> list[int]:
        """Neighbours whose T0 notice keeps i; one whose notice never came keeps getting i's updates."""
        notices = await node.gather("listening", round=self.options.prune_round, peers=sorted(listeners),
                                    timeout=self.options.timeout, valid=node_ids(node.num_nodes))
        return [j for j in listeners if j not in notices or node.id in notices[j].body]

    # -- results ---------------------------------------------------------------
    def summary(self, records) -> dict:
        """Where tasks are known: does each node put its same-task neighbours on top of its last weights?"""
        clusters = self.workload.clusters
        last = last_rows(records, "graph")
        if any(c is None for c in clusters) or not last:
            return {}
        identified = {}
        for i, row in last.items():
            peers = {j for j in self.run_info.graph.neighbors(i) if clusters[j] == clusters[i]}
            if peers:
                identified[str(i)] = same_task_on_top(i, {int(j): w for j, w in row["weights"].items()}, peers)
        if not identified:
            return {}
        return {"same_task_on_top": identified, "task_identification": statistics.fmean(identified.values())}

    def render(self, console, summary) -> None:
        if "same_task_on_top" in summary:
            hits = sum(summary["same_task_on_top"].values())
            console.print(f"task identification: {hits} of {len(summary['same_task_on_top'])} nodes give "
                          f"their largest weights to their same-task neighbours")
