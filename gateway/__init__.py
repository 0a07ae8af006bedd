"""The asyncio gRPC gateway. It never imports torch or ``draftwise.worker``."""

from __future__ import annotations
