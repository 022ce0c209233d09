"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang and Zhang, AAAI 2022): personal models of any architecture
that share class prototypes, the mean representation of each class, through a server.

On the star of protocols/personalised.py, round r, with z = f_k(x) the client's backbone output and
r(x) = ReLU(z) the representation its classifier's last layer reads (the reference's x1 = relu(fc1(.)),
the input of its fc2):
  client k: E epochs of SGD(lr, momentum, weight decay) over all of its model, fresh each round, on
            minibatches of B samples (the last partial batch of an epoch dropped), with the batch loss
              l = CE(phi_k(r(x)), y) + ld * mean_{b, d} (r(x_b) - target_b)^2,
            target_b = the global prototype C[y_b] where one exists, else r(x_b) itself (no pull on that
            sample, but it still counts in the mean); no prototype term before the first C arrives;
            local prototypes c_k[j] = the mean of r(x) over the class-j samples of the LAST epoch's
            batches, each computed in train mode by the batch's own forward pass (before its step);
            send ({j : c_k[j]} over the classes j it holds);
  server:   C[j] <- the plain mean of c_k[j] over the clients heard before --timeout that sent class j
            (not weighted by samples), for every j sent; {j : C[j]} back to every client;
  client k: keeps C for the next round; scores its own model (its own classifier) on its own test
            split (test_acc, what the MAPL paper reports) and logs test_acc_proto: the class j of the
            nearest C[j] to r(x), in eval mode, among the classes it holds, as the reference's "with
            protos" score.
Wire form of both messages: {"classes": the sorted class ids, a list of ints; "prototypes": a
len(classes) x d_z float32 tensor, row i the prototype of classes[i]}; a body that is not exactly that
(K classes at most, distinct ids in 0..K-1, d_z columns, finite values) is refused. A client sends its
held classes (5 of 10 in the MAPL scenarios), the server every class heard: the MAPL paper's Table 7
counts 2 M d_p K T.

The MAPL paper (appendix C.2): FedProto "uses class-wise feature prototypes to align the classes in the
latent space across clients. The prototype for a particular class is computed as an average over all
the features pertaining to the samples from the corresponding class in the local dataset. At the end of
each global round, the local prototypes are aggregated over all the clients. We adapt the original
implementation." It scores every client's model on 15 test samples per class it holds (Table 1).

Compared with the reference code (github.com/yuetan031/FedProto: lib/update.py LocalUpdate.
update_weights_het and test_inference_new_het_lt, lib/utils.py agg_func and proto_aggregation,
exps/federated_main.py FedProto_modelheter, lib/options.py), update rule by update rule:
- local loss: the same. NLLLoss of log_softmax (= CE) plus ld * MSELoss(proto_new, protos) with
  proto_new a detached copy of the batch's representations whose rows are replaced by the global
  prototype of their label where one exists: a mean over all B x d_z entries, so the rows without a
  global prototype add 0 but still divide. No term (0 * CE) before global prototypes exist. --ld 1, the
  reference's default (its README: 1 on MNIST and FEMNIST, 0.1 on CIFAR-10).
- optimiser: the same, a fresh torch SGD per round over every parameter: --lr 0.01 (theirs), --momentum
  0.5 (theirs is hard-coded at 0.5; its --momentum flag is never read; here --momentum drives it), no
  weight decay (theirs passes none to SGD; --weight-decay adds it). --batch-size 32 here, theirs 4 (its
  default, which its MNIST and FEMNIST commands keep; 32 in its CIFAR-10 command): CPU-sized, as the
  other baselines here; --batch-size 4 is theirs. --local-epochs 1 (their --train_ep 1).
  --local-steps is refused: the prototypes are one whole epoch's.
- batches: theirs a shuffled DataLoader with drop_last=True; the same here (a fresh permutation from the
  node's generator each epoch, the last partial batch dropped), except that a client with fewer samples
  than one batch trains on its one short batch (theirs would train nothing), and a one-sample batch is
  skipped (BatchNorm cannot train on it; theirs has no BatchNorm).
- local prototypes: the same rule (agg_protos_label is reset at the start of each epoch, so the last
  epoch's train-mode representations, taken in each batch's forward pass, averaged per class by
  agg_func). The representation is ReLU of the backbone's d_z output, the input of the classifier's last
  layer, as their x1 is the input of fc2 (their dropout sits between x1 and fc2; the models here have no
  dropout). So the prototypes are d_z wide (--d-z, 128 by default; theirs 50 on MNIST and FEMNIST).
- server: the same, proto_aggregation: per class, the unweighted mean over the clients that sent it;
  a class no client sent is absent. The server keeps the last combined set when it hears no client.
- evaluation: theirs scores once, after the last round: test_acc is their "w/o protos" accuracy of the
  client's model on its own test split, test_acc_proto their "with protos" one (argmin of MSELoss to the
  global prototypes of the classes the client holds). Here both after every --eval-every round, each
  client separately (their correct/total counters run on across clients and across the two scores, so
  their printed per-client figures are running totals). One forward pass gives both.
- partition and models: the MAPL paper's (--partition mapl:scenario=1, 20 clients, --model
  hetero-small here: four backbones of different kinds, as the paper's four); theirs draws n classes
  and k shots per client, and varies only the width of one CNN layer across clients ("model_heter").
  Every backbone gives a --d-z latent (default 128), so the prototypes are comparable.
- every client trains every round (theirs too: --frac is not read by FedProto).

--executor batched: not used. Its batched forms are those of the shared jobs (sgd, accuracy); FedProto's
training job needs the representation, a per-sample prototype target and per-class sums of the last
epoch, which sgd's `objective=` cannot hand back, so it is a job of its own and runs node by node (as
MAPL's PML does). A batched form would be a vmap of local_update in p2p_emulator/workloads/batched.py;
on a CPU the hetero-small backbones have convolutions, which that executor runs node by node anyway.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from emulator.protocol import register
from p2p_emulator.workloads.lazy import LazyModule
from p2p_emulator.workloads.training import full_batch_samples, full_batches

from .common import SGDOptions, check, expects, option_help
from .personalised import PersonalisedOptions, PersonalisedStar

torch = LazyModule("torch")

CLASSES, PROTOTYPES = "classes", "prototypes"  # a body: sorted class ids, and their prototypes row by row


@dataclass
class FedProtoOptions(PersonalisedOptions, SGDOptions):
    lr: float = field(default=0.01, metadata=option_help("learning rate (FedProto: SGD, reference 0.01)"))
    momentum: float = field(default=0.5, metadata=option_help("heavy-ball momentum (FedProto reference: 0.5)"))
    weight_decay: float = field(default=0.0, metadata=option_help("weight decay (FedProto reference: 0)"))
    batch_size: int = field(default=32, metadata=option_help("local batch size (FedProto reference: 4)"))
    ld: float = field(default=1.0, metadata=option_help(
        "FedProto: weight of the prototype term, ld * MSE(representation, global prototype of its label)"))

    def validate(self):
        super().validate()
        check("ld", self.ld, math.isfinite(self.ld) and self.ld >= 0, "must be a number, not negative")
        check("local-steps", self.local_steps, self.local_steps == 0,
              "FedProto trains whole epochs (its prototypes are the last epoch's); use --local-epochs")


# -- the jobs (they run where the node's model lives)

def representation(model, x):
    """r(x): the input of the classifier's last layer (ReLU of the backbone's latent)."""
    return model.classifier[:-1](model.features(x))


def local_update(model, x, y, shared: dict | None, *, ld: float, epochs: int, lr: float, momentum: float,
                 weight_decay: float, batch_size: int, generator) -> tuple[float, float, dict]:
    """FedProto's local round: returns (mean loss, mean prototype term, the body to send); trains in place.

    shared: the global prototypes ({CLASSES, PROTOTYPES}) or None before the first.
    """
    last = model.classifier[-1]
    k, d_z, device = last.out_features, last.in_features, x.device
    targets = has = None
    if shared is not None and shared[CLASSES]:
        held = torch.tensor(shared[CLASSES], device=device)
        targets = torch.zeros(k, d_z, device=device)
        targets[held] = shared[PROTOTYPES].to(device, torch.float32)
        has = torch.zeros(k, dtype=torch.bool, device=device)
        has[held] = True
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    model.train()
    total = proto_total = 0.0
    seen = 0
    for epoch in range(epochs):
        sums, counts = torch.zeros(k, d_z, device=device), torch.zeros(k, dtype=torch.long, device=device)
        for idx in full_batches(len(y), batch_size, generator):
            if len(idx) < 2:  # BatchNorm cannot train on one sample
                continue
            labels = y[idx]
            r = representation(model, x[idx])
            loss = torch.nn.functional.cross_entropy(last(r), labels)
            if targets is None:
                proto = torch.zeros((), device=device)
            else:
                target = torch.where(has[labels, None], targets[labels], r.detach())
                proto = torch.nn.functional.mse_loss(r, target)
                loss = loss + ld * proto
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
            proto_total += proto.item() * len(idx)
            seen += len(idx)
            if epoch == epochs - 1:
                sums.index_add_(0, labels, r.detach())
                counts.index_add_(0, labels, torch.ones_like(labels))
    model.zero_grad(set_to_none=True)
    held = [j for j in range(k) if counts[j] > 0]
    rows = (sums[held] / counts[held, None]).cpu() if held else torch.zeros(0, d_z)
    return total / max(seen, 1), proto_total / max(seen, 1), {CLASSES: held, PROTOTYPES: rows.float()}


def mean_prototypes(bodies: list[dict]) -> dict:
    """Per class, the plain mean of the prototypes of the clients that sent it (a sum in the order of
    `bodies`, then one division); the classes nobody sent are absent."""
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    for body in bodies:
        for j, row in zip(body[CLASSES], body[PROTOTYPES]):
            sums[j] = row.clone() if j not in sums else sums[j] + row
            counts[j] = counts.get(j, 0) + 1
    classes = sorted(sums)
    if not classes:
        return {CLASSES: [], PROTOTYPES: torch.zeros(0, bodies[0][PROTOTYPES].shape[1])}
    return {CLASSES: classes, PROTOTYPES: torch.stack([sums[j] / counts[j] for j in classes])}


def fedproto_scores(model, test_x, test_y, train_y, shared: dict | None,
                    batch_size: int = 1024) -> dict[str, float]:
    """test_acc: the model's own classifier; test_acc_proto (once global prototypes arrived): the nearest
    global prototype to r(x), in squared distance, among the classes of the client's training split."""
    model.eval()
    with torch.no_grad():
        r = torch.cat([representation(model, test_x[i:i + batch_size]) for i in range(0, len(test_y), batch_size)])
        scores = {"test_acc": (model.classifier[-1](r).argmax(1) == test_y).sum().item() / len(test_y)}
        if shared is not None:
            own = set(torch.unique(train_y).tolist())
            rows = [i for i, j in enumerate(shared[CLASSES]) if j in own]
            if rows:
                candidates = torch.tensor([shared[CLASSES][i] for i in rows], device=r.device)
                prototypes = shared[PROTOTYPES][rows].to(r.device, r.dtype)
                nearest = candidates[torch.cdist(r, prototypes).argmin(1)]
                scores["test_acc_proto"] = (nearest == test_y).sum().item() / len(test_y)
    return scores


def prototype_check(num_classes: int, d_z: int):
    """The check of a body on the wire (either way): see the module's wire form."""
    def classes(value) -> bool:
        return (isinstance(value, list) and len(value) <= num_classes
                and all(type(j) is int and 0 <= j < num_classes for j in value)
                and all(a < b for a, b in zip(value, value[1:])))

    def rows(value) -> bool:
        return (torch.is_tensor(value) and value.dtype == torch.float32 and value.dim() == 2
                and value.shape[1] == d_z and math.isfinite(value.sum()))

    fields = expects(**{CLASSES: classes, PROTOTYPES: rows})
    return lambda body: fields(body) and len(body[CLASSES]) == body[PROTOTYPES].shape[0]


@register("fedproto")
class FedProto(PersonalisedStar):
    """FedProto: personal models aligned by class prototypes that a server averages."""
    dp_refused = ("sends class prototypes computed from its private samples and trains with a "
                  "prototype loss of its own")
    Options = FedProtoOptions
    checkpointable = True
    state_copies = 1.0

    async def local_round(self, node, model, data, shared):
        o = self.options
        n = len(data.train_y)
        loss, proto_loss, body = await node.compute(
            local_update, model, data.train_x, data.train_y, shared, ld=o.ld, epochs=o.local_epochs, lr=o.lr,
            momentum=o.momentum, weight_decay=o.weight_decay, batch_size=o.batch_size,
            generator=node.torch_generator,
            work=data.work.training(o.local_epochs * full_batch_samples(n, o.batch_size), o.batch_size))
        node.log(train_proto_loss=proto_loss)
        return loss, body

    combine = staticmethod(mean_prototypes)

    def make_checks(self):
        last = self.initial_model(0).classifier[-1]
        valid = prototype_check(last.out_features, last.in_features)
        return valid, valid

    async def client_scores(self, node, model, data, shared):
        """test_acc and test_acc_proto (with the global prototypes the client holds), one forward pass."""
        if not self.scores_due(node) or not len(data.test_y):
            return {}
        return await node.compute(fedproto_scores, model, data.test_x, data.test_y, data.train_y, shared,
                                  work=data.work.scoring(len(data.test_y)))
