"""Ray Serve's own settings that ``tiergate cluster`` runs with (docs/CLUSTER.md, "Ray Serve
settings"), kept only where a measurement showed they help (docs/BENCHMARKS.md, Cluster).

Each Serve process (controller, proxies, replicas) reads its settings from its environment once,
when ``ray.serve._private.constants`` is imported, so they must be in that environment when the
process starts: the job's runtime_env (``cluster.app.runtime_env``) carries them to every actor the
job starts, Serve's controller included, which starts the proxies and replicas with them. A Serve
already running on the cluster (started by another job) keeps the settings it started with.
"""

from __future__ import annotations

import os

SERVE_SETTINGS = {
    # Handle calls (ingress -> replica) and the proxy's calls (proxy -> ingress) go over gRPC
    # straight to the replica instead of as Ray actor tasks: about 4 ms of CPU less per request
    # across the proxy, ingress and replica on the benchmark's machine.
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
}

# Serve's per-request access log lines (proxy, ingress, replica) off; its warnings stay. tiergate's
# request log (the replica's app) is not Serve's and is unchanged.
SERVE_LOGGING = {"enable_access_log": False, "log_level": "WARNING"}


def serve_settings() -> dict[str, str]:
    """``SERVE_SETTINGS``, each overridden by the same variable in this process's environment."""
    return {name: os.environ.get(name, value) for name, value in SERVE_SETTINGS.items()}


def in_effect() -> dict[str, object]:
    """The values Ray Serve runs with in this process, for each of ``SERVE_SETTINGS``."""
    from ray.serve._private import constants

    return {name: getattr(constants, name) for name in SERVE_SETTINGS}
