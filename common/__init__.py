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
