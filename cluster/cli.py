"""``tiergate cluster``: the tiers.yaml's models on a Ray cluster (docs/CLUSTER.md). Imported only
by that command, so ``tiergate serve`` never imports Ray."""

from __future__ import annotations

import sys

from gateway.auth import ADMIN_ENV, demo_keys
from gateway.config import ConfigError, check_keys_apart, env_keys, load_config, tier_keys


def run(config_path: str, address: str | None, demo: bool) -> int:
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        print(f"tiergate: {exc}", file=sys.stderr)
        return 2
    try:
        keys, admin = tier_keys(config), env_keys(ADMIN_ENV)
        check_keys_apart(config, keys, admin)
    except ConfigError as exc:  # a key file that cannot be read, a key in two places
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

    # on a cluster of its own (no address) the ports must be free (the ingress's, and with direct ingress Serve's
    # proxy's on the next); on one joined, Serve may already run there
    from cluster.settings import is_direct, serve_settings

    port = config.cluster.port
    ports = {port: "cluster.port"} | ({port + 1: "cluster.port + 1, Serve's proxy"}
                                      if is_direct(serve_settings(port)) else {})
    for each, what in ports.items():
        if (error := check_port(config.cluster.host, each, may_be_used=address is not None, what=what)) is not None:
            print(f"tiergate: {error}", file=sys.stderr)
            return 2
    import ray
    from ray import serve

    from cluster.app import build, runtime_env
    from cluster.settings import SERVE_LOGGING

    # each node's ingress serves cluster.port itself (direct ingress)
    env = runtime_env(ingress_port=port, config=config)
    ray.init(address=address, runtime_env=env)
    stop = Stop()  # after ray.init: Ray's own SIGTERM handler (a crash dump, then death) is replaced
    proxy_port = port + 1 if is_direct(env["env_vars"]) else port  # Serve's proxy: head node only, a fallback
    serve.start(http_options={"host": config.cluster.host, "port": proxy_port, "location": "EveryNode"},
                logging_config=SERVE_LOGGING)
    try:
        serve.run(build(config, keys, admin), name=APP, route_prefix="/", blocking=False)
    except RuntimeError as exc:  # Serve's "Deploying application tiergate failed", with its traceback
        print(f"tiergate: the application did not start ({str(exc).splitlines()[0]}); if the ingress failed, "
              f"is port {port} in use on a node (Serve's log under /tmp/ray/session_latest/logs/serve says)?",
              file=sys.stderr)
        serve.shutdown()
        ray.shutdown()
        return 1
    print(f"tiergate: serving on {config.cluster.host}:{port}; SIGTERM or Ctrl+C drains, then stops", file=sys.stderr)
    stop.wait()
    try:
        drain(config)
    except KeyboardInterrupt:  # a second signal: stop now
        print("tiergate: stopping without waiting for the drain", file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


APP = "tiergate"  # the Serve application's name


def port_state(host: str, port: int) -> str:
    """"free", "closing" (held only by connections of a process that stopped, TIME_WAIT, whose
    listener bound with SO_REUSEADDR) or "in use" (a listener, or closing connections a bind with
    SO_REUSEADDR cannot pass: their listener bound without it)."""
    import socket

    for reuse in (False, True):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            if reuse:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
            return "closing" if reuse else "free"
    return "in use"


def check_port(host: str, port: int, may_be_used: bool = False, what: str = "cluster.port") -> str | None:
    """None when this node's ingress (or Serve's proxy) can bind ``host:port``, else the one-line
    reason it cannot. Both bind with SO_REUSEADDR (the ingress: ``cluster.settings.reuse_address``),
    so a last run's closed connections (TIME_WAIT, a restart right after a stop) are no reason.
    ``may_be_used``: a listener there is none either (an ingress of a Serve already running on the cluster)."""
    if port_state(host, port) != "in use" or may_be_used:
        return None
    return f"port {port} on {host} ({what}) is in use by another process"


class Stop:
    """The first SIGTERM or SIGINT ends ``wait`` (the drain begins); a second raises
    KeyboardInterrupt wherever the driver is, cutting the drain short."""

    def __init__(self) -> None:
        import signal
        import threading

        self.asked = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._signalled)

    def _signalled(self, sig: int, frame) -> None:
        if self.asked.is_set():
            raise KeyboardInterrupt
        self.asked.set()

    def wait(self) -> None:
        while not self.asked.wait(1.0):  # a timeout, so the signal's handler runs promptly
            pass


def drain(config, app: str = APP) -> None:
    """Drain every replica of ``app`` at once, as ``tiergate serve`` drains (``TierReplica.drain``:
    503 ``shutting_down`` to new requests, batch lines handed back, requests in flight finished for
    up to ``server.drain_timeout_s``), and return when all have: the ingresses relay what the
    replicas still send meanwhile. Serve's shutdown then stops what is idle."""
    from ray import serve

    from cluster.deployments import deployments

    timeout = config.server.drain_timeout_s
    print(f"tiergate: draining: new requests refused, those in flight get up to {timeout:g} s", file=sys.stderr)
    calls = []
    for d in deployments(config):
        handle = serve.get_deployment_handle(d.name, app_name=app)
        named = handle.options(method_name="name")
        seen: list[str] = []
        for _ in range(d.num_replicas):
            replica = named.remote(avoid=seen).result(timeout_s=30)
            if replica in seen:  # every replica answered already (the router fell back)
                break
            seen.append(replica)
        calls += [(r, handle.options(method_name="drain").remote(replica=r)) for r in seen]
    for replica, call in calls:
        try:
            said = call.result(timeout_s=timeout + 30)
        except Exception as exc:  # noqa: BLE001 - a replica that died or hung: Serve's shutdown stops it
            said = f"failed: {type(exc).__name__}: {exc}"[:300]
        print(f"tiergate: replica {replica} drained: {said}", file=sys.stderr)
