"""The engine step's shape, checked on the source: one module writes a request's progress, and
no phase takes a callback into the engine (docs/architecture.md, "The step")."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "worker"
CALLBACK_PARAMS = {"emit", "on_finish", "on_release", "fail"}


def _trees() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(WORKER.rglob("*.py"))]


def _assigned_attrs(tree: ast.AST, attr: str) -> int:
    n = 0
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        while any(isinstance(t, ast.Tuple | ast.List | ast.Starred) for t in targets):
            targets = [
                x
                for t in targets
                for x in (
                    t.elts if isinstance(t, ast.Tuple | ast.List) else [t.value] if isinstance(t, ast.Starred) else [t]
                )
            ]
        n += sum(isinstance(t, ast.Attribute) and t.attr == attr for t in targets)
    return n


def test_num_computed_tokens_is_assigned_in_one_module() -> None:
    writers = {p.relative_to(ROOT).as_posix() for p, t in _trees() if _assigned_attrs(t, "num_computed_tokens")}
    assert writers == {"worker/core/scheduler.py"}, writers


def test_the_check_sees_an_assignment_elsewhere() -> None:
    planted = ast.parse("def f(r):\n    r.num_computed_tokens += 1\n    r.x, r.num_computed_tokens = 1, 2\n")
    assert _assigned_attrs(planted, "num_computed_tokens") == 2
    assert _assigned_attrs(ast.parse("r.num_computed_tokens = 0"), "num_computed_tokens") == 1


def test_no_phase_takes_a_callback_into_the_engine() -> None:
    found = []
    for p, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                found += [f"{p.relative_to(ROOT)}:{node.name}({a.arg})" for a in args if a.arg in CALLBACK_PARAMS]
    assert not found, found
