"""What tiergate's stores share (one SQLite file with its retention sweep, a Redis client, records
that expire, records kept as JSON), importing nothing of tiergate's, so that ``batch``, ``accounts`` and the gateway's
stores of responses, completions and conversations need not import each other for it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Along:
    """Writes that go with a change to a store, in the same atomic step, on the same backend (a
    webhook event's deliveries with the end of the batch or response it tells of:
    ``gateway.webhook_outbox``): ``sqlite`` runs inside the change's transaction, on its
    connection; ``redis`` is commands (each a list of strings) that the change's script runs once
    it has made the change. A change that does not happen writes none of them."""

    sqlite: Callable[[Any], None] | None = None
    redis: tuple[tuple[str, ...], ...] = ()

    def run_sqlite(self, db: Any) -> None:
        if self.sqlite is not None:
            self.sqlite(db)


def along_json(along: Along | None) -> str:
    """``along``'s Redis commands as a script's argument (``storage.redis.ALONG_LUA`` runs them)."""
    return json.dumps([list(c) for c in along.redis] if along is not None else [])


def on_backend(spec: str, sqlite: Callable[[], T], redis: Callable[[str], T]) -> T:
    """The store on the backend ``spec`` names (``batch.store`` in tiers.yaml), which every store
    shares: ``"sqlite"`` -> ``sqlite()`` (the batch store's file), a ``redis://`` or ``rediss://``
    URL -> ``redis(url)``; anything else is a ValueError."""
    if spec == "sqlite":
        return sqlite()
    if spec.startswith(("redis://", "rediss://")):
        return redis(spec)
    raise ValueError(f"unknown store {spec!r}: use 'sqlite' or a redis:// URL")
