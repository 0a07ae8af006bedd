"""Cache salts (issue 26): one per API key under scope ``key``, the same for every key under
``shared`` and without API keys; a salt reveals nothing of its key, and gateways that share the
internal secret give a key the same salt."""

from __future__ import annotations

import pytest

from draftwise.gateway.config import GatewayConfig
from draftwise.gateway.tenancy import CacheSalts, bearer_key, metadata_key


def test_scope_key_salts_each_key_apart_and_alike_across_replicas():
    a, b = CacheSalts("key", keyed=True, secret="s3cret"), CacheSalts("key", keyed=True, secret="s3cret")
    salt = a.for_key("sk-alice")
    assert salt == b.for_key("sk-alice") != a.for_key("sk-bob")
    assert len(salt) == 64 and "alice" not in salt
    assert CacheSalts("key", keyed=True, secret="other").for_key("sk-alice") != salt
    # without an internal secret: a random one per process
    assert CacheSalts("key", keyed=True).for_key("sk-alice") != CacheSalts("key", keyed=True).for_key("sk-alice")


def test_shared_scope_and_keyless_gateways_share_one_cache():
    assert CacheSalts("shared", keyed=True, secret="s").for_key("sk-alice") == ""
    assert CacheSalts("key", keyed=False, secret="s").for_key("sk-alice") == ""
    assert CacheSalts("key", keyed=True, secret="s").for_key(None) == ""


def test_keys_are_read_from_bearer_credentials():
    assert bearer_key("Bearer sk-1 ") == "sk-1"
    assert bearer_key(b"bearer sk-2") == "sk-2"
    assert bearer_key("Basic abc") is None and bearer_key("Bearer ") is None and bearer_key(None) is None
    assert metadata_key((("x", "y"), ("authorization", "Bearer k"))) == "k"
    assert metadata_key(None) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("routing", "round-robin"), ("prefix_cache_scope", "tenant"), ("prefix_routing_bytes", 0)],
)
def test_config_refuses_unknown_policies(field: str, value: object):
    with pytest.raises(ValueError, match=field):
        GatewayConfig(**{field: value})  # type: ignore[arg-type]
