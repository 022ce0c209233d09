"""Stragglers that are what they say: `stragglers:fraction=F,slowdown=S` slows exactly round(F*n) nodes, the
seed choosing which, bad parameters are refused before anything is written, and summary.json names each
node's slowdown."""
import json

import numpy as np
import pytest

from emulator.seeds import Seeds
from p2p_emulator import run
from p2p_emulator.specs import slowdowns
from tests.conftest import assert_refused

GOSSIP = ["--protocol", "gossip", "--nodes", "4", "--rounds", "2", "--quiet", "--no-plots"]


def _drawn(spec: str, n: int, seed: int) -> tuple[float, ...]:
    return slowdowns(spec, n, np.random.default_rng(seed))


@pytest.mark.parametrize("n", [5, 12, 16, 33])
@pytest.mark.parametrize("seed", range(10))
def test_exactly_round_fraction_n_nodes_are_slowed(n, seed):
    factors = _drawn("stragglers:fraction=0.25,slowdown=4", n, seed)
    assert len(factors) == n
    assert factors.count(4.0) == round(0.25 * n)  # 5 -> 1, 12 -> 3, 16 -> 4, 33 -> 8
    assert factors.count(1.0) == n - round(0.25 * n)


@pytest.mark.parametrize("fraction, slowed", [(0, 0), (1, 16)])
def test_fraction_zero_slows_none_and_one_slows_all(fraction, slowed):
    factors = _drawn(f"stragglers:fraction={fraction},slowdown=4", 16, 0)
    assert factors.count(4.0) == slowed and factors.count(1.0) == 16 - slowed


def test_the_seed_chooses_the_stragglers():
    chosen = {frozenset(np.flatnonzero(np.array(_drawn("stragglers:fraction=0.25,slowdown=4", 16, seed)) > 1))
              for seed in range(10)}
    assert len(chosen) >= 2
    assert _drawn("stragglers:fraction=0.25,slowdown=4", 16, 3) == _drawn("stragglers:fraction=0.25,slowdown=4", 16, 3)


@pytest.mark.parametrize("spec, named", [("stragglers:fraction=2", "fraction must be in"),
                                         ("stragglers:slowdown=0", "slowdown must be positive")])
def test_the_cli_refuses_bad_stragglers_before_writing_anything(spec, named, tmp_path, capsys):
    assert_refused(capsys, [*GOSSIP, "--compute-speed", spec], named, tmp_path / "run")


def test_summary_names_each_nodes_slowdown(tmp_path):
    spec = "stragglers:fraction=0.5,slowdown=4"
    slowed = run(protocol="gossip", nodes=4, rounds=1, compute_speed=spec, quiet=True, no_plots=True,
                 out=str(tmp_path / "slowed"))
    written = json.loads((slowed.out_dir / "summary.json").read_text())["compute_slowdowns"]
    expected = slowdowns(spec, 4, Seeds(0).numpy("compute.speed"))  # the run's own draw, seed 0
    assert written == {str(node): s for node, s in enumerate(expected)}
    assert sorted(written.values()) == [1.0, 1.0, 4.0, 4.0]
    plain = run(protocol="gossip", nodes=4, rounds=1, quiet=True, no_plots=True, out=str(tmp_path / "plain"))
    assert "compute_slowdowns" not in json.loads((plain.out_dir / "summary.json").read_text())
