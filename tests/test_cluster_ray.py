"""tiergate on a local two-node Ray cluster (``ray.cluster_utils.Cluster``): two replicas, one per node (fractional CPU, a simulated 2 GiB budget each,
real arbiters and gates, the tiny demo chat model under three names of 1.5 GiB declared each, so a
replica holds one at a time), the tier-aware router and the ingress, through Ray Serve's HTTP
proxy with the openai SDK. The cluster starts once for the module; the scenarios run in order.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from ray.cluster_utils import Cluster  # noqa: E402

from cluster.app import build, runtime_env  # noqa: E402
from gateway.config import load_config  # noqa: E402
from tests.helpers import TIERS, spare_port  # noqa: E402

KEYS = {t: [f"key-{t}"] for t in TIERS}
ADMIN = "key-admin"
PERIOD_S = 0.5  # how often replicas report to the router here
WINDOW_S = 30  # protect_window_s


def config_text(models: dict[str, Path], period: float) -> str:
    lines = ["tiers:"]
    for t in TIERS:
        lines += [f"  - name: {t}", f"    keys_env: TEST_KEYS_{t.upper()}", "    max_inflight: 4",
                  "    max_queued: 16", "    latency_target_s: 600"] + (["    batch: true"] if t == "batch" else [])
    lines.append("models:")
    for name, path in models.items():
        lines += [f"  - name: {name}", "    kind: chat", f"    path: {path}", "    vram: 1536MiB",
                  "    engine: transformers"]
    lines += ["gpu:", "  device: cpu", "  vram_budget: 2GiB", "  host_cache_budget: 4GiB",
              f"eviction:\n  protect_window_s: {WINDOW_S}",
              "limits:\n  max_chat_tokens: 512",
              "cluster:", "  nodes: 2", "  replicas_per_node: 1", "  devices: cpu", "  replica_cpus: 0.5",
              f"  stats_period_s: {period}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def cluster(tiny_chat, tmp_path_factory):
    port = spare_port()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    nodes.add_node(num_cpus=2)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, runtime_env=runtime_env(), log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    folder = tmp_path_factory.mktemp("cluster")

    def deploy(name: str, prefix: str, period: float) -> None:
        path = folder / f"{name}.yaml"
        path.write_text(config_text({"a": tiny_chat, "b": tiny_chat, "c": tiny_chat}, period))
        serve.run(build(load_config(path), KEYS, [ADMIN]), name=name, route_prefix=prefix)

    deploy("tiergate", "/", PERIOD_S)
    deploy("stale", "/stale", 60.0)  # reports a minute apart: the redirect test's
    time.sleep(2 * PERIOD_S + 0.5)  # the first reports
    yield type("Cluster", (), {"url": f"http://127.0.0.1:{port}"})
    serve.shutdown()
    ray.shutdown()
    nodes.shutdown()


def chat(cluster, model: str, tier: str, prefix: str = "", **kw) -> httpx.Response:
    return httpx.post(f"{cluster.url}{prefix}/v1/chat/completions", timeout=60,
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
                                            max_tokens=8, stream=True)
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


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


def test_ingress_refuses_before_any_replica(cluster):
    assert chat(cluster, "a", "nobody").status_code == 401
    missing = chat(cluster, "no-such-model", "paid")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


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
    """On the second application (its own two replicas) reports come a minute apart: its fresh
    replicas report both empty; a then b for free both rank
    the same replica first; it holds a (protected for free) by then, so it answers "redirect" and
    b lands on the other replica."""
    a = chat(cluster, "a", "free", prefix="/stale")
    b = chat(cluster, "b", "free", prefix="/stale")
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.headers["x-tiergate-redirects"] == "0"
    assert b.headers["x-tiergate-redirects"] == "1"
    assert replica(b) != replica(a)


def test_a_replica_killed_mid_stream(cluster):
    """The client gets a clean error (the SDK raises it), and the next request is served by a
    replica that is alive (reported: how long after the kill)."""
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="key-paid", max_retries=0)
    long = dict(model="c", messages=[{"role": "user", "content": "tell me"}], max_tokens=480, temperature=0)
    assert client.chat.completions.create(**long).choices[0].finish_reason == "length"  # it runs the full length
    stream = client.chat.completions.create(**long, stream=True)
    victim = stream.response.headers["x-tiergate-replica"]
    chunks = iter(stream)
    next(chunks)
    killed = time.monotonic()
    ray.kill(ray.get_actor(f"SERVE_REPLICA::tiergate#replica#{victim}", namespace="serve"), no_restart=True)
    with pytest.raises(openai.APIError, match="replica serving this request failed"):
        for _ in chunks:
            pass
    for attempt in range(20):
        after = chat(cluster, "c", "paid")
        if after.status_code == 200:
            break
        time.sleep(0.25)
    assert after.status_code == 200, after.text
    assert replica(after) != victim
    print(f"served again {time.monotonic() - killed:.2f} s after the kill, after {attempt} refusals")
