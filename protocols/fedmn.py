"""FedMN (Wang et al., "Personalized Federated Learning with Federated Modular Networks"), Algorithm 1.

Every client holds a modular network and a routing hypernetwork (p2p_emulator/workloads/modular.py).
Rounds 0..K-1 (--pretrain-rounds K) are FedAvg on the whole network, every connection on
(the paper pretrains with FedAvg). Each later round t, on a star whose node 0 serves:
  1. the server samples --clients-per-round clients and sends each the hypernetwork;
  2. client m gets Pi_m from its whole local dataset (Eq. 10) and draws V_m with the binary
     Concrete relaxation (Eq. 5), u ~ U(0,1) from its own generator: V_m = 1 where the relaxed
     sample exceeds 1/2; it tells the server V_m;
  3. the server sends m the active modules of V_m, and only those;
  4. m trains with V_m fixed for the round: the forward pass uses V_m, while the gradient reaches
     Pi_m through the relaxed sample at temperature tau_t (straight-through), which anneals
     exponentially from --tau-start to --tau-end over the FedMN rounds;
  5. m scores its model and sends back its active modules, the hypernetwork, V_m and |D_m|;
  6. the server sets each tensor to the |D_m|-weighted mean over the clients that sent it: a
     module is averaged over the clients for which it was active. The paper's weights
     |D_m| / |D| are renormalised over those clients, so a module few clients use is not shrunk.
--router frozen takes the authors' detached Pi (github.com/xztcwang/FedMN draws V from
z_mean[dim].item()): no gradient reaches the hypernetwork, so it keeps its initial value. It never
changes, so it never travels: in step 1 the server's message holds no tensor, and step 5 leaves it out.
Where the authors' code departs from the paper, this follows the paper (docs/fedmn.md, "Against the
authors' code"). Their code has a soft V (a Gumbel-softmax weight per connection, never thresholded,
softmaxed over all connections), redrawn every minibatch, and a temperature that never anneals. Each
layer's blocks share one module's weights. It averages every module over every client, unweighted
by |D_m|, and its output layer divides inside its sum. Its optimiser is SGD with weight decay 5e-4
on 512/256-wide N(0, 0.01) layers, and its LeNet encoders are pretrained from a file.
fedmn-p2p runs the same rounds on any graph with no server: each node decides with its own
hypernetwork, trains, sends its active modules and hypernetwork to its neighbours, and
averages each tensor over itself and the neighbours that sent it, weighted by |D|.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from rich import box
from rich.table import Table

from emulator.errors import UsageError
from emulator.protocol import register
from p2p_emulator.workloads.lazy import LazyModule
from p2p_emulator.workloads.training import load_state, mean_loss, sgd

from .common import (STATE, CarriedModel, CheckedOptions, LearningProtocol, SGDOptions, TimeoutOptions, check, default,
                     expects, last_rows, like, positive_int, entry_count)
from .fedavg import FedAvg, FedAvgOptions

torch = LazyModule("torch")
modular = LazyModule("p2p_emulator.workloads.modular")  # torch comes with it: not at import, so --help stays light

DECISION = "decision"  # V_m on the wire: E ints, 0 or 1
SAMPLES = "samples"
ROUTERS = ("train", "frozen")


@dataclass
class ModularOptions(CheckedOptions):
    modules: str = field(default="2,2,2", metadata={
        "help": "fedmn: blocks per layer N1,N2,...,NL: N1 encoders (the --model's backbone), then layers of "
                "blocks; the last layer gives the logits"})
    dropout: float = field(default=0.1, metadata={"help": "fedmn: dropout after each hidden block"})
    pretrain_rounds: int = field(default=0, metadata={
        "help": "fedmn: the first K of --rounds are FedAvg on the whole network (every connection on)"})
    tau_start: float = field(default=1.0, metadata={
        "help": "fedmn: binary Concrete temperature of the first routed round"})
    tau_end: float = field(default=0.1, metadata={"help": "fedmn: temperature of the last round (exponential decay)"})
    router: str = field(default="train", metadata={
        "help": "fedmn: train (Eq. 6: the decision's gradient trains the hypernetwork, which is federated) or "
                "frozen (the authors' code: Pi from the initial hypernetwork, which never trains or travels)"})

    def validate(self):
        super().validate()
        try:
            modular.parse_modules(self.modules)
        except ValueError as exc:  # a ModelError
            raise UsageError(str(exc)) from None
        check("dropout", self.dropout, 0 <= self.dropout < 1, "must be in [0, 1)")
        check("pretrain-rounds", self.pretrain_rounds, self.pretrain_rounds >= 0, "must not be negative")
        for flag, tau in (("tau-start", self.tau_start), ("tau-end", self.tau_end)):
            check(flag, tau, tau > 0, "must be positive")
        check("router", self.router, self.router in ROUTERS, f"choose {' or '.join(ROUTERS)}")

    @property
    def trains_router(self) -> bool:
        """The hypernetwork trains, and so travels (--router train)."""
        return self.router == "train"
        if self.model.startswith("hetero"):
            raise UsageError(f"--model {self.model}: fedmn's encoders share one architecture; use e.g. cnn-small")


@dataclass
class FedMNOptions(ModularOptions, FedAvgOptions):
    pass


@dataclass
class FedMNP2POptions(ModularOptions, TimeoutOptions, SGDOptions):
    momentum: float = default(SGDOptions, "momentum", 0.0)
    weight_decay: float = default(SGDOptions, "weight_decay", 0.0)


# -- jobs: they run where the node's network lives

class Routing(NamedTuple):
    """A client's round: V (drawn), its route (1 where Pi > 1/2: the V it draws most often), and Pi."""
    decision: list[int]
    route: list[int]
    pi: list[float]


def draw_decision(network, x, y, generator, batch_size: int = 1024) -> Routing:
    """Step 2: Pi over the whole dataset (Eq. 10), u ~ U(0,1), V = 1 where u > 1 - Pi, kept on the network."""
    network.eval()
    with torch.no_grad():
        logits = sum(network.router(x[i:i + batch_size], y[i:i + batch_size]) * len(y[i:i + batch_size])
                     for i in range(0, len(y), batch_size)) / len(y)
    noise = torch.rand(logits.shape, generator=generator, device=logits.device)
    network.noise = noise
    pi = torch.sigmoid(logits)
    network.decision.copy_(modular.binary_concrete(pi, noise, 1.0) > 0.5)
    return Routing([int(v) for v in network.decision.tolist()], [int(v > 0) for v in logits.tolist()],
                   [round(p, 4) for p in pi.tolist()])


def wire_everything(network) -> Routing:
    """Pretraining: every connection on."""
    network.decision.fill_(1.0)
    ones = [1] * len(network.decision)
    return Routing(ones, ones, [1.0] * len(ones))


def routed_sgd(network, x, y, *, routed: bool, tau: float, generator, **options) -> tuple[float, int]:
    """Step 4: local SGD under the round's decision; routed, the gates carry the relaxed sample's gradient."""
    if not routed and not modular.active_modules(network.widths, network.decision):
        return mean_loss(network, x, y), 0  # no path to the prediction, no gradient to the router: nothing trains
    def forward(x_batch, y_batch):
        gates = network.decision
        if routed:  # the batch's Pi estimates the dataset's; forward V, backward the relaxed sample
            soft = modular.binary_concrete(torch.sigmoid(network.router(x_batch, y_batch)), network.noise, tau)
            gates = gates + soft - soft.detach()
        return network(x_batch, gates, generator)

    return sgd(network, x, y, generator=generator, forward=forward, **options)


def average_modules(network, updates: list[tuple[int, dict]]) -> None:
    """Step 6: each tensor <- its |D|-weighted mean over the updates that carry it; one none carries stays."""
    state = network.state_dict()
    names = dict.fromkeys(name for _, sent in updates for name in sent)
    with torch.no_grad():
        for name in names:
            holders = [(n, sent[name]) for n, sent in updates if name in sent]
            total = sum(n for n, _ in holders)
            mean = sum(t.to(state[name].dtype) * (n / total) for n, t in holders)
            state[name].copy_(mean)


# -- what goes on the wire

class Layout:
    """Which state entries belong to which module, and checks of received bodies.
    `router`: the hypernetwork's entries when it travels (a trained router), else none."""

    def __init__(self, state: dict, widths: tuple[int, ...], router_travels: bool):
        self.widths, self.edges = widths, modular.connections(widths)
        self.tensors = {name: like(t) for name, t in state.items()}
        self.router = [name for name in state if name.startswith(modular.ROUTER) and router_travels]
        self.of_module = {(layer, j): [name for name in state if name.startswith(modular.module_prefix(layer, j))]
                          for layer, n in enumerate(widths) for j in range(n)}
        self.everything = [1] * self.edges

    def names(self, decision: list[int], router: bool) -> list[str]:
        """The entries a message under `decision` carries: its active modules (and the hypernetwork)."""
        active = modular.active_modules(self.widths, decision)
        names = [name for module in active for name in self.of_module[module]]
        return names + self.router if router else names

    def pick(self, state: dict, decision: list[int], router: bool) -> dict:
        return {name: state[name] for name in self.names(decision, router)}

    def is_decision(self, value) -> bool:
        return (isinstance(value, list) and len(value) == self.edges
                and all(type(v) is int and v in (0, 1) for v in value))

    def is_state(self, value, names: list[str]) -> bool:
        return (isinstance(value, dict) and value.keys() == set(names)
                and all(self.tensors[name](t) for name, t in value.items()))

    def carrying(self, *entries: list[str]):
        """A check of a body {STATE: ...} that holds exactly one of these lists of entries."""
        return expects(**{STATE: lambda state: any(self.is_state(state, names) for names in entries)})

    def update(self, routed: bool):
        """A check of an update: the sender's active modules under its decision, and the hypernetwork when routed."""
        fields = expects(**{STATE: dict, SAMPLES: positive_int, DECISION: self.is_decision})

        def check(body) -> bool:
            return (fields(body) and (routed or body[DECISION] == self.everything)
                    and self.is_state(body[STATE], self.names(body[DECISION], routed)))
        return check


class Modular(LearningProtocol):
    """What fedmn and fedmn-p2p share: the network, the round's decision, training, the summary."""
    dp_refused = "trains its router on private samples with a job of its own and sends the routing decisions"
    checkpointable = True

    @property
    def widths(self) -> tuple[int, ...]:
        return modular.parse_modules(self.options.modules)

    def initial_model(self, part):
        o, dataset = self.options, self.workload.dataset
        network = modular.build_modular(o.model, self.widths, dataset.shape, dataset.num_classes,
                                        d_z=o.d_z, norm=o.norm, dropout=o.dropout,
                                        init_seed=self.workload.init_seed(part), vocabulary=dataset.vocabulary)
        return network.to(self.workload.device)

    def routed(self, rnd: int) -> bool:
        return rnd >= self.options.pretrain_rounds

    async def layout(self, node, network) -> Layout:
        return Layout(await self.state(node, network), self.widths, self.options.trains_router)

    def tau(self, rnd: int) -> float:
        """tau_t = tau_start (tau_end / tau_start)^(t / (T - 1)) over the T routed rounds."""
        o = self.options
        span = max(self.run_info.rounds - o.pretrain_rounds - 1, 1)
        return o.tau_start * (o.tau_end / o.tau_start) ** ((rnd - o.pretrain_rounds) / span)

    async def decide(self, node, network, data) -> Routing:
        """The round's decision V, route and Pi (see draw_decision)."""
        if not self.routed(node.round):
            return await node.compute(wire_everything, network, work=0)
        return await node.compute(draw_decision, network, data.train_x, data.train_y, node.torch_generator,
                                  work=data.work.scoring(len(data.train_y)))

    async def train(self, node, network, data) -> float:
        trains_router = self.routed(node.round) and self.options.trains_router
        # charged an SGD step of the whole network, whose forward runs every active encoder (and the router's
        # small net, when it trains, is left uncounted)
        return await super().train(node, network, data, job=routed_sgd, routed=trains_router,
                                   tau=self.tau(node.round))

    async def update(self, node, network, layout: Layout, decision: list[int], data) -> dict:
        """Step 5's body: the active modules (and the hypernetwork, when routed), |D| and V."""
        state = layout.pick(await self.state(node, network), decision, self.routed(node.round))
        return {STATE: state, SAMPLES: len(data.train_y), DECISION: decision}

    def report(self, node, routing: Routing, component, **metrics) -> None:
        bits, route = "".join(map(str, routing.decision)), "".join(map(str, routing.route))
        node.record("decisions", decision=bits, route=route, component=component, pi=routing.pi)
        node.log(phase="fedmn" if self.routed(node.round) else "pretrain", decision=bits, route=route, **metrics)

    def summary(self, records):
        """Per kind (decision: the last V drawn; route: Pi > 1/2), the share of nodes whose last one is their
        component's most common one, and those majorities."""
        last = last_rows(records, "decisions").values()
        out = {}
        for kind in ("decision", "route"):
            by_component: dict = {}
            for row in last:
                by_component.setdefault(str(row["component"]), []).append(row[kind])
            majority = {c: max(sorted(set(d)), key=d.count) for c, d in sorted(by_component.items())}
            agree = sum(row[kind] == majority[str(row["component"])] for row in last)
            out[f"{kind}_agreement"] = agree / len(last) if last else None
            out[f"majority_{kind}s"] = majority
        return out

    def render(self, console, summary) -> None:
        """Traffic per phase and, per component, its most common last route."""
        table = Table(title="fedmn: traffic by phase, routes by component", box=box.SIMPLE_HEAD)
        table.add_column("")
        table.add_column("value", justify="right")
        for phase, entry in summary.get("bytes_by_phase", {}).items():
            table.add_row(f"{phase} bytes per round", f"{entry['bytes_sent'] / max(entry['rounds'], 1):,.0f}")
        for component, route in summary.get("majority_routes", {}).items():
            who = "every node" if component == "None" else f"component {component}"  # None: no mixture partition
            table.add_row(f"{who}: most common route", route)
        if summary.get("route_agreement") is not None:
            table.add_row("route agreement", f"{summary['route_agreement']:.2f}")
            table.add_row("decision agreement", f"{summary['decision_agreement']:.2f}")
        console.print(table)


@register("fedmn")
class FedMN(Modular, FedAvg):
    """FedMN on a star: a server averages each module over the clients for which it was active."""
    Options = FedMNOptions

    async def _serve(self, node):
        o = self.options
        network = node.keep(self.initial_model(0))
        layout = await self.layout(node, network)
        node.carry(CarriedModel(network))  # the modular network, hypernetwork included
        async for _ in node.rounds():
            routed = self.routed(node.round)
            reachable = node.neighbours
            sampled = self._sample(node, reachable)
            state = await self.state(node, network)
            if routed:  # 1-3
                router = {name: state[name] for name in layout.router}
                decisions = await self._decisions(node, {STATE: router}, sampled, layout)
                blocks = {client: layout.pick(state, decision, False) for client, decision in decisions.items()}
                for client, picked in blocks.items():
                    node.send(client, "blocks", {STATE: picked})
                sent = entry_count(router) * len(sampled) + sum(map(entry_count, blocks.values()))
            else:
                decisions = dict.fromkeys(sampled, layout.everything)
                whole = layout.pick(state, layout.everything, False)
                node.broadcast("model", {STATE: whole}, to=sampled)
                sent = entry_count(whole) * len(sampled)
            node.broadcast("model", None, to=[c for c in reachable if c not in sampled])
            updates = await node.gather("update", peers=sorted(decisions), timeout=o.timeout,
                                        valid=layout.update(routed))
            await node.compute(average_modules, network, [(m.body[SAMPLES], m.body[STATE]) for m in updates.values()],
                               work=0)  # 6
            node.log(heard_from=len(updates), params_sent=sent, phase="fedmn" if routed else "pretrain")

    async def _decisions(self, node, router: dict, sampled: list[int], layout: Layout) -> dict[int, list[int]]:
        node.broadcast("model", router, to=sampled)
        heard = await node.gather("decision", peers=sampled, timeout=self.options.timeout,
                                  valid=expects(**{DECISION: layout.is_decision}))
        return {client: message.body[DECISION] for client, message in heard.items()}

    async def _client(self, node):
        o = self.options
        network, data = self.hold(node, self.part[node.id])
        layout = await self.layout(node, network)
        first = layout.carrying(layout.router, layout.names(layout.everything, False))  # routed, or pretraining
        node.carry(CarriedModel(network))
        message = None  # the server's model for this round, taken anew each round (none is ahead at a barrier)
        async for _ in node.rounds():
            if message is None or message.round < node.round:
                message = await self._next_model(node, first)
            if message is None or message.round > node.round or message.body is None:
                continue  # the server fell silent; or it is rounds ahead; or not sampled
            routed = self.routed(node.round)
            await node.compute(load_state, network, message.body[STATE], work=0)
            routing = await self.decide(node, network, data)  # 2
            decision = routing.decision
            if routed:
                node.send(self.server, "decision", {DECISION: decision})
                blocks = await node.gather("blocks", peers=[self.server], timeout=2 * o.timeout,
                                           valid=layout.carrying(layout.names(decision, False)))
                if not blocks:
                    continue
                await node.compute(load_state, network, blocks[self.server].body[STATE], work=0)  # 3
            loss = await self.train(node, network, data)  # 4
            scores = await self.evaluate(node, network, data)  # 5
            body = await self.update(node, network, layout, decision, data)
            node.send(self.server, "update", body)
            self.report(node, routing, data.cluster, train_loss=loss, params_sent=entry_count(body[STATE]), **scores)

    async def run_no_rounds(self, node):
        if node.id != self.server:
            network, data = self.hold(node, self.part[node.id])
            node.log(**await self.scores(node, network, data))

    def summary(self, records):
        return {**FedAvg.summary(self, records), **Modular.summary(self, records)}


@register("fedmn-p2p")
class FedMNP2P(Modular):
    """FedMN with no server: each node averages each module with the neighbours for which it was active."""
    Options = FedMNP2POptions

    async def run(self, node):
        o = self.options
        network, data = self.hold(node)
        layout = await self.layout(node, network)
        node.carry(CarriedModel(network))
        async for _ in node.rounds():
            routed = self.routed(node.round)
            routing = await self.decide(node, network, data)
            loss = await self.train(node, network, data)
            body = await self.update(node, network, layout, routing.decision, data)
            sent = entry_count(body[STATE]) * len(node.neighbours)
            node.broadcast("blocks", body)
            heard = await node.gather("blocks", timeout=o.timeout, valid=layout.update(routed))
            await node.compute(average_modules, network, [(body[SAMPLES], body[STATE])]
                               + [(m.body[SAMPLES], m.body[STATE]) for m in heard.values()], work=0)
            self.report(node, routing, data.cluster, train_loss=loss, heard_from=len(heard),
                        params_sent=sent,
                        **await self.evaluate(node, network, data))
