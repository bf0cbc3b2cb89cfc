"""A managed API key: its record, and its secret, which exists in clear only once, in the answer
that creates it.

The secret is ``sk-tg-`` plus 43 url-safe characters of ``secrets.token_urlsafe(32)`` (256 random
bits). Stores keep only its SHA-256, in hex. A keyed hash (HMAC with a server-side pepper) or a
slow hash (argon2, bcrypt) protects *guessable* secrets from someone who has read the store; a
256-bit random secret cannot be guessed from its hash, so a plain SHA-256 is as strong here, needs
no pepper to keep and share between processes, and lets a presented key be found by an index
lookup of its hash (so no per-key comparison whose timing could depend on the secret). The record
keeps the secret's last four characters (``hint``) so people can tell their keys apart.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

PREFIX = "sk-tg-"


def new_secret() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_key_id() -> str:
    return "key_" + secrets.token_hex(8)


@dataclass(frozen=True)
class KeyRecord:
    """A managed key as stored (without its secret). ``limits`` holds only the fields this key
    sets over its tier's defaults; ``models`` None means the tier's allow-list."""

    id: str
    name: str
    tier: str
    hash: str  # SHA-256 of the secret, hex
    hint: str  # the secret's last four characters
    created_at: int
    limits: dict[str, Any] = field(default_factory=dict)
    models: tuple[str, ...] | None = None
    adapters: tuple[str, ...] | None = None  # adapter patterns; None: the tier's allow-list
    revoked_at: int | None = None
    version: int = 0  # the store's change counter when this record last changed

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def doc(self) -> dict[str, Any]:
        """The record as stored (hash included)."""
        d = asdict(self)
        d["models"] = list(self.models) if self.models is not None else None
        d["adapters"] = list(self.adapters) if self.adapters is not None else None
        d.pop("version")
        return d

    @classmethod
    def of(cls, doc: dict[str, Any], version: int = 0) -> "KeyRecord":
        models, adapters = doc.get("models"), doc.get("adapters")
        return cls(**{**doc, "models": tuple(models) if models is not None else None,
                      "adapters": tuple(adapters) if adapters is not None else None, "version": version})

    def public(self) -> dict[str, Any]:
        """What the admin API shows: never the hash."""
        return {"id": self.id, "object": "api_key", "name": self.name, "tier": self.tier,
                "redacted_value": f"{PREFIX}...{self.hint}", "created_at": self.created_at,
                "limits": dict(self.limits), "models": list(self.models) if self.models is not None else None,
                "adapters": list(self.adapters) if self.adapters is not None else None,
                "revoked_at": self.revoked_at, "status": "active" if self.active else "revoked"}


def make_key(name: str, tier: str, limits: dict[str, Any] | None = None,
             models: tuple[str, ...] | None = None, adapters: tuple[str, ...] | None = None) -> tuple[KeyRecord, str]:
    """A new record and its secret (to show once)."""
    secret = new_secret()
    record = KeyRecord(new_key_id(), name, tier, secret_hash(secret), secret[-4:], int(time.time()),
                       dict(limits or {}), models, adapters)
    return record, secret
