"""The product's import structure, read from the source with the package map of
``pyproject.toml``:

- no import cycles: every ``import``/``from ... import`` at module level (type-checking-only
  imports included; imports inside functions are lazy by design and not counted) forms an
  acyclic graph;
- layers: every import, inside functions too, keeps the worker off the gateway, the gateway off
  the worker and torch, and the kernels off both."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGE_DIRS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"
]  # import name -> folder
TOP = {"draftwise", "draftwise.worker", "draftwise.gateway", "draftwise.kernels"}
FOLDERS = {folder: name for name, folder in PACKAGE_DIRS.items() if name in TOP}
LAYERS = {  # importer prefix -> prefixes it must never import
    "draftwise.worker": ("draftwise.gateway",),
    "draftwise.gateway": ("draftwise.worker", "torch"),
    "draftwise.kernels": ("draftwise.worker", "draftwise.gateway"),
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


def _targets(node: ast.Import | ast.ImportFrom, package: str, mods: dict[str, Path]) -> list[str]:
    """The modules (or names) an import statement reads, relative imports resolved."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def _package(mod: str, path: Path) -> str:
    return mod if path.name == "__init__.py" else mod.rpartition(".")[0]


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in _top_level_imports(ast.parse(path.read_text())):
            assert isinstance(node, ast.Import | ast.ImportFrom)
            graph[mod].update(t for t in _targets(node, _package(mod, path), mods) if t in mods and t != mod)
    return graph


def _layer_violations(sources: dict[str, tuple[Path, str]], mods: dict[str, Path]) -> list[str]:
    """Every import anywhere in a module (functions included) that crosses a layer."""
    out = []
    for mod, (path, text) in sources.items():
        banned = next((b for prefix, b in LAYERS.items() if mod == prefix or mod.startswith(prefix + ".")), ())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for t in _targets(node, _package(mod, path), mods):
                    if any(t == b or t.startswith(b + ".") for b in banned):
                        out.append(f"{mod}:{node.lineno} imports {t}")
    return out


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


def test_the_package_map_is_pyprojects():
    assert FOLDERS == {
        "common": "draftwise",
        "worker": "draftwise.worker",
        "gateway": "draftwise.gateway",
        "kernels": "draftwise.kernels",
    }
    assert len(_modules()) > 80


def test_no_import_crosses_a_layer():
    mods = _modules()
    found = _layer_violations({m: (p, p.read_text()) for m, p in mods.items()}, mods)
    assert not found, found


def test_a_planted_function_level_import_across_layers_is_found():
    mods = _modules()
    path = ROOT / "worker" / "serving" / "planted.py"
    planted = "def build():\n    from draftwise.gateway.main import add_gateway_args\n    return add_gateway_args\n"
    found = _layer_violations({"draftwise.worker.serving.planted": (path, planted)}, mods)
    assert found == ["draftwise.worker.serving.planted:2 imports draftwise.gateway.main"], found
    relative = "def f():\n    from ...gateway import relay\n"
    found = _layer_violations({"draftwise.worker.serving.planted": (path, relative)}, mods)
    assert found == ["draftwise.worker.serving.planted:2 imports draftwise.gateway.relay"], found
    torch_in_gateway = "import os\ndef f():\n    import torch.nn\n"
    found = _layer_violations({"draftwise.gateway.planted": (ROOT / "gateway" / "planted.py", torch_in_gateway)}, mods)
    assert found == ["draftwise.gateway.planted:3 imports torch.nn"], found


WORKER_PACKAGES = ("core", "engine", "model", "parallel", "sampling", "serving", "speculative", "text")


def _worker_package(mod: str) -> str | None:
    parts = mod.split(".")
    if parts[:2] == ["draftwise", "worker"] and len(parts) > 3 and parts[2] in WORKER_PACKAGES:
        return parts[2]
    return None


def _package_graph(sources: dict[str, tuple[Path, str]], mods: dict[str, Path]) -> dict[str, set[str]]:
    """Worker subpackage -> the worker subpackages its modules import (anywhere in a module:
    module level, type checking and inside functions)."""
    graph: dict[str, set[str]] = {p: set() for p in WORKER_PACKAGES}
    for mod, (path, text) in sources.items():
        src = _worker_package(mod)
        if src is None:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for t in _targets(node, _package(mod, path), mods):
                    dst = _worker_package(t if t in mods else t + ".x")
                    if dst is not None and dst != src:
                        graph[src].add(dst)
    return graph


def test_no_cycle_between_worker_packages():
    mods = _modules()
    assert {p.name for p in (ROOT / "worker").iterdir() if (p / "__init__.py").is_file()} == set(WORKER_PACKAGES)
    graph = _package_graph({m: (p, p.read_text()) for m, p in mods.items()}, mods)
    assert {"core", "speculative", "text"} <= graph["engine"]  # the check sees real arrows
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_a_planted_package_cycle_is_found():
    mods = _modules()
    sources = {m: (p, p.read_text()) for m, p in mods.items()}
    planted = "def f():\n    from draftwise.worker.engine.llm_engine import LLMEngine\n"
    sources["draftwise.worker.core.planted"] = (ROOT / "worker" / "core" / "planted.py", planted)
    cycle = _cycle(_package_graph(sources, mods))
    assert cycle is not None and "core" in cycle and "engine" in cycle, cycle
