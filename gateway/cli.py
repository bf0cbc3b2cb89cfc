"""The ``tiergate`` command: ``serve`` and ``demo-models``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from gateway.auth import ADMIN_ENV, KeyRing, demo_keys
from gateway.config import Config, ConfigError, load_config, tier_keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiergate", description="A tiered inference gateway for one shared GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP server")
    serve.add_argument("--config", default="tiers.yaml", help="path to tiers.yaml")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--demo", action="store_true",
                       help="when no API keys are set, make random ones for this run and print them")
    models = sub.add_parser("demo-models", help="build the tiny offline demo models")
    models.add_argument("--out", default="demo-models", help="folder to build them in")
    models.add_argument("--seed", type=int, default=0)
    models.add_argument("--force", action="store_true", help="rebuild models that exist")
    args = parser.parse_args(argv)
    if args.command == "demo-models":
        from demo import build_demo_models

        for name, folder in build_demo_models(Path(args.out), args.seed, force=args.force).items():
            print(f"{name}: {folder}")
        return 0
    return _serve(args)


def resolve_keys(config: Config, demo: bool, environ=os.environ) -> tuple[KeyRing, dict[str, list[str]] | None]:
    """The key ring, and the demo keys if they were made up (to print once)."""
    keys = tier_keys(config, environ)
    admin = [k.strip() for k in environ.get(ADMIN_ENV, "").split(",") if k.strip()]
    made = None
    if not any(keys.values()):
        if not demo:
            names = ", ".join(t.keys_env for t in config.tiers)
            raise ConfigError(f"{config.source}: tiers: no API keys are set (set {names}, or run with --demo)")
        made = demo_keys(config.tier_names + ["admin"])
        admin = made.pop("admin")
        keys = made
        made = {**made, "admin": admin}
    return KeyRing(keys, admin), made


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
        keyring, made = resolve_keys(config, args.demo)
    except ConfigError as exc:
        print(f"tiergate: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from gateway.app import build_services, create_app

    try:
        services = build_services(config, keyring)
    except ConfigError as exc:  # an adapter that cannot be served
        print(f"tiergate: {exc}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as exc:
        print(f"tiergate: {config.source}: gpu: {exc}", file=sys.stderr)
        return 2
    app = create_app(services)
    if made:
        _print_demo_keys(made, args.host, args.port)
    uvicorn.Server(server_config(app, args.host, args.port)).run()
    return 0


def server_config(app, host: str, port: int, log_level: str = "info") -> "uvicorn.Config":
    """uvicorn as tiergate runs it (the tests run the same): h11 with the request head capped at
    ``MAX_HEAD_BYTES`` and protocol errors in OpenAI's shape (gateway/http11.py). Request bodies
    are bounded by the app: ``limits.max_body`` and ``limits.body_timeout_s``."""
    import uvicorn

    from gateway.http11 import MAX_HEAD_BYTES, GatewayH11Protocol

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", http=GatewayH11Protocol,
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES)


def _print_demo_keys(made: dict[str, list[str]], host: str, port: int) -> None:
    base = f"http://{host}:{port}/v1"
    print("\ntiergate demo mode: random API keys for this run only", flush=True)
    for tier, keys in made.items():
        print(f"  {tier:<11} {keys[0]}")
    paid = made[next(iter(made))][0]
    print(f"""
Try it:
  curl {base}/chat/completions -H "Authorization: Bearer {paid}" \\
       -H "Content-Type: application/json" \\
       -d '{{"model": "tiny-chat", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 16}}'
  OPENAI_BASE_URL={base} OPENAI_API_KEY={paid} python -c "import openai; print(openai.OpenAI().chat.completions.create(model='tiny-chat', messages=[{{'role': 'user', 'content': 'Hello'}}], max_tokens=16).choices[0].message.content)"
""", flush=True)


if __name__ == "__main__":
    sys.exit(main())
