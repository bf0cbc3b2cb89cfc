"""The images behind ``response_format: "url"`` (PNG, JPEG or WebP, as asked): kept in memory for
the key that asked for them, for a limited time and up to a byte budget."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from typing import Callable

from gateway.origin import IMAGE, tagged


class ImageStore:
    """Images behind ``response_format: "url"``: owner key id, format (the url's extension) and
    bytes, expiring after ``ttl_s``, at most ``max_bytes`` in all (the oldest go first).
    Insertion order is expiry order."""

    def __init__(self, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic,
                 origin: str = "") -> None:
        """``origin``: the cluster replica that makes the ids (``gateway.origin``)."""
        self.ttl_s, self.max_bytes, self.clock, self.origin = ttl_s, max_bytes, clock, origin
        self._items: OrderedDict[str, tuple[str, float, str, bytes]] = OrderedDict()  # id -> (owner, expires, format, bytes)
        self.bytes = 0

    def put(self, owner: str, data: bytes, fmt: str = "png") -> str:
        self._expire()
        while self._items and self.bytes + len(data) > self.max_bytes:
            self._drop(next(iter(self._items)))
        image_id = tagged(IMAGE, self.origin, secrets.token_urlsafe(18))
        self._items[image_id] = (owner, self.clock() + self.ttl_s, fmt, data)
        self.bytes += len(data)
        return image_id

    def get(self, owner: str, image_id: str, fmt: str = "png") -> bytes | None:
        """The image if it exists in format ``fmt``, has not expired, and belongs to ``owner``;
        else None."""
        self._expire()
        item = self._items.get(image_id)
        if item is None or not secrets.compare_digest(item[0], owner) or item[2] != fmt:
            return None
        return item[3]

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        now = self.clock()
        while self._items and next(iter(self._items.values()))[1] <= now:
            self._drop(next(iter(self._items)))

    def _drop(self, image_id: str) -> None:
        self.bytes -= len(self._items.pop(image_id)[3])
