"""MAPL (Mukherjee, Simonetto, Jamali-Rad): model-agnostic peer-to-peer learning.

Every node has its own backbone (any architecture), projection head, classifier
g_phi (ReLU, then a bias-free Linear d_z -> K) and K learnable prototypes xi_i
(K x d_p). Round t, node i (Algorithm 3):
  1. PML (Algorithm 1): E epochs of Adam over two augmented views of each sample
     on l_ce + l_cont + l_proto + l_uni (backbone, head, classifier and xi_i).
     Images only: token ids (--model char-lstm) and feature vectors have no augmentation, so
     there both views are the samples themselves (a departure: the paper is about images). With
     char-lstm --normalize is free, the projection head reads the LSTM's last state (z), and the
     classifier (no ReLU, a bias) sends only its K x d_z weight: the bias stays local.
  2. Send xi_i to the neighbours it still talks to; from T_thr on also the
     classifier weight Phi_i (K x d_z); in round 0 also its sample count n_i.
  3. CGL (Algorithm 2), from T_thr on: c_ij = cos(d_i - mean d_i, d_j - mean d_j), d_i[k] =
     ||Phi_i[k] - mean_k Phi_i[k]|| (the paper: mean_k cos(Phi_i[k], Phi_j[k]); docs/mapl.md says
     why); s_ij = -c_ij (s_ii = -1); E_g steps on
       l_g(w_i) = mu1 sum_j gamma_j s_ij w_ij + mu2 (beta ||w_i||_2 - log(deg_i + eps)),
     gamma_j = n_j / sum_k n_k over i and its neighbours (the global share on a
     mesh), deg_i = sum_{j != i} w_ij, each step followed by the Euclidean
     projection onto the simplex.
  4. xi_i <- w_ii xi_i + sum_j w_ij xi_j; a neighbour not heard from this round
     leaves its weight with i.
  5. Sparsification: once w_ij = 0 (at most --zero-weight, 1e-4: the authors' sign
     steps can leave a weight at a few 1e-6 round after round), i drops j: it
     tells j so (a "drop" message of a few bytes, this round) and never sends to
     j nor waits for j again. j drops i on hearing it (before its next send; its
     weight on i is spread over the rest of its row), so a link dies in both
     directions. (A drop notice lost on a lossy link leaves j waiting up to
     --timeout for i each round.)
CGL scores a neighbour whose classifier did not arrive this round with the last one
it sent (never one: similarity -1, as the authors' code scores non-neighbours).

Where the defaults depart from the paper or the authors' code (--classifier-rows,
--loss-forms, --similarity, --graph-step, --degree-barrier, --no-sparsify), and the
CPU-sized defaults: docs/mapl.md. PML (step 1) lives in p2p_emulator/workloads/prototypes.py.

Variants: `mapl+` (one architecture for all nodes) also averages the backbones
with w_i (the backbone rides on the same message); --mapl-no-cgl is the paper's
"MAPL w/o CGL": W stays uniform over the neighbours and no classifier is sent.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from rich import box
from rich.table import Table

from emulator.compute import Resident
from emulator.errors import UsageError
from emulator.protocol import register
from p2p_emulator.workloads import model_specs
from p2p_emulator.workloads.lazy import LazyModule
from p2p_emulator.workloads.training import mix

from .common import (LearningProtocol, TimeoutOptions, TrainingOptions, check, default, expects, last_rows, like,
                     option_help, own_row, positive_int)

torch = LazyModule("torch")
# PML (prototypes) and its augmentations (torchvision): imported when MAPL is set up
pml = LazyModule("p2p_emulator.workloads.prototypes")
augment = LazyModule("p2p_emulator.workloads.augment")
LOSS_FORMS = ("code", "paper")  # pml.LOSSES's keys: checking --loss-forms must not load torch
PML_TERMS = ("cont", "proto", "uni")  # pml.TERMS, for the same reason

KIND, DROP = "mapl", "drop"
DEGREE_EPS = 1e-6  # the code's epsilon in log(deg_i + eps)


@dataclass
class MapLOptions(TimeoutOptions, TrainingOptions):
    dataset: str = default(TrainingOptions, "dataset", "digits")
    partition: str = default(TrainingOptions, "partition", "mapl:scenario=1")
    model: str = default(TrainingOptions, "model", "hetero-small")
    d_z: int = default(TrainingOptions, "d_z", 128)
    init: str = default(TrainingOptions, "init", "independent")  # heterogeneous backbones cannot share one x0
    local_epochs: int = field(default=2, metadata=option_help("local epochs per round (paper: 1)"))
    lr: float = field(default=3e-3, metadata=option_help("learning rate (MAPL: Adam; paper 1e-4)"))
    weight_decay: float = default(TrainingOptions, "weight_decay", 0.0)
    batch_size: int = field(default=32, metadata=option_help("local batch size (MAPL paper: 64)"))
    d_p: int = field(default=128, metadata=option_help("MAPL: prototype and projection width (paper 512)"))
    projection_hidden: int = field(default=512, metadata=option_help("MAPL: projection head hidden width (paper 4096)"))
    adam_beta1: float = field(default=0.5, metadata=option_help("MAPL: Adam's beta1 for PML and CGL"))
    crop_scale: float = field(default=0.5, metadata=option_help(
        "MAPL: smallest crop area of the augmentation, as a fraction of the image (code: 0.2)"))
    tau: float = field(default=100.0, metadata=option_help("MAPL: temperature of the contrastive losses"))
    loss_forms: str = field(default="code", metadata=option_help("MAPL losses: code (authors' code) or paper"))
    pml_losses: str = field(default="cont,proto,uni", metadata=option_help(
        "MAPL: PML's losses beside the cross-entropy, a comma list of cont, proto and uni, or none (to ablate them)"))
    t_thr: int = field(default=-1, metadata=option_help("MAPL: first round of graph learning (-1: rounds // 4)"))
    mu1: float = field(default=0.5, metadata=option_help("MAPL: weight of the similarity term of l_g"))
    mu2: float = field(default=0.1, metadata=option_help("MAPL: weight of the graph regulariser"))
    beta: float = field(default=0.5, metadata=option_help("MAPL: weight of ||w_i||_2 in the graph regulariser"))
    similarity: str = field(default="max", metadata=option_help("MAPL: max (code: c_ij / max c) or raw (paper)"))
    classifier_rows: str = field(default="norms", metadata=option_help(
        "MAPL: what c_ij compares of two classifiers Phi: norms (the K distances of the rows from their mean "
        "row, the same in any basis of the latent), centred (the rows minus their mean row, class by class) "
        "or raw (the rows, class by class: paper and code)"))
    graph_step: str = field(default="adam", metadata=option_help("MAPL: adam (code: fresh Adam) or sgd (paper)"))
    graph_lr: float = field(default=0.1, metadata=option_help("MAPL: step size of graph learning"))
    graph_steps: int = field(default=1, metadata=option_help("MAPL: graph-learning steps per round (E_g)"))
    degree_barrier: bool = field(default=False, metadata=option_help(
        "MAPL: let -log(deg_i) push w_i (paper); the code holds deg_i constant"))
    zero_weight: float = field(default=1e-4, metadata=option_help(
        "MAPL: a learned w_ij at or below this counts as 0 and the link is dropped (sign steps can park a "
        "weight at a few 1e-6 for good)"))
    no_sparsify: bool = field(default=False, metadata=option_help(
        "MAPL: keep sending to zero-weight neighbours (the authors' code)"))
    mapl_no_cgl: bool = field(default=False, metadata=option_help(
        "MAPL w/o CGL: uniform weights over the neighbours, no classifier exchange"))

    def validate(self):
        super().validate()
        for flag, value, allowed in (("loss-forms", self.loss_forms, LOSS_FORMS),
                                     ("similarity", self.similarity, ("max", "raw")),
                                     ("classifier-rows", self.classifier_rows, ("norms", "centred", "raw")),
                                     ("graph-step", self.graph_step, ("adam", "sgd"))):
            if value not in allowed:
                raise UsageError(f"--{flag} {value!r}: choose {' or '.join(allowed)}")
        if min(self.tau, self.graph_lr) <= 0:
            raise UsageError("--tau and --graph-lr must be positive")
        check("graph-steps", self.graph_steps, self.graph_steps >= 1, "must be at least 1")
        terms = self.pml_terms()
        check("pml-losses", self.pml_losses, set(terms) <= set(PML_TERMS) and len(set(terms)) == len(terms),
              f"a comma list of {', '.join(PML_TERMS)} without repeats, or none")
        if self.t_thr < -1 or min(self.mu1, self.mu2, self.beta) < 0:
            raise UsageError("--t-thr must be -1 or a round, --mu1/--mu2/--beta not negative")
        if not 0 < self.crop_scale <= 1:
            raise UsageError(f"--crop-scale {self.crop_scale}: must be in (0, 1]")
        if not 0 <= self.zero_weight < 1:
            raise UsageError(f"--zero-weight {self.zero_weight}: must be in [0, 1)")
        if not 0 <= self.adam_beta1 < 1:
            raise UsageError(f"--adam-beta1 {self.adam_beta1}: must be in [0, 1)")
        # Images' views un-standardise, augment in 0..1 and standardise again; token ids are never normalised.
        if self.normalize != "standard" and model_specs.reads_images(self.model):
            raise UsageError(f"--normalize {self.normalize}: MAPL's augmentation of images needs "
                             "--normalize standard")
        if min(self.d_p, self.projection_hidden) < 1:
            raise UsageError("--d-p and --projection-hidden must be at least 1")

    def pml_terms(self) -> tuple[str, ...]:
        return () if self.pml_losses == "none" else tuple(self.pml_losses.split(","))


# ---------------------------------------------------------------- CGL

def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection onto {w >= 0, sum w = 1} (sort-based, Condat 2016 Alg. 1 / Held et al.)."""
    u = torch.sort(v, descending=True).values
    k = torch.arange(1, len(v) + 1, dtype=v.dtype)
    thresholds = (u.cumsum(0) - 1) / k
    rho = int((u > thresholds).nonzero().max())  # the largest k with (sum_{r<=k} u_r - 1)/k < u_k
    return torch.clamp(v - thresholds[rho], min=0)


def classifier_similarity(own: torch.Tensor, other: torch.Tensor, rows: str) -> float:
    """c_ij from two classifiers Phi (K x d_z), by the rule `rows`:

    - "raw" (paper and code): mean over classes k of cos(Phi_i[k], Phi_j[k]);
    - "centred": the same on the rows minus their mean row. Adding one vector to every row shifts
      every logit by the same amount, which the softmax cannot see;
    - "norms": cos of the K distances ||Phi[k] - mean row||, each set centred over the classes.
      Heterogeneous backbones share no basis of the latent, and these distances are the same in
      any basis; comparing rows coordinate by coordinate decays as each node's latent drifts
      (docs/mapl.md).
    """
    if rows != "raw":
        own, other = own - own.mean(0), other - other.mean(0)
    if rows != "norms":
        return float(torch.nn.functional.cosine_similarity(own, other, dim=1).mean())
    spread_own, spread_other = own.norm(dim=1), other.norm(dim=1)
    return float(torch.nn.functional.cosine_similarity(spread_own - spread_own.mean(),
                                                       spread_other - spread_other.mean(), dim=0))


def dissimilarity(c: torch.Tensor, rule: str) -> torch.Tensor:
    """s over (i, neighbours...) from the neighbours' c_ij: s_ii = -1, s_ij = -c_ij (/ max c when 'max' and > 0)."""
    if rule == "max" and len(c) and c.max() > 0:
        c = c / c.max()
    return -torch.cat([torch.ones(1), c])


def learn_row(w: torch.Tensor, s: torch.Tensor, gamma: torch.Tensor, o: MapLOptions) -> torch.Tensor:
    """E_g projected steps on l_g(w_i); index 0 is node i itself."""
    w = w.clone().requires_grad_(True)
    adam = torch.optim.Adam([w], lr=o.graph_lr, betas=(o.adam_beta1, pml.ADAM_BETA2)) if o.graph_step == "adam" else None
    for _ in range(o.graph_steps):
        degree = w[1:].sum() if o.degree_barrier else w[1:].sum().detach()
        loss = o.mu1 * (gamma * s * w).sum() + o.mu2 * (o.beta * w.norm() - torch.log(degree + DEGREE_EPS))
        grad, = torch.autograd.grad(loss, w)
        with torch.no_grad():
            if adam is None:
                w -= o.graph_lr * grad
            else:
                w.grad = grad
                adam.step()
            w.copy_(project_simplex(w))
    return w.detach()


@dataclass
class Carried:
    """What a node carries from round to round: its model, its prototypes xi_i and its row w_i of W."""
    model: Resident
    prototypes: torch.Tensor
    row: "CollaborationRow"


class CollaborationRow:
    """Node i's row w_i of W, over itself and the neighbours it still talks to (i first)."""

    def __init__(self, me: int, neighbours: list[int], samples: int):
        self.me = me
        self.weights = {j: 1 / (len(neighbours) + 1) for j in [me, *neighbours]}
        self.samples = {me: samples}  # n_j, heard once
        self.classifiers: dict[int, torch.Tensor] = {}  # the last Phi_j heard
        self.similarity: dict[int, float] = {}  # c_ij of the last CGL call, before any normalisation

    @property
    def peers(self) -> list[int]:
        return [j for j in self.weights if j != self.me]

    def hear(self, heard: dict) -> None:
        for j, message in heard.items():
            if "samples" in message.body:
                self.samples[j] = message.body["samples"]
            if "classifier" in message.body:
                self.classifiers[j] = message.body["classifier"]

    def drop(self, j: int) -> None:
        """Forget j; the rest of the row is rescaled to sum to one."""
        if self.weights.pop(j, None) is None:
            return
        total = sum(self.weights.values())
        if total <= 0:  # nothing left to rescale: keep to itself
            self.weights[self.me] = total = 1.0
        self.weights = {k: w / total for k, w in self.weights.items()}

    def learn(self, own_classifier: torch.Tensor, o: MapLOptions) -> None:
        """CGL (Algorithm 2) on this row."""
        self.similarity = {j: classifier_similarity(own_classifier, self.classifiers[j], o.classifier_rows)
                           if j in self.classifiers
                           else -1.0 for j in self.peers}
        if not self.similarity:
            return
        nodes = list(self.weights)
        c = torch.tensor(list(self.similarity.values()))
        counts = torch.tensor([float(self.samples.get(j, self.samples[self.me])) for j in nodes])
        w = learn_row(torch.tensor([self.weights[j] for j in nodes]), dissimilarity(c, o.similarity),
                      counts / counts.sum(), o)
        self.weights = dict(zip(nodes, w.tolist()))

    def sparsify(self, zero_weight: float) -> list[int]:
        """Drop the neighbours whose weight counts as zero; returns them."""
        dropped = [j for j in self.peers if self.weights[j] <= zero_weight]
        for j in dropped:
            self.drop(j)
        return dropped

    def mixing(self, heard: dict) -> tuple[float, list[tuple[float, int]]]:
        """(w_ii plus the weight of neighbours not heard from, [(w_ij, j) for j heard])."""
        return own_row({j: self.weights[j] for j in heard if j in self.weights})

    def mix(self, own: torch.Tensor, received: dict[int, torch.Tensor]) -> torch.Tensor:
        self_weight, others = self.mixing(received)
        return sum((w * received[j] for w, j in others), self_weight * own)


def cluster_mass(weights: dict[int, float], me: int, clusters: list) -> float:
    """The weight node `me` puts on its own cluster, itself included."""
    return sum(w for j, w in weights.items() if clusters[j] == clusters[me])


def classifier_weight(model) -> torch.Tensor:
    """Phi_i, a copy: what a job hands back never aliases the node's live model."""
    return model.classifier[-1].weight.detach().cpu().clone()


# ---------------------------------------------------------------- protocol

@register("mapl")
class MAPL(LearningProtocol):
    """MAPL: heterogeneous models aligned by shared prototypes, with a learned collaboration graph."""
    dp_refused = "sends class prototypes and learns its collaboration graph from its private samples"
    Options = MapLOptions
    checkpointable = True
    state_copies = 3.0
    training_passes = 2  # two augmented views a sample
    averages_backbones = False

    def __init__(self, options, run_info):
        super().__init__(options, run_info, projection=(options.d_p, options.projection_hidden))
        self.t_thr = options.t_thr if options.t_thr >= 0 else run_info.rounds // 4
        self.clusters = self.workload.clusters if None not in self.workload.clusters else None
        self.stats = pml.view_stats(self.workload.dataset)

    async def run(self, node):
        o = self.options
        model, data = self.hold(node)
        prototypes = await node.compute(pml.initial_prototypes, self.workload.num_classes, o.d_p,
                                        node.torch_generator, work=0)
        views = None if self.stats is None else await node.compute(
            augment.TwoViews, self.workload.dataset.shape, node.torch_generator, scale=(o.crop_scale, 1.0),
            work=0, keep=True)
        neighbours = list(node.neighbours)
        valid = await self.expected(node, model, prototypes)
        state = node.carry(Carried(model, prototypes, CollaborationRow(node.id, neighbours, len(data.train_y))))
        row = state.row
        async for r in node.rounds():
            loss, prototypes = await node.compute(
                pml.personalised_learning, model, state.prototypes, data.train_x, data.train_y, views, self.stats,
                epochs=o.local_epochs, batch_size=o.batch_size, lr=o.lr, beta1=o.adam_beta1,
                weight_decay=o.weight_decay, tau=o.tau, forms=o.loss_forms, terms=o.pml_terms(),
                generator=node.torch_generator,
                work=data.work.training(o.local_epochs * len(data.train_y), o.batch_size) * self.training_passes)
            learn_graph = not o.mapl_no_cgl and r >= self.t_thr
            while (notice := await node.recv(timeout=0, kind=DROP, valid=like(None))) is not None:
                row.drop(notice.src)
            current = set(node.neighbours)
            peers = [j for j in row.peers if j in current]
            body = await self.message(node, model, prototypes, learn_graph, r, len(data.train_y))
            node.broadcast(KIND, body, to=peers)
            heard = await node.gather(KIND, peers=peers, timeout=o.timeout, valid=valid)
            row.hear(heard)
            if learn_graph:
                row.learn(body["classifier"], o)
            state.prototypes = row.mix(prototypes, {j: m.body["prototypes"] for j, m in heard.items()})
            if self.averages_backbones:
                self_weight, others = row.mixing(heard)
                received = [(w, heard[j].body["backbone"]) for w, j in others]
                await node.compute(mix, model.backbone, self_weight, received, work=0)
            heard_from = len(heard)
            del heard, body  # mixed: the neighbours' copies go now, not at the next round's gather
            if not o.no_sparsify:
                node.broadcast(DROP, None, to=[j for j in row.sparsify(o.zero_weight) if j in current])
            self.report(node, row, neighbours, loss, await self.evaluate(node, model, data), heard_from)

    async def expected(self, node, model, prototypes: torch.Tensor):
        """The check of a neighbour's message: the fields `message` may send, each like this node's own."""
        backbone = {"backbone": await self.state(node, model.backbone)} if self.averages_backbones else {}
        return expects(optional=("classifier", "samples", "backbone"), prototypes=prototypes,
                       classifier=await node.compute(classifier_weight, model, work=0), samples=positive_int,
                       **backbone)

    async def message(self, node, model, prototypes: torch.Tensor, learn_graph: bool, rnd: int, samples: int) -> dict:
        body = {"prototypes": prototypes}
        if learn_graph:
            body["classifier"] = await node.compute(classifier_weight, model, work=0)
        if rnd == 0:
            body["samples"] = samples
        if self.averages_backbones:
            body["backbone"] = await self.state(node, model.backbone)
        return body

    def report(self, node, row: CollaborationRow, neighbours: list[int], loss: float, evaluation: dict,
               heard: int) -> None:
        weights = {j: row.weights.get(j, 0.0) for j in sorted([node.id, *neighbours])}
        node.record("graph", weights={str(j): w for j, w in weights.items()},
                    similarity={str(j): c for j, c in sorted(row.similarity.items())})
        metrics = dict(train_loss=loss, **evaluation, heard_from=heard, links=len(row.peers))
        if self.clusters is not None:
            metrics["within_cluster"] = cluster_mass(row.weights, node.id, self.clusters)
        node.log(**metrics)

    def summary(self, records) -> dict:
        """The last W each node recorded (zeros included) and, with clusters, its weight on its own cluster."""
        rows = {i: {int(j): w for j, w in row["weights"].items()} for i, row in last_rows(records, "graph").items()}
        out = {"collaboration_graph": {str(i): {str(j): w for j, w in weights.items()}
                                       for i, weights in rows.items()}}
        if self.clusters is not None and rows:
            mass = {i: cluster_mass(weights, i, self.clusters) for i, weights in rows.items()}
            out["within_cluster_weight"] = {str(i): m for i, m in mass.items()}
            out["within_cluster_weight_mean"] = statistics.fmean(mass.values())
        return out

    def render(self, console, summary) -> None:
        """The learned W as a nodes x nodes table: row i is node i's weights, green within its cluster."""
        rows = {int(i): {int(j): w for j, w in weights.items()}
                for i, weights in summary.get("collaboration_graph", {}).items()}
        if not rows:
            return
        nodes = sorted(rows)
        caption = None if self.clusters is None else (
            f"within-cluster weight, mean over nodes: {summary['within_cluster_weight_mean']:.2f}")
        table = Table(title="learned collaboration graph W (row i: node i's weights)", caption=caption,
                      box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), show_edge=False)
        table.add_column("node", justify="right")
        table.add_column("cl", justify="right")
        for j in nodes:
            table.add_column(str(j), justify="right")
        for i in nodes:
            cells = [self.cell(i, j, rows[i].get(j, 0.0)) for j in nodes]
            table.add_row(str(i), "-" if self.clusters is None else str(self.clusters[i]), *cells)
        console.print(table)

    def cell(self, i: int, j: int, w: float) -> str:
        if w <= 0:
            return "·"
        text = f"{w:.2f}".removeprefix("0")  # ".20": three characters keep 20 nodes in 80 columns
        if self.clusters is None:
            return text
        return f"[{'green' if self.clusters[i] == self.clusters[j] else 'red'}]{text}"


@dataclass
class MapLPlusOptions(MapLOptions):
    model: str = default(TrainingOptions, "model", "cnn-small")
    init: str = default(TrainingOptions, "init", "common")

    def validate(self):
        super().validate()
        if self.model in ("hetero", "hetero-small"):
            raise UsageError(f"mapl+ averages backbones: --model {self.model} gives nodes different "
                             "architectures; choose one architecture")


@register("mapl+")
class MAPLPlus(MAPL):
    """MAPL+ (homogeneous backbones): MAPL that also averages the backbones with the learned W."""
    Options = MapLPlusOptions
    averages_backbones = True
