"""The architecture's "never" arrows, checked on every import statement of the product.

- policies/ imports no other package of the project, and no torch: a policy is pure
  decision code, testable alone and safe to hot-swap.
- gpu_worker/ imports nothing from service/, policies/ or ops/: it is its own process.
- service/ imports from gpu_worker/ only the wire contract (gpu_worker.protocol).
- nothing in the product imports ops/ (the tooling finds the product, not the reverse).
- ops/ has no import cycle.
Lazy imports inside functions count the same as those at the top of a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROJECT = ("service", "gpu_worker", "policies", "ops")
WIRE_CONTRACT = "gpu_worker.protocol"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str = "") -> set[str]:
    """Every module `source` imports; `from pkg import name` counts as pkg.name when
    that is a module of the project, else as pkg."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else _resolve(module, node)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _is_project_module(candidate) else base)
    return found


def _resolve(module: str, node: ast.ImportFrom) -> str:
    package = module.rsplit(".", node.level)[0]
    return f"{package}.{node.module}"


def _is_project_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def top(name: str) -> str:
    return name.split(".")[0]


def violations(module: str, imported: set[str]) -> list[str]:
    """The rules above, for one module and what it imports."""
    package = top(module)
    found = []
    for name in sorted(imported):
        if package != "ops" and top(name) == "ops":
            found.append(f"{module} imports the tooling ({name})")
        if package == "policies" and (top(name) in PROJECT and top(name) != "policies"):
            found.append(f"{module}: a policy imports {name}")
        if package == "policies" and top(name) == "torch":
            found.append(f"{module}: a policy imports torch")
        if package == "gpu_worker" and top(name) in ("service", "policies"):
            found.append(f"{module}: the worker imports {name}")
        if package == "service" and top(name) == "gpu_worker" and name != WIRE_CONTRACT:
            found.append(f"{module}: the service imports worker internals ({name})")
    return found


def product_modules() -> dict[str, set[str]]:
    graph = {}
    for package in PROJECT:
        for path in sorted((REPO / package).rglob("*.py")):
            name = module_name(path)
            graph[name] = imports_of(path.read_text(encoding="utf-8"), name)
    return graph


def test_every_module_keeps_the_layering():
    graph = product_modules()
    problems = [p for name, imported in graph.items() for p in violations(name, imported)]
    assert not problems, "\n".join(problems)


def test_ops_has_no_import_cycle():
    graph = {
        name: {i for i in imported if top(i) == "ops"}
        for name, imported in product_modules().items()
        if top(name) == "ops"
    }
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle in a directed graph as a path that returns to its start, or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


# ---- the checks themselves must bite --------------------------------------------------


@pytest.mark.parametrize(
    ("module", "source", "complaint"),
    [
        ("policies.fcfs", "from service.engine.scheduler import Scheduler", "a policy imports"),
        ("policies.fcfs", "def f():\n    import torch", "a policy imports torch"),
        ("gpu_worker.runner", "from policies.base import View", "the worker imports"),
        ("service.engine.engine", "from gpu_worker.sampler import Sampler", "worker internals"),
        ("service.engine.engine", "from gpu_worker import runner", "worker internals"),
        ("service.cli", "def f():\n    from ops.bench import main", "imports the tooling"),
    ],
)
def test_a_broken_rule_is_reported(module, source, complaint):
    problems = violations(module, imports_of(source, module))
    assert any(complaint in p for p in problems), problems


def test_allowed_imports_are_not_reported():
    source = "from gpu_worker.protocol import StepPlan\nfrom policies.base import View\n"
    assert violations("service.engine.scheduler", imports_of(source)) == []
    assert violations("ops.bench", imports_of("from service.config import Config")) == []


def test_a_cycle_is_found_and_a_tree_is_not():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
