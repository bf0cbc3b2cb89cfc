"""The PNGs behind images' ``response_format: "url"``: kept in memory for the key that asked for
them, for a limited time and up to a byte budget."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from typing import Callable


class ImageStore:
    """PNGs behind ``response_format: "url"``: owner key id + bytes, expiring after ``ttl_s``,
    at most ``max_bytes`` in all (the oldest go first). Insertion order is expiry order."""

    def __init__(self, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_bytes, self.clock = ttl_s, max_bytes, clock
        self._items: OrderedDict[str, tuple[str, float, bytes]] = OrderedDict()  # id -> (owner, expires, png)
        self.bytes = 0

    def put(self, owner: str, png: bytes) -> str:
        self._expire()
        while self._items and self.bytes + len(png) > self.max_bytes:
            self._drop(next(iter(self._items)))
        image_id = f"img-{secrets.token_urlsafe(18)}"
        self._items[image_id] = (owner, self.clock() + self.ttl_s, png)
        self.bytes += len(png)
        return image_id

    def get(self, owner: str, image_id: str) -> bytes | None:
        """The image if it exists, has not expired, and belongs to ``owner``; else None."""
        self._expire()
        item = self._items.get(image_id)
        if item is None or not secrets.compare_digest(item[0], owner):
            return None
        return item[2]

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        now = self.clock()
        while self._items and next(iter(self._items.values()))[1] <= now:
            self._drop(next(iter(self._items)))

    def _drop(self, image_id: str) -> None:
        self.bytes -= len(self._items.pop(image_id)[2])
