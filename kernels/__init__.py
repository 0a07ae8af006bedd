"""Hot ops (attention, KV-cache writes, RMSNorm) behind one dispatch point.

Each op has a torch reference twin; faster implementations register in
``draftwise.kernels.dispatch`` for the device types they serve.
"""

from __future__ import annotations

from draftwise.kernels.attention import AttentionBackend, get_attention_backend
from draftwise.kernels.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
