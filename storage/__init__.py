"""What tiergate's stores share (one SQLite file with its retention sweep, a Redis client, records
that expire, records kept as JSON), importing nothing of tiergate's, so that ``batch``, ``accounts`` and the gateway's
stores of responses, completions and conversations need not import each other for it."""

from typing import Callable, TypeVar

T = TypeVar("T")


def on_backend(spec: str, sqlite: Callable[[], T], redis: Callable[[str], T]) -> T:
    """The store on the backend ``spec`` names (``batch.store`` in tiers.yaml), which every store
    shares: ``"sqlite"`` -> ``sqlite()`` (the batch store's file), a ``redis://`` or ``rediss://``
    URL -> ``redis(url)``; anything else is a ValueError."""
    if spec == "sqlite":
        return sqlite()
    if spec.startswith(("redis://", "rediss://")):
        return redis(spec)
    raise ValueError(f"unknown store {spec!r}: use 'sqlite' or a redis:// URL")
