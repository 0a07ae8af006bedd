"""The dispatch point: the torch twin for every op on CPU, the Triton kernels for CUDA
tensors once registered, and a broken attention module that does not take the others down."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator

import pytest
import structlog
import torch

from draftwise.kernels import dispatch, reference

MINE = ("write_kv_cache", "rms_norm", "rejection_accept")


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict]]:
    """An empty registry for the test, the real one restored afterwards; yields the log
    lines written meanwhile (captured: another test may have pointed structlog at a stream
    that is closed by now)."""
    monkeypatch.setattr(dispatch, "_FAST", {})
    with structlog.testing.capture_logs() as logs:
        yield logs


def test_every_op_has_a_twin_picked_on_cpu() -> None:
    """On CPU every op runs its twin, except RMSNorm, paged attention and the KV write once the
    model is imported: the model registers the CPU kernel library's (each falls back to the twin
    itself where it does not apply: tests/model/test_cpu_ops.py, test_cpu_attention.py)."""
    from draftwise.worker.model import cpu_attention, cpu_matmul, llama  # noqa: F401 - registers them for CPU

    assert set(MINE) | {"paged_attention"} == set(dispatch.OPS)
    library = {
        "rms_norm": cpu_matmul.rms_norm,
        "paged_attention": cpu_attention.paged_attention,
        "write_kv_cache": cpu_attention.write_kv_cache,
    }
    for op in dispatch.OPS:
        if op in library:
            assert dispatch.backend_name(op, "cpu") == "draftwise-cpu"
            assert dispatch.impl(op, "cpu") is library[op]
        else:
            assert dispatch.backend_name(op, "cpu") == "torch"
            assert dispatch.impl(op, "cpu") is getattr(reference, op)
        assert dispatch.impl(op, torch.device("cpu"), prefer_reference=True) is getattr(reference, op)


def test_register_triton_serves_cuda_tensors_only(fresh_registry: list[dict]) -> None:
    from draftwise.kernels import triton_ops

    registered = dispatch.register_triton()
    assert set(MINE) <= set(registered)
    for op in MINE:
        assert dispatch.backend_name(op, "cuda") == "triton"
        assert dispatch.backend_name(op, "cuda:0") == "triton"
        assert dispatch.impl(op, "cuda") is getattr(triton_ops, op)
        assert dispatch.impl(op, "cuda", prefer_reference=True) is getattr(reference, op)
        assert dispatch.backend_name(op, "cuda", prefer_reference=True) == "torch"
        assert dispatch.backend_name(op, "cpu") == "torch"
        assert dispatch.impl(op, "cpu") is getattr(reference, op)
    # paged attention comes from its own module; registered exactly when that module imports
    has_attention = importlib.util.find_spec("draftwise.kernels.triton_attention") is not None
    if not has_attention:
        assert "paged_attention" not in registered
    attention = "triton" if "paged_attention" in registered else "torch"
    assert dispatch.backend_name("paged_attention", "cuda") == attention
    assert dispatch.backend_name("paged_attention", "cpu") == "torch"


def test_register_triton_skips_a_broken_attention_module(
    fresh_registry: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "draftwise.kernels.triton_attention", None)  # import raises ImportError
    registered = dispatch.register_triton()
    assert registered == MINE
    assert dispatch.backend_name("paged_attention", "cuda") == "torch"
    assert [e["event"] for e in fresh_registry] == ["triton paged attention unavailable; using the torch twin"]
    assert all(dispatch.backend_name(op, "cuda") == "triton" for op in MINE)


def test_register_triton_without_triton_registers_nothing(
    fresh_registry: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "draftwise.kernels.triton_ops", None)
    assert dispatch.register_triton() == ()
    assert [e["log_level"] for e in fresh_registry] == ["warning"]
    assert all(dispatch.backend_name(op, "cuda") == "torch" for op in dispatch.OPS)


def test_unknown_ops_raise() -> None:
    for call in (
        lambda: dispatch.impl("nope", "cpu"),
        lambda: dispatch.backend_name("nope", "cuda"),
        lambda: dispatch.register("nope", "cuda", "triton", reference.rms_norm),
    ):
        with pytest.raises(ValueError, match="unknown op"):
            call()
