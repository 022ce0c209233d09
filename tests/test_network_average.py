"""The network average: every averaging protocol's mixing step keeps the mean of the nodes' models.

With symmetric doubly-stochastic weights (Metropolis-Hastings on a ring), no loss, no churn and no local
step, the mean over nodes after each round's mixing equals the mean before it. Exceptions, each by design
of the published algorithm, not tested here:
  - DCD-PSGD (`--sparsify Q` without `--error-feedback`): x_i <- x_i + Q(z_i) keeps the mean only in
    expectation, for an unbiased Q (Tang et al. 2018 assume one); top-k moves it (tested below);
  - `--aggregate median|trimmed|krum`: robust rules are not weighted means;
  - fedavg (a server replaces every model), gossip_learning (the receiver merges, the sender keeps its
    model), l2c (learned, non-symmetric weights), sgp (push-sum keeps the sum of its numerators, not the
    mean of the de-biased models), ad_psgd (asynchronous: no round to compare; each pairwise average
    keeps its pair's sum, tests/test_ad_psgd.py).
"""
import pytest
import torch

from p2p_emulator.cli import main
from protocols.common import LearningProtocol
from p2p_emulator.workloads.training import flat

SETTINGS = ["--dataset", "digits", "--partition", "iid", "--model", "mlp:hidden=16", "--topology", "ring",
            "--nodes", "6", "--rounds", "4", "--init", "independent", "--quiet", "--no-plots"]


def _means(tmp_path, monkeypatch, flags) -> list[torch.Tensor]:
    """The mean of the nodes' models at the start and after each round, in a run with no local step."""
    initial, means = {}, []

    async def no_step(self, node, model, data, *args, **kwargs) -> float:
        if node.round == 0:  # before any mixing: x0
            initial[node.id] = flat(await self.state(node, model)).double()
        return 0.0

    def observe(self, rnd, snapshots):
        means.append(torch.stack([flat(state).double() for state in snapshots.values()]).mean(0))
        return {}

    monkeypatch.setattr(LearningProtocol, "train", no_step)
    monkeypatch.setattr(LearningProtocol, "observe", observe)
    assert main([*SETTINGS, *flags, "--out", str(tmp_path / "run")]) == 0
    return [torch.stack(list(initial.values())).mean(0), *means]


def _drift(means) -> float:
    return max(float((m - means[0]).abs().max()) for m in means)


@pytest.mark.parametrize("flags", [
    ["--protocol", "dpsgd"],
    ["--protocol", "dfedavgm"],
    ["--protocol", "choco", "--compress-op", "none", "--consensus-step", "1"],
    ["--protocol", "choco", "--compress-op", "sign"],
    ["--protocol", "choco", "--compress-op", "topk:0.1"],
    ["--protocol", "choco", "--compress-op", "q4"],
    ["--protocol", "choco", "--compress-op", "qsgd", "--choco-order", "icml2019"],
    ["--protocol", "dpsgd", "--sparsify", "sign", "--error-feedback"],
    ["--protocol", "dpsgd", "--sparsify", "topk:0.1", "--error-feedback"],
    ["--protocol", "dfedavgm", "--sparsify", "q8", "--error-feedback"],
    ["--protocol", "powergossip", "--consensus-step", "1.3", "--power-steps", "2"],
], ids=lambda flags: " ".join(flags[1:]))
def test_mixing_keeps_the_network_average(tmp_path, monkeypatch, flags):
    means = _means(tmp_path, monkeypatch, flags)
    assert len(means) == 5 and _drift(means) < 1e-6


def test_dcd_psgd_with_a_biased_operator_moves_the_average(tmp_path, monkeypatch):
    """The exception above, measured: so the test above can tell a drift when there is one."""
    means = _means(tmp_path, monkeypatch, ["--protocol", "dpsgd", "--sparsify", "topk:0.1"])
    assert _drift(means) > 1e-3
