"""Small modules: no product source file passes 450 lines (generated code aside), and the
engine's step body stays a short pipeline (docs/architecture.md, "The step")."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("gateway", "worker", "kernels", "common", "clients/python")
LIMIT = 450
STEP_LIMIT = 40


def _generated(path: Path) -> bool:
    return path.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")) or "_proto" in path.parts


def _sources() -> list[Path]:
    return [p for f in FOLDERS for p in sorted((ROOT / f).rglob("*.py")) if not _generated(p)]


def _too_long(paths: list[Path]) -> dict[str, int]:
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in paths}
    return {name: n for name, n in lengths.items() if n > LIMIT}


def test_no_source_file_passes_the_limit() -> None:
    paths = _sources()
    assert len(paths) > 100, "the product's sources were not found"
    assert not _too_long(paths), _too_long(paths)


def test_the_check_sees_a_long_file(tmp_path: Path) -> None:
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * (LIMIT + 1))
    short = tmp_path / "short.py"
    short.write_text("x = 1\n" * LIMIT)
    lengths = {p.name: len(p.read_text().splitlines()) for p in (long, short)}
    assert {k for k, v in lengths.items() if v > LIMIT} == {"long.py"}


def _step_body_lines(source: str) -> int:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "LLMEngine":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "_step":
                    first = item.body[0]
                    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                        first = item.body[1]  # the docstring is not the body
                    assert item.end_lineno is not None
                    return item.end_lineno - first.lineno + 1
    raise AssertionError("LLMEngine._step not found")


def test_the_step_body_is_a_short_pipeline() -> None:
    n = _step_body_lines((ROOT / "worker/engine/llm_engine.py").read_text())
    assert 5 < n <= STEP_LIMIT, n


def test_the_step_check_counts_the_body() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(STEP_LIMIT + 1))
    source = f'class LLMEngine:\n    def _step(self):\n        """doc"""\n{body}\n'
    assert _step_body_lines(source) == STEP_LIMIT + 1
