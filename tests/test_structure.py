"""The data path runs one way: the package imports, read from the sources by AST, never run back."""
import ast
import functools
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
TOP = ("p2p_emulator", "emulator", "protocols", "topologies")  # the import packages the wheel installs
# The layers of the data path. The tool's package holds three: the command and its settings, workloads
# (data and models, used by protocols) and analysis (reads run directories).
LAYERS = {"p2p_emulator.analysis": "analysis", "p2p_emulator.workloads": "workloads", "p2p_emulator": "command",
          "emulator": "emulator", "protocols": "protocols", "topologies": "topologies"}


def layer(module: str) -> str:
    """The layer a module belongs to: that of the longest package in LAYERS that holds it."""
    return LAYERS[max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)]


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Project modules that `path` imports, at any depth (inside functions too)."""
    here = _module(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in TOP}


@functools.cache
def _graph() -> nx.DiGraph:
    modules = {_module(path): path for package in TOP for path in (ROOT / package).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target in _imports(path):
            while target not in modules:  # "from pkg.mod import name" names a symbol, not a module
                target = target.rpartition(".")[0]
            if target != name and target not in TOP:
                graph.add_edge(name, target)
    return graph


def _imported_by(name: str) -> dict[str, set[str]]:
    """For each module of layer `name`, the modules it imports."""
    graph = _graph()
    return {module: set(graph.successors(module)) for module in graph if layer(module) == name}


def test_no_import_cycle():
    assert list(nx.simple_cycles(_graph())) == []


def test_emulator_imports_nothing_above_it():
    for module, targets in _imported_by("emulator").items():
        assert {layer(t) for t in targets} <= {"emulator"}, module


def test_analysis_reads_run_directories_only():
    for module, targets in _imported_by("analysis").items():
        assert {layer(t) for t in targets} <= {"analysis"}, module


def test_topologies_and_workloads_use_only_the_emulators_errors_units_and_work():
    for name in ("topologies", "workloads"):
        for module, targets in _imported_by(name).items():
            outside = {t for t in targets if layer(t) != name}
            assert outside <= {"emulator.errors", "emulator.units", "emulator.work"}, (module, outside)


def test_the_checker_sees_imports():
    # A test that cannot fail is a defect: the graph must hold the edges the code has.
    graph = _graph()
    assert graph.has_edge("p2p_emulator.runs", "emulator.emulation") and graph.has_edge("p2p_emulator.cli", "p2p_emulator.runs")
    assert graph.has_edge("protocols.dfedavgm", "emulator.protocol")
    assert graph.has_edge("protocols.common", "p2p_emulator.workloads.task")
    assert layer("p2p_emulator.workloads.task") == "workloads" and layer("p2p_emulator.runs") == "command"
