"""The package's layering, pinned: who may import whom, and no import cycles.

Every import of a gemmactl module counts, at the top of a file or inside a function (a lazy
import is still a dependency); only imports under `if TYPE_CHECKING:` are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gemmactl"

# Lower layers never import higher ones; packages of one layer never import each other
# (the shared ground floor, layer 0, excepted).
LAYERS = {
    "errors": 0, "sizes": 0, "endpoints": 0, "fileio": 0, "machine": 0, "__init__": 0,
    "prompt": 1, "formats": 1,
    "store": 2, "runtime": 2,
    "hub": 3, "llamacpp": 3,
    "plan": 4, "recipes": 4,
    "router": 5,
    "generate": 6,
    "chat": 7,
    "server": 7, "bench": 7,
    "cli": 8, "__main__": 9,
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str) -> set[str]:
    """The gemmactl modules a file imports (resolved to the longest existing module name)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("gemmactl"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gemmactl") and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    modules = _modules()
    resolved = set()
    for name in found:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in modules and name != module:
            resolved.add(name)
    return resolved


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


GRAPH = {module: _imports(path, module) for module, path in _modules().items()}


def test_every_component_has_a_layer():
    assert {_component(module) for module in GRAPH} <= set(LAYERS)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_go_down_the_layers(module):
    mine = _component(module)
    wrong = []
    for imported in sorted(GRAPH[module]):
        theirs = _component(imported)
        if theirs == mine:
            continue
        if LAYERS[theirs] > LAYERS[mine] or (LAYERS[theirs] == LAYERS[mine] and LAYERS[mine] > 0):
            wrong.append(f"{module} ({mine}, layer {LAYERS[mine]}) imports {imported} (layer {LAYERS[theirs]})")
    assert not wrong, "\n".join(wrong)


def test_the_rules_people_rely_on():
    def imports_component(component: str, target: str) -> list[str]:
        return [m for m, deps in GRAPH.items() if _component(m) == component
                for d in deps if _component(d) == target]

    for library in set(LAYERS) - {"cli", "__main__"}:
        assert not imports_component(library, "cli"), f"{library} imports the CLI"
    assert not imports_component("formats", "store")
    assert not imports_component("llamacpp", "bench") and not imports_component("llamacpp", "server")
    assert not imports_component("bench", "server") and not imports_component("server", "bench")
    assert not imports_component("recipes", "llamacpp")


def test_no_import_cycles():
    # Tarjan's strongly connected components over the module graph.
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                connect(nxt)
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
            # A package's __init__ importing its own submodules is not a cycle of behaviour.
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in GRAPH:
        if node not in index:
            connect(node)
    assert not cycles, cycles
