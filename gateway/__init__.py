"""The asyncio gRPC gateway. It never imports torch or ``draftwise.worker``.

    from draftwise.gateway import Gateway, GatewayConfig
    gateway = Gateway(GatewayConfig(port=50051, workers=("127.0.0.1:50061",)))
    await gateway.start(); ...; await gateway.stop()

Modules: ``config`` (GatewayConfig), ``server`` (Gateway: gRPC server, health, reflection,
TLS), ``service`` and ``bidi`` (GenerateService), ``relay`` (one request to a worker),
``streams`` (bounded coalescing queues: backpressure), ``router`` (worker load and
routing), ``admission``, ``auth`` (API keys), ``metrics`` (Prometheus), ``launcher``
(``draftwise serve``), ``main`` (``python -m draftwise.gateway``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from draftwise.gateway.config import GatewayConfig
    from draftwise.gateway.server import Gateway

__all__ = ["Gateway", "GatewayConfig"]


def __getattr__(name: str) -> Any:  # lazy: importing the package stays cheap
    if name == "Gateway":
        from draftwise.gateway.server import Gateway

        return Gateway
    if name == "GatewayConfig":
        from draftwise.gateway.config import GatewayConfig

        return GatewayConfig
    raise AttributeError(f"module 'draftwise.gateway' has no attribute {name!r}")
