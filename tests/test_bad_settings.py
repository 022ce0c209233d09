"""Bad settings, from flags, config files and topology files: exit 2, one short line naming the problem,
no traceback, and nothing run."""
import gc

import pytest

from p2p_emulator.cli import main

# A refused run leaves nothing behind, not even a warning: an unclosed loop or file fails the test.
pytestmark = [pytest.mark.filterwarnings("error::ResourceWarning"),
              pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")]


@pytest.fixture(autouse=True)
def _collected():
    """What a refused run left unclosed warns when it is collected: collect it within the test."""
    yield
    gc.collect()


GOSSIP = ["--protocol", "gossip", "--nodes", "4", "--rounds", "2", "--quiet", "--no-plots"]
DFEDAVGM = ["--protocol", "dfedavgm", "--dataset", "digits", "--nodes", "4", "--rounds", "1", "--model", "mlp",
            "--quiet", "--no-plots"]

FLAGS = {  # case: (base, flags, what the line must name)
    "lr nan": (DFEDAVGM, ["--lr", "nan"], "--lr"),
    "momentum nan": (DFEDAVGM, ["--momentum", "nan"], "--momentum"),
    "timeout nan": (GOSSIP, ["--timeout", "nan"], "--timeout"),
    "compute cost overflows": (GOSSIP, ["--compute-cost", "1e400s"], "--compute-cost"),
    "latency overflows": (GOSSIP, ["--latency", "1e400ms"], "--latency"),
    "latency sigma nan": (GOSSIP, ["--latency", "lognormal:median=20ms,sigma=nan"], "--latency"),
    "latency sigma text": (GOSSIP, ["--latency", "lognormal:median=20ms,sigma=abc"], "--latency"),
    "compute factor nan": (GOSSIP, ["--compute-time", "measured", "--compute-factor", "nan"], "--compute-factor"),
    "compute factor inf": (GOSSIP, ["--compute-time", "measured", "--compute-factor", "inf"], "--compute-factor"),
    "weight decay negative": (DFEDAVGM, ["--weight-decay", "-1"], "--weight-decay"),
    "compute speed nan": (GOSSIP, ["--compute-speed", "uniform:low=nan,high=2"], "--compute-speed"),
    "compute speed low above high": (GOSSIP, ["--compute-speed", "uniform:low=2,high=1"], "--compute-speed"),
    "compute speed sigma negative": (GOSSIP, ["--compute-speed", "lognormal:sigma=-1"], "--compute-speed"),
    # parameters, not one node's draw: fraction=2 slowed every node, slowdown=0 failed once a node drew it
    "stragglers fraction above 1": (GOSSIP, ["--compute-speed", "stragglers:fraction=2"], "fraction must be in"),
    "stragglers slowdown zero": (GOSSIP, ["--compute-speed", "stragglers:slowdown=0"], "slowdown must be positive"),
    "constant speed negative": (GOSSIP, ["--compute-speed", "constant:value=-1"], "value must be positive"),
    "uniform speed from zero": (GOSSIP, ["--compute-speed", "uniform:low=0,high=2"], "low must be positive"),
    "seed beyond 64 bits": (DFEDAVGM, ["--seed", str(2**70)], "--seed"),
    "too many nodes": (GOSSIP, ["--nodes", "10000000"], "--nodes"),
    # 1,000 nodes of 65 MiB models (255 GiB): the same refusal as 100,000 small ones, without partitioning
    # the data 100,000 ways first (10 s)
    "models beyond memory": (DFEDAVGM, ["--nodes", "1000", "--topology", "ring", "--model", "mlp:hidden=4096,4096"],
                             "GiB of model state"),
    "time scale inf": (GOSSIP, ["--clock", "real", "--time-scale", "inf"], "--time-scale"),
    "bandwidth nan": (GOSSIP, ["--bandwidth", "nan"], "--bandwidth"),
    "loss nan": (GOSSIP, ["--loss", "nan"], "--loss"),
    "corrupt nan": (GOSSIP, ["--corrupt", "nan"], "--corrupt"),
    "rounds huge": (GOSSIP, ["--rounds", str(2**70)], "--rounds"),
    "long input is cut": (GOSSIP, ["--latency", "x" * 5000], "--latency"),
    "adversary fraction": (GOSSIP, ["--adversaries", "fraction=2,kind=signflip"], "--adversaries"),
    "adversary kind": (GOSSIP, ["--adversaries", "fraction=0.1,kind=evil"], "--adversaries"),
    "adversary noise nan": (GOSSIP, ["--adversaries", "fraction=0.1,kind=noise:std=nan"], "--adversaries"),
    "aggregate trimmed too far": (DFEDAVGM, ["--aggregate", "trimmed:0.5"], "--aggregate"),
    "aggregate unknown": (DFEDAVGM, ["--aggregate", "mode"], "--aggregate"),
}

CONFIG_FILES = {  # case: (file name, content, what the line must name)
    "float for an int (TOML)": ("c.toml", "nodes = 3.7\n", "nodes"),
    "float for an int (YAML)": ("c.yaml", "seed: -0.5\n", "seed"),
    "bool for an int": ("c.yaml", "nodes: true\n", "nodes"),
    "rounds inf (TOML)": ("c.toml", "rounds = inf\n", "rounds"),
    "rounds inf (YAML)": ("c.yaml", "rounds: .inf\n", "rounds"),
    "float nan (YAML)": ("c.yaml", "time_scale: .nan\n", "time"),
    "binary file": ("c.yaml", bytes(range(256)) * 2, "c.yaml"),
    "alias bomb": ("c.yaml", "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{c}: &{c} [{','.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")) + "latency: *i\n",
        "alias"),
    "oversized file": ("c.yaml", "# padding\n" * 200_000, "c.yaml"),
}


def assert_refused(capsys, argv, named):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    assert named in lines[0] and len(lines[0]) < 200 and "Traceback" not in captured.err, lines[0]


@pytest.mark.parametrize("case", list(FLAGS))
def test_bad_flags(case, tmp_path, capsys):
    base, flags, named = FLAGS[case]
    assert_refused(capsys, [*base, *flags, "--out", str(tmp_path / "run")], named)
    assert not (tmp_path / "run").exists()
    assert not (tmp_path / "run").exists()  # refused before any work


@pytest.mark.parametrize("case", list(CONFIG_FILES))
def test_bad_config_files(case, tmp_path, capsys):
    name, content, named = CONFIG_FILES[case]
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    # no flags for the file's settings: flags would win over it
    assert_refused(capsys, ["--protocol", "gossip", "--quiet", "--no-plots", "--config", str(path),
                            "--out", str(tmp_path / "run")], named)
    assert not (tmp_path / "run").exists()


def test_a_bad_edge_in_a_topology_file_names_the_file_the_line_and_the_edge(tmp_path, capsys):
    topology = tmp_path / "net.csv"
    topology.write_text("src,dst,latency\n0,1,5ms\n1,2,-5ms\n2,0,5ms\n")
    assert main(["--protocol", "gossip", "--topology", str(topology), "--rounds", "1", "--quiet", "--no-plots",
                 "--out", str(tmp_path / "run")]) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert "net.csv" in line and "line 3" in line and "1-2" in line and "-5ms" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("made_by_user", [False, True])
def test_a_run_refused_while_setting_up_leaves_nothing_behind(tmp_path, capsys, made_by_user):
    out = tmp_path / "run"
    if made_by_user:
        out.mkdir()
    assert_refused(capsys, [*DFEDAVGM, "--dataset", "mnist", "--data-root", str(tmp_path / "none"), "--out", str(out)],
                   "mnist")
    assert (out.exists() and not any(out.iterdir())) if made_by_user else not out.exists()
