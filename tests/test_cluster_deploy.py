"""The cluster's parts that need no Ray: the deployments a tiers.yaml becomes (tensor-parallel
models included), the cluster section's validation, the ingress's early quota refusal on a real
account store, the merged scrape target, and what the ingress's process imports. The CUDA test
checks that a replica sees the GPUs Ray gave it (skipped without CUDA)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from accounts.rates import Ask, utc_day
from accounts.sqlite_store import SQLiteAccounts
from accounts.usage import Usage
from cluster.deployments import Deployment, deployments, serving_only
from cluster.quota import early_refusal
from cluster.scrape import merged
from gateway.accounts import Accounts
from gateway.auth import Caller, RateState
from gateway.config import ConfigError, load_config


def test_the_ingress_and_the_driver_import_no_model_library():
    """The ingress (and the router inside it) does what the gateway does before a model is needed:
    its process imports neither torch nor the model libraries. One ingress runs on every node; with
    them it took 10 s of CPU to start here, and held torch's memory, for nothing. Nor does the
    driver that builds the application (``tiergate cluster``: ``cluster.cli``, ``cluster.app``,
    which names the replicas' class): the replicas import them when they start."""
    code = ("import sys, cluster.ingress, cluster.ray_router, cluster.app, cluster.cli; "
            "print(sorted({'torch', 'transformers', 'diffusers', 'peft', 'vllm'} & sys.modules.keys()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def tiers_yaml(tmp_path: Path, cluster: str, models: str = "") -> Path:
    for name in ("big", "m1", "m2"):
        (tmp_path / name).mkdir(exist_ok=True)
    path = tmp_path / "tiers.yaml"
    path.write_text(
        "tiers:\n  - {name: paid, keys_env: K_PAID, latency_target_s: 10}\n  - {name: free, keys_env: K_FREE}\n"
        "models:\n"
        "  - {name: big, kind: chat, path: big, vram: 60GiB, engine: vllm}\n"
        "  - {name: m1, kind: chat, path: m1, vram: 10GiB, engine: vllm}\n"
        "  - {name: m2, kind: chat, path: m2, vram: 10GiB, engine: vllm}\n" + models
        + "gpu: {device: cpu, vram_budget: 80GiB}\n" + "cluster:\n" + cluster)
    return path


CUDA_TWO_NODES = "  nodes: 2\n  replicas_per_node: 4\n  devices: cuda\n"


def test_one_replica_per_device_and_a_tensor_parallel_model_apart(tmp_path):
    config = load_config(tiers_yaml(tmp_path, CUDA_TWO_NODES + "  tensor_parallel: {big: 2}\n"))
    assert deployments(config) == [
        Deployment("replica", ("m1", "m2"), 6, 1, 1.0, 4, pinned=False),  # 8 devices, 2 spanned by big
        Deployment("tp-big", ("big",), 1, 2, 1.0, 1, pinned=True),
    ]


def test_without_tensor_parallel_every_device_is_a_pool_replica(tmp_path):
    config = load_config(tiers_yaml(tmp_path, CUDA_TWO_NODES))
    assert deployments(config) == [Deployment("replica", ("big", "m1", "m2"), 8, 1, 1.0, 4, pinned=False)]


def test_on_cpu_replicas_reserve_no_gpu(tmp_path):
    config = load_config(tiers_yaml(tmp_path, "  nodes: 1\n  replicas_per_node: 4\n  devices: cpu\n"
                                              "  replica_cpus: 0.5\n  tensor_parallel: {big: 3}\n"))
    assert [(d.name, d.num_replicas, d.num_gpus, d.num_cpus) for d in deployments(config)] == [
        ("replica", 1, 0, 0.5), ("tp-big", 1, 0, 0.5)]


def test_a_tensor_parallel_replica_serves_its_model_alone_pinned_with_its_size_as_budget(tmp_path):
    config = load_config(tiers_yaml(tmp_path, CUDA_TWO_NODES + "  tensor_parallel: {big: 2}\n"))
    tp = serving_only(config, ["big"], pinned=True)
    assert [m.name for m in tp.models] == ["big"] and tp.gpu.vram_budget == 60 * 2**30
    pool = serving_only(config, ["m1", "m2"], pinned=False)
    assert [m.name for m in pool.models] == ["m1", "m2"] and pool.gpu.vram_budget == 80 * 2**30


def test_a_replica_keeps_the_adapter_folders_of_its_models(tmp_path):
    (tmp_path / "for-big").mkdir()
    (tmp_path / "for-m1").mkdir()
    path = tiers_yaml(tmp_path, CUDA_TWO_NODES + "  tensor_parallel: {big: 2}\n")
    path.write_text(path.read_text() + "adapter_dirs:\n  - {model: big, path: for-big}\n  - {model: m1, path: for-m1}\n")
    config = load_config(path)
    assert [d.model for d in serving_only(config, ["big"], pinned=True).adapter_dirs] == ["big"]
    assert [d.path.name for d in serving_only(config, ["m1", "m2"], pinned=False).adapter_dirs] == ["for-m1"]


@pytest.mark.parametrize("cluster,message", [
    ("  tensor_parallel: {nope: 2}\n", "cluster.tensor_parallel: no model named 'nope'"),
    ("  max_copies: {nope: 2}\n", "cluster.max_copies: no model named 'nope'"),
    ("  tensor_parallel: {big: 1}\n", "greater than or equal to 2"),
    ("  tensor_parallel: {small: 2}\n", "only a chat model on the vllm engine"),
    ("  tensor_parallel: {undeclared: 2}\n", "declare the model's vram"),
    ("  tensor_parallel: {big: 2}\n  max_copies: {big: 2}\n", "has one copy"),
    ("  nodes: 1\n  replicas_per_node: 2\n  tensor_parallel: {big: 2}\n", "leave none for the other models"),
])
def test_the_cluster_section_is_checked(tmp_path, cluster, message):
    (tmp_path / "small").mkdir()
    extra = ("  - {name: small, kind: chat, path: small, vram: 1GiB, engine: transformers}\n"
             "  - {name: undeclared, kind: chat, path: small, engine: vllm}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(tiers_yaml(tmp_path, cluster, extra))


# --- the early quota refusal, on the real account store -------------------------------------------

def test_the_hops_grpc_messages_fit_the_largest_body_the_server_accepts(tmp_path, monkeypatch):
    """Serve's gRPC message limit between the ingress and the replicas (4 MiB by default, which
    failed 5 MiB uploads) is set in the job's runtime_env above the largest body the tiers.yaml's
    limits accept (a batch file of ``batch.max_file_bytes`` here), never below what a JSON answer
    needs, and a ``RAY_SERVE_*`` variable of the environment still wins."""
    from cluster.app import runtime_env
    from cluster.settings import ANSWER_BYTES, GRPC_MESSAGE

    monkeypatch.delenv(GRPC_MESSAGE, raising=False)
    path = tiers_yaml(tmp_path, "  nodes: 1\n")
    path.write_text(path.read_text() + "limits: {max_body: 1MiB}\nbatch: {max_file_bytes: 300MiB}\n")
    assert int(runtime_env(8000, config=load_config(path))["env_vars"][GRPC_MESSAGE]) > (300 << 20) + (64 << 10)
    assert int(runtime_env()["env_vars"][GRPC_MESSAGE]) == ANSWER_BYTES  # the default limits: 200 MiB files
    monkeypatch.setenv(GRPC_MESSAGE, "12345")
    assert runtime_env(config=load_config(path))["env_vars"][GRPC_MESSAGE] == "12345"


def test_a_restart_right_after_a_stop_starts_at_once_and_names_a_port_in_use(capsys):
    """A restart within a minute of a stop that had connections open found ``cluster.port`` held by
    them (TIME_WAIT). The ingress and Serve's proxy now bind with SO_REUSEADDR, through such
    connections, so ``tiergate cluster`` starts at once (it waited up to 65 s); a port another
    process listens on is named in one line."""
    import socket

    from cluster.cli import check_port, port_state

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the ingress binds
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    assert port_state("127.0.0.1", port) == "in use"
    assert check_port("127.0.0.1", port) == f"port {port} on 127.0.0.1 (cluster.port) is in use by another process"
    assert check_port("127.0.0.1", port, may_be_used=True) is None  # a Serve already running there
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server's side closes first: its end of the connection stays in TIME_WAIT
    client.close()
    listener.close()
    assert port_state("127.0.0.1", port) == "closing"
    assert check_port("127.0.0.1", port) is None
    assert capsys.readouterr().err == ""


def test_a_replacement_ingress_binds_the_port_its_dead_predecessors_connections_still_hold(monkeypatch):
    """Serve's direct ingress bound ``cluster.port`` without SO_REUSEADDR: when an ingress died with
    connections open (TIME_WAIT for a minute), its replacement could not bind the port, Serve took it
    for another service's and never offered it again, and the node's port never answered again
    (hunt CC, finding 1). In the ingress's process Serve now binds with SO_REUSEADDR
    (``cluster.settings.reuse_address``), so a replacement serves on the port at once, while a port
    another process listens on still fails it."""
    import socket

    import httpx
    from ray.serve._private import http_util, replica
    from ray.serve.config import HTTPOptions

    from cluster.settings import reuse_address
    from tests.helpers import spare_port

    for module, name in ((replica, "start_asgi_http_server"), (http_util, "set_socket_reuse_port")):
        monkeypatch.setattr(module, name, getattr(module, name))  # Serve as it was, after the test
    assert reuse_address()  # the installed Serve binds as the patch expects
    port = spare_port()
    url = f"http://127.0.0.1:{port}/"

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def ingress():
        """Serve's direct ingress server on ``port``, as the replica starts it."""
        options = HTTPOptions(host="127.0.0.1", port=port)
        task, server = await replica.start_asgi_http_server(app, options, event_loop=asyncio.get_running_loop())
        while not server.started:
            await asyncio.sleep(0.01)
        return task, server

    async def scenario() -> None:
        task, server = await ingress()
        async with httpx.AsyncClient() as client:  # its connection stays open
            assert (await client.get(url)).status_code == 200
            server.should_exit = True  # the ingress goes with a connection open: its end closes first
            await task
        with socket.socket() as plain, pytest.raises(OSError):  # that connection holds the port (TIME_WAIT)
            plain.bind(("127.0.0.1", port))
        task, server = await ingress()  # the replacement: Serve's RuntimeError "Failed to bind" without the fix
        async with httpx.AsyncClient() as client:
            assert (await client.get(url)).text == "ok"
        with pytest.raises(RuntimeError, match="Failed to bind"):  # a live listener's port is still no one else's
            await ingress()
        server.should_exit = True
        await task

    asyncio.run(scenario())


def test_the_ingress_refuses_a_spent_minute_limit_and_a_spent_budget(tmp_path):
    config = load_config(tiers_yaml(tmp_path, "  nodes: 1\n"))

    async def main():
        accounts = Accounts(config, SQLiteAccounts(tmp_path / "accounts.sqlite3"))
        await accounts.start()
        try:
            per_min, _ = await accounts.create_key("rpm", "paid", {"requests_per_min": 2}, None)
            budget, _ = await accounts.create_key("gpu", "paid", {"gpu_seconds_per_day": 0.5}, None)
            caller = Caller(tier="paid", key_id=per_min.id, rate=RateState())
            for _ in range(2):
                assert await early_refusal(accounts, caller) is None
                assert await accounts.admit(caller, "m1", Ask()) is not None
            over = await early_refusal(accounts, caller)
            assert over is not None and over.status == 429 and over.code == "rate_limit_exceeded"
            assert 1 <= int(over.headers["retry-after"]) <= 31  # one request comes back every 30 s
            assert over.headers["x-ratelimit-remaining-requests"] == "0"

            spender = Caller(tier="paid", key_id=budget.id)
            assert await early_refusal(accounts, spender) is None
            await accounts.store.record(utc_day(time.time()), budget.id, "m1", "paid", Usage(requests=1, gpu_seconds=0.6))
            spent = await early_refusal(accounts, spender)
            assert spent is not None and spent.code == "insufficient_quota" and spent.headers["x-should-retry"] == "false"
            unlimited = Caller(tier="free", key_id="env-key")
            assert await early_refusal(accounts, unlimited) is None
        finally:
            await accounts.stop()

    asyncio.run(main())


def test_the_ingress_refuses_a_limit_under_one_unit_only_when_it_is_spent(tmp_path):
    """A minute limit under one unit (``audio_seconds_per_min: 0.5``) never holds a whole unit: the
    ingress, which does not know a request's cost, refuses early only once the limit is spent, and
    then with a wait (``Retry-After``); a request too large for it is the replica's to refuse."""
    config = load_config(tiers_yaml(tmp_path, "  nodes: 1\n"))

    async def main():
        accounts = Accounts(config, SQLiteAccounts(tmp_path / "accounts.sqlite3"))
        await accounts.start()
        try:
            key, _ = await accounts.create_key("asr", "paid", {"audio_seconds_per_min": 0.5}, None)
            caller = Caller(tier="paid", key_id=key.id, rate=RateState())
            assert await early_refusal(accounts, caller) is None
            assert await accounts.admit(caller, "m1", Ask(audio_seconds=0.5)) is not None
            spent = await early_refusal(accounts, caller)
            assert spent is not None and spent.code == "rate_limit_exceeded" and "try again in" in spent.message
            assert 60 <= int(spent.headers["retry-after"]) <= 120 and "x-should-retry" not in spent.headers
        finally:
            await accounts.stop()

    asyncio.run(main())


@pytest.mark.parametrize("need_admin", [False, True])
def test_the_ingress_metrics_need_an_admin_key_where_configured(tmp_path, monkeypatch, need_admin):
    """``server.metrics_need_admin``: the cluster's /metrics (the ingress's scrape of its replicas)
    answers 401 without a key and 403 to a key that is not an admin's, as tiergate serve's does;
    without it, it is open, as Prometheus endpoints usually are."""
    import types

    import httpx

    import cluster.ingress as ingress

    class Handle:  # a deployment's handle: never called here (the scrape is stood in for)
        def options(self, **_):
            return self

    path = tiers_yaml(tmp_path, "  nodes: 1\n")
    server = "  metrics_need_admin: true\n" if need_admin else ""
    path.write_text(path.read_text() + f"server:\n  loop_stall_s: 0\n{server}")
    context = types.SimpleNamespace(replica_id=types.SimpleNamespace(unique_id="ingress-1"))
    monkeypatch.setattr(ingress.serve, "get_replica_context", lambda: context)
    monkeypatch.setattr(ingress.Ingress, "_scrape", lambda self: asyncio.sleep(0, "tiergate_up 1\n"))
    monkeypatch.setattr(ingress, "reuse_address", lambda: False)  # this process's Serve left as it is
    front = ingress.Ingress(str(path), {"paid": ["k-paid"], "free": ["k-free"]}, ["k-admin"],
                            {"pool": {"models": ["big", "m1", "m2"], "replicas": 1, "handle": Handle()}})

    async def main() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front.asgi), base_url="http://x") as c:
            return [(await c.get("/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})).status_code
                    for key in (None, "k-free", "k-admin")]

    assert asyncio.run(main()) == ([401, 403, 200] if need_admin else [200, 200, 200])


# --- one scrape target --------------------------------------------------------------------------

def _replica_text(admitted: int, waiting: float) -> str:
    registry = CollectorRegistry()
    Counter("tiergate_admitted", "Requests admitted by the gate", ["tier"], registry=registry).labels("paid").inc(admitted)
    Gauge("vllm:num_requests_waiting", "Requests queued", registry=registry).set(waiting)
    Histogram("tiergate_request_seconds", "Latency", ["tier"], registry=registry).labels("paid").observe(0.2)
    return generate_latest(registry).decode()


def test_replicas_metrics_merge_into_one_family_each_with_their_replica_label():
    from prometheus_client.core import GaugeMetricFamily

    own = GaugeMetricFamily("tiergate_ingress_in_flight", "In flight", labels=["tier"])
    own.add_metric(["paid"], 3)
    text = merged([({"replica": "A"}, _replica_text(1, 2)), ({"replica": "B"}, _replica_text(5, 0))], [own]).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert text.count("# TYPE tiergate_admitted_total counter") == 1  # one family, both replicas' samples
    admitted = {s.labels["replica"]: s.value for s in families["tiergate_admitted"].samples
                if s.name == "tiergate_admitted_total"}
    assert admitted == {"A": 1.0, "B": 5.0}
    assert {s.labels["replica"]: s.value for s in families["vllm:num_requests_waiting"].samples} == {"A": 2.0, "B": 0.0}
    counts = [s for s in families["tiergate_request_seconds"].samples if s.name.endswith("_count")]
    assert families["tiergate_request_seconds"].type == "histogram" and len(counts) == 2
    assert [(s.labels, s.value) for s in families["tiergate_ingress_in_flight"].samples] == [({"tier": "paid"}, 3.0)]


# --- a replica sees its GPUs ----------------------------------------------------------------------

def test_a_replica_sees_the_gpus_ray_gave_it(tmp_path, tiny_chat):
    """On CUDA: the pool's replica sees one GPU; with three or more, a tensor-parallel model's
    replica sees two (and none of the pool's). Ray sets each replica's CUDA_VISIBLE_DEVICES to what it reserved."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: a replica's GPUs can only be checked on a machine with one")
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from cluster.app import build, runtime_env

    gpus = torch.cuda.device_count()
    span = "  tensor_parallel: {wide: 2}\n" if gpus >= 3 else ""
    path = tmp_path / "tiers.yaml"
    path.write_text(
        "tiers:\n  - {name: paid, keys_env: K_PAID}\nmodels:\n"
        f"  - {{name: narrow, kind: chat, path: {tiny_chat}, vram: 1GiB, engine: vllm}}\n"
        f"  - {{name: wide, kind: chat, path: {tiny_chat}, vram: 1GiB, engine: vllm}}\n"
        f"cluster:\n  nodes: 1\n  replicas_per_node: {max(gpus, 1)}\n  devices: cuda\n  replica_cpus: 0.5\n" + span)
    config = load_config(path)
    ray.init(address="local", num_gpus=gpus, num_cpus=4, runtime_env=runtime_env(), include_dashboard=False)
    try:
        serve.run(build(config, {"paid": ["k"]}, []), name="gpus", route_prefix="/")
        pool = serve.get_deployment_handle("replica", app_name="gpus")
        seen = pool.devices.remote().result(timeout_s=120)
        assert seen["torch_devices"] == 1 and len(seen["ray_gpu_ids"]) == 1, seen
        if span:
            wide = serve.get_deployment_handle("tp-wide", app_name="gpus").devices.remote().result(timeout_s=120)
            assert wide["torch_devices"] == 2 and len(wide["ray_gpu_ids"]) == 2, wide
            assert set(wide["ray_gpu_ids"]).isdisjoint(seen["ray_gpu_ids"])
    finally:
        serve.shutdown()
        ray.shutdown()


def test_tiergate_cluster_refuses_in_one_line_when_the_proxys_port_is_taken(tmp_path, monkeypatch, capsys):
    """With direct ingress, Serve's proxy binds ``cluster.port + 1`` on the head node: a listener
    there made the start die after ~20 s of Ray with a long traceback, exit 1. ``tiergate cluster``
    checks both of its node's ports before starting Ray, and names the taken one in one line, exit 2."""
    import socket

    from cluster.cli import run
    from tests.helpers import spare_port

    monkeypatch.setenv("K_PAID", "key-paid")
    monkeypatch.delenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", raising=False)
    while True:  # a free port whose next one this test can take
        ingress, listener = spare_port(), socket.socket()
        try:
            listener.bind(("127.0.0.1", ingress + 1))
            break
        except OSError:
            listener.close()
    listener.listen()
    try:
        path = tiers_yaml(tmp_path, f"  nodes: 1\n  host: 127.0.0.1\n  port: {ingress}\n")
        assert run(str(path), None, False) == 2
    finally:
        listener.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tiergate: port {ingress + 1} on 127.0.0.1 (cluster.port + 1, Serve's proxy) is in use by another "
                   "process"]
