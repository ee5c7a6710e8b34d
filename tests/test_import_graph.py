"""Dependencies point one way: no module of service/ imports itself back through others (imports
inside functions and under TYPE_CHECKING count: neither may hide a circle), the packages form a
layered graph, and the engine never reaches up into selection, the API or the entry points. And no
module grows past MAX_LINES: a file that long holds more than one job (split it by job)."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICE = Path(__file__).resolve().parent.parent / "service"

# What the engine (service.engine and its subpackages) may not import: it is loaded by them.
ABOVE_THE_ENGINE = {"service.selection", "service.api", "service.serving", "service.cli", "service.commands",
                    "service.server", "service.telemetry", "service.config", "service.config_loading",
                    "service.config_views", "service.config_values"}  # fmt: skip
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    modules = {}
    for path in SERVICE.rglob("*.py"):
        if path.name == "__main__.py":  # an entry point (python -m), imported by nothing: above every layer
            continue
        name = ".".join(path.relative_to(SERVICE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the service modules it imports anywhere in its file."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("service"):
                for alias in node.names:  # `from service.x import y`: y may be a module
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name.startswith("service"))
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _package(module: str) -> str:
    """service.X for a module of package X (or the top-level module service.X itself)."""
    return ".".join(module.split(".")[:2])


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph`, as the nodes along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_module_imports_itself_back() -> None:
    cycle = _cycle(_imports(_modules()))
    assert cycle is None, " -> ".join(cycle or [])


def test_the_packages_form_layers() -> None:
    packages: dict[str, set[str]] = {}
    for module, imported in _imports(_modules()).items():
        packages.setdefault(_package(module), set()).update(
            _package(m) for m in imported if _package(m) != _package(module)
        )
    cycle = _cycle(packages)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_engine_never_imports_what_loads_it() -> None:
    wrong = {
        f"{module} imports {m}"
        for module, imported in _imports(_modules()).items()
        if module.startswith("service.engine")
        for m in imported
        if _package(m) in ABOVE_THE_ENGINE
    }
    assert not wrong, sorted(wrong)


def test_the_check_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_is_over_the_line_cap() -> None:
    over = {
        str(path.relative_to(SERVICE.parent)): n
        for path in SERVICE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not over, f"over {MAX_LINES} lines (split by job): {over}"
