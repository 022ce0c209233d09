"""The horizon rule of the time-driven protocols: an exchange is completed on both sides or on neither, so that
averaging alone conserves the network's sum of models to the end of the run (--duration, with or without
--rounds), on several seeds and graphs."""
import json

import networkx as nx
import pytest
import torch

from emulator.protocol import RunInfo
from emulator.seeds import Seeds
from p2p_emulator import run
from p2p_emulator.runs import execute
from p2p_emulator.settings import RunConfig
from p2p_emulator.workloads.task import Workload, WorkloadOptions
from p2p_emulator.workloads.training import float_state
from protocols.ad_psgd import ADPSGD, ADPSGDOptions
from protocols.sgp import SGP, SGPOptions

N, MODEL = 8, "mlp:hidden=8"
# float32 models: each average rounds once, so the sum drifts by about 1e-7 of its size an exchange; one
# exchange completed on one side only moves it by half the gap between two models, about 0.1 here
DRIFT = 1e-4


def _initial_sum(seed: int, out_dir) -> dict:
    workload = Workload(WorkloadOptions(init="independent", model=MODEL),
                        RunInfo(N, 1, Seeds(seed), nx.complete_graph(N), "cpu", out_dir))
    states = [float_state(workload.model(i)) for i in range(N)]
    return {k: torch.stack([s[k].double() for s in states]).sum(0) for k in states[0]}


def _drift(final: dict, seed: int, out_dir) -> float:
    start = _initial_sum(seed, out_dir)
    end = {k: torch.stack([s[k].double() for s in final.values()]).sum(0) for k in start}
    return max(float((end[k] - start[k]).abs().max()) for k in start)


class AveragingADPSGD(ADPSGD):
    """AD-PSGD with every gradient zeroed (its compute still charged): averaging alone; keeps the final models."""
    final: dict = {}

    async def stochastic_gradient(self, node, model, data):
        grads, loss = await super().stochastic_gradient(node, model, data)
        return {name: torch.zeros_like(g) for name, g in grads.items()}, loss

    async def log_final_scores(self, node, model, data):
        self.final[node.id] = await self.state(node, model)


@pytest.mark.parametrize("topology", ["ring", "regular:d=4"])
@pytest.mark.parametrize("rounds", [None, 6])  # 6: some nodes run out of steps first
def test_ad_psgd_conserves_the_sum_of_the_models_to_the_end(tmp_path, topology, rounds):
    for seed in (0, 1, 2):
        AveragingADPSGD.final = {}
        config = RunConfig(protocol="ad-psgd", topology=topology, nodes=N, duration=0.2,
                           rounds=rounds, compute_speed="uniform:low=1,high=3", seed=seed, quiet=True,
                           no_plots=True)
        result = execute(config, ADPSGDOptions(init="independent", model=MODEL), AveragingADPSGD,
                         tmp_path / f"{seed}")
        exchanges = result.summary["exchanges"]
        assert exchanges["averaged"] >= N and sorted(AveragingADPSGD.final) == list(range(N))
        assert exchanges["averaged"] == exchanges["answered"], exchanges  # each completed on both sides
        assert _drift(AveragingADPSGD.final, seed, tmp_path) < DRIFT, (seed, exchanges)
        assert result.summary["emulated_seconds"] < config.duration + 0.1  # no one waits out a --timeout (1 s)


class AveragingSGP(SGP):
    """SGP --average-only that keeps each node's final (w_i, z_i), after its closing mix."""
    final: dict = {}

    async def close(self, node, carried, valid):
        await super().close(node, carried, valid)
        self.final[node.id] = (carried.w, await self.state(node, carried.model))


@pytest.mark.parametrize("topology", ["ring", "regular:d=4"])
@pytest.mark.parametrize("rounds", [None, 6])
def test_sgp_conserves_the_mass_to_the_end(tmp_path, topology, rounds):
    """Sum of w_i is n to 1e-9, and sum of w_i z_i the sum of the initial models: no share is lost at the horizon,
    also where a node's shares reach a neighbour that has run out of --rounds."""
    for seed in (0, 1, 2):
        AveragingSGP.final = {}
        config = RunConfig(protocol="sgp", topology=topology, nodes=N, duration=0.1, rounds=rounds,
                           compute_speed="uniform:low=1,high=3", seed=seed, quiet=True, no_plots=True)
        execute(config, SGPOptions(average_only=True, init="independent", model=MODEL), AveragingSGP,
                tmp_path / f"{seed}")
        weights = [w for w, _ in AveragingSGP.final.values()]
        assert sorted(AveragingSGP.final) == list(range(N)) and abs(sum(weights) - N) < 1e-9, weights
        numerators = {i: {k: v.double() * w for k, v in z.items()} for i, (w, z) in AveragingSGP.final.items()}
        assert _drift(numerators, seed, tmp_path) < DRIFT


@pytest.mark.parametrize("topology", ["ring", "regular:d=4"])
@pytest.mark.parametrize("rounds", [None, 3])
def test_randomized_gossip_conserves_the_sum_to_the_end(tmp_path, topology, rounds):
    """x_i's sum stays n(n-1)/2 to 1e-9: a node answers until the horizon, then busy, and waits for its last
    request's answer."""
    for seed in (0, 1, 2):
        result = run(protocol="randomized-gossip", topology=topology, nodes=N, duration=4.0, wake_rate=4.0,
                     rounds=rounds, seed=seed, quiet=True, no_plots=True, out=str(tmp_path / f"{seed}"))
        rows = [json.loads(line) for line in (result.out_dir / "randomized_gossip.jsonl").read_text().splitlines()]
        assert sum(row["exchanges"] for row in rows) >= 2 * N
        assert abs(sum(row["x"] for row in rows) - N * (N - 1) / 2) < 1e-9
