"""What a newcomer meets first: the version, the protocol list, and bad settings refused at once and cleanly."""
import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from p2p_emulator.cli import main
from emulator.protocol import protocols

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_installed_package_s_and_is_in_summary_json(tmp_path, capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"emulate {version('p2p-emulator')}\n"
    out = tmp_path / "run"
    assert main(["--protocol", "gossip", "--nodes", "3", "--rounds", "1", "--quiet", "--no-plots", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["version"] == version("p2p-emulator")


def test_the_protocol_list_is_two_aligned_columns(capsys):
    assert main(["--list-protocols"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(protocols())
    width = max(map(len, protocols()))
    assert {len(line) - len(line[width:].lstrip()) for line in lines} == {width + 2}  # every description in one column


def _refuse(args: list[str], cwd: Path) -> tuple[int, str, bool]:
    """Exit code, stderr, and whether torch was imported, of `emulate ARGS` in a fresh interpreter."""
    code = ("import sys; from p2p_emulator.cli import main; code = main(sys.argv[1:]); "
            "print('torch' in sys.modules); sys.exit(code)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "default"}
    done = subprocess.run([sys.executable, "-c", code, *args, "--out", "run"], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)
    return done.returncode, done.stderr, done.stdout.strip() == "True"


@pytest.mark.parametrize("args, said", [
    (["--model-assign", "bogus"], "--model-assign 'bogus': choose one of round-robin, random"),
    (["--val-fraction", "1.5"], "--val-fraction 1.5: must be in [0, 1)"),
    (["--val-fraction", "0.6", "--rollback-fraction", "0.5"],
     "--val-fraction 0.6 and --rollback-fraction 0.5: together they must leave training samples (sum below 1)"),
    (["--data-root", str(ROOT / "pyproject.toml")], f"--data-root {ROOT / 'pyproject.toml'}: is not a directory"),
    (["--dataset", "imagenet"], "--dataset 'imagenet': choose one of digits, fashion-mnist, mnist, cifar10, svhn, "
                                "cinic10, fortunes, leaf-femnist, leaf-shakespeare, leaf-sent140, or file:PATH"),
    (["--partition", "dirichlet:beta=1"], "bad option 'beta=1' in 'dirichlet:beta=1'; dirichlet takes alpha=, "
                                          "min_size="),
    (["--model", "mlp:hidden=0"], "model 'mlp:hidden=0': hidden must be positive integers separated by commas"),
    (["--model", "hetero-small"], "--model hetero-small: dfedavgm averages models, so every node needs the same "
                                  "architecture (got cnn-small, small-dwsep, small-mixer, small-resnet)"),
])
def test_workload_settings_are_refused_before_torch_or_the_dataset_loads(tmp_path, args, said):
    code, err, torch_loaded = _refuse(["--protocol", "dfedavgm", "--nodes", "4", *args], tmp_path)
    assert (code, err) == (2, f"emulate: error: {said}\n")
    assert not torch_loaded
    assert not (tmp_path / "run").exists()


def test_mapl_checks_its_flags_without_loading_torch(tmp_path):
    code, err, torch_loaded = _refuse(["--protocol", "mapl", "--loss-forms", "mine"], tmp_path)
    assert (code, err, torch_loaded) == (2, "emulate: error: --loss-forms 'mine': choose code or paper\n", False)
    from protocols.mapl import LOSS_FORMS, PML_TERMS
    from p2p_emulator.workloads.prototypes import LOSSES, TERMS

    assert LOSS_FORMS == tuple(LOSSES) and PML_TERMS == TERMS  # the flags' choices are the losses that exist


def test_a_bad_topology_file_leaves_one_line_and_no_warning(tmp_path):
    edges = tmp_path / "bad.edges"
    edges.write_text("0 1 latency=abc\n1 2\n")
    code, err, _ = _refuse(["--protocol", "gossip", "--topology", str(edges)], tmp_path)
    assert code == 2
    assert err == (f"emulate: error: {edges}: line 1: edge 0-1: unknown latency model 'abc' "
                   "(use a duration, uniform, normal or lognormal)\n")  # no "unclosed event loop" after it
    assert not (tmp_path / "run").exists()
