"""tiergate on a local two-node Ray cluster (``ray.cluster_utils.Cluster``): two replicas, one per node (fractional CPU, a simulated 2 GiB budget each,
real arbiters and gates, the tiny demo chat model under three names of 1.5 GiB declared each, so a
replica holds one at a time, and once more as a small model ``s`` for batch lines; a tiny image
model and a tiny speech-to-text model, small beside them), the tier-aware router and the ingress,
through Ray Serve's HTTP proxy with the openai SDK (realtime sessions included), keys, quotas and
the batch backlog in a real Redis. The cluster starts once for the module; the scenarios run in order.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from ray.cluster_utils import Cluster  # noqa: E402

from accounts.redis_store import RedisAccounts  # noqa: E402
from cluster.app import build, runtime_env  # noqa: E402
from gateway.config import load_config  # noqa: E402
from tests.helpers import TIERS, spare_port  # noqa: E402
from tests.test_batch_store import redis_server  # noqa: E402

KEYS = {t: [f"key-{t}"] for t in TIERS}
ADMIN = "key-admin"
PERIOD_S = 0.5  # how often replicas report to the router here
WINDOW_S = 30  # protect_window_s
RECLAIM_S = 2.0  # batch.reclaim_after_s: a dead replica's batch lines run elsewhere after this


PAGE = "http://page.example"  # the web page origin the clusters allow (server.cors_origins)


def config_text(models: dict[str, Path], period: float, redis_url: str | None = None, replicas: tuple[int, int] = (2, 1),
                paid_target_s: float = 600, slots: int = 8, max_copies: str = "{}", small: Path | None = None,
                image: Path | None = None, stt: Path | None = None, embed: Path | None = None,
                rerank: Path | None = None) -> str:
    lines = ["tiers:"]
    for t in TIERS:
        target = paid_target_s if t == "paid" else 600
        lines += [f"  - name: {t}", f"    keys_env: TEST_KEYS_{t.upper()}", "    max_inflight: 4",
                  "    max_queued: 16", f"    latency_target_s: {target}"] + (["    batch: true"] if t == "batch" else [])
    lines.append("models:")
    for name, path in models.items():
        lines += [f"  - name: {name}", "    kind: chat", f"    path: {path}", "    vram: 1536MiB",
                  "    engine: transformers"] + (["    aliases: [gpt-4o-mini]"] if name == "c" else [])
    if small is not None:  # fits beside any one of the others
        lines += ["  - name: s", "    kind: chat", f"    path: {small}", "    vram: 256MiB", "    engine: transformers"]
    if image is not None:  # fits beside one of the big ones and s
        lines += ["  - name: img", "    kind: image", f"    path: {image}", "    vram: 128MiB"]
    if stt is not None:
        lines += ["  - name: stt", "    kind: stt", f"    path: {stt}", "    vram: 64MiB"]
    if embed is not None:
        lines += ["  - name: emb", "    kind: embed", f"    path: {embed}", "    vram: 16MiB"]
    if rerank is not None:
        lines += ["  - name: rr", "    kind: rerank", f"    path: {rerank}", "    vram: 16MiB"]
    nodes, per_node = replicas
    lines += ["gpu:", "  device: cpu", "  vram_budget: 2GiB", "  host_cache_budget: 4GiB",
              f"eviction:\n  protect_window_s: {WINDOW_S}",
              f"gate:\n  slots: {slots}",
              "limits:\n  max_chat_tokens: 512",
              f"server:\n  cors_origins: [{PAGE}]",
              f"batch:\n  reclaim_after_s: {RECLAIM_S}\n  concurrency: 1",
              "cluster:", f"  nodes: {nodes}", f"  replicas_per_node: {per_node}", "  devices: cpu",
              f"  replica_cpus: {0.5 if nodes * per_node <= 2 else 0.25}",
              f"  stats_period_s: {period}", f"  max_copies: {max_copies}"]
    if redis_url is not None:
        lines.append(f"  redis_url: {redis_url}")
    return "\n".join(lines) + "\n"


INGRESS_PORTS = 8  # both simulated nodes are this machine: each app's ingress replicas take a port each


@pytest.fixture(scope="module")
def cluster(tiny_chat, tiny_image, tiny_stt, tiny_embed, tiny_rerank, tmp_path_factory):
    """Two simulated nodes, the main application at ``url`` (its ingress's own port: Serve's direct
    ingress, as ``tiergate cluster`` runs it) and the others under a prefix of Serve's proxy."""
    ingress_port = spare_port_range(INGRESS_PORTS)
    port = next(p for p in iter(spare_port, None) if not ingress_port <= p < ingress_port + INGRESS_PORTS)
    folder = tmp_path_factory.mktemp("cluster")
    env = runtime_env(ingress_port, INGRESS_PORTS)
    with redis_server(tmp_path_factory.mktemp("redis")) as redis_url:
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        nodes.add_node(num_cpus=2)
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, runtime_env=env, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})

        def deploy(name: str, prefix: str, **kw) -> None:
            path = folder / f"{name}.yaml"
            path.write_text(config_text({"a": tiny_chat, "b": tiny_chat, "c": tiny_chat}, **kw))
            serve.run(build(load_config(path), KEYS, [ADMIN]), name=name, route_prefix=prefix)

        deploy("tiergate", "/", period=PERIOD_S, redis_url=redis_url, small=tiny_chat, image=tiny_image, stt=tiny_stt,
               embed=tiny_embed, rerank=tiny_rerank)
        # the redirect test's: its replicas report as they start, then an hour apart (a minute
        # apart could bring a fresh report between that test's two requests: ~2 s in 60)
        deploy("stale", "/stale", period=3600.0, replicas=(1, 2))  # one node: one ingress replica, not two
        time.sleep(2 * PERIOD_S + 0.5)  # the first reports
        main = ingress_ports("tiergate")
        assert len(main) == 2 and port not in main  # one ingress per node, each on its own port
        yield type("Cluster", (), {"url": f"http://127.0.0.1:{min(main)}", "proxy": f"http://127.0.0.1:{port}",
                                   "redis_url": redis_url, "deploy": deploy, "folder": folder})
        serve.shutdown()
        ray.shutdown()
        nodes.shutdown()


def spare_port_range(n: int) -> int:
    """The first of ``n`` consecutive ports free now."""
    while True:
        first = spare_port()
        if first + n < 65536 and all(_free(first + i) for i in range(1, n)):
            return first


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ingress_ports(app: str) -> list[int]:
    """The HTTP ports the application's ingress replicas serve on (Serve's target groups)."""
    details = serve.context._get_global_client().get_serve_details()
    return sorted(t["port"] for g in details["target_groups"]
                  if g["app_name"] == app and g["protocol"] == "HTTP" for t in g["targets"])


def chat(cluster, model: str, tier: str, prefix: str = "", **kw) -> httpx.Response:
    return httpx.post(f"{cluster.proxy + prefix if prefix else cluster.url}/v1/chat/completions", timeout=60,
                      headers={"authorization": f"Bearer key-{tier}"},
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw})


def replica(response: httpx.Response) -> str:
    return response.headers["x-tiergate-replica"]


def settle():
    time.sleep(2 * PERIOD_S + 0.2)  # the router sees the new places


def test_placement_eviction_and_cluster_wide_429(cluster):
    first = chat(cluster, "a", "free")
    assert first.status_code == 200, first.text
    settle()
    again = chat(cluster, "a", "free")
    assert replica(again) == replica(first)  # where a is resident
    b = chat(cluster, "b", "free")
    assert b.status_code == 200 and replica(b) != replica(first)  # fits on the empty replica: nobody evicted
    assert b.headers["x-tiergate-node"] != first.headers["x-tiergate-node"]  # one replica per node
    settle()
    # both replicas hold a model the free tier used within the window: c for free is a 429 for the
    # whole cluster, with Retry-After the earliest protection end (a's, served first)
    refused = chat(cluster, "c", "free")
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "model_protected"
    assert 1 <= int(refused.headers["retry-after"]) <= WINDOW_S
    # paid may evict a free tier's model: c loads in place of one of them, and the other stays
    paid = chat(cluster, "c", "paid")
    assert paid.status_code == 200, paid.text
    settle()
    a_now, b_now = chat(cluster, "a", "subscriber"), chat(cluster, "b", "subscriber")
    served = {r.status_code for r in (a_now, b_now)}
    assert 200 in served  # the one paid did not evict is still served
    evicted = a_now if a_now.status_code != 200 else b_now
    assert evicted.status_code == 429  # a subscriber may not evict paid's c, nor the other free model


def test_sse_streaming_through_the_ingress_with_the_openai_sdk(cluster):
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="key-paid", max_retries=0)
    stream = client.chat.completions.create(model="c", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=8, temperature=0, stream=True)  # greedy: text, no early EOS
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def ws_url(cluster, query: str = "?model=c") -> str:
    return cluster.url.replace("http", "ws") + "/v1/realtime" + query


def test_a_realtime_conversation_through_the_ingress(cluster):
    """The Realtime API's WebSocket through the ingress, with the openai SDK's realtime client: a
    text turn on c is answered as a greedy chat completion over the same conversation answers it
    (the cluster has no speech-out model: text replies only), on the replica where c is
    resident, through the ingress's port and Serve's proxy alike; the replica and the ingress count
    the session while it is open, and neither once its client is gone without a close; the key is
    checked at the ingress."""
    import websockets

    from tests.test_realtime import events_until

    turn = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where is the gold?"}]
    expected = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="key-paid", max_retries=0).chat.completions.create(
        model="c", messages=turn, max_tokens=12, temperature=0)
    holder = replica(chat(cluster, "c", "paid"))

    async def conversation():
        client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="key-paid", max_retries=0)
        async with client.realtime.connect(model="c") as conn:
            created = (await events_until(conn, "session.created"))[-1]
            await conn.session.update(session={"type": "realtime", "instructions": turn[0]["content"],
                                               "max_output_tokens": 12, "output_modalities": ["text"]})
            await events_until(conn, "session.updated")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": turn[1]["content"]}]})
            await conn.response.create()
            return created, await events_until(conn, "response.done")

    async def raw():
        async with websockets.connect(ws_url(cluster), additional_headers={"Authorization": "Bearer key-subscriber"}) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            during = await asyncio.to_thread(scrape, cluster)
            return ws.response.headers, during

    async def refused(headers: dict, query: str = "?model=c"):
        with pytest.raises(websockets.exceptions.InvalidStatus) as denied:
            async with websockets.connect(ws_url(cluster, query), additional_headers=headers):
                pass
        return denied.value.response

    created, reply = asyncio.run(conversation())
    assert created.session.model == "c"
    text = "".join(e.delta for e in reply if e.type == "response.output_text.delta")
    assert reply[-1].response.status in ("completed", "incomplete")  # (max_output_tokens may cut it)
    assert text == expected.choices[0].message.content
    headers, during = asyncio.run(raw())
    assert headers["x-tiergate-replica"] == holder  # the session ran where c is resident
    assert sum(s.value for s in during["tiergate_realtime_sessions"] if s.labels["tier"] == "subscriber") == 1
    open_now = {s.labels["tier"]: s.value for s in during["tiergate_ingress_realtime_sessions"]}
    assert open_now["subscriber"] == 1 and open_now["paid"] == 0

    async def dropped():  # a client that vanishes without a close: its session ends on the replica too
        ws = await websockets.connect(ws_url(cluster), additional_headers={"Authorization": "Bearer key-subscriber"})
        assert json.loads(await ws.recv())["type"] == "session.created"
        ws.transport.abort()

    def open_sessions() -> tuple[float, float]:
        families = scrape(cluster)
        return (sum(s.value for s in families["tiergate_realtime_sessions"] if s.labels["tier"] == "subscriber"),
                sum(s.value for s in families["tiergate_ingress_realtime_sessions"] if s.labels["tier"] == "subscriber"))

    asyncio.run(dropped())
    for _ in range(50):
        if open_sessions() == (0, 0):
            break
        time.sleep(0.1)
    assert open_sessions() == (0, 0)  # on the replica, and through the ingress

    async def through_the_proxy():  # Serve's HTTP proxy (the fallback port) hands it to an ingress the same way
        async with websockets.connect(cluster.proxy.replace("http", "ws") + "/v1/realtime?model=c",
                                      additional_headers={"Authorization": "Bearer key-paid"}) as ws:
            return ws.response.headers["x-tiergate-replica"], json.loads(await ws.recv())["type"]

    assert asyncio.run(through_the_proxy()) == (holder, "session.created")
    nobody = asyncio.run(refused({"Authorization": "Bearer key-nobody"}))
    assert nobody.status_code == 401 and json.loads(nobody.body)["error"]["code"] == "invalid_api_key"
    secret = asyncio.run(refused({"Authorization": "Bearer ek_made-by-no-replica"}))  # a replica's answer
    assert secret.status_code == 401 and "client secret" in json.loads(secret.body)["error"]["message"]
    unknown = asyncio.run(refused({"Authorization": "Bearer key-paid"}, "?model=no-such-model"))
    assert unknown.status_code == 404 and json.loads(unknown.body)["error"]["param"] == "model"  # a replica's answer


def test_a_client_secret_opens_sessions_on_the_replica_that_made_it(cluster):
    """A client secret lives in the memory of the replica that made it: every session it opens,
    through the ingress, goes there (its id names it: ``gateway.origin``) and starts with its
    settings. The secret is made where its session's model is resident, and the test picks a
    model resident on the replica that Serve does not give calls that need no model (the first
    test left a big model resident on each), so its sessions, routed as such a call, would fail."""
    import websockets

    default = replica(httpx.get(f"{cluster.url}/v1/models", headers={"authorization": "Bearer key-paid"}, timeout=30))
    holders = {s.labels["model"]: s.labels["replica"] for s in scrape(cluster)["tiergate_model_resident"] if s.value == 1}
    model = next(m for m, where in sorted(holders.items()) if where != default and m in ("a", "b", "c"))
    made = httpx.post(f"{cluster.url}/v1/realtime/client_secrets", headers={"authorization": "Bearer key-paid"}, timeout=60,
                      json={"session": {"type": "realtime", "model": model, "instructions": "Be brief.",
                                        "output_modalities": ["text"]}})
    assert made.status_code == 200, made.text
    value, maker = made.json()["value"], replica(made)
    assert maker == holders[model] != default

    async def sessions(n: int) -> list[tuple[str, dict]]:
        out = []
        for i in range(n):  # as a browser sends it (a subprotocol), and as a header
            how = {"subprotocols": ["realtime", f"openai-insecure-api-key.{value}"]} if i % 2 else \
                {"additional_headers": {"Authorization": f"Bearer {value}"}}
            async with websockets.connect(ws_url(cluster, f"?model={model}"), **how) as ws:
                out.append((ws.response.headers["x-tiergate-replica"], json.loads(await ws.recv())))
        return out

    opened = asyncio.run(sessions(6))
    assert [where for where, _ in opened] == [maker] * 6
    assert all(e["type"] == "session.created" and e["session"]["instructions"] == "Be brief." for _, e in opened)


def test_serve_settings_reach_the_replicas(cluster):
    """tiergate's Ray Serve settings (``cluster.settings``) travel in the job's runtime_env and are
    what Serve read in each replica's and ingress's process, not Serve's defaults; the ingress calls
    the replicas over gRPC and binds its port with SO_REUSEADDR (``cluster.settings.reuse_address``)."""
    from cluster.settings import ANSWER_BYTES, GRPC_MESSAGE, INGRESS_SETTINGS, SERVE_SETTINGS

    for name in ("tiergate", "stale"):
        seen = serve.get_deployment_handle("replica", app_name=name).serve_settings.remote().result(timeout_s=30)
        assert seen == {"RAY_SERVE_USE_GRPC_BY_DEFAULT": True, "RAY_SERVE_ENABLE_DIRECT_INGRESS": True,
                        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": 60.0,
                        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": True,  # Serve's defaults in the replicas
                        "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": True,
                        GRPC_MESSAGE: ANSWER_BYTES}  # the default limits' largest body (200 MiB files) is less
        assert seen.keys() >= SERVE_SETTINGS.keys() | INGRESS_SETTINGS.keys()
        ingress = serve.get_deployment_handle("ingress", app_name=name).serve_settings.remote().result(timeout_s=30)
        assert ingress == {**seen, "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": False,  # the ingress's own
                           "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": False,
                           "replica_calls": ["grpc"],  # its handles were made in the driver, by reference
                           "reuses_address": True}


def freezes(app: str, want: set[str] | int) -> dict[str, int]:
    """Each replica's freeze count, asked through a handle (one replica per call) until the
    replicas ``want`` names (or that many) have answered."""
    handle = serve.get_deployment_handle("replica", app_name=app)
    seen: dict[str, int] = {}
    for _ in range(40):
        answer = handle.collector_freezes.remote().result(timeout_s=60)
        seen[answer["replica"]] = answer["freezes"]
        if (want <= seen.keys()) if isinstance(want, set) else len(seen) >= want:
            break
    return seen


def test_replicas_freeze_their_long_lived_objects(cluster):
    """Each replica runs the collector as ``tiergate serve`` does (gateway/collector.py): frozen at
    start, and again after the first load of a worker class: the replica that served a chat
    request has frozen at least twice. The second application's replicas have had no request
    yet: their apps started with them (Serve's health check), so they froze at start too."""
    untouched = freezes("stale", 2)
    assert len(untouched) == 2 and set(untouched.values()) == {1}, untouched
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="key-paid", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="c", messages=[{"role": "user", "content": "hi"}],
                                                           max_tokens=2)
    served_by = raw.headers["x-tiergate-replica"]
    seen = freezes("tiergate", {served_by})
    assert all(n >= 1 for n in seen.values()), seen
    assert seen[served_by] >= 2, seen


def test_other_endpoints_and_one_request_id(cluster):
    models = httpx.get(f"{cluster.url}/v1/models", headers={"authorization": "Bearer key-free"})
    assert models.status_code == 200 and {m["id"] for m in models.json()["data"]} >= {"a", "b", "c"}
    r = httpx.post(f"{cluster.url}/v1/chat/completions", headers={"authorization": "Bearer key-paid",
                   "x-request-id": "trace-42"}, json={"model": "c", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["trace-42"]
    bad = httpx.post(f"{cluster.url}/v1/chat/completions", headers={"authorization": "Bearer key-paid"},
                     content=b"{not json", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


def test_each_request_is_logged_by_its_replica(cluster):
    """A replica writes ``tiergate serve``'s request line for each request it serves (Serve's
    access log is off), on its stderr, which Ray sends to the driver's output and keeps in the
    worker's log file: it names the request's id and its caller."""
    import uuid

    probe = f"probe-{uuid.uuid4().hex}"
    r = httpx.get(f"{cluster.url}/v1/models", headers={"authorization": "Bearer key-free", "x-request-id": probe})
    assert r.status_code == 200
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    deadline = time.monotonic() + 20
    while not (lines := [line for f in logs.glob("worker-*.err") for line in f.read_text(errors="replace").splitlines()
                         if probe in line]):
        assert time.monotonic() < deadline, "no replica logged the request"
        time.sleep(0.5)
    assert len(lines) == 1 and "tiergate.requests" in lines[0] and "status=200" in lines[0] and "tier=free" in lines[0]


def test_anthropics_messages_through_the_ingress(cluster):
    """The Messages API through the ingress with the anthropic SDK, which sends its key as
    x-api-key: whole, streamed (Anthropic's events, relayed as they come), and a bad key refused
    at the ingress."""
    import anthropic

    c = anthropic.Anthropic(base_url=cluster.url, api_key="key-paid", max_retries=0, timeout=60)
    kw = dict(model="c", max_tokens=4, messages=[{"role": "user", "content": "hi"}], extra_body={"temperature": 0})
    whole = c.messages.create(**kw)
    assert whole.type == "message" and whole.usage.output_tokens == 4 and whole.stop_reason == "max_tokens"
    with c.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == whole.content[0].text
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=cluster.url, api_key="nobody", max_retries=0).messages.create(**kw)


def test_embeddings_rerank_and_score_through_the_ingress(cluster):
    """The encoders route by their body's model as chat does: the openai SDK's embeddings, a rerank
    and a score, each answered by a replica, the same as one replica answers them alone; an unknown
    encoder is the ingress's 404 and a bad document the replica's 400, both OpenAI-shaped."""
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="key-paid", max_retries=0)
    vectors = client.embeddings.create(model="emb", input=["paid first", "batch waits"])
    assert [len(d.embedding) for d in vectors.data] == [len(vectors.data[0].embedding)] * 2
    assert vectors.usage.prompt_tokens > 0
    auth = {"authorization": "Bearer key-paid"}
    docs = ["Paid requests go first.", "A fox ran.", "Batch work waits for idle time."]
    ranked = httpx.post(f"{cluster.url}/v1/rerank", headers=auth, timeout=60,
                        json={"model": "rr", "query": "which tier comes first?", "documents": docs, "top_n": 2})
    assert ranked.status_code == 200, ranked.text
    results = ranked.json()["results"]
    assert len(results) == 2 and results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert "x-tiergate-replica" in ranked.headers
    scored = httpx.post(f"{cluster.url}/v1/score", headers=auth, timeout=60,
                        json={"model": "rr", "text_1": "which tier comes first?", "text_2": docs})
    assert scored.status_code == 200, scored.text
    by_index = {r["index"]: r["relevance_score"] for r in results}
    for item in scored.json()["data"]:  # the same pairs scored by either endpoint, on either replica
        if item["index"] in by_index:
            assert abs(item["score"] - by_index[item["index"]]) < 1e-5
    cosine = httpx.post(f"{cluster.url}/v1/score", headers=auth, timeout=60,
                        json={"model": "emb", "text_1": "paid first", "text_2": "paid first"})
    assert cosine.status_code == 200 and abs(cosine.json()["data"][0]["score"] - 1) < 1e-4, cosine.text
    missing = httpx.post(f"{cluster.url}/v1/rerank", headers=auth, timeout=30,
                         json={"model": "no-such-reranker", "query": "q", "documents": ["d"]})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(f"{cluster.url}/v1/rerank", headers=auth, timeout=30,
                     json={"model": "rr", "query": "q", "documents": ["d", " "]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents[1]", bad.text


def test_cors_through_the_ingress(cluster):
    """``server.cors_origins`` in cluster mode: the ingress answers a browser's preflight (which
    carries no key) and puts the CORS headers on its own refusals, so a page reads a 401 as such; a
    replica's answer carries them once; another origin's preflight is refused."""
    page = {"origin": PAGE}
    pre = httpx.options(f"{cluster.url}/v1/chat/completions", timeout=30, headers={
        **page, "access-control-request-method": "POST", "access-control-request-headers": "authorization, content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == PAGE, (pre.status_code, pre.headers)
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    body = {"model": "c", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused = httpx.post(f"{cluster.url}/v1/chat/completions", headers={**page, "authorization": "Bearer nobody"},
                         json=body, timeout=30)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == PAGE
    assert "x-request-id" in refused.headers["access-control-expose-headers"]
    ok = httpx.post(f"{cluster.url}/v1/chat/completions", headers={**page, "authorization": "Bearer key-paid"},
                    json=body, timeout=60)
    assert ok.status_code == 200 and ok.headers.get_list("access-control-allow-origin") == [PAGE]
    assert "retry-after" in ok.headers["access-control-expose-headers"]
    other = httpx.options(f"{cluster.url}/v1/chat/completions", timeout=30, headers={
        "origin": "http://elsewhere.example", "access-control-request-method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_ingress_refuses_before_any_replica(cluster):
    assert chat(cluster, "a", "nobody").status_code == 401
    missing = chat(cluster, "no-such-model", "paid")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    aliased = chat(cluster, "gpt-4o-mini", "paid")  # routed as its model, c (tiers.yaml's aliases)
    assert aliased.status_code == 200, aliased.text


def test_multipart_uploads_route_by_their_model_part(cluster):
    """The ingress reads a form's model from its 'model' part (uploads are not JSON): an unknown one
    is its own 404, a known one goes to a replica, which judges the rest (here: a chat model cannot
    transcribe or edit images); a batch file, which names no model, is stored by any replica."""
    paid = {"authorization": "Bearer key-paid"}
    png = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                        "1f15c4890000000d49444154789c6360000000000500010d0a2db40000000049454e44ae426082")
    for path, files in (("/v1/audio/transcriptions", {"file": ("a.wav", b"RIFF")}),
                        ("/v1/images/edits", {"image": ("a.png", png)})):
        data = {"prompt": "a cat"} if "images" in path else {}
        missing = httpx.post(f"{cluster.url}{path}", headers=paid, files=files, data={"model": "nope", **data}, timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model", missing.text
        assert "x-tiergate-replica" not in missing.headers  # refused at the ingress
        wrong = httpx.post(f"{cluster.url}{path}", headers=paid, files=files, data={"model": "a", **data}, timeout=60)
        assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "model_not_supported", wrong.text
        assert wrong.headers["x-tiergate-replica"]
    stored = httpx.post(f"{cluster.url}/v1/files", headers=paid, data={"purpose": "batch"}, timeout=60,
                        files={"file": ("b.jsonl", b'{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", '
                                                   b'"body": {"model": "a", "messages": []}}\n')})
    assert stored.status_code == 200 and stored.json()["id"].startswith("file-"), stored.text


def test_a_file_uploaded_in_parts_through_the_ingress(cluster, tmp_path):
    """The Uploads API through the ingress: the parts name no model, so they may reach any replica;
    the upload and its parts are in Redis, and the file the last call makes is one file."""
    c = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="key-paid", max_retries=0, timeout=60)
    line = {"custom_id": "1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    content = "".join(json.dumps({**line, "custom_id": str(i)}) + "\n" for i in range(6)).encode()
    path = tmp_path / "in.jsonl"
    path.write_bytes(content)
    upload = c.uploads.upload_file_chunked(file=path, mime_type="application/jsonl", purpose="batch", part_size=100)
    assert upload.status == "completed" and upload.file.bytes == len(content)
    assert c.files.content(upload.file.id).content == content


def test_bodies_past_grpcs_4_mib_cross_the_hop_both_ways(cluster):
    """A body over gRPC's default 4 MiB message crosses the hop between the ingress and a replica
    as on ``tiergate serve``: a 6 MiB file is uploaded and read back whole, a 5 MiB JSON body
    reaches the replica (which judges it: 400, not the ingress's 500), and a body past the largest
    any endpoint accepts is refused at the ingress with 413."""
    c = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="key-paid", max_retries=0, timeout=120)
    content = bytes(range(256)) * (6 * 4096)  # 6 MiB
    stored = c.files.create(file=("big.bin", content), purpose="user_data")
    assert stored.bytes == len(content)
    assert c.files.content(stored.id).content == content
    c.files.delete(stored.id)
    big = {"model": "c", "input": "x" * (5 << 20)}  # c, resident since the first test, embeds nothing
    judged = httpx.post(f"{cluster.url}/v1/embeddings", headers={"authorization": "Bearer key-paid"}, json=big,
                        timeout=120)
    assert judged.status_code == 400 and judged.headers["x-tiergate-replica"], judged.text[:300]
    import socket  # a client that declares 300 MiB (and sends none of it): httpx would not

    port = int(cluster.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer key-paid\r\n"
                  b"content-type: application/json\r\ncontent-length: %d\r\n\r\n{" % (300 << 20))
        answer = b""
        while b"request_too_large" not in answer and (got := s.recv(65536)):
            answer += got
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer, answer[:500]


def test_background_responses_through_the_ingress(cluster):
    """A background response is answered queued by the replica that takes it, runs there, and is
    read (and cancelled, and a streamed one followed again) through the ingress, whichever replica
    answers: the records and events are in Redis, and a cancel that lands on another replica is
    written there for the running one to find."""
    c = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="key-paid", max_retries=0, timeout=60)
    # on "c", resident since the first test, so that the residency the later tests expect stays as it is
    made = c.responses.create(model="c", input="hi", max_output_tokens=4, background=True, temperature=0)
    assert made.status == "queued"
    deadline = time.monotonic() + 60
    while (done := c.responses.retrieve(made.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, done
        time.sleep(0.1)
    assert done.status in ("completed", "incomplete") and done.output_text
    assert c.responses.cancel(made.id).status == done.status
    # greedy "tell me" runs the whole 480 tokens (the mid-stream test's); a sampled reply of the
    # random model may end at once, before the cancel (seen once: "completed")
    long = c.responses.create(model="c", input="tell me", max_output_tokens=480, background=True,
                              temperature=0)  # within the 512 context
    assert c.responses.cancel(long.id).status in ("cancelled", "queued", "in_progress")  # here: at once; elsewhere: by its next write
    deadline = time.monotonic() + 20
    while (r := c.responses.retrieve(long.id)).status != "cancelled":
        assert r.status in ("queued", "in_progress") and time.monotonic() < deadline, r
        time.sleep(0.2)
    time.sleep(1)
    assert c.responses.retrieve(long.id).status == "cancelled"
    # streamed in the background: left after its first events, followed again through the ingress
    # from whichever replica answers (from Redis where it does not run)
    with c.responses.create(model="c", input="Count", max_output_tokens=32, background=True, stream=True,
                            temperature=0) as stream:
        first = [event for _, event in zip(range(3), stream)]
    rid = first[0].response.id
    rest = list(c.responses.retrieve(rid, stream=True, starting_after=2))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == c.responses.retrieve(rid).output_text


def test_stored_chat_completions_and_conversations_through_the_ingress(cluster):
    """A chat completion stored by the replica that made it is read, listed, changed and deleted
    through the ingress, whichever replica answers, and a conversation one replica made is read
    and added to by any: the stores are the shared Redis."""
    c = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="key-paid", max_retries=0, timeout=60)
    made = c.chat.completions.create(model="c", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                     store=True, metadata={"via": "cluster"})
    for _ in range(4):  # (GETs go to any replica)
        assert c.chat.completions.retrieve(made.id).choices[0].message.content == made.choices[0].message.content
    assert made.id in [x.id for x in c.chat.completions.list(metadata={"via": "cluster"})]
    assert c.chat.completions.update(made.id, metadata={"via": "changed"}).metadata == {"via": "changed"}
    assert c.chat.completions.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.retrieve(made.id)
    conv = c.conversations.create(items=[{"type": "message", "role": "user", "content": "hi"}])
    replies = [c.responses.create(model="c", input="more", max_output_tokens=2, conversation=conv.id) for _ in range(2)]
    for _ in range(4):
        listed = [i.id for i in c.conversations.items.list(conv.id, order="asc")]
        assert len(listed) == 5 and [listed[2], listed[4]] == [r.output[0].id for r in replies]


def scrape(cluster, prefix: str = "") -> dict[str, list]:
    """The cluster's /metrics, parsed by prometheus_client: family name -> samples."""
    response = httpx.get(f"{cluster.proxy + prefix if prefix else cluster.url}/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(response.text)}


def test_one_metrics_target_for_the_whole_cluster(cluster):
    """GET /metrics on the ingress: both replicas' series, each with its replica label, and the
    ingress's own, in Prometheus text that its parser reads."""
    assert chat(cluster, "c", "paid").status_code == 200
    families = scrape(cluster)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "tiergate_model_resident", "tiergate_admitted"):
        assert len({s.labels["replica"] for s in families[name]}) == 2, name
    ingress = {s.labels["ingress"] for s in families["tiergate_ingress_in_flight"]}
    lag = families["tiergate_event_loop_lag_seconds"]  # every event loop watched: the replicas' and the ingress's
    assert {s.labels["ingress"] for s in lag if "ingress" in s.labels} == ingress
    assert len({s.labels["replica"] for s in lag if "replica" in s.labels}) == 2
    assert any(s.name.endswith("_count") and s.value > 0 and "ingress" in s.labels for s in lag)
    resident = {(s.labels["replica"], s.labels["model"]): s.value for s in families["tiergate_model_resident"]}
    assert sorted(m for (_, m), v in resident.items() if v == 1) == ["a", "c", "emb", "rr"]  # as tests left them
    nodes = {s.labels["node"] for s in families["vllm:num_requests_running"]}
    assert len(nodes) == 2  # one replica per node
    assert len(ingress) == 1  # the answering ingress's own (one ingress per node: each counts its own)
    assert {s.labels["tier"] for s in families["tiergate_ingress_in_flight"]} == set(TIERS)
    for path in ("/healthz", "/health"):  # liveness, unauthenticated, as `tiergate serve` answers it
        assert httpx.get(f"{cluster.url}{path}", timeout=30).json() == {"status": "ok"}, path


def test_an_image_url_is_read_back_from_the_replica_that_made_it(cluster):
    """An image url's file is kept by the replica that made it: every fetch through the ingress
    goes there (its id names it), and another key still gets a 404. (After the metrics test,
    which counts the models resident.)"""
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="key-paid", max_retries=0)
    made = client.images.with_raw_response.generate(model="img", prompt="a cat", size="32x32", response_format="url",
                                                    extra_body={"num_inference_steps": 2, "seed": 3})
    url, maker = made.parse().data[0].url, made.headers["x-tiergate-replica"]
    assert url.startswith(f"{cluster.url}/v1/images/files/img-{maker}~")
    fetched = [httpx.get(url, headers={"authorization": "Bearer key-paid"}, timeout=30) for _ in range(6)]
    assert [(r.status_code, replica(r)) for r in fetched] == [(200, maker)] * 6
    assert len({r.content for r in fetched}) == 1 and fetched[0].headers["content-type"] == "image/png"
    assert httpx.get(url, headers={"authorization": "Bearer key-free"}, timeout=30).status_code == 404


def test_a_transcription_session_through_the_ingress(cluster):
    """A transcription session (the URL names no model: the first speech-to-text model) fed as a
    microphone feeds it (40 ms frames: many client messages per call to the replica), then
    committed: transcribed as /v1/audio/transcriptions transcribes the same audio through the
    cluster. (After the metrics test.)"""
    import numpy as np

    from tests.helpers import spoken
    from tests.test_realtime import RATE, b64, events_until, wav_of

    speech = np.concatenate([np.zeros(RATE // 4, np.float32), spoken("Hello from the cluster.", rate=RATE)])
    manual = {"type": "transcription", "audio": {"input": {"transcription": {"model": "stt", "language": "en"},
                                                           "turn_detection": None}}}

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="key-subscriber", max_retries=0)
        async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
            created = (await events_until(conn, "session.created"))[-1]
            await conn.session.update(session=manual)
            await events_until(conn, "session.updated")
            for i in range(0, len(speech), 960):
                await conn.input_audio_buffer.append(audio=b64(speech[i:i + 960]))
            await conn.input_audio_buffer.commit()
            return created, await events_until(conn, "conversation.item.input_audio_transcription.completed")

    created, events = asyncio.run(run())
    assert created.session.type == "transcription" and created.session.audio.input.transcription.model == "stt"
    http = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="key-subscriber", max_retries=0)
    expected = http.audio.transcriptions.create(model="stt", file=("a.wav", wav_of(speech)), language="en").text
    assert events[-1].transcript == expected and expected
    assert events[-1].usage.seconds == pytest.approx(len(speech) / RATE, abs=1e-3)  # every frame arrived (and in order: the text)


def admitted(cluster) -> float:
    return sum(s.value for s in scrape(cluster)["tiergate_admitted"] if s.name == "tiergate_admitted_total")


def test_quota_refused_at_the_ingress_before_any_replica(cluster):
    """A managed key over its requests per minute, and one over its daily GPU budget: the ingress
    answers 429 itself (every replica's answer names its replica; this one does not, and no
    replica admitted anything more), with OpenAI's codes."""
    def key(limits: dict) -> str:
        made = httpx.post(f"{cluster.url}/admin/keys", headers={"authorization": f"Bearer {ADMIN}"},
                          json={"name": "quota", "tier": "paid", "limits": limits}, timeout=30)
        assert made.status_code == 201, made.text
        return made.json()["value"]

    per_min, budget = key({"requests_per_min": 2}), key({"gpu_seconds_per_day": 0.0001})
    time.sleep(1.5)  # accounts.refresh_s is 0.5 s

    def ask(secret: str) -> httpx.Response:
        return httpx.post(f"{cluster.url}/v1/chat/completions", headers={"authorization": f"Bearer {secret}"},
                          json={"model": "c", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                          timeout=60)

    assert [ask(per_min).status_code for _ in range(2)] == [200, 200]
    assert ask(budget).status_code == 200  # the request that crosses the budget completes
    before = admitted(cluster)
    over = ask(per_min)
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded", over.text
    assert 1 <= int(over.headers["retry-after"]) <= 60 and "x-tiergate-replica" not in over.headers
    assert over.headers["x-ratelimit-remaining-requests"] == "0"
    spent = ask(budget)
    assert spent.status_code == 429 and spent.json()["error"]["code"] == "insufficient_quota", spent.text
    assert spent.headers["x-should-retry"] == "false" and "x-tiergate-replica" not in spent.headers
    assert admitted(cluster) == before  # no replica saw either


def test_managed_keys_reach_the_ingress_and_every_replica(cluster):
    """A key made through the ingress (on whichever replica) is known to the ingress and the
    replicas within a refresh; its model allow-list is applied at the ingress."""
    made = httpx.post(f"{cluster.url}/admin/keys", headers={"authorization": f"Bearer {ADMIN}"},
                      json={"name": "team", "tier": "paid", "models": ["c"]}, timeout=30)
    assert made.status_code == 201, made.text
    time.sleep(1.5)  # accounts.refresh_s is 0.5 s
    key = made.json()["value"]
    headers = {"authorization": f"Bearer {key}"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ok = httpx.post(f"{cluster.url}/v1/chat/completions", headers=headers, json={"model": "c", **body}, timeout=60)
    assert ok.status_code == 200, ok.text
    hidden = httpx.post(f"{cluster.url}/v1/chat/completions", headers=headers, json={"model": "a", **body})
    assert hidden.status_code == 404 and "x-tiergate-replica" not in hidden.headers  # refused at the ingress


def test_stale_stats_redirect(cluster):
    """On the second application (its own two replicas) reports come an hour apart: its fresh
    replicas report both empty; a then b for free both rank
    the same replica first; it holds a (protected for free) by then, so it answers "redirect" and
    b lands on the other replica."""
    a = chat(cluster, "a", "free", prefix="/stale")
    b = chat(cluster, "b", "free", prefix="/stale")
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.headers["x-tiergate-redirects"] == "0"
    assert b.headers["x-tiergate-redirects"] == "1"
    assert replica(b) != replica(a)


def test_a_drain_lets_streams_finish_and_refuses_new_requests(cluster):
    """``tiergate cluster`` on SIGTERM drains as ``tiergate serve`` does (``cluster.cli.drain``;
    here on the second application, which no test uses after this one but to delete it): while a stream is in
    flight, a new request is refused 503 ``shutting_down``, the stream runs to its end
    (``[DONE]``, not cut), and the drain returns once it has, with nothing cut."""
    import threading

    from cluster.cli import drain

    url = f"{cluster.proxy}/stale/v1"
    paid = {"authorization": "Bearer key-paid"}
    body = {"model": "a", "messages": [{"role": "user", "content": "count"}], "max_tokens": 400, "stream": True}
    drained = threading.Thread(target=drain, args=(load_config(cluster.folder / "stale.yaml"), "stale"))
    with httpx.stream("POST", f"{url}/chat/completions", headers=paid, json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # in flight
        drained.start()
        deadline = time.monotonic() + 30
        while (refused := httpx.get(f"{url}/models", headers=paid, timeout=30)).status_code != 503:
            assert time.monotonic() < deadline, refused.text
            time.sleep(0.2)
        assert refused.json()["error"]["code"] == "shutting_down"
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    drained.join(timeout=60)
    assert not drained.is_alive()


def test_a_replica_killed_mid_stream(cluster):
    """The client gets a clean error (the SDK raises it; a realtime session on that replica gets an
    error event and a close), and the next request is served by a replica that is alive (reported:
    how long after the kill). Serve starts a replica in the dead
    one's place while the next test deploys its application: the last test waits for it."""
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="key-paid", max_retries=0)
    long = dict(model="c", messages=[{"role": "user", "content": "tell me"}], max_tokens=480, temperature=0)
    assert client.chat.completions.create(**long).choices[0].finish_reason == "length"  # it runs the full length
    stream = client.chat.completions.create(**long, stream=True)
    victim = stream.response.headers["x-tiergate-replica"]
    chunks = iter(stream)
    next(chunks)

    def kill() -> float:
        killed = time.monotonic()
        ray.kill(ray.get_actor(f"SERVE_REPLICA::tiergate#replica#{victim}", namespace="serve"), no_restart=True)
        with pytest.raises(openai.APIError, match="replica serving this request failed"):
            for _ in chunks:
                pass
        return killed

    async def a_realtime_session_through_the_kill():
        """A realtime session open on the same replica: an error event, then a close (1011)."""
        import websockets

        async with websockets.connect(ws_url(cluster), additional_headers={"Authorization": "Bearer key-paid"}) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            where = ws.response.headers["x-tiergate-replica"]
            killed = await asyncio.to_thread(kill)
            events = []
            with pytest.raises(websockets.exceptions.ConnectionClosedError) as closed:
                async with asyncio.timeout(30):
                    while True:
                        events.append(json.loads(await ws.recv()))
            return killed, where, events, closed.value.rcvd.code

    killed, where, events, code = asyncio.run(a_realtime_session_through_the_kill())
    assert where == victim
    assert [e["error"]["code"] for e in events if e["type"] == "error"] == ["replica_failed"] and code == 1011
    for attempt in range(20):
        after = chat(cluster, "c", "paid")
        if after.status_code == 200:
            break
        time.sleep(0.25)
    assert after.status_code == 200, after.text
    assert replica(after) != victim
    print(f"served again {time.monotonic() - killed:.2f} s after the kill, after {attempt} refusals")


def test_a_hot_model_loads_a_second_copy_and_no_more_than_max_copies(cluster, tiny_chat):
    """Three replicas with one gate slot each, paid's latency target 1 ms and ``max_copies: {a: 2}``:
    four clients ask for long paid replies of ``a`` back to back (6 s, or until a second copy has
    loaded and 3 s more: up to 40 s on a loaded machine). A replica running one predicts a
    paid wait past the target (the rest of that reply) until it ends, so ``a`` loads on a second
    replica; with both past it, requests go to those two (whose gates may answer 429), never to the
    third, which stays empty."""
    serve.delete("stale")  # its test is over: room for this application's replicas
    cluster.deploy("copies", "/copies", period=0.25, replicas=(1, 3), paid_target_s=0.001, slots=1,
                   max_copies="{a: 2}")
    time.sleep(1.0)

    def holders() -> set[str]:
        return {s.labels["replica"] for s in scrape(cluster, "/copies")["tiergate_model_resident"]
                if s.labels["model"] == "a" and s.value == 1}

    async def scenario(at_least: float, at_most: float, after_second: float) -> tuple[list[set[str]], Counter]:
        """Ask for ``at_least`` seconds, longer while no second copy has loaded (up to ``at_most``:
        a loaded machine loads slowly), and ``after_second`` seconds more once one has."""
        answered: Counter = Counter()
        body = {"model": "a", "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 480,
                "temperature": 0}
        stop = asyncio.Event()

        async def asker(client: httpx.AsyncClient) -> None:
            while not stop.is_set():
                r = await client.post("/v1/chat/completions", json=body)
                answered[r.status_code] += 1
                if r.status_code != 200:
                    await asyncio.sleep(0.1)

        async with httpx.AsyncClient(base_url=f"{cluster.proxy}/copies", timeout=120,
                                     headers={"authorization": "Bearer key-paid"}) as client:
            start = time.monotonic()
            until = start + at_most
            askers = [asyncio.create_task(asker(client)) for _ in range(4)]
            seen = []
            while time.monotonic() < until:
                await asyncio.sleep(0.5)
                seen.append(await asyncio.to_thread(holders))
                if len(set().union(*seen)) >= 2:
                    until = min(until, max(start + at_least, time.monotonic() + after_second))
            stop.set()
            await asyncio.gather(*askers)
        return seen, answered

    try:
        seen, answered = asyncio.run(scenario(6.0, 40.0, 3.0))
        time.sleep(1.0)  # the replies have ended and the reports say so: every wait is 0 again
        by_key: dict[str, set[str]] = {}
        for i in range(16):  # the prompt_cache_key's replica, of the two holding a (the router's affinity)
            key = f"conversation-{i % 8}"
            r = chat(cluster, "a", "paid", "/copies", prompt_cache_key=key)
            assert r.status_code == 200, r.text
            by_key.setdefault(key, set()).add(replica(r))
            # four report periods: a report still showing this request in flight would give its replica
            # a wait past the affinity's slack, and the next key for it would go to the other (with two
            # periods this failed in about one full run in ten on a loaded machine, twice by 2026-12-06)
            time.sleep(1.0)
    finally:
        serve.delete("copies")
    print("replicas holding a, scraped every 0.5 s:", [len(h) for h in seen], "answers:", dict(answered))
    assert answered[200] >= 2
    assert all(len(h) <= 2 for h in seen)
    assert len(set().union(*seen)) == 2  # a second copy loaded, and never a third
    print("replicas by prompt_cache_key:", by_key)
    assert all(len(where) == 1 for where in by_key.values())  # each key kept to one replica
    assert len(set().union(*by_key.values())) == 2  # the keys spread over both copies


def test_a_replica_killed_mid_batch(cluster, tiny_chat):
    """Both replicas pull a batch's lines from Redis (one at a time each); the actor of one that
    holds a claimed line is killed (``ray.kill``) after the first lines are done. After
    ``batch.reclaim_after_s`` the other replica (or the replacement Serve starts) reclaims the dead
    one's line: every line has exactly one result, none failed, and the engines completed exactly
    as many executions as there are lines (the usage metered in Redis, batch tier). It starts
    once Serve runs two replicas again (the one it started after the mid-stream kill may have had
    no request yet: it pulls lines all the same). Each line writes all its 256 tokens (its end of
    text barred by ``logit_bias``), so that both replicas are seen holding one: 48 tokens with an
    early end of text made the whole batch a fraction of a second on a fast machine."""
    from transformers import AutoTokenizer

    no_end = {str(AutoTokenizer.from_pretrained(tiny_chat).eos_token_id): -100}
    deadline = time.monotonic() + 300
    while len(live_replicas("tiergate")) < 2:  # (Serve's status says RUNNING for a while after a kill)
        assert time.monotonic() < deadline, "Serve did not replace the replica the mid-stream test killed"
        time.sleep(0.5)
    n = 6
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="key-paid", max_retries=0)
    rows = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "s", "messages": [{"role": "user", "content": f"count {i}"}], "max_tokens": 256,
                      "temperature": 0, "logit_bias": no_end}} for i in range(n)]
    content = "".join(json.dumps(r) + "\n" for r in rows).encode()
    file = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline:
        done = client.batches.retrieve(batch.id).request_counts.completed
        holders = asyncio.run(claimed_by(cluster.redis_url))
        if done >= 1 and len(holders) == 2:  # both replicas run lines: one is killed, one goes on
            victim = holders[0]
        time.sleep(0.05)
    assert victim is not None, "two replicas were never seen holding a line each"
    actor = next(a for a in ray._private.state.actors(actor_state_name="ALIVE").values() if a["Pid"] == victim)
    assert actor["Name"].startswith("SERVE_REPLICA::tiergate#replica#")
    ray.kill(ray.get_actor(actor["Name"], namespace="serve"), no_restart=True)
    killed = time.monotonic()
    while client.batches.retrieve(batch.id).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() - killed < 180, "the batch did not finish"
        time.sleep(0.5)
    final = client.batches.retrieve(batch.id)
    assert final.status == "completed" and final.request_counts.completed == n and final.request_counts.failed == 0
    results = Counter(json.loads(x)["custom_id"] for x in client.files.content(final.output_file_id).text.splitlines())
    assert results == Counter({f"line-{i}": 1 for i in range(n)})
    assert asyncio.run(batch_executions(cluster.redis_url, "s")) == n
    print(f"finished {time.monotonic() - killed:.1f} s after the kill")


def live_replicas(app: str) -> set[int]:
    """The pids of the application's ``replica`` replicas that Serve reports running and Ray
    reports alive: Serve's own status goes on counting a killed replica until its controller
    notices, so a test that needs the replacement waits for it here."""
    details = serve.context._get_global_client().get_serve_details()
    running = {r["pid"] for r in details["applications"][app]["deployments"]["replica"]["replicas"]
               if r["state"] == "RUNNING"}
    alive = {a["Pid"] for a in ray._private.state.actors(actor_state_name="ALIVE").values()}
    return running & alive


async def claimed_by(redis_url: str) -> list[int]:
    """The pids of the processes (replicas) that hold claimed, unfinished batch lines, most first."""
    import redis.asyncio as aioredis

    r = aioredis.from_url(redis_url)
    try:
        held: Counter[int] = Counter()
        for stream in await r.keys("tg:backlog:*"):
            for c in await r.xinfo_consumers(stream, "runners"):
                if c["pending"]:
                    name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
                    held[int(name.split(":")[1])] += c["pending"]
        return [pid for pid, _ in held.most_common()]
    finally:
        await r.aclose()


async def batch_executions(redis_url: str, model: str) -> int:
    """Requests the batch tier completed on ``model``, as metered in the shared usage store."""
    store = RedisAccounts(redis_url)
    await store.open()
    try:
        return sum(row.usage.requests for row in await store.usage(None, model, None, None) if row.tier == "batch")
    finally:
        await store.close()
