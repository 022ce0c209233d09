"""The package a lab installs: what the wheel holds, and the one public API (`import p2p_emulator`)."""
import functools
import inspect
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import p2p_emulator

ROOT = Path(__file__).resolve().parents[1]
IMPORT_PACKAGES = {"p2p_emulator", "emulator", "protocols", "topologies"}  # the design's three and the tool's own


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel built from a copy of every tracked file but the docs (so a stray package would be found)."""
    tmp = tmp_path_factory.mktemp("wheel")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        if not name.startswith("docs/"):
            (tmp / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tmp / "src" / name)
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp / "dist"),
                    str(tmp / "src")], check=True, capture_output=True)
    return zipfile.ZipFile(next((tmp / "dist").glob("*.whl")))


def test_the_wheel_holds_only_the_designs_packages_and_the_tools_own(wheel):
    top = {name.split("/")[0] for name in wheel.namelist()}
    dist_info = {name for name in top if name.endswith(".dist-info")}
    assert top - dist_info == IMPORT_PACKAGES
    assert dist_info == {f"p2p_emulator-{p2p_emulator.__version__}.dist-info"}


def test_the_wheel_ships_type_information_and_the_command(wheel):
    names = set(wheel.namelist())
    assert {f"{package}/py.typed" for package in IMPORT_PACKAGES} <= names
    assert "p2p_emulator/analysis/watch.html" in names  # `emulate watch`'s page
    entry_points = wheel.read(f"p2p_emulator-{p2p_emulator.__version__}.dist-info/entry_points.txt").decode()
    assert "emulate = p2p_emulator.cli:main" in entry_points
    assert "[p2p_emulator.analysis]" in entry_points  # the protocols' own figures and measures


def _documented_members(obj) -> dict[str, object]:
    """A public class's own public members; for Node, the API a protocol's handle exposes."""
    if obj is p2p_emulator.Node:
        from emulator.node import METHODS, PROPERTIES

        return {name: getattr(obj, name) for name in (*PROPERTIES, *METHODS) if name != "id"}
    return {name: member for name, member in vars(obj).items()
            if not name.startswith("_") and (callable(member) or isinstance(member, (property, functools.cached_property)))
            and name != "Options"}


@pytest.mark.parametrize("name", sorted(set(p2p_emulator.__all__) - {"__version__"}))
def test_every_public_name_has_a_docstring(name):
    obj = getattr(p2p_emulator, name)
    assert (obj.__doc__ or "").strip(), name
    if inspect.isclass(obj):
        undocumented = [member for member, value in _documented_members(obj).items() if not (value.__doc__ or "").strip()]
        assert undocumented == [], name


def test_importing_the_api_loads_neither_torch_nor_matplotlib():
    code = ("import sys, p2p_emulator as emu; "
            "assert not {'torch', 'matplotlib', 'p2p_emulator.runs'} & set(sys.modules), sorted(sys.modules); "
            "assert callable(emu.run) and 'p2p_emulator.runs' in sys.modules; "
            "assert set(emu.__all__) <= set(dir(emu))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'execute'"):
        p2p_emulator.execute


def test_the_api_names_stay_functions_once_every_module_is_imported():
    # A submodule named like an API function would replace it on the package once imported.
    code = ("import importlib, pkgutil, inspect, p2p_emulator as emu\n"
            "for info in pkgutil.walk_packages(emu.__path__, 'p2p_emulator.'):\n"
            "    importlib.import_module(info.name)\n"
            "modules = [name for name in emu.__all__ if inspect.ismodule(getattr(emu, name))]\n"
            "assert modules == [], modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
