"""Stochastic Gradient Push (Assran, Loizou, Ballas and Rabbat, ICML 2019), asynchronous by default
(Asynchronous Gradient-Push, Assran and Rabbat, IEEE TAC 2021).

Push-sum on a directed, possibly time-varying graph. Node i holds its biased parameters x_i
and its push-sum weight w_i (w_i = 1 at the start); its model is the de-biased z_i = x_i / w_i.
Each step k of node i (its own step counter: the graph of --topology-schedule, e.g.
one-peer-exponential, is the one of ITS step k):
  1. draws one minibatch and computes g = grad F_i(z_i), weight decay included
     (the `gradient` job, charged work = --batch-size);
  2. x_i <- x_i - lr * g;
  3. with d out-neighbours, keeps the share 1/(d+1) of (x_i, w_i) and pushes one share
     (x_i / (d+1), w_i / (d+1)) to each out-neighbour;
  4. adds every share (x_j', w_j') that has arrived: x_i <- x_i/(d+1) + sum x_j',
     w_i <- w_i/(d+1) + sum w_j', and z_i = x_i / w_i.
Asynchronous (the default, AGP): step 4 takes the shares that arrived since the last step,
whatever step of their senders they come from; a node goes at its own pace. But while the
mass it holds after mixing is below --min-weight (0.25), it waits for more shares (at most
--timeout, never past --duration): a node whose steps outpace its links would otherwise
push its mass away faster than it comes back, w -> 0, and its steps lr/w would diverge.
So after every step's mix w_i >= --min-weight, unless that wait ran out, and the gradient
moves z_i by at most lr/--min-weight. (--min-weight 0: never wait, AGP as published.)
--sync (SGP): step 4 first waits, at most --timeout and never past --duration (a neighbour
stopped at the horizon sends no more), for a share from each in-neighbour of step k; a share
from a sender's later step waits for that step, and one that arrives after its step's wait is
mixed at the next step (not dropped). One class serves both: it is `asynchronous` (runs to
--duration, each node's rows are its own steps, final metrics are each node's last row), and
under --sync the waits keep the nodes' step counters in step.
--average-only: step 2 skipped, pure push-sum averaging of the initial models (use --init
independent): every z_i tends to the exact mean of the x_i(0). Step 1 still runs (its loss
logged, its gradient dropped), so a step takes a training step's time in any compute model.

Sum of x and sum of w over the nodes and the shares in flight are conserved while no message is
lost, to the end: after its last step a node sends "closed" to its out-neighbours and mixes
what arrives until each in-neighbour has said the same (at most --timeout; links are FIFO, so
every share sent to it has come; on a --topology-schedule, those of its own last step). A lost
share (--loss, a receiver offline under --churn) takes its mass with it: z stays a weighted
average of the mass left, but the mean it tends to moves; and since step 2 moves z_i by
lr/w_i g, the steps grow as w drains. Under steady loss the sum of w falls geometrically (--loss 0.1
on a ring: about 7% a step), so training degrades and in the end diverges (a drained node's z
becomes infinite, its shares are refused as invalid; the run goes on). With --min-weight a
drained node waits for mass instead (at most --timeout a step), so training stalls rather than
diverges.

--robust (Hadjicostis, Vaidya and Dominguez-Garcia, IEEE TAC 2016; Spiridonoff et al., JMLR
2020): node i keeps the running sums S_i = sum of all the (x, w) shares it has pushed, and
pushes S_i itself (in float64); node j keeps, for each in-neighbour i, the last S_i it took in,
T_ji, and adds S_i - T_ji on mixing, then T_ji <- S_i. A lost share's mass is in the next S_i
that arrives, and a node that was offline gets all it missed at once: sum of x and w over the
nodes and the sums not yet taken in is conserved under loss and churn (not under a crash: a
crashed node's mass is gone). A share then costs twice the bytes, and every out-neighbour must
get the same S_i, so --robust needs a static graph.

Each step's row: train_loss; mixed (shares mixed); ps_weight (w_i after mixing); staleness,
when a share was mixed: the age of the oldest share mixed, counted in the node's own steps
begun at or after it was sent (0: sent during this step). Test accuracy is scored once, after
the last step (--eval-every is refused), and on z_i by --eval-every-seconds.

Departures from the papers and the reference code (facebookresearch/stochastic_gradient_push):
- A share travels as (z_j, w_j/(d+1)) rather than as the numerator x_j/(d+1) (with the weight
  appended only when the mixing is not regular, as the reference does): the same information,
  as x_j/(d+1) = (w_j/(d+1)) z_j. The receiver mixes z_i <- (w_keep z_i + sum w_j' z_j) / w_i',
  a convex combination with w in float64, so nothing underflows when mass leaks and the
  resident model always holds z_i (what is scored and what the gradient is taken at).
- Plain SGD (lr, weight decay) with one fresh minibatch per step, as the algorithm box; the
  reference trains with (Nesterov) momentum 0.9, a warm-up and a step schedule of lr, and a
  DistributedSampler's epochs.
- Weight decay is part of g, taken at the de-biased z_i (x_i <- x_i - lr (grad + wd z_i)); the
  reference's optimizer decays the numerator it steps, x_i <- x_i - lr (grad + wd x_i), so z_i
  decays by lr wd there and by lr wd / w_i here (the same where w_i = 1).
- Every floating-point entry of the model is pushed and mixed (BatchNorm running statistics
  too); the reference gossips module.parameters() only and keeps buffers local.
- --min-weight: a node waits for mass rather than let w fall below it; AGP (and its analysis)
  assume delays bounded in steps instead. Measured (docs/async.md): a 32-node torus of digits,
  a tenth of the nodes 8x slower, compute charged as counted: AGP's w falls 0.2, 0.04, ...
  before the first share arrives (10 ms links, 0.86 ms steps) and it ends at 10.03%; with the
  floor 92.37%, beside AD-PSGD's 91.76% (seeds 3 and 8, experiments/sgp_outpaced.yaml).
- Asynchrony is AGP's: any number of shares in flight, no bound on staleness. The reference's
  asynchronous variant (overlap, synch_freq) gossips in a background thread, one blocking
  exchange with the in-peers of the iteration at a time, and a node blocks once it has gone
  synch_freq iterations without one completing. AGP's step-size scaling for known update rates
  is not implemented (factor 1).
- --sync waits at most --timeout per step (the reference blocks for its in-peers without end,
  failing after a 300 s heartbeat); a late share is mixed later, not lost.
- The emulator's one-peer exponential schedule cycles the offsets 2^0 .. 2^(tau-1) with
  tau = floor(log2 n); the reference's cycles 2^0 .. 2^floor(log2(n-1)): the same for n a power
  of two, one offset fewer otherwise.
- No lazy mixing (the reference skips de-biasing on regular graphs, where w stays 1).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, fields

from emulator.compute import Resident
from emulator.errors import UsageError
from emulator.protocol import register
from p2p_emulator.workloads.lazy import LazyModule
from p2p_emulator.workloads.task import WorkloadOptions
from p2p_emulator.workloads.training import float_state, mix

from .common import (STATE, CheckedOptions, LearningProtocol, TrainingOptions, check, closing_handshake, default,
                     expects, like)

torch = LazyModule("torch")

WEIGHT = "w"  # the push-sum weight's share a message carries
KIND = "share"


@dataclass
class SGPOptions(WorkloadOptions, CheckedOptions):
    lr: float = default(TrainingOptions, "lr", 0.05)
    weight_decay: float = default(TrainingOptions, "weight_decay", 5e-4)
    batch_size: int = default(TrainingOptions, "batch_size", 32)
    dp: str = default(TrainingOptions, "dp", "")
    sync: bool = field(default=False, metadata={"help": (
        "sgp: synchronous SGP: each step waits (at most --timeout) for its in-neighbours' shares of that step "
        "(default: asynchronous, AGP: mix what has arrived, never wait)")})
    timeout: float = field(default=60.0, metadata={"help": (
        "sgp --sync: emulated seconds a step waits for its in-neighbours' shares")})
    min_weight: float = field(default=0.25, metadata={"help": (
        "sgp: the push-sum weight a node must hold after mixing before its next step: below it, the node waits "
        "for shares (at most --timeout, never past --duration), so its gradient step, lr/w, stays at most "
        "lr/min-weight when its steps outpace its links (0: never wait, AGP as published; --sync waits for each "
        "step's shares instead)")})
    robust: bool = field(default=False, metadata={"help": (
        "sgp: robust push-sum (Hadjicostis, Vaidya and Dominguez-Garcia 2016): a share carries the running sum of "
        "all its sender has pushed (float64, twice the bytes), so the mass of a share lost (--loss, an offline "
        "receiver) comes with the next one that arrives; a static graph only")})
    average_only: bool = field(default=False, metadata={"help": (
        "sgp: apply no gradients, only push-sum averaging of the initial models (with --init independent every "
        "model tends to their exact mean); each step still computes one, taking a training step's time")})

    def validate(self):
        super().validate()
        shared = ("lr", "weight_decay", "batch_size", "dp", *(f.name for f in fields(WorkloadOptions)))
        TrainingOptions(**{name: getattr(self, name) for name in shared}).validate()  # the same checks
        check("timeout", self.timeout, self.timeout > 0, "must be positive")
        check("min-weight", self.min_weight, 0 <= self.min_weight < 1, "must be in [0, 1)")
        check("eval-every", self.eval_every, self.eval_every == 1,
              "sgp scores each node once, after its last step; use --eval-every-seconds")


@dataclass
class Carried:
    """What a node carries from step to step: z_i (the resident model), w_i, the start times of its steps
    (for the age of the shares it mixes), and under --sync the shares of its later steps that came early."""
    model: Resident
    w: float = 1.0
    starts: list[float] = field(default_factory=list)
    early: list = field(default_factory=list)
    pushed: Resident | None = None  # --robust: the running sum of the numerators it has pushed (float64)
    pushed_w: float = 0.0  # and of the weights
    taken: Resident | None = None  # --robust: per sender, the running sum last taken in
    taken_w: dict = field(default_factory=dict)
    pace: dict = field(default_factory=dict)  # per sender: [its last share's send time, the longest gap between
    # two of its shares, the longest time one took to arrive]: how long its "closed" may take


def positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def descend(model, grads: dict, step: float) -> None:
    """z <- z - step * g, in place. A step too large for the model's dtype gives infinities, as the arithmetic
    would, rather than an error (training.descend's alpha refuses it): a node whose mass drained diverges."""
    state = model.state_dict()
    with torch.no_grad():
        for name, g in grads.items():
            state[name].sub_(g.to(state[name].device, state[name].dtype) * step)


def push_running_sum(model, sums: dict, weight: float) -> dict:
    """sums <- sums + weight z over the model's floating-point entries, in float64; a copy of them (a job)."""
    for name, value in float_state(model).items():
        total = sums.get(name)
        sums[name] = value.double() * weight if total is None else total.add_(value.double(), alpha=weight)
    return {name: total.clone() for name, total in sums.items()}


def mix_running_sums(model, taken: dict, kept: float, total: float, sums: dict) -> None:
    """z <- (kept z + sum_j (S_j - T_j)) / total and T_j <- S_j, for each sender j's running sum S_j: all that j
    pushed since the last of its sums taken in, the lost shares' too (a job)."""
    increments = []
    for src, latest in sums.items():
        before = taken.get(src)
        increments.append((1 / total, latest if before is None else {k: latest[k] - before[k] for k in latest}))
        taken[src] = latest
    mix(model, kept / total, increments)


@register("sgp")
class SGP(LearningProtocol):
    """Stochastic Gradient Push: push-sum averaging of the SGD iterates; asynchronous (AGP) unless --sync."""
    Options = SGPOptions
    averages_models = True
    asynchronous = True

    def __init__(self, options, run_info, **workload):
        if options.robust and run_info.time_varying:
            raise UsageError("--robust: a running sum reaches every out-neighbour; it needs a static graph (no "
                             "--topology-schedule)")
        super().__init__(options, run_info, **workload)

    async def run(self, node):
        o = self.options
        model, data = self.hold(node)
        carried = node.carry(Carried(model))
        state = await self.state(node, model)
        if o.robust:
            carried.pushed, carried.taken = node.keep({}), node.keep({})
            state = {name: value.double() for name, value in state.items()}
        valid = expects(**{STATE: like(state), WEIGHT: positive})
        async for step in node.rounds():
            carried.starts.append(node.now())
            grads, loss = await self.stochastic_gradient(node, model, data)  # 1
            if not o.average_only:  # 2, on z: x - lr g = w (z - lr/w g)
                await node.compute(descend, model, grads, o.lr / carried.w if carried.w else math.inf, work=0)
            share = 1 / (len(node.neighbours) + 1)  # 3
            kept = carried.w * share
            node.broadcast(KIND, await self.share(node, carried, kept))
            shares = await (self.in_step(node, step, carried, valid) if o.sync
                            else self.arrived(node, carried, valid, kept))
            await self.mix(node, carried, kept, shares)  # 4
            node.log(train_loss=loss, mixed=len(shares), ps_weight=carried.w,
                     **({"staleness": max(self.age(carried, m) for m in shares)} if shares else {}))
        await self.close(node, carried, valid)
        await self.log_final_scores(node, model, data)

    async def close(self, node, carried: Carried, valid) -> None:
        """The horizon rule: no share is lost to a node that has stopped. A node that has run its last step tells
        its out-neighbours so (links are FIFO: its shares come first), then mixes every share that arrives until
        each in-neighbour it has heard from has said so: at most the longest gap between two of their shares and
        twice the longest transit it has seen (a "closed" may be lost), and --timeout."""
        shares, carried.early = carried.early, []
        senders = set(node.in_neighbours) & carried.pace.keys()  # one never heard from is not waited for
        bound = max((carried.pace[j][1] + 2 * carried.pace[j][2] for j in senders), default=0.0)
        shares += await closing_handshake(node, node.neighbours, senders, min(self.options.timeout, bound),
                                          valid)
        await self.mix(node, carried, carried.w, shares)

    async def share(self, node, carried: Carried, kept: float) -> dict:
        """What a node pushes to each out-neighbour: (z_i, its share of w_i); --robust: the running sums."""
        if not self.options.robust:
            return {STATE: await self.state(node, carried.model), WEIGHT: kept}
        carried.pushed_w += kept
        return {STATE: await node.compute(push_running_sum, carried.model, carried.pushed, kept, work=0),
                WEIGHT: carried.pushed_w}

    def mass(self, carried: Carried, shares: list) -> float:
        """The weight the shares bring: their own; --robust: each sender's latest running sum less the last taken."""
        if not self.options.robust:
            return sum(m.body[WEIGHT] for m in shares)
        latest = {m.src: m.body[WEIGHT] for m in shares}
        return sum(w - carried.taken_w.get(src, 0.0) for src, w in latest.items())

    async def arrived(self, node, carried: Carried, valid, kept: float) -> list:
        """Every share that has arrived, in arrival order; then, while the mass falls short of --min-weight, the
        shares that arrive (at most --timeout)."""
        shares = []
        while (message := await node.recv(timeout=0, kind=KIND, valid=valid)) is not None:
            shares.append(message)
        deadline = node.now() + self.options.timeout  # (a wait ends at --duration at the latest)
        while kept + self.mass(carried, shares) < self.options.min_weight:
            message = await node.recv(timeout=max(0.0, deadline - node.now()), kind=KIND, valid=valid)
            if message is None:
                break
            shares.append(message)
        return shares

    async def in_step(self, node, step: int, carried: Carried, valid) -> list:
        """--sync: the shares of this step and earlier ones, after waiting (at most --timeout) for one from each
        in-neighbour of this step; shares of later steps are kept for them."""
        waiting = set(node.in_neighbours)
        deadline = node.now() + self.options.timeout  # (a wait ends at --duration at the latest)
        ready, carried.early = [m for m in carried.early if m.round <= step], [m for m in carried.early
                                                                               if m.round > step]
        waiting -= {m.src for m in ready if m.round == step}
        while True:
            message = await node.recv(timeout=0 if not waiting else max(0.0, deadline - node.now()), kind=KIND,
                                      valid=valid)
            if message is None:
                return ready
            if message.round > step:
                carried.early.append(message)
                continue
            ready.append(message)
            if message.round == step:
                waiting.discard(message.src)

    async def mix(self, node, carried: Carried, kept: float, shares: list) -> None:
        """z_i <- (kept z_i + sum w_j' z_j) / w_i', w_i' = kept + sum w_j': x_i <- x_i/(d+1) + sum x_j'."""
        total = kept + self.mass(carried, shares)
        carried.w = total
        for message in shares:
            last, gap, transit = carried.pace.get(message.src, (message.t_send, 0.0, 0.0))
            carried.pace[message.src] = [message.t_send, max(gap, message.t_send - last),
                                         max(transit, message.t_arrive - message.t_send)]
        if not total:  # w underflowed to 0 and nothing arrived: no mass, nothing to mix
            return
        if not self.options.robust:
            await node.compute(mix, carried.model, kept / total,
                               [(m.body[WEIGHT] / total, m.body[STATE]) for m in shares], work=0)
            return
        latest = {m.src: m.body for m in shares}  # links are FIFO: each sender's last is its largest sum
        carried.taken_w.update({src: body[WEIGHT] for src, body in latest.items()})
        await node.compute(mix_running_sums, carried.model, carried.taken, kept, total,
                           {src: body[STATE] for src, body in latest.items()}, work=0)

    @staticmethod
    def age(carried: Carried, message) -> int:
        """How many of the node's own steps began at or after the share was sent (0: sent during the current step)."""
        return len(carried.starts) - bisect.bisect_left(carried.starts, message.t_send)
