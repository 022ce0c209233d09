"""FedSim (Pillutla et al., ICML 2022, partial personalisation): a shared part averaged by a server,
a personal part that stays on the client; as the MAPL paper runs it, the shared part is the
classifier head and the personal part the backbone, so every client may have its own architecture.

On the star of protocols/personalised.py, round r:
  client k: load the averaged head phi (from round r-1; round 0: the server's phi_0, the same on every
            client), then train backbone and head together (FedSim: "simultaneous") by local SGD on
            its n_k samples; send (phi_k, n_k);
  server:   phi <- sum_k n_k phi_k / sum_k n_k over the heads heard before --timeout, sent back;
  client k: loads phi and scores backbone_k with phi on its own test split.
The head is ReLU, then Linear(d_z, K) without bias (K x d_z floats, the MAPL paper's phi), so
every backbone needs the same --d-z. Local training is the shared SGD job (--lr, --momentum,
--weight-decay, --local-epochs), so --executor batched trains the clients of one architecture as
one vmap.

The MAPL paper (appendix C.2): "only the prediction head is aggregated over all clients with the help
of a central server. This setting further allows each client to have a heterogeneous backbone while
sharing a common architecture for the prediction head." Table 7 counts 2 M phi T.

Compared with the authors' code (facebookresearch/FL_partial_personalization, pfl/optim/fedsim.py and
pfl_base.py), update rule by update rule:
- start: the same, one server head phi_0 that every client starts from (theirs broadcasts the server
  model; here every client builds it, the first client's initial head, so round 0 has no message from
  the server). Heads of their own would average after round 0 to about 1/sqrt(M) of their norm and
  shorten SGD's steps on every backbone as much: 12 points lost on digits (docs/mapl.md, "The
  baselines on tiny local sets");
- local step: the same (all parameters by one client optimiser, cross-entropy; their optional l2
  penalty on the personal part is 0 by default, as here);
- server step: theirs applies the weighted mean delta with a server optimiser (SGD, --server-lr 1 and
  no momentum by default), which is the weighted mean of the heads, as here. They weight by the number
  of local batches ("a proxy for dataset size"); here by n_k, the samples;
- their clients are sampled each round; here every client takes part, as in the MAPL paper;
- scoring: the personal part with the server's shared part after the round, as theirs.
"""
from __future__ import annotations

from dataclasses import dataclass

from emulator.protocol import register
from p2p_emulator.workloads.training import float_state, load_state

from .common import SGDOptions, expects, positive_int
from .personalised import PersonalisedOptions, PersonalisedStar, weighted_mean

HEAD = "head"


@dataclass
class FedSimOptions(PersonalisedOptions, SGDOptions):
    """Local SGD as Local's (--lr 0.05 --momentum 0.9 --weight-decay 5e-4)."""


def head(model) -> dict:
    """The classifier head's floating-point tensors, on the CPU (a copy)."""
    return {k: v.cpu() for k, v in float_state(model.classifier).items()}


def load_head(model, shared: dict) -> None:
    load_state(model.classifier, shared[HEAD])


@register("fedsim")
class FedSim(PersonalisedStar):
    """FedSim: personal backbones, a classifier head averaged by the server."""
    Options = FedSimOptions
    checkpointable = True
    state_copies = 1.0

    def __init__(self, options, run_info):
        super().__init__(options, run_info)
        self.start = {HEAD: head(self.initial_model(0))}  # phi_0; read-only, as self.checks

    async def local_round(self, node, model, data, shared):
        if node.round == 0:
            await node.compute(load_head, model, self.start, work=0)
        loss = await self.train(node, model, data)  # the averaged head is in place since the last round
        return loss, {HEAD: await node.compute(head, model, work=0), "samples": len(data.train_y)}

    @staticmethod
    def combine(bodies):
        return {HEAD: weighted_mean([(b["samples"], b[HEAD]) for b in bodies])}

    take = staticmethod(load_head)

    def make_checks(self):
        example = head(self.initial_model(0))
        return expects(**{HEAD: example, "samples": positive_int}), expects(**{HEAD: example})
