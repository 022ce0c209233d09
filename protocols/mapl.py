"""MAPL (Mukherjee, Simonetto, Jamali-Rad): model-agnostic peer-to-peer learning.

Every node has its own backbone (any architecture), projection head, classifier
g_phi (ReLU, then a bias-free Linear d_z -> K) and K learnable prototypes xi_i
(K x d_p). Round t, node i (Algorithm 3):
  1. PML (Algorithm 1): E epochs of Adam over two augmented views of each sample
     on l_ce + l_cont + l_proto + l_uni (backbone, head, classifier and xi_i).
  2. Send xi_i to the neighbours it still talks to; from T_thr on also the
     classifier weight Phi_i (K x d_z); in round 0 also its sample count n_i.
  3. CGL (Algorithm 2), from T_thr on: c_ij = mean_k cos(Phi_i[k], Phi_j[k]), the rows of
     each Phi first centred (below); s_ij = -c_ij (s_ii = -1); E_g steps on
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

Departure from the paper and the code (default; --classifier-rows raw restores theirs):
  --classifier-rows centred   c_ij compares Phi - mean_k Phi[k]. A vector added to every row
                      moves every logit by the same amount, which the softmax cannot see, yet
                      raw cosines count it. The rows of the classes a node never sees are
                      all pushed down along one shared direction, which dominates the mean
                      row, and the nodes of both clusters share it. On
                      digits, scenario 1, M = 10, raw c_ij across the clusters climbs from
                      0.18 at round 10 to 0.42 at round 39 (within: 0.43 to 0.54), so at
                      T_thr = 10 every neighbour passes the sign step's threshold and W stays
                      uniform; centred, within is +0.5 and across -0.5 from the first call.
                      Centred, within-cluster c_ij still decays as nodes train (0.11-0.17 at
                      round 99 of 100), and the sign step then prunes some links inside the
                      cluster too (README, "Does the graph find the clusters?").

Paper vs the authors' code (other defaults follow the code, which produced the tables):
  --loss-forms code   l_cont = -mean log(sum_pos e^{cos/tau} / sum_{pos+neg} e^{cos/tau});
                      l_proto = CE(<p_hat, xi_k>) (tau cancels: temperature 1);
                      l_uni = mean_k sum_{r!=k} exp(<xi_k, xi_r>/tau) on raw prototypes.
               paper  SupCon (mean over positives of the log-probabilities),
                      CE(cos(p_hat, xi_k)/tau), (1/K) sum_{k!=r} cos(xi_k, xi_r).
  --similarity max    c_ij divided by max_j c_ij (only when that max is positive:
                      dividing by a negative max would flip every sign); raw: c_ij.
  --graph-step adam   one fresh Adam(lr 0.1, betas (0.5, 0.999)) per CGL call, i.e.
                      about a sign step of 0.1; sgd: w_i <- w_i - graph_lr * grad.
  --degree-barrier    off (code): deg_i is a constant, the log barrier has no
                      gradient; on (paper): d/dw_ij of -log(deg_i + eps).
  --no-sparsify       the code: keep sending to (and waiting for) zero-weight
                      neighbours; the default stops, as the paper's Table 4 counts.
Both the paper and the code use tau = 100, Adam lr 1e-4, betas (0.5, 0.999),
batch 64, E = 1, T = 400, T_thr = 100, d_z = d_p = 512, head width 4096 and crops
of 20-100% of the image. CPU defaults here (20 rounds of 8x8 digits): Adam lr
3e-3, batch 32, 2 epochs per round, crops of 50-100% (a 20% crop of an 8x8 digit
is about 3x3 pixels), T_thr = rounds // 4 (--t-thr -1), d_z = d_p = 128, head
width 512, hetero-small backbones; tau = 100 and the rest as the code.

Variants: `mapl+` (one architecture for all nodes) also averages the backbones
with w_i (the backbone rides on the same message); --mapl-no-cgl is the paper's
"MAPL w/o CGL": W stays uniform over the neighbours and no classifier is sent.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from rich import box
from rich.table import Table

from emulator.errors import UsageError
from emulator.protocol import register
from workloads.augment import TwoViews
from workloads.task import WorkloadOptions
from workloads.training import batches, float_state, mix

from .base import LearningProtocol, default

KIND, DROP = "mapl", "drop"
ADAM_BETA2 = 0.999  # paper and code
DEGREE_EPS = 1e-6  # the code's epsilon in log(deg_i + eps)


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class MapLOptions(WorkloadOptions):
    dataset: str = default(WorkloadOptions, "dataset", "digits")
    partition: str = default(WorkloadOptions, "partition", "mapl:scenario=1")
    model: str = default(WorkloadOptions, "model", "hetero-small")
    d_z: int = default(WorkloadOptions, "d_z", 128)
    init: str = default(WorkloadOptions, "init", "independent")  # heterogeneous backbones cannot share one x0
    d_p: int = field(default=128, metadata=_help("MAPL: prototype and projection width (paper 512)"))
    projection_hidden: int = field(default=512, metadata=_help("MAPL: projection head hidden width (paper 4096)"))
    local_epochs: int = field(default=2, metadata=_help("local epochs per round (paper: 1)"))
    lr: float = field(default=3e-3, metadata=_help("learning rate (MAPL: Adam; paper 1e-4)"))
    adam_beta1: float = field(default=0.5, metadata=_help("MAPL: Adam's beta1 for PML and CGL"))
    weight_decay: float = field(default=0.0, metadata=_help("weight decay"))
    batch_size: int = field(default=32, metadata=_help("local batch size (MAPL paper: 64)"))
    crop_scale: float = field(default=0.5, metadata=_help(
        "MAPL: smallest crop area of the augmentation, as a fraction of the image (code: 0.2)"))
    tau: float = field(default=100.0, metadata=_help("MAPL: temperature of the contrastive losses"))
    loss_forms: str = field(default="code", metadata=_help("MAPL losses: code (authors' code) or paper"))
    t_thr: int = field(default=-1, metadata=_help("MAPL: first round of graph learning (-1: rounds // 4)"))
    mu1: float = field(default=0.5, metadata=_help("MAPL: weight of the similarity term of l_g"))
    mu2: float = field(default=0.1, metadata=_help("MAPL: weight of the graph regulariser"))
    beta: float = field(default=0.5, metadata=_help("MAPL: weight of ||w_i||_2 in the graph regulariser"))
    similarity: str = field(default="max", metadata=_help("MAPL: max (code: c_ij / max c) or raw (paper)"))
    classifier_rows: str = field(default="centred", metadata=_help(
        "MAPL: rows of Phi that c_ij compares: centred (minus their mean row, which the softmax cannot see) "
        "or raw (paper and code)"))
    graph_step: str = field(default="adam", metadata=_help("MAPL: adam (code: fresh Adam) or sgd (paper)"))
    graph_lr: float = field(default=0.1, metadata=_help("MAPL: step size of graph learning"))
    graph_steps: int = field(default=1, metadata=_help("MAPL: graph-learning steps per round (E_g)"))
    degree_barrier: bool = field(default=False, metadata=_help(
        "MAPL: let -log(deg_i) push w_i (paper); the code holds deg_i constant"))
    zero_weight: float = field(default=1e-4, metadata=_help(
        "MAPL: a learned w_ij at or below this counts as 0 and the link is dropped (sign steps can park a "
        "weight at a few 1e-6 for good)"))
    no_sparsify: bool = field(default=False, metadata=_help(
        "MAPL: keep sending to zero-weight neighbours (the authors' code)"))
    mapl_no_cgl: bool = field(default=False, metadata=_help(
        "MAPL w/o CGL: uniform weights over the neighbours, no classifier exchange"))
    timeout: float = field(default=60.0, metadata=_help("emulated seconds to wait for neighbours' messages"))

    def validate(self):
        for flag, value, allowed in (("loss-forms", self.loss_forms, LOSSES),
                                     ("similarity", self.similarity, ("max", "raw")),
                                     ("classifier-rows", self.classifier_rows, ("centred", "raw")),
                                     ("graph-step", self.graph_step, ("adam", "sgd"))):
            if value not in allowed:
                raise UsageError(f"--{flag} {value!r}: choose {' or '.join(allowed)}")
        if min(self.lr, self.tau, self.timeout, self.graph_lr) <= 0:
            raise UsageError("--lr, --tau, --timeout and --graph-lr must be positive")
        if min(self.batch_size, self.local_epochs, self.graph_steps) < 1:
            raise UsageError("--batch-size, --local-epochs and --graph-steps must be at least 1")
        if self.t_thr < -1 or min(self.mu1, self.mu2, self.beta, self.weight_decay) < 0:
            raise UsageError("--t-thr must be -1 or a round, --mu1/--mu2/--beta/--weight-decay not negative")
        if not 0 < self.crop_scale <= 1:
            raise UsageError(f"--crop-scale {self.crop_scale}: must be in (0, 1]")
        if not 0 <= self.zero_weight < 1:
            raise UsageError(f"--zero-weight {self.zero_weight}: must be in [0, 1)")
        if not 0 <= self.adam_beta1 < 1:
            raise UsageError(f"--adam-beta1 {self.adam_beta1}: must be in [0, 1)")
        if self.normalize != "standard":  # the two views un-standardise, augment in 0..1, standardise again
            raise UsageError(f"--normalize {self.normalize}: MAPL's augmentation needs --normalize standard")
        if min(self.d_p, self.projection_hidden) < 1:
            raise UsageError("--d-p and --projection-hidden must be at least 1")


# ---------------------------------------------------------------- PML losses

def code_losses(p: torch.Tensor, y: torch.Tensor, xi: torch.Tensor, tau: float) -> torch.Tensor:
    """l_cont + l_proto + l_uni as the authors' code computes them."""
    p_hat = F.normalize(p, dim=1)
    eye = torch.eye(len(y), dtype=torch.bool, device=y.device)
    same = y[:, None] == y[None, :]
    logits = p_hat @ p_hat.T / tau
    # log(pos / (pos + neg)), pos = same label but not itself, neg = other labels (never itself)
    cont = -(logits.masked_fill(~same | eye, -math.inf).logsumexp(1)
             - logits.masked_fill(eye, -math.inf).logsumexp(1)).mean()
    proto = F.cross_entropy(p_hat @ xi.T, y)
    others = ~torch.eye(len(xi), dtype=torch.bool, device=xi.device)
    uni = (torch.exp(xi @ xi.T / tau) * others).sum(1).mean()
    return cont + proto + uni


def paper_losses(p: torch.Tensor, y: torch.Tensor, xi: torch.Tensor, tau: float) -> torch.Tensor:
    """l_cont + l_proto + l_uni as the paper writes them (cosine forms), averaged over the 2B views."""
    p_hat, xi_hat = F.normalize(p, dim=1), F.normalize(xi, dim=1)
    eye = torch.eye(len(y), dtype=torch.bool, device=y.device)
    positives = (y[:, None] == y[None, :]) & ~eye
    logits = (p_hat @ p_hat.T / tau).masked_fill(eye, -math.inf)
    log_prob = (logits - logits.logsumexp(1, keepdim=True)).masked_fill(~positives, 0)
    cont = -(log_prob.sum(1) / positives.sum(1)).mean()
    proto = F.cross_entropy(p_hat @ xi_hat.T / tau, y)
    cosines = xi_hat @ xi_hat.T
    uni = cosines.masked_fill(torch.eye(len(xi), dtype=torch.bool, device=xi.device), 0).sum() / len(xi)
    return cont + proto + uni


LOSSES = {"code": code_losses, "paper": paper_losses}


def personalised_learning(model, prototypes: torch.Tensor, x: torch.Tensor, y: torch.Tensor, views: TwoViews,
                          stats: tuple[torch.Tensor, torch.Tensor], *, epochs: int, batch_size: int, lr: float,
                          beta1: float, weight_decay: float, tau: float, forms: str,
                          generator: torch.Generator) -> tuple[float, torch.Tensor]:
    """PML (Algorithm 1): returns the mean loss and the trained prototypes; trains `model` in place.

    x is standardised (on the model's device); views are drawn on the CPU in 0..1
    units (the colour ops clamp there). The optimizer is fresh every call, as in
    the authors' code. Prototypes come and go on the CPU, where messages live.
    """
    mean, std = stats
    xi = prototypes.to(x.device, copy=True).requires_grad_(True)
    optimizer = torch.optim.Adam([*model.parameters(), xi], lr=lr, betas=(beta1, ADAM_BETA2),
                                 weight_decay=weight_decay)
    model.train()
    total, seen = 0.0, 0
    for _ in range(epochs):
        for idx in batches(len(y), batch_size, generator):
            both = ((torch.cat(views(x[idx].cpu() * std + mean)) - mean) / std).to(x.device)
            labels = y[idx].repeat(2)
            z = model.features(both)
            loss = F.cross_entropy(model.classifier(z), labels) + LOSSES[forms](model.project(z), labels, xi, tau)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
            seen += len(idx)
    return total / max(seen, 1), xi.detach().cpu()


def initial_prototypes(num_classes: int, d_p: int, generator: torch.Generator) -> torch.Tensor:
    """U(-1/sqrt(d_p), 1/sqrt(d_p)), as the authors' code."""
    bound = 1 / math.sqrt(d_p)
    return (torch.rand(num_classes, d_p, generator=generator) * 2 - 1) * bound


# ---------------------------------------------------------------- CGL

def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection onto {w >= 0, sum w = 1} (sort-based, Condat 2016 Alg. 1 / Held et al.)."""
    u = torch.sort(v, descending=True).values
    k = torch.arange(1, len(v) + 1, dtype=v.dtype)
    thresholds = (u.cumsum(0) - 1) / k
    rho = int((u > thresholds).nonzero().max())  # the largest k with (sum_{r<=k} u_r - 1)/k < u_k
    return torch.clamp(v - thresholds[rho], min=0)


def classifier_similarity(own: torch.Tensor, other: torch.Tensor, rows: str) -> float:
    """c_ij = mean over classes k of cos(Phi_i[k], Phi_j[k]), the rows first centred when rows == "centred".

    Adding one vector to every row of Phi shifts every logit by the same amount, which
    the softmax cannot see: centring compares only what the classifier learned.
    """
    if rows == "centred":
        own, other = own - own.mean(0), other - other.mean(0)
    return float(F.cosine_similarity(own, other, dim=1).mean())


def dissimilarity(c: torch.Tensor, rule: str) -> torch.Tensor:
    """s over (i, neighbours...) from the neighbours' c_ij: s_ii = -1, s_ij = -c_ij (/ max c when 'max' and > 0)."""
    if rule == "max" and len(c) and c.max() > 0:
        c = c / c.max()
    return -torch.cat([torch.ones(1), c])


def learn_row(w: torch.Tensor, s: torch.Tensor, gamma: torch.Tensor, o: MapLOptions) -> torch.Tensor:
    """E_g projected steps on l_g(w_i); index 0 is node i itself."""
    w = w.clone().requires_grad_(True)
    adam = torch.optim.Adam([w], lr=o.graph_lr, betas=(o.adam_beta1, ADAM_BETA2)) if o.graph_step == "adam" else None
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
        self.similarity = {j: classifier_similarity(own_classifier, self.classifiers[j], o.classifier_rows) if j in self.classifiers
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
        others = [(self.weights[j], j) for j in heard if j in self.weights]
        return 1.0 - sum(w for w, _ in others), others

    def mix(self, own: torch.Tensor, received: dict[int, torch.Tensor]) -> torch.Tensor:
        self_weight, others = self.mixing(received)
        return sum((w * received[j] for w, j in others), self_weight * own)


def cluster_mass(weights: dict[int, float], me: int, clusters: list) -> float:
    """The weight node `me` puts on its own cluster, itself included."""
    return sum(w for j, w in weights.items() if clusters[j] == clusters[me])


def classifier_weight(model) -> torch.Tensor:
    return model.classifier[-1].weight.detach().cpu()


# ---------------------------------------------------------------- protocol

@register("mapl")
class MAPL(LearningProtocol):
    """MAPL: heterogeneous models aligned by shared prototypes, with a learned collaboration graph."""
    Options = MapLOptions
    averages_backbones = False

    def __init__(self, options, env):
        super().__init__(options, env, projection=(options.d_p, options.projection_hidden))
        self.t_thr = options.t_thr if options.t_thr >= 0 else env.rounds // 4
        self.rows: dict[int, dict[int, float]] = {}  # each node's latest row of W, zeros included
        self.clusters = self.workload.clusters if None not in self.workload.clusters else None
        ds = self.workload.dataset
        self.stats = (torch.tensor(ds.mean).view(-1, 1, 1), torch.tensor(ds.std).view(-1, 1, 1))

    async def run(self, node):
        o = self.options
        model, data = self.workload.model(node.id), self.workload.data(node.id)
        prototypes = initial_prototypes(self.workload.num_classes, o.d_p, node.torch_generator)
        views = TwoViews(self.workload.dataset.shape, node.torch_generator, scale=(o.crop_scale, 1.0))
        neighbours = list(node.neighbours)
        row = CollaborationRow(node.id, neighbours, len(data.train_y))
        for r in node.rounds():
            loss, prototypes = await node.compute(
                personalised_learning, model, prototypes, data.train_x, data.train_y, views, self.stats,
                epochs=o.local_epochs, batch_size=o.batch_size, lr=o.lr, beta1=o.adam_beta1,
                weight_decay=o.weight_decay, tau=o.tau, forms=o.loss_forms, generator=node.torch_generator,
                work=2 * o.local_epochs * len(data.train_y))  # two views per sample
            learn_graph = not o.mapl_no_cgl and r >= self.t_thr
            while (notice := await node.recv(timeout=0, kind=DROP)) is not None:
                row.drop(notice.src)
            current = set(node.neighbours)
            peers = [j for j in row.peers if j in current]
            node.broadcast(KIND, self.message(model, prototypes, learn_graph, r, len(data.train_y)), to=peers)
            heard = await node.gather(KIND, peers=peers, timeout=o.timeout)
            row.hear(heard)
            if learn_graph:
                row.learn(classifier_weight(model), o)
            prototypes = row.mix(prototypes, {j: m.body["prototypes"] for j, m in heard.items()})
            if self.averages_backbones:
                self_weight, others = row.mixing(heard)
                mix(model.backbone, self_weight, [(w, heard[j].body["backbone"]) for w, j in others])
            if not o.no_sparsify:
                node.broadcast(DROP, None, to=[j for j in row.sparsify(o.zero_weight) if j in current])
            self.report(node, row, neighbours, loss, await self.evaluate(node, model, data), len(heard))

    def message(self, model, prototypes: torch.Tensor, learn_graph: bool, rnd: int, samples: int) -> dict:
        body = {"prototypes": prototypes}
        if learn_graph:
            body["classifier"] = classifier_weight(model)
        if rnd == 0:
            body["samples"] = samples
        if self.averages_backbones:
            body["backbone"] = float_state(model.backbone)
        return body

    def report(self, node, row: CollaborationRow, neighbours: list[int], loss: float, evaluation: dict,
               heard: int) -> None:
        weights = {j: row.weights.get(j, 0.0) for j in sorted([node.id, *neighbours])}
        self.rows[node.id] = weights
        node.record("graph", weights={str(j): w for j, w in weights.items()},
                    similarity={str(j): c for j, c in sorted(row.similarity.items())})
        metrics = dict(train_loss=loss, **evaluation, heard_from=heard, links=len(row.peers))
        if self.clusters is not None:
            metrics["within_cluster"] = cluster_mass(row.weights, node.id, self.clusters)
        node.log(**metrics)

    def within_cluster(self) -> dict[int, float]:
        return {i: cluster_mass(weights, i, self.clusters) for i, weights in sorted(self.rows.items())}

    def summary(self) -> dict:
        out = {"collaboration_graph": {str(i): {str(j): w for j, w in weights.items()}
                                       for i, weights in sorted(self.rows.items())}}
        if self.clusters is not None and self.rows:
            mass = self.within_cluster()
            out["within_cluster_weight"] = {str(i): m for i, m in mass.items()}
            out["within_cluster_weight_mean"] = statistics.fmean(mass.values())
        return out

    def render(self, console) -> None:
        """The learned W as a nodes x nodes table: row i is node i's weights, green within its cluster."""
        if not self.rows:
            return
        nodes = sorted(self.rows)
        caption = None if self.clusters is None else (
            f"within-cluster weight, mean over nodes: {statistics.fmean(self.within_cluster().values()):.2f}")
        table = Table(title="learned collaboration graph W (row i: node i's weights)", caption=caption,
                      box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), show_edge=False)
        table.add_column("node", justify="right")
        table.add_column("cl", justify="right")
        for j in nodes:
            table.add_column(str(j), justify="right")
        for i in nodes:
            cells = [self._cell(i, j) for j in nodes]
            table.add_row(str(i), "-" if self.clusters is None else str(self.clusters[i]), *cells)
        console.print(table)

    def _cell(self, i: int, j: int) -> str:
        w = self.rows[i].get(j, 0.0)
        if w <= 0:
            return "·"
        text = f"{w:.2f}".removeprefix("0")  # ".20": three characters keep 20 nodes in 80 columns
        if self.clusters is None:
            return text
        return f"[{'green' if self.clusters[i] == self.clusters[j] else 'red'}]{text}"


@dataclass
class MapLPlusOptions(MapLOptions):
    model: str = default(WorkloadOptions, "model", "cnn-small")
    init: str = default(WorkloadOptions, "init", "common")

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
