"""draftwise: an LLM inference server with speculative decoding.

Subpackages: ``draftwise.worker`` (engine, models), ``draftwise.kernels`` (attention and
other hot ops behind one dispatch point), ``draftwise.gateway`` (the gRPC front).
"""

from __future__ import annotations

import os
import sys

__version__ = "0.1.0"


def _is_source_checkout(entry: str) -> bool:
    folder = os.path.abspath(entry or os.curdir)
    return all(
        os.path.isfile(os.path.join(folder, *part))
        for part in (("pyproject.toml",), ("common", "__init__.py"), ("kernels", "__init__.py"))
    )


def _source_checkout_last() -> None:
    """Move a draftwise source checkout behind the installed packages on ``sys.path``.

    The checkout's folders install under ``draftwise.*`` (``kernels/`` is ``draftwise.kernels``) and are
    never import names of their own; but ``python -m``, ``python -c`` and pytest run from the checkout put
    it first on ``sys.path``, where ``kernels/`` hides Hugging Face's ``kernels`` package, which
    transformers (5.25 and later depend on it) imports: every tokenizer load then failed with
    "cannot import name 'CUDAProperties' from 'kernels'". Behind the installed packages the checkout
    still serves what only it has (the tests' ``tests`` package)."""
    checkout = [entry for entry in sys.path if _is_source_checkout(entry)]
    if checkout:
        sys.path[:] = [entry for entry in sys.path if entry not in checkout] + checkout


_source_checkout_last()

GOMP_SPINCOUNT = "10000"
"""How long PyTorch's OpenMP threads (libgomp) spin after a parallel region before they sleep, unless the
environment says otherwise: 10,000 spins rather than libgomp's default 300,000 (milliseconds on a Zen 4, whose
pause instruction takes tens of cycles). The CPU kernel library's products run on its own thread pool (worker/model/cpu_pool.cpp);
between them a prompt chunk runs torch ops (attention of long chunks, silu), after each of which a libgomp
thread kept spinning on the core a product's second thread needed: a 256-token SmolLM2-135M prefill took
~440 ms, ~280 ms with 10,000 spins (~300 ms with none at all: OMP_WAIT_POLICY=PASSIVE), and 32 concurrent
requests in one process went 1.10x faster (docs/benchmarks.md; `serve`'s worker already escaped it: its engine
thread gives libgomp more threads than cores, and libgomp then stops spinning by itself). libgomp reads it once,
when torch loads it: so it is set here, on importing draftwise, only when torch is not imported yet; the worker
processes inherit it."""


def _quiet_openmp_spin() -> None:
    if "torch" not in sys.modules:
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)


_quiet_openmp_spin()
