"""The package's imports run one way: no module of ``sinv_prune`` reaches itself through its imports, no
module imports from a package later in :data:`LAYERS`, and no underscore name crosses a package.

The graph is read with ``ast`` from every module's source, module-level and function-level imports
alike (a function-level import only hides a circle until the function runs). ``from pkg import name``
points at ``pkg.name`` when that is a module, else at ``pkg``; a parent package's ``__init__`` that
Python runs on the way is not an edge (every module would otherwise import ``sinv_prune/__init__``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import sinv_prune

PACKAGE = "sinv_prune"
ROOT = Path(sinv_prune.__file__).resolve().parent


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package's ``__init__`` under the package's name)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The dotted name a ``from ... import`` statement imports from, relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(modules: dict[str, Path]) -> Iterator[tuple[str, str, str]]:
    """``(module, source, name)`` for every import anywhere in the modules' source: ``import a.b`` gives
    ``(module, "a.b", "")``, ``from pkg import name`` gives ``(module, pkg, name)`` (relative levels resolved)."""
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                yield from ((module, alias.name, "") for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(node, module, path.name == "__init__.py")
                yield from ((module, source, alias.name) for alias in node.names)


def _target(source: str, name: str, modules: dict[str, Path]) -> str:
    """The module an import points at: ``source.name`` when that is a module, else ``source``."""
    return f"{source}.{name}" if name and f"{source}.{name}" in modules else source


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module, source, name in imports(modules):
        target = _target(source, name, modules)
        if target in modules and target != module:
            graph[module].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules (Tarjan), each as ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle(graph, group) for group in groups]


def _circle(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no circle through {start}")  # a strongly connected group always has one


def test_package_has_no_import_cycles():
    cycles = find_cycles(import_graph(module_files()))
    assert not cycles, "import cycles in sinv_prune: " + "; ".join(" -> ".join(c) for c in cycles)


#: The package's layers, lowest first (docs/design-notes.md, "Package layout"): a module imports from its own
#: layer and those before it only. Each entry names ``sinv_prune``'s top-level modules and packages; ``""``
#: is ``sinv_prune/__init__``.
LAYERS = (
    ("version", "progress", "log_level", "strict_json", "filemodes", "data", "rundir"),
    ("arch",),
    ("symmetry",),
    ("surgery",),
    ("units",),
    ("scoring",),
    ("deploy",),
    ("lmeval",),
    ("hub",),
    ("shrink",),
    ("pipeline",),
    ("cli", "checkpoint", "modeling_sinv_prune"),
    ("",),
)


def top_level(module: str) -> str:
    """``sinv_prune.scoring.criteria.base`` -> ``scoring``; ``sinv_prune`` itself -> ``""``."""
    return module.split(".")[1] if "." in module else ""


def layer(module: str) -> int:
    top = top_level(module)
    found = [i for i, names in enumerate(LAYERS) if top in names]
    assert found, f"{module}: {top!r} is in no layer of LAYERS (tests/test_imports.py); place it there and in the docs"
    return found[0]


def order_violations(modules: dict[str, Path]) -> list[str]:
    """``"a -> b"`` for every import of a module ``b`` in a later layer than ``a``'s."""
    graph = import_graph(modules)
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) > layer(a))


def private_imports(modules: dict[str, Path]) -> list[str]:
    """``"a imports b._name"`` for every underscore name ``a`` imports from another top-level package."""
    found = set()
    for module, source, name in imports(modules):
        target = _target(source, name, modules)
        crosses = target in modules and top_level(target) != top_level(module)
        if crosses and name.startswith("_") and not name.endswith("__"):
            found.add(f"{module} imports {source}.{name}")
    return sorted(found)


def test_imports_follow_the_layers():
    wrong = order_violations(module_files())
    assert not wrong, f"{len(wrong)} imports from a later layer (LAYERS, docs/design-notes.md): " + "; ".join(wrong)


def test_no_private_name_crosses_a_package():
    wrong = private_imports(module_files())
    assert not wrong, f"{len(wrong)} underscore names imported across packages: " + "; ".join(wrong)


def test_walk_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from ..c import thing\n")
    (pkg / "c.py").write_text("import pkg.a\nthing = 1\n")
    graph = import_graph(module_files(pkg, "pkg"))
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": set()}, []),
        ({"a": {"b"}, "b": {"a"}}, [["a", "b", "a"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}}, [["d", "e", "d"], ["a", "b", "c", "a"]]),
    ],
)
def test_find_cycles_names_each_circle(edges, expected):
    assert find_cycles(edges) == expected
