"""OpenAI-compatible HTTP on the gateway (``--http-port``): ``/v1/models``,
``/v1/completions`` and ``/v1/chat/completions``, streaming (server-sent events) or not,
over the same routing, admission, API keys and metrics as gRPC. See docs/openai.md."""

from __future__ import annotations

from draftwise.gateway.openai.server import OpenAIServer, start_openai_server

__all__ = ["OpenAIServer", "start_openai_server"]
