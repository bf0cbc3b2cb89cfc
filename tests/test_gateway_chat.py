"""The chat API through the official openai SDK and raw HTTP against a real uvicorn."""

from __future__ import annotations

import json

import time

import httpx
import openai
import pytest


def client(server, tier="paid", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, **kw)


def test_sdk_chat_non_streaming(chat_server):
    r = client(chat_server).chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, seed=7)
    assert r.object == "chat.completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    again = client(chat_server).chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, seed=7)
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # the transformers engine keeps no prefix cache


def test_sdk_chat_streaming_with_usage(chat_server):
    stream = client(chat_server).chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Hello"}], max_completion_tokens=6,
        seed=3, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    # the same request without streaming gives the same text (same seed)
    whole = client(chat_server).chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Hello"}], max_completion_tokens=6, seed=3)
    assert whole.choices[0].message.content == text


def test_stream_ends_with_done(chat_server):
    with httpx.stream("POST", f"{chat_server.base_url}/chat/completions",
                      headers={"Authorization": f"Bearer {chat_server.keys['free']}"},
                      json={"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}],
                            "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert "x-ratelimit-limit-requests" in r.headers
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)


def test_seed_and_temperature(chat_server):
    c = client(chat_server)
    msgs = [{"role": "user", "content": "Tell me"}]
    a = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=12, seed=11, temperature=1.0)
    b = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=12, seed=11, temperature=1.0)
    d = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=12, seed=12, temperature=1.0)
    assert a.choices[0].message.content == b.choices[0].message.content
    g1 = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=12, temperature=0)
    g2 = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=12, temperature=0, seed=99)
    assert g1.choices[0].message.content == g2.choices[0].message.content  # greedy ignores the seed
    assert len({a.choices[0].message.content, d.choices[0].message.content, g1.choices[0].message.content}) >= 2


def test_stop_sequence_cuts_output(chat_server):
    c = client(chat_server)
    msgs = [{"role": "user", "content": "Count"}]
    full = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=24, temperature=0).choices[0].message.content
    # pick a stop string from the middle of the greedy output
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop
    cut = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(stop)]


def test_models_list(chat_server):
    models = client(chat_server).models.list()
    row = next(m for m in models.data if m.id == "tiny-chat")
    assert row.model_extra["kind"] == "chat"
    assert row.model_extra["place"] in ("resident", "warm", "cold")


def _post(server, body, key="paid", raw=None, headers=None):
    h = {"Authorization": f"Bearer {server.keys[key]}"} if key else {}
    h.update(headers or {})
    return httpx.post(f"{server.base_url}/chat/completions", headers=h,
                      content=raw if raw is not None else json.dumps(body))


def _error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["code"], str) and err["message"]
    if code:
        assert err["code"] == code
    assert err["param"] == param
    return err


GOOD = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("body,param", [
    ({**GOOD, "temperature": 5}, "temperature"),
    ({**GOOD, "top_p": 0}, "top_p"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_tokens": 65}, "max_tokens"),  # above limits.max_chat_tokens
    ({**GOOD, "messages": []}, "messages"),
    ({**GOOD, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({**GOOD, "messages": [{"role": "user"}]}, "messages[0].content"),
    # a part's own problem, not the content's "not a valid string"
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({**GOOD, "messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    ({**GOOD, "messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": 5}]},
                           {"role": "user", "content": "hi"}]}, "messages[0].content[0].refusal"),
    ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**GOOD, "stop": ""}, "stop"),
    ({**GOOD, "n": 5}, "n"),  # above limits.max_n (4)
    ({**GOOD, "bogus": 1}, "bogus"),
    ({k: v for k, v in GOOD.items() if k != "model"}, "model"),
    ({**GOOD, "max_completion_tokens": 1}, "max_tokens"),  # both: OpenAI's invalid_parameter_combination
    ({**GOOD, "stream_options": {"include_usage": True}}, "stream_options"),  # without stream (OpenAI's, vLLM's)
])
def test_bad_fields_are_400_with_param(chat_server, body, param):
    _error(_post(chat_server, body), 400, param=param)


def test_a_part_the_chat_models_cannot_read_is_named(chat_server):
    """A part of a type no chat model here reads: a 400 naming the part's type, where pydantic
    alone would say the content is "not a valid string"; audio for a model that has no model to
    hear it (tests/test_input_audio.py has one that has), a file part with a URL (documents are
    sent, not fetched: tests/test_input_files.py), and an image part for this text-only model
    (tests/test_vision.py has the models that read them) are each named; text parts are read as
    before."""
    content = [{"type": "text", "text": "what is this?"}, {"type": "input_video", "input_video": {"url": "data:,x"}}]
    err = _error(_post(chat_server, {**GOOD, "messages": [{"role": "user", "content": content}]}), 400,
                 "invalid_value", "messages[0].content")
    assert "content parts of type 'input_video' are not supported" in err["message"]
    for kind, code, param in [("input_audio", "audio_input_not_supported", "messages[0].content"),
                              ("file", "unknown_parameter", "messages[0].content[1].file.url")]:
        content = [{"type": "text", "text": "what is this?"}, {"type": kind, kind: {"url": "data:,x"}}]
        _error(_post(chat_server, {**GOOD, "messages": [{"role": "user", "content": content}]}), 400, code, param)
    content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,x"}}]
    err = _error(_post(chat_server, {**GOOD, "messages": [{"role": "user", "content": content}]}), 400,
                 "image_input_not_supported", "messages[0].content[1].type")
    assert "reads text only" in err["message"]
    ok = _post(chat_server, {**GOOD, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert ok.status_code == 200, ok.text


def test_an_assistant_refusal_part_goes_back_as_history_unrendered(chat_server):
    """OpenAI's assistant content may hold ``refusal`` parts (a refusal sent back as history):
    accepted and not rendered (the prompt is that of the text parts alone); in a user message
    it is a 400 on that message's content."""
    def turn(parts: list) -> list:
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": parts},
                {"role": "user", "content": "why?"}]

    refused = _post(chat_server, {**GOOD, "messages": turn([{"type": "text", "text": "No."},
                                                              {"type": "refusal", "refusal": "I can't help with that."}])})
    plain = _post(chat_server, {**GOOD, "messages": turn([{"type": "text", "text": "No."}])})
    assert refused.status_code == plain.status_code == 200, refused.text
    assert refused.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    err = _error(_post(chat_server, {**GOOD, "messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]}),
                 400, "invalid_value", "messages[0].content")
    assert "only for assistant messages" in err["message"]


def test_an_assistant_message_dumped_by_the_sdk_goes_back_as_history(chat_server):
    """``messages.append(reply.choices[0].message.model_dump())``: the SDK's message dumped whole
    carries ``annotations`` (a reply's citations; null here) and ``audio``, ``function_call``,
    ``tool_calls`` null: accepted, the prompt that of the message's role and content alone.
    ``annotations`` on a user message is a 400 naming it."""
    from openai.types.chat import ChatCompletionMessage

    reply = _post(chat_server, GOOD)
    assert reply.status_code == 200, reply.text
    dumped = ChatCompletionMessage.model_validate(reply.json()["choices"][0]["message"]).model_dump()
    assert "annotations" in dumped
    cited = {**dumped, "annotations": [{"type": "url_citation", "url_citation": {
        "url": "https://example.com", "title": "t", "start_index": 0, "end_index": 1}}]}
    plain = {"role": "assistant", "content": dumped["content"]}
    asked = [{"role": "user", "content": "why?"}]
    answers = [_post(chat_server, {**GOOD, "messages": GOOD["messages"] + [m] + asked}) for m in (dumped, cited, plain)]
    assert [a.status_code for a in answers] == [200] * 3, answers[0].text
    assert len({a.json()["usage"]["prompt_tokens"] for a in answers}) == 1
    _error(_post(chat_server, {**GOOD, "messages": [{"role": "user", "content": "hi", "annotations": []}]}),
           400, "invalid_value", "messages[0].annotations")


def test_context_too_long_is_400(chat_server):
    body = {**GOOD, "messages": [{"role": "user", "content": "word " * 600}], "max_tokens": 8}
    _error(_post(chat_server, body), 400, "context_length_exceeded", "messages")


def test_bad_json_is_400(chat_server):
    _error(_post(chat_server, None, raw=b"{not json"), 400, "invalid_json")
    _error(_post(chat_server, None, raw=b"[1, 2]"), 400, "invalid_json")


def test_auth_errors_are_401(chat_server):
    _error(_post(chat_server, GOOD, key=None), 401, "missing_api_key")
    _error(_post(chat_server, GOOD, key=None, headers={"Authorization": "Bearer nope"}), 401, "invalid_api_key")
    _error(_post(chat_server, GOOD, key=None, headers={"Authorization": "Basic abc"}), 401, "missing_api_key")
    _error(httpx.get(f"{chat_server.base_url}/models"), 401, "missing_api_key")


def test_unknown_model_and_route_are_404(chat_server):
    _error(_post(chat_server, {**GOOD, "model": "gpt-9"}), 404, "model_not_found", "model")
    _error(httpx.get(f"{chat_server.url}/v1/nothing-here"), 404, "not_found")


def test_wrong_method_is_405(chat_server):
    _error(httpx.put(f"{chat_server.base_url}/chat/completions"), 405, "method_not_allowed")  # (GET lists stored ones)


def test_body_over_cap_is_413(chat_server):
    big = {**GOOD, "messages": [{"role": "user", "content": "x" * 70_000}]}
    _error(_post(chat_server, big), 413, "request_too_large")


def test_keys_are_not_logged(chat_server, caplog):
    caplog.set_level("DEBUG")
    _post(chat_server, GOOD)
    _post(chat_server, GOOD, key=None, headers={"Authorization": "Bearer secret-wrong-key"})
    assert chat_server.keys["paid"] not in caplog.text
    assert "secret-wrong-key" not in caplog.text


def test_healthz_and_metrics(chat_server):
    assert httpx.get(f"{chat_server.url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{chat_server.url}/health").json() == {"status": "ok"}  # where probes written for vLLM look
    _post(chat_server, GOOD, key="subscriber")
    text = httpx.get(f"{chat_server.url}/metrics").text
    for name in ("tiergate_admitted_total", "tiergate_rejected_total", "tiergate_queued", "tiergate_in_flight",
                 "tiergate_request_seconds_bucket", "tiergate_queue_wait_seconds_bucket"):
        assert name in text
    admitted = [ln for ln in text.splitlines() if ln.startswith('tiergate_admitted_total{tier="subscriber"}')]
    assert admitted and float(admitted[0].split()[-1]) >= 1


def test_metrics_need_an_admin_key_where_configured(chat_server, monkeypatch):
    """/metrics is open (as Prometheus endpoints usually are); with ``server.metrics_need_admin``
    it answers 401 without a key and 403 to a key that is not an admin's, as /admin/* does."""
    def statuses() -> list[int]:
        return [httpx.get(f"{chat_server.url}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {},
                          timeout=30).status_code for key in (None, chat_server.keys["paid"], chat_server.keys["admin"])]

    assert statuses() == [200, 200, 200]
    config = chat_server.services.config
    monkeypatch.setattr(chat_server.services, "config", config.model_copy(
        update={"server": config.server.model_copy(update={"metrics_need_admin": True})}))
    assert statuses() == [401, 403, 200]


def test_the_prefix_cache_salt_is_the_callers_key_unless_shared(chat_server, monkeypatch):
    """``ChatRequest.cache_salt`` (what vLLM scopes its prefix cache by) is the calling key's id
    with ``server.prefix_cache: per_key`` (the default), and None with ``shared``."""
    from gateway.auth import key_id

    assert _post(chat_server, GOOD).status_code == 200  # the model resident, its worker made
    worker = chat_server.services.arbiter.workers["tiny-chat"]
    salts, chat = [], worker.chat
    monkeypatch.setattr(worker, "chat", lambda req: salts.append(req.cache_salt) or chat(req))
    assert _post(chat_server, GOOD, key="free").status_code == 200
    config = chat_server.services.config
    monkeypatch.setattr(chat_server.services, "config", config.model_copy(
        update={"server": config.server.model_copy(update={"prefix_cache": "shared"})}))
    assert _post(chat_server, GOOD, key="free").status_code == 200
    assert salts == [key_id(chat_server.keys["free"]), None]


def test_tokens_are_counted_in_metrics_as_in_usage(chat_server):
    """``tiergate_tokens_total{model, tier, type}`` grows by each request's prompt and completion
    tokens (its usage); no cached tokens on the transformers engine, so no such series grows."""
    from prometheus_client.parser import text_string_to_metric_families

    def tokens() -> dict[tuple[str, str, str], float]:
        text = httpx.get(f"{chat_server.url}/metrics").text
        [family] = [f for f in text_string_to_metric_families(text) if f.name == "tiergate_tokens"]
        return {(s.labels["model"], s.labels["tier"], s.labels["type"]): s.value for s in family.samples
                if s.name == "tiergate_tokens_total"}

    before = tokens()
    used = [_post(chat_server, {**GOOD, "max_tokens": n}, key="free").json()["usage"] for n in (2, 3)]
    want = {"prompt": sum(u["prompt_tokens"] for u in used), "completion": sum(u["completion_tokens"] for u in used)}
    deadline = time.time() + 10  # counted as the request's slot is given back, just after its answer
    while True:
        after = tokens()
        grew = {k[2]: after.get(k, 0) - before.get(k, 0) for k in after if k[:2] == ("tiny-chat", "free")}
        if {k: v for k, v in grew.items() if v} == want or time.time() > deadline:
            break
        time.sleep(0.05)
    assert {k: v for k, v in grew.items() if v} == want


@pytest.mark.parametrize("prefix_cache, salt, expected", [
    ("per_key", None, "key-1"),  # the default: each key's blocks its own
    ("per_key", "t7", '["key-1", "t7"]'),  # a request's cache_salt within its key's
    ("shared", None, None),  # every request's blocks shared
    ("shared", "t7", "t7"),
])
def test_a_prompts_prefix_cache_salt(prefix_cache, salt, expected):
    """``gateway.chat.prefix_salt``: the key's salt (``server.prefix_cache: per_key``), then the
    request's vLLM ``cache_salt``."""
    from types import SimpleNamespace

    from gateway.chat import prefix_salt

    svc = SimpleNamespace(config=SimpleNamespace(server=SimpleNamespace(prefix_cache=prefix_cache)))
    assert prefix_salt(svc, SimpleNamespace(key_id="key-1"), SimpleNamespace(cache_salt=salt)) == expected


def test_interleave_waits_for_each_choice_and_takes_none():
    """``interleave`` hands on every choice's deltas and waits for their tasks at its end (each meters
    its choice there); with no choice it ends at once (``asyncio.wait`` refuses an empty set)."""
    import asyncio

    from gateway.chat import interleave

    async def choice(name: str):
        for i in range(2):
            await asyncio.sleep(0)
            yield f"{name}{i}"

    async def go(streams) -> list:
        return [d async for d in interleave(streams)]

    assert sorted(asyncio.run(go([choice("a"), choice("b")]))) == ["a0", "a1", "b0", "b1"]
    assert asyncio.run(go([])) == []
