"""The llm-d / Gateway API Inference Extension model-server protocol on a real server's /metrics.

The contract is the protocol's document: kubernetes-sigs/gateway-api-inference-extension,
docs/proposals/003-model-server-protocol/README.md ("Metrics Reporting": TotalQueuedRequests,
TotalRunningRequests and KVCacheUtilization are gauges, named in vLLM `vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`; "LoRA Adapter Serving":
`vllm:lora_requests_info`, a gauge whose value is the last update time and whose labels are
`max_lora`, `running_lora_adapters` and `waiting_lora_adapters`). Scraped with prometheus_client's
own parser, as a Prometheus server would read it. tiergate adds `tiergate_model_resident{model}`.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

# name -> (type, label names) as the protocol's document requires them
PROTOCOL = {
    "vllm:num_requests_waiting": ("gauge", set()),
    "vllm:num_requests_running": ("gauge", set()),
    "vllm:kv_cache_usage_perc": ("gauge", set()),
    "vllm:lora_requests_info": ("gauge", {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}),
    "tiergate_model_resident": ("gauge", {"model"}),
}


def scrape(server) -> dict:
    text = httpx.get(f"{server.url}/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families, name, **labels) -> float:
    samples = [s for s in families[name].samples if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(samples) == 1, samples
    return samples[0].value


def test_metrics_follow_the_model_server_protocol(chat_server):
    families = scrape(chat_server)
    for name, (kind, labels) in PROTOCOL.items():
        assert name in families, f"{name} missing from /metrics"
        family = families[name]
        assert family.type == kind, (name, family.type)
        assert family.samples, name
        for sample in family.samples:
            assert set(sample.labels) == labels, (name, sample.labels)
    usage = value(families, "vllm:kv_cache_usage_perc")
    assert 0.0 <= usage <= 1.0
    info = families["vllm:lora_requests_info"].samples[0]
    assert int(info.labels["max_lora"]) >= 1
    assert abs(info.value - time.time()) < 3600  # a wall-clock timestamp, so the picker finds the latest


def test_model_resident_follows_the_arbiter(chat_server):
    admin = {"authorization": f"Bearer {chat_server.keys['admin']}"}
    httpx.post(f"{chat_server.url}/admin/models/tiny-chat/unload", headers=admin)
    assert value(scrape(chat_server), "tiergate_model_resident", model="tiny-chat") in (0.0, 0.5)
    client = openai.OpenAI(base_url=chat_server.base_url, api_key=chat_server.keys["paid"])
    client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert value(scrape(chat_server), "tiergate_model_resident", model="tiny-chat") == 1.0
    assert httpx.post(f"{chat_server.url}/admin/models/tiny-chat/unload", headers=admin).status_code == 200
    assert value(scrape(chat_server), "tiergate_model_resident", model="tiny-chat") == 0.5  # warm in host memory


def test_waiting_and_running_count_the_gates_requests(chat_server):
    """Tickets held and queued at the server's real gate show up in the scrape."""
    gate = chat_server.services.gate

    def acquire():
        return asyncio.run_coroutine_threadsafe(gate.acquire("free", "tiny-chat"), chat_server.loop)

    held = [acquire().result(10) for _ in range(gate.limits["free"])]
    queued = acquire()
    time.sleep(0.2)
    try:
        families = scrape(chat_server)
        assert value(families, "vllm:num_requests_running") == len(held)
        assert value(families, "vllm:num_requests_waiting") == 1
    finally:
        for ticket in held:
            chat_server.call(gate.release, ticket)
        chat_server.call(gate.release, queued.result(10))
    families = scrape(chat_server)
    assert value(families, "vllm:num_requests_running") == 0
    assert value(families, "vllm:num_requests_waiting") == 0


def test_lora_info_names_the_adapters_of_running_and_waiting_requests(chat_server):
    """Requests through the real serving core (gate slot + model lease), with adapter stacks: one
    holding its slot, one queued behind the free tier's limit."""
    from gateway.auth import Caller
    from gateway.serving import Serving

    svc = chat_server.services
    free = Caller(tier="free", key_id="test")
    inside, leave = asyncio.Event(), asyncio.Event()

    async def hold(adapters):
        async with Serving(svc, free, "tiny-chat", 1, "chat", None, adapters=adapters):
            inside.set()
            await leave.wait()

    def start(coro):
        return asyncio.run_coroutine_threadsafe(coro, chat_server.loop)

    limit = svc.gate.limits["free"]
    running = [start(hold(("pirate",)))] + [start(hold(())) for _ in range(limit - 1)]
    deadline = time.time() + 30
    while svc.gate.inflight["free"] < limit and time.time() < deadline:
        time.sleep(0.05)
    waiting = start(hold(("poet", "pirate")))
    time.sleep(0.3)
    try:
        info = scrape(chat_server)["vllm:lora_requests_info"].samples[0].labels
        assert info["running_lora_adapters"] == "pirate"
        assert info["waiting_lora_adapters"] == "pirate,poet"
    finally:
        chat_server.loop.call_soon_threadsafe(leave.set)
        for f in [*running, waiting]:
            f.result(30)
    info = scrape(chat_server)["vllm:lora_requests_info"].samples[0].labels
    assert info["running_lora_adapters"] == info["waiting_lora_adapters"] == ""
