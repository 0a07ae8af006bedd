"""The CPU kernel library's own thread pool (worker/model/cpu_pool.cpp): one pool whatever thread calls
(the regression it replaced: libgomp gave each calling thread a team of its own and then stopped spinning,
and a decode step on the engine's thread ran at half speed), the same results from any thread and from two
threads at once, a forked child that computes instead of waiting for workers it does not have, and no
OpenMP runtime linked."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest
import torch

from draftwise.worker.model import cpu_matmul


@pytest.fixture
def lib():
    lib = cpu_matmul.kernel()
    assert lib is not None, cpu_matmul.unavailable_reason()  # it builds on this machine: never skip
    return lib


def _product(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(512, 256, generator=g)
    x = torch.randn(3, 256, generator=g)
    return x, cpu_matmul.pack(w), x @ w.T


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(60)
    assert not t.is_alive()
    return out[0]


def test_one_pool_whatever_thread_calls(lib, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    x, panels, _ = _product()
    main = cpu_matmul.matmul(x, panels)
    workers = lib.dw_pool_workers()
    assert workers >= 2  # three parts: the caller and two workers
    other = _in_thread(lambda: cpu_matmul.matmul(x, panels))
    assert torch.equal(main, other)
    assert lib.dw_pool_workers() == workers  # no second team for the second thread


def test_two_threads_at_once_get_their_own_results(lib, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    cases = [_product(seed) for seed in range(4)]
    want = [cpu_matmul.matmul(x, p) for x, p, _ in cases]
    got: dict[int, list[torch.Tensor]] = {}

    def run(i: int) -> None:
        x, p, _ = cases[i]
        got[i] = [cpu_matmul.matmul(x, p) for _ in range(200)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    for i, results in got.items():
        assert all(torch.equal(r, want[i]) for r in results)
    for (_, _, exact), w in zip(cases, want, strict=True):
        torch.testing.assert_close(w, exact, rtol=1e-4, atol=1e-4)


def test_a_forked_child_computes_without_the_parents_workers(lib, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    x, panels, _ = _product()
    want = cpu_matmul.matmul(x, panels)  # the parent's pool has a worker now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a product on a pool of its own, then out (killed if it hangs waiting for workers)
        signal.alarm(60)
        ok = torch.equal(cpu_matmul.matmul(x, panels), want)
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1" and status == 0
    os.close(read)


def test_the_library_links_no_openmp_runtime(lib):
    path = lib._name  # noqa: SLF001
    needed = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    assert "NEEDED" in needed and "gomp" not in needed and "omp" not in needed.replace("NEEDED", "")
