"""Model code (our own), reading the paged KV cache."""

from __future__ import annotations
