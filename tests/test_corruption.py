"""The corruption model: bit flips in arriving frames, caught by the frame checksum or reaching the protocol."""
import collections
import csv
import json

import networkx as nx
import numpy as np
import pytest

from p2p_emulator.cli import main
from p2p_emulator.specs import parse_corrupt
from emulator import wire
from emulator.units import UnitError
from tests.conftest import emulate

PAYLOAD = np.arange(250, dtype=np.float32)  # a 1,000-byte array


def _exchange(log, messages: int):
    """Node 0 sends `messages` arrays to node 1, which logs what it takes."""
    async def run(node):
        if node.id == 0:
            for _ in range(messages):
                node.send(1, "data", PAYLOAD)
            return
        while (msg := await node.recv(timeout=10.0)) is not None:
            log.append(msg.body)
    return run


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_corrupted_frame_is_a_corrupt_drop_with_checksums(seed):
    log = []
    emulation = emulate(_exchange(log, 400), nx.path_graph(2), corrupt="0.25", seed=seed)
    totals = emulation.ledger.totals()
    assert totals["messages_total"] == 400 and totals["bytes_total"] == 400 * len(wire.encode(["data", 0, PAYLOAD]))
    assert totals["dropped_corrupt"] + totals["messages_delivered"] == 400
    assert 60 < totals["dropped_corrupt"] < 140  # 100 expected
    assert len(log) == totals["messages_delivered"] and all(np.array_equal(body, PAYLOAD) for body in log)


def test_corruption_draws_on_its_own_stream_and_repeats_with_the_seed():
    def fates(**settings):
        log = []
        emulation = emulate(_exchange(log, 300), nx.path_graph(2), trace=True, seed=5, **settings)
        return [row.fate for row in emulation.ledger.trace]

    lossy, both = fates(loss="0.2"), fates(loss="0.2", corrupt="0.3")
    assert both == fates(loss="0.2", corrupt="0.3")
    # the same messages are lost with or without corruption; some of the others turn corrupt
    assert [f == "loss" for f in lossy] == [f == "loss" for f in both]
    assert "corrupt" in both and "corrupt" not in lossy


def test_a_bit_error_rate_drops_frames_by_their_length():
    log = []
    ber = 1e-5
    emulation = emulate(_exchange(log, 600), nx.path_graph(2), corrupt=f"ber:{ber}", seed=3)
    totals = emulation.ledger.totals()
    size = totals["bytes_total"] // 600
    expected = 600 * (1 - (1 - ber) ** (8 * size))  # about 50
    assert abs(totals["dropped_corrupt"] - expected) < 4 * expected ** 0.5


def test_without_checksums_corrupted_frames_reach_the_receiver():
    log = []
    emulation = emulate(_exchange(log, 200), nx.path_graph(2), corrupt="0.5", no_checksum=True, seed=1)
    totals = emulation.ledger.totals()
    damaged = sum(not np.array_equal(body, PAYLOAD) for body in log)
    # one flipped bit lands in the 1,000 data bytes of a ~1,040-byte frame most of the time: it decodes
    assert damaged > 60 and totals["dropped_corrupt"] < 20
    assert len(log) + totals["dropped_corrupt"] == 200


@pytest.mark.parametrize("text", ["2", "-0.1", "nan", "ber:x", "ber:1.5", "bits"])
def test_bad_corruption_settings_are_refused(text):
    with pytest.raises(UnitError):
        parse_corrupt(text)


DFEDAVGM = ["--protocol", "dfedavgm", "--dataset", "digits", "--partition", "iid", "--nodes", "8",
            "--topology", "regular:d=4", "--rounds", "20", "--model", "mlp", "--quiet", "--no-plots"]


def test_with_checksums_a_corrupted_frame_is_a_counted_drop_as_a_lost_one_is(tmp_path):
    """At 1% either way (loss of whole messages: --loss-model datagram), each of the 640 frames arrives whole or is
    dropped for its cause, counted on its link; the dropped frames still cost their bytes, no damaged body reaches
    DFedAvgM, and it learns through both."""
    runs = {}
    for cause in ("corrupt", "loss"):
        out = tmp_path / cause
        assert main([*DFEDAVGM, f"--{cause}", "0.01", "--loss-model", "datagram", "--trace", "--out", str(out)]) == 0
        summary = json.loads((out / "summary.json").read_text())
        messages = [json.loads(line) for line in (out / "messages.jsonl").read_text().splitlines()]
        fates = collections.Counter(m["fate"] for m in messages)
        assert len(messages) == 8 * 4 * 20 and set(fates) - {None} == {"delivered", cause}
        assert fates[None] == summary["messages_in_flight"]  # sent as the run ended
        # about 6.4 expected (binomial, sd 2.5); a checksum that let damaged frames through would leave ~0
        assert 2 <= summary[f"dropped_{cause}"] == fates[cause] <= 14
        by_link = collections.Counter((m["src"], m["dst"]) for m in messages if m["fate"] == cause)
        with open(out / "links.csv") as fh:
            assert {(int(r["src"]), int(r["dst"])): int(r[f"dropped_{cause}"]) for r in csv.DictReader(fh)
                    if int(r[f"dropped_{cause}"])} == by_link
        assert summary["dropped_invalid"] == 0 and summary["messages_total"] == len(messages)
        assert summary["final"]["test_acc"] > 0.9  # measured 0.938 both ways (seed 0)
        runs[cause] = summary
    assert runs["corrupt"]["bytes_total"] == runs["loss"]["bytes_total"]


def test_silent_corruption_reaches_dfedavgm_which_drops_what_it_cannot_use(tmp_path):
    assert main([*DFEDAVGM, "--corrupt", "0.05", "--no-checksum", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dropped_corrupt"] == 0 < summary["dropped_invalid"]
    links = (tmp_path / "links.csv").read_text().splitlines()
    assert links[0].endswith(",dropped_invalid")
    assert sum(int(row.rsplit(",", 1)[1]) for row in links[1:]) == summary["dropped_invalid"]
