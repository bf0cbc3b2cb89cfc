"""The ingress's early quota refusal: a key that has already spent a minute limit or its daily
budget is answered 429 (``rate_limit_exceeded``) or ``insufficient_quota`` before any replica is
asked.

It only reads (``Limiter.peek`` and the day's GPU-seconds from the shared account store) and
spends nothing: the chosen replica's serving core still admits the request atomically and meters
it, exactly as in ``tiergate serve``, so two requests racing past this check are decided there.
With ``cluster.redis_url`` the buckets and the usage are the whole cluster's.
"""

from __future__ import annotations

import time

from accounts.rates import WINDOW_S, over_budget, refusal, utc_day
from accounts.store import STORE_ERRORS
from gateway.accounts import Accounts, rate_headers, refused
from gateway.auth import Caller
from gateway.errors import APIError


async def early_refusal(accounts: Accounts, caller: Caller) -> APIError | None:
    """The 429 a request of ``caller`` would get for limits it has already used up, or None (also
    when the store does not answer: the replica's admission then answers 503 store_unavailable)."""
    try:
        return await _early_refusal(accounts, caller)
    except STORE_ERRORS:
        return None


async def _early_refusal(accounts: Accounts, caller: Caller) -> APIError | None:
    limits = accounts.limits(caller.key_id, caller.tier)
    if limits.gpu_seconds_per_day is not None:
        now = time.time()
        spent = await accounts.store.gpu_spent(caller.key_id, utc_day(now))
        if spent >= limits.gpu_seconds_per_day:
            return refused(over_budget(spent, limits.gpu_seconds_per_day, now))
    if not (limits.requests_per_min or limits.tokens_per_min or limits.images_per_min or limits.audio_seconds_per_min):
        return None
    buckets = await accounts.limiter.peek(caller.key_id, limits)
    for dim, bucket in buckets.items():
        # not one unit left (all of a limit under one unit): any request would be refused. The
        # ingress does not know a request's cost, so it only ever says "wait": a request too large
        # for a limit whatever the wait is the replica's to refuse (final, x-should-retry: false)
        unit = min(1.0, bucket.limit)
        if bucket.limit - bucket.reset_s * bucket.limit / WINDOW_S < unit - 1e-9:
            need_s = bucket.reset_s - WINDOW_S + unit * WINDOW_S / bucket.limit
            error = refused(refusal(dim, bucket.limit, unit, max(need_s, 0.001)))
            error.headers.update(rate_headers(buckets))
            return error
    return None
