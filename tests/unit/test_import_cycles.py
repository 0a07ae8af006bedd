"""No import cycles between the product's modules: every ``import``/``from ... import`` at
module level (type-checking-only imports included; imports inside functions are lazy by
design and not counted) forms an acyclic graph."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
FOLDERS = {
    "common": "draftwise",
    "worker": "draftwise.worker",
    "gateway": "draftwise.gateway",
    "kernels": "draftwise.kernels",
}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, name in FOLDERS.items():
        for py in (ROOT / folder).rglob("*.py"):
            rel = py.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([name, *parts])] = py
    return out


def _top_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """Import statements outside functions (inside ``if``/``try`` blocks too)."""
    found: list[ast.stmt] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for n in nodes:
            if isinstance(n, ast.Import | ast.ImportFrom):
                found.append(n)
            elif isinstance(n, ast.If | ast.Try):
                visit(n.body)
                visit(n.orelse)
                for h in getattr(n, "handlers", []):
                    visit(h.body)

    visit(tree.body)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _top_level_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            graph[mod].update(t for t in targets if t in mods and t != mod)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := dfs(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := dfs(m)):
            return found
    return None


def test_the_graph_is_real():
    graph = _graph()
    assert "draftwise.worker.model.chunk" in graph["draftwise.worker.model.model_runner"]
    assert (
        "draftwise.worker.model.chunk" in graph["draftwise.worker.model.graph_runner"]
    )  # a type-checking import counts
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])
