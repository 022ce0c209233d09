"""What the protocols share; not a protocol (nothing here is registered).

- option mixins, each checking its own fields once: TrainingOptions (local training),
  SGDOptions (LearningProtocol.train's SGD), TimeoutOptions, MixingOptions;
- the body keys that more than one protocol puts on the wire;
- a node's row of W from what it heard (own_row, degree_weights);
- expects: the check of a received body (keys, shapes, dtypes, finite values);
- LearningProtocol: the workload, local SGD, evaluation and the consensus observer;
- last_rows: each node's last row of a recorded stream, for summaries.
"""
from __future__ import annotations

import math
from dataclasses import astuple, dataclass, field, fields, replace
from typing import Any, Callable

import numpy as np

from emulator.compute import Resident, physical_memory
from emulator.work import Work
from emulator.errors import UsageError
from emulator.protocol import Protocol
from topologies import neighbour_weight
from p2p_emulator.workloads.lazy import LazyModule
from p2p_emulator.workloads.task import (NodeTensors, Workload, WorkloadError, WorkloadOptions, check_options,
                                        option_help)
from p2p_emulator.workloads.privacy import (ACCOUNTANT, Accountant, DPSpec, PrivacyError, dp_gradient, dp_sgd,
                                           noise_for, sample_rate, spent, steps_per_call)
from p2p_emulator.workloads.training import accuracy, flat, float_state, gradient, sgd
from p2p_emulator.workloads.work import ModelWork, model_work

torch = LazyModule("torch")

STATE = "state"  # a model's (or encoder's) floating-point tensors
DEGREE = "degree"  # the sender's (in-)degree: the receiver's w_ij needs it


def default(options: type, name: str, value):
    """A field of `options` with another default, keeping its help text."""
    return field(default=value, metadata={f.name: f for f in fields(options)}[name].metadata)


def check(flag: str, value, ok: bool, problem: str) -> None:
    if not ok:
        raise UsageError(f"--{flag} {value}: {problem}")


# -- option mixins: combine them, and each validate() checks its own fields, then hands on

class CheckedOptions:
    """The root of the option mixins."""

    def validate(self) -> None:
        """Nothing left to check."""


@dataclass
class TrainingOptions(WorkloadOptions, CheckedOptions):
    """Local training: epochs of minibatches with a learning rate and weight decay."""
    local_epochs: int = field(default=1, metadata=option_help("local epochs per round"))
    lr: float = field(default=0.05, metadata=option_help("learning rate"))
    weight_decay: float = field(default=5e-4, metadata=option_help("weight decay"))
    batch_size: int = field(default=32, metadata=option_help("local batch size"))
    dp: str = field(default="", metadata=option_help(
        "DP-SGD on each node's own samples: clip=C,noise=SIGMA[,delta=D] or clip=C,target_epsilon=E[,delta=D] "
        "(Poisson sampling at rate batch-size/n; delta default 1/n, n the node's training samples)"))

    def validate(self):
        super().validate()
        try:
            check_options(self)
            dp_spec(self)
        except (WorkloadError, PrivacyError) as exc:
            raise UsageError(str(exc)) from None
        check("lr", self.lr, self.lr > 0, "must be positive")
        check("batch-size", self.batch_size, self.batch_size >= 1, "must be at least 1")
        check("local-epochs", self.local_epochs, self.local_epochs >= 1, "must be at least 1")
        check("weight-decay", self.weight_decay, self.weight_decay >= 0, "must not be negative")


@dataclass
class SGDOptions(TrainingOptions):
    """Local SGD as LearningProtocol.train runs it: also a step budget and heavy-ball momentum."""
    local_steps: int = field(default=0, metadata=option_help("local SGD steps per round (0: use --local-epochs)"))
    momentum: float = field(default=0.9, metadata=option_help("heavy-ball momentum"))

    def validate(self):
        super().validate()
        check("local-steps", self.local_steps, self.local_steps >= 0, "must not be negative")
        check("momentum", self.momentum, self.momentum >= 0, "must not be negative")


@dataclass
class TimeoutOptions(CheckedOptions):
    timeout: float | str = field(default="auto", metadata=option_help(
        "emulated seconds to wait for neighbours' messages, or auto: TCP's retransmission timer over the times "
        "the node's messages took in transit (at least 1 s), plus the round's compute: docs/network-model.md"))

    def validate(self):
        super().validate()
        if self.timeout != "auto":
            self.timeout = seconds("timeout", self.timeout)


def seconds(flag: str, value) -> float:
    """A positive, finite number of seconds from an option's value (a number, or its text)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    check(flag, value, math.isfinite(number) and number > 0, "must be a positive number of seconds, or auto")
    return number


@dataclass
class MixingOptions(TimeoutOptions):
    """Averaging with the neighbours heard from before the timeout, with weights from the degrees."""
    mixing: str = field(default="mh", metadata=option_help("mixing weights: mh (Metropolis-Hastings) or uniform"))

    def validate(self):
        super().validate()
        check("mixing", repr(self.mixing), self.mixing in ("mh", "uniform"), "choose mh or uniform")


def dp_spec(options) -> DPSpec | None:
    """--dp read, or None when it is off (or the protocol has no such option)."""
    text = getattr(options, "dp", "")
    return DPSpec.parse(text) if text else None


AGGREGATES = ("mean", "median", "trimmed", "krum")


@dataclass
class RobustMixingOptions(MixingOptions):
    """Averaging that may be robust: mean (the mixing weights), or median, trimmed:0.2, krum:f=1 over the
    node's own model and those it heard, with equal weights."""
    aggregate: str = field(default="mean", metadata=option_help(
        "how a node combines its model with its neighbours': mean (the mixing weights), median, trimmed:BETA "
        "(coordinate-wise mean without the BETA fraction of largest and of smallest values) or krum:f=F"))

    def validate(self):
        super().validate()
        rule, param = self.robust_rule
        check("aggregate", repr(self.aggregate), rule in AGGREGATES and param >= 0 and (rule != "trimmed" or param < 0.5),
              "choose mean, median, trimmed:BETA with 0 <= BETA < 0.5, or krum:f=F with F >= 0")

    @property
    def robust_rule(self) -> tuple[str, float]:
        """(rule, parameter): trimmed's fraction or krum's f; -1 when unreadable."""
        rule, _, text = self.aggregate.partition(":")
        text = text.removeprefix("f=") if rule == "krum" else text
        default_param = {"trimmed": 0.2, "krum": 1.0}.get(rule, 0.0)
        try:
            param = float(text) if text else default_param
        except ValueError:
            param = -1.0
        return rule, param if math.isfinite(param) else -1.0


# -- a node's row of W

def own_row(heard: dict[int, float]) -> tuple[float, list[tuple[float, int]]]:
    """Node i's row from the weights w_ij of the neighbours heard from: (w_ii, [(w_ij, j), ...]).

    w_ii = 1 - sum of those w_ij: a neighbour not heard from (offline, link down, too
    slow) leaves its weight with i, so the row still sums to one.
    """
    others = [(w, j) for j, w in heard.items()]
    return 1.0 - sum(w for w, _ in others), others


def degree_weights(mixing: str, degree: int, heard: dict) -> dict[int, float]:
    """w_ij of each message's sender from the two degrees alone: Metropolis-Hastings (mh) or uniform."""
    return {j: neighbour_weight(mixing, degree, message.body[DEGREE]) for j, message in heard.items()}


# -- what a node accepts from the wire

Check = Callable[[Any], bool]


def expects(optional: tuple[str, ...] = (), **examples) -> Check:
    """A check of received bodies, made once from examples of what a body holds.

    The body must be a dict with these keys (those in `optional` may be missing), each
    value like its example: a tensor or numpy array of the same shape and dtype with
    finite values; a dict of them with the same keys; a type (int, float: a finite
    number, str, ...); or a check of its own. Pass it as gather's or recv's `valid`:
    a body it rejects is dropped as invalid, so corrupt or hostile input never reaches
    the protocol's arithmetic.
    """
    checks = {key: like(example) for key, example in examples.items()}
    required = set(checks) - set(optional)

    def check(body) -> bool:
        if not isinstance(body, dict) or not required <= body.keys() <= checks.keys():
            return False
        for key, value in body.items():  # a loop, not all(...): this runs for every message
            if not checks[key](value):
                return False
        return True
    return check


def like(example) -> Check:
    """A check that a value is like `example`: see expects; also a number (of its type), None,
    or a list (as long, each item like the example's). A node's own outgoing body is the
    usual example of what its neighbours send."""
    if isinstance(example, type):
        return _of_type(example)
    if example is None or isinstance(example, (bool, int, float, str)):
        return _of_type(type(example))
    if isinstance(example, dict):
        return expects(**example)
    if isinstance(example, list):
        items = [like(item) for item in example]
        return lambda v: isinstance(v, list) and len(v) == len(items) and all(c(x) for c, x in zip(items, v))
    if isinstance(example, np.ndarray):
        shape, dtype = example.shape, example.dtype
        return lambda v: (isinstance(v, np.ndarray) and v.shape == shape and v.dtype == dtype
                          and (dtype.kind not in "fc" or bool(np.isfinite(v).all())))
    if torch.is_tensor(example):
        shape, dtype = example.shape, example.dtype
        # finite: the sum is (one pass, no mask tensor: 5x cheaper than isfinite().all() on a model);
        # values so large that their sum overflows are refused too, as no model holds them
        return lambda v: (torch.is_tensor(v) and v.shape == shape and v.dtype == dtype
                          and (not v.is_floating_point() or math.isfinite(v.sum())))
    if callable(example):
        return example
    raise TypeError(f"expects: no check for an example of {type(example).__name__}")


def _of_type(kind: type) -> Check:
    if kind is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if kind is int:
        return lambda v: type(v) is int  # not a bool
    return lambda v: isinstance(v, kind)


CLOSED = "closed"  # a time-driven node's last message to a peer: all it sent that peer came before it


async def closing_handshake(node, to: list[int], senders: set[int], timeout: float,
                            valid: Check | None = None) -> list:
    """The horizon handshake of a time-driven protocol: tell `to` that this node has stopped, then wait (past
    --duration if need be, at most `timeout`) until each of `senders` has said the same. Links are FIFO, so by
    then all they sent has come. With `valid`, the other messages that arrive meanwhile (bodies it accepts)
    are returned; without, they stay queued."""
    node.broadcast(CLOSED, to=to)
    arrived = []
    deadline = node.now() + timeout
    while senders and (message := await node.recv(timeout=max(0.0, deadline - node.now()),
                                                  kind=None if valid else CLOSED,
                                                  valid=lambda body: body is None or (valid is not None
                                                                                      and valid(body)),
                                                  past_horizon=True)):
        if message.kind == CLOSED:
            senders.discard(message.src)
        elif message.body is not None:
            arrived.append(message)
    return arrived


def positive_int(value) -> bool:
    """A count such as a sender's number of samples."""
    return type(value) is int and value > 0


def node_ids(num_nodes: int) -> Check:
    """A list of node ids, e.g. L2C's notice of whom a node still listens to."""
    return lambda v: isinstance(v, list) and all(type(j) is int and 0 <= j < num_nodes for j in v)


# -- learning

class LearningProtocol(Protocol):
    """A protocol over a Workload: every node gets its data split and its own model."""
    averages_models = False  # then every node needs the same architecture
    # Bytes of state per node in models' worth of parameters, from ./dev bench memory (cnn-small):
    # DFedAvgM 4.1, MAPL 3.0, L2C 7.2, meta-L2C 11, Local 1.0. A run that cannot fit is refused.
    state_copies = 4.0
    # Why --dp is refused: what the protocol releases from private data that DP-SGD's steps do not cover.
    dp_refused = ""
    training_passes = 1  # the passes over each sample a round's training makes (two augmented views: 2)

    def __init__(self, options, run_info, **workload):
        super().__init__(options, run_info)
        self.dp = dp_spec(options)
        self._counted: dict[str, ModelWork] = {}
        if self.dp is not None and self.dp_refused:
            raise UsageError(f"--dp: {self.name} {self.dp_refused}, which DP-SGD does not cover")
        try:
            self.workload = Workload(options, run_info, averaged_by=self.name if self.averages_models else None,
                                     **workload)
        except WorkloadError as exc:
            raise UsageError(str(exc)) from None
        self.check_memory()
        if self.dp is not None:
            self.check_dp()
        self.compute_wait = self.longest_round_of_compute()
        if self.compute_wait:
            self.given_timeout = self.options.timeout
            self.options = replace(self.options, timeout=self.options.timeout + self.compute_wait)

    def longest_round_of_compute(self) -> float:
        """The emulated seconds of the longest round of compute any node may be charged (each count's most over
        the data holders, on the slowest node): what a synchronous protocol's --timeout is lengthened by, so
        that no node loses a neighbour only because the neighbour's compute outlasted the wait.
        0 for an asynchronous protocol, one without --timeout, a run of no rounds, and under --compute-time
        measured."""
        charge, o = self.run_info.charge, self.options
        if self.asynchronous or charge is None or not hasattr(o, "timeout") or not self.run_info.rounds:
            return 0.0
        works = [self.round_work(part) for part in range(len(self.workload.archs))]
        most = Work(*(max(counts) for counts in zip(*map(astuple, works))))
        return max(charge(node, most) for node in range(self.run_info.num_nodes))

    def round_work(self, part: int) -> Work:
        """Data holder `part`'s round of compute: its local training, and its scoring."""
        o, split = self.options, self.workload.partition.nodes[part]
        samples = getattr(o, "local_steps", 0) * o.batch_size or o.local_epochs * len(split.train)
        tested = len(self.workload.global_test()[1]) if self.workload.test_set == "global" else len(split.test)
        work = self.counted_work(part)
        return work.training(samples, o.batch_size) * self.training_passes + work.scoring(tested)

    def counted_work(self, part: int) -> ModelWork:
        """The counted work of data holder `part`'s model (counted once per architecture)."""
        arch = self.workload.archs[part]
        if arch not in self._counted:
            data = self.workload.data(part)
            self._counted[arch] = model_work(self.initial_model(part), *data_sample(data))
        return self._counted[arch]

    def check_dp(self) -> None:
        """Refuse what per-sample clipping cannot bound, and a target epsilon without a plan of the steps."""
        archs = self.workload.archs
        for arch, part in ((arch, archs.index(arch)) for arch in dict.fromkeys(archs)):  # each one the run assigns
            if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in self.initial_model(part).modules()):
                named = arch if arch == self.options.model else f"{self.options.model} (data holder {part}: {arch})"
                raise UsageError(f"--dp: --model {named} has BatchNorm, which mixes the samples of a "
                                 "batch, so clipping each sample's gradient does not bound its influence; "
                                 "use --norm group")
        if self.dp.target_epsilon and self.run_info.duration:
            raise UsageError("--dp target_epsilon: a run of --duration has no planned number of steps to "
                             "spend it over; give noise=SIGMA")
        for part in range(len(self.workload.archs)):
            self.privacy_plan(part)  # a target no noise reaches fails now, in one line

    def privacy_plan(self, part: int) -> dict:
        """Data holder `part`'s DP-SGD: its sampling rate, delta and noise (solved for --dp target_epsilon over
        --rounds trainings of the planned steps)."""
        o, n = self.options, len(self.workload.partition.nodes[part].train)
        rate, delta = sample_rate(n, o.batch_size), self.dp.delta or 1 / n
        noise = self.dp.noise
        if self.dp.target_epsilon:
            steps = self.run_info.rounds * steps_per_call(n, o.batch_size, o.local_epochs, o.local_steps)
            if not steps:  # opacus's search for sigma would never end
                raise UsageError(f"--dp target_epsilon: --rounds {self.run_info.rounds} plans no steps to spend it "
                                 "over; give noise=SIGMA")
            try:
                noise = noise_for(self.dp.target_epsilon, rate, steps, delta)
            except PrivacyError as exc:
                raise UsageError(f"{exc} (node data part {part}: {steps} steps at sampling rate {rate:.3g})") from None
        return {"rate": rate, "delta": delta, "noise": noise}

    def check_memory(self) -> None:
        """Refuse up front a run whose nodes' models cannot fit in this machine's memory, with the estimate.
        (On a Ray cluster the models live on the workers, whose memory is Ray's to manage.)"""
        if not self.run_info.state_in_process:
            return
        model = self.initial_model(0)
        parameters = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        need, have = self.run_info.num_nodes * self.state_copies * parameters, physical_memory()
        if need > have:
            raise UsageError(f"--nodes {self.run_info.num_nodes}: needs about {need / 2**30:.0f} GiB of model state "
                             f"({self.state_copies:g} copies of {parameters / 2**20:.1f} MiB per node), more than "
                             f"this machine's {have / 2**30:.0f} GiB")

    def hold(self, node, part: int | None = None, scored: bool = True):
        """(model, data) of data holder `part` (default: the node's own), kept where node's jobs run; under
        --dp, data carries the holder's accountant. `scored`: the model is what --eval-every-seconds scores.

        Both are handles: pass them to node.compute. data has the NodeTensors fields, each
        tensor a handle whose len() is its sample count.
        """
        part = node.id if part is None else part
        initial, tensors = self.initial_model(part), self.workload.data(part)
        model, data = node.keep(initial), keep_data(node, tensors, initial)
        if self.dp is not None:
            plan = self.privacy_plan(part)
            data = replace(data, accountant=node.keep(Accountant(self.dp.clip, plan["noise"], plan["rate"],
                                                                 plan["delta"])))
        if scored:
            node.score_with(test_scores, model, data.test_x, data.test_y)
        return model, data

    def initial_model(self, part: int):
        """Data holder `part`'s model before training (a protocol with a model of its own overrides this)."""
        return self.workload.model(part)

    async def run_no_rounds(self, node):
        """--rounds 0: build the node's data and model, evaluate once."""
        model, data = self.hold(node)
        node.log(**await self.scores(node, model, data))

    async def train(self, node, model, data, job=sgd, passes: float = 1, epochs: int | None = None,
                    **extra) -> float:
        """Local SGD as the options say (local_epochs or local_steps, lr, momentum, ...); returns the mean loss.

        `job` is sgd or a job taking sgd's arguments and `extra`; it is charged `passes` times the work of
        sgd's steps. `epochs` replaces --local-epochs.
        """
        o = self.options
        epochs = o.local_epochs if epochs is None else epochs
        samples = o.local_steps * o.batch_size if o.local_steps else epochs * len(data.train_y)
        work = data.work.training(samples, o.batch_size) * passes
        if self.dp is not None:
            return await self.train_privately(node, model, data, job, epochs, work=work, **extra)
        loss, _ = await node.compute(
            job, model, data.train_x, data.train_y, epochs=epochs, steps=o.local_steps, lr=o.lr,
            momentum=o.momentum, weight_decay=o.weight_decay, batch_size=o.batch_size,
            generator=node.torch_generator, work=work, **extra)
        return loss

    async def train_privately(self, node, model, data, job, epochs: int, work: Work, **extra) -> float:
        """train's DP-SGD: the steps, then the node's epsilon so far into its row (and privacy.jsonl)."""
        if job is not sgd or data.accountant is None:
            raise UsageError(f"--dp: {self.name} trains with {getattr(job, '__name__', job)}, "
                             "which has no DP-SGD variant")
        o = self.options
        loss, _ = await node.compute(
            dp_sgd, model, data.train_x, data.train_y, accountant=data.accountant, epochs=epochs,
            steps=o.local_steps, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
            batch_size=o.batch_size, generator=node.torch_generator, work=work, **extra)
        await self.account(node, data)
        return loss

    async def stochastic_gradient(self, node, model, data) -> tuple[dict, float]:
        """One minibatch's gradient at the model as it stands (training.gradient), or under --dp one
        DP-SGD step's noisy gradient; charged one training step. ({name: gradient}, loss)."""
        o = self.options
        work = data.work.training(o.batch_size, o.batch_size)
        if self.dp is None:
            return await node.compute(gradient, model, data.train_x, data.train_y, batch_size=o.batch_size,
                                      weight_decay=o.weight_decay, generator=node.torch_generator, work=work)
        out = await node.compute(dp_gradient, model, data.train_x, data.train_y, accountant=data.accountant,
                                 batch_size=o.batch_size, weight_decay=o.weight_decay,
                                 generator=node.torch_generator, work=work)
        await self.account(node, data)
        return out

    @staticmethod
    async def account(node, data) -> None:
        """The node's epsilon so far into its row, and its account into privacy.jsonl."""
        account = await node.compute(spent, data.accountant, work=0)
        node.log(epsilon=account["epsilon"])
        node.record("privacy", **account)

    async def evaluate(self, node, model, data) -> dict[str, float]:
        """The scores in the rounds --eval-every picks (and the last), else {}."""
        return await self.scores(node, model, data) if self.scores_due(node) else {}

    def scores_due(self, node) -> bool:
        """Whether this round is one --eval-every picks (or the last)."""
        return not (node.round + 1) % self.options.eval_every or node.round == self.run_info.rounds - 1

    async def scores(self, node, model, data) -> dict[str, float]:
        """{"test_acc": ...}, charged as compute; {} for a node without test samples, which has no accuracy."""
        if not len(data.test_y):
            return {}
        return {"test_acc": await node.compute(accuracy, model, data.test_x, data.test_y,
                                               work=data.work.scoring(len(data.test_y)))}

    async def log_final_scores(self, node, model, data) -> None:
        """An asynchronous protocol's node, once its last step is done: its scores into that step's row,
        charged nothing (the run's horizon has passed; the summary's final metrics are each node's last row)."""
        if len(data.test_y):
            node.log(test_acc=await node.compute(accuracy, model, data.test_x, data.test_y, work=0))

    def shared_summary(self, records) -> dict:
        """Under --dp: each node's last epsilon, its delta and noise, and the accountant that computed them."""
        if self.dp is None:
            return {}
        last = last_rows(records, "privacy")
        by_node = {key: {str(node): row[key] for node, row in last.items()} for key in ("epsilon", "delta", "noise")}
        return {"privacy": {"mechanism": "DP-SGD", "accountant": ACCOUNTANT, "sampling": "poisson",
                            "clip": self.dp.clip, "epsilon_max": max(by_node["epsilon"].values(), default=0.0),
                            **by_node}}

    @staticmethod
    async def state(node, module) -> dict:
        """A copy of a resident module's floating-point tensors (what a node sends); no emulated time."""
        return await node.compute(float_state, module, work=0)

    def observe(self, rnd, snapshots):
        """consensus_distance: ||x_i - mean_j x_j|| from flattened float states (no messages)."""
        vectors = {i: flat(state) for i, state in snapshots.items() if state is not None}
        if len(vectors) < 2:
            return {}
        mean = torch.stack(list(vectors.values())).mean(0)
        return {i: {"consensus_distance": float(torch.linalg.vector_norm(v - mean))} for i, v in vectors.items()}


def test_scores(model, test_x, test_y) -> dict[str, float]:
    """{"test_acc": ...} of a model on a test split (a job; {} without test samples): what the clock-driven
    sampler (--eval-every-seconds) scores."""
    return {"test_acc": accuracy(model, test_x, test_y)} if len(test_y) else {}


def entry_count(state: dict) -> int:
    """The tensor entries of a state (parameters, and any BatchNorm statistics): what papers count as
    parameters transmitted. Logged as params_sent."""
    return sum(t.numel() for t in state.values())


@dataclass
class CarriedModel:
    """What a node of a model-only protocol carries from round to round (node.carry): its model."""
    model: Resident


def data_sample(data: NodeTensors) -> tuple:
    """(x, y) of the node's training split, or of its test split when it has no training samples: what
    the counted work of its model is counted on."""
    return (data.train_x, data.train_y) if len(data.train_y) else (data.test_x, data.test_y)


def keep_data(node, data: NodeTensors, model) -> NodeTensors:
    """The node's splits kept where its jobs run: the same fields, each tensor replaced by its handle; with
    the counted work of `model` (the model the node trains) on them."""
    return replace(data, work=model_work(model, *data_sample(data)), **{
        f.name: node.keep(getattr(data, f.name)) for f in fields(data) if torch.is_tensor(getattr(data, f.name))})


# -- results

def last_rows(records: dict[str, list[dict]], stream: str) -> dict[int, dict]:
    """Each node's last row of `stream`, by node id."""
    last = {}
    for row in records.get(stream, []):
        last[row["node"]] = row
    return dict(sorted(last.items()))
