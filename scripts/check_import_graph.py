"""Check that a plain import-graph tool reads the product: grimp (the graph library behind
import-linter) builds the graph of ``draftwise`` from the strict editable install that
``.ci/run`` makes in ``.venv-types`` (a tree of links to the source files), and every
``draftwise.*`` import in the source, inside functions too, resolves to one of its modules.

    .venv-types/bin/python scripts/check_import_graph.py

Exits 1 naming what did not resolve (an ordinary editable install maps the folders with an
import hook that no static tool follows: run it under the strict install)."""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "draftwise"


def source_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> source file, for every package pyproject.toml lists (folders from its
    package-dir map)."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dirs: dict[str, str] = setuptools["package-dir"]
    out: dict[str, Path] = {}
    for name in setuptools["packages"]:
        base = max((p for p in package_dirs if name == p or name.startswith(p + ".")), key=len)
        folder = root / package_dirs[base] / Path(*name[len(base) :].split(".")[1:])
        for py in sorted(folder.glob("*.py")):
            out[name if py.stem == "__init__" else f"{name}.{py.stem}"] = py
    return out


def imported_names(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every ``draftwise`` import in a file, relative ones resolved; for
    ``from X import a`` both ``X.a`` and ``X`` are candidates, so the name yielded is ``X.a``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == PACKAGE:
                    yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if base.split(".")[0] == PACKAGE:
                for a in node.names:
                    yield node.lineno, f"{base}.{a.name}"


def unresolved(imports: Iterable[tuple[str, int, str]], modules: set[str]) -> list[str]:
    """The imports (file, line, name) whose module is not in ``modules``: a name resolves when it
    is a module, or when its parent is (``from module import attribute``)."""
    return [
        f"{file}:{line}: {name}"
        for file, line, name in imports
        if name not in modules and name.rpartition(".")[0] not in modules
    ]


def main() -> int:
    import grimp

    graph = grimp.build_graph(PACKAGE, include_external_packages=False)
    found = set(graph.modules)
    sources = source_modules()
    missing = sorted(set(sources) - found)
    imports = [
        (str(path.relative_to(ROOT)), line, name)
        for module, path in sources.items()
        for line, name in imported_names(path, module)
    ]
    bad = unresolved(imports, found)
    edges = sum(len(graph.find_modules_directly_imported_by(m)) for m in found)
    if missing or bad or not edges:
        print(f"the import graph of {PACKAGE} read by grimp ({len(found)} modules, {edges} imports) misses:")
        for m in missing:
            print(f"  module {m} ({sources[m].relative_to(ROOT)})")
        for b in bad:
            print(f"  import {b}")
        return 1
    print(f"import graph: {len(found)} modules, {edges} imports; all {len(imports)} draftwise imports resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
