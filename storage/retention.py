"""Records that expire a fixed time after they were made: what the stores of stored responses and
stored chat completions share, on SQLite and on Redis."""

from __future__ import annotations

import time


class Retained:
    retention_s: float | None = None  # None: kept until deleted

    def _cutoff(self) -> float | None:
        """Records made before this (epoch seconds) are past their retention."""
        return None if self.retention_s is None else time.time() - self.retention_s

    def _expires_at(self, created_at: float) -> int | None:
        """When a record made at ``created_at`` expires (whole epoch seconds, for Redis's EXAT)."""
        return None if self.retention_s is None else int(created_at + self.retention_s) + 1
