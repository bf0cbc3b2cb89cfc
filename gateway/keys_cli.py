"""``tiergate keys create|list|revoke``: managed keys from the command line, on the same store the
servers use (tiers.yaml's ``batch.store``), so a key made here works on every server at once and
a revoke reaches them all within ``accounts.refresh_s``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from accounts.config import Limits
from accounts.store import STORE_ERRORS
from gateway.accounts import store_for
from gateway.config import Config
from accounts.keys import make_key

LIMIT_FIELDS = [n for n in Limits.model_fields if n not in ("models", "adapters")]


def add_parser(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="create, list or revoke managed API keys")
    keys.add_argument("--config", default="tiers.yaml", help="path to tiers.yaml (its batch.store holds the keys)")
    actions = keys.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="make a key; its secret is printed once")
    create.add_argument("--tier", required=True)
    create.add_argument("--name", default="")
    create.add_argument("--limit", action="append", default=[], metavar="FIELD=VALUE",
                        help=f"one of the key's own limits ({', '.join(LIMIT_FIELDS)}); repeatable")
    create.add_argument("--models", help="comma-separated allow-list of models (default: the tier's)")
    create.add_argument("--adapters", help="comma-separated allow-list of adapter names or shell-style patterns, "
                                           "e.g. 'acme-*' (default: the tier's; '' for none)")
    actions.add_parser("list", help="every key, without secrets, as JSON lines")
    revoke = actions.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")


def run(args: argparse.Namespace, config: Config) -> int:
    """Carry out ``args.action``; 0 on success, 1 when the key does not exist or the store does not
    answer, 2 for bad input."""
    return asyncio.run(_run(args, config))


async def _run(args: argparse.Namespace, config: Config) -> int:
    store = store_for(config)
    try:
        await store.open()
        try:
            return await _act(args, config, store)
        finally:
            await store.close()
    except STORE_ERRORS as exc:  # Redis down, SQLite's file refused: one line, not the client's traceback
        return _refuse(f"{config.source}: batch.store: the key store did not answer: {exc}", 1)


async def _act(args: argparse.Namespace, config: Config, store) -> int:
    if args.action == "create":
        return await _create(args, config, store)
    if args.action == "list":
        for record in await store.list_keys():
            print(json.dumps(record.public()))
        return 0
    record = await store.update_key(args.key_id, revoked_at=int(time.time()))
    if record is None:
        return _refuse(f"no key {args.key_id}", 1)
    print(json.dumps(record.public()))
    return 0


async def _create(args: argparse.Namespace, config: Config, store) -> int:
    if args.tier not in config.tier_names:
        return _refuse(f"--tier: no tier named {args.tier!r} (tiers: {', '.join(config.tier_names)})")
    limits: dict[str, Any] = {}
    for item in args.limit:
        name, _, value = item.partition("=")
        if name not in LIMIT_FIELDS or not value:
            return _refuse(f"--limit {item!r}: use FIELD=VALUE with FIELD one of {', '.join(LIMIT_FIELDS)}")
        number = _number(value)
        if number is None:
            return _refuse(f"--limit {item!r}: {value!r} is not a number")
        limits[name] = number
    try:
        Limits.model_validate(limits)
    except ValueError as exc:
        return _refuse(f"--limit: {exc.errors()[0]['msg'] if hasattr(exc, 'errors') else exc}")
    models = tuple(m.strip() for m in args.models.split(",") if m.strip()) if args.models else None
    unknown = sorted(set(models or ()) - {m.name for m in config.models})
    if unknown:
        return _refuse(f"--models: no model named {unknown[0]!r}")
    adapters = tuple(a.strip() for a in args.adapters.split(",") if a.strip()) if args.adapters is not None else None
    record, secret = make_key(args.name, args.tier, limits, models, adapters)
    record = await store.create_key(record)
    print(json.dumps({**record.public(), "value": secret}), flush=True)
    return 0


def _number(text: str) -> int | float | None:
    """A limit's value as written: an int, else a float (``Limits`` checks its type and range), else None."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return None


def _refuse(message: str, code: int = 2) -> int:
    """One error line on stderr (stdout carries only the JSON records); the exit status."""
    print(f"tiergate: {message}", file=sys.stderr, flush=True)
    return code
