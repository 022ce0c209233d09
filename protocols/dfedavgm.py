"""DFedAvgM (Sun et al., 2021): decentralised FedAvg with momentum.

Each round, node i:
  1. runs local SGD with heavy-ball momentum (the buffer starts fresh every round);
  2. sends its model to every neighbour;
  3. mixes x_i <- w_ii x_i + sum_{j heard} w_ij x_j with its Metropolis-Hastings
     (or uniform) row; a neighbour not heard from before the timeout (offline,
     link down, straggling) gives its weight back to i. Only floating-point
     tensors are averaged, BatchNorm's running statistics with the weights, as
     every averaging protocol here does. With --aggregate median, trimmed:BETA or
     krum:f=F, step 3 is that robust rule over x_i and the models heard, equally weighted.
On a directed graph (e.g. --topology-schedule one-peer-exponential) a node sends
to its out-neighbours and mixes what its in-neighbours sent, with degrees counted
as in-degrees (one-peer exponential: half its own model, half the one received).

With --sparsify Q, steps 2-3 are one of two published algorithms, with the trained
model v_i = x_i after step 1 in place of their single SGD step:
  DCD-PSGD (Tang, Gan, Zhang, Zhang, Liu, NeurIPS 2018, Algorithm 1), without --error-feedback.
    Every node holds x̂_j, a replica of each neighbour's model, equal to x_j itself:
    z_i = v_i - x̂_i + sum_j w_ij (x̂_j - x̂_i), the x̂_j as the last exchange left them;
    x_i <- x̂_i + Q(z_i); send Q(z_i), and add each Q(z_j) heard to x̂_j.
    The replicas start at the common x0 (protocols/compression.py: PublicCopies); one
    that missed an increment is left out until j sends it whole. The paper assumes an
    unbiased Q: then the network average is kept in expectation; top-k moves it.
  DeepSqueeze (Tang, Lian, Qiu, Yuan, Zhang, Liu, 2019, Algorithm 1), with --error-feedback.
    c_i = Q(v_i + e_i); e_i <- v_i + e_i - c_i (the error, 0 at first); send c_i;
    x_i <- v_i + eta sum_{j heard} w_ij (c_j - c_i), eta = --consensus-step.
    No copies: each message is the whole compressed model, so a lost one costs one round.
Both follow epfml/ChocoSGD's dl_code/pcode/optim/dcd_psgd.py and deep_squeeze.py rule for rule.
Departures: the local steps (with DFedAvgM's momentum, fresh each round) stand for their one SGD
step; a neighbour not heard gives its weight back to i; a replica that missed an increment is
repaired whole; BatchNorm's running statistics travel (the reference sends the parameters only).
Unset, --consensus-step follows the operator (compression.CONSENSUS_STEPS, tuned on a
held-out seed); config.yaml records the value used.

With --secure-aggregation secagg, steps 2-3 are protocols/secure_mixing.py's: each node is the SecAgg
server of its neighbourhood and learns sum_j w_ij x_j, not its neighbours' models.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from emulator.compute import Resident
from emulator.errors import UsageError
from emulator.protocol import adaptive, register
from topologies import neighbour_weight
from p2p_emulator.workloads.training import aggregate, load_state, mix, shift

from .common import DEGREE, STATE, LearningProtocol, RobustMixingOptions, SGDOptions, check, expects, like, own_row
from .compression import CONSENSUS_STEPS, Operator, PublicCopies, copied, on_host, weighted_differences
from .secagg import SecureAggregationOptions, secure
from .secure_mixing import SecureMixing, check_neighbourhoods


@dataclass
class DFedAvgMOptions(RobustMixingOptions, SGDOptions):
    sparsify: str = field(default="none", metadata={"help": (
        "dfedavgm, dpsgd: send Q(...) instead of x, Q one of topk:F, randk:F (F the share of each tensor's "
        "entries), sign, q8, q4, qsgd:s=S[,biased]: DCD-PSGD, or DeepSqueeze with --error-feedback (none: send x)")})
    error_feedback: bool = field(default=False, metadata={"help": (
        "dfedavgm, dpsgd with --sparsify: DeepSqueeze, which sends Q(x + e) and keeps what Q dropped in e for "
        "the next round (without it: DCD-PSGD)")})
    consensus_step: float | None = field(default=None, metadata={"help": (
        "dfedavgm, dpsgd with --sparsify and --error-feedback: DeepSqueeze's consensus step eta in (0, 1] "
        "(unset: the operator's, docs/compression.md)")})

    def validate(self):
        super().validate()
        operator = self.operator  # first: parsing it checks it
        if operator.name == "none" and self.error_feedback:
            raise UsageError("--error-feedback: needs --sparsify")
        if operator.name != "none" and self.robust_rule[0] != "mean":
            raise UsageError(f"--aggregate {self.aggregate}: not with --sparsify (DCD-PSGD and DeepSqueeze mix by "
                             "their weights)")
        if not self.error_feedback:
            if self.consensus_step is not None:
                raise UsageError(f"--consensus-step {self.consensus_step}: needs --sparsify and --error-feedback "
                                 "(DeepSqueeze's step; DCD-PSGD has none)")
            return
        if self.consensus_step is None:
            self.consensus_step = CONSENSUS_STEPS["deepsqueeze"][operator.name]
        check("consensus-step", self.consensus_step, 0 < self.consensus_step <= 1, "must be in (0, 1]")

    @property
    def operator(self) -> Operator:
        return Operator.parse("sparsify", self.sparsify)


@dataclass
class SecureDFedAvgMOptions(SecureAggregationOptions, DFedAvgMOptions):
    """DFedAvgM's options with secure aggregation's (D-PSGD extends DFedAvgMOptions, without them)."""

    def validate(self):
        super().validate()
        if self.secure_aggregation == "secagg+":
            raise UsageError("--secure-aggregation secagg+: dfedavgm has secagg only (a neighbourhood is the cohort)")
        if self.secure_aggregation != "none" and (self.sparsify != "none" or self.robust_rule[0] != "mean"):
            raise UsageError(f"--secure-aggregation {self.secure_aggregation}: not with --sparsify or --aggregate "
                             f"{self.aggregate} (it mixes by the weights, exactly)")


@dataclass
class Carried:
    """What a node carries from round to round: x_i (the momentum buffer starts fresh each round);
    DCD-PSGD's replicas x̂ and the neighbours heard at the last exchange, or DeepSqueeze's error e_i."""
    model: Resident
    copies: PublicCopies | None = None
    rows: list = field(default_factory=list)  # DCD-PSGD: [w_ij, j] of the neighbours heard at the last exchange
    error: dict | None = None


@register("dfedavgm")
class DFedAvgM(LearningProtocol):
    """DFedAvgM: local momentum SGD, then Metropolis-Hastings model averaging."""
    Options = SecureDFedAvgMOptions
    averages_models = True
    checkpointable = True

    def __init__(self, options, run_info):
        if secure(options):
            check_neighbourhoods(run_info.graph, options)
        super().__init__(options, run_info)
        self.secure_mixing = SecureMixing(adaptive(options)) if secure(options) else None  # no compute allowance

    async def run(self, node):
        model, data = self.hold(node)
        carried = node.carry(await self.carried(node, model))
        valid = self.message_check(node, carried)
        async for _ in node.rounds():
            loss = await self.train(node, model, data)  # 1
            heard_from = await self.average(node, model, carried, valid)  # 2-3
            node.snapshot(await self.state(node, model))
            node.log(train_loss=loss, **await self.evaluate(node, model, data), heard_from=heard_from)

    async def carried(self, node, model) -> Carried:
        o = self.options
        if o.sparsify == "none":
            return Carried(model)
        x0 = on_host(await self.state(node, model))
        if o.error_feedback:
            return Carried(model, error={name: value.zero_() for name, value in copied(x0).items()})
        common = o.init == "common"  # then every replica starts at the x0 all nodes drew from the seed
        return Carried(model, PublicCopies(public=x0, start=copied(x0) if common else None))

    def message_check(self, node, carried: Carried):
        """With --sparsify, the check of what the neighbours send (None: the exact model's, made per round)."""
        operator = self.options.operator
        if carried.copies is not None:
            return carried.copies.check(operator, node.num_nodes)
        if carried.error is not None:
            return expects(**{DEGREE: int, "c": operator.check(carried.error)})
        return None

    async def average(self, node, model, carried: Carried, valid=None) -> int:
        """Steps 2-3; returns how many neighbours were heard. Their models go with this call, once mixed.
        valid: with --sparsify, the check of what the neighbours send."""
        if self.secure_mixing is not None:
            return await self.secure_mixing.mix(node, model, await self.state(node, model))
        if carried.copies is not None:
            return await self.dcd_psgd(node, model, carried, valid)
        if carried.error is not None:
            return await self.deepsqueeze(node, model, carried, valid)
        o = self.options
        degree = len(node.in_neighbours)
        body = {STATE: await self.state(node, model), DEGREE: degree}
        node.broadcast("model", body)  # 2
        heard = await node.gather("model", timeout=o.timeout, valid=like(body))
        models = {j: (message.body[DEGREE], message.body[STATE]) for j, message in heard.items()}
        rule, param = o.robust_rule
        if rule == "mean":
            self_weight, row = own_row({j: neighbour_weight(o.mixing, degree, d) for j, (d, _) in models.items()})  # 3
            await node.compute(mix, model, self_weight, [(w, models[j][1]) for w, j in row], work=0)
        else:  # a robust rule in place of step 3's weighted mean
            await node.compute(aggregate, model, [state for _, state in models.values()], rule, param, work=0)
        return len(models)

    async def dcd_psgd(self, node, model, carried: Carried, valid) -> int:
        """DCD-PSGD's exchange: x_i <- x̂_i + Q(z_i), z_i = v_i - x̂_i + sum_j w_ij (x̂_j - x̂_i); Q(z_i) to the
        neighbours."""
        o, copies = self.options, carried.copies
        v = on_host(await self.state(node, model))
        mixing = copies.consensus(carried.rows, 1.0)
        z = {name: v[name] - copies.public[name] + mixing[name] for name in v}
        q = o.operator.compress(z, node.np_rng)
        copies.advance(o.operator.decompress(q, v))
        await node.compute(load_state, model, copies.public, work=0)  # x_i is the replica its neighbours hold
        copies.send(node, "model", q, degree=len(node.in_neighbours))
        heard = await node.gather("model", timeout=o.timeout, valid=valid)
        copies.receive(node, heard, o.operator)
        carried.rows = copies.rows(node, o.mixing, heard)
        return len(heard)

    async def deepsqueeze(self, node, model, carried: Carried, valid) -> int:
        """DeepSqueeze's exchange: c_i = Q(v_i + e_i) to the neighbours, e_i <- v_i + e_i - c_i,
        x_i <- v_i + eta sum_{j heard} w_ij (c_j - c_i)."""
        o, error, operator = self.options, carried.error, self.options.operator
        v = on_host(await self.state(node, model))
        for name, value in error.items():
            value.add_(v[name])
        c = operator.compress(error, node.np_rng)
        mine = operator.decompress(c, v)
        for name, value in error.items():
            value.sub_(mine[name])
        degree = len(node.in_neighbours)
        node.broadcast("model", {DEGREE: degree, "c": c})
        heard = await node.gather("model", timeout=o.timeout, valid=valid)
        theirs = {j: (neighbour_weight(o.mixing, degree, m.body[DEGREE]), operator.decompress(m.body["c"], v))
                  for j, m in heard.items()}
        await node.compute(shift, model, weighted_differences(mine, theirs.values(), o.consensus_step), work=0)
        return len(heard)
