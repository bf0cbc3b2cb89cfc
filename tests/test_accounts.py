"""Accounts on a real server (SQLite store): managed keys through the admin API, each key's own
rate-limit headers, its limits (requests, tokens, concurrency, the daily GPU budget, the model
allow-list), usage read back per key, and secrets kept out of logs and storage. GPU-seconds of
rows that share a decode step are checked on the chat engine itself."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

import httpx
import openai
import pytest
import torch

from tests.helpers import start_server, stream_and_leave, write_config
from workers.base import ChatParams, ChatRequest, ModelSpec, StepContext

EXTRA = """batch:
  store: sqlite
accounts:
  limits:
    free: {requests_per_min: 100, tokens_per_min: 100000}
prices:
  paid: {input_tokens_per_1m: 1000000, output_tokens_per_1m: 2000000, gpu_hour: 3600}
  batch: {like: paid, factor: 0.5}
"""
HI = [{"role": "user", "content": "hi"}]
HI_ESTIMATE = math.ceil(len(json.dumps(HI)) / 4)  # the prompt's tokens as the limiter guesses them


@pytest.fixture(scope="module")
def server(tiny_chat, tiny_image, tmp_path_factory):
    folder = tmp_path_factory.mktemp("accounts")
    s = start_server(write_config(folder, {"tiny-chat": ("chat", tiny_chat), "tiny-image": ("image", tiny_image)},
                                  EXTRA))
    s.folder = folder
    yield s
    s.stop()


def admin(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.keys['admin']}"}, timeout=30)


def new_key(server, **body) -> tuple[str, str]:
    with admin(server) as c:
        r = c.post("/admin/keys", json={"name": "t", "tier": "free", **body})
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["value"]


def chat(server, secret: str, max_tokens: int = 4, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                      json={"model": "tiny-chat", "messages": HI, "max_tokens": max_tokens, **kw}, timeout=60)


def test_a_key_made_at_run_time_works_at_once_is_listed_without_secret_and_revoked(server):
    key_id, secret = new_key(server, name="ci")
    assert secret.startswith("sk-tg-")
    client = openai.OpenAI(base_url=server.base_url, api_key=secret, max_retries=0)
    assert client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=2).choices
    with admin(server) as c:
        listed = c.get("/admin/keys").json()["data"]
        mine = next(k for k in listed if k["id"] == key_id)
        assert mine["redacted_value"] == f"sk-tg-...{secret[-4:]}" and mine["status"] == "active"
        assert secret not in json.dumps(listed) and "value" not in mine and "hash" not in mine
        new_key(server, name="p1"), new_key(server, name="p2")
        every = [k["id"] for k in c.get("/admin/keys").json()["data"]]  # no paging asked: every key, oldest first
        assert len(every) == len(listed) + 2
        page = c.get("/admin/keys", params={"limit": 1, "after": every[0]}).json()
        assert [k["id"] for k in page["data"]] == every[1:2] and page["has_more"] and page["last_id"] == every[1]
        page = c.get("/admin/keys", params={"after": every[-2]}).json()
        assert [k["id"] for k in page["data"]] == every[-1:] and not page["has_more"]
        assert [k["id"] for k in c.get("/admin/keys", params={"order": "desc", "limit": 2}).json()["data"]] == \
            every[::-1][:2]
        refused = c.get("/admin/keys", params={"page": 2}).json()["error"]
        assert (refused["param"], refused["code"]) == ("page", "unknown_parameter")
        changed = c.patch(f"/admin/keys/{key_id}", json={"tier": "paid", "limits": {"requests_per_min": 7}}).json()
        assert changed["tier"] == "paid" and changed["limits"] == {"requests_per_min": 7}
        assert c.patch(f"/admin/keys/{key_id}", json={"tier": "gold"}).status_code == 400
        assert c.patch(f"/admin/keys/{key_id}", json={"limits": {"requests_per_min": "7"}}).json()["error"]["param"] \
            == "limits.requests_per_min"
        assert c.delete(f"/admin/keys/{key_id}").json() == {"id": key_id, "object": "api_key.deleted", "deleted": True}
        assert c.delete("/admin/keys/key_nope").status_code == 404
        late = c.patch(f"/admin/keys/{key_id}", json={"name": "renamed"})  # a revoke is final
        assert late.status_code == 409 and late.json()["error"]["code"] == "key_revoked"
        assert c.get(f"/admin/keys/{key_id}").json()["name"] == "ci"
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=2)
    other = httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {secret}"})
    assert other.status_code == 401
    not_admin = httpx.post(f"{server.url}/admin/keys", json={"tier": "free"},
                           headers={"Authorization": f"Bearer {server.keys['paid']}"})
    assert not_admin.status_code == 403


@pytest.mark.parametrize("limit", ["requests_per_min=abc", "requests_per_min=20/min", "concurrent=1.5", "nope=1"])
def test_tiergate_keys_create_refuses_a_bad_limit_in_one_line_on_stderr(tmp_path, capsys, limit):
    """``tiergate keys create --limit`` with a value that is not a number is one ``tiergate: --limit``
    line on stderr and exit 2, as the other bad limits are, not a traceback (hunt report L, finding
    10); stdout carries only the keys' JSON, and no key is made."""
    from gateway.cli import main

    config = write_config(tmp_path, {"tiny-chat": ("chat", tmp_path / "unread")}, "batch:\n  store: sqlite\n")
    assert main(["keys", "--config", str(config), "create", "--tier", "free", "--limit", limit]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("tiergate: --limit") and len(err.splitlines()) == 1, err
    assert main(["keys", "--config", str(config), "list"]) == 0 and capsys.readouterr().out == ""


def test_tiergate_keys_names_a_store_it_cannot_use_in_one_line(tmp_path, capsys):
    """``tiergate keys`` with a ``batch.data_dir`` that cannot hold the SQLite store is serve's one
    line and exit 2, and a Redis store that does not answer one line and exit 1: both were a
    traceback (hunt report QQ, finding 3)."""
    from gateway.cli import main

    (tmp_path / "afile").write_text("not a folder")
    config = write_config(tmp_path, {"tiny-chat": ("chat", tmp_path / "unread")}, "batch:\n  data_dir: afile\n")
    assert main(["keys", "--config", str(config), "list"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"tiergate: {config}: batch.data_dir: {tmp_path / 'afile'} cannot hold the SQLite "
                                 "stores: it is not a folder\n")
    config = write_config(tmp_path, {"tiny-chat": ("chat", tmp_path / "unread")},
                          "batch:\n  store: redis://127.0.0.1:1/0\n")  # nothing listens on port 1
    assert main(["keys", "--config", str(config), "list"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"tiergate: {config}: batch.store: the key store did not answer: "), err


def test_headers_are_true_for_the_key(server):
    key_id, secret = new_key(server, limits={"requests_per_min": 3, "tokens_per_min": 1000})
    spent = 0  # tokens the bucket holds after each request is corrected to what it used
    for i in range(3):
        if i == 1:  # a stream carries them too, before its first byte
            with httpx.stream("POST", f"{server.base_url}/chat/completions",
                              headers={"Authorization": f"Bearer {secret}"},
                              json={"model": "tiny-chat", "messages": HI, "max_tokens": 4, "stream": True,
                                    "stream_options": {"include_usage": True}}, timeout=60) as r:
                headers = r.headers
                usage = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")][-1]["usage"]
        else:
            r = chat(server, secret)
            headers, usage = r.headers, r.json()["usage"]
        assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-limit-tokens"] == "1000"
        assert headers["x-ratelimit-remaining-requests"] == str(2 - i)
        expected = 1000 - spent - (HI_ESTIMATE + 4)
        assert expected <= int(headers["x-ratelimit-remaining-tokens"]) <= expected + 1000 // 60 * 10
        assert headers["x-ratelimit-reset-requests"].endswith("s")
        spent += usage["total_tokens"]
    refused = chat(server, secret)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 20  # one request comes back every 60/3 s
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    models = httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {secret}"})
    assert models.headers["x-ratelimit-limit-requests"] == "3" and models.headers["x-ratelimit-remaining-requests"] == "0"
    paid = chat(server, server.keys["paid"])  # an environment key of a tier without limits: the tier's headers
    assert paid.status_code == 200 and "x-ratelimit-limit-tokens" not in paid.headers


def test_a_request_over_the_token_limit_and_too_many_at_once(server):
    _, secret = new_key(server, limits={"tokens_per_min": 20})
    big = chat(server, secret, max_tokens=64)
    assert big.status_code == 429 and "more than this key's limit" in big.json()["error"]["message"]
    _, secret = new_key(server, limits={"concurrent": 1})
    with httpx.stream("POST", f"{server.base_url}/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                      json={"model": "tiny-chat", "messages": HI, "max_tokens": 400, "stream": True,
                            "temperature": 0}, timeout=60) as r:  # greedy: all 400 tokens, no early EOS
        assert r.status_code == 200
        second = chat(server, secret, max_tokens=2)  # while the stream holds the key's one slot
        assert second.status_code == 429 and "in flight" in second.json()["error"]["message"]
        r.read()
    assert chat(server, secret, max_tokens=2).status_code == 200


@pytest.mark.parametrize("limits", [{"concurrent": 2}, {"requests_per_min": 2}], ids=["concurrent", "per-min"])
def test_a_request_of_n_choices_is_one_request_to_the_keys_limits(server, limits):
    """A chat request of ``n`` 3 choices, and a completion of two prompts of 2 choices each, are one
    request each to the key's ``concurrent`` and ``requests_per_min`` (as OpenAI counts them),
    admitted whole before any choice starts: both are served on a key whose limit is 2, and are
    usage of one request each; the minute's bucket then has no room for a third request."""
    key_id, secret = new_key(server, tier="paid", limits=limits)
    client = openai.OpenAI(base_url=server.base_url, api_key=secret, max_retries=0)
    chat_reply = client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=3, n=3)
    assert sorted(c.index for c in chat_reply.choices) == [0, 1, 2]
    text_reply = client.completions.create(model="tiny-chat", prompt=["one", "two"], max_tokens=3, n=2)
    assert sorted(c.index for c in text_reply.choices) == [0, 1, 2, 3]
    [row] = httpx.get(f"{server.base_url}/usage", headers={"Authorization": f"Bearer {secret}"}).json()["data"]
    assert row["requests"] == 2
    assert row["output_tokens"] == chat_reply.usage.completion_tokens + text_reply.usage.completion_tokens
    if "requests_per_min" in limits:
        with pytest.raises(openai.RateLimitError, match="try again in"):
            client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=3)


def test_a_keys_own_limit_refusals_are_counted_with_its_tiers_refusals(server):
    """A 429 of a key's own limit is counted refused for its tier, reason ``key_limit``: in
    ``tiergate_rejected_total`` and the dashboard's ``refused_by_reason_per_min``, so that an
    operator sees why that tier's callers get 429s; a request served is not."""
    from prometheus_client.parser import text_string_to_metric_families

    def refused() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        [family] = [f for f in text_string_to_metric_families(text) if f.name == "tiergate_rejected"]
        return sum(s.value for s in family.samples if s.labels == {"tier": "subscriber", "reason": "key_limit"}
                   and s.name.endswith("_total"))

    def on_the_dashboard() -> int:
        [tier] = [t for t in admin(server).get("/admin/state").json()["tiers"] if t["name"] == "subscriber"]
        return tier["refused_by_reason_per_min"].get("key_limit", 0)

    _, secret = new_key(server, tier="subscriber", limits={"requests_per_min": 1})
    client = openai.OpenAI(base_url=server.base_url, api_key=secret, max_retries=0)
    before = (refused(), on_the_dashboard())
    client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=2)
    for _ in range(2):
        with pytest.raises(openai.RateLimitError, match="try again in"):
            client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=2)
    assert (refused() - before[0], on_the_dashboard() - before[1]) == (2, 2)


@pytest.mark.parametrize("dimension", ["tokens", "images", "messages"])
def test_a_request_larger_than_a_minute_limit_fails_at_once_without_retries(server, dimension):
    """A request whose cost alone is over one of its key's minute limits (``max_tokens`` above
    ``tokens_per_min``, more images than ``images_per_min``; on the Messages API too) can never be
    admitted: its 429 ``rate_limit_exceeded`` says so, with ``x-should-retry: false`` and no
    ``Retry-After``, so the openai and anthropic SDKs, retries left, fail at once: the server saw
    the request once (one ``key_limit`` refusal), not three times two minutes apart."""
    import anthropic
    from prometheus_client.parser import text_string_to_metric_families

    def refused() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        [family] = [f for f in text_string_to_metric_families(text) if f.name == "tiergate_rejected"]
        return sum(s.value for s in family.samples if s.labels == {"tier": "subscriber", "reason": "key_limit"}
                   and s.name.endswith("_total"))

    limits = {"images_per_min": 1} if dimension == "images" else {"tokens_per_min": 100}
    _, secret = new_key(server, tier="subscriber", limits=limits)
    before = refused()
    if dimension == "messages":
        claude = anthropic.Anthropic(base_url=server.url, api_key=secret, max_retries=2)
        with pytest.raises(anthropic.RateLimitError, match="can never be admitted") as err:
            claude.messages.create(model="tiny-chat", max_tokens=200, messages=HI)
    else:
        client = openai.OpenAI(base_url=server.base_url, api_key=secret, max_retries=2)
        with pytest.raises(openai.RateLimitError, match="can never be admitted") as err:
            if dimension == "images":
                client.images.generate(model="tiny-image", prompt="a cat", n=2, size="64x64")
            else:
                client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=200)
    assert refused() - before == 1
    answer = err.value.response
    assert answer.headers["x-should-retry"] == "false" and "retry-after" not in answer.headers


def test_a_request_of_n_choices_whose_tokens_alone_are_over_the_limit_is_refused_whole(server):
    """``tokens_per_min`` is asked for the prompt once plus every choice's ``max_tokens``: an ``n``
    3 request that needs more than the key's limit is refused with the message that says so, and
    none of its choices ran (no usage), however little one choice alone would need."""
    _, secret = new_key(server, tier="paid", limits={"tokens_per_min": HI_ESTIMATE + 20})
    client = openai.OpenAI(base_url=server.base_url, api_key=secret, max_retries=0)
    with pytest.raises(openai.RateLimitError, match="more than this key's limit") as err:
        client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=10, n=3)
    assert f"needs {HI_ESTIMATE + 30} tokens" in err.value.message
    assert httpx.get(f"{server.base_url}/usage", headers={"Authorization": f"Bearer {secret}"}).json()["data"] == []
    assert client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=10, n=2).choices


def test_a_request_of_n_choices_is_metered_its_prompt_once(server):
    """A chat request of ``n`` 4 choices, and a completion of two prompts of 3 choices each: the
    response's usage counts each prompt once and every choice's completion, and so do the key's
    usage (and its cost) and ``tiergate_tokens_total{type="prompt"}``, not the prompt once per choice."""
    from prometheus_client.parser import text_string_to_metric_families

    def prompt_tokens_counted() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        [family] = [f for f in text_string_to_metric_families(text) if f.name == "tiergate_tokens"]
        return sum(s.value for s in family.samples if s.name == "tiergate_tokens_total"
                   and s.labels == {"model": "tiny-chat", "tier": "paid", "type": "prompt"})

    _, secret = new_key(server, tier="paid")
    client = openai.OpenAI(base_url=server.base_url, api_key=secret, max_retries=0)
    before = prompt_tokens_counted()
    chat_reply = client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=2, n=4)
    text_reply = client.completions.create(model="tiny-chat", prompt=["one two three", "four"], max_tokens=2, n=3)
    prompt = chat_reply.usage.prompt_tokens + text_reply.usage.prompt_tokens
    completion = chat_reply.usage.completion_tokens + text_reply.usage.completion_tokens
    [row] = httpx.get(f"{server.base_url}/usage", headers={"Authorization": f"Bearer {secret}"}).json()["data"]
    assert (row["requests"], row["input_tokens"], row["output_tokens"]) == (2, prompt, completion)
    assert row["cost_usd"] == pytest.approx(prompt * 1.0 + completion * 2.0 + row["gpu_seconds"], rel=1e-6)
    assert prompt_tokens_counted() - before == prompt  # counted before the last byte, with the usage


def test_a_budget_spent_mid_day_gives_insufficient_quota(server):
    key_id, secret = new_key(server, limits={"gpu_seconds_per_day": 0.000001})
    assert chat(server, secret).status_code == 200  # under budget when it starts; it spends past it
    client = openai.OpenAI(base_url=server.base_url, api_key=secret, max_retries=3)
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=2)
    assert time.monotonic() - started < 1.0  # x-should-retry: false, so the SDK did not retry
    assert err.value.code == "insufficient_quota" and err.value.response.headers["x-should-retry"] == "false"
    assert 0 < int(err.value.response.headers["retry-after"]) <= 86400  # until 00:00 UTC
    with admin(server) as c:
        c.patch(f"/admin/keys/{key_id}", json={"limits": {"gpu_seconds_per_day": 3600}})
    deadline = time.time() + 2
    while chat(server, secret).status_code != 200:  # a bigger budget applies within a second
        assert time.time() < deadline
    usage = httpx.get(f"{server.base_url}/usage", headers={"Authorization": f"Bearer {secret}"}).json()["data"]
    assert usage[0]["requests"] == 2 and usage[0]["gpu_seconds"] > 0.000001


def test_requests_in_flight_count_against_the_gpu_budget(server, tiny_chat):
    """The daily GPU budget counts the key's requests in flight, not only those that ended: while
    one long stream runs (holding the GPU-seconds the gate predicts for it), requests that arrive
    find the budget taken and are refused with 429 ``rate_limit_exceeded`` to try again soon, none
    admitted to overrun it; once the stream ends its true usage counts, and spent past the budget
    the next request gets ``insufficient_quota``. Usage: the one request that ran."""
    from transformers import AutoTokenizer

    _, secret = new_key(server, tier="paid", limits={"gpu_seconds_per_day": 0.000001})
    eos = AutoTokenizer.from_pretrained(str(tiny_chat)).eos_token_id
    client = openai.OpenAI(base_url=server.base_url, api_key=secret, max_retries=0)
    stream = client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=400, temperature=0,
                                            logit_bias={str(eos): -100}, stream=True)
    with stream:
        next(iter(stream))  # in flight

        def another(_) -> openai.RateLimitError | None:
            try:
                client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=2)
            except openai.RateLimitError as exc:
                return exc
            return None

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4) as pool:
            refused = list(pool.map(another, range(8)))
        assert all(r is not None and r.code == "rate_limit_exceeded" for r in refused), refused
        assert "held by requests in flight" in refused[0].message
        assert refused[0].response.headers["retry-after"] == "1"
        assert sum(1 for _ in stream) > 0  # the stream runs to its end
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=2)
    assert err.value.code == "insufficient_quota"
    [row] = httpx.get(f"{server.base_url}/usage", headers={"Authorization": f"Bearer {secret}"}).json()["data"]
    assert row["requests"] == 1


def test_a_model_outside_the_allow_list_does_not_exist_for_that_key(server):
    _, secret = new_key(server, models=["tiny-image"])
    auth = {"Authorization": f"Bearer {secret}"}
    hidden = chat(server, secret)
    missing = httpx.post(f"{server.base_url}/chat/completions", headers=auth,
                         json={"model": "no-such-model", "messages": HI})
    assert hidden.status_code == missing.status_code == 404
    assert hidden.json() == json.loads(json.dumps(missing.json()).replace("no-such-model", "tiny-chat"))
    listed = httpx.get(f"{server.base_url}/models", headers=auth).json()["data"]
    assert [m["id"] for m in listed] == ["tiny-image"]
    assert httpx.get(f"{server.base_url}/models/tiny-chat", headers=auth).status_code == 404
    assert httpx.get(f"{server.base_url}/models/tiny-image", headers=auth).status_code == 200
    # deleting it is no exception: a 404 as for none (it was a 403, model_not_deletable, telling that it exists)
    hidden, missing = (httpx.delete(f"{server.base_url}/models/{m}", headers=auth)
                       for m in ("tiny-chat", "no-such-model"))
    assert hidden.status_code == missing.status_code == 404
    assert hidden.json() == json.loads(json.dumps(missing.json()).replace("no-such-model", "tiny-chat"))
    own = httpx.delete(f"{server.base_url}/models/tiny-image", headers=auth)
    assert own.status_code == 403 and own.json()["error"]["code"] == "model_not_deletable"
    assert chat(server, server.keys["free"]).status_code == 200  # other keys still see it


def test_usage_per_key_is_exact_grouped_priced_and_csv(server):
    key_id, secret = new_key(server, tier="paid")
    totals = {"prompt_tokens": 0, "completion_tokens": 0}
    for max_tokens in (3, 5):
        for k, v in chat(server, secret, max_tokens=max_tokens).json()["usage"].items():
            if k in totals:
                totals[k] += v
    auth = {"Authorization": f"Bearer {secret}"}
    mine = httpx.get(f"{server.base_url}/usage", params={"group_by": "model"}, headers=auth).json()
    [row] = mine["data"]
    assert (row["model"], row["requests"], row["input_tokens"], row["output_tokens"]) == \
        ("tiny-chat", 2, totals["prompt_tokens"], totals["completion_tokens"])
    assert row["gpu_seconds"] > 0 and row["swap_seconds"] >= 0
    price = totals["prompt_tokens"] * 1.0 + totals["completion_tokens"] * 2.0 + row["gpu_seconds"]
    assert row["cost_usd"] == pytest.approx(price, rel=1e-6)
    assert httpx.get(f"{server.base_url}/usage", params={"key": "other"}, headers=auth).status_code == 400
    assert chat(server, server.keys["free"]).status_code == 200  # another key's usage, whatever ran before
    with admin(server) as c:
        today = time.strftime("%Y-%m-%d", time.gmtime())
        text = c.get("/admin/usage", params={"key": key_id, "start_date": today, "end_date": today,
                                             "format": "csv"}).text
        head, line = text.splitlines()
        assert head.split(",")[:3] == ["day", "requests", "input_tokens"] and line.startswith(f"{today},2,")
        everyone = c.get("/admin/usage", params={"group_by": "key"}).json()["data"]
        assert key_id in {r["key"] for r in everyone} and len(everyone) > 1
        for day in ("yesterday", "2026-13-01", "2026-02-30"):
            assert c.get("/admin/usage", params={"start_date": day}).json()["error"]["param"] == "start_date"
        assert c.get("/admin/usage", params={"key": key_id, "end_date": "2000-01-01"}).json()["data"] == []


def usage_row_of(server, headers: dict, requests: int, what: str) -> dict:
    """The key's usage row once it counts ``requests`` (a cut request is metered when the server
    sees the cut, a moment after the client has gone)."""
    deadline = time.monotonic() + 30
    while True:
        rows = httpx.get(f"{server.base_url}/usage", headers=headers).json()["data"]
        if rows and rows[0]["requests"] == requests:
            return rows[0]
        assert time.monotonic() < deadline, f"{what} was not metered"
        time.sleep(0.1)


@pytest.mark.parametrize("limits", [None, {"tokens_per_min": 100000}], ids=["no-limits", "limited"])
def test_a_stream_the_client_cuts_is_metered_by_the_tokens_it_cost(server, tiny_chat, limits):
    """The client leaves after three text chunks of a long streamed reply: the key is metered the
    prompt's tokens and every token generated until the engine saw it leave (at least the three
    it received, far fewer than asked for), not a request of no tokens. Both of ``finish``'s
    paths: a key without limits (the row alone) and a key with limits (the row and the buckets)."""
    from transformers import AutoTokenizer

    key_id, secret = new_key(server, tier="paid", **({"limits": limits} if limits else {}))
    eos = AutoTokenizer.from_pretrained(str(tiny_chat)).eos_token_id
    body = {"model": "tiny-chat", "messages": HI, "temperature": 0, "logit_bias": {str(eos): -100}}
    headers = {"Authorization": f"Bearer {secret}"}
    prompt = httpx.post(f"{server.base_url}/chat/completions", headers=headers, timeout=60,
                        json={**body, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    stream_and_leave(f"{server.base_url}/chat/completions", headers, {**body, "max_tokens": 400})

    row = usage_row_of(server, headers, requests=2, what="the cut stream")
    assert row["input_tokens"] == 2 * prompt
    assert 3 <= row["output_tokens"] - 1 < 400  # the first request's one token, then the cut one's
    assert row["gpu_seconds"] > 0


def test_a_responses_stream_the_client_cuts_stops_and_is_metered_by_the_tokens_it_cost(server):
    """The Responses API's stream as chat's: its text goes out as the engine writes it (not held
    to the reply's end), so a client that leaves after three text deltas of a long reply is seen
    there: its work stops, and the key is metered a few tokens, not the whole reply."""
    key_id, secret = new_key(server, tier="paid")
    body = {"model": "tiny-chat", "input": "hi", "temperature": 0, "max_output_tokens": 400, "store": False}
    whole = httpx.post(f"{server.base_url}/responses", headers={"Authorization": f"Bearer {server.keys['paid']}"},
                       json=body, timeout=60).json()
    assert whole["usage"]["output_tokens"] == 400, "the greedy reply ends early: pick another input"
    headers = {"Authorization": f"Bearer {secret}"}
    stream_and_leave(f"{server.base_url}/responses", headers, body)

    row = usage_row_of(server, headers, requests=1, what="the cut stream")
    assert 3 <= row["output_tokens"] < 400


def test_a_client_that_leaves_before_a_whole_answer_is_metered_by_the_tokens_it_cost(server, tiny_chat):
    """Not streamed: the client gives up (its read timeout) while a long reply is generated. The
    server sees it leave (``ClientGone``) and meters the prompt and the tokens generated by then."""
    from transformers import AutoTokenizer

    key_id, secret = new_key(server, tier="paid")
    eos = AutoTokenizer.from_pretrained(str(tiny_chat)).eos_token_id
    body = {"model": "tiny-chat", "messages": HI, "temperature": 0, "logit_bias": {str(eos): -100}}
    headers = {"Authorization": f"Bearer {secret}"}
    prompt = httpx.post(f"{server.base_url}/chat/completions", headers=headers, timeout=60,
                        json={**body, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    httpx.post(f"{server.base_url}/chat/completions", headers=headers, timeout=60, json={**body, "max_tokens": 8})
    with pytest.raises(httpx.ReadTimeout):  # the engine is warm: 400 tokens take longer than this
        httpx.post(f"{server.base_url}/chat/completions", headers=headers, json={**body, "max_tokens": 400},
                   timeout=httpx.Timeout(60, read=0.1))

    got = usage_row_of(server, headers, requests=3, what="the request the client left")
    assert got["input_tokens"] == 3 * prompt
    assert 1 <= got["output_tokens"] - 1 - 8 < 400  # the two whole replies' 1 + 8, then the cut one's


@pytest.mark.parametrize("streamed", [True, False], ids=["stream-cut", "whole-left"])
def test_a_request_of_n_choices_the_client_leaves_is_metered_and_gives_its_slot_back(server, tiny_chat, streamed):
    """A chat request of three choices that the client leaves mid-reply (a stream it closes, or a
    whole answer it stops waiting for): its choices' blocks end in tasks of their own, which were
    cancelled again as they wrote the request's usage, so it was not metered at all and, under
    ``concurrent``, counted in flight for good (every later request a 429). Now: one request,
    its prompt once and the tokens generated, and the key's slot back."""
    from transformers import AutoTokenizer

    key_id, secret = new_key(server, tier="paid", limits={"concurrent": 1, "tokens_per_min": 100000})
    eos = AutoTokenizer.from_pretrained(str(tiny_chat)).eos_token_id
    body = {"model": "tiny-chat", "messages": HI, "temperature": 0, "logit_bias": {str(eos): -100}, "n": 3}
    headers = {"Authorization": f"Bearer {secret}"}
    if streamed:
        stream_and_leave(f"{server.base_url}/chat/completions", headers, {**body, "max_tokens": 400}, chunks=6)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base_url}/chat/completions", headers=headers, json={**body, "max_tokens": 400},
                       timeout=httpx.Timeout(60, read=0.3))

    row = usage_row_of(server, headers, requests=1, what="the request of three choices the client left")
    assert row["input_tokens"] > 0 and 2 <= row["output_tokens"] < 3 * 400
    r = chat(server, secret, max_tokens=1)  # its one slot of concurrent is free again
    assert r.status_code == 200, r.text


def test_a_chat_request_the_engine_turns_down_on_submission_is_not_usage(server):
    """A prompt longer than the model's context is found by the engine as it is submitted, in the
    slot but before any work: a 400 ``context_length_exceeded`` that, like every 400 refused before
    any work (docs/ACCOUNTS.md), is not usage and gives back its tokens. It was metered one request
    of no tokens; a request of n choices is refused whole, not metered either."""
    key_id, secret = new_key(server, tier="paid", limits={"tokens_per_min": 100000})
    long = [{"role": "user", "content": "hello " * 600}]  # tiny-chat's context is 512 tokens
    for n in (1, 2):
        r = chat(server, secret, messages=long, n=n)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert httpx.get(f"{server.base_url}/usage", headers={"Authorization": f"Bearer {secret}"}).json()["data"] == []
    models = httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {secret}"})
    assert models.headers["x-ratelimit-remaining-tokens"] == "100000"


def test_a_cut_blocks_usage_write_is_not_cut_by_a_second_cancel(server):
    """A block cut in a task of its own can be cancelled again while it writes its usage: a spoken
    reply's speech, whose task ``output_audio`` cancels and then awaits inside the stream's
    cancelled scope, which cancels it once more. That cut the write: the speech was not metered,
    nor given back to its key's limits (under ``concurrent``, in flight for good). The store's
    write is slowed here, so that the second cancel lands in it."""
    from gateway.auth import Caller
    from gateway.serving import Serving

    key_id, secret = new_key(server, tier="paid", limits={"concurrent": 1})
    svc = server.services
    store = svc.accounts.store
    real = store.record

    async def slow(*args, **kwargs):
        await asyncio.sleep(0.2)
        await real(*args, **kwargs)

    async def cut_twice() -> None:
        entered = asyncio.Event()

        async def block() -> None:
            async with Serving(svc, svc.accounts.for_http(Caller("paid", key_id)), "tiny-chat", 1, "chat", None):
                entered.set()
                await asyncio.sleep(60)

        task = asyncio.create_task(block())
        await entered.wait()
        store.record = slow
        try:
            task.cancel()
            await asyncio.sleep(0.05)  # the block is cut and writes its usage
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(0.3)
        finally:
            del store.record

    server.wait(cut_twice())
    assert usage_row_of(server, {"Authorization": f"Bearer {secret}"}, requests=1, what="the cut block")
    r = chat(server, secret, max_tokens=1)  # its one slot of concurrent is free again
    assert r.status_code == 200, r.text


def test_secrets_never_in_logs_nor_stored_in_clear(server, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    key_id, secret = new_key(server, limits={"requests_per_min": 1})
    chat(server, secret)
    chat(server, secret)  # a 429
    with admin(server) as c:
        c.delete(f"/admin/keys/{key_id}")
    time.sleep(0.1)
    chat(server, secret)  # a 401
    out, err = capfd.readouterr()
    body = secret.removeprefix("sk-tg-")
    for text in (caplog.text, out, err):
        assert body not in text
    data = server.folder / "tiergate-data"
    stored = b"".join(p.read_bytes() for p in [*data.glob("accounts.sqlite3*"), *data.glob("accounts.sqlite3.usage/*")]
                      if p.is_file())  # the usage journal too
    assert key_id.encode() in stored and body.encode() not in stored and body[:12].encode() not in stored


# -- GPU-seconds of rows that share a decode step ---------------------------------------------------

def test_gpu_seconds_of_one_batched_step_are_shared_by_its_rows(tiny_chat, monkeypatch):
    """Every forward pass 'takes' exactly 1 s (a fake clock): a prefill is its row's alone, a
    prefill of several rows together and a decode step are shared equally by the rows in them;
    nothing is lost or counted twice."""
    import workers.chat as engine

    ticks = iter(range(10**9))
    worker = engine.ChatWorker(ModelSpec("tiny-chat", "chat", tiny_chat), max_num_seqs=8)
    worker.clock = lambda: float(next(ticks))  # this worker's only: another server's engine in this process keeps time
    worker.load(torch.device("cpu"))
    passes = []  # each forward pass: the rows it computed
    decode, prefill, together = worker._decode_step, worker._prefill_into, worker._prefill_together
    monkeypatch.setattr(worker, "_decode_step", lambda b: (passes.append([s.req.ctx for s in b.seqs]), decode(b))[1])
    monkeypatch.setattr(worker, "_prefill_into", lambda b, s: (passes.append([s.req.ctx]), prefill(b, s))[1])
    monkeypatch.setattr(worker, "_prefill_together",
                        lambda b, seqs: (passes.append([s.req.ctx for s in seqs]), together(b, seqs))[1])
    try:
        contexts = [StepContext() for _ in range(3)]

        async def main():
            async def one(ctx, n):
                async for _ in worker.chat(ChatRequest(HI, ChatParams(max_tokens=n, temperature=0), ctx=ctx)):
                    pass

            await asyncio.gather(*(one(ctx, n) for ctx, n in zip(contexts, (4, 8, 12))))

        asyncio.run(main())
    finally:
        worker.unload()
    assert max(len(rows) for rows in passes) >= 2, "the rows never shared a pass"
    for ctx in contexts:
        expected = sum(1.0 / len(rows) for rows in passes if ctx in rows)
        assert ctx.gpu_s == pytest.approx(expected, rel=1e-12)
    assert sum(ctx.gpu_s for ctx in contexts) == pytest.approx(len(passes), rel=1e-12)


def test_a_chat_request_works_out_its_token_ask_only_for_a_key_with_limits(tmp_path, tiny_chat, monkeypatch):
    """The prompt is serialised to estimate its tokens (``estimate_tokens``) only when the key has
    limits to spend them against; a key without limits asks nothing of the limiter."""
    from types import SimpleNamespace

    from accounts.rates import Ask
    from accounts.sqlite_store import SQLiteAccounts
    from gateway import chat
    from gateway.accounts import Accounts
    from gateway.auth import Caller
    from gateway.config import load_config

    config = load_config(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, EXTRA))  # free has limits
    svc = SimpleNamespace(accounts=Accounts(config, SQLiteAccounts(tmp_path / "accounts.sqlite3")))
    job = SimpleNamespace(prompt_ids=None, messages=HI)
    estimated = []
    monkeypatch.setattr(chat, "estimate_tokens", lambda messages: estimated.append(messages) or 7)
    params = ChatParams(max_tokens=4)
    assert chat._ask(svc, Caller("paid", "k1"), job, params) == Ask() and estimated == []
    assert chat._ask(svc, Caller("free", "k2"), job, params) == Ask(tokens=7 + 4) and estimated == [HI]
    assert chat._ask(SimpleNamespace(accounts=None), Caller("free", "k2"), job, params) == Ask()


def test_accounts_stop_when_the_store_swallows_the_cancel(tmp_path):
    """The managed keys' refresh loop asks the store every ``refresh_s``; on Redis the client can
    swallow a cancel (``storage.redis``). Here the store's ``keys_since`` does, as the send would
    when the stop lands: ``stop`` must return all the same."""
    from gateway.accounts import Accounts
    from gateway.config import load_config

    config = load_config(write_config(tmp_path, {"m": ("chat", tmp_path)}, "accounts:\n  refresh_s: 0.05\n"))

    async def go() -> bool:
        accounts = Accounts.from_config(config)
        real, inside, swallowed = accounts.store.keys_since, asyncio.Event(), []

        async def swallowing(*args):
            inside.set()
            try:
                await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                if swallowed:  # once is enough: later cancels (the test's cleanup) go through
                    raise
                swallowed.append(True)  # as wait_for on 3.11 when the send had finished: the cancel is gone
            return await real(*args)

        accounts.store.keys_since = swallowing
        await accounts.start()
        inside.clear()
        async with asyncio.timeout(10):
            await inside.wait()  # the refresh loop's own call, not start()'s
        loop = accounts._loop
        stopping = asyncio.create_task(accounts.stop())
        done, _ = await asyncio.wait({stopping}, timeout=10)
        loop.cancel()  # a loop that ignored the stop gets another cancel, to end the test
        await asyncio.gather(stopping, return_exceptions=True)
        return stopping in done

    assert asyncio.run(go()), "Accounts.stop() did not return: the refresh loop went on after a swallowed cancel"


def test_a_settle_the_store_failed_is_made_again_when_it_answers(tmp_path, redis_url):
    """A request's settle gives back its slot of ``concurrent`` (and what it held of the budget):
    one that Redis failed (an outage as the request ended) left the slot held in Redis for 15
    minutes, and a key with ``concurrent: 1`` was refused on every process once Redis was back,
    with nothing in flight. It is kept and made again once the store answers."""
    import uuid

    from redis.exceptions import ConnectionError as RedisConnectionError

    from accounts.rates import Ask
    from accounts.redis_store import RedisAccounts
    from gateway.accounts import Accounts
    from gateway.auth import Caller
    from gateway.config import load_config
    from gateway.errors import APIError

    config = load_config(write_config(tmp_path, {"m": ("chat", tmp_path)}, "accounts:\n  refresh_s: 0.05\n"))

    async def go() -> float | None:
        accounts = Accounts(config, RedisAccounts(redis_url, f"t{uuid.uuid4().hex[:8]}:"))
        await accounts.start()
        try:
            record, _ = await accounts.create_key("one", "free", {"concurrent": 1}, None)
            caller = accounts.for_http(Caller("free", record.id))
            held = await accounts.admit(caller, "m", Ask(requests=1.0))
            real = accounts.store.settle_script

            async def down(*args, **kwargs):
                accounts.store.settle_script = real  # the store answers again right after
                raise RedisConnectionError("Redis went away")

            accounts.store.settle_script = down
            await accounts.finish(caller, "m", held, None)
            at = time.monotonic()
            while time.monotonic() - at < 3:
                try:
                    await accounts.finish(caller, "m", await accounts.admit(accounts.for_http(caller), "m",
                                                                            Ask(requests=1.0)), None)
                    return time.monotonic() - at
                except APIError as exc:
                    assert exc.status == 429, exc.body()
                await asyncio.sleep(0.02)
            return None
        finally:
            await accounts.stop()

    assert asyncio.run(go()) is not None, "the request's slot stayed held after the store answered again"


def test_a_limited_key_gets_503_while_its_store_is_down_and_is_served_again_after(tiny_chat, tmp_path):
    """A managed key's limits live in the store (Redis here): while it does not answer, the key's
    requests are refused with 503 ``store_unavailable`` and Retry-After (not a 500), as are the
    requests of any key to the endpoints that read or write the store, and the key is served
    again once it answers (a new Redis on the same port: the buckets start afresh; a pooled
    connection to the old one fails its first command, which is a 503 too)."""
    from tests.helpers import redis_server, spare_port

    port = spare_port()
    (tmp_path / "redis").mkdir()
    body = {"model": "tiny-chat", "messages": HI, "max_tokens": 1}
    with redis_server(tmp_path / "redis", port) as url:
        s = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, f"batch:\n  store: {url}\n"))
        c = httpx.Client(base_url=s.url, timeout=60)
        made = c.post("/admin/keys", json={"name": "t", "tier": "free", "limits": {"requests_per_min": 100}},
                      headers={"Authorization": "Bearer key-admin"})
        assert made.status_code == 201, made.text
        key = {"Authorization": f"Bearer {made.json()['value']}"}
        assert c.post("/v1/chat/completions", json=body, headers=key).status_code == 200
    try:
        down = c.post("/v1/chat/completions", json=body, headers=key)
        assert down.status_code == 503, down.text
        assert down.json()["error"]["code"] == "store_unavailable" and down.headers["retry-after"] == "1"
        paid = {"Authorization": f"Bearer {s.keys['paid']}"}  # the other endpoints on the store: 503 too
        for other in (c.get("/v1/batches", headers=paid), c.get("/v1/usage", headers=key),
                      c.post("/v1/files", headers=paid, files={"file": ("in.jsonl", b"{}\n")}, data={"purpose": "batch"})):
            assert other.status_code == 503 and other.json()["error"]["code"] == "store_unavailable", other.text
        with redis_server(tmp_path / "redis", port):
            for _ in range(5):
                again = c.post("/v1/chat/completions", json=body, headers=key)
                if again.status_code != 503:
                    break
            assert again.status_code == 200, again.text
            assert again.headers["x-ratelimit-limit-requests"] == "100"
    finally:
        c.close()
        s.stop()


def test_usage_of_a_key_without_limits_served_while_redis_is_down_is_written_when_it_is_back(tiny_chat, tmp_path):
    """A key without limits is served while Redis is down; its usage is kept in the process
    (``tiergate_usage_unwritten``) and written once Redis answers again, so the day's row holds
    every request, before the outage and during it. Redis keeps its data across the restart
    (an append-only file): the rows add up to what each answer's usage said."""
    from tests.helpers import redis_server, spare_port

    port = spare_port()
    (tmp_path / "redis").mkdir()
    body = {"model": "tiny-chat", "messages": HI, "max_tokens": 3, "temperature": 0}
    admin = {"Authorization": "Bearer key-admin"}
    with redis_server(tmp_path / "redis", port, persist=True) as url:
        s = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, f"batch:\n  store: {url}\n"))
        c = httpx.Client(base_url=s.url, timeout=60)
        made = c.post("/admin/keys", json={"name": "t", "tier": "free"}, headers=admin)
        assert made.status_code == 201, made.text
        key_id, key = made.json()["id"], {"Authorization": f"Bearer {made.json()['value']}"}
        served = [c.post("/v1/chat/completions", json=body, headers=key)]
        assert served[0].status_code == 200, served[0].text
    try:
        for _ in range(3):
            served.append(c.post("/v1/chat/completions", json=body, headers=key))
            assert served[-1].status_code == 200, served[-1].text
        assert metric(c, "tiergate_usage_unwritten") == 3
        assert c.get("/admin/usage", params={"key": key_id}, headers=admin).status_code == 503
        with redis_server(tmp_path / "redis", port, persist=True):
            deadline = time.monotonic() + 10  # the refresh loop writes them within refresh_s of Redis answering
            while metric(c, "tiergate_usage_unwritten") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert metric(c, "tiergate_usage_unwritten") == 0
            rows = c.get("/admin/usage", params={"key": key_id}, headers=admin).json()["data"]
        assert metric(c, "tiergate_usage_dropped_total") == 0
    finally:
        c.close()
        s.stop()
    assert len(rows) == 1 and rows[0]["requests"] == 4, rows
    assert rows[0]["output_tokens"] == sum(r.json()["usage"]["completion_tokens"] for r in served)
    assert rows[0]["input_tokens"] == sum(r.json()["usage"]["prompt_tokens"] for r in served)


def metric(client: httpx.Client, name: str) -> float:
    """One unlabelled sample of /metrics."""
    text = client.get("/metrics").text
    values = [float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, f"{name} not in /metrics"
    return values[0]


class FlakyStore:
    """A real SQLite account store whose ``record`` fails while ``down`` (``landed``: after the
    row went in, as a Redis write whose answer was lost), counting the calls that reached it."""

    def __init__(self, real) -> None:
        self.real, self.down, self.landed, self.calls = real, False, False, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    async def record(self, *args) -> None:
        self.calls += 1
        if self.down and not self.landed:
            raise ConnectionError("the store is down")
        await self.real.record(*args)
        if self.down:
            raise TimeoutError("the answer was lost")


def test_kept_usage_is_written_in_order_once_each_however_often_it_is_written_again(tmp_path, monkeypatch, caplog):
    """The kept rows, unit by unit on a real SQLite store: a failed write is kept under a metering
    id of its own; rows after it are kept without asking the store; a pass that lands but fails
    (answers lost) and the next pass count each row once; past the cap rows are dropped and
    counted; at shutdown with the store still failing, the log keeps the lost sums."""
    from accounts.usage import Usage
    from gateway import accounts as accounts_module
    from gateway.auth import Caller
    from gateway.config import load_config

    config = load_config(write_config(tmp_path, {"m": ("chat", tmp_path)}))
    caller = Caller(tier="free", key_id="k1")

    async def go() -> tuple:
        accounts = accounts_module.Accounts.from_config(config)
        store = accounts.store = FlakyStore(accounts.store)
        await store.open()  # no refresh loop: each pass here is the test's own
        store.down = True
        for tokens in (1, 2, 3):
            await accounts.finish(caller, "m", None, Usage(requests=1, output_tokens=tokens))
        assert store.calls == 1  # the first failed; the two after it were kept without a try
        assert [r.usage.output_tokens for r in accounts.unwritten] == [1, 2, 3]
        assert len({r.metering_id for r in accounts.unwritten}) == 3
        store.landed = True  # the next pass writes them all, but every answer is lost
        await accounts.write_again()
        assert len(accounts.unwritten) == 3
        store.down = False
        await accounts.write_again()
        assert not accounts.unwritten
        rows = await accounts.store.usage("k1", None, None, None)
        monkeypatch.setattr(accounts_module, "UNWRITTEN_MAX", 2)
        store.down, store.landed = True, False
        for tokens in (10, 20, 30):
            await accounts.finish(caller, "m", None, Usage(requests=1, output_tokens=tokens))
        dropped = accounts.dropped
        await accounts.stop()
        return rows, dropped, accounts.dropped

    with caplog.at_level(logging.ERROR, logger="tiergate.accounts"):
        rows, dropped, lost = asyncio.run(go())
    assert len(rows) == 1 and (rows[0].usage.requests, rows[0].usage.output_tokens) == (3, 6)
    assert (dropped, lost) == (1, 3)  # the third past the cap of 2; then the two kept at shutdown
    line = next(r.getMessage() for r in caplog.records if "lost" in r.getMessage())
    summed = json.loads(line.split(": ", 1)[1])
    assert [(s["key"], s["requests"], s["output_tokens"]) for s in summed] == [("k1", 2, 30)]


def _tuned(owner: str, suffix: str | None, job: str = "ftjob-0123456789abcdef") -> str:
    from tuning.runner import fine_tuned_name
    from tuning.store import Job

    return fine_tuned_name(Job(id=job, owner=owner, created_at=0, model="tiny-chat", training_file="file-x",
                               validation_file=None, hyperparameters={}, seed=0, suffix=suffix))


MANAGED = "key_fa91626131ce094a"  # a managed key's id; its fine-tuned models' names have key-fa91...


@pytest.mark.parametrize("name, pattern, allowed", [
    (_tuned(MANAGED, "own"), f"ft:*:{MANAGED}:*", True),  # the key id as README writes it
    (_tuned(MANAGED, "own"), "ft:*:key-fa91626131ce094a:*", True),  # as the name has it
    (_tuned(MANAGED, None), f"ft:*:{MANAGED}:*", True),
    (_tuned(MANAGED, "own") + ":ckpt-step-50", f"ft:*:{MANAGED}:*", True),  # its checkpoints
    (_tuned("e3175ac00733985d", "key-fa91626131ce094a"), f"ft:*:{MANAGED}:*", False),  # a suffix copying its label
    (_tuned("e3175ac00733985d", "key-fa91626131ce094a"), "ft:*:key-fa91626131ce094a:*", False),
    (_tuned("e3175ac00733985d", "own"), f"ft:*:{MANAGED}:*", False),  # another key's
    (_tuned("e3175ac00733985d", "own"), "ft:*", True),  # every key's fine-tuned models
    (_tuned("e3175ac00733985d", "own"), "ft:tiny-chat:*", True),
    (_tuned("e3175ac00733985d", "own"), "ft:other:*", False),
    ("acme-support", "acme-*", True), ("acme:v2", "acme*", True), ("acme:v2", "acme:v?", True),  # no ":": as fnmatch
    ("acme", "acme:*", False), ("team-b", "team_b", False),  # "_" is written as "-" only in an ft: owner's field
])
def test_an_adapter_pattern_matches_field_by_field_and_admits_a_keys_own_fine_tuned_models(name, pattern, allowed):
    """README, Fine-tuning: ``ft:*:<key id>:*`` admits the key's own fine-tuned models and no
    other key's, whose suffix may spell the key's label: the pattern's ``*`` stays within its own
    ``:``-separated field, but for the last."""
    from accounts.config import Limits, adapter_matches

    assert adapter_matches(name, pattern) is allowed
    assert Limits(adapters=(pattern,)).allows_adapter(name) is allowed
