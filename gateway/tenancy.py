"""Which requests may share the workers' prefix caches: the cache salt.

A prefix cache hit makes a prompt's first token come sooner, so a tenant that can hit another
tenant's cached prefix can learn, from timing alone, what that tenant's prompts begin with. The
gateway therefore gives every request a *cache salt* (``WorkerServiceGenerateRequest.cache_salt``)
that the workers mix into their block hashes: requests with different salts never share a
cached block. By default (``--prefix-cache-scope key``) the salt follows the caller's API key;
``shared`` gives every request the same (empty) salt, for keys that trust each other (one
application's users of a common system prompt, say). A gateway without API keys cannot tell
callers apart: its requests all share.

The salt is an HMAC of the key, so neither a worker nor its logs ever see a key: with the
gateway's internal secret (``--internal-secret-file``, shared by every gateway replica of a
deployment, so that the same key gets the same salt on each of them and after a restart), or
with a random secret of this gateway process when it has none.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable

SALT_CONTEXT = b"draftwise prefix cache salt v1\0"
"""Domain separation: the internal secret keys nothing else this way."""


class CacheSalts:
    """The cache salt of each API key under one gateway's scope."""

    def __init__(self, scope: str, keyed: bool, secret: str = "") -> None:
        """``scope``: "key" or "shared"; ``keyed``: whether the gateway checks API keys;
        ``secret``: the internal secret ("": a random one of this process)."""
        self.per_key = scope == "key" and keyed
        self._secret = secret.encode() if secret else secrets.token_bytes(32)

    def for_key(self, key: str | None) -> str:
        """The salt of requests made with API key ``key`` ("" when they share the one cache)."""
        if not self.per_key or not key:
            return ""
        return hmac.new(self._secret, SALT_CONTEXT + key.encode(), hashlib.sha256).hexdigest()


def bearer_key(value: str | bytes | None) -> str | None:
    """The key of an ``authorization`` value ``Bearer <key>``; None when there is none."""
    if value is None:
        return None
    token = value.decode(errors="replace") if isinstance(value, bytes) else value
    scheme, _, key = token.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


def metadata_key(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The API key a gRPC call carries (its ``authorization: Bearer`` metadata), if any."""
    return bearer_key(next((v for k, v in metadata or () if k == "authorization"), None))
