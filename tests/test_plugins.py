"""Protocols from other packages: an installed package's entry point adds a protocol, with no change here."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
EMULATE = [sys.executable, "-m", "p2p_emulator.cli"]


def _install(package: str, target: Path) -> Path:
    """pip-install tests/<package> into `target` (a copy: the build leaves nothing in the source tree)."""
    source = target.parent / f"{package}-source"
    shutil.copytree(HERE / package, source)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", str(target), str(source)],
                   check=True, capture_output=True)
    return target


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """site directories holding the example plugin and the broken one."""
    root = tmp_path_factory.mktemp("plugins")
    return {name: _install(name, root / name) for name in ("plugin_example", "plugin_broken")}


def _emulate(args: list, *site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), *map(str, site)])}
    return subprocess.run([*EMULATE, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def test_an_installed_plugin_is_listed_and_runs_with_its_own_options(installed, tmp_path):
    site = installed["plugin_example"]
    listed = _emulate(["--list-protocols"], site, cwd=tmp_path)
    assert listed.returncode == 0 and listed.stderr == ""
    assert "max-flood" in listed.stdout.split() and "gossip" in listed.stdout.split()
    help_text = _emulate(["--protocol", "max-flood", "--help"], site, cwd=tmp_path).stdout
    assert "protocol options (max-flood)" in help_text and "--timeout" in help_text
    bad = _emulate(["--protocol", "max-flood", "--timeout", "0"], site, cwd=tmp_path)
    assert (bad.returncode, bad.stderr) == (2, "emulate: error: --timeout 0.0: must be positive\n")

    out = tmp_path / "run"
    done = _emulate(["--protocol", "max-flood", "--topology", "ring", "--nodes", 8, "--rounds", 5, "--timeout", 0.5,
                     "--quiet", "--no-plots", "--out", out], site, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # A ring of 8 has diameter 4: after round r every node knows the maximum of its r+1 hops.
    knows = {r: sum(row["knows_max"] for row in rows if row["round"] == r) for r in range(5)}
    assert knows[4] == 8 and knows[0] == 3  # the holder and its two neighbours
    assert all(row["bytes_sent"] == 2 * 32 for row in rows)  # two neighbours, a float each way
    assert json.loads((out / "summary.json").read_text())["protocol"] == "max-flood"


def test_a_broken_plugin_is_one_line_and_the_built_in_protocols_still_run(installed, tmp_path):
    site = installed["plugin_broken"]
    listed = _emulate(["--list-protocols"], site, cwd=tmp_path)
    assert listed.returncode == 0 and "gossip" in listed.stdout and "broken" not in listed.stdout
    assert listed.stderr.splitlines() == [
        "warning: protocol plugin 'broken' (broken_protocol:Broken) not loaded: "
        "ModuleNotFoundError: No module named 'a_module_that_is_not_installed'"]
    both = _emulate(["--protocol", "max-flood", "--nodes", 4, "--rounds", 1, "--quiet", "--no-plots",
                     "--out", tmp_path / "run"], site, installed["plugin_example"], cwd=tmp_path)
    assert both.returncode == 0 and len(both.stderr.splitlines()) == 1
    named = _emulate(["--protocol", "broken"], site, cwd=tmp_path)
    assert named.returncode == 2 and named.stderr.splitlines()[-1].startswith("emulate: error: --protocol 'broken'")


def test_a_plugin_may_not_replace_a_built_in_protocol(tmp_path, monkeypatch):
    from importlib import metadata

    from emulator import protocol

    class Impostor(protocol.Protocol):
        """Not gossip."""

    fake = metadata.EntryPoint("gossip", "impostor:Impostor", protocol.PLUGIN_GROUP)
    monkeypatch.setattr(metadata.EntryPoint, "load", lambda self: Impostor)
    monkeypatch.setattr(protocol, "entry_points", lambda group: [fake])
    monkeypatch.setattr(protocol, "_load_plugins", protocol._load_plugins.__wrapped__)
    with pytest.warns(protocol.PluginWarning, match=r"protocol plugin 'gossip' \(impostor:Impostor\) not loaded: "
                                                    r"ValueError: protocol 'gossip' is registered twice"):
        registry = protocol.protocols()
    assert registry["gossip"] is not Impostor and registry["gossip"].__name__ == "Gossip"
