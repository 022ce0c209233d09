"""FedClassAvg (Jang, Ha, Jung and Yoon, ICPP 2022): personal backbones of any architecture, one
classifier averaged by a server, and local representation learning by a supervised contrastive loss
on two augmented views, with a proximal term that holds the classifier near the global one.

On the star of protocols/personalised.py, round r:
  client k: phi_g <- the server's classifier from round r-1 (round 0: its own; the reference's
            "pretrain" round), loaded into the model; then E epochs of Adam(lr, betas (beta1, 0.999))
            over backbone theta_k and classifier phi_k, on minibatches of B samples, the last partial
            batch dropped; each sample x gives two views v1, v2 (augment.TwoViews), z = f_theta(v1, v2)
            (the backbone's d_z latent, not normalised), and the batch loss is
              l = (tau / tau_b) SupCon_tau(z, y) + CE(phi(z_v1), y) + (mu / 2) sum_p mean((p - p_g)^2)
            (SupCon over all 2B views as anchors, the other view and same-label views positives, logits
            z_a . z_b / tau; CE on the first view only; p over phi_k's tensors, p_g the loaded phi_g);
            send (phi_k, n_k);
  server:   phi_g <- (sum_k n_k phi_k) / sum_k n_k over the classifiers heard before --timeout, sent back;
  client k: keeps phi_g for the next round and scores theta_k with its OWN phi_k (the one it just
            trained, as the reference evaluates) on its own test split.
The classifier is ReLU, then Linear(d_z, K) without bias (K x d_z floats, the MAPL paper's phi), so
every backbone needs the same --d-z (char-lstm's and leaf-cnn's classifiers have a bias, sent and
averaged with the weight). Defaults: --tau 100, --base-tau 0.07 (a contrastive weight of
1429), --mu 0.1, Adam beta1 0.5, no weight decay, as the reference; lr, batch and crops CPU-sized, below.

The MAPL paper (appendix C.2): "FedClassAvg implicitly aligns the clients using the classifier layer.
Thus, during each global round, the models are trained locally by each client, followed by the
aggregation of the classifier layers across all the clients. Additionally, they use supervised
contrastive loss during local training similar to MAPL ... We adopted the original implementation."
Table 7 counts 2 M phi T: a classifier up and one back per client per round.

Compared with the reference code (github.com/hukla/FedClassAvg: src/fedclassavg.py,
src/heteropfl_utils.py train_cl / evaluate_cl, src/losses.py SupConLoss, src/supcon_utils.py),
update rule by update rule:
- contrastive term: the same. SupConLoss(temperature=100, base_temperature=0.07, contrast_mode "all")
  on the backbone's output of both views, unnormalised (their F.normalize is commented out), scaled
  by 100 / 0.07; here the log-sum-exp is masked instead of max-shifted (the same value up to float
  rounding). Their latent is 512 wide (feat_dim); here --d-z (128).
- cross-entropy: the same, on the classifier's logits of the first view only.
- proximal term: the same, (mu / 2) sum over the classifier's tensors of MSELoss(p, p_g) (a mean over
  entries, not a squared norm), toward the classifier as loaded at the start of the round. Theirs skips
  batch 0 of an epoch, where it is zero (and its gradient too) since p = p_g there; with
  --local-epochs > 1 it is applied at the first batch of later epochs here (their train_cl returns
  after the first epoch, whatever --local_epochs says, so they never reach one). --mu: their argparse
  default is 0, their README's command passes 0.1; 0.1 here.
- local epochs: their train_cl has its `return` inside the epoch loop, so every round is one epoch;
  here --local-epochs epochs (default 1: theirs).
- optimiser: the same, a fresh Adam per round over backbone and classifier, betas (0.5, 0.999), no
  weight decay (--weight-decay adds Adam's L2 term). CPU-sized: --lr 3e-3 and --batch-size 32 (theirs
  1e-4 and 64 for FashionMNIST and CIFAR-10, 5e-4 for EMNIST; configs/*.json), as MAPL's defaults here.
- batches: theirs a DataLoader with drop_last=True; here the last partial batch of an epoch is dropped
  too, except when a client has fewer samples than one batch, where its one short batch trains (theirs
  would train nothing and divide by zero).
- classifier: ReLU then Linear without bias here (the project's split model, MAPL's phi); theirs has a
  bias, averaged with the weight. So a message holds K x d_z floats, theirs K x (512 + 1).
- augmentation: theirs RandomResizedCrop(scale 0.2-1), horizontal flip, ColorJitter(0.4, 0.4, 0.4,
  0.1) with p 0.8 and RandomGrayscale(0.2) on PIL images, normalised with mean = std = 0.5 on the
  MNISTs. Here p2p_emulator/workloads/augment.py's TwoViews, as MAPL: the same crop (--crop-scale 0.5,
  CPU-sized as MAPL's: a 20% crop of an 8x8 digit is 3x3 pixels; 0.2 is theirs) and flip; colour jitter
  and grayscale on RGB only, so on the grayscale datasets theirs also jitters brightness and contrast
  (its saturation, hue and grayscale do nothing to a one-channel image) and this does not. Views are
  drawn in 0..1 units and standardised with the dataset's own mean and std (--normalize standard).
  Token ids (--model char-lstm) and feature vectors have no augmentation: as MAPL here, both views
  are the samples themselves (SupCon then contrasts samples with their labels, each sample's other
  view a positive identical to it); with char-lstm --normalize is free.
- round 0: theirs first trains every client once with no global classifier and sends nothing
  ("pretrain"), then round 1 loads the server's UNTRAINED classifier (a fresh model's, never
  updated by the pretraining) into every client. Here round 0 is that pretraining round, and its
  classifiers are sent and averaged, so round 1 starts from the average of the pretrained classifiers.
  T rounds are T local trainings here, T + 1 there.
- server step: the same, sum_k n_k phi_k / sum_k n_k with n_k the client's training samples (before
  dropping the partial batch), summed then divided, as theirs; over the classifiers heard before the
  timeout (theirs: every client). Every client takes part each round (their --c 1, the default).
- loading: the same, the global classifier is loaded before local training, not after; a client the
  server did not answer loads the last one it heard again (theirs never misses one).
- scoring: the same, each client's backbone with its own classifier after local training (not the
  global one), on its own test split. Theirs draws that split with replacement, 30% of the client's
  training count in its label proportions, and drops the last partial test batch; here the
  partition's test split, all of it.
- client sampling, early stopping and best-round bookkeeping of theirs: not here (the MAPL paper
  reports the last round).

Executors: the local training job (two views, SupCon, Adam) has no batched form, so it runs alone
under --executor batched, as MAPL's PML does; a batched form would need a vmap'd Adam and SupCon in
p2p_emulator/workloads/batched.py. Scoring (`accuracy`) batches where that executor batches it
(within one architecture; not convolutional models on a CPU, which every hetero-small backbone is).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from emulator.errors import UsageError
from emulator.protocol import register
from p2p_emulator.workloads import model_specs
from p2p_emulator.workloads.lazy import LazyModule

from .common import TrainingOptions, check, default, expects, option_help, positive_int
from .fedsim import HEAD, head
from .personalised import PersonalisedOptions, PersonalisedStar

torch = LazyModule("torch")
augment = LazyModule("p2p_emulator.workloads.augment")
pml = LazyModule("p2p_emulator.workloads.prototypes")  # the two views, as MAPL's
training = LazyModule("p2p_emulator.workloads.training")

ADAM_BETA2 = 0.999  # the reference's


@dataclass
class FedClassAvgOptions(PersonalisedOptions):
    lr: float = field(default=3e-3, metadata=option_help("learning rate (FedClassAvg: Adam; reference 1e-4)"))
    weight_decay: float = default(TrainingOptions, "weight_decay", 0.0)
    batch_size: int = field(default=32, metadata=option_help("local batch size (FedClassAvg reference: 64)"))
    tau: float = field(default=100.0, metadata=option_help(
        "FedClassAvg: temperature of the supervised contrastive loss (reference: 100)"))
    base_tau: float = field(default=0.07, metadata=option_help(
        "FedClassAvg: SupCon's base temperature; the contrastive term is scaled by tau / base-tau (reference: 0.07)"))
    mu: float = field(default=0.1, metadata=option_help(
        "FedClassAvg: weight of the proximal term (mu / 2) sum mean((phi - phi_global)^2) (reference README: 0.1)"))
    adam_beta1: float = field(default=0.5, metadata=option_help("FedClassAvg: Adam's beta1 (reference: 0.5)"))
    crop_scale: float = field(default=0.5, metadata=option_help(
        "FedClassAvg: smallest crop area of the augmentation, as a fraction of the image (reference: 0.2)"))

    def validate(self):
        super().validate()
        for flag, value in (("tau", self.tau), ("base-tau", self.base_tau)):
            check(flag, value, math.isfinite(value) and value > 0, "must be positive")
        check("mu", self.mu, math.isfinite(self.mu) and self.mu >= 0, "must not be negative")
        check("adam-beta1", self.adam_beta1, 0 <= self.adam_beta1 < 1, "must be in [0, 1)")
        check("crop-scale", self.crop_scale, 0 < self.crop_scale <= 1, "must be in (0, 1]")
        # Images' views un-standardise, augment in 0..1 and standardise again; token ids are never normalised.
        if self.normalize != "standard" and model_specs.reads_images(self.model):
            raise UsageError(f"--normalize {self.normalize}: FedClassAvg's augmentation of images needs "
                             "--normalize standard")


# ---------------------------------------------------------------- the local loss

def supcon(z: torch.Tensor, labels: torch.Tensor, tau: float, base_tau: float) -> torch.Tensor:
    """SupConLoss(temperature=tau, base_temperature=base_tau) of the reference, contrast mode "all".

    z: (2B, d), the first view's B rows then the second's; labels: (B,). Every row is an anchor;
    its positives are the other rows of its label (its other view among them), never itself:
      -(tau / base_tau) mean_a [ mean_{p in P(a)} log( exp(z_a.z_p / tau) / sum_{b != a} exp(z_a.z_b / tau) ) ].
    """
    y = labels.repeat(2)
    eye = torch.eye(len(y), dtype=torch.bool, device=z.device)
    positives = (y[:, None] == y[None, :]) & ~eye
    logits = (z @ z.T / tau).masked_fill(eye, -math.inf)
    log_prob = (logits - logits.logsumexp(1, keepdim=True)).masked_fill(~positives, 0)
    return -(tau / base_tau) * (log_prob.sum(1) / positives.sum(1)).mean()


def proximal(classifier, initial: dict, mu: float) -> torch.Tensor:
    """(mu / 2) sum over the classifier's parameters p of mean((p - p_g)^2): the reference's MSELoss form."""
    terms = [torch.nn.functional.mse_loss(p, initial[name]) for name, p in classifier.named_parameters()]
    return mu / 2 * torch.stack(terms).sum()


def batch_loss(model, z: torch.Tensor, labels: torch.Tensor, initial: dict, *, tau: float, base_tau: float,
               mu: float) -> torch.Tensor:
    """The reference's loss of one batch from the latents z of both views (first view's rows first)."""
    first = z[:len(labels)]
    return (supcon(z, labels, tau, base_tau)
            + torch.nn.functional.cross_entropy(model.classifier(first), labels)
            + proximal(model.classifier, initial, mu))


def local_training(model, x: torch.Tensor, y: torch.Tensor, shared: dict | None,
                   stats: tuple[torch.Tensor, torch.Tensor] | None, *, epochs: int, batch_size: int, lr: float,
                   beta1: float, weight_decay: float, tau: float, base_tau: float, mu: float, crop_scale: float,
                   generator: torch.Generator) -> float:
    """A FedClassAvg client's round (a job): load the global classifier (if any), then E epochs of Adam on
    batch_loss over two views of each sample; returns the mean loss per sample. Trains `model` in place.

    x is standardised images, on the model's device, their views drawn as MAPL's (prototypes.two_views); or
    token ids or features, with stats None, both of whose views are the samples themselves.
    """
    if shared is not None:
        training.load_state(model.classifier, shared[HEAD])
    initial = {name: p.detach().clone() for name, p in model.classifier.named_parameters()}
    views = None if stats is None else augment.TwoViews(tuple(x.shape[1:]), generator, scale=(crop_scale, 1.0))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(beta1, ADAM_BETA2), weight_decay=weight_decay)
    model.train()
    total, seen = 0.0, 0
    for _ in range(epochs):
        for idx in training.full_batches(len(y), batch_size, generator):
            both = pml.two_views(x[idx], views, stats)
            loss = batch_loss(model, model.features(both), y[idx], initial, tau=tau, base_tau=base_tau, mu=mu)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
            seen += len(idx)
    model.zero_grad(set_to_none=True)
    return total / max(seen, 1)


# ---------------------------------------------------------------- the protocol

def sample_weighted_mean(bodies: list[dict]) -> dict:
    """The reference's server step: (sum_k n_k phi_k) / sum_k n_k, tensor by tensor (summed, then divided)."""
    total = sum(b["samples"] for b in bodies)
    mean = {}
    for name, example in bodies[0][HEAD].items():
        acc = torch.zeros_like(example)
        for b in bodies:
            acc += b[HEAD][name] * b["samples"]
        mean[name] = acc / total
    return {HEAD: mean}


@register("fedclassavg")
class FedClassAvg(PersonalisedStar):
    """FedClassAvg: personal backbones, a classifier averaged by the server, SupCon on two views."""
    dp_refused = "trains with a contrastive and proximal loss of its own"
    Options = FedClassAvgOptions
    checkpointable = True
    state_copies = 3.0  # the model, Adam's two moments during a round (as MAPL's PML)
    training_passes = 2  # two views a sample

    def __init__(self, options, run_info):
        super().__init__(options, run_info)
        self.stats = pml.view_stats(self.workload.dataset)

    async def local_round(self, node, model, data, shared):
        o = self.options
        n = len(data.train_y)
        loss = await node.compute(
            local_training, model, data.train_x, data.train_y, shared, self.stats, epochs=o.local_epochs,
            batch_size=o.batch_size, lr=o.lr, beta1=o.adam_beta1, weight_decay=o.weight_decay, tau=o.tau,
            base_tau=o.base_tau, mu=o.mu, crop_scale=o.crop_scale, generator=node.torch_generator,
            work=data.work.training(o.local_epochs * training.full_batch_samples(n, o.batch_size), o.batch_size)
            * self.training_passes)
        return loss, {HEAD: await node.compute(head, model, work=0), "samples": n}

    combine = staticmethod(sample_weighted_mean)

    # take: the default (keep the global classifier for the next round's start); the client scores its own

    def make_checks(self):
        example = head(self.initial_model(0))
        return expects(**{HEAD: example, "samples": positive_int}), expects(**{HEAD: example})
