"""Client secrets for the Realtime API (``POST /v1/realtime/client_secrets``): a short-lived key a
server hands to a browser, so that the browser opens a realtime session without holding the
server's own key.

A secret is ``ek_`` and 43 random characters. It stands for the key that made it (its tier,
limits and usage: the sessions it opens are metered to that key), as that key stands when a
session opens (it keeps the key's id, never the key: a key taken out of its file or revoked stops
its secrets, and a key moved to another tier takes their sessions there), and for the session
settings it was made with, checked when it was made. It opens any number of sessions until it expires (10 s to
2 h after it was made, 10 minutes by default, as OpenAI's). It opens realtime sessions only:
presented to any other endpoint, it is an unknown key. Secrets live in this process's memory and
are kept by the SHA-256 of their value, so a lookup's time does not depend on how much of a
presented secret matches, and a memory dump does not hold them.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.auth import Caller
from gateway.origin import CLIENT_SECRET, tagged

PREFIX = CLIENT_SECRET
DEFAULT_S, MIN_S, MAX_S = 600, 10, 7200


@dataclass(frozen=True)
class Secret:
    key_id: str  # the key that made it: its id, looked up again when the secret opens a session
    expires_at: float
    session: Any  # what a session it opens starts as (gateway.realtime_conversation makes and reads it)


class ClientSecrets:
    """The secrets issued by this process, until they expire (at most ``max_items``, the oldest
    dropped first)."""

    def __init__(self, clock: Callable[[], float] = time.time, max_items: int = 100_000, origin: str = "") -> None:
        """``origin``: the cluster replica that makes the secrets (``gateway.origin``)."""
        self.clock, self.max_items, self.origin = clock, max_items, origin
        self._by_hash: dict[bytes, Secret] = {}  # insertion order is issue order

    def issue(self, caller: Caller, seconds: int, session: Any) -> tuple[str, Secret]:
        self._expire()
        while len(self._by_hash) >= self.max_items:
            del self._by_hash[next(iter(self._by_hash))]
        value = tagged(PREFIX, self.origin, secrets.token_urlsafe(32))
        secret = Secret(caller.key_id, self.clock() + seconds, session)
        self._by_hash[_hash(value)] = secret
        return value, secret

    def redeem(self, value: str) -> Secret | None:
        """The secret ``value`` names while it is valid; else None."""
        secret = self._by_hash.get(_hash(value))
        return secret if secret is not None and secret.expires_at > self.clock() else None

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, s in self._by_hash.items() if s.expires_at <= now]:
            del self._by_hash[key]


def _hash(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()
