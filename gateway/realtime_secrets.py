"""Client secrets for the Realtime API (``POST /v1/realtime/client_secrets``): a short-lived key a
server hands to a browser, so that the browser opens a realtime session without holding the
server's own key.

A secret is ``ek_`` and 43 random characters. It stands for the key that made it (its tier,
limits and usage: the sessions it opens are metered to that key), as that key stands when a
session opens (it keeps the key's id, never the key: a key taken out of its file or revoked stops
its secrets, and a key moved to another tier takes their sessions there), and for the session
settings it was made with, checked when it was made. It opens any number of sessions until it
expires (10 s to 2 h after it was made, 10 minutes by default, as OpenAI's), or until the key
that made it has made ``ClientSecrets.max_per_key`` (10,000) newer ones, or newer ones whose
settings fill ``ClientSecrets.max_bytes_per_key`` (32 MiB, as the requests that made them
measured them: a request may be 25 MiB, and 10,000 of those held in memory would be 250 GB). It
opens realtime sessions only: presented to any other endpoint, it is an unknown key. Secrets live
in this process's memory and are kept by the SHA-256 of their value, so a lookup's time does not depend on how much of a
presented secret matches, and a memory dump does not hold them.
"""

from __future__ import annotations

import hashlib
import heapq
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.auth import Caller
from gateway.origin import CLIENT_SECRET, tagged

PREFIX = CLIENT_SECRET
DEFAULT_S, MIN_S, MAX_S = 600, 10, 7200
MAX_BYTES_PER_KEY = 32 * 2**20  # the settings a key's unexpired secrets hold, all together (their requests' bytes)


@dataclass(frozen=True)
class Secret:
    key_id: str  # the key that made it: its id, looked up again when the secret opens a session
    expires_at: float
    session: Any  # what a session it opens starts as (gateway.realtime_conversation makes and reads it)
    size: int = 0  # the bytes of the request that made it: what its settings hold, counted against the key's bound


class ClientSecrets:
    """The secrets issued by this process, until they expire: at most ``max_per_key`` for each
    key, and ``max_bytes_per_key`` of their settings, that key's own oldest dropped first when it
    makes another past either (one key making many voids none of another key's). Expiry is swept
    in expiry order (a heap), so a mint costs the secrets that expired since the last one, not a
    walk over all of them."""

    def __init__(self, clock: Callable[[], float] = time.time, max_per_key: int = 10_000, origin: str = "",
                 max_bytes_per_key: int = MAX_BYTES_PER_KEY) -> None:
        """``origin``: the cluster replica that makes the secrets (``gateway.origin``)."""
        self.clock, self.max_per_key, self.origin = clock, max_per_key, origin
        self.max_bytes_per_key = max_bytes_per_key
        self._by_hash: dict[bytes, Secret] = {}
        self._of_key: dict[str, dict[bytes, None]] = {}  # each key's secrets' hashes, in issue order
        self._bytes: dict[str, int] = {}  # each key's secrets' sizes, summed
        self._expiring: list[tuple[float, bytes]] = []  # a heap by expiry; entries of dropped secrets are skipped

    def issue(self, caller: Caller, seconds: int, session: Any, size: int = 0) -> tuple[str, Secret]:
        """A new secret of ``caller``'s key for ``seconds``, opening sessions set as ``session``,
        which the ``size`` bytes of its request made."""
        self._expire()
        own = self._of_key.get(caller.key_id, {})
        while own and (len(own) >= self.max_per_key or self._bytes[caller.key_id] + size > self.max_bytes_per_key):
            self._drop(next(iter(own)))
        value = tagged(PREFIX, self.origin, secrets.token_urlsafe(32))
        secret, digest = Secret(caller.key_id, self.clock() + seconds, session, size), _hash(value)
        self._by_hash[digest] = secret
        self._of_key.setdefault(caller.key_id, {})[digest] = None
        self._bytes[caller.key_id] = self._bytes.get(caller.key_id, 0) + size
        heapq.heappush(self._expiring, (secret.expires_at, digest))
        if len(self._expiring) > 2 * len(self._by_hash) + 1024:  # mostly dropped ones: rebuilt, amortized O(1)
            self._expiring = [(s.expires_at, h) for h, s in self._by_hash.items()]
            heapq.heapify(self._expiring)
        return value, secret

    def redeem(self, value: str) -> Secret | None:
        """The secret ``value`` names while it is valid; else None."""
        secret = self._by_hash.get(_hash(value))
        return secret if secret is not None and secret.expires_at > self.clock() else None

    def __len__(self) -> int:
        return len(self._by_hash)

    def _expire(self) -> None:
        now = self.clock()
        while self._expiring and self._expiring[0][0] <= now:
            self._drop(heapq.heappop(self._expiring)[1])

    def _drop(self, digest: bytes) -> None:
        secret = self._by_hash.pop(digest, None)
        if secret is None:
            return  # dropped already (its key made too many)
        own = self._of_key[secret.key_id]
        del own[digest]
        self._bytes[secret.key_id] -= secret.size
        if not own:
            del self._of_key[secret.key_id]
            del self._bytes[secret.key_id]


def _hash(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()
