"""--topology-schedule resample:every=Ss: a time-driven protocol's nodes see the draw of the emulated instant."""
import pytest

from emulator.protocol import NoOptions, Protocol
from emulator.seeds import Seeds
from p2p_emulator.runs import execute
from p2p_emulator.settings import RunConfig
from tests.conftest import assert_refused
from topologies.schedules import resample

N, SEED, EVERY = 12, 4, 0.5


class Looking(Protocol):
    """Each node, every 0.1-0.2 emulated seconds: notes the instant and the neighbours it sees, and sends to them."""
    asynchronous = True
    seen: list = []

    async def run(self, node):
        async for _ in node.rounds():
            self.seen.append((node.now(), node.id, node.neighbours))
            node.broadcast("hello")  # over the links of that instant's graph (another would be refused)
            await node.sleep(0.1 + 0.01 * node.id)


def test_each_step_sees_the_graph_drawn_for_its_instant(tmp_path):
    Looking.seen = []
    config = RunConfig(protocol="looking", topology="regular:d=4", nodes=N, duration=3.0, seed=SEED,
                       topology_schedule=f"resample:every={EVERY}s", quiet=True, no_plots=True)
    result = execute(config, NoOptions(), Looking, tmp_path / "run")
    seed = Seeds(SEED).integer("topology")  # the run's stream for its topology
    draws = {k: resample("regular:d=4", N, seed, k, 1) for k in range(6)}
    assert len({tuple(sorted(g.edges)) for g in draws.values()}) == 6  # the draws differ
    assert {int(t // EVERY) for t, _, _ in Looking.seen} == set(draws)
    for t, i, neighbours in Looking.seen:
        assert neighbours == sorted(draws[int(t // EVERY)].neighbors(i)), (t, i)
    assert result.summary["messages_total"] == sum(len(neighbours) for _, _, neighbours in Looking.seen)


@pytest.mark.parametrize("argv, named", [
    (["--protocol", "dpsgd", "--topology", "regular:d=4", "--topology-schedule", "resample:every=2s"],
     "--topology-schedule"),  # rounds, not time
    (["--protocol", "randomized-gossip", "--topology", "regular:d=4", "--duration", "1",
      "--topology-schedule", "resample:every=2.5"], "--topology-schedule"),  # no unit: neither rounds nor time
])
def test_a_schedule_in_time_is_refused_where_it_has_no_meaning(capsys, tmp_path, argv, named):
    assert_refused(capsys, [*argv, "--nodes", "8"], named, tmp_path / "r")


def test_a_schedule_file_of_instants_holds_each_graph_until_the_next(tmp_path):
    """t,src,dst: a ring of 4 from t = 0, its chords from t = 1 s, the ring again from t = 2 s to the end."""
    path = tmp_path / "schedule.csv"
    ring, chords = [(0, 1), (1, 2), (2, 3), (0, 3)], [(0, 2), (1, 3)]
    rows = [(t, u, v) for t, edges in ((0, ring), (1, chords), (2, ring)) for u, v in edges]
    path.write_text("t,src,dst\n" + "".join(f"{t},{u},{v}\n" for t, u, v in rows))
    Looking.seen = []
    config = RunConfig(protocol="looking", nodes=4, duration=3.0, topology_schedule=str(path), quiet=True,
                       no_plots=True)
    execute(config, NoOptions(), Looking, tmp_path / "run")
    graph = {0: ring, 1: chords, 2: ring}
    for t, i, neighbours in Looking.seen:
        edges = graph[min(int(t), 2)]
        assert neighbours == sorted({v for u, v in edges if u == i} | {u for u, v in edges if v == i}), (t, i)
    assert {int(t) for t, _, _ in Looking.seen} == {0, 1, 2}


def test_a_schedule_file_of_instants_must_start_at_zero(capsys, tmp_path):
    path = tmp_path / "late.csv"
    path.write_text("t,src,dst\n0.5,0,1\n0.5,1,2\n")
    assert_refused(capsys, ["--protocol", "randomized-gossip", "--duration", "1", "--topology-schedule", str(path)],
                   "t = 0", tmp_path / "r")
