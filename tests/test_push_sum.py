"""Push-sum, the README's example protocol, run through the CLI: every estimate reaches the mean."""
import json

import pytest

from p2p_emulator.cli import main


def estimates(tmp_path, *flags) -> dict[int, list[float]]:
    """Each round's estimates s_i / w_i, node by node."""
    out = tmp_path / "run"
    assert main(["--protocol", "push-sum", "--quiet", "--no-plots", *flags, "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_round: dict[int, list[float]] = {}
    for row in rows:
        by_round.setdefault(row["round"], []).append(row["estimate"])
    return by_round


def test_first_round_on_a_ring_averages_each_node_with_its_two_neighbours(tmp_path):
    first = estimates(tmp_path, "--topology", "ring", "--nodes", "8", "--rounds", "1")[0]
    # s_i = (x_{i-1} + x_i + x_{i+1}) / 3 with x_i = i, w_i = 1 on a ring of 8
    assert first == pytest.approx([8 / 3, 1, 2, 3, 4, 5, 6, 13 / 3], abs=1e-12)


@pytest.mark.parametrize("topology,nodes,seed", [("ring", 8, 0), ("ba:m=2", 12, 1), ("ba:m=2", 12, 2),
                                                 ("regular:d=3", 10, 3)])
def test_every_estimate_converges_to_the_mean(tmp_path, topology, nodes, seed):
    by_round = estimates(tmp_path, "--topology", topology, "--nodes", str(nodes), "--seed", str(seed),
                         "--rounds", "200")
    mean = (nodes - 1) / 2  # of the initial values 0, 1, ..., n - 1
    assert by_round[199] == pytest.approx([mean] * nodes, abs=1e-9)
    assert max(abs(e - mean) for e in by_round[0]) > 0.5  # not there from the start
