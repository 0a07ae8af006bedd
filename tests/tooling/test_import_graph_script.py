"""scripts/check_import_graph.py (run by .ci/run under the strict install) finds what a plain
import-graph tool must resolve, and reports an import it cannot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_import_graph", ROOT / "scripts" / "check_import_graph.py")
assert spec is not None and spec.loader is not None
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def test_every_listed_package_maps_to_its_files() -> None:
    mods = script.source_modules()
    assert mods["draftwise.worker.engine.llm_engine"] == ROOT / "worker/engine/llm_engine.py"
    assert mods["draftwise.gateway.openai"] == ROOT / "gateway/openai/__init__.py"
    assert mods["draftwise.cli.main"] == ROOT / "common/cli/main.py"
    assert mods["draftwise.v1.generation_pb2"] == ROOT / "proto/draftwise/v1/generation_pb2.py"
    assert len(mods) > 100


def test_relative_and_function_level_imports_are_read(tmp_path: Path) -> None:
    f = tmp_path / "mod.py"
    f.write_text(
        "from . import sibling\nfrom ..engine.request import Request\ndef f():\n    import draftwise.gateway.x\n"
    )
    names = [n for _, n in script.imported_names(f, "draftwise.worker.text.mod")]
    assert names == ["draftwise.worker.text.sibling", "draftwise.worker.engine.request.Request", "draftwise.gateway.x"]


def test_an_import_of_no_module_is_reported() -> None:
    modules = {"draftwise", "draftwise.worker", "draftwise.worker.engine", "draftwise.worker.core.request"}
    imports = [
        ("a.py", 1, "draftwise.worker.core.request.Request"),  # attribute of a module: resolves
        ("a.py", 2, "draftwise.worker.engine"),
        ("b.py", 3, "draftwise.worker.nowhere.thing"),  # neither it nor its parent is a module
    ]
    assert script.unresolved(imports, modules) == ["b.py:3: draftwise.worker.nowhere.thing"]
