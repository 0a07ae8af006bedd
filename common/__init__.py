"""draftwise: an LLM inference server with speculative decoding.

Subpackages: ``draftwise.worker`` (engine, models), ``draftwise.kernels`` (attention and
other hot ops behind one dispatch point), ``draftwise.gateway`` (the gRPC front).
"""

from __future__ import annotations

__version__ = "0.1.0"
