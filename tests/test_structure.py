"""The data path runs one way: the package imports, read from the sources by AST, never run back."""
import ast
import functools
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "analysis", "emulator", "protocols", "topologies", "workloads")


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
    return {name for name in found if name.split(".")[0] in PACKAGES}


@functools.cache
def _graph() -> nx.DiGraph:
    modules = {_module(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target in _imports(path):
            while target not in modules:  # "from pkg.mod import name" names a symbol, not a module
                target = target.rpartition(".")[0]
            if target != name and target not in PACKAGES:
                graph.add_edge(name, target)
    return graph


def _packages_imported_by(package: str) -> dict[str, set[str]]:
    graph = _graph()
    return {module: set(graph.successors(module)) for module in graph if module.split(".")[0] == package}


def test_no_import_cycle():
    assert list(nx.simple_cycles(_graph())) == []


def test_emulator_imports_nothing_above_it():
    for module, targets in _packages_imported_by("emulator").items():
        assert {t.split(".")[0] for t in targets} <= {"emulator"}, module


def test_analysis_reads_run_directories_only():
    for module, targets in _packages_imported_by("analysis").items():
        assert {t.split(".")[0] for t in targets} <= {"analysis"}, module


def test_topologies_and_workloads_use_only_the_emulators_errors_and_units():
    for package in ("topologies", "workloads"):
        for module, targets in _packages_imported_by(package).items():
            outside = {t for t in targets if t.split(".")[0] != package}
            assert outside <= {"emulator.errors", "emulator.units"}, (module, outside)


def test_the_checker_sees_imports():
    # A test that cannot fail is a defect: the graph must hold the edges the code has.
    graph = _graph()
    assert graph.has_edge("app.run", "emulator.emulation") and graph.has_edge("app.cli", "app.run")
    assert graph.has_edge("protocols.dfedavgm", "emulator.protocol")
