"""The arbiter behind real HTTP: batch work yields to paid work and completes with its full
output, protection answers 429 with Retry-After, OOM in a step is relieved and retried."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch

from tests.helpers import start_server, write_config


def two_model_server(tmp_path, tiny_chat, budget="5GiB", window=1):
    cfg = write_config(tmp_path, {"x": ("chat", tiny_chat), "y": ("chat", tiny_chat)})
    text = cfg.read_text().replace("    path: ", "    vram: 4GiB\n    path: ")
    text = text.replace("vram_budget: 4GiB", f"vram_budget: {budget}\neviction:\n  protect_window_s: {window}")
    cfg.write_text(text)
    return start_server(cfg)


def places(server):
    return server.call(lambda: {n: s.place for n, s in server.services.arbiter.states.items()})


def stream_tokens(server, key, model, max_tokens, out: list, started: threading.Event):
    with httpx.stream("POST", f"{server.base_url}/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {server.keys[key]}"},
                      json={"model": model, "messages": [{"role": "user", "content": "batch job"}],
                            "max_tokens": max_tokens, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    out.append((time.monotonic(), chunk["choices"][0]["delta"]["content"]))
                    started.set()


def greedy_text(server, model, max_tokens):
    """An uninterrupted run at the batch tier (which protects the model against no one)."""
    c = openai.OpenAI(base_url=server.base_url, api_key=server.keys["batch"], max_retries=0)
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "batch job"}],
                                  max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content


@pytest.mark.parametrize("paid_model", ["x", "y"])
def test_batch_pauses_for_paid_and_completes_with_full_output(tmp_path, tiny_chat, paid_model):
    """paid on the same model: the batch row pauses in place. paid on another model that only
    fits by evicting the batch job's model: the batch work pauses, its model goes warm, and it
    comes back (and the work resumes) once the paid work is done."""
    server = two_model_server(tmp_path, tiny_chat)
    try:
        expected = greedy_text(server, "x", 300)
        pauses_before = server.services.arbiter.counters.batch_pauses
        got, started = [], threading.Event()
        t = threading.Thread(target=stream_tokens, args=(server, "batch", "x", 300, got, started))
        t.start()
        assert started.wait(30)
        paid = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0)
        first_paid = None
        for chunk in paid.chat.completions.create(model=paid_model, messages=[{"role": "user", "content": "now"}],
                                                  max_tokens=150, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content and first_paid is None:
                first_paid = time.monotonic()  # paid is running: the batch work has been told to pause
        t1 = time.monotonic()
        assert first_paid is not None
        if paid_model == "y":
            assert server.services.arbiter.counters.evictions.get(("x", "make_room")) == 1
        t.join(120)
        assert not t.is_alive()
        text = "".join(piece for _, piece in got)
        assert text == expected  # nothing lost, nothing repeated
        assert server.services.arbiter.counters.batch_pauses > pauses_before
        # while the paid request ran, the batch stream was (almost) silent: at most the step in flight
        during = [ts for ts, _ in got if first_paid + 0.05 < ts < t1]
        assert len(during) <= 2, len(during)
        assert places(server)["x"] == "resident"
    finally:
        server.stop()


def test_protected_model_answers_429_with_retry_after_then_serves(tmp_path, tiny_chat):
    server = two_model_server(tmp_path, tiny_chat, window=2)
    try:
        paid = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0)
        paid.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}], max_tokens=2)
        r = httpx.post(f"{server.base_url}/chat/completions", headers={"Authorization": f"Bearer {server.keys['free']}"},
                       json={"model": "y", "messages": [{"role": "user", "content": "b"}], "max_tokens": 2})
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "model_protected"
        assert 1 <= int(r.headers["retry-after"]) <= 2
        assert r.headers["x-ratelimit-remaining-requests"] == "0"  # a refused request has no room left
        assert r.headers["x-ratelimit-reset-requests"] == f"{r.headers['retry-after']}s"
        assert places(server) == {"x": "resident", "y": "cold"}
        time.sleep(int(r.headers["retry-after"]) + 0.1)
        free = openai.OpenAI(base_url=server.base_url, api_key=server.keys["free"], max_retries=0)
        free.chat.completions.create(model="y", messages=[{"role": "user", "content": "b"}], max_tokens=2)
        assert places(server) == {"x": "warm", "y": "resident"}
        models = {m.id: m.model_extra for m in free.models.list().data}
        assert models["y"]["last_tier"] == "free" and models["x"]["place"] == "warm"
    finally:
        server.stop()


def test_oom_during_a_step_evicts_another_model_and_retries(tmp_path, tiny_chat):
    server = two_model_server(tmp_path, tiny_chat, budget="10GiB", window=0)
    try:
        c = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0)
        for m in ("y", "x"):
            c.chat.completions.create(model=m, messages=[{"role": "user", "content": "a"}], max_tokens=2)
        worker = server.services.arbiter.workers["x"]
        real_chat = worker.chat
        calls = []

        def chat_oom_once(req):
            calls.append(1)
            if len(calls) == 1:
                async def boom():
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")
                    yield  # pragma: no cover
                return boom()
            return real_chat(req)

        worker.chat = chat_oom_once
        r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "b"}], max_tokens=3)
        # the retry ran the request whole: it ended as any reply does (random weights may draw EOS early)
        assert len(calls) == 2 and r.choices[0].finish_reason in ("stop", "length")
        assert 1 <= r.usage.completion_tokens <= 3  # an EOS drawn as the third token is "stop" with 3 (it counts)
        assert r.choices[0].finish_reason == "stop" or r.usage.completion_tokens == 3
        assert server.services.arbiter.counters.evictions.get(("y", "oom")) == 1
        deadline = time.time() + 10
        while places(server)["y"] != "warm" and time.time() < deadline:
            time.sleep(0.05)
        assert places(server) == {"x": "resident", "y": "warm"}
    finally:
        server.stop()
