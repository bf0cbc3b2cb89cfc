"""Accounts: API keys managed at run time, per-key limits and usage metered per key.

``keys`` (a managed key's record and its secret's hash), ``config`` (limits and prices as tiers.yaml
states them), ``rates`` (the limit arithmetic: GCRA buckets, the in-process limiter), ``usage``
(what a request used, rows per key / model / UTC day, grouping, prices), ``store`` (the store
interface) with ``sqlite_store`` and ``redis_store`` (which also holds the limiter shared across
processes). The package imports nothing of tiergate's; the gateway composes it
(``gateway/accounts.py``).
"""
