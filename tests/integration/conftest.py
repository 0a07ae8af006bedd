"""Processes shared by the integration tests: two real workers of the embedded default
model and a gateway in front of them, started once per session and always killed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.procs import ENGINE_KWARGS, Proc, start_gateway, start_workers


@pytest.fixture(scope="session")
def proc_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("procs")


@pytest.fixture(scope="session")
def workers(proc_dir: Path) -> Iterator[list[Proc]]:
    procs = start_workers(2, proc_dir)
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="session")
def gateway(workers: list[Proc], proc_dir: Path) -> Iterator[Proc]:
    # resumption off: a cancelled call aborts its requests at once (test_cancel checks the KV is freed)
    g = start_gateway(workers, proc_dir, "gateway", "--max-in-flight=256", "--resume-retention-s=0")
    yield g
    g.stop()


@pytest.fixture(scope="session")
def reference_llm():
    """The offline engine with the workers' settings (see ``reference_outputs``)."""
    from draftwise.worker import LLM

    return LLM(**ENGINE_KWARGS)


def reference_outputs(llm, prompts, params):
    """Offline greedy outputs, computed on one thread like the workers."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        torch.set_num_threads(threads)
