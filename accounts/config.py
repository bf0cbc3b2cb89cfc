"""Limits and prices as tiers.yaml states them: ``accounts.limits`` (defaults per tier) and
``prices`` (cost per tier). A managed key's own limits override its tier's, field by field."""

from __future__ import annotations

import fnmatch
import functools

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(_Strict):
    """What one key may use; None is no limit. Minute limits are buckets that refill evenly over
    a minute (GCRA), so a full minute's worth can be spent at once and then one more every
    ``60 / limit`` seconds."""

    requests_per_min: int | None = Field(default=None, ge=1)
    tokens_per_min: int | None = Field(default=None, ge=1)  # chat prompt + max_tokens, embeddings input
    concurrent: int | None = Field(default=None, ge=1)  # requests in flight at once
    images_per_min: int | None = Field(default=None, ge=1)
    audio_seconds_per_min: float | None = Field(default=None, gt=0)  # speech made plus audio transcribed
    gpu_seconds_per_day: float | None = Field(default=None, gt=0)  # per UTC day
    models: tuple[str, ...] | None = None  # allow-list of model names; None: every model
    adapters: tuple[str, ...] | None = None  # allow-list of adapter names, shell-style patterns; None: every adapter

    def allows_adapter(self, name: str) -> bool:
        """Whether the adapter ``name`` (of a model this key may use) is in the adapter allow-list."""
        return self.adapters is None or any(adapter_matches(name, pattern) for pattern in self.adapters)

    @functools.cached_property
    def limited(self) -> bool:
        """Whether any minute, concurrency or daily limit is set (the allow-list is not a limit):
        asked of every request's limits, so worked out once per ``Limits``."""
        return any(getattr(self, f) is not None for f in
                   ("requests_per_min", "tokens_per_min", "concurrent", "images_per_min", "audio_seconds_per_min",
                    "gpu_seconds_per_day"))

    def over(self, overrides: dict) -> "Limits":
        """These limits with ``overrides`` (a key's own, only the fields it sets) on top."""
        return Limits.model_validate({**self.model_dump(), **overrides})


def adapter_matches(name: str, pattern: str) -> bool:
    """Whether the adapter ``name`` matches the allow-list ``pattern``: shell-style (``*``, ``?``,
    ``[ab]``), field by field where the pattern has ``:``-separated fields. Each of the pattern's
    fields but its last matches one of the name's; the last matches the rest of the name, colons
    and all. So ``ft:*:key-1a2b:*`` admits ``ft:<model>:key-1a2b:<suffix>:<id>`` (and its
    checkpoints), and not another key's model whose suffix is ``key-1a2b``, where one ``*`` over
    the whole name let the first ``*`` run over the owner's field. A pattern without ``:`` is
    matched against the whole name, as before. In an ``ft:`` pattern's owner field (the third) a
    key id may be written as it is (``key_1a2b``): the name has it with ``-`` for ``_``
    (``tuning.runner.owner_label``; an adapter's name has no ``_``)."""
    fields, parts = pattern.split(":"), name.split(":")
    if len(parts) < len(fields):
        return False
    if fields[0] == "ft" and len(fields) > 2:
        fields[2] = fields[2].replace("_", "-")
    last = len(fields) - 1
    return (all(fnmatch.fnmatchcase(part, field) for part, field in zip(parts[:last], fields[:last]))
            and fnmatch.fnmatchcase(":".join(parts[last:]), fields[last]))


class Price(_Strict):
    """US dollars per unit of usage for one tier, or another tier's prices times ``factor``
    (``{like: paid, factor: 0.5}``: OpenAI's Batch API discount)."""

    like: str | None = None
    factor: float = Field(default=1.0, ge=0)
    input_tokens_per_1m: float = Field(default=0.0, ge=0)
    cached_input_tokens_per_1m: float | None = Field(default=None, ge=0)  # input the prefix cache served; None: as input
    output_tokens_per_1m: float = Field(default=0.0, ge=0)
    embedding_tokens_per_1m: float = Field(default=0.0, ge=0)
    image: float = Field(default=0.0, ge=0)  # per image
    audio_in_minute: float = Field(default=0.0, ge=0)  # transcription, per minute of audio
    audio_out_minute: float = Field(default=0.0, ge=0)  # speech, per minute made
    gpu_hour: float = Field(default=0.0, ge=0)
    trained_tokens_per_1m: float = Field(default=0.0, ge=0)  # fine-tuning


class AccountsConfig(_Strict):
    """``accounts:`` in tiers.yaml: per-tier default limits, and how long a process trusts what it
    knows of the managed keys (a revoke reaches every process within ``refresh_s``)."""

    limits: dict[str, Limits] = Field(default_factory=dict)
    refresh_s: float = Field(default=0.5, gt=0, le=1.0)


def check_tiers(accounts: AccountsConfig, prices: dict[str, Price], tiers: list[str]) -> None:
    """Every tier named under ``accounts.limits`` and ``prices`` exists; ``like`` names a priced tier."""
    for where, names in (("accounts.limits", accounts.limits), ("prices", prices)):
        for name in names:
            if name not in tiers:
                raise ValueError(f"{where}: no tier named {name!r} (tiers: {', '.join(tiers)})")
    for name, price in prices.items():
        if price.like is not None and (price.like not in prices or prices[price.like].like is not None):
            raise ValueError(f"prices.{name}.like: {price.like!r} must be a tier priced directly")
        _priced_one_way(name, price)


def _priced_one_way(name: str, price: Price) -> None:
    """A tier is priced either directly or ``like`` another times ``factor``, never both:
    ``resolved_price`` would drop a price written next to ``like``, and ``factor`` scales only
    ``like``'s prices, so either mistake would bill other than the file says."""
    own = sorted(price.model_fields_set - {"like", "factor"})
    if price.like is not None and own:
        raise ValueError(f"prices.{name}.{own[0]}: a tier priced like another takes only factor; "
                         f"price {name!r} directly, without like, to set its own prices")
    if price.like is None and "factor" in price.model_fields_set:
        raise ValueError(f"prices.{name}.factor: factor scales the prices of like; a tier priced directly "
                         "has no factor (write its prices as they are)")


def resolved_price(prices: dict[str, Price], tier: str) -> Price | None:
    """The tier's prices with ``like`` applied, or None when the tier has none."""
    price = prices.get(tier)
    if price is None or price.like is None:
        return price
    base = prices[price.like].model_dump(exclude={"like", "factor"})
    return Price(**{k: None if v is None else v * price.factor for k, v in base.items()})

