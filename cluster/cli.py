"""``tiergate cluster``: the tiers.yaml's models on a Ray cluster (docs/CLUSTER.md). Imported only
by that command, so ``tiergate serve`` never imports Ray."""

from __future__ import annotations

import sys

from gateway.auth import ADMIN_ENV, demo_keys
from gateway.config import ConfigError, env_keys, load_config, tier_keys


def run(config_path: str, address: str | None, demo: bool) -> int:
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        print(f"tiergate: {exc}", file=sys.stderr)
        return 2
    try:
        keys, admin = tier_keys(config), env_keys(ADMIN_ENV)
    except ConfigError as exc:  # a key file that cannot be read
        print(f"tiergate: {exc}", file=sys.stderr)
        return 2
    if not any(keys.values()):
        if not demo:
            names = ", ".join(t.keys_env for t in config.tiers)
            print(f"tiergate: {config.source}: tiers: no API keys are set (set {names}, or each with _FILE "
                  "naming a file of keys, or run with --demo)", file=sys.stderr)
            return 2
        made = demo_keys(config.tier_names + ["admin"])
        admin = made.pop("admin")
        keys = made
        for tier, ring in {**keys, "admin": admin}.items():
            print(f"  {tier}: {', '.join(ring)}", file=sys.stderr)

    import ray
    from ray import serve

    from cluster.app import build, runtime_env
    from cluster.settings import SERVE_LOGGING, is_direct

    port = config.cluster.port
    env = runtime_env(ingress_port=port, config=config)  # each node's ingress serves cluster.port itself (direct ingress)
    ray.init(address=address, runtime_env=env)
    proxy_port = port + 1 if is_direct(env["env_vars"]) else port  # Serve's proxy: head node only, a fallback
    serve.start(http_options={"host": config.cluster.host, "port": proxy_port, "location": "EveryNode"},
                logging_config=SERVE_LOGGING)
    serve.run(build(config, keys, admin), name="tiergate", route_prefix="/", blocking=True)
    return 0
