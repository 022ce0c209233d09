"""FedLinked (the report in ../shared/seeds/fedlinked-report.txt: Algorithm 3, Sections 3.2-3.5).

Nodes share neither data nor parameters, only representations alpha(j, X0) of a public
unlabelled set X0 (--public-fraction of every class, held out before partitioning). Every
model has its own architecture and weights; only the width of the representation (--d-z,
the backbone's output) is common.
  0. Pretraining: local training with early stopping (--init-epochs at most).
  Each round r:
  1. client j sends alpha(j, X0): its backbone's outputs on X0 (or on --public-subsample N
     samples of it, the same N for every node, drawn afresh each round from the run's seed);
  2. for every k != j heard: R_kj = sum_x alpha(k, x) alpha(j, x)^T = U S V^T and the Procrustes
     map B_kj = V U^T (Eq. 3.12, the orthogonal B maximising trace(B R_kj)); --procrustes off
     sets B_kj = I (the report's ablation);
  3. cross-utility, Eq. 3.5 on the mapped representations (Eq. 3.14): s_kj = sum_x
     <alpha(j, x), B_kj alpha(k, x)>, A_kj = sqrt(eta) s_kj / ||s_.j||. The normalisation is per
     column, which solves Eq. 3.4 under its constraint sum_k A_kj^2 = eta for every j (the printed
     Eq. 3.5 sums over all pairs, which meets the constraint only summed over j);
  4. target f*_j = sum_k A_kj B_kj alpha(k) / sum_k |A_kj| (the report divides by sum_k A_kj, the
     same for A >= 0, which the maps guarantee; without them a column of mixed signs could bring
     the sum near zero and the target far beyond every representation);
  5. j fits its representations to f*_j on X0 for --dist-epochs (Eq. 3.6), with the loss
     weighted by sum_k |A_kj|, as Eq. 3.1's first term weights it (so eta sets the pull);
  6. j fine-tunes its task-specific layers, backbone frozen (--finetune-epochs), then trains
     locally with early stopping on its first validation split (--local-epochs at most, --patience;
     by the validation loss: the accuracy of a split of a few samples saturates and stops all training);
  7. j scores its model on its second validation split and keeps the best so far; after the last
     round it rolls back to it (the rollback of Section 3.5).
fedlinked runs on a star: steps 2-4 run on the server node, and client j receives only f*_j
and its weight, never A, B or another client's representations. fedlinked-p2p runs on any
graph: each node computes its own column of A, its maps and f* from its neighbours' alpha.
A round waits --timeout for representations, round 0 (--init-epochs + 1) times that: pretraining
runs up to --init-epochs epochs where a later round runs up to --local-epochs.
--eta 0 is separated learning: the same pretraining, early stopping and rollback, no messages.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from rich import box
from rich.table import Table

from emulator.compute import Resident
from emulator.errors import UsageError
from emulator.protocol import register
from p2p_emulator.workloads.lazy import LazyModule
from p2p_emulator.workloads.task import WorkloadOptions
from p2p_emulator.workloads.training import accuracy, mean_loss, sgd
from p2p_emulator.workloads.work import FORWARD_SHARE

from .common import LearningProtocol, SGDOptions, TimeoutOptions, check, default, expects
from .fedavg import from_server, star

torch = LazyModule("torch")

REPS = "reps"  # alpha(j, X0): float32, (public samples, d_z)
TARGET = "target"  # f*_j, the same shape
WEIGHT = "weight"  # sum_k |A_kj|: how hard j is pulled to f*_j


@dataclass
class FedLinkedOptions(TimeoutOptions, SGDOptions):
    public_fraction: float = default(WorkloadOptions, "public_fraction", 0.25)
    val_fraction: float = default(WorkloadOptions, "val_fraction", 0.1)
    rollback_fraction: float = default(WorkloadOptions, "rollback_fraction", 0.1)
    partition: str = default(WorkloadOptions, "partition", "fedlinked")
    init: str = default(WorkloadOptions, "init", "independent")
    d_z: int = default(WorkloadOptions, "d_z", 128)
    local_epochs: int = default(SGDOptions, "local_epochs", 5)
    eta: float = field(default=2.0, metadata={
        "help": "fedlinked: collaboration strength, sum_k A_kj^2 = eta (0: separated learning, no messages)"})
    procrustes: str = field(default="on", metadata={
        "help": "fedlinked: on (map each representation with B_kj, Eq. 3.12) or off (B_kj = I)"})
    standardise: str = field(default="on", metadata={
        "help": "fedlinked: on (A and B from representations centred and scaled to unit norm, f* mapped back "
                "into each node's own) or off (the report's raw representations)"})
    init_epochs: int = field(default=20, metadata={"help": "fedlinked: pretraining epochs at most (early stopping)"})
    dist_epochs: int = field(default=5, metadata={
        "help": "fedlinked: epochs fitting the representations to f* on the public set (Eq. 3.6)"})
    finetune_epochs: int = field(default=2, metadata={
        "help": "fedlinked: epochs training the task-specific layers alone after the fit"})
    patience: int = field(default=3, metadata={
        "help": "fedlinked: early stopping after this many epochs without a lower validation loss"})
    public_subsample: int = field(default=0, metadata={
        "help": "fedlinked: send representations of N random public samples, drawn afresh each round (0: all)"})

    def validate(self):
        super().validate()
        check("eta", self.eta, self.eta >= 0, "must not be negative (0: separated learning)")
        for flag, value in (("procrustes", self.procrustes), ("standardise", self.standardise)):
            check(flag, repr(value), value in ("on", "off"), "choose on or off")
        for flag, value in (("init-epochs", self.init_epochs), ("dist-epochs", self.dist_epochs),
                            ("finetune-epochs", self.finetune_epochs), ("public-subsample", self.public_subsample)):
            check(flag, value, value >= 0, "must not be negative")
        check("patience", self.patience, self.patience >= 1, "must be at least 1")
        check("local-steps", self.local_steps, self.local_steps == 0,
              "fedlinked trains by epochs, with early stopping; use --local-epochs")
        if self.eta > 0:
            check("public-fraction", self.public_fraction, self.public_fraction > 0,
                  "fedlinked shares representations of a public set; give it a share of the data (e.g. 0.25)")


# -- the algebra of steps 2-4 (numpy, float64): the server's, or each node's under fedlinked-p2p

def procrustes(r: np.ndarray) -> np.ndarray:
    """The orthogonal B maximising trace(B R): V U^T, from R = U S V^T (Eq. 3.12)."""
    u, _, vt = np.linalg.svd(r)
    return vt.T @ u.T


def standardise(alpha: np.ndarray):
    """(alpha minus its mean over the samples, over its Frobenius norm; the map from that frame back to alpha's)."""
    alpha = alpha.astype(np.float64)
    mean = alpha.mean(0)
    scale = float(np.linalg.norm(alpha - mean)) or 1.0
    return (alpha - mean) / scale, lambda y: y * scale + mean


def raw(alpha: np.ndarray):
    """alpha as it is (--standardise off), and the identity back."""
    return alpha.astype(np.float64), lambda y: y


def utility_column(own: np.ndarray, others: dict[int, np.ndarray], eta: float, maps: bool = True,
                   frame=standardise) -> tuple[dict[int, float], dict[int, np.ndarray], object]:
    """Node j's column of A (Eqs. 3.5, 3.14), the others' representations mapped into j's (B_kj alpha(k)),
    all in `frame`, and the map from that frame back to j's representations.

    own: alpha(j, X0), (n, d); others: k -> alpha(k, X0). Rows are samples, so B alpha(k, x) is a @ B^T.
    """
    own, back = frame(own)
    mapped = {}
    for k, alpha in others.items():
        alpha = frame(alpha)[0]
        mapped[k] = alpha @ procrustes(alpha.T @ own).T if maps else alpha
    scores = {k: float(np.sum(own * a)) for k, a in mapped.items()}
    norm = np.sqrt(sum(s * s for s in scores.values()))
    column = {k: (float(np.sqrt(eta)) * s / norm if norm > 0 else 0.0) for k, s in scores.items()}
    return column, mapped, back


def regulariser(own: np.ndarray, others: dict[int, np.ndarray], eta: float, maps: bool = True,
                frame=standardise) -> tuple[dict[int, float], dict | None]:
    """(A's column for j, the body j gets: f*_j and sum_k |A_kj|; None while A's column is all zero)."""
    column, mapped, back = utility_column(own, others, eta, maps, frame)
    weight = sum(abs(a) for a in column.values())
    if weight == 0:
        return column, None
    target = back(sum(a * column[k] for k, a in mapped.items()) / weight)
    return column, {TARGET: target.astype(np.float32), WEIGHT: float(weight)}


# -- jobs: they run where the node's model lives

def represent(model, x, index: np.ndarray, batch_size: int = 1024) -> np.ndarray:
    """alpha(j, X0[index]): the backbone's outputs, float32."""
    model.eval()
    picked = x[torch.as_tensor(index, device=x.device)]
    with torch.no_grad():
        out = torch.cat([model.features(picked[i:i + batch_size]) for i in range(0, len(picked), batch_size)])
    return out.float().cpu().numpy()


def distil(model, x, index: np.ndarray, target: np.ndarray, weight: float, **options) -> float:
    """Eq. 3.6: SGD on the backbone towards f*_j, loss weight * mean squared error; the mean loss."""
    def objective(x_batch, target_batch):
        return weight * torch.nn.functional.mse_loss(model.features(x_batch), target_batch)
    picked, goal = x[torch.as_tensor(index, device=x.device)], torch.as_tensor(target, device=x.device)
    return sgd(model, picked, goal, steps=0, objective=objective, parameters=model.backbone.parameters(),
               **options)[0]


def finetune(model, x, y, **options) -> tuple[float, int]:
    """SGD on the task-specific layers alone: the backbone runs frozen, in eval mode."""
    def forward(x_batch, _):
        model.backbone.eval()
        with torch.no_grad():
            z = model.features(x_batch)
        return model.classifier(z)
    return sgd(model, x, y, forward=forward, **options)


def copy_model(target, source) -> None:
    """target <- source: weights and buffers."""
    target.load_state_dict(source.state_dict())


@dataclass
class Carried:
    """What a client carries from round to round: its model, the rollback copy of its best (kept) and
    early stopping's scratch copy (best), the best rollback accuracy, whether the initial epochs ran,
    and (on a star) the first round it takes part in again after falling behind the server."""
    model: Resident
    kept: Resident
    best: Resident
    best_acc: float = -1.0
    pretrained: bool = False
    resume: int = 0


class Linked(LearningProtocol):
    """What fedlinked and fedlinked-p2p share: the public set, a node's learning in a round, the summary."""
    dp_refused = ("trains with objectives of its own (distillation, fine-tuning) and sends "
                  "representations of the public set")
    checkpointable = True
    Options = FedLinkedOptions
    state_copies = 3.0  # the model, the early-stopping best and the rollback best

    def __init__(self, options, run_info, **workload):
        super().__init__(options, run_info, **workload)
        self.public = self.workload.public()  # public data, normalised once; each node keeps it as its own
        self.public_size = 0 if self.public is None else len(self.public)
        if options.eta > 0 and self.public_size < 2:
            raise UsageError(f"--public-fraction {options.public_fraction}: the public set has {self.public_size} "
                             "samples; fedlinked needs at least 2")
        if options.public_subsample > self.public_size:
            raise UsageError(f"--public-subsample {options.public_subsample}: the public set has only "
                             f"{self.public_size} samples")

    def public_index(self, rnd: int) -> np.ndarray:
        """The round's public samples: all, or --public-subsample of them, the same at every node."""
        n, k = self.public_size, self.options.public_subsample
        if not k:
            return np.arange(n)
        return np.sort(self.run_info.seeds.numpy("fedlinked.public", rnd).choice(n, size=k, replace=False))

    def wait(self, rnd: int) -> float:
        """How long a round waits for representations: round 0 waits out pretraining too."""
        o = self.options
        return o.timeout * (o.init_epochs + 1) if rnd == 0 else o.timeout

    async def regularise(self, node, client: int, own, others: dict) -> dict | None:
        """Steps 2-4 for `client`: records its column of A, returns its body (f*, weight); None without others.
        No emulated time: SVDs of d x d matrices, one per pair."""
        o = self.options
        if not others or not np.isfinite(own).all():  # nobody heard, or the node's own model has diverged
            return None
        column, body = await node.compute(regulariser, own, others, o.eta, o.procrustes == "on",
                                          standardise if o.standardise == "on" else raw, work=0)
        node.record("utility", client=client, utility={str(k): a for k, a in column.items()})
        return body

    def reps_check(self, samples: int):
        return expects(**{REPS: np.zeros((samples, self.options.d_z), np.float32)})

    def target_check(self, samples: int):
        body = expects(**{TARGET: np.zeros((samples, self.options.d_z), np.float32), WEIGHT: float})
        return lambda value: value is None or body(value)

    def setup(self, node, part: int):
        """The node's model and data, scratch copies for the two bests, and X0 where its jobs run."""
        model, data = self.hold(node, part)
        kept, best_epoch = node.keep(self.initial_model(part)), node.keep(self.initial_model(part))
        return model, data, kept, best_epoch, node.keep(self.public) if self.public is not None else None

    async def represent(self, node, model, data, public, index) -> dict:
        return {REPS: await node.compute(represent, model, public, index, work=data.work.scoring(len(index)))}

    async def early_stopping(self, node, model, data, best, max_epochs: int) -> tuple[float | None, int]:
        """Up to max_epochs epochs, stopping after --patience without a lower loss on the early-stopping split
        (the loss, not the accuracy, which a split of a few samples saturates); the model ends as the best of
        its states, the one it started from included. (last training loss, epochs run)"""
        loss, patience = None, self.options.patience
        if not len(data.val_y):
            for _ in range(max_epochs):
                loss = await self.train(node, model, data, epochs=1)
            return loss, max_epochs
        best_loss, waited, epochs = await self.validation_loss(node, model, data), 0, 0
        await node.compute(copy_model, best, model, work=0)
        while epochs < max_epochs and waited < patience:
            loss, epochs = await self.train(node, model, data, epochs=1), epochs + 1
            val_loss = await self.validation_loss(node, model, data)
            if val_loss < best_loss:
                best_loss, waited = val_loss, 0
                await node.compute(copy_model, best, model, work=0)
            else:
                waited += 1
        await node.compute(copy_model, model, best, work=0)
        return loss, epochs

    @staticmethod
    async def validation_loss(node, model, data) -> float:
        return await node.compute(mean_loss, model, data.val_x, data.val_y, work=data.work.scoring(len(data.val_y)))

    async def learn(self, node, model, data, best, public, index, body: dict | None) -> dict:
        """Steps 5-6 for the round; the metrics."""
        o, metrics = self.options, {}
        if body is not None:
            metrics["distil_loss"] = await node.compute(
                distil, model, public, index, body[TARGET], body[WEIGHT], epochs=o.dist_epochs, lr=o.lr,
                momentum=o.momentum, weight_decay=o.weight_decay, batch_size=o.batch_size,
                generator=node.torch_generator, work=data.work.training(o.dist_epochs * len(index), o.batch_size))
            if o.finetune_epochs:
                await self.train(node, model, data, job=finetune, passes=FORWARD_SHARE,
                                 epochs=o.finetune_epochs)
        loss, epochs = await self.early_stopping(node, model, data, best, o.local_epochs)
        return {**metrics, "regularised": body is not None, "local_epochs_run": epochs,
                **({"train_loss": loss} if loss is not None else {})}

    async def roll(self, node, model, data, kept, best_acc: float) -> tuple[float, dict]:
        """Step 7: score on the rollback split, keep the best; after the last round, load it back."""
        if not len(data.rollback_y):
            return best_acc, await self.evaluate(node, model, data)
        acc = await node.compute(accuracy, model, data.rollback_x, data.rollback_y,
                                 work=data.work.scoring(len(data.rollback_y)))
        if acc >= best_acc:
            best_acc = acc
            await node.compute(copy_model, kept, model, work=0)
        if node.round == self.run_info.rounds - 1:
            await node.compute(copy_model, model, kept, work=0)
        return best_acc, {"rollback_acc": acc, **await self.evaluate(node, model, data)}

    async def pretrained(self, node, state: "Carried", data) -> dict:
        """The initial epochs, once, first thing in round 0: their metrics then, {} after."""
        if state.pretrained:
            return {}
        state.pretrained = True
        loss, epochs = await self.early_stopping(node, state.model, data, state.best, self.options.init_epochs)
        return {"pretrain_epochs": epochs, **({"pretrain_loss": loss} if loss is not None else {})}

    def summary(self, records):
        """A in the last round that has it: {j: {k: A_kj}}, and for each j the k it ranks first."""
        last: dict[str, dict] = {}
        for row in records.get("utility", []):
            last[str(row["client"])] = row
        top = max((row["round"] for row in last.values()), default=None)
        utility = {j: row["utility"] for j, row in sorted(last.items(), key=lambda item: int(item[0]))
                   if row["round"] == top}
        return {"utility": utility, "utility_round": top,
                "ranked_first": {j: max(col, key=col.get) for j, col in utility.items() if col}}

    def render(self, console, summary) -> None:
        """A as a matrix (up to 6 nodes), else per node j the k it ranks first."""
        utility = summary.get("utility") or {}
        if not utility:
            return
        table = Table(title=f"{self.name}: cross-utility A_kj in round {summary['utility_round']} "
                            "(how useful k is to j)", box=box.SIMPLE_HEAD)
        if len(utility) <= 6:  # row j, column k, as plots/utility.png draws it
            table.add_column("j \\ k")
            others = sorted({k for col in utility.values() for k in col}, key=int)
            for k in others:
                table.add_column(k, justify="right")
            for j, column in utility.items():
                table.add_row(j, *(f"{column[k]:.3f}" if k in column else "-" for k in others))
        else:
            for name in ("j", "k ranked first", "its A_kj", "mean A_kj"):
                table.add_column(name, justify="right")
            for j, k in summary["ranked_first"].items():
                column = utility[j]
                table.add_row(j, k, f"{column[k]:.3f}", f"{sum(column.values()) / len(column):.3f}")
        console.print(table)


@register("fedlinked")
class FedLinked(Linked):
    """FedLinked on a star: the server computes A, the maps and each client's f*_j."""

    def __init__(self, options, run_info):
        self.server, self.clients = star(run_info.graph, "fedlinked")
        super().__init__(options, run_info, parts=len(self.clients))
        self.part = {client: part for part, client in enumerate(self.clients)}

    async def run(self, node):
        await (self._serve(node) if node.id == self.server else self._client(node))

    async def run_no_rounds(self, node):
        if node.id != self.server:
            model, data = self.hold(node, self.part[node.id])
            node.log(**await self.scores(node, model, data))

    async def _serve(self, node):
        o = self.options
        async for _ in node.rounds():
            if o.eta == 0:
                continue  # separated learning: nothing to serve
            index = self.public_index(node.round)
            heard = await node.gather(REPS, peers=node.neighbours, timeout=self.wait(node.round),
                                      valid=self.reps_check(len(index)))
            alphas = {k: m.body[REPS] for k, m in heard.items()}
            for j in node.neighbours:
                others = {k: a for k, a in alphas.items() if k != j}
                node.send(j, TARGET, await self.regularise(node, j, alphas[j], others) if j in alphas else None)
            node.log(heard_from=len(heard))

    async def _client(self, node):
        o = self.options
        model, data, kept, best, public = self.setup(node, self.part[node.id])
        state = node.carry(Carried(model, kept, best))
        async for _ in node.rounds():
            first = await self.pretrained(node, state, data)
            index, body = self.public_index(node.round), None
            # behind the server (it answered a later round), a client learns alone until it has caught up
            if o.eta > 0 and node.round >= state.resume and self.server in node.neighbours:
                node.send(self.server, REPS, await self.represent(node, model, data, public, index))
                message = await from_server(node, TARGET, self.target_check(len(index)),
                                            self.wait(node.round) + o.timeout)
                if message is not None and message.round > node.round:
                    state.resume = message.round + 1
                elif message is not None:
                    body = message.body
            metrics = await self.learn(node, model, data, best, public, index, body)
            state.best_acc, scores = await self.roll(node, model, data, kept, state.best_acc)
            node.log(**first, **metrics, **scores)

    def summary(self, records):
        return {"server": self.server, **super().summary(records)}


@register("fedlinked-p2p")
class FedLinkedP2P(Linked):
    """FedLinked with no server: each node computes its own column of A, its maps and f* from its neighbours'."""

    async def run(self, node):
        o = self.options
        model, data, kept, best, public = self.setup(node, node.id)
        state = node.carry(Carried(model, kept, best))
        async for _ in node.rounds():
            first = await self.pretrained(node, state, data)
            index, body, heard = self.public_index(node.round), None, {}
            if o.eta > 0:
                own = await self.represent(node, model, data, public, index)
                node.broadcast(REPS, own)
                heard = await node.gather(REPS, timeout=self.wait(node.round), valid=self.reps_check(len(index)))
                body = await self.regularise(node, node.id, own[REPS], {k: m.body[REPS] for k, m in heard.items()})
            metrics = await self.learn(node, model, data, best, public, index, body)
            state.best_acc, scores = await self.roll(node, model, data, kept, state.best_acc)
            node.log(**first, **metrics, heard_from=len(heard), **scores)
