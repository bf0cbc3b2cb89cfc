"""What requests used, per key, model, tier and UTC day; grouping and prices.

A :class:`Usage` is one request's counts (or a sum of them). The store adds each request's usage
to its row ``(day, key, model, tier)`` in one atomic step; reading groups rows by day, model or
key and, when tiers.yaml has ``prices:``, prices each row at its own tier (a batch line of a paid
key is priced at the batch tier's prices).
"""

from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass, fields
from typing import Iterable, Literal

from accounts.config import Price

GroupBy = Literal["day", "model", "key", "tier"]


@dataclass
class Usage:
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    embedding_tokens: int = 0
    images: int = 0
    pixels: int = 0
    audio_in_seconds: float = 0.0  # transcribed
    audio_out_seconds: float = 0.0  # spoken
    gpu_seconds: float = 0.0  # the model's service time; a batched step's time shared among its rows
    swap_seconds: float = 0.0  # the model load (and the evictions before it) this request triggered
    # of input_tokens, those the engine's prefix cache served (vLLM); new counters go last: a
    # usage journal line written before one existed is read with it at 0 (accounts.journal)
    cached_input_tokens: int = 0
    trained_tokens: int = 0  # fine-tuning: tokens trained on, every epoch counted (tuning/)

    def add(self, other: "Usage") -> None:
        for f in COUNTERS:
            setattr(self, f, getattr(self, f) + getattr(other, f))

    def cost(self, price: Price) -> float:
        cached = price.input_tokens_per_1m if price.cached_input_tokens_per_1m is None else price.cached_input_tokens_per_1m
        return ((self.input_tokens - self.cached_input_tokens) * price.input_tokens_per_1m / 1e6
                + self.cached_input_tokens * cached / 1e6
                + self.output_tokens * price.output_tokens_per_1m / 1e6
                + self.embedding_tokens * price.embedding_tokens_per_1m / 1e6
                + self.images * price.image
                + self.audio_in_seconds / 60 * price.audio_in_minute
                + self.audio_out_seconds / 60 * price.audio_out_minute
                + self.gpu_seconds / 3600 * price.gpu_hour
                + self.trained_tokens * price.trained_tokens_per_1m / 1e6)


COUNTERS = tuple(f.name for f in fields(Usage))
FIRST_COUNTERS = 10  # the counters of the first version (through swap_seconds): the shortest row a journal may hold
INTEGER_COUNTERS = frozenset(f.name for f in fields(Usage) if f.type == "int")


@dataclass(frozen=True)
class UsageRow:
    day: str  # YYYY-MM-DD, UTC
    key: str  # the key's id
    model: str
    tier: str
    usage: Usage


def group(rows: Iterable[UsageRow], by: GroupBy, prices: dict[str, Price | None]) -> list[dict]:
    """Rows summed per ``by`` value, sorted by it; with ``cost_usd`` when any tier is priced."""
    out: dict[str, tuple[Usage, float]] = {}
    priced = any(p is not None for p in prices.values())
    for row in rows:
        name = getattr(row, by)
        total, cost = out.get(name, (Usage(), 0.0))
        total.add(row.usage)
        price = prices.get(row.tier)
        out[name] = (total, cost + (row.usage.cost(price) if price is not None else 0.0))
    result = []
    for name in sorted(out):
        total, cost = out[name]
        item = {by: name, **_rounded(total)}
        if priced:
            item["cost_usd"] = round(cost, 6)
        result.append(item)
    return result


def _rounded(u: Usage) -> dict:
    return {k: (v if k in INTEGER_COUNTERS else round(v, 6)) for k, v in asdict(u).items()}


def to_csv(items: list[dict]) -> str:
    if not items:
        return ""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(items[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(items)
    return buf.getvalue()
