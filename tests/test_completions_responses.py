"""POST /v1/completions (legacy) and the Responses API through the openai SDK against a real
server: the transformers engine for most, one vLLM-engine server for a smaller set; the store of
responses on both backends (SQLite, Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from pathlib import Path
from dataclasses import replace

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from gateway.auth import key_id
from gateway.errors import APIError
from gateway.response_store import RedisResponses, SQLiteResponses, StoredResponse
from gateway.responses import RECLAIM_TRIES, sse_event
from tests.helpers import start_server, write_config
from tests.test_batch_store import redis_server
from tests.test_batches import _no_stray_processes  # noqa: F401 - autouse: no tiergate serve outlives its test

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                         "required": ["city"], "additionalProperties": False}, "strict": True}]
CLOSED = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}
STALE_S = 30.0  # responses.reclaim_after_s as shipped
EVENTS_TEXT = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
EVENTS_TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")  # Qwen2.5-Coder's names


@pytest.fixture(scope="module")
def tiny_coder(tiny_chat, tmp_path_factory):
    """tiny-chat made a fill-in-the-middle model as code models ship: its tokenizer with Qwen2.5-Coder's
    three FIM tokens, and embedding rows for them."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny-coder")
    tok = AutoTokenizer.from_pretrained(tiny_chat)
    tok.add_tokens(list(FIM), special_tokens=True)
    tok.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat)
    torch.manual_seed(0)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(tiny_chat, tiny_coder, tmp_path_factory):
    folder = tmp_path_factory.mktemp("completions-responses")
    config = write_config(folder, {"tiny-chat": ("chat", tiny_chat), "tiny-coder": ("chat", tiny_coder),
                                   "tiny-chat-fim": ("chat", tiny_chat)}, "limits:\n  max_chat_tokens: 64\n")
    entry = f"  - name: tiny-chat-fim\n    kind: chat\n    path: {tiny_chat}\n"  # its chat roles as FIM tokens
    config.write_text(config.read_text().replace(
        entry, entry + '    fim: {prefix: "<|user|>", suffix: "<|system|>", middle: "<|assistant|>"}\n'))
    s = start_server(config)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_chat):
    return AutoTokenizer.from_pretrained(tiny_chat)


def client(server, tier="paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, timeout=120)


def post(server, path: str, body: dict, tier="paid") -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {server.keys[tier]}"})


def greedy(c, prompt, max_tokens=8, **kw):
    return c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


# -- /v1/completions ----------------------------------------------------------------------------------


def test_a_string_prompt_has_no_template(server, tokenizer):
    r = greedy(client(server), "Hello there", max_tokens=6)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason in ("length", "stop") and r.choices[0].text
    assert r.usage.prompt_tokens == len(tokenizer("Hello there")["input_ids"])  # not the chat template's
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the same ids as a token prompt give the same greedy text
    ids = tokenizer("Hello there")["input_ids"]
    assert greedy(client(server), ids, max_tokens=6).choices[0].text == r.choices[0].text


def test_a_list_of_prompts_with_n_2(server, tokenizer):
    c = client(server)
    prompts = ["The cat", "A dog barks"]
    r = greedy(c, prompts, max_tokens=5, n=2)
    assert [ch.index for ch in sorted(r.choices, key=lambda ch: ch.index)] == [0, 1, 2, 3]
    texts = {ch.index: ch.text for ch in r.choices}
    for p, prompt in enumerate(prompts):  # choice i of prompt p is p * n + i; greedy: all alike
        alone = greedy(c, prompt, max_tokens=5).choices[0].text
        assert texts[2 * p] == texts[2 * p + 1] == alone
    assert r.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    lengths = [ch for ch in r.choices if ch.finish_reason == "length"]
    assert r.usage.completion_tokens >= 5 * len(lengths)
    token_lists = [tokenizer(p)["input_ids"] for p in prompts]
    assert [ch.text for ch in sorted(greedy(c, token_lists, max_tokens=5).choices, key=lambda ch: ch.index)] == \
        [texts[0], texts[2]]


def test_seeded_sampling_gives_each_choice_its_own_seed(server):
    c = client(server)
    r = c.completions.create(model="tiny-chat", prompt="Once", max_tokens=8, n=2, seed=5)
    again = c.completions.create(model="tiny-chat", prompt="Once", max_tokens=8, n=2, seed=5)
    assert [ch.text for ch in r.choices] == [ch.text for ch in again.choices]
    first = c.completions.create(model="tiny-chat", prompt="Once", max_tokens=8, seed=5)
    second = c.completions.create(model="tiny-chat", prompt="Once", max_tokens=8, seed=6)
    assert {ch.index: ch.text for ch in r.choices} == {0: first.choices[0].text, 1: second.choices[0].text}


def _mean(choice) -> float:
    lps = choice.logprobs.token_logprobs
    return sum(lps) / len(lps) if lps else float("-inf")


def test_best_of_answers_the_candidates_with_the_best_mean_logprob(server):
    """``best_of`` 4 with ``n`` 2, seeded: the two answered are, best first, the two of the four
    candidates (the same four as ``n`` 4 with the seed: candidate i is seeded seed + i) with the
    highest mean token logprob, read from that ``n`` 4 answer; usage counts all four, as OpenAI
    bills them; logprobs only when asked. With two prompts, each prompt's best, indexed p * n + i."""
    c = client(server)
    ask = dict(model="tiny-chat", max_tokens=6, seed=3)
    every = c.completions.create(**ask, prompt="Once", n=4, logprobs=0)
    assert len({ch.text for ch in every.choices}) > 2  # sampled: the candidates differ
    ranked = sorted(every.choices, key=lambda ch: -_mean(ch))
    got = c.completions.create(**ask, prompt="Once", n=2, best_of=4)
    assert [ch.index for ch in got.choices] == [0, 1]
    assert [ch.text for ch in got.choices] == [ch.text for ch in ranked[:2]]
    assert all(ch.logprobs is None for ch in got.choices)
    assert got.usage.completion_tokens == every.usage.completion_tokens
    scored = c.completions.create(**ask, prompt="Once", n=2, best_of=4, logprobs=1)
    for mine, theirs in zip(scored.choices, ranked[:2], strict=True):
        assert mine.logprobs.token_logprobs == pytest.approx(theirs.logprobs.token_logprobs, rel=1e-5)
    prompts = ["Once", "Twice upon"]
    each = c.completions.create(**ask, prompt=prompts, n=3, logprobs=0)
    best = c.completions.create(**ask, prompt=prompts, best_of=3)
    for p in range(2):
        mine = [ch for ch in each.choices if ch.index // 3 == p]
        assert [ch.text for ch in best.choices if ch.index == p] == [max(mine, key=_mean).text]
    assert sorted(ch.index for ch in best.choices) == [0, 1]


def test_stream_matches_the_whole_completion(server):
    c = client(server)
    whole = greedy(c, "Stream me", max_tokens=8)
    chunks = list(c.completions.create(model="tiny-chat", prompt="Stream me", max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "text_completion" for ch in chunks)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    many = list(c.completions.create(model="tiny-chat", prompt=["Stream me", "Two"], n=2, max_tokens=4,
                                     temperature=0, stream=True))
    joined = {i: "".join(ch.choices[0].text for ch in many if ch.choices[0].index == i) for i in range(4)}
    ends = [ch.choices[0].index for ch in many if ch.choices[0].finish_reason]
    assert sorted(ends) == [0, 1, 2, 3] and joined[0] == joined[1] and joined[2] == joined[3]
    assert joined[2] == greedy(c, "Two", max_tokens=4).choices[0].text
    with httpx.stream("POST", f"{server.base_url}/completions", headers={"Authorization": f"Bearer {server.keys['free']}"},
                      json={"model": "tiny-chat", "prompt": "x", "max_tokens": 2, "stream": True}) as raw:
        lines = [ln for ln in raw.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


def test_stop_cuts_the_text(server):
    c = client(server)
    text = greedy(c, "Tell me", max_tokens=24).choices[0].text
    stop = next(text[k:k + 2] for k in range(2, len(text) - 2) if text[k:k + 2].strip() and "\ufffd" not in text[k:k + 2])
    r = greedy(c, "Tell me", max_tokens=24, stop=[stop])
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_echo_prepends_the_prompt(server):
    c = client(server)
    plain = greedy(c, "Echo this", max_tokens=5).choices[0].text
    assert greedy(c, "Echo this", max_tokens=5, echo=True).choices[0].text == "Echo this" + plain
    chunks = list(c.completions.create(model="tiny-chat", prompt="Echo this", max_tokens=5, temperature=0,
                                       echo=True, stream=True))
    assert chunks[0].choices[0].text == "Echo this"
    assert "".join(ch.choices[0].text for ch in chunks) == "Echo this" + plain


def test_logprobs_in_the_legacy_shape(server):
    c = client(server)
    r = greedy(c, "Probably", max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    for i, (token, logprob, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        assert logprob <= 0 and token in top and len(top) <= 3
        assert logprob == pytest.approx(max(top.values()))  # greedy: the sampled token is the most likely
        if i:
            assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    assert lp.text_offset[0] == 0
    streamed = list(c.completions.create(model="tiny-chat", prompt="Probably", max_tokens=6, temperature=0,
                                         logprobs=2, stream=True))
    tokens = [t for ch in streamed if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def prompt_reference(tiny_chat, ids: list[int]) -> tuple[list[float], list[float]]:
    """A plain torch reference for a prompt's logprobs: the model from its folder in float32, one
    forward pass, log-softmax at each place: each token's logprob given those before it, and the
    best logprob there (the first token has neither)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_chat, dtype=torch.float32).eval()
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), logprobs.max(-1).values.tolist()


def check_echoed_logprobs(c, tokenizer, tiny_chat, tol: float) -> None:
    """``echo`` with ``logprobs`` and ``max_tokens: 1``, as evaluation harnesses score a
    continuation: the prompt's tokens come first, each with its logprob given the tokens before
    it (the first with none), then the generated token; a token-id prompt gives the same; the
    stream sends the prompt with its logprobs first. Compared with ``prompt_reference`` within
    ``tol`` (absolute, in nats)."""
    context, continuation = "The quick brown fox", " jumps over"
    ids = tokenizer(context + continuation)["input_ids"]
    ctxlen = len(tokenizer(context)["input_ids"])
    expected, best = prompt_reference(tiny_chat, ids)
    r = greedy(c, context + continuation, max_tokens=1, echo=True, logprobs=2)
    plain = greedy(c, context + continuation, max_tokens=1).choices[0].text
    choice = r.choices[0]
    assert choice.text == context + continuation + plain
    lp = choice.logprobs
    n = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 1
    assert lp.tokens[:n] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(expected, abs=tol)
    for i in range(1, n):  # the prompt token and the 2 best at its place
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and len(top) <= 3 and max(top.values()) == pytest.approx(best[i - 1], abs=tol)
    assert lp.text_offset[:n] == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert lp.text_offset[n] == len(context + continuation)  # the generated token, in the text returned
    # what lm-evaluation-harness's local-completions model sums: the continuation's logprobs
    assert sum(lp.token_logprobs[ctxlen:-1]) == pytest.approx(sum(expected[ctxlen - 1:]), abs=tol * n)
    as_ids = greedy(c, ids, max_tokens=1, echo=True, logprobs=2).choices[0].logprobs
    assert as_ids.tokens == lp.tokens and as_ids.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=tol)
    chunks = list(c.completions.create(model="tiny-chat", prompt=ids, max_tokens=3, temperature=0, echo=True,
                                       logprobs=2, stream=True))
    first = chunks[0].choices[0]
    assert first.text == tokenizer.decode(ids) and first.logprobs.tokens == lp.tokens[:n]
    assert first.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=tol)
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert streamed[:n + 1] == lp.tokens and len(streamed) <= n + 3
    # max_tokens 0 (the older idiom): the prompt scored, nothing generated, whole and streamed
    scored = greedy(c, context + continuation, max_tokens=0, echo=True, logprobs=2)
    only = scored.choices[0]
    assert only.text == context + continuation and only.finish_reason == "length"
    assert only.logprobs.tokens == lp.tokens[:n] and only.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=tol)
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (n, 0)
    chunks = list(c.completions.create(model="tiny-chat", prompt=ids, max_tokens=0, temperature=0, echo=True,
                                       logprobs=2, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == tokenizer.decode(ids)
    assert [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens] == lp.tokens[:n]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["length"]


def test_echo_with_logprobs_gives_the_prompts_logprobs(server, tokenizer, tiny_chat, monkeypatch):
    check_echoed_logprobs(client(server), tokenizer, tiny_chat, tol=1e-4)
    whole = greedy(client(server), "The quick brown fox jumps over", max_tokens=1, echo=True, logprobs=2)
    monkeypatch.setattr("workers.chat._PROMPT_CHUNK", 3)  # the log-softmax a few places at a time: the same
    chunked = greedy(client(server), "The quick brown fox jumps over", max_tokens=1, echo=True, logprobs=2)
    assert chunked.choices[0].logprobs == whole.choices[0].logprobs
    r = greedy(client(server), ["The cat", "A dog barks"], max_tokens=2, n=2, echo=True, logprobs=0)
    for ch in r.choices:  # each choice has its own prompt's tokens; logprobs 0: only the token's own
        prompt = ["The cat", "A dog barks"][ch.index // 2]
        n = len(tokenizer(prompt)["input_ids"])
        assert ch.text.startswith(prompt) and ch.logprobs.tokens[:n] == \
            [tokenizer.decode([t]) for t in tokenizer(prompt)["input_ids"]]
        assert all(len(top) == 1 for top in ch.logprobs.top_logprobs[1:n])


def fim_layout(tok, prompt: str, suffix: str, names=FIM) -> list[int]:
    """The layout a FIM-trained code model reads, built here token by token."""
    pre, suf, mid = tok.convert_tokens_to_ids(list(names))
    return [pre, *tok.encode(prompt, add_special_tokens=False), suf, *tok.encode(suffix, add_special_tokens=False), mid]


def test_suffix_fills_in_the_middle_on_a_model_with_fim_tokens(server, tiny_coder):
    """The completion with ``suffix`` is the model's greedy continuation of the prefix-suffix-middle
    layout (the same as that layout sent as token ids), whole and streamed, for every prompt; the
    prompt's tokens are the layout's."""
    tok, c = AutoTokenizer.from_pretrained(tiny_coder), client(server)
    prefix, suffix = "def add(a, b):\n    ", "\n    return total"
    layout = fim_layout(tok, prefix, suffix)
    filled = c.completions.create(model="tiny-coder", prompt=prefix, suffix=suffix, max_tokens=8, temperature=0)
    plain = c.completions.create(model="tiny-coder", prompt=layout, max_tokens=8, temperature=0)
    assert filled.choices[0].text == plain.choices[0].text and filled.choices[0].text
    assert filled.usage.prompt_tokens == len(layout)
    without = c.completions.create(model="tiny-coder", prompt=prefix, max_tokens=8, temperature=0)
    assert without.usage.prompt_tokens == len(tok(prefix)["input_ids"])  # a prompt alone is not laid out
    streamed = c.completions.create(model="tiny-coder", prompt=[prefix, "x = "], suffix=suffix, max_tokens=8,
                                    temperature=0, stream=True)
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts[0] == filled.choices[0].text
    second = c.completions.create(model="tiny-coder", prompt=fim_layout(tok, "x = ", suffix), max_tokens=8, temperature=0)
    assert texts[1] == second.choices[0].text


def test_fim_tokens_named_in_tiers_yaml(server, tokenizer):
    c = client(server)
    names = ("<|user|>", "<|system|>", "<|assistant|>")
    filled = c.completions.create(model="tiny-chat-fim", prompt="The cat", suffix="the mat", max_tokens=6, temperature=0)
    plain = greedy(c, fim_layout(tokenizer, "The cat", "the mat", names), max_tokens=6)
    assert filled.choices[0].text == plain.choices[0].text
    assert filled.usage.prompt_tokens == len(fim_layout(tokenizer, "The cat", "the mat", names))


@pytest.mark.parametrize("model, body, param, says", [
    ("tiny-chat", {"suffix": "y"}, "suffix", "no fill-in-the-middle tokens"),  # none of the layouts, none named
    ("tiny-coder", {"suffix": "y", "echo": True}, "echo", "echo with suffix"),
])
def test_a_suffix_the_model_cannot_fill_is_a_400(server, model, body, param, says):
    r = post(server, "/completions", {"model": model, "prompt": "x", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and says in r.json()["error"]["message"]


def test_fim_ids_finds_each_layout_and_checks_named_tokens(tokenizer, tiny_embed):
    from gateway.completions import FIM_LAYOUTS, fim_ids

    assert fim_ids(tokenizer) is None
    with_unk = AutoTokenizer.from_pretrained(tiny_embed)  # a missing token reads as [UNK]'s id there
    assert with_unk.convert_tokens_to_ids("<fim_prefix>") == with_unk.unk_token_id is not None
    assert fim_ids(with_unk) is None
    with pytest.raises(APIError, match="<nope>"):
        fim_ids(with_unk, ("[CLS]", "<nope>", "[SEP]"))
    for layout in FIM_LAYOUTS:
        tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
        tok.add_tokens(list(layout), special_tokens=True)
        assert fim_ids(tok) == tuple(tok.convert_tokens_to_ids(list(layout)))
    assert fim_ids(tokenizer, ("<|user|>", "<|system|>", "<|assistant|>")) == \
        tuple(tokenizer.convert_tokens_to_ids(["<|user|>", "<|system|>", "<|assistant|>"]))
    with pytest.raises(APIError, match="<nope>"):
        fim_ids(tokenizer, ("<|user|>", "<nope>", "<|assistant|>"))


def test_a_tokenizer_s_bos_comes_before_the_fim_layout(tokenizer):
    from tokenizers.processors import TemplateProcessing

    from gateway.completions import encode_prompts

    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    assert tok("ab")["input_ids"][0] == tok.bos_token_id  # it adds a BOS now
    fim = (3, 4, 5)
    [text, ids] = encode_prompts(tok, ["ab cd", [7, 8]], " ef", fim)
    assert text.ids == [tok.bos_token_id, 3, *tok.encode("ab cd", add_special_tokens=False), 4,
                        *tok.encode(" ef", add_special_tokens=False), 5]
    assert ids.ids == [3, 7, 8, 4, *tok.encode(" ef", add_special_tokens=False), 5]  # token ids are as sent


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "n": 99}, "n"),
    ({"prompt": [1, 2, 10 ** 9]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1], "x"]}, "prompt"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "stop": ["a", ""]}, "stop"),
    ({"prompt": "x", "max_tokens": 65}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # scoring (0) needs echo and logprobs
    ({"prompt": "x", "max_tokens": 0, "echo": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1, "echo": True, "logprobs": 1}, "max_tokens"),
    ({"prompt": "word " * 600}, "prompt"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),  # fewer candidates than choices
    ({"prompt": "x", "best_of": 5}, "best_of"),  # above limits.max_n (4)
    ({"prompt": "x", "best_of": 2, "stream": True}, "best_of"),  # the best are known only at the end
    ({"prompt": [[5]] * 17, "best_of": 4}, "prompt"),  # 68 candidates, above MAX_CHOICES (64)
    ({"prompt": "x", "logit_bias": {"²": 1}}, "logit_bias"),  # a digit to str.isdigit, not to int
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
])
def test_bad_completion_input_is_a_400_naming_the_param(server, body, param):
    r = post(server, "/completions", {"model": "tiny-chat", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_completion_and_response_lines_in_a_batch(server):
    c = client(server)
    lines = [{"custom_id": "c", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny-chat", "prompt": "Batch", "max_tokens": 4, "temperature": 0}}]
    upload = c.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())),
                            purpose="batch")
    batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    rlines = [{"custom_id": "r", "method": "POST", "url": "/v1/responses",
               "body": {"model": "tiny-chat", "input": "Batch", "max_output_tokens": 4, "temperature": 0}},
              {"custom_id": "bg", "method": "POST", "url": "/v1/responses",  # a line runs on its own already
               "body": {"model": "tiny-chat", "input": "Batch", "background": True}},
              {"custom_id": "conv", "method": "POST", "url": "/v1/responses",  # a line has no conversation
               "body": {"model": "tiny-chat", "input": "Batch", "conversation": "conv_0"}}]
    rupload = c.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in rlines).encode())),
                             purpose="batch")
    rbatch = c.batches.create(input_file_id=rupload.id, endpoint="/v1/responses", completion_window="24h")
    deadline = time.time() + 120
    for b in (batch, rbatch):
        while (b := c.batches.retrieve(b.id)).status not in ("completed", "failed", "expired", "cancelled"):
            assert time.time() < deadline, b.status
            time.sleep(0.05)
        assert b.status == "completed" and b.request_counts.completed == 1, b
        body = json.loads(c.files.content(b.output_file_id).text)["response"]["body"]
        if b.endpoint == "/v1/responses":
            refused = {r["custom_id"]: r["response"]["body"]["error"]["param"]
                       for r in map(json.loads, c.files.content(b.error_file_id).text.splitlines())}
            assert refused == {"bg": "background", "conv": "conversation"}
        if b.endpoint == "/v1/completions":
            assert body["choices"][0]["text"] == greedy(c, "Batch", max_tokens=4).choices[0].text
        else:
            live = c.responses.create(model="tiny-chat", input="Batch", max_output_tokens=4, temperature=0)
            assert body["object"] == "response" and body["output"][0]["content"][0]["text"] == live.output_text


# -- /v1/responses ------------------------------------------------------------------------------------


def respond(c, input, **kw):
    kw.setdefault("max_output_tokens", 8)
    kw.setdefault("temperature", 0)
    return c.responses.create(model="tiny-chat", input=input, **kw)


def test_responses_take_vllms_sampling_extensions(server):
    """top_k, min_p and repetition_penalty, as vLLM's Responses API takes them (extra_body): top_k
    1 at temperature 1 leaves only the likeliest token, so the reply is the greedy one; a draw
    without it is not (24 tokens of a random-weight model, whose tokens are near even odds); a
    repetition penalty changes a greedy reply that repeats a token; bad values are 400s."""
    c = client(server)
    greedy = respond(c, "Hello", max_output_tokens=24)
    assert respond(c, "Hello", max_output_tokens=24, temperature=1, extra_body={"top_k": 1}).output_text == greedy.output_text
    assert respond(c, "Hello", max_output_tokens=24, temperature=1).output_text != greedy.output_text
    tok = AutoTokenizer.from_pretrained(server.services.arbiter.specs["tiny-chat"].path)
    ids = tok(greedy.output_text, add_special_tokens=False)["input_ids"]
    assert len(set(ids)) < len(ids), f"the greedy reply repeats no token: pick another prompt ({greedy.output_text!r})"
    penalized = respond(c, "Hello", max_output_tokens=24, extra_body={"repetition_penalty": 100})
    assert penalized.output_text != greedy.output_text
    for field, value in (("top_k", -2), ("min_p", 2), ("repetition_penalty", 0)):
        with pytest.raises(openai.BadRequestError) as bad:
            respond(c, "Hello", extra_body={field: value})
        assert bad.value.body["param"] == field


def test_openais_nullable_fields_sent_as_null_are_their_defaults(server):
    """OpenAI's nullable fields sent as null (the openai SDK's explicit None) are taken as left out,
    as OpenAI and vllm serve take them: a completion's sampling fields, ``n``, ``stream`` and
    ``echo``; a response's sampling fields, ``stream``, ``background`` and ``store`` (stored: true
    is its default)."""
    c = client(server)
    left_out = c.completions.create(model="tiny-chat", prompt="Hello", max_tokens=6, seed=4)
    sent = c.completions.create(model="tiny-chat", prompt="Hello", max_tokens=6, seed=4, temperature=None, top_p=None,
                                n=None, stream=None, echo=None, presence_penalty=None, frequency_penalty=None)
    assert [x.text for x in sent.choices] == [x.text for x in left_out.choices]
    r = c.responses.create(model="tiny-chat", input="Hello", max_output_tokens=8, temperature=None, top_p=None,
                           store=None, stream=None, background=None)
    assert r.status in ("completed", "incomplete") and r.temperature == 1.0
    assert c.responses.retrieve(r.id).id == r.id


def test_the_end_user_and_cache_fields_are_accepted_echoed_and_logged_scoped(server, caplog):
    from gateway.auth import key_id
    from gateway.schemas import EndUser

    caplog.set_level("INFO", logger="tiergate")
    c = client(server)
    plain = respond(c, "Hello there")
    tagged = respond(c, "Hello there", safety_identifier="carol@example.com", prompt_cache_key="app-2",
                     prompt_cache_retention="in-memory", max_tool_calls=3)
    assert tagged.output_text == plain.output_text
    assert (tagged.safety_identifier, tagged.prompt_cache_key, tagged.max_tool_calls) == ("carol@example.com", "app-2", 3)
    assert c.responses.retrieve(tagged.id).safety_identifier == "carol@example.com"
    assert "carol@example.com" not in caplog.text
    assert EndUser(safety_identifier="carol@example.com").end_user(key_id(server.keys["paid"])) in caplog.text
    events = list(c.responses.create(model="tiny-chat", input="Hello there", temperature=0, max_output_tokens=8, stream=True,
                                     stream_options={"include_obfuscation": False}))
    assert events[-1].response.output_text == plain.output_text
    with pytest.raises(openai.BadRequestError) as e:
        respond(c, "hi", max_tool_calls=0)
    assert e.value.body["param"] == "max_tool_calls"


def test_a_string_input(server):
    r = respond(client(server), "Hello there")
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text == r.output[0].content[0].text and r.output_text
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 8
    else:
        assert r.status == "completed"


def test_items_and_instructions_are_the_chat_prompt(server):
    c = client(server)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
             {"role": "user", "content": "How are you?"}]
    r = respond(c, items, instructions="Be brief")
    chat = c.chat.completions.create(model="tiny-chat", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "How are you?"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content


def test_previous_response_id_continues_the_conversation(server):
    c = client(server)
    first = respond(c, "Hi", instructions="Be brief")
    second = respond(c, "Say more", previous_response_id=first.id)
    # the same conversation spelt out: the first exchange (its instructions are not carried over)
    spelt = respond(c, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                        {"role": "user", "content": "Say more"}])
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == spelt.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == spelt.output_text


def test_a_stored_response_keeps_its_input_once(server):
    """A stored response keeps its input items (what ``input_items`` lists and a continuation reads
    again), not also the chat messages made of them: a chain over a long input (an inline image,
    say) stores it once a record, where it stored it twice, and a continuation reads it as before."""
    c, store, owner = client(server), server.app.state.responses, key_id(server.keys["paid"])
    text = "The gold is under the palm tree. " * 12
    first = respond(c, text, max_output_tokens=2)
    second = respond(c, "Where?", previous_response_id=first.id, max_output_tokens=2)
    third = respond(c, "And the map?", previous_response_id=second.id, max_output_tokens=2)
    for made in (first, second, third):
        assert server.wait(store.get(made.id, owner)).doc().count(text) == 1
    spelt = respond(c, [{"role": "user", "content": text}, {"role": "assistant", "content": first.output_text},
                        {"role": "user", "content": "Where?"}, {"role": "assistant", "content": second.output_text},
                        {"role": "user", "content": "And the map?"}], max_output_tokens=2)
    assert third.usage.input_tokens == spelt.usage.input_tokens


def test_a_reasoning_item_in_the_input_is_accepted_and_listed_as_given(server):
    """A reasoning item from an earlier turn (as OpenAI wrote it; the Agents SDK sends them back)
    is accepted and ``input_items`` lists it as sent. Its text goes to the template with the
    assistant message after it (tests/test_reasoning.py); tiny-chat's template does not read it,
    so the prompt is the one without it."""
    c = client(server)
    thought = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "thought about it"}],
               "encrypted_content": "gAAAA"}
    turn = [{"role": "user", "content": "Hi"}, thought, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "More?"}]
    with_it = respond(c, turn, store=True)
    without = respond(c, [item for item in turn if item is not thought])
    assert with_it.usage.input_tokens == without.usage.input_tokens
    listed = list(c.responses.input_items.list(with_it.id, order="asc"))
    assert [(i.type, i.id) for i in listed][1] == ("reasoning", "rs_1")
    # the SDK's own item dumped whole (model_dump()): content and status null
    from openai.types.responses import ResponseReasoningItem
    dumped = ResponseReasoningItem.model_validate(thought).model_dump()
    assert dumped["content"] is None
    again = respond(c, [dumped if item is thought else item for item in turn])
    assert again.usage.input_tokens == without.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as bad:
        respond(c, [{"type": "reasoning", "summary": "text"}, {"role": "user", "content": "Hi"}])
    assert bad.value.body["param"] == "input[0].summary"
    with pytest.raises(openai.BadRequestError) as bad:
        respond(c, [{"type": "reasoning", "summary": [], "content": "text"}, {"role": "user", "content": "Hi"}])
    assert bad.value.body["param"] == "input[0].content"
    with pytest.raises(openai.BadRequestError) as bad:
        respond(c, [thought])
    assert bad.value.body["param"] == "input" and "no message to answer" in bad.value.body["message"]


def test_input_items_list_what_a_response_was_made_from(server):
    """``responses.input_items.list``: a continued response's items are the previous one's input
    and output items, ids unchanged, then its own input as sent (no instructions, not its own
    reply), newest first by default, ``asc`` on request, paged by ``after`` (the SDK follows the
    cursor), function calls and their outputs as items; another key gets 404, a bad ``limit``,
    ``order`` or cursor a 400 naming it."""
    c = client(server)
    first = respond(c, [{"role": "developer", "content": "Rules"},
                        {"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                     {"type": "input_text", "text": " there"}]}],
                    instructions="Be brief")
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Rome"}'}
    second = respond(c, [{"role": "user", "content": "Weather in Rome?", "id": "msg_mine"}, call,
                         {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
                     previous_response_id=first.id)
    firsts = list(c.responses.input_items.list(first.id, order="asc"))
    assert [(i.role, [p.text for p in i.content]) for i in firsts] == [("developer", ["Rules"]), ("user", ["Hi", " there"])]
    asc = list(c.responses.input_items.list(second.id, order="asc"))
    assert [i.id for i in asc[:3]] == [firsts[0].id, firsts[1].id, first.output[0].id]
    assert asc[2].type == "message" and asc[2].role == "assistant" and asc[2].content[0].text == first.output_text
    assert (asc[3].id, asc[3].role, asc[3].content[0].text) == ("msg_mine", "user", "Weather in Rome?")
    assert (asc[4].type, asc[4].call_id, asc[4].name, asc[4].arguments) == \
        ("function_call", "call_1", "get_weather", '{"city":"Rome"}')
    assert (asc[5].type, asc[5].call_id, asc[5].output) == ("function_call_output", "call_1", "sunny")
    assert len({i.id for i in asc}) == 6 and all(i.status == "completed" for i in asc[3:])
    assert [i.id for i in c.responses.input_items.list(second.id)] == [i.id for i in reversed(asc)]
    page = c.responses.input_items.list(second.id, limit=4, order="asc")
    assert [i.id for i in page.data] == [i.id for i in asc[:4]] and page.has_more
    assert [i.id for i in page] == [i.id for i in asc]  # iterating follows `after` to the end
    later = c.responses.input_items.list(second.id, order="asc", after=asc[1].id, limit=2)
    assert [i.id for i in later.data] == [asc[2].id, asc[3].id] and later.has_more
    before = c.responses.input_items.list(second.id, order="asc", extra_query={"before": asc[2].id})
    assert [i.id for i in before.data] == [asc[0].id, asc[1].id] and not before.has_more
    before = c.responses.input_items.list(second.id, order="asc", limit=2, extra_query={"before": asc[5].id})
    assert [i.id for i in before.data] == [asc[3].id, asc[4].id] and before.has_more  # the page just before it
    with pytest.raises(openai.NotFoundError):
        client(server, "free").responses.input_items.list(second.id)
    for given, at in (([{"role": "user", "content": "a", "id": "msg_twice"}, {"role": "user", "content": "b", "id": "msg_twice"}],
                       "input[1].id"),
                      ([{"role": "user", "content": "again", "id": "msg_mine"}], "input[0].id")):  # msg_mine is in second's
        r = post(server, "/responses", {"model": "tiny-chat", "input": given, "previous_response_id": second.id})
        assert r.status_code == 400 and r.json()["error"]["param"] == at, r.text
    for query, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "²"}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "msg_nope"}, "after")):
        r = httpx.get(f"{server.base_url}/responses/{second.id}/input_items", params=query,
                      headers={"Authorization": f"Bearer {server.keys['paid']}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_top_logprobs_in_output_text(server):
    r = respond(client(server), "Probably", top_logprobs=2, max_output_tokens=6)
    entries = r.output[0].content[0].logprobs
    if r.status == "incomplete":  # every token generated has its entry (an end-of-text token has none)
        assert len(entries) == r.usage.output_tokens == 6
    assert entries and all(e.logprob <= 0 and 0 < len(e.top_logprobs) <= 2 for e in entries)
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in entries)  # greedy: the best one


def test_include_output_text_logprobs_asks_for_them(server):
    """``include=["message.output_text.logprobs"]`` (OpenAI's way to ask): the output text's logprobs
    without alternatives, or with ``top_logprobs`` of them; the same tokens as top_logprobs alone
    reads (greedy). Without either, ``[]``, as OpenAI sends it, stored and read back the same."""
    c = client(server)
    plain = respond(c, "Probably", max_output_tokens=6)
    assert plain.output[0].content[0].logprobs == [] == c.responses.retrieve(plain.id).output[0].content[0].logprobs
    got = respond(c, "Probably", max_output_tokens=6, include=["message.output_text.logprobs"])
    entries = got.output[0].content[0].logprobs
    assert entries and all(e.logprob <= 0 and e.top_logprobs == [] for e in entries)
    both = respond(c, "Probably", max_output_tokens=6, include=["message.output_text.logprobs"], top_logprobs=2)
    assert [(e.token, e.logprob) for e in both.output[0].content[0].logprobs] == \
        [(e.token, pytest.approx(e.logprob)) for e in entries]
    assert all(len(e.top_logprobs) == 2 for e in both.output[0].content[0].logprobs)


def test_get_delete_and_other_keys(server):
    c, other = client(server), client(server, "free")
    r = respond(c, "Keep me")
    got = c.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage.output_tokens == r.usage.output_tokens
    for call in (lambda: other.responses.retrieve(r.id), lambda: other.responses.delete(r.id),
                 lambda: respond(other, "x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(r.id)
    unstored = respond(c, "Forget me", store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_streamed_text_events_in_order(server):
    c = client(server)
    whole = respond(c, "Stream it")
    with c.responses.stream(model="tiny-chat", input="Stream it", max_output_tokens=8, temperature=0) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == EVENTS_TEXT + ["response.output_text.delta"] * len(deltas) + EVENTS_TEXT_END + \
        [f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert c.responses.retrieve(final.id).output_text == text  # stored before the last event


def test_structured_output_completes_and_validates(server):
    c = client(server)
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": CLOSED, "strict": True}}
    with c.responses.stream(model="tiny-chat", input="Answer", text=fmt, max_output_tokens=64) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    answer = json.loads(final.output_text)
    assert isinstance(answer["ok"], bool) and answer["n"] in (1, 2, 3) and set(answer) == {"ok", "n"}
    assert json.loads(respond(c, "Answer", text=fmt, max_output_tokens=64).output_text).keys() == {"ok", "n"}


def test_the_sdks_pydantic_helpers_parse_the_output(server):
    """``client.responses.parse`` and ``client.responses.stream`` with ``text_format=`` a pydantic
    model (how applications ask for structured outputs): the SDK turns the model into a strict JSON
    schema, and the reply parses into it, whole and streamed."""
    from typing import Literal

    import pydantic

    class Closed(pydantic.BaseModel):
        ok: bool
        n: Literal[1, 2, 3]

    c = client(server)
    parsed = c.responses.parse(model="tiny-chat", input="Answer", text_format=Closed, max_output_tokens=64)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Closed)
    assert parsed.output_parsed == Closed.model_validate_json(parsed.output_text)
    with c.responses.stream(model="tiny-chat", input="Answer", text_format=Closed, max_output_tokens=64) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(final.output_parsed, Closed)


def test_required_tool_call_and_its_output(server):
    c = client(server)
    r = respond(c, "Weather in Paris?", tools=TOOLS, tool_choice="required", max_output_tokens=64)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].call_id.startswith("call_")
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    after = respond(c, [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
                    previous_response_id=r.id, tools=TOOLS)
    # the output items go back as input as the SDK parsed them
    spelt = respond(c, [{"role": "user", "content": "Weather in Paris?"}] + r.output
                    + [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}], tools=TOOLS)
    assert after.usage.input_tokens == spelt.usage.input_tokens > r.usage.input_tokens
    assert after.output_text == spelt.output_text
    # or dumped whole (model_dump()): the SDK's call items carry caller and namespace, null here
    dumped = respond(c, [{"role": "user", "content": "Weather in Paris?"}] + [o.model_dump() for o in r.output]
                     + [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny", "caller": None,
                         "name": "get_weather", "namespace": None}], tools=TOOLS)
    assert dumped.usage.input_tokens == spelt.usage.input_tokens and dumped.output_text == spelt.output_text


def test_allowed_tools_choice_calls_only_the_listed_tools(server):
    """Responses' flat ``allowed_tools`` choice: ``required`` over one of two tools calls it, the
    other is not in the prompt, and the response echoes the choice as asked."""
    c = client(server)
    alarm = {"type": "function", "name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "enum": [6, 7]}}, "required": ["hour"],
        "additionalProperties": False}, "strict": True}
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "set_alarm"}]}
    r = respond(c, "Wake me", tools=[*TOOLS, alarm], tool_choice=choice, parallel_tool_calls=False,
                max_output_tokens=64)
    assert [(o.type, o.name) for o in r.output] == [("function_call", "set_alarm")]
    assert json.loads(r.output[0].arguments)["hour"] in (6, 7)
    assert r.tool_choice.type == "allowed_tools" and r.tool_choice.mode == "required"
    assert [t["name"] for t in r.tool_choice.tools] == ["set_alarm"]
    alone = respond(c, "Wake me", tools=[alarm], tool_choice="required", parallel_tool_calls=False, max_output_tokens=64)
    assert r.usage.input_tokens == alone.usage.input_tokens  # get_weather was not rendered


def test_a_call_cut_by_max_output_tokens_is_incomplete(server):
    c = client(server)
    whole = respond(c, "Weather?", tools=TOOLS, tool_choice="required", max_output_tokens=64)
    assert whole.status == "completed"
    # greedy, so the same call, cut one token short of its end
    kw = dict(tools=TOOLS, tool_choice="required", max_output_tokens=whole.usage.output_tokens - 1)
    r = respond(c, "Weather?", **kw)
    assert r.status == "incomplete" and [(o.type, o.status) for o in r.output] == [("function_call", "incomplete")]
    with c.responses.stream(model="tiny-chat", input="Weather?", temperature=0, **kw) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and events[-2].item.status == "incomplete"
    assert events[-1].response.output[0].arguments == r.output[0].arguments


def test_streamed_function_call_arguments(server):
    c = client(server)
    with c.responses.stream(model="tiny-chat", input="Weather?", tools=TOOLS, max_output_tokens=64,
                            tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "function_call" and events[2].item.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "".join(deltas) == done.arguments == final.output[0].arguments
    assert json.loads(done.arguments)["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": "ns"}]},
     "input[0].namespace"),  # namespaced tools are not served
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                 "caller": {"type": "program", "caller_id": "p"}}]}, "input[0].caller"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # thinking alone: no message to answer
    ({"input": "x", "max_output_tokens": 65}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "strng"}}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": CLOSED}}}, "text.format.name"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "tools": [{**TOOLS[0], "parameters": {"type": "strng"}}]}, "tools[0].parameters"),
    ({"input": "word " * 600}, "input"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),  # the Agents SDK's WebSearchTool
])
def test_bad_response_input_is_a_400_naming_the_param(server, body, param):
    r = post(server, "/responses", {"model": "tiny-chat", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if param == "tools[0].type":
        assert "'web_search' are not served here" in r.json()["error"]["message"]


# -- background responses -----------------------------------------------------------------------------


def wait_until_done(c, response_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while (r := c.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, r
        time.sleep(0.05)
    return r


def test_background_response_is_answered_queued_and_polled_to_its_end(server):
    c = client(server)
    alone = respond(c, "Tell me a story", max_output_tokens=24)
    made = c.responses.create(model="tiny-chat", input="Tell me a story", max_output_tokens=24, temperature=0,
                              background=True)
    assert made.status == "queued" and made.background is True and made.output == [] and made.usage is None
    done = wait_until_done(c, made.id)
    assert done.status == alone.status and done.background is True
    assert done.output_text == alone.output_text and done.usage.output_tokens == alone.usage.output_tokens
    assert done.error is None
    items = c.responses.input_items.list(made.id)
    assert [i.type for i in items.data] == ["message"]
    follow = respond(c, "And then?", previous_response_id=made.id, max_output_tokens=4)  # a finished one continues
    assert follow.status in ("completed", "incomplete")


def test_a_limit_no_prompt_fits_beside_is_a_400_at_once_even_in_the_background(server, monkeypatch):
    """A reply limit at or past the model's context (the server's own limit above it) leaves no
    room for any prompt: 400 ``context_length_exceeded`` naming the limit, before anything runs,
    on chat, completions and responses, a background one too (it was answered queued, then
    failed); a limit one token under the context is served (its prompt then decides)."""
    config = server.services.config
    context = client(server).models.retrieve("tiny-chat").model_extra["max_model_len"]
    monkeypatch.setattr(server.services, "config", config.model_copy(
        update={"limits": config.limits.model_copy(update={"max_chat_tokens": context + 100})}))
    for path, body, param in [
            ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": context},
             "max_tokens"),
            ("/completions", {"prompt": "hi", "max_tokens": context + 1}, "max_tokens"),
            ("/responses", {"input": "hi", "max_output_tokens": context}, "max_output_tokens"),
            ("/responses", {"input": "hi", "max_output_tokens": context, "background": True}, "max_output_tokens")]:
        r = post(server, path, {"model": "tiny-chat", **body})
        assert r.status_code == 400, (path, body, r.text)
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("context_length_exceeded", param)
    fits = post(server, "/chat/completions", {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": context - 32, "temperature": 0})
    assert fits.status_code == 200, fits.text


def _slow_background(c, **kw):
    """A background response long enough to be caught running, mostly: 64 tokens (the tiny model
    writes one every ~1-3 ms here, so it runs for ~0.06-0.2 s)."""
    return c.responses.create(model="tiny-chat", input="Count to a thousand", max_output_tokens=64,
                              background=True, **kw)


def test_cancel_stops_a_running_background_response(server):
    c = client(server)
    respond(c, "hi", max_output_tokens=1)  # the model loaded, so its worker is there to count steps
    worker = server.services.arbiter.workers["tiny-chat"]
    for _ in range(5):  # a fast machine may finish its 64 tokens before the cancel lands: again
        before = server.call(lambda: worker.steps)
        made = _slow_background(c)
        gone = c.responses.cancel(made.id)
        if gone.status != "completed":
            break
    assert gone.status == "cancelled" and gone.output == []
    assert c.responses.cancel(made.id).status == "cancelled"  # again: the same, idempotent
    assert not server.app.state.background.running
    time.sleep(0.2)  # a step in flight when the cancel landed ends
    steps = server.call(lambda: worker.steps)
    assert steps - before < 60  # the engine stopped short of the 64 tokens asked
    time.sleep(0.3)
    assert server.call(lambda: worker.steps) == steps  # and decodes nothing more for it
    assert c.responses.retrieve(made.id).status == "cancelled"  # not overwritten by a finish
    with pytest.raises(openai.BadRequestError) as e:  # only a finished response continues
        respond(c, "more", previous_response_id=made.id)
    assert e.value.body["param"] == "previous_response_id"
    done = wait_until_done(c, _slow_background(c).id)
    assert c.responses.cancel(done.id).status == done.status  # a finished one is returned as it is
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.cancel(respond(c, "hi", max_output_tokens=2).id)
    assert e.value.body["code"] == "not_background"
    with pytest.raises(openai.NotFoundError):
        c.responses.cancel("resp_nope")
    with pytest.raises(openai.NotFoundError):  # another key's
        client(server, "free").responses.cancel(done.id)


def test_a_queued_background_response_counts_for_the_drain_and_cancels_from_the_queue(server):
    """With paid's slots all taken, a background response waits at the gate, ``queued``; while it
    does it counts as work in flight for a drain (a SIGTERM waits for it); a cancel takes it out of
    the gate's queue before any model work."""
    gate, state, c = server.services.gate, server.app.state, client(server)
    tickets = [server.wait(gate.acquire("paid", "tiny-chat")) for _ in range(gate.limits["paid"])]
    try:
        made = c.responses.create(model="tiny-chat", input="hi", max_output_tokens=4, background=True)
        time.sleep(0.2)
        assert c.responses.retrieve(made.id).status == "queued"
        assert server.call(lambda: (state.drain.inflight, gate.queued("paid"))) == (1, 1)
        scraped = httpx.get(f"{server.url}/metrics", timeout=30).text
        assert "tiergate_background_responses 1.0" in scraped and 'tiergate_queued{tier="paid"} 1.0' in scraped
        assert c.responses.cancel(made.id).status == "cancelled"
        assert server.call(lambda: (state.drain.inflight, gate.queued("paid"), len(state.background.running))) == (0, 0, 0)
    finally:
        for ticket in tickets:
            server.call(gate.release, ticket)
    time.sleep(0.2)
    assert c.responses.retrieve(made.id).status == "cancelled"


def test_a_cancel_written_by_another_process_stops_the_work(server, monkeypatch):
    """Another process cancels (it writes ``cancelled`` to the store): the running process finds it
    at its next write, stops the work (here: takes it out of the gate's queue, the slots still all
    taken) and leaves the record cancelled."""
    import gateway.response_runs as runs

    monkeypatch.setattr(runs, "HEARTBEAT_S", 0.05)
    gate, state, store, c = server.services.gate, server.app.state, server.app.state.responses, client(server)
    tickets = [server.wait(gate.acquire("paid", "tiny-chat")) for _ in range(gate.limits["paid"])]
    try:
        made = c.responses.create(model="tiny-chat", input="hi", max_output_tokens=4, background=True)
        record = server.wait(store.get(made.id, key_id(server.keys["paid"])))
        cancelled = replace(record, response={**record.response, "status": "cancelled"}, beat=time.time())
        assert server.wait(store.update_running(cancelled))
        deadline = time.monotonic() + 10
        while server.call(lambda: made.id in state.background.running) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.call(lambda: (made.id in state.background.running, gate.queued("paid"))) == (False, 0)
    finally:
        for ticket in tickets:
            server.call(gate.release, ticket)
    assert c.responses.retrieve(made.id).status == "cancelled"


def test_on_redis_another_processs_cancel_or_delete_stops_the_work_at_once(tiny_chat, tmp_path, monkeypatch):
    """On Redis a cancel or delete made by another process is announced, and the process running
    the response stops it at once: not at its next write (here 60 s away)."""
    import gateway.response_runs as runs

    monkeypatch.setattr(runs, "HEARTBEAT_S", 60.0)
    with redis_server(tmp_path) as url:
        s = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, f"batch:\n  store: {url}\n"))
        gate, state, c = s.services.gate, s.app.state, client(s)
        tickets = [s.wait(gate.acquire("paid", "tiny-chat")) for _ in range(gate.limits["paid"])]
        try:
            for how in ("cancel", "delete"):
                made = c.responses.create(model="tiny-chat", input="hi", max_output_tokens=4, background=True)
                assert s.call(lambda: made.id in state.background.running)

                async def elsewhere() -> None:  # another process's store on the same Redis
                    other = RedisResponses(url)
                    await other.open()
                    record = await other.get(made.id, key_id(s.keys["paid"]))
                    if how == "cancel":
                        assert await other.update_running(replace(record, response={**record.response, "status": "cancelled"}))
                    else:
                        assert await other.delete(made.id, record.owner)
                    await other.announce_stop(made.id)
                    await other.close()

                asyncio.run(elsewhere())
                deadline = time.monotonic() + 3
                while s.call(lambda: made.id in state.background.running) and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert s.call(lambda: (made.id in state.background.running, gate.queued("paid"))) == (False, 0), how
        finally:
            for ticket in tickets:
                s.call(gate.release, ticket)
            s.stop()


@pytest.mark.parametrize("loop", ["stops", "every"])
def test_on_redis_the_shutdown_ends_when_the_store_swallows_the_cancel(redis_url, loop):
    """At shutdown ``Background.stop`` cancels its loops (the stops channel's listener, the periodic
    reclaim) and waits for them. redis-py sends every command through ``asyncio.wait_for``, which on
    Python 3.11 swallows a cancel that lands as the send finishes (``storage.redis``): a server that
    could not bind its port shut down just as the listener subscribed, and it never exited, not even
    on SIGTERM. Here the listener's subscribe, or the periodic call, swallows the cancel: ``stop``
    must return all the same."""
    from gateway.background import Background
    from gateway.drain import Drain

    async def go():
        store, inside, swallowed = RedisResponses(redis_url), asyncio.Event(), []
        await store.open()

        def swallowing(real):
            async def call(*args, **kwargs):
                inside.set()
                try:
                    await asyncio.sleep(0.5)  # the command on its way when the cancel lands
                except asyncio.CancelledError:
                    if swallowed:  # once is enough: later cancels (the test's cleanup) go through
                        raise
                    swallowed.append(True)  # as wait_for on 3.11 when the send had finished
                return await real(*args, **kwargs)
            return call

        background = Background(Drain(1.0))
        if loop == "stops":
            make = store._r.pubsub

            def pubsub(**kwargs):
                channel = make(**kwargs)
                channel.subscribe = swallowing(channel.subscribe)
                return channel

            store._r.pubsub = pubsub
            background.follow_stops(store.stops())
        else:
            background.every(0.01, swallowing(store._r.ping))
        async with asyncio.timeout(10):
            await inside.wait()
        loops = [t for t in (background._listener, *background._loops) if t is not None]
        stopping = asyncio.create_task(background.stop())
        done, _ = await asyncio.wait({stopping}, timeout=10)
        for task in loops:  # a loop that ignored the cancel gets another, to end the test
            task.cancel()
        await asyncio.gather(stopping, return_exceptions=True)
        await store.close()
        return stopping in done, swallowed

    assert asyncio.run(go()) == (True, [True]), "Background.stop() did not return: a loop ignored its cancel"


def test_while_the_store_is_down_a_stored_response_is_refused_before_its_work_or_answered_unstored(tiny_chat,
                                                                                                    tmp_path):
    """Redis stops: the first response (``store`` by default; the server did not know yet) is
    answered all the same, its work done: a streamed one ends ``response.completed`` or
    ``incomplete`` with no error event, and a whole one carries ``x-tiergate-stored: false``. Once
    the server knows, one is refused with 503 ``store_unavailable`` before any work, while
    ``store: false`` is served."""
    with redis_server(tmp_path) as url:
        s = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, f"batch:\n  store: {url}\n"))
    try:
        c, watch = client(s), s.app.state.store_watch
        types = [e.type for e in c.responses.create(model="tiny-chat", input="hi", max_output_tokens=4, stream=True)]
        assert types[-1] in ("response.completed", "response.incomplete") and "error" not in types, types
        with pytest.raises(openai.APIStatusError) as refused:
            c.responses.create(model="tiny-chat", input="hi", max_output_tokens=4)
        assert refused.value.status_code == 503 and refused.value.code == "store_unavailable"
        served = c.responses.create(model="tiny-chat", input="hi", max_output_tokens=4, store=False)
        assert served.status in ("completed", "incomplete") and served.usage.output_tokens >= 1  # sampled: may be EOS
        s.call(lambda: setattr(watch, "down", False))  # as if the outage began during the next one's work
        raw = c.responses.with_raw_response.create(model="tiny-chat", input="hi", max_output_tokens=4)
        assert raw.status_code == 200 and raw.headers["x-tiergate-stored"] == "false"
        assert raw.parse().status in ("completed", "incomplete") and raw.parse().usage.output_tokens >= 1
        assert s.call(lambda: watch.down)  # and the next is refused before its work
    finally:
        s.stop()


def test_a_background_response_whose_process_died_is_run_again_here(tiny_chat, tmp_path, monkeypatch):
    """A record left running by a dead process (its last write older than reclaim_after_s), with its
    request kept: another process claims it and runs it from the start, so it ends as it would
    have (reading ``queued`` meanwhile, not ``failed``); a streamed one with plain text too (its
    stored events show no output: from the start). A streamed one whose output cannot be
    continued (here: with logprobs), or one already run RECLAIM_TRIES times, is not run again and
    reads failed."""
    import gateway.response_runs as runs

    monkeypatch.setattr(runs, "RECLAIM_S", 0.1)
    s = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, "responses:\n  reclaim_after_s: 1\n"))
    try:
        c, store, owner = client(s), s.app.state.responses, key_id(s.keys["paid"])
        alone = wait_until_done(c, c.responses.create(model="tiny-chat", input="Tell me a story", max_output_tokens=12,
                                                      temperature=0, background=True).id)
        record = s.wait(store.get(alone.id, owner))
        assert record.request["tier"] == "paid" and record.request["body"]["input"] == "Tell me a story"

        def dead(name: str, **request) -> str:
            left = replace(record, id=name, beat=time.time() - 5, runner="a-dead-process",
                           request={**record.request, **request},
                           response={**record.response, "id": name, "status": "in_progress", "output": []})
            s.wait(store.put(left))
            return name

        again = dead("resp_deadrerun")
        assert c.responses.retrieve(again).status in ("queued", "in_progress", "completed", "incomplete")
        done = wait_until_done(c, again)
        assert done.output_text == alone.output_text and done.usage.output_tokens == alone.usage.output_tokens
        assert s.wait(store.get(again, owner)).request["attempts"] == record.request["attempts"] + 1
        streamed = dead("resp_deadstream", body={**record.request["body"], "stream": True})
        assert wait_until_done(c, streamed).output_text == alone.output_text
        with_logprobs = dead("resp_deadlogprobs", body={**record.request["body"], "stream": True, "top_logprobs": 2})
        spent = dead("resp_deadspent", attempts=RECLAIM_TRIES)
        time.sleep(0.5)  # a few passes of the reclaimer
        for name in (with_logprobs, spent):
            r = c.responses.retrieve(name)
            assert r.status == "failed" and r.error.code == "server_error", name
            assert name not in s.app.state.background.running

        # streamed but still queued when its process died: no output was seen, so it runs again,
        # its stored events going on from the last one stored
        waiting = replace(record, id="resp_deadqueued", beat=time.time(), runner="a-dead-process",
                          request={**record.request, "body": {**record.request["body"], "stream": True}},
                          response={**record.response, "id": "resp_deadqueued", "status": "queued", "output": []})
        s.wait(store.put(waiting))  # live while its first events are stored (else the reclaimer may run it first)
        opened = [sse_event(kind, n, response=waiting.response) for n, kind in enumerate(["response.created", "response.queued"])]
        s.wait(store.add_events(waiting.id, waiting.created_at, 0, opened))
        assert s.wait(store.update_running(replace(waiting, beat=time.time() - 5)))  # then its process died
        events = list(c.responses.retrieve(waiting.id, stream=True))
        assert [e.sequence_number for e in events] == list(range(len(events)))  # one stream, numbered on
        assert [e.type for e in events[:3]] == ["response.created", "response.queued", "response.in_progress"]
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.output_text == alone.output_text
        assert c.responses.retrieve(waiting.id).output_text == alone.output_text
    finally:
        s.stop()


@pytest.mark.parametrize("sent", [5, None])  # tokens of the reply sent before the process died (None: all of it)
def test_a_streamed_background_response_whose_process_died_goes_on_from_the_text_it_had_sent(
        tiny_chat, tmp_path, monkeypatch, sent):
    """A streamed background response (plain text) whose process died after its followers had
    seen part of its text: another process claims it (this server's reclaimer) and goes on from
    that text (``check_a_response_goes_on_from_its_text``)."""
    import gateway.response_runs as runs

    monkeypatch.setattr(runs, "RECLAIM_S", 0.1)
    s = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, "responses:\n  reclaim_after_s: 1\n"))
    try:
        check_a_response_goes_on_from_its_text(s, tiny_chat, sent, 1.0)
    finally:
        s.stop()


def test_on_redis_a_streamed_background_response_goes_on_from_its_text(tiny_chat, tmp_path, monkeypatch):
    """The same on the Redis store (where ``tiergate cluster``'s replicas keep responses)."""
    import gateway.response_runs as runs

    monkeypatch.setattr(runs, "RECLAIM_S", 0.1)
    with redis_server(tmp_path) as url:
        s = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)},
                                      f"batch:\n  store: {url}\nresponses:\n  reclaim_after_s: 1\n"))
        try:
            assert isinstance(s.app.state.responses, RedisResponses)
            check_a_response_goes_on_from_its_text(s, tiny_chat, 5, 1.0)
        finally:
            s.stop()


def test_a_streamed_response_whose_stored_events_ended_its_item_reads_failed(tiny_chat, tmp_path, monkeypatch):
    """A dead process's streamed response whose stored events had already ended its message item
    (it died between those events and its record): nothing to go on from, so the process that
    claims it records it failed, and it is not run."""
    import gateway.response_runs as runs

    monkeypatch.setattr(runs, "RECLAIM_S", 0.1)
    s = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, "responses:\n  reclaim_after_s: 1\n"))
    try:
        c, store, owner = client(s), s.app.state.responses, key_id(s.keys["paid"])
        made = wait_until_done(c, c.responses.create(model="tiny-chat", input="hi", max_output_tokens=4,
                                                     background=True).id)
        record = s.wait(store.get(made.id, owner))
        dead = replace(record, id="resp_deadended", beat=time.time() - 5, runner="a-dead-process",
                       request={**record.request, "body": {**record.request["body"], "stream": True}},
                       response={**record.response, "id": "resp_deadended", "status": "in_progress", "output": []})
        s.wait(store.put(dead))
        at = dict(item_id="msg_x", output_index=0, content_index=0)
        events = [sse_event("response.created", 0, response=dead.response),
                  sse_event("response.in_progress", 1, response=dead.response),
                  sse_event("response.output_item.added", 2, output_index=0, item={"id": "msg_x", "type": "message"}),
                  sse_event("response.output_text.delta", 3, delta="Hi", logprobs=[], **at),
                  sse_event("response.output_text.done", 4, text="Hi", logprobs=[], **at)]
        s.wait(store.add_events(dead.id, dead.created_at, 0, events))
        deadline = time.monotonic() + 10
        while (r := c.responses.retrieve(dead.id)).status == "queued" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.status == "failed" and r.error.code == "server_error"
        assert dead.id not in s.app.state.background.running
    finally:
        s.stop()


@pytest.mark.parametrize("dies_at,stream", [("closing events", True), ("final record", True), ("final record", False)])
def test_a_background_response_whose_process_died_as_its_reply_ended_is_finished(
        tiny_chat, tmp_path, monkeypatch, dies_at, stream):
    """A background response whose process dies after its reply ended (and was metered), before
    its record says it ended (and a streamed one's before its items' closing events are stored,
    or after): the process that claims it neither fails it (a streamed one's followers saw the
    whole answer) nor runs it again, but finishes it: a streamed one with the closing events a
    follower has not seen yet, then ``response.incomplete``; with the reply's text and usage,
    metered once."""
    import gateway.response_runs as runs

    monkeypatch.setattr(runs, "RECLAIM_S", 0.1)
    s = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, "responses:\n  reclaim_after_s: 1\n"))
    try:
        c, store, died = client(s, "subscriber"), s.app.state.responses, []
        ask = dict(model="tiny-chat", input="Tell me a story", max_output_tokens=12, temperature=0)
        alone = c.responses.create(**ask)  # (greedy, tiny-chat runs to its length: incomplete)
        add_events, update_running = store.add_events, store.update_running

        async def dying_add(response_id, created_at, n, events):
            if dies_at == "closing events" and not died and "event: response.output_item.done" in "".join(events):
                died.append(response_id)
                raise asyncio.CancelledError  # its process dies here: its task ends, nothing more is written
            return await add_events(response_id, created_at, n, events)

        async def dying_update(record, along=None):
            if dies_at == "final record" and not died and record.response["status"] == "incomplete":
                died.append(record.id)
                raise asyncio.CancelledError
            return await update_running(record, along)

        monkeypatch.setattr(store, "add_events", dying_add)
        monkeypatch.setattr(store, "update_running", dying_update)
        if not stream:
            rid = c.responses.create(**ask, background=True).id
            done = wait_until_done(c, rid)
            assert died == [rid] and done.status == "incomplete" and done.output_text == alone.output_text
            assert (done.usage.input_tokens, done.usage.output_tokens) == (alone.usage.input_tokens, 12)
            usage = httpx.get(f"{s.base_url}/usage", headers={"Authorization": f"Bearer {s.keys['subscriber']}"})
            assert sum(row["requests"] for row in usage.json()["data"]) == 2  # not run again
            return
        first = list(c.responses.create(**ask, background=True, stream=True))  # its follower, ended with it
        rid = first[0].response.id
        assert died == [rid] and first[-1].type != "response.incomplete"
        done = wait_until_done(c, rid)
        events = list(c.responses.retrieve(rid, stream=True))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        kinds = [e.type for e in events]
        assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 1
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.incomplete"]
        assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
        assert done.output_text == _deltas(events) == events[-1].response.output_text == alone.output_text
        assert done.output[0].id == next(e.item.id for e in events if e.type == "response.output_item.added")
        assert (done.usage.input_tokens, done.usage.output_tokens) == (alone.usage.input_tokens, 12)
        usage = httpx.get(f"{s.base_url}/usage", headers={"Authorization": f"Bearer {s.keys['subscriber']}"}).json()
        assert sum(row["requests"] for row in usage["data"]) == 2  # the first request, and the one that ended
    finally:
        s.stop()


def check_a_response_goes_on_from_its_text(s, tiny_chat: Path, sent: int | None, stale_s: float,
                                           reclaim_now: bool = False, model: str = "tiny-chat",
                                           extra: dict | None = None, template_kwargs: dict | None = None) -> None:
    """A dead process's streamed background response, its events stored up to part of its text
    (the first ``sent`` tokens of the reply, all of it for None), is claimed by server ``s`` (by
    its reclaimer, or at once with ``reclaim_now``). A follower sees one stream: numbered on, no
    second ``response.in_progress`` nor item, the same message item, its deltas joining to the
    whole text. What it adds is what the model makes from the prompt and that text's tokens (the
    same raw prompt through ``/v1/completions``, greedy, with what is left of
    ``max_output_tokens``), and the text's tokens count as output, in its usage and in what its key
    is metered (they were metered as input). With the whole reply sent, nothing is left to make: it
    ends at its length with that text. ``model`` takes the request's ``extra`` fields, which render
    its prompt with ``template_kwargs``."""
    import gateway.response_runs as runs
    from workers.chat_prompt import encode

    c, store, owner = client(s), s.app.state.responses, key_id(s.keys["paid"])
    ask = dict(model=model, input="Tell me a story", max_output_tokens=24, temperature=0, **(extra or {}))
    alone = c.responses.create(**ask)
    tok = AutoTokenizer.from_pretrained(next(m.path for m in s.services.config.models if m.name == model))
    ids = tok(alone.output_text, add_special_tokens=False)["input_ids"]
    text = tok.decode(ids[:sent])
    said = tok(text, add_special_tokens=False)["input_ids"]
    left = 24 - len(said)
    assert (left > 0) == (sent is not None)
    added = ""
    if left > 0:
        prompt = encode(tok, [{"role": "user", "content": "Tell me a story"}], None, template_kwargs) + said
        added = c.completions.create(model=model, prompt=prompt, max_tokens=left, temperature=0).choices[0].text
    record = s.wait(store.get(wait_until_done(c, c.responses.create(**ask, background=True).id).id, owner))
    rid = f"resp_deadmid{sent}"
    dead = replace(record, id=rid, beat=time.time(), runner="a-dead-process",
                   request={**record.request, "body": {**record.request["body"], "stream": True}},
                   response={**record.response, "id": rid, "status": "in_progress", "output": []})
    s.wait(store.put(dead))
    item = {"id": "msg_before", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    at = dict(item_id="msg_before", output_index=0, content_index=0)
    before = [sse_event(kind, n, response=dead.response)
              for n, kind in enumerate(["response.created", "response.queued", "response.in_progress"])]
    before += [sse_event("response.output_item.added", 3, output_index=0, item=item),
               sse_event("response.content_part.added", 4, part={"type": "output_text", "text": "", "annotations": []},
                         **at)]
    before += [sse_event("response.output_text.delta", 5 + k, delta=d, logprobs=[], **at)
               for k, d in enumerate([text[:3], text[3:]])]
    s.wait(store.add_events(rid, dead.created_at, 0, before))

    def metered() -> tuple[int, int]:
        rows = httpx.get(f"{s.base_url}/usage", headers={"Authorization": f"Bearer {s.keys['paid']}"}).json()["data"]
        return sum(r["input_tokens"] for r in rows), sum(r["output_tokens"] for r in rows)

    metered_before = metered()
    assert s.wait(store.update_running(replace(dead, beat=time.time() - stale_s - 5)))  # then its process died
    if reclaim_now:
        state = s.app.state
        s.wait(runs.reclaim(s.services, store, state.conversations, state.background))  # (or its own pass took it)
    events = list(c.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    after = [e.type for e in events[len(before):]]
    assert "response.in_progress" not in after and "response.output_item.added" not in after
    assert after[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert (left > 0) == (after[0] == "response.output_text.delta")
    last = events[-1].response
    assert _deltas(events) == last.output_text == text + added and last.output[0].id == "msg_before"
    done = c.responses.retrieve(rid)
    assert done.output_text == text + added and done.status == "incomplete"
    assert (done.usage.input_tokens, done.usage.output_tokens) == (alone.usage.input_tokens, max(24, len(said)))
    if left > 0:  # (none left: no model work, nothing metered)
        now = metered()
        assert (now[0] - metered_before[0], now[1] - metered_before[1]) == (done.usage.input_tokens, 24)


def test_what_stored_events_show_of_the_output():
    from gateway.responses import Sent

    def ev(kind: str, **data) -> str:
        return sse_event(kind, 0, **data)

    message = {"id": "msg_1", "type": "message"}
    opened = [ev("response.created"), ev("response.in_progress"), ev("response.output_item.added", item=message)]
    assert Sent.of([]) == Sent()
    assert Sent.of(opened[:1]) == Sent(1)
    assert Sent.of(opened) == Sent(3, True, "msg_1")
    texts = [ev("response.output_text.delta", delta=d) for d in ("Hel", "lo", " there")]
    assert Sent.of(opened + texts) == Sent(6, True, "msg_1", "Hello there")
    assert Sent.of(opened + texts + [ev("response.output_text.done", text="Hello there")]).closed
    assert Sent.of(opened[:2] + [ev("response.output_item.added", item={"id": "fc_1", "type": "function_call"})]).closed
    assert Sent.of(opened + [ev("response.output_item.added", item={"id": "msg_2", "type": "message"})]).closed
    # a reasoning model's thinking: its item open, then ended and followed by the answer's message
    rs = {"id": "rs_1", "type": "reasoning"}
    thinking = opened[:2] + [ev("response.output_item.added", item=rs), ev("response.content_part.added", item_id="rs_1"),
                             ev("response.reasoning_text.delta", item_id="rs_1", delta="hm"),
                             ev("response.reasoning_text.delta", item_id="rs_1", delta="m")]
    assert Sent.of(thinking) == Sent(6, True, thought_id="rs_1", thought="hmm")
    ended = thinking + [ev("response.reasoning_text.done", item_id="rs_1", text="hmm"),
                        ev("response.content_part.done", item_id="rs_1"), ev("response.output_item.done", item=rs)]
    assert Sent.of(ended) == Sent(9, True, thought_id="rs_1", thought="hmm", thought_done=True)
    answered = Sent.of(ended + [ev("response.output_item.added", item=message)] + texts)
    assert answered == Sent(13, True, "msg_1", "Hello there", thought_id="rs_1", thought="hmm", thought_done=True)
    assert answered.output and Sent.of(thinking).output and not Sent.of(opened).output
    assert Sent.of(ended + [ev("response.output_item.added", item=message)] + texts + [ev("response.output_text.done")]).closed
    assert Sent.of(thinking + [ev("response.output_item.added", item=message)]).closed  # the thinking never ended
    assert Sent.of(ended + [ev("response.output_item.added", item={"id": "rs_2", "type": "reasoning"})]).closed
    assert Sent.of(opened + [ev("response.output_item.added", item=rs)]).closed  # thinking after the answer


def test_no_follower_sees_an_event_before_it_is_stored():
    """A streamed background response's events reach this process's followers only once stored
    (so a run again elsewhere goes on from the last one any follower saw); a write that fails is
    tried again with the next, and its events still reach the followers meanwhile."""
    from gateway.response_runs import StoredEvents
    from gateway.responses import Draft, ResponseEvents, ResponseJob, ResponsesRequest

    class Store:
        def __init__(self) -> None:
            self.rows: list[str] = []
            self.fail = False
            self.seen_by_followers: list[int] = []  # how many were in the log at each write

        async def add_events(self, response_id: str, created_at: int, first: int, events: list[str]) -> None:
            self.seen_by_followers.append(len(stored.log.events))
            if self.fail:
                raise ConnectionError("the store is down")
            assert first == len(self.rows)
            self.rows += events

    store = Store()
    draft = Draft("resp_x", ResponseJob(None, [], ResponsesRequest(model="m", input="x"), []), "default")
    stored = StoredEvents(store, draft, ResponseEvents(draft))

    async def run() -> None:
        await stored.add(["a", "b"])
        assert store.seen_by_followers == [0] and store.rows == stored.log.events == ["a", "b"]
        store.fail = True
        await stored.add(["c"])
        assert stored.log.events == ["a", "b", "c"] and store.rows == ["a", "b"]
        store.fail = False
        await stored.add(["d"])
        assert store.rows == stored.log.events == ["a", "b", "c", "d"] and store.seen_by_followers == [0, 2, 3]

    asyncio.run(run())


def test_kill_9_mid_background_response_and_the_next_process_runs_it(tiny_chat, tmp_path):
    """The crash test: ``tiergate serve`` is killed with ``kill -9`` while a background response
    generates; a second process on the same store takes it over once its record goes unwritten
    (``responses.reclaim_after_s``, 2 s here) and runs it to the end it would have had."""
    from tests.helpers import TIERS
    from tests.test_batches import Proc

    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)},
                          "responses:\n  reclaim_after_s: 2\nlimits:\n  max_chat_tokens: 480\n")
    keys = {t: f"key-{t}" for t in TIERS}
    first = Proc(config, keys, tmp_path / "first.log").ready()
    c = first.client(keys["paid"])
    made = c.responses.create(model="tiny-chat", input="Count to a thousand", max_output_tokens=480,
                              temperature=0, background=True)
    deadline = time.monotonic() + 30
    while (status := c.responses.retrieve(made.id).status) == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert status == "in_progress"  # killed mid-generation
    first.kill9()
    second = Proc(config, keys, tmp_path / "second.log").ready()
    c = second.client(keys["paid"])
    done = wait_until_done(c, made.id)
    live = c.responses.create(model="tiny-chat", input="Count to a thousand", max_output_tokens=480, temperature=0)
    assert done.status == live.status and done.output_text == live.output_text
    assert "run again here" in (tmp_path / "second.log").read_text()


def test_kill_9_mid_streamed_background_response_and_its_follower_gets_one_stream(tiny_chat, tmp_path):
    """The crash test, streamed: ``tiergate serve`` is killed with ``kill -9`` while a streamed
    background response sends its text; its client follows it again from the last event it saw,
    through a second process on the same store, which takes the response over and goes on from
    the text sent. The client gets one stream: numbered on, one message, the text it saw and
    then the rest, ending as the response's record does."""
    from tests.helpers import TIERS
    from tests.test_batches import Proc

    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)},
                          "responses:\n  reclaim_after_s: 2\nlimits:\n  max_chat_tokens: 480\n")
    keys = {t: f"key-{t}" for t in TIERS}
    first = Proc(config, keys, tmp_path / "first.log").ready()
    seen = []
    stream = first.client(keys["paid"]).responses.create(model="tiny-chat", input="hi", max_output_tokens=480,
                                                          temperature=0, background=True, stream=True)  # no early EOS
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            break
    first.kill9()
    rid = seen[0].response.id
    second = Proc(config, keys, tmp_path / "second.log").ready()
    c = second.client(keys["paid"])
    rest = list(c.responses.retrieve(rid, stream=True, starting_after=seen[-1].sequence_number))
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds.count("response.in_progress") == kinds.count("response.output_item.added") == 1
    done = c.responses.retrieve(rid)
    assert events[-1].type == f"response.{done.status}" and done.status in ("completed", "incomplete")
    assert _deltas(events) == done.output_text and done.output_text.startswith(seen[-1].delta)
    assert done.usage.output_tokens <= 480
    assert "run again here" in (tmp_path / "second.log").read_text()


def test_a_cancel_through_another_server_stops_the_work_where_it_runs(tiny_chat, tmp_path, monkeypatch):
    """Two servers on one store (SQLite): a background response waiting at the first is
    cancelled through the second's HTTP API; the second writes the cancel as the record's runner,
    and the first finds it at its next write and stops."""
    import gateway.response_runs as runs

    monkeypatch.setattr(runs, "HEARTBEAT_S", 0.05)
    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)})
    here, there = start_server(config), start_server(config)
    try:
        gate = here.services.gate
        tickets = [here.wait(gate.acquire("paid", "tiny-chat")) for _ in range(gate.limits["paid"])]
        try:
            made = client(here).responses.create(model="tiny-chat", input="hi", max_output_tokens=4, background=True)
            assert client(there).responses.cancel(made.id).status == "cancelled"
            deadline = time.monotonic() + 10
            while here.call(lambda: made.id in here.app.state.background.running) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert here.call(lambda: (made.id in here.app.state.background.running, gate.queued("paid"))) == (False, 0)
        finally:
            for ticket in tickets:
                here.call(gate.release, ticket)
        time.sleep(0.2)
        assert client(here).responses.retrieve(made.id).status == "cancelled"
    finally:
        here.stop()
        there.stop()


def test_a_running_record_whose_process_died_reads_failed_over_http(server):
    """A record left ``in_progress`` by a process killed mid-work (its last write older than
    STALE_S) is shown failed by GET and by a cancel, so a client polling it stops."""
    store, owner = server.app.state.responses, key_id(server.keys["paid"])
    made = respond(client(server), "hi", max_output_tokens=2)
    record = server.wait(store.get(made.id, owner))
    dead = replace(record, id="resp_dead" + made.id[5:], beat=time.time() - STALE_S - 5,
                   response={**record.response, "id": "resp_dead", "status": "in_progress", "background": True})
    server.wait(store.put(dead))
    for r in (httpx.get(f"{server.base_url}/responses/{dead.id}", headers={"Authorization": f"Bearer {server.keys['paid']}"}),
              post(server, f"/responses/{dead.id}/cancel", {})):
        assert r.status_code == 200 and r.json()["status"] == "failed", r.text
        assert r.json()["error"]["code"] == "server_error"


def test_background_work_left_at_shutdown_is_handed_back_and_run_by_the_next_server(tiny_chat, tmp_path, monkeypatch):
    """At shutdown (after the drain's wait, or without one) what still runs is stopped: a response
    that can run again is handed back (stored queued, unwritten), and the next server on the same
    store runs it to its end; a streamed one still queued (its followers saw no output) too, its
    events going on in the next server; and a streamed one that had begun its text (another
    tier's, not held at the gate), from that text. The attempt the shutdown cut is not metered:
    its key is metered once, for the attempt that ended."""
    import sqlite3

    import gateway.response_runs as runs

    monkeypatch.setattr(runs, "RECLAIM_S", 0.1)
    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)})
    s = start_server(config)
    respond(client(s, "subscriber"), "hi", max_output_tokens=2)  # the model loaded
    gate = s.services.gate
    tickets = [s.wait(gate.acquire("paid", "tiny-chat")) for _ in range(gate.limits["paid"])]
    made = client(s).responses.create(model="tiny-chat", input="hi", max_output_tokens=4, background=True, temperature=0)
    streamed = client(s).responses.create(model="tiny-chat", input="hi", max_output_tokens=4, background=True, stream=True)
    streamed_id = next(iter(streamed)).response.id
    streamed.close()  # (leaving it: the work goes on)
    begun: list = []
    model = s.services.arbiter.workers["tiny-chat"].model
    model.register_forward_pre_hook(lambda *_: time.sleep(0.05))  # a token every 50 ms: it runs at the stop
    going = client(s, "subscriber").responses.create(model="tiny-chat", input="hi", max_output_tokens=96,
                                                     temperature=0, background=True, stream=True)
    for event in going:  # (greedy, tiny-chat says no end of text on "hi": all 96 tokens, 50 ms each)
        begun.append(event)
        if event.type == "response.output_text.delta":
            break
    going.close()  # left, as the other: the server's shutdown does not wait for this connection
    assert s.call(lambda: {made.id, streamed_id, begun[0].response.id} <= set(s.app.state.background.running))
    s.stop()
    db = sqlite3.connect(tmp_path / "tiergate-data" / "batches.sqlite3")
    docs = {i: json.loads(doc) for i, doc in db.execute("SELECT id, doc FROM responses WHERE id IN (?, ?, ?)",
                                                        (made.id, streamed_id, begun[0].response.id))}
    db.close()
    for rid in (made.id, streamed_id, begun[0].response.id):
        assert docs[rid]["response"]["status"] == "queued" and docs[rid]["beat"] == 0.0 and tickets

    s = start_server(config)  # the next server: it finds the handed-back ones and runs them
    try:
        done = wait_until_done(client(s), made.id)
        assert done.status in ("completed", "incomplete")
        assert done.output_text == respond(client(s), "hi", max_output_tokens=4).output_text
        events = list(client(s).responses.retrieve(streamed_id, stream=True))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert [e.type for e in events[:3]] == ["response.created", "response.queued", "response.in_progress"]
        assert events[-1].type in ("response.completed", "response.incomplete")
        rest = list(client(s, "subscriber").responses.retrieve(begun[0].response.id, stream=True,
                                                                 starting_after=begun[-1].sequence_number))
        events = begun + rest
        assert [e.sequence_number for e in events] == list(range(len(events)))
        kinds = [e.type for e in events]
        assert kinds.count("response.in_progress") == kinds.count("response.output_item.added") == 1
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert _deltas(events) == events[-1].response.output_text and _deltas(events).startswith(begun[-1].delta)
        usage = httpx.get(f"{s.base_url}/usage", headers={"Authorization": f"Bearer {s.keys['subscriber']}"}).json()
        assert sum(row["requests"] for row in usage["data"]) == 2  # the first request, and the attempt that ended
    finally:
        s.stop()


def test_a_running_record_its_process_stopped_writing_shows_failed():
    from gateway.responses import shown

    def rec(status: str, age: float) -> StoredResponse:
        return StoredResponse("resp_s", "k", 1, {"id": "resp_s", "status": status, "error": None}, [], [],
                              time.time() - age)

    assert shown(rec("in_progress", 1.0), STALE_S)["status"] == "in_progress"
    stale = shown(rec("in_progress", STALE_S + 1), STALE_S)
    assert stale["status"] == "failed" and stale["error"]["code"] == "server_error"
    assert shown(rec("queued", STALE_S + 1), STALE_S)["status"] == "failed"
    assert shown(rec("completed", STALE_S + 1), STALE_S)["status"] == "completed"  # a finished one is what it is


@pytest.mark.parametrize("failure,code", [
    (APIError(503, "the model 'tiny-chat' cannot be used: gone", "model_unavailable"), "model_unavailable"),
    (RuntimeError("a bug"), "server_error"),
])
def test_a_background_response_that_fails_records_its_error(server, monkeypatch, failure, code):
    """What ends a live request with an error ends a background one ``failed``, with the error."""
    import gateway.response_runs as runs

    async def failing(*args):
        raise failure
        yield  # an async generator, as serve_chat's deltas are

    monkeypatch.setattr(runs, "serve_chat", lambda *args: failing())
    c = client(server)
    done = wait_until_done(c, c.responses.create(model="tiny-chat", input="hi", background=True).id)
    assert done.status == "failed" and done.error.code == code and done.error.message and done.output == []
    assert not server.app.state.background.running


# -- streamed background responses ---------------------------------------------------------------------


def _deltas(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_streamed_background_response_is_followed_again_from_any_event(server):
    """background + stream: the stream opens with the response queued; the client that leaves
    does not stop it; ``GET ?stream=true&starting_after=n`` gives the events after n, and from the
    first after it ended (from the store); the SDK's ``responses.stream(response_id=...)`` rebuilds it."""
    c = client(server)
    alone = respond(c, "Tell me a story", max_output_tokens=24)
    with c.responses.create(model="tiny-chat", input="Tell me a story", max_output_tokens=24, temperature=0,
                            background=True, stream=True) as stream:
        first = []
        for event in stream:
            first.append(event)
            if len(first) == 4:
                break  # and the connection closes
    assert [e.type for e in first[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert first[0].response.status == "queued" and first[0].response.background is True
    rid = first[0].response.id
    rest = list(c.responses.retrieve(rid, stream=True, starting_after=first[-1].sequence_number))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == f"response.{alone.status}" and _deltas(events) == alone.output_text
    done = wait_until_done(c, rid)
    assert events[-1].response.output_text == done.output_text == alone.output_text
    assert done.usage.output_tokens == alone.usage.output_tokens
    again = list(c.responses.retrieve(rid, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
    with c.responses.stream(response_id=rid, starting_after=5) as helper:  # (it reads from the first, shows after 5)
        assert [e.sequence_number for e in helper] == list(range(6, len(events)))


def test_followers_of_a_streamed_background_response_while_it_runs(server, monkeypatch):
    """While it waits for a slot and then runs: a second client of this process follows it live
    from the event it names, and a follower reading the store (as another process does, every
    POLL_S) gets every event once, in order, ending with the last."""
    import gateway.response_runs as runs

    monkeypatch.setattr(runs, "POLL_S", 0.01)
    gate, store, c = server.services.gate, server.app.state.responses, client(server)
    owner = key_id(server.keys["paid"])

    async def replay(record) -> list[str]:
        return [event async for event in runs.replay(store, record, -1, STALE_S)]

    tickets = [server.wait(gate.acquire("paid", "tiny-chat")) for _ in range(gate.limits["paid"])]
    try:
        mine = iter(c.responses.create(model="tiny-chat", input="Count to a thousand", max_output_tokens=48,
                                       temperature=0, background=True, stream=True))
        created, queued = next(mine), next(mine)
        rid = created.response.id
        assert c.responses.retrieve(rid).status == "queued"
        assert server.call(lambda: rid in server.app.state.background.logs)
        follower = c.responses.retrieve(rid, stream=True, starting_after=0)
        elsewhere = asyncio.run_coroutine_threadsafe(replay(server.wait(store.get(rid, owner))), server.loop)
        time.sleep(0.1)
        assert not elsewhere.done()  # it waits for more: the response has not begun
    finally:
        for ticket in tickets:
            server.call(gate.release, ticket)
    events = [created, queued] + list(mine)
    followed = list(follower)
    assert [e.sequence_number for e in events] == list(range(len(events))) and events[-1].type == "response.incomplete"
    assert [e.model_dump() for e in followed] == [e.model_dump() for e in events[1:]]
    stored = elsewhere.result(30)
    assert stored == server.wait(store.events(rid, -1)) and len(stored) == len(events)
    assert [json.loads(e.split("data: ", 1)[1])["sequence_number"] for e in stored] == list(range(len(events)))
    assert not server.call(lambda: rid in server.app.state.background.logs)  # gone with its work


def test_a_cancelled_streamed_background_response_ends_its_streams(server):
    """A cancel while it waits: its stream (and one opened after) ends with an ``error`` event,
    ``response_cancelled``; the record is cancelled."""
    gate, c = server.services.gate, client(server)
    tickets = [server.wait(gate.acquire("paid", "tiny-chat")) for _ in range(gate.limits["paid"])]
    try:
        mine = iter(c.responses.create(model="tiny-chat", input="hi", max_output_tokens=8, background=True, stream=True))
        rid = next(mine).response.id
        assert c.responses.cancel(rid).status == "cancelled"
    finally:
        for ticket in tickets:
            server.call(gate.release, ticket)
    events = list(mine)
    assert [e.type for e in events] == ["response.queued", "error"] and events[-1].code == "response_cancelled"
    assert c.responses.retrieve(rid).status == "cancelled"
    assert [e.type for e in c.responses.retrieve(rid, stream=True, starting_after=1)] == ["error"]


def test_a_streamed_background_response_whose_process_died_ends_failed(server):
    """Its stored events, then (its record no longer written: its process died) a
    ``response.failed`` made from the record as GET shows it."""
    store, owner = server.app.state.responses, key_id(server.keys["paid"])
    record = server.wait(store.get(respond(client(server), "hi", max_output_tokens=2).id, owner))
    dead = replace(record, id="resp_dead2", beat=time.time() - STALE_S - 5,
                   response={**record.response, "id": "resp_dead2", "status": "in_progress", "background": True})
    server.wait(store.put(dead))
    made = [f'event: response.created\ndata: {json.dumps({"type": "response.created", "response": dead.response, "sequence_number": 0})}\n\n']
    server.wait(store.add_events(dead.id, dead.created_at, 0, made))
    events = list(client(server).responses.retrieve(dead.id, stream=True))
    assert [(e.type, e.sequence_number) for e in events] == [("response.created", 0), ("response.failed", 1)]
    assert events[1].response.status == "failed" and events[1].response.error.code == "server_error"


def test_a_streamed_background_response_followed_from_its_last_event_gives_nothing_more(server):
    """A client that saw the last event (stored, or made from the record of one whose process died)
    and comes back from its number, or from a number past it, gets an empty stream: no second end,
    numbered after it (one was made up, numbered ``starting_after + 1``)."""
    c, store, owner = client(server), server.app.state.responses, key_id(server.keys["paid"])
    rid = list(c.responses.create(model="tiny-chat", input="hi", max_output_tokens=4, background=True,
                                  stream=True))[0].response.id
    last = list(c.responses.retrieve(rid, stream=True))[-1]
    assert last.type == "response.incomplete" and not server.call(lambda: rid in server.app.state.background.logs)
    for after in (last.sequence_number, last.sequence_number + 5, 1000):
        assert list(c.responses.retrieve(rid, stream=True, starting_after=after)) == [], after
    record = server.wait(store.get(rid, owner))
    dead = replace(record, id="resp_dead3", beat=time.time() - STALE_S - 5, request=None,  # (not run again)
                   response={**record.response, "id": "resp_dead3", "status": "in_progress"})
    server.wait(store.put(dead))
    created = sse_event("response.created", 0, response=dead.response)
    server.wait(store.add_events(dead.id, dead.created_at, 0, [created]))
    ended = list(c.responses.retrieve(dead.id, stream=True, starting_after=0))
    assert [(e.type, e.sequence_number) for e in ended] == [("response.failed", 1)]
    for after in (1, 6):
        assert list(c.responses.retrieve(dead.id, stream=True, starting_after=after)) == [], after


def test_a_streamed_response_shows_its_message_so_far():
    """A record written while the reply streams (a background one's heartbeat) shows the open
    message with its text so far, not the stream's own bookkeeping."""
    from gateway.chat import ChoiceDelta
    from gateway.responses import Draft, ResponseEvents, ResponseJob, ResponsesRequest, delta_events

    draft = Draft("resp_x", ResponseJob(None, [], ResponsesRequest(model="m", input="x"), []), "default")
    s = ResponseEvents(draft)
    delta_events(s, ChoiceDelta(0, "Hel"))
    delta_events(s, ChoiceDelta(0, "lo"))
    (item,) = draft.public("in_progress")["output"]
    assert item["status"] == "in_progress" and item["content"][0]["text"] == "Hello"
    assert not [k for k in item if k.startswith("_")] and json.dumps(item)


@pytest.mark.parametrize("query, param", [
    ("stream=maybe", "stream"),
    ("stream=true&starting_after=-1", "starting_after"),
    ("stream=true&starting_after=x", "starting_after"),
    ("starting_after=3", "starting_after"),
])
def test_bad_stream_query_is_a_400(server, query, param):
    made = respond(client(server), "hi", max_output_tokens=2)
    r = httpx.get(f"{server.base_url}/responses/{made.id}?{query}", headers={"Authorization": f"Bearer {server.keys['paid']}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_only_a_streamed_background_response_streams_again(server):
    c = client(server)
    live = respond(c, "hi", max_output_tokens=2, stream=False)
    polled = wait_until_done(c, c.responses.create(model="tiny-chat", input="hi", max_output_tokens=2, background=True).id)
    for rid in (live.id, polled.id):
        with pytest.raises(openai.BadRequestError) as e:
            list(c.responses.retrieve(rid, stream=True))
        assert e.value.body["code"] == "not_streamable" and e.value.body["param"] == "stream"
    with c.responses.stream(model="tiny-chat", input="hi", max_output_tokens=2, background=True) as s:  # the SDK's helper
        rid = next(iter(s)).response.id
    wait_until_done(c, rid)
    with pytest.raises(openai.NotFoundError):  # another key's
        list(client(server, "free").responses.retrieve(rid, stream=True))
    with pytest.raises(openai.NotFoundError):
        list(c.responses.retrieve("resp_nope", stream=True))


def test_input_tokens_are_counted_as_the_response_counts_them(server):
    """``responses.input_tokens.count`` gives the ``usage.input_tokens`` the same request gets, with
    instructions, tools, a previous response or a conversation in the prompt."""
    c = client(server)
    first = respond(c, "Tell me about Paris", max_output_tokens=4)
    conv = c.conversations.create(items=[{"type": "message", "role": "user", "content": "Hello there"}])
    for kw in ({"input": "Hi"}, {"input": "Hi", "instructions": "Answer in French"},
               {"input": "Weather?", "tools": TOOLS}, {"input": "And Rome?", "previous_response_id": first.id},
               {"input": [{"type": "message", "role": "user", "content": "Go on"}], "conversation": conv.id}):
        counted = c.responses.input_tokens.count(model="tiny-chat", **kw)
        assert counted.object == "response.input_tokens"
        assert counted.input_tokens == respond(c, max_output_tokens=2, **kw).usage.input_tokens, kw
    assert c.responses.input_tokens.count(model="tiny-chat", conversation=conv.id).input_tokens > 0  # no input
    for body, status, param in (({"input": "x"}, 400, "model"), ({"model": "nope", "input": "x"}, 404, "model"),
                                ({"model": "tiny-chat"}, 400, "input"),
                                ({"model": "tiny-chat", "input": "x", "previous_response_id": "resp_nope"}, 404,
                                 "previous_response_id")):
        r = post(server, "/responses/input_tokens", body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)


def test_an_assistant_refusal_part_is_history_not_rendered(server):
    """An assistant item's ``refusal`` content part (OpenAI's refusal, sent back as input) is
    accepted and not rendered, as chat takes it: the prompt is that of its text parts alone; in a
    user message it is a 400 naming the part."""
    c = client(server)

    def turn(parts: list) -> list:
        return [{"role": "user", "content": "hi"}, {"type": "message", "role": "assistant", "content": parts},
                {"role": "user", "content": "why?"}]

    text = {"type": "output_text", "text": "No.", "annotations": []}
    refused = c.responses.input_tokens.count(model="tiny-chat", input=turn([text, {"type": "refusal", "refusal": "I can't."}]))
    assert refused.input_tokens == c.responses.input_tokens.count(model="tiny-chat", input=turn([text])).input_tokens
    assert respond(c, max_output_tokens=1, input=turn([{"type": "refusal", "refusal": "I can't."}])).status == "incomplete"
    r = post(server, "/responses", {"model": "tiny-chat", "input": [
        {"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0].type", r.text
    assert "only for assistant messages" in r.json()["error"]["message"]


def test_truncation_auto_drops_the_oldest_turns_until_it_fits(server):
    """A conversation past the context: a 400 naming input without truncation; with ``auto`` the
    fewest whole turns are dropped from the start (the reply and its input tokens are those of the
    conversation with them left out), and the response says so."""
    c = client(server)
    turns = []
    for i in range(12):
        turns += [{"type": "message", "role": "user", "content": f"Question {i}: " + "tell me more " * 10},
                  {"type": "message", "role": "assistant", "content": f"Answer {i}: " + "it is so " * 10}]
    turns.append({"type": "message", "role": "user", "content": "And finally?"})
    with pytest.raises(openai.BadRequestError) as e:
        respond(c, turns, max_output_tokens=8)
    assert e.value.body["param"] == "input"
    cut = respond(c, turns, max_output_tokens=8, truncation="auto")
    assert cut.truncation == "auto" and cut.status in ("completed", "incomplete")

    def count(start: int) -> int:
        return c.responses.input_tokens.count(model="tiny-chat", input=turns[start:]).input_tokens

    room = 512 - 8  # tiny-chat's context, less the reply
    kept = next(start for start in range(0, len(turns), 2) if count(start) <= room)
    assert kept > 0 and count(kept - 2) > room  # the fewest whole turns went
    assert cut.usage.input_tokens == count(kept)
    assert cut.output_text == respond(c, turns[kept:], max_output_tokens=8).output_text
    assert c.responses.input_tokens.count(model="tiny-chat", input=turns, truncation="auto",  # counted as it would run
                                          extra_body={"max_output_tokens": 8}).input_tokens == count(kept)


def test_service_tier_on_both(server):
    c = client(server)
    flex = c.completions.create(model="tiny-chat", prompt="x", max_tokens=2, extra_body={"service_tier": "flex"})
    r = respond(c, "x", max_output_tokens=2, service_tier="flex")
    assert flex.service_tier == r.service_tier == "flex"  # a paid key may ask to run lower
    free = client(server, "free")
    assert respond(free, "x", max_output_tokens=2, service_tier="priority").service_tier == "default"  # never higher
    raw = post(server, "/responses", {"model": "tiny-chat", "input": "x", "max_output_tokens": 2, "service_tier": "flex"})
    assert raw.headers["x-tiergate-tier"] == "batch"


def test_unknown_model_is_404_on_both(server):
    for path, body in (("/completions", {"prompt": "x"}), ("/responses", {"input": "x"})):
        r = post(server, path, {"model": "no-such-model", **body})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_raw_events_name_their_type(server):
    with httpx.stream("POST", f"{server.base_url}/responses", headers={"Authorization": f"Bearer {server.keys['paid']}"},
                      json={"model": "tiny-chat", "input": "x", "max_output_tokens": 3, "stream": True}) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in raw.read().decode().split("\n\n") if b]
    for block in blocks:
        event, data = block.split("\n")
        assert json.loads(data.removeprefix("data: "))["type"] == event.removeprefix("event: ")
    assert blocks[-1].startswith("event: response.")  # no [DONE]: the Responses API ends with its last event


def test_unknown_previous_response_is_404(server):
    r = post(server, "/responses", {"model": "tiny-chat", "input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_a_response_past_the_30_days_retention_is_gone(server):
    """The shipped retention (responses.retention_days: 30, as OpenAI keeps them): a stored
    response made 31 days ago cannot be read, continued or deleted (its DELETE said deleted: true,
    beside GET's 404: hunt 4 Z1); one made 29 days ago can."""
    import sqlite3

    c = client(server)
    old, recent = respond(c, "Old"), respond(c, "Recent")
    db = sqlite3.connect(server.services.config.source.parent / "tiergate-data" / "batches.sqlite3")
    with db:
        for r, days in ((old, 31), (recent, 29)):
            db.execute("UPDATE responses SET created_at = created_at - ? WHERE id = ?", (days * 86400, r.id))
    db.close()
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(old.id)
    with pytest.raises(openai.NotFoundError):
        respond(c, "x", previous_response_id=old.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(old.id)
    assert c.responses.retrieve(recent.id).id == recent.id
    assert respond(c, "More", previous_response_id=recent.id).previous_response_id == recent.id


# -- the store, on both backends ----------------------------------------------------------------------


async def _store_contract(store) -> None:
    await store.open()
    try:
        record = StoredResponse("resp_1", "key-a", 5, {"id": "resp_1", "object": "response"},
                                [{"role": "user", "content": "hi"}], [{"id": "msg_1", "type": "message"}])
        await store.put(record)
        assert await store.get("resp_1", "key-a") == record
        old = StoredResponse("resp_0", "key-a", 4, {}, [])  # a record from before input items were kept
        await store.put(old)
        assert await store.get("resp_0", "key-a") == old and old.input_items is None
        assert await store.get("resp_1", "key-b") is None
        assert not await store.delete("resp_1", "key-b")
        assert await store.get("resp_1", "key-a") == record
        assert await store.delete("resp_1", "key-a")
        assert await store.get("resp_1", "key-a") is None and not await store.delete("resp_1", "key-a")

        # a background response's record changes only while it runs
        def bg(status: str, beat: float) -> StoredResponse:
            return StoredResponse("resp_b", "key-a", 6, {"id": "resp_b", "status": status, "background": True},
                                  [], [], beat)

        await store.put(bg("queued", 1.0))
        assert await store.update_running(bg("in_progress", 2.0))
        assert (await store.get("resp_b", "key-a")).beat == 2.0
        assert not await store.update_running(replace(bg("cancelled", 3.0), owner="key-b"))  # not its owner's
        assert await store.update_running(bg("cancelled", 4.0))  # (another process's cancel)
        assert not await store.update_running(bg("completed", 5.0))  # the runner cannot undo it
        assert (await store.get("resp_b", "key-a")).response["status"] == "cancelled"
        assert not await store.update_running(bg("in_progress", 6.0)) and (await store.get("resp_b", "key-a")).beat == 4.0
        assert await store.delete("resp_b", "key-a") and not await store.update_running(bg("queued", 7.0))
        assert await store.get("resp_b", "key-a") is None  # not written back after a delete

        # running records, and a claim: one process takes over a record left by a dead one, and
        # the dead one's runner can no longer write it
        run = StoredResponse("resp_r", "key-a", 9, {"id": "resp_r", "status": "in_progress", "background": True}, [], [],
                             1.0, {"body": {"model": "m", "input": "x"}, "tier": "paid"}, "runner-1")
        await store.put(run)
        docs = dict(await store.running())
        assert "resp_r" in docs and "resp_0" not in docs and StoredResponse.of("resp_r", docs["resp_r"]) == run
        taken = replace(run, runner="runner-2", beat=2.0, response={**run.response, "status": "queued"})
        assert await store.claim("resp_r", docs["resp_r"], taken)
        assert not await store.claim("resp_r", docs["resp_r"], replace(run, runner="runner-3"))  # taken already
        assert not await store.update_running(replace(run, beat=3.0))  # the first runner lost it
        assert (await store.get("resp_r", "key-a")) == taken
        assert await store.update_running(replace(taken, beat=4.0, response={**taken.response, "status": "completed"}))
        assert "resp_r" not in dict(await store.running())

        # a streamed background response's events: appended in order, read above a number,
        # never twice, gone with their record and not added after it
        await store.put(bg("queued", 8.0))
        assert await store.events("resp_b", -1) == []
        await store.add_events("resp_b", 6, 0, ["e0", "e1"])
        await store.add_events("resp_b", 6, 1, ["e1", "e2"])  # (a write that had landed, tried again)
        await store.add_events("resp_b", 6, 3, ["e3"])
        assert await store.events("resp_b", -1) == ["e0", "e1", "e2", "e3"]
        assert await store.events("resp_b", 1) == ["e2", "e3"] and await store.events("resp_b", 3) == []
        assert await store.events("resp_other", -1) == []
        assert not await store.delete("resp_b", "key-b") and len(await store.events("resp_b", -1)) == 4
        assert await store.delete("resp_b", "key-a") and await store.events("resp_b", -1) == []
        await store.add_events("resp_b", 6, 4, ["e4"])
        assert await store.events("resp_b", -1) == []
    finally:
        await store.close()


def test_input_items_of_a_record_from_before_they_were_kept():
    """Rebuilt from its chat messages, its own reply (the last) left out: messages, each tool call
    an item after its message, tool outputs; ids fixed by the response and place."""
    from gateway.responses import input_items

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    rec = StoredResponse("resp_ab", "k", 1, {}, [
        {"role": "system", "content": "Rules"}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "assistant", "content": "Nice"}])
    items = input_items(rec)
    assert [(i["type"], i.get("role")) for i in items] == [("message", "system"), ("message", "user"),
                                                          ("function_call", None), ("function_call_output", None)]
    assert items[1]["content"] == [{"type": "input_text", "text": "Hi"}]
    assert (items[2]["call_id"], items[2]["name"], items[3]["output"]) == ("call_1", "get_weather", "sunny")
    assert [i["id"] for i in items] == [i["id"] for i in input_items(rec)] and len({i["id"] for i in items}) == 4
    assert all(i["id"].split("_")[1].startswith("ab") for i in items)


def test_sqlite_store(tmp_path):
    asyncio.run(_store_contract(SQLiteResponses(tmp_path / "batches.sqlite3")))
    async def reopened() -> None:  # durable: a record outlives the store that wrote it
        a = SQLiteResponses(tmp_path / "b.sqlite3")
        await a.open()
        await a.put(StoredResponse("resp_2", "k", 1, {}, []))
        await a.close()
        b = SQLiteResponses(tmp_path / "b.sqlite3")
        await b.open()
        assert (await b.get("resp_2", "k")).created_at == 1
        await b.close()
    asyncio.run(reopened())


def test_redis_store(tmp_path):
    with redis_server(tmp_path) as url:
        asyncio.run(_store_contract(RedisResponses(url)))


def test_on_redis_a_queued_record_is_written_with_its_place_in_the_running_set_or_not_at_all(tmp_path, monkeypatch):
    """A queued (background) record and its place in ``responses-running``, which the reclaim reads,
    are one transaction: a process that died after writing the record and before adding it there (its
    connection gone, here) left a record that no reclaim ever found, ``queued`` until its retention
    (hunt CC, finding 4). Either both are written or neither."""
    from redis.asyncio.connection import AbstractConnection
    from redis.exceptions import ConnectionError as RedisConnectionError

    sent = AbstractConnection.send_packed_command

    async def dying_at_sadd(self, command, check_health=True):
        packed = b"".join(command) if isinstance(command, (list, tuple)) else command
        if b"SADD" in packed:
            raise RedisConnectionError("the process died here")
        return await sent(self, command, check_health)

    async def main(url: str) -> None:
        store = RedisResponses(url)
        await store.open()
        try:
            queued = record("resp_queued", 0)
            queued.response["status"] = "queued"
            monkeypatch.setattr(AbstractConnection, "send_packed_command", dying_at_sadd)
            with pytest.raises(RedisConnectionError):
                await store.put(queued)
            monkeypatch.setattr(AbstractConnection, "send_packed_command", sent)
            written = await store._r.exists(store._key("resp_queued"))
            assert (written, await store._r.sismember(store._running_key(), "resp_queued")) == (0, 0)
            await store.put(queued)  # (a live process: both)
            assert [i for i, _ in await store.running()] == ["resp_queued"]
        finally:
            await store.close()

    with redis_server(tmp_path) as url:
        asyncio.run(main(url))


DAY = 86400


def record(response_id: str, age_s: float, owner: str = "k") -> StoredResponse:
    made = int(time.time() - age_s)
    return StoredResponse(response_id, owner, made, {"id": response_id, "created_at": made}, [])


def test_sqlite_retention_hides_and_sweeps_old_records(tmp_path):
    """With a retention, a record past it is not returned, the store's sweep deletes it (at open
    and every sweep_s), and a newer one stays."""
    import sqlite3

    path = tmp_path / "batches.sqlite3"

    def rows() -> set[str]:
        with contextlib.closing(sqlite3.connect(path)) as db:
            return {r[0] for r in db.execute("SELECT id FROM responses UNION SELECT response_id FROM response_events")}

    async def main() -> None:
        store = SQLiteResponses(path, retention_s=DAY, sweep_s=0.05)
        await store.open()
        try:
            for r in (record("resp_old", 2 * DAY), record("resp_new", 0)):
                await store.put(r)
                await store.add_events(r.id, r.created_at, 0, ["e0"])  # (a streamed one's events go with it)
            assert await store.get("resp_old", "k") is None  # hidden at once, before any sweep
            assert (await store.get("resp_new", "k")).id == "resp_new"
            for _ in range(100):  # the sweep every 0.05 s deletes it
                if rows() == {"resp_new"}:
                    break
                await asyncio.sleep(0.02)
            assert rows() == {"resp_new"}
        finally:
            await store.close()

    asyncio.run(main())


def test_sqlite_table_from_before_retention_is_migrated_and_swept_at_open(tmp_path):
    """A responses table written before there was a retention (no created_at column) gets the
    column from each record, and its records past the retention go when the store opens."""
    import sqlite3

    path = tmp_path / "batches.sqlite3"
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, doc TEXT NOT NULL)")
        for r in (record("resp_old", 40 * DAY), record("resp_new", DAY)):
            db.execute("INSERT INTO responses VALUES (?, ?, ?)", (r.id, r.owner, r.doc()))

    async def main() -> None:
        store = SQLiteResponses(path, retention_s=30 * DAY)
        await store.open()
        try:
            assert await store.get("resp_old", "k") is None
            assert (await store.get("resp_new", "k")).id == "resp_new"
        finally:
            await store.close()

    asyncio.run(main())
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("SELECT id, created_at > 0 FROM responses").fetchall() == [("resp_new", 1)]


def test_redis_retention_is_each_keys_expiry(tmp_path):
    """On Redis a record expires at the end of its retention (set when it is written; one already
    past it is gone at once), and records written before there was a retention get their expiry
    when a store with one opens."""
    import redis

    async def main(url: str) -> None:
        forever = RedisResponses(url)  # as before: no retention
        await forever.open()
        await forever.put(record("resp_before_old", 40 * DAY))
        await forever.put(record("resp_before_new", DAY))
        await forever._r.set("tg:response:not-ours", "not json")  # skipped by the scan, not a stop
        await forever.close()
        store = RedisResponses(url, retention_s=30 * DAY)
        await store.open()
        try:
            await store._expirer  # the scan it starts when it opens
            for r in (record("resp_old", 31 * DAY), record("resp_new", 0)):
                await store.put(r)
                await store.add_events(r.id, r.created_at, 0, ["e0"])
            assert await store.get("resp_new", "k") is not None and await store.get("resp_old", "k") is None
            # a record past the retention that has no expiry yet (the scan gives it one) is hidden, and
            # so is not deleted either (its DELETE answered deleted: true beside GET's 404: hunt 4 Z1)
            await store._r.set(store._key("resp_unexpiring"), record("resp_unexpiring", 40 * DAY).doc())
            assert await store.get("resp_unexpiring", "k") is None
            assert await store.delete("resp_unexpiring", "k") is False
            await store._r.delete(store._key("resp_unexpiring"))
            await store.put(record("resp_recent", 0))
            assert await store.delete("resp_recent", "k") is True
        finally:
            await store.close()

    with redis_server(tmp_path) as url:
        asyncio.run(main(url))
        r = redis.Redis.from_url(url)
        ttl = {k.decode().rsplit(":", 1)[1]: r.ttl(k) for k in r.keys("tg:response:*")}
        events_ttl = {k.decode().rsplit(":", 1)[1]: r.ttl(k) for k in r.keys("tg:response-events:*")}
        r.close()
    assert set(events_ttl) == {"resp_new"}  # the old one's were never written: its record had expired
    assert 30 * DAY - 60 < events_ttl["resp_new"] <= 30 * DAY + 1
    assert set(ttl) == {"resp_before_new", "resp_new", "not-ours"}  # both old ones are gone from Redis itself
    assert ttl["not-ours"] == -1
    assert 29 * DAY - 60 < ttl["resp_before_new"] <= 29 * DAY + 1
    assert 30 * DAY - 60 < ttl["resp_new"] <= 30 * DAY + 1
