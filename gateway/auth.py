"""API keys -> tiers. Keys come from environment variables named in tiers.yaml (or are made up
in demo mode); they are compared in constant time and never logged. Inside the gateway a caller
is known by ``key_id``, a short hash of the key, which is safe to log and to store as an owner.
Managed keys (created at run time, ``gateway.accounts``) are known by their id. A batch line's
caller also carries its :class:`Metering`, the ids its usage is written under."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

ADMIN_ENV = "TIERGATE_KEYS_ADMIN"


@dataclass(eq=False)
class RateState:
    """One HTTP request's rate-limit headers for its key, set when its key's limits admit it and
    sent on its response (``gateway.accounts_api.KeyHeaders``)."""

    headers: dict[str, str] | None = None


@dataclass(eq=False)
class Metering:
    """The ids a batch line's usage is written under, so that the usage store counts it once
    however often the line runs (a retry, or another process's after this one died before it
    recorded the outcome): its k-th usage write (one per serving block: one per choice when
    ``n`` > 1) is ``{line}:{k}`` in every attempt. ``line`` is ``{batch_id}:{index}``."""

    line: str
    written: int = 0

    def next_id(self) -> str:
        self.written += 1
        return f"{self.line}:{self.written - 1}"


@dataclass(frozen=True)
class Caller:
    tier: str
    key_id: str
    admin: bool = False
    rate: RateState | None = field(default=None, compare=False)  # HTTP requests only: their key's limits apply
    metering: Metering | None = field(default=None, compare=False)  # batch lines only: usage counted once


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class KeyRing:
    """Every configured key with its tier. Lookup compares against every key, always."""

    def __init__(self, keys_by_tier: dict[str, list[str]], admin_keys: list[str] = ()) -> None:
        self.top_tier = next(iter(keys_by_tier), None)
        # Each key's caller is made once (a Caller is immutable): an admin key acts at the highest
        # tier when it calls the model API.
        self._entries = [(k.encode(), Caller(tier, key_id(k))) for tier, keys in keys_by_tier.items() for k in keys]
        self._entries += [(k.encode(), Caller(self.top_tier, key_id(k), admin=True)) for k in admin_keys]
        self._by_id: dict[str, Caller] = {}
        for _, caller in self._entries:
            self._by_id.setdefault(caller.key_id, caller)  # the one lookup finds for that key

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, presented: str) -> Caller | None:
        """The caller for ``presented``, or None. Time does not depend on which key matches."""
        given = presented.encode()
        found: Caller | None = None
        for key, caller in self._entries:
            if hmac.compare_digest(key, given) and found is None:
                found = caller
        return found

    def by_id(self, key_id_: str) -> Caller | None:
        """The caller of the configured key whose id is ``key_id_``, or None (no longer in the
        key files: a key's id is not secret, so this is no key lookup)."""
        return self._by_id.get(key_id_)


def demo_keys(tiers: list[str]) -> dict[str, list[str]]:
    """Fresh random keys, one per tier, for demo mode. Never shipped, never reused."""
    return {t: [f"tg-{t}-{secrets.token_urlsafe(18)}"] for t in tiers}


KEY_SUBPROTOCOL = "openai-insecure-api-key."  # a browser's way to send its key (OpenAI's name for it)


def subprotocol_key(scope: dict) -> str | None:
    """The key a browser sends as a WebSocket subprotocol (it cannot set headers on one), as
    OpenAI's: ``openai-insecure-api-key.<key>``."""
    for offered in scope.get("subprotocols", ()):
        if offered.startswith(KEY_SUBPROTOCOL):
            return offered[len(KEY_SUBPROTOCOL):]
    return None


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
