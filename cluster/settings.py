"""Ray Serve's own settings that ``tiergate cluster`` runs with (docs/CLUSTER.md, "Ray Serve
settings"), kept only where a measurement showed they help (docs/BENCHMARKS.md, Cluster).

Each Serve process (controller, proxies, replicas) reads its settings from its environment once,
when ``ray.serve._private.constants`` is imported, so they must be in that environment when the
process starts: the job's runtime_env (``cluster.app.runtime_env``) carries them to every actor the
job starts, Serve's controller included, which starts the proxies and replicas with them. A Serve
already running on the cluster (started by another job) keeps the settings it started with.

Any ``RAY_SERVE_*`` variable set where ``tiergate cluster`` runs travels the same way and wins over
these, so a setting can be turned off (``RAY_SERVE_ENABLE_DIRECT_INGRESS=0``: through Serve's
proxy again) or another one tried without a code change.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket

log = logging.getLogger("tiergate.cluster")

SERVE_SETTINGS = {
    # Handle calls (ingress -> replica) and the proxy's calls (proxy -> ingress) go over gRPC
    # straight to the replica instead of as Ray actor tasks: about 4 ms of CPU less per request
    # across the proxy, ingress and replica on the benchmark's machine.
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    # Serve's controller kills a proxy that has not answered its ready check within 5 s and starts
    # another, while ``serve.start`` waits (up to 60 s) on the first one only, so it fails with
    # ActorDiedError ("killed by `ray.kill`... never ran"). On a loaded node a proxy's process takes
    # longer than 5 s to start: it did in CI (2 cores, two test processes, another Ray cluster
    # starting). The controller now waits as long as ``serve.start`` does.
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
}

# The name each setting has in ``ray.serve._private.constants``, where it is not the variable's.
CONSTANT_NAMES = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "PROXY_READY_CHECK_TIMEOUT_S"}

# The ingress only (its deployment's runtime_env, merged over the job's): its code and its handles'
# router run on the actor's main event loop, where Serve's HTTP server for it runs, instead of a
# thread and a loop each, so a request no longer crosses threads inside the ingress (HTTP -> user
# code -> router -> gRPC and back); Serve's own throughput profile (RAY_SERVE_THROUGHPUT_OPTIMIZED)
# sets the same. The ingress never blocks its loop. The replicas keep Serve's defaults: with these
# settings on every deployment test_cluster_ray failed in 3 of 10 full runs over two rounds (twice
# test_a_replica_killed_mid_batch metered one execution more than lines, once a stream); on the
# ingress only, 1 of 9 (that test again, on a heavily loaded machine); without them, never (8 full
# runs). The batch lines' metering ids (6a25573) have since fixed that double count; tried on the
# replicas again (2026-12-02), the test module passed and neither the hop nor the replicas' CPU
# moved beyond the run-to-run spread, so the replicas still keep Serve's defaults.
# docs/BENCHMARKS.md, the 2026-12-02 pass and Cluster.
INGRESS_SETTINGS = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}

# Serve's per-request access log lines (proxy, ingress, replica) off; its warnings stay. tiergate's
# request log is not Serve's: each replica writes it on its stderr (``TierReplica.__init__``).
SERVE_LOGGING = {"enable_access_log": False, "log_level": "WARNING"}

DIRECT_INGRESS = "RAY_SERVE_ENABLE_DIRECT_INGRESS"

# The largest gRPC message a replica's server (the request) and the ingress's channel to it (the
# answer) receive: gRPC's 4 MiB by default, so a 5 MiB upload failed the hop with a 500 while
# ``tiergate serve`` takes 25 MiB bodies and 200 MiB files (hunt K, finding 1). A request crosses
# whole, so the limit is the largest body the server accepts (``cluster.deployments.largest_body``;
# the ingress refuses a larger one) with room for its headers; a streamed answer crosses in chunks
# of at most ``cluster.replica.CHUNK_BYTES``, a non-streamed one (a JSON answer) whole, so never
# below ``ANSWER_BYTES``. gRPC allocates nothing up to the limit: it only refuses beyond it.
GRPC_MESSAGE = "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"
ANSWER_BYTES = 256 << 20
HEADROOM = 1 << 20  # the request's headers and the call's own fields beside its body
GRPC_MAX = (1 << 31) - 1  # gRPC's own ceiling (a signed 32-bit length)


def message_limit(largest_body: int) -> dict[str, str]:
    """Serve's gRPC message limit for a server whose largest accepted body is ``largest_body``."""
    return {GRPC_MESSAGE: str(min(GRPC_MAX, max(ANSWER_BYTES, largest_body + HEADROOM)))}


def direct_ingress(port: int, ports: int = 1) -> dict[str, str]:
    """Serve's direct ingress: each ingress replica serves HTTP itself, on the first free port of
    ``[port, port + ports)`` on its node, so a request skips Serve's proxy (which then runs on the
    head node only, as a fallback on its own port). A port an ingress released is free again at once
    (Serve holds it back 150 s for its HAProxy mode, which tiergate does not use). A stopping ingress
    stops once its requests are done, not 30 s later at the earliest (Serve's wait for a load
    balancer to deregister it): ``tiergate cluster`` drains the replicas first (``cluster.cli.drain``),
    and ends, as ``tiergate serve`` does, as soon as nothing is in flight."""
    return {DIRECT_INGRESS: "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + ports), "RAY_SERVE_PORT_QUARANTINE_S": "0",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


def reuse_address() -> bool:
    """Make Serve's direct ingress in this process bind its HTTP port with SO_REUSEADDR, as uvicorn
    and Serve's own proxy do; True once it does. Called in the ingress's process
    (``Ingress.__init__``), which Serve binds only after the ingress is made.

    Serve (2.60) binds it without (``http_util.start_asgi_http_server``, called with
    ``enable_so_reuseport=False``; no setting changes that). An ingress that died with connections
    open (an OOM kill, a crash) leaves them in TIME_WAIT for a minute, so its replacement could not
    bind ``cluster.port``; Serve then takes the port for another service's and never offers it again
    (``release_replica_port(block_port=True)``), and with tiergate's range of one port every later
    replacement failed: the node's port never answered again (hunt CC, finding 1). With SO_REUSEADDR
    on both the dead listener and the new one, Linux lets the new one bind through the TIME_WAIT
    connections, while a port another process listens on still fails it. SO_REUSEPORT (which Serve's
    helper sets beside it when asked for reuse) is left off: it would let a live listener share the port.

    The patch: the replica module's name for Serve's helper asks it for reuse, and the helper's
    reuse step sets SO_REUSEADDR alone. Applied only where Serve's code is as described (the
    helper takes ``enable_so_reuseport`` and calls ``set_socket_reuse_port`` by its module's name);
    otherwise logged, and Serve binds as it does by itself."""
    from ray.serve._private import http_util, replica

    if replica.start_asgi_http_server is _start_reusing_address:
        return True
    helper = http_util.start_asgi_http_server
    if (replica.start_asgi_http_server is not helper or "set_socket_reuse_port" not in helper.__code__.co_names
            or "enable_so_reuseport" not in inspect.signature(helper).parameters):
        log.warning("this Ray Serve binds its direct ingress differently: cluster.port is bound without SO_REUSEADDR, "
                    "so an ingress that dies with connections open may leave it unbound (docs/CLUSTER.md)")
        return False
    http_util.set_socket_reuse_port = _reuse_address_only
    replica.start_asgi_http_server = _start_reusing_address
    return True


async def _start_reusing_address(app, options, *, event_loop, enable_so_reuseport: bool = False):
    """Serve's helper, always asked for reuse (its one caller here, the direct ingress, asks for none)."""
    from ray.serve._private import http_util

    return await http_util.start_asgi_http_server(app, options, event_loop=event_loop, enable_so_reuseport=True)


def _reuse_address_only(sock: socket.socket) -> bool:
    """The helper's reuse step in the ingress's process (its only user there): SO_REUSEADDR, no SO_REUSEPORT."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return True


def serve_settings(ingress_port: int | None = None, ports: int = 1, largest_body: int = 0) -> dict[str, str]:
    """``SERVE_SETTINGS``, direct ingress on ``ingress_port`` when given, the gRPC message limit for
    ``largest_body`` (``message_limit``), and every ``RAY_SERVE_*`` variable of this process's
    environment, which wins over them."""
    chosen = {**SERVE_SETTINGS, **(direct_ingress(ingress_port, ports) if ingress_port is not None else {}),
              **message_limit(largest_body)}
    return {**chosen, **{k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")}}


def ingress_settings() -> dict[str, str]:
    """``INGRESS_SETTINGS``, each overridden by the same variable in this process's environment."""
    return {k: os.environ.get(k, v) for k, v in INGRESS_SETTINGS.items()}


def is_direct(settings: dict[str, str]) -> bool:
    return settings.get(DIRECT_INGRESS) == "1"


def in_effect() -> dict[str, object]:
    """The values Ray Serve runs with in this process, for each of ``SERVE_SETTINGS``,
    ``INGRESS_SETTINGS``, direct ingress and the gRPC message limit."""
    from ray.serve._private import constants

    return {name: getattr(constants, CONSTANT_NAMES.get(name, name))
            for name in [*SERVE_SETTINGS, *INGRESS_SETTINGS, DIRECT_INGRESS, GRPC_MESSAGE]}
