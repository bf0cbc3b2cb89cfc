"""What clients call on /v1/chat/completions beyond plain text (issue 12): structured outputs,
tools, logprobs, n, penalties and logit_bias, service_tier, and their 400s, through the openai
SDK, LangChain and instructor against a real server on tiny-chat (random weights), on BOTH chat
engines. The vLLM server is shared with test_vllm_gateway (conftest.py)."""

from __future__ import annotations

import json
import math
import re
import threading
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers import start_server, write_config

ENGINES = ["transformers", pytest.param("vllm", marks=pytest.mark.skipif(
    not __import__("importlib").util.find_spec("vllm"), reason="vllm is not installed"))]


@pytest.fixture(scope="module", params=ENGINES)
def server(request, tiny_chat, tmp_path_factory):
    if request.param == "vllm":  # shared with test_vllm_gateway (conftest.py)
        yield request.getfixturevalue("vllm_chat_server")
        return
    folder = tmp_path_factory.mktemp(f"chat-api-{request.param}")
    cfg = write_config(folder, {"tiny-chat": ("chat", tiny_chat)}, "limits:\n  max_chat_tokens: 256\n")
    running = start_server(cfg)
    yield running
    running.stop()


def client(server, tier="paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, timeout=120)


def tokenizer(server):
    """The model's tokenizer from its folder: the test must not depend on the model being resident."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(server.services.arbiter.specs["tiny-chat"].path))


class Answer(BaseModel):
    """A closed schema: an enum, a boolean and a bounded integer."""

    color: Literal["red", "green", "blue"]
    ok: bool
    level: int = Field(ge=0, le=9)


class GetWeather(BaseModel):
    """Weather in a city."""

    city: Literal["paris", "oslo", "lima"]
    celsius: bool


class SetAlarm(BaseModel):
    hour: int = Field(ge=0, le=23)


def fn(model: type[BaseModel]) -> dict:
    return {"type": "function", "function": {"name": model.__name__, "description": model.__doc__ or "",
                                             "parameters": model.model_json_schema()}}


TOOLS = [fn(GetWeather), fn(SetAlarm)]
ASK = [{"role": "user", "content": "What is the weather?"}]


# -- structured outputs ------------------------------------------------------------------------------


def test_sdk_parse_with_a_pydantic_model(server):
    r = client(server).chat.completions.parse(model="tiny-chat", messages=ASK, response_format=Answer,
                                              max_tokens=64, seed=1)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Answer)
    text = r.choices[0].message.content
    assert text == json.dumps(json.loads(text), separators=(",", ":"))  # compact JSON: no free whitespace


@pytest.mark.parametrize("seed", range(4))
def test_closed_schema_ends_within_64_tokens(server, seed):
    schema = {"type": "object", "properties": {"mood": {"enum": ["calm", "angry"]}, "n": {"type": "integer", "minimum": 1, "maximum": 5},
                                               "yes": {"type": "boolean"}}, "required": ["mood", "n", "yes"]}
    r = client(server).chat.completions.create(
        model="tiny-chat", messages=ASK, max_tokens=64, seed=seed, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "m", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 64
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"mood", "n", "yes"} and value["mood"] in ("calm", "angry") and 1 <= value["n"] <= 5


def test_json_object_mode_starts_an_object(server):
    r = client(server).chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=32, seed=2,
                                               response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_vllms_structured_outputs_constrain_the_reply(server):
    """vLLM's ``structured_outputs`` (``extra_body``), on both engines: each constraint at
    temperature 1 over seeds (random weights: only the grammar keeps the text in shape), whole and
    streamed, on chat, completions and responses."""
    c = client(server)

    def reply(so: dict, seed: int, **kw) -> tuple[str, str]:
        r = c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=48, temperature=1, seed=seed,
                                      extra_body={"structured_outputs": so}, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    choices = ["yes", "no", "maybe so", 'a "quoted"\nline']
    picked = {reply({"choice": choices}, seed) for seed in range(6)}
    assert {finish for _, finish in picked} == {"stop"} and {text for text, _ in picked} <= set(choices)
    assert len({text for text, _ in picked}) > 1  # the model's draw, not a fixed answer
    for seed in range(3):
        text, finish = reply({"regex": r"[0-9]{3}-[a-z]{2}"}, seed)
        assert finish == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text
        text, _ = reply({"grammar": 'root ::= "id-" [0-9] [0-9] ("!" | "?")'}, seed)
        assert re.fullmatch(r"id-[0-9]{2}[!?]", text), text
        text, _ = reply({"grammar": 'start: "on" | "off"  // Lark, as vLLM tells it apart'}, seed)
        assert text in ("on", "off")
        text, finish = reply({"json": Answer.model_json_schema()}, seed)
        assert finish == "stop"
        Answer.model_validate_json(text)
        text, _ = reply({"json": json.dumps(Answer.model_json_schema()), "disable_any_whitespace": True}, seed)
        Answer.model_validate_json(text)
    assert reply({"json_object": True}, 1)[0].startswith("{")
    stream = c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=48, temperature=1, seed=3,
                                       stream=True, extra_body={"structured_outputs": {"choice": choices}})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == reply({"choice": choices}, 3)[0]
    legacy = c.completions.create(model="tiny-chat", prompt="Code:", max_tokens=16, temperature=1, seed=2, n=2,
                                  extra_body={"structured_outputs": {"regex": "[A-Z][0-9]{4}"}})
    assert all(re.fullmatch("[A-Z][0-9]{4}", ch.text) for ch in legacy.choices), legacy
    legacy = c.completions.create(model="tiny-chat", prompt="Code:", max_tokens=64, temperature=1, seed=2,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "Answer", "schema": Answer.model_json_schema()}}})
    Answer.model_validate_json(legacy.choices[0].text)
    r = c.responses.create(model="tiny-chat", input="Well?", max_output_tokens=16, temperature=1,
                           extra_body={"structured_outputs": {"choice": choices}})
    assert r.output_text in choices
    with pytest.raises(openai.BadRequestError) as bad:
        c.responses.create(model="tiny-chat", input="Well?", text={"format": {"type": "json_object"}},
                           extra_body={"structured_outputs": {"choice": choices}})
    assert bad.value.body["param"] == "structured_outputs"


def test_auto_tools_beside_structured_outputs_answer_with_its_text_or_calls(server):
    """Tools in auto mode with a ``structured_outputs`` choice: the reply is one of the choices or
    valid calls, as with a response format's JSON."""
    models = {"GetWeather": GetWeather, "SetAlarm": SetAlarm}
    seen = set()
    for seed in range(16):
        r = client(server).chat.completions.create(
            model="tiny-chat", messages=ASK, tools=TOOLS, parallel_tool_calls=False, max_tokens=128, seed=seed,
            extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}})
        c = r.choices[0]
        if c.message.tool_calls:
            (call,) = c.message.tool_calls
            models[call.function.name].model_validate_json(call.function.arguments)
            seen.add("calls")
        else:
            assert (c.message.content, c.finish_reason) in (("sunny", "stop"), ("rainy", "stop")), c
            seen.add("choice")
        if seen == {"calls", "choice"}:
            break
    assert seen == {"calls", "choice"}


# -- tools --------------------------------------------------------------------------------------------


def stream_calls(stream) -> tuple[list[dict], list[str], list]:
    """Tool calls assembled from a stream's deltas, the finish reasons and the raw tool-call deltas."""
    calls: dict[int, dict] = {}
    finishes, deltas = [], []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
            for d in choice.delta.tool_calls or []:
                deltas.append(d)
                if d.id is not None:
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    calls[d.index]["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)], finishes, deltas


def test_named_tool_choice_whole_and_streamed(server):
    choice = {"type": "function", "function": {"name": "GetWeather"}}
    r = client(server).chat.completions.create(model="tiny-chat", messages=ASK, tools=TOOLS, tool_choice=choice,
                                               max_tokens=128, seed=3)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "GetWeather"
    GetWeather.model_validate_json(call.function.arguments)

    stream = client(server).chat.completions.create(model="tiny-chat", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                    max_tokens=128, seed=3, stream=True)
    calls, finishes, deltas = stream_calls(stream)
    assert finishes == ["tool_calls"]
    assert len(calls) == 1 and calls[0]["name"] == "GetWeather"
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)  # same seed, same call
    assert deltas[0].id and deltas[0].function.name and all(d.id is None for d in deltas[1:])


def test_required_tool_choice_whole_and_streamed(server):
    models = {"GetWeather": GetWeather, "SetAlarm": SetAlarm}
    for seed in range(3):
        r = client(server).chat.completions.create(model="tiny-chat", messages=ASK, tools=TOOLS, tool_choice="required",
                                                   parallel_tool_calls=False, max_tokens=128, seed=seed)
        (call,) = r.choices[0].message.tool_calls
        models[call.function.name].model_validate_json(call.function.arguments)
        assert r.choices[0].finish_reason == "tool_calls"
    stream = client(server).chat.completions.create(model="tiny-chat", messages=ASK, tools=TOOLS, tool_choice="required",
                                                    parallel_tool_calls=False, max_tokens=128, seed=0, stream=True)
    calls, finishes, _ = stream_calls(stream)
    assert finishes == ["tool_calls"] and len(calls) == 1
    models[calls[0]["name"]].model_validate_json(calls[0]["arguments"])


def test_stop_strings_do_not_cut_a_forced_call(server):
    """A forced reply is its calls alone: a stop string or stop token that the call writes (here
    its argument's key, ``city``, and every token with a quote) does not cut it, so the call's
    arguments are JSON that validates, whole and streamed, and ``finish_reason`` is ``tool_calls``
    (cut, the reply was no call, or one whose arguments were ``{"``, a call all the same)."""
    tok = tokenizer(server)
    quotes = [i for i in range(len(tok)) if '"' in tok.decode([i])]
    choice = {"type": "function", "function": {"name": "GetWeather"}}
    kw = dict(model="tiny-chat", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=128, seed=3,
              stop=["city", "zzz"], extra_body={"stop_token_ids": quotes})
    r = client(server).chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    GetWeather.model_validate_json(call.function.arguments)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].model_extra["stop_reason"] is None
    calls, finishes, _ = stream_calls(client(server).chat.completions.create(**kw, stream=True))
    assert finishes == ["tool_calls"] and len(calls) == 1
    GetWeather.model_validate_json(calls[0]["arguments"])


def test_auto_tools_beside_a_response_format_answer_with_the_json_or_calls(server):
    """An agent's usual request: tools it may call and the shape of its final answer. Each reply
    is either the format's JSON (``stop``) or valid calls (``tool_calls``), never text outside
    both; across seeds the random model takes both ways, whole and streamed alike. One call at
    most (``parallel_tool_calls: false``), so that a reply fits in max_tokens: at temperature 1
    the random model may write call after call (each ~50 of its tokens) until cut."""
    models = {"GetWeather": GetWeather, "SetAlarm": SetAlarm}
    fmt = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": Answer.model_json_schema()}}
    seen, calling_seed = set(), None
    for seed in range(16):
        r = client(server).chat.completions.create(model="tiny-chat", messages=ASK, tools=TOOLS, response_format=fmt,
                                                   parallel_tool_calls=False, max_tokens=128, seed=seed)
        c = r.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and not c.message.content and len(c.message.tool_calls) == 1, c
            for call in c.message.tool_calls:
                models[call.function.name].model_validate_json(call.function.arguments)
            seen.add("calls")
            calling_seed = seed
        else:
            assert c.finish_reason == "stop", c
            Answer.model_validate_json(c.message.content)
            seen.add("json")
        if seen == {"calls", "json"}:
            break
    assert seen == {"calls", "json"}
    whole = client(server).chat.completions.create(model="tiny-chat", messages=ASK, tools=TOOLS, response_format=fmt,
                                                   parallel_tool_calls=False, max_tokens=128, seed=calling_seed)
    stream = client(server).chat.completions.create(model="tiny-chat", messages=ASK, tools=TOOLS, response_format=fmt,
                                                    parallel_tool_calls=False, max_tokens=128, seed=calling_seed, stream=True)
    calls, finishes, _ = stream_calls(stream)
    assert finishes == ["tool_calls"]
    assert [(k["name"], json.loads(k["arguments"])) for k in calls] == [
        (k.function.name, json.loads(k.function.arguments)) for k in whole.choices[0].message.tool_calls]


def test_forced_tools_beside_a_response_format_are_calls(server):
    """``tool_choice: "required"`` with a response format (the Agents SDK sends both on an
    agent's first turn): the reply is calls, as OpenAI serves it; the format shapes a later
    turn's text."""
    fmt = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": Answer.model_json_schema()}}
    r = client(server).chat.completions.create(model="tiny-chat", messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, response_format=fmt, max_tokens=128, seed=2)
    (call,) = r.choices[0].message.tool_calls
    {"GetWeather": GetWeather, "SetAlarm": SetAlarm}[call.function.name].model_validate_json(call.function.arguments)


def test_allowed_tools_render_and_allow_only_the_tools_they_list(server):
    """``tool_choice: {"type": "allowed_tools", ...}``: the prompt holds the listed tools alone
    (the server's prompt tokens are the template's with that one tool), and ``required`` calls
    only them."""
    from workers.chat_prompt import encode

    def allowed(mode: str, name: str) -> dict:
        return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [{"type": "function", "function": {"name": name}}]}}

    only_alarm = len(encode(tokenizer(server), ASK, [TOOLS[1]]))
    assert only_alarm != len(encode(tokenizer(server), ASK, TOOLS))
    for seed in range(3):
        r = client(server).chat.completions.create(model="tiny-chat", messages=ASK, tools=TOOLS, max_tokens=128, seed=seed,
                                                   tool_choice=allowed("required", "SetAlarm"), parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls" and r.usage.prompt_tokens == only_alarm
        for call in r.choices[0].message.tool_calls:
            assert call.function.name == "SetAlarm"
            SetAlarm.model_validate_json(call.function.arguments)
    r = client(server).chat.completions.create(model="tiny-chat", messages=ASK, tools=TOOLS, max_tokens=4, seed=0,
                                               tool_choice=allowed("auto", "SetAlarm"))
    assert r.usage.prompt_tokens == only_alarm


def test_deprecated_functions_whole_streamed_and_in_a_round_trip(server):
    """The old functions API (``functions``, ``function_call``; LangChain's and the SDK's 2023
    code): a named ``function_call`` is answered as ``message.function_call`` with
    ``finish_reason: "function_call"`` (no ``tool_calls``), streamed as ``delta.function_call``
    (the name first, then argument fragments), and an assistant ``function_call`` with its
    ``role: "function"`` result renders as the same call and result in tools' terms."""
    from workers.chat_prompt import encode

    functions = [t["function"] for t in TOOLS]
    kw = dict(model="tiny-chat", messages=ASK, functions=functions, function_call={"name": "GetWeather"},
              max_tokens=128, seed=3)
    r = client(server).chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "function_call" and c.message.tool_calls is None and c.message.content is None
    assert c.message.function_call.name == "GetWeather"
    GetWeather.model_validate_json(c.message.function_call.arguments)
    assert r.usage.prompt_tokens == len(encode(tokenizer(server), ASK, TOOLS))

    chunks = list(client(server).chat.completions.create(**kw, stream=True))
    calls = [ch.choices[0].delta.function_call for ch in chunks if ch.choices and ch.choices[0].delta.function_call]
    assert calls[0].name == "GetWeather" and all(f.name is None for f in calls[1:])
    assert "".join(f.arguments or "" for f in calls) == c.message.function_call.arguments  # same seed, same call
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["function_call"]
    assert all(ch.choices[0].delta.tool_calls is None for ch in chunks if ch.choices)

    args = '{"city": "oslo", "celsius": true}'
    legacy = ASK + [{"role": "assistant", "content": None, "function_call": {"name": "GetWeather", "arguments": args}},
                    {"role": "function", "name": "GetWeather", "content": "sunny, 21 C"}]
    r = client(server).chat.completions.create(model="tiny-chat", messages=legacy, functions=functions, max_tokens=4)
    spelt = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "GetWeather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    text = tokenizer(server).decode(encode(tokenizer(server), spelt, TOOLS))
    assert "<tool_response>sunny, 21 C</tool_response>" in text
    assert r.usage.prompt_tokens == len(encode(tokenizer(server), spelt, TOOLS))


def test_a_function_message_answers_the_call_before_it_by_id():
    """What the template gets for the old functions API: each assistant ``function_call`` is a
    tool call with an id, and the ``role: "function"`` message after it is a tool message that
    names that id (templates such as Mistral's match them) and the function."""
    from gateway.schemas import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "function_call": {"name": "a", "arguments": "{}"}},
        {"role": "function", "name": "a", "content": "1"},
        {"role": "assistant", "content": "", "function_call": {"name": "b", "arguments": "{\"x\": 1}"}},
        {"role": "function", "name": "b", "content": "2"}]})
    m = body.messages_as_dicts()
    assert [d["role"] for d in m] == ["user", "assistant", "tool", "assistant", "tool"]
    assert m[1]["tool_calls"] == [{"id": m[2]["tool_call_id"], "type": "function", "function": {"name": "a", "arguments": "{}"}}]
    assert m[3]["tool_calls"][0]["id"] == m[4]["tool_call_id"] != m[2]["tool_call_id"]
    assert (m[2]["name"], m[4]["name"], m[4]["content"]) == ("a", "b", "2")


def test_tool_round_trip_renders_calls_and_results(server):
    from workers.chat_prompt import encode

    call = {"id": "call_abc", "type": "function", "function": {"name": "GetWeather", "arguments": '{"city": "oslo", "celsius": true}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21 C"}]
    r = client(server).chat.completions.create(model="tiny-chat", messages=messages, tools=TOOLS, max_tokens=8, seed=1)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = encode(tokenizer(server), messages, TOOLS)
    text = tokenizer(server).decode(rendered)
    assert '<tool_call>{"name": "GetWeather", "arguments": {"city": "oslo", "celsius": true}}</tool_call>' in text
    assert "<tool_response>sunny, 21 C</tool_response>" in text and '"name": "SetAlarm"' in text
    assert r.usage.prompt_tokens == len(rendered)  # the server rendered exactly this


# -- sampling fields ------------------------------------------------------------------------------------


def test_logprobs_whole_and_streamed(server):
    kw = dict(model="tiny-chat", messages=ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
              logit_bias={str(tokenizer(server).eos_token_id): -100})
    r = client(server).chat.completions.create(**kw)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 8
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token or e.token == ""  # its own bytes: see below
    chunks = list(client(server).chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-4)


def test_non_finite_logprobs_are_sent_as_json_numbers(server, monkeypatch):
    """An engine's logprob that is not finite (an impossible token's -inf; NaN or inf from a model
    whose outputs overflowed) is sent as a JSON number, as vLLM's server sends -inf: -inf and NaN
    as -9999.0, +inf as 0.0, on chat, legacy completions and responses, whole and streamed. Before,
    a whole reply was a 500 (``Out of range float values are not JSON compliant``), and a streamed
    chunk carried ``NaN``/``Infinity``, which is not JSON."""
    import itertools

    from workers.grammar import Vocabulary

    real, odd = Vocabulary.entry, itertools.cycle([float("-inf"), float("nan"), float("inf")])
    monkeypatch.setattr(Vocabulary, "entry", lambda self, token, _, *a, **kw: real(self, token, next(odd), *a, **kw))

    def refuse(constant: str):
        raise AssertionError(f"{constant} in the JSON")

    calls = [("/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 2}),
             ("/completions", {"prompt": "Hello", "logprobs": 2}),
             ("/responses", {"input": "Hello", "top_logprobs": 2})]
    for path, body in calls:
        for stream in (False, True):
            r = httpx.post(f"{server.base_url}{path}", headers={"Authorization": f"Bearer {server.keys['paid']}"},
                           json={"model": "tiny-chat", "max_tokens" if path != "/responses" else "max_output_tokens": 4,
                                 "temperature": 0, "stream": stream, **body}, timeout=120)
            assert r.status_code == 200, (path, stream, r.text)
            lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ") and ln != "data: [DONE]"]
            text = "\n".join(lines) if stream else r.text
            assert "-9999.0" in text, (path, stream)
            for line in lines if stream else [text]:
                json.loads(line, parse_constant=refuse)


def test_a_reply_without_max_tokens_fits_in_the_room_the_prompt_leaves(server):
    """Without ``max_tokens``, the reply's default (chat's 256, legacy completions' 16) shrinks to
    the room a long prompt leaves in the context, as vLLM's does (``ignore_eos``: the reply fills
    it), where it was a 400 blaming a max_tokens the client never sent; one the client asks that
    does not fit is still refused."""
    context = client(server).models.retrieve("tiny-chat").model_extra["max_model_len"]
    word = len(tokenizer(server).encode("word " * 100, add_special_tokens=False)) / 100
    messages = [{"role": "user", "content": "word " * int((context - 100) / word)}]
    kw = dict(model="tiny-chat", messages=messages, temperature=0, extra_body={"ignore_eos": True})
    r = client(server).chat.completions.create(**kw)
    assert context - 256 < r.usage.prompt_tokens < context  # the default would not have fit
    assert r.usage.completion_tokens == context - r.usage.prompt_tokens and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(**kw, max_tokens=256)
    assert caught.value.body["code"] == "context_length_exceeded"
    legacy = client(server).completions.create(model="tiny-chat", prompt=[5] * (context - 5), temperature=0,
                                               extra_body={"ignore_eos": True})
    assert legacy.usage.completion_tokens == 5 and legacy.choices[0].finish_reason == "length"


def test_logprobs_under_a_grammar_leave_out_what_it_forbids(server):
    """Logprobs with a grammar (a choice, JSON mode, a required tool call): more alternatives asked
    than the grammar allows at a step give fewer, each finite, whole and streamed (vLLM's raw
    logprobs are masked by the grammar: its forbidden tokens were ``-inf``, a 500 whole and
    ``-Infinity``, not JSON, streamed)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    for constraint in [{"structured_outputs": {"choice": ["Yes", "No"]}}, {"response_format": {"type": "json_object"}},
                       {"tools": [tool], "tool_choice": "required"}]:
        body = dict(model="tiny-chat", messages=ASK, max_tokens=4, temperature=0, logprobs=True, top_logprobs=5,
                    **constraint)
        headers = {"authorization": f"Bearer {server.keys['paid']}"}
        whole = httpx.post(f"{server.base_url}/chat/completions", json=body, headers=headers, timeout=120)
        assert whole.status_code == 200, whole.text
        streamed = httpx.post(f"{server.base_url}/chat/completions", json={**body, "stream": True}, headers=headers,
                              timeout=120)
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: {")]

        def strict(text: str):
            return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {constraint}"))

        entries = [e for event in [strict(whole.text)] + [strict(e) for e in events] for c in event["choices"]
                   if c.get("logprobs") for e in c["logprobs"]["content"] or []]
        assert entries and all(len(e["top_logprobs"]) <= 5 for e in entries)
        assert any(len(e["top_logprobs"]) < 5 for e in entries), constraint  # the grammar narrowed some step
        assert all(math.isfinite(t["logprob"]) for e in entries for t in [e, *e["top_logprobs"]])


def test_logprobs_bytes_are_each_tokens_own(server):
    """OpenAI's ``bytes`` let a client join the pieces of a character split over tokens: a token
    that is the byte 0xC3 alone has ``bytes`` [0xC3] (its ``token`` is "": see the next test),
    not the UTF-8 of U+FFFD; and a reply's entries' bytes, joined, decode to its text."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = tokenizer(server)
    piece = tok.convert_tokens_to_ids(bytes_to_unicode()[0xC3])  # the byte-level BPE token of that byte
    assert tok.decode([piece]) == "\ufffd"
    kw = dict(model="tiny-chat", messages=ASK, temperature=0, logprobs=True, top_logprobs=2)
    forced = client(server).chat.completions.create(**kw, max_tokens=1, logit_bias={str(piece): 100})
    assert forced.choices[0].logprobs.content[0].bytes == [0xC3]
    r = client(server).chat.completions.create(**kw, max_tokens=24, logit_bias={str(tok.eos_token_id): -100})
    entries = r.choices[0].logprobs.content
    joined = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")
    assert joined.rstrip("\ufffd") == r.choices[0].message.content.rstrip("\ufffd")  # an unfinished last character: either way
    for t in (t for e in entries for t in e.top_logprobs):
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token or t.token == ""


def test_logprobs_tokens_join_into_the_text_as_vllm_serve_gives_them(server):
    """A token's ``token`` is its text as ``vllm serve`` gives it, on both engines alike: a piece of
    a multi-byte character is "" and the piece that completes the character has the whole
    character (its ``bytes`` still its own), so a reply's tokens join into its text, whole,
    streamed and in the legacy shape (whose ``text_offset`` counts the tokens' texts)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = tokenizer(server)
    piece = tok.convert_tokens_to_ids(bytes_to_unicode()[0xC3])
    kw = dict(model="tiny-chat", temperature=0, logprobs=True, top_logprobs=2)
    forced = client(server).chat.completions.create(**kw, messages=ASK, max_tokens=1, logit_bias={str(piece): 100})
    assert forced.choices[0].logprobs.content[0].token == "" and forced.choices[0].logprobs.content[0].bytes == [0xC3]
    r = client(server).chat.completions.create(**kw, messages=ASK, max_tokens=64,
                                               logit_bias={str(tok.eos_token_id): -100})
    entries, text = r.choices[0].logprobs.content, r.choices[0].message.content
    completing = [e for e in entries if e.token and e.token.encode() != bytes(e.bytes)]  # the whole character's
    assert completing and all("\ufffd" in bytes(e.bytes).decode("utf-8", "replace") for e in completing)
    # (this random model also writes pieces no character completes, where the text has U+FFFD and
    # the tokens "", and special tokens, which the text leaves out)
    written = [e.token for e in entries if e.token not in tok.all_special_tokens]
    assert "".join(written) == text.replace("\ufffd", "")
    streamed = client(server).chat.completions.create(**kw, messages=ASK, max_tokens=64, stream=True,
                                                      logit_bias={str(tok.eos_token_id): -100})
    assert [e.token for c in streamed if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content or []] == [e.token for e in entries]
    legacy = client(server).completions.create(model="tiny-chat", prompt="naïve café", max_tokens=64, temperature=0,
                                               logprobs=1, logit_bias={str(tok.eos_token_id): -100}).choices[0]
    assert "".join(t for t in legacy.logprobs.tokens if t not in tok.all_special_tokens) == \
        legacy.text.replace("\ufffd", "")


def test_logprobs_of_a_reply_that_ends_at_once(server):
    """Asked for, a choice's logprobs are an object even when the model ends before any token
    (OpenAI's shape: ``content`` empty, not ``logprobs: null``); not asked for, they are null."""
    ends = {str(tokenizer(server).eos_token_id): 100}
    kw = dict(model="tiny-chat", messages=ASK, max_tokens=4, logit_bias=ends)
    r = client(server).chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == ""
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content == []
    assert client(server).chat.completions.create(**kw).choices[0].logprobs is None


def test_n_choices_each_take_a_slot(server):
    gate = server.services.gate
    before = gate.admitted["paid"]
    kw = dict(model="tiny-chat", messages=ASK, max_tokens=10, temperature=1.0)
    r = client(server).chat.completions.create(**kw, n=2, seed=40)
    assert gate.admitted["paid"] - before == 2
    assert [c.index for c in r.choices] == [0, 1]
    alone = [client(server).chat.completions.create(**kw, seed=s) for s in (40, 41)]
    singles = [a.choices[0].message.content for a in alone]
    assert [c.message.content for c in r.choices] == singles  # choice i is seeded seed + i
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    texts = {0: "", 1: ""}
    for chunk in client(server).chat.completions.create(**kw, n=2, seed=40, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[0], texts[1]] == singles


def test_penalties_and_logit_bias(server):
    tok = tokenizer(server)
    a, b = (tok.convert_tokens_to_ids(t) for t in ("a", "b"))
    kw = dict(model="tiny-chat", messages=ASK, max_tokens=12, temperature=0, logit_bias={str(a): 100, str(b): 90})
    plain = client(server).chat.completions.create(**kw).choices[0].message.content
    assert plain == "a" * 12
    damped = client(server).chat.completions.create(**kw, frequency_penalty=2, presence_penalty=2).choices[0].message.content
    assert set(damped) == {"a", "b"}  # every "a" costs 2 more: "b" wins now and then


def test_vllms_sampling_extensions_reach_the_engine(server):
    """top_k, min_p and repetition_penalty, as clients written for vLLM send them (extra_body), on
    both engines. Two tokens far above the rest (logit_bias 100 and 99.5; the model's own logits are
    small next to that), so that a draw at temperature 1 mixes them; top_k 1 or min_p 0.9 leave the
    likelier alone, so the draw is the greedy reply; a repetition penalty of 2 halves a seen token's
    logit, so the other one wins the next step, where greedy repeats one."""
    tok = tokenizer(server)
    a, b = (tok.convert_tokens_to_ids(t) for t in ("a", "b"))
    kw = dict(model="tiny-chat", messages=ASK, max_tokens=24, logit_bias={str(a): 100, str(b): 99.5})
    c = client(server)

    def reply(**extra) -> str:
        return c.chat.completions.create(**kw, **extra).choices[0].message.content

    greedy = reply(temperature=0)
    assert greedy in ("a" * 24, "b" * 24)
    assert set(reply(temperature=1, seed=5)) == {"a", "b"}  # a mix: 24 draws of near-even odds
    assert reply(temperature=1, seed=5, extra_body={"top_k": 1}) == greedy
    assert reply(temperature=1, seed=5, extra_body={"min_p": 0.9}) == greedy  # e^-0.5 = 0.61 < 0.9: one left
    assert reply(temperature=1, seed=5, extra_body={"top_k": -1, "min_p": 0}) == reply(temperature=1, seed=5)  # off
    penalized = reply(temperature=0, extra_body={"repetition_penalty": 2.0})
    assert set(penalized) == {"a", "b"} and penalized[:2] in ("ab", "ba")
    for field, value in (("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0), ("top_k", 1.5)):
        with pytest.raises(openai.BadRequestError) as bad:
            reply(temperature=1, extra_body={field: value})
        assert bad.value.body["param"] == field
    legacy = c.completions.create(model="tiny-chat", prompt="Say", max_tokens=24, temperature=1, seed=5,
                                  logit_bias={str(a): 100, str(b): 99.5}, extra_body={"top_k": 1}).choices[0].text
    assert len(set(legacy)) == 1  # the legacy completions take them too


def test_vllms_ends_of_a_reply_reach_the_engine(server):
    """stop_token_ids, min_tokens and ignore_eos, on both engines: with "a" biased far above the
    rest, a stop token "a" ends the reply at its first token (not in the text); with the end of text
    biased above everything, the reply ends at once, unless min_tokens holds it off (so many tokens,
    then the end) or ignore_eos goes past it to max_tokens."""
    tok = tokenizer(server)
    a, eos = tok.convert_tokens_to_ids("a"), tok.eos_token_id
    c = client(server)

    def ask(bias: dict, **extra):
        return c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=12, temperature=0,
                                         logit_bias={str(k): v for k, v in bias.items()}, extra_body=extra or None)

    assert ask({a: 100}).choices[0].message.content == "a" * 12
    stopped = ask({a: 100}, stop_token_ids=[a])
    assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == ("", "stop")
    assert stopped.usage.completion_tokens == 1
    ended = ask({eos: 100})
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    held = ask({eos: 100}, min_tokens=5)
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 6  # 5, then the end
    past = ask({eos: 100}, ignore_eos=True)
    assert past.choices[0].finish_reason == "length" and past.usage.completion_tokens == 12
    legacy = c.completions.create(model="tiny-chat", prompt="Say", max_tokens=12, temperature=0,
                                  logit_bias={str(a): 100}, extra_body={"stop_token_ids": [a]}).choices[0]
    assert (legacy.text, legacy.finish_reason) == ("", "stop")
    for extra, param in (({"min_tokens": 13}, "min_tokens"), ({"stop_token_ids": [10**6]}, "stop_token_ids"),
                         ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos")):
        with pytest.raises(openai.BadRequestError) as bad:
            ask({}, **extra)
        assert bad.value.body["param"] == param


def test_constraints_that_leave_no_token_to_sample_are_a_400_naming_the_field(server):
    """A grammar that allows only the end, which min_tokens or ignore_eos bars, or a grammar and
    allowed_token_ids / bad_words with no token in common, left every token masked: a 500 (a draw
    from nothing; at temperature 0 a token outside the grammar). A 400 naming the field, whole and
    streamed, chat and legacy completions. On vLLM (which ends the request with an error) for
    allowed_token_ids and bad_words; min_tokens and ignore_eos there do as vllm serve does."""
    vllm = server.services.arbiter.specs["tiny-chat"].engine == "vllm"
    eos = tokenizer(server).eos_token_id
    short = {"type": "json_schema", "json_schema": {"name": "b", "schema": {
        "type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}}}
    yes = {"structured_outputs": {"choice": ["yes"]}}
    for extra, param in (({"response_format": short, "min_tokens": 30}, "min_tokens"),
                         ({"response_format": short, "min_tokens": 30, "temperature": 0}, "min_tokens"),
                         ({"response_format": short, "ignore_eos": True}, "ignore_eos"),
                         ({**yes, "allowed_token_ids": [eos]}, "allowed_token_ids"),
                         ({**yes, "bad_words": ["yes", "ye", "y"]}, "bad_words")):
        if vllm and param in ("min_tokens", "ignore_eos"):
            continue
        body = {"model": "tiny-chat", "messages": ASK, "max_tokens": 40, **extra}
        r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {server.keys['paid']}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    if vllm:
        return
    for path, body in (("chat/completions", {"messages": ASK}), ("completions", {"prompt": "Say"})):
        r = httpx.post(f"{server.base_url}/{path}", timeout=60,
                       headers={"Authorization": f"Bearer {server.keys['paid']}"},
                       json={"model": "tiny-chat", "max_tokens": 40, "min_tokens": 30, "response_format": short,
                             "stream": True, **body})
        errors = [json.loads(line[6:])["error"] for line in r.text.splitlines() if line.startswith('data: {"error"')]
        assert [e["param"] for e in errors] == ["min_tokens"] and "min_tokens (30)" in errors[0]["message"], r.text


def test_stop_reason_names_what_ended_the_reply(server):
    """vLLM's ``stop_reason``, on both engines, whole and streamed, chat and legacy completions:
    the stop string or stop token id that ended the reply, None for the model's end of text or
    max_tokens. "a" biased far above the rest makes each case certain."""
    tok = tokenizer(server)
    a, eos = tok.convert_tokens_to_ids("a"), tok.eos_token_id
    c = client(server)

    def ask(bias: dict, stream: bool = False, **extra):
        kw = dict(model="tiny-chat", messages=ASK, max_tokens=12, temperature=0, stream=stream,
                  logit_bias={str(k): v for k, v in bias.items()}, **extra)
        if not stream:
            choice = c.chat.completions.create(**kw).choices[0]
            return choice.finish_reason, choice.model_extra["stop_reason"]
        last = [ch.choices[0] for ch in c.chat.completions.create(**kw) if ch.choices and ch.choices[0].finish_reason]
        return last[0].finish_reason, last[0].model_extra["stop_reason"]

    for stream in (False, True):
        assert ask({a: 100}, stream, stop=["zz", "aaa"]) == ("stop", "aaa")
        assert ask({a: 100}, stream, extra_body={"stop_token_ids": [a]}) == ("stop", a)
        assert ask({eos: 100}, stream) == ("stop", None)
        assert ask({a: 100}, stream) == ("length", None)
    legacy = c.completions.create(model="tiny-chat", prompt="Say", max_tokens=12, temperature=0, stop=["aa"],
                                  logit_bias={str(a): 100}).choices[0]
    assert (legacy.text, legacy.finish_reason, legacy.model_extra["stop_reason"]) == ("", "stop", "aa")
    kept = dict(model="tiny-chat", max_tokens=12, temperature=0, stop=["zz", "aaa"], logit_bias={str(a): 100},
                extra_body={"include_stop_str_in_output": True})  # vLLM's: the stop string stays in the text
    assert c.chat.completions.create(messages=ASK, **kept).choices[0].message.content == "aaa"
    assert "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(messages=ASK, stream=True, **kept)
                   if ch.choices) == "aaa"
    assert c.completions.create(prompt="Say", **kept).choices[0].text == "aaa"
    chunks = c.completions.create(model="tiny-chat", prompt="Say", max_tokens=12, temperature=0, stream=True,
                                  logit_bias={str(a): 100}, extra_body={"stop_token_ids": [a]})
    streamed = [ch.choices[0] for ch in chunks if ch.choices]
    assert streamed[-1].model_extra["stop_reason"] == a
    assert all("stop_reason" not in ch.model_extra for ch in streamed[:-1])  # only in the chunk that ends it


def test_return_tokens_as_token_ids_names_each_logprob_by_its_id(server):
    """vLLM's ``return_tokens_as_token_ids``, on both engines: each logprob entry and alternative
    names its token ``token_id:<id>`` (its ``bytes`` that name's), the ids those ``return_token_ids``
    gives, whole and streamed; the legacy shape too, echoed prompt included, its ``text_offset``
    still places in the text. The log probabilities are those the plain names have."""
    tok = tokenizer(server)
    c = client(server)
    named = re.compile(r"token_id:\d+")
    kw = dict(model="tiny-chat", messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    both = {"return_tokens_as_token_ids": True, "return_token_ids": True, "ignore_eos": True}
    r = c.chat.completions.create(**kw, extra_body=both)
    ids, content = r.choices[0].model_extra["token_ids"], r.choices[0].logprobs.content
    assert len(ids) == 6 and [e.token for e in content] == [f"token_id:{i}" for i in ids]
    assert all(e.bytes == list(e.token.encode()) for e in content)
    assert all(len(e.top_logprobs) == 2 and all(named.fullmatch(t.token) for t in e.top_logprobs) for e in content)
    plain = c.chat.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].logprobs.content
    assert all(e.token in (tok.decode([i]), "") for e, i in zip(plain, ids))  # ("" for a piece of a character)
    assert [e.logprob for e in plain] == pytest.approx([e.logprob for e in content], abs=1e-5)
    chunks = c.chat.completions.create(**kw, stream=True, extra_body=both)
    assert [e.token for ch in chunks if ch.choices and ch.choices[0].logprobs
            for e in ch.choices[0].logprobs.content] == [e.token for e in content]

    legacy = dict(model="tiny-chat", prompt="Say", max_tokens=4, temperature=0, logprobs=2, echo=True)
    if server.services.arbiter.specs["tiny-chat"].options.get("enable_lora"):
        legacy["echo"] = False  # an echo's prompt logprobs: refused on vLLM with LoRA (test_vllm_gateway)
        told = c.completions.create(**legacy, extra_body=both).choices[0]
        assert told.logprobs.tokens == [f"token_id:{i}" for i in told.model_extra["token_ids"]]
        return
    told = c.completions.create(**legacy, extra_body=both).choices[0]
    prompt = tok("Say")["input_ids"]
    assert told.logprobs.tokens == [f"token_id:{i}" for i in prompt + told.model_extra["token_ids"]]
    assert told.logprobs.top_logprobs[0] is None and all(named.fullmatch(k) for t in told.logprobs.top_logprobs[1:]
                                                            for k in t)
    as_text = c.completions.create(**legacy, extra_body={"ignore_eos": True}).choices[0]
    assert told.logprobs.text_offset == as_text.logprobs.text_offset and told.text == as_text.text


def test_allowed_token_ids_and_bad_words_constrain_the_reply_as_vllms(server):
    """vLLM's ``allowed_token_ids`` (the only tokens a reply may have) and ``bad_words`` (a word's
    last token barred where the reply ends with the rest of it, the word tokenized as it starts a
    text and after a space), on both engines, chat and legacy, read back with ``return_token_ids``.
    "a" biased to 100 and "b" to 50 make each reply certain: "aa" barred leaves a, b, a, b, ..."""
    tok = tokenizer(server)
    a, b, eos = (tok.convert_tokens_to_ids(t) for t in ("a", "b", tok.eos_token))
    assert tok.encode("aa", add_special_tokens=False) == [a, a]
    c = client(server)

    def ids(bias: dict | None = None, temperature: float = 0, **extra) -> list[int]:
        r = c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=6, temperature=temperature, seed=3,
                                      logit_bias={str(k): v for k, v in (bias or {}).items()},
                                      extra_body={"return_token_ids": True, **extra})
        return r.choices[0].model_extra["token_ids"]

    drawn = ids(temperature=1.0, allowed_token_ids=[a, b, 300])
    assert len(drawn) == 6 and set(drawn) <= {a, b, 300}
    assert ids(allowed_token_ids=[eos]) == [eos]  # the only token allowed: the end of text, at once
    assert ids({a: 100, b: 50}) == [a] * 6
    assert ids({a: 100, b: 50}, bad_words=["aa"]) == [a, b] * 3
    assert ids({a: 100, b: 50}, bad_words=["a"]) == [b] * 6
    assert ids({a: 100, b: 50}, bad_words=["  a"]) == [b] * 6  # (its leading spaces dropped, as vLLM's)
    legacy = c.completions.create(model="tiny-chat", prompt="Say", max_tokens=6, temperature=0,
                                  logit_bias={str(a): 100, str(b): 50},
                                  extra_body={"bad_words": ["aa"], "return_token_ids": True}).choices[0]
    assert legacy.model_extra["token_ids"] == [a, b] * 3
    for extra, param in (({"allowed_token_ids": []}, "allowed_token_ids"),
                         ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
                         ({"bad_words": [""]}, "bad_words[0]"), ({"bad_words": ["   "]}, "bad_words"),
                         ({"bad_words": ["w"] * 129}, "bad_words"), ({"bad_words": "aa"}, "bad_words")):
        with pytest.raises(openai.BadRequestError) as bad:
            ids(**extra)
        assert bad.value.body["param"] == param, extra


def test_special_tokens_and_a_stop_tokens_text_as_vllm_decodes_them(server):
    """vLLM's ``skip_special_tokens`` (default true) on both engines, whole and streamed, chat and
    legacy: a special token ("<|user|>", biased far above the rest) is left out of the text, and
    kept with false; ``include_stop_str_in_output`` keeps the text of the stop token that ended the
    reply too (a ``stop_token_ids`` token's; the end of text's, which is empty unless special
    tokens are kept), as vLLM's detokenizer does."""
    tok = tokenizer(server)
    a, eos, user = tok.convert_tokens_to_ids("a"), tok.eos_token_id, tok.convert_tokens_to_ids("<|user|>")
    assert user in tok.all_special_ids and user != eos
    c = client(server)

    def text(bias: dict, stream: bool = False, **extra) -> str:
        kw = dict(model="tiny-chat", messages=ASK, max_tokens=3, temperature=0, stream=stream,
                  logit_bias={str(k): v for k, v in bias.items()}, extra_body=extra)
        if not stream:
            return c.chat.completions.create(**kw).choices[0].message.content
        return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw) if ch.choices)

    for stream in (False, True):
        assert text({user: 100}, stream) == ""
        assert text({user: 100}, stream, skip_special_tokens=False) == "<|user|>" * 3
        kept = text({user: 100}, stream, skip_special_tokens=False, spaces_between_special_tokens=False)
        assert kept == "<|user|>" * 3
        assert text({a: 100}, stream, stop_token_ids=[a]) == ""
        assert text({a: 100}, stream, stop_token_ids=[a], include_stop_str_in_output=True) == "a"
        assert text({eos: 100}, stream, include_stop_str_in_output=True) == ""
        assert text({eos: 100}, stream, include_stop_str_in_output=True, skip_special_tokens=False) == tok.eos_token
        assert text({eos: 100}, stream, skip_special_tokens=False) == ""
    legacy = dict(model="tiny-chat", prompt="Say", max_tokens=3, temperature=0, logit_bias={str(user): 100})
    assert c.completions.create(**legacy).choices[0].text == ""
    kept = c.completions.create(**legacy, extra_body={"skip_special_tokens": False}).choices[0].text
    assert kept == "<|user|>" * 3
    with pytest.raises(openai.BadRequestError) as bad:
        text({}, skip_special_tokens="no")
    assert bad.value.body["param"] == "skip_special_tokens"


def test_continue_final_message_prefills_the_reply_as_vllm_does(server):
    """vLLM's ``continue_final_message`` (with ``add_generation_prompt`` false): the last message
    is left open and the reply continues it, on both engines. Its greedy reply is a raw legacy
    completion's of the same prompt (the template's text, left open), its prompt tokens those
    ``/tokenize`` counts with the same fields; ``add_generation_prompt`` false alone closes the
    last message; both true is a 400."""
    tok = tokenizer(server)
    c = client(server)
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]

    def ids(**ends) -> list[int]:  # the template's text, encoded as both engines encode it
        return tok(tok.apply_chat_template(messages, tokenize=False, **ends), add_special_tokens=False)["input_ids"]

    open_ids = ids(continue_final_message=True, add_generation_prompt=False)
    assert tok.decode(open_ids).endswith("My favourite is")
    kw = dict(model="tiny-chat", messages=messages, max_tokens=8, temperature=0)
    r = c.chat.completions.create(**kw, extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(open_ids)
    raw = c.completions.create(model="tiny-chat", prompt=open_ids, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == raw.choices[0].text
    assert r.choices[0].message.content != c.chat.completions.create(**kw).choices[0].message.content
    counted = httpx.post(f"{server.url}/tokenize", timeout=60, headers={"Authorization": f"Bearer {server.keys['paid']}"},
                         json={"model": "tiny-chat", "messages": messages, "continue_final_message": True,
                               "add_generation_prompt": False}).json()
    assert counted["count"] == len(open_ids)
    closed = c.chat.completions.create(**kw, extra_body={"add_generation_prompt": False})
    assert closed.usage.prompt_tokens == len(ids(add_generation_prompt=False)) != len(open_ids)
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(**kw, extra_body={"continue_final_message": True})
    assert bad.value.body["param"] == "continue_final_message"


def test_return_token_ids_as_vllm_answers_them(server):
    """vLLM's ``return_token_ids``, on both engines: the prompt's ids (the template's text as the
    engines encode it) and each choice's generated ids, whole and streamed (the chunks' ids joined
    are the whole answer's), chat and legacy completions; the tokens of a stop string cut from the
    text and the end of text are in them, as vLLM counts them; not asked, no such fields."""
    tok = tokenizer(server)
    a, eos = tok.convert_tokens_to_ids("a"), tok.eos_token_id
    c = client(server)
    prompt = tok(tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    kw = dict(model="tiny-chat", messages=ASK, max_tokens=10, temperature=0, extra_body={"return_token_ids": True})

    whole = c.chat.completions.create(n=2, **kw)
    assert whole.model_extra["prompt_token_ids"] == prompt and whole.usage.prompt_tokens == len(prompt)
    ids = [ch.model_extra["token_ids"] for ch in whole.choices]
    assert sum(map(len, ids)) == whole.usage.completion_tokens and ids[0] == ids[1]  # greedy: the same reply
    text = whole.choices[0].message.content
    assert tok.decode(ids[0], skip_special_tokens=True).rstrip("\ufffd") == text.rstrip("\ufffd")

    chunks = [ch for ch in c.chat.completions.create(stream=True, **kw)]
    assert chunks[0].model_extra["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in ch.model_extra for ch in chunks[1:])
    assert "token_ids" not in chunks[0].choices[0].model_extra  # the role's chunk: no tokens, as vLLM's
    assert [t for ch in chunks[1:] for t in ch.choices[0].model_extra["token_ids"]] == ids[0]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content

    def ended(bias: dict, stream: bool, **extra) -> tuple[str, list[int]]:
        asked = dict(kw, logit_bias={str(k): v for k, v in bias.items()}, **extra)
        if not stream:
            choice = c.chat.completions.create(**asked).choices[0]
            return choice.message.content, choice.model_extra["token_ids"]
        parts = [ch.choices[0] for ch in c.chat.completions.create(stream=True, **asked) if ch.choices][1:]
        return "".join(p.delta.content or "" for p in parts), [t for p in parts for t in p.model_extra["token_ids"]]

    for stream in (False, True):
        assert ended({a: 100}, stream, stop=["aaa"]) == ("", [a, a, a])  # the text cut, its tokens reported
        assert ended({eos: 100}, stream) == ("", [eos])

    legacy = c.completions.create(model="tiny-chat", prompt=["Say", "Go on"], max_tokens=6, temperature=0,
                                  extra_body={"return_token_ids": True})
    for choice, text in zip(legacy.choices, ["Say", "Go on"]):
        assert choice.model_extra["prompt_token_ids"] == tok(text)["input_ids"]
        assert tok.decode(choice.model_extra["token_ids"], skip_special_tokens=True).rstrip("\ufffd") == \
            choice.text.rstrip("\ufffd")  # (a character cut off at the end is dropped from the text)
    assert sum(len(ch.model_extra["token_ids"]) for ch in legacy.choices) == legacy.usage.completion_tokens
    streamed = [ch.choices[0] for ch in c.completions.create(model="tiny-chat", prompt="Say", max_tokens=6,
                                                              temperature=0, stream=True,
                                                              extra_body={"return_token_ids": True})]
    assert streamed[0].model_extra["prompt_token_ids"] == tok("Say")["input_ids"]
    assert [t for ch in streamed for t in ch.model_extra["token_ids"]] == legacy.choices[0].model_extra["token_ids"]

    plain = c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=4)
    assert "prompt_token_ids" not in plain.model_extra and "token_ids" not in plain.choices[0].model_extra
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=4, extra_body={"return_token_ids": "yes"})
    assert bad.value.body["param"] == "return_token_ids"


def test_echo_prepends_the_last_message_as_vllm_does(server):
    """vLLM's chat ``echo``, on both engines, whole and streamed: a continued message
    (``continue_final_message``) comes back whole, its text then the reply's; with the generation
    prompt, a last message that is not the assistant's is not echoed; with ``add_generation_prompt``
    false, any last message is (vLLM's reply takes its role then)."""
    c = client(server)
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    kw = dict(model="tiny-chat", messages=messages, max_tokens=6, temperature=0)
    go_on = {"continue_final_message": True, "add_generation_prompt": False}
    reply = c.chat.completions.create(**kw, extra_body=go_on)
    echoed = c.chat.completions.create(**kw, extra_body={**go_on, "echo": True})
    assert echoed.choices[0].message.content == "My favourite is" + reply.choices[0].message.content
    assert echoed.usage.completion_tokens == reply.usage.completion_tokens
    chunks = list(c.chat.completions.create(stream=True, n=2, **kw, extra_body={**go_on, "echo": True}))
    for i in range(2):
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
        assert text == echoed.choices[0].message.content, i
    plain = dict(model="tiny-chat", messages=ASK, max_tokens=6, temperature=0)
    assert c.chat.completions.create(**plain, extra_body={"echo": True}).choices[0].message.content == \
        c.chat.completions.create(**plain).choices[0].message.content
    closed = c.chat.completions.create(**plain, extra_body={"echo": True, "add_generation_prompt": False})
    alone = c.chat.completions.create(**plain, extra_body={"add_generation_prompt": False})
    assert closed.choices[0].message.content == ASK[-1]["content"] + alone.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(**kw, modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"},
                                  extra_body={**go_on, "echo": True})
    assert bad.value.body["param"] == "echo"


def test_truncate_prompt_tokens_cuts_the_prompt_as_vllm_does(server):
    """vLLM's ``truncate_prompt_tokens`` with ``truncation_side``, on both engines: the rendered
    prompt cut to its last (left) or first (right) tokens, the tokenizer's own side by default, -1
    the context less one (here: nothing cut); the reply is a raw completion's of the kept ids. On
    legacy completions each prompt is cut, and echoes as the kept tokens' text."""
    tok = tokenizer(server)
    c = client(server)
    prompt = tok(tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    k = len(prompt) - 3

    def chat(**extra):
        return c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=6, temperature=0,
                                         extra_body={"return_token_ids": True, **extra})

    for side, kept in (("left", prompt[-k:]), ("right", prompt[:k]), (None, prompt[:k] if
                       tok.truncation_side == "right" else prompt[-k:])):
        r = chat(truncate_prompt_tokens=k, **({"truncation_side": side} if side else {}))
        assert r.usage.prompt_tokens == k and r.model_extra["prompt_token_ids"] == kept, side
        raw = c.completions.create(model="tiny-chat", prompt=kept, max_tokens=6, temperature=0)
        assert r.choices[0].message.content == raw.choices[0].text, side
    assert chat(truncate_prompt_tokens=-1).model_extra["prompt_token_ids"] == prompt
    said = tok("Say something nice about tiers")["input_ids"]
    cut = c.completions.create(model="tiny-chat", prompt="Say something nice about tiers", max_tokens=2,
                               temperature=0, echo=True,
                               extra_body={"truncate_prompt_tokens": 3, "truncation_side": "left"})
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text.startswith(tok.decode(said[-3:]))
    for extra in ({"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": -2},
                  {"truncate_prompt_tokens": 4, "truncation_side": "middle"}):
        with pytest.raises(openai.BadRequestError) as bad:
            chat(**extra)
        assert bad.value.body["param"] in ("truncate_prompt_tokens", "truncation_side"), extra


def test_prompt_logprobs_as_vllm_answers_them(server):
    """vLLM's chat ``prompt_logprobs``, on both engines: per prompt token after the first, its log
    probability given the tokens before it and its rank (as plain transformers computes them on the
    rendered prompt, within 1e-3), with the k likeliest there ranked 1..k, by token id; not with
    ``stream``, as vLLM refuses it. The suite's vLLM engine has LoRA enabled (its adapters), where
    vLLM 0.32 cannot compute them: there they are a 400, and the engine serves on."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = tokenizer(server)
    c = client(server)
    prompt = tok(tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    if server.services.arbiter.specs["tiny-chat"].options.get("enable_lora"):
        # one such request beside another killed vLLM's engine core here (workers.chat_vllm)
        long = c.chat.completions.with_streaming_response.create(model="tiny-chat", messages=ASK, max_tokens=200,
                                                                 stream=True, extra_body={"ignore_eos": True})
        with long as running:  # a reply decoding while the others arrive
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            for ask in (lambda: c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=2,
                                                          extra_body={"prompt_logprobs": 2}),
                        lambda: c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=0, n=2,
                                                     extra_body={"prompt_logprobs": 2})):
                with pytest.raises(openai.BadRequestError) as bad:
                    ask()
                assert bad.value.body["param"] == "prompt_logprobs" and "LoRA" in bad.value.body["message"]
            assert sum(1 for line in lines if line.startswith("data:")) > 100  # the running reply went on
        # greedy: a sampled 2-token reply was empty in 4% of draws (EOS, or bytes that make no character yet)
        served = c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=2, temperature=0)
        assert (served.choices[0].finish_reason, served.usage.completion_tokens) == ("length", 2)
        return
    r = c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    places = r.model_extra["prompt_logprobs"]
    assert len(places) == len(prompt) == r.usage.prompt_tokens and places[0] is None
    model = AutoModelForCausalLM.from_pretrained(str(server.services.arbiter.specs["tiny-chat"].path)).eval()
    with torch.no_grad():
        rows = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)
    for at, (token, place) in enumerate(zip(prompt[1:], places[1:])):
        row = rows[at]
        own = place[str(token)]
        assert abs(own["logprob"] - float(row[token])) < 1e-3, at
        assert own["rank"] == int((row > row[token]).sum()) + 1 and own["decoded_token"] == tok.decode([token])
        best = sorted((v["rank"], int(k)) for k, v in place.items() if v["rank"] <= 2)
        assert [t for _, t in best] == torch.topk(row, 2).indices.tolist() and [k for k, _ in best] == [1, 2]
    assert "prompt_logprobs" not in c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=2).model_extra
    for extra, stream in (({"prompt_logprobs": 1}, True), ({"prompt_logprobs": -1}, False),
                          ({"prompt_logprobs": 21}, False)):
        with pytest.raises(openai.BadRequestError) as bad:
            c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=2, stream=stream, extra_body=extra)
        assert bad.value.body["param"] == "prompt_logprobs", extra
    # legacy completions take it too (max_tokens 0: the prompt scored alone), each choice its own
    legacy = c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=0, n=2,
                                  extra_body={"prompt_logprobs": 2})
    for choice in legacy.choices:
        got = choice.model_extra["prompt_logprobs"]
        assert got[0] is None and [sorted(p) for p in got[1:]] == [sorted(p) for p in places[1:]]
        assert all(abs(p[k]["logprob"] - q[k]["logprob"]) < 1e-4 for p, q in zip(got[1:], places[1:]) for k in p)
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model="tiny-chat", prompt="Hi", max_tokens=2, stream=True,
                             extra_body={"prompt_logprobs": 1})
    assert bad.value.body["param"] == "prompt_logprobs"


def test_documents_reach_a_template_that_renders_them(tiny_chat, tmp_path):
    """vLLM's ``documents``: a RAG template (here: each document's title and text before the
    conversation) renders them, as the prompt's own ids show (``return_token_ids``); the stock
    template, which has no use for them, renders the same prompt with or without them, as vLLM's."""
    from transformers import AutoTokenizer

    folder = tmp_path / "rag"
    folder.mkdir()
    for f in tiny_chat.iterdir():
        if f.name != "chat_template.jinja":
            (folder / f.name).symlink_to(f)
    template = (tiny_chat / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text(
        "{% for d in documents or [] %}[{{ d['title'] }}: {{ d['text'] }}]\n{% endfor %}" + template)
    running = start_server(write_config(tmp_path, {"rag": ("chat", folder), "tiny-chat": ("chat", tiny_chat)}))
    tok = AutoTokenizer.from_pretrained(str(tiny_chat))
    try:
        c = openai.OpenAI(base_url=running.base_url, api_key=running.keys["paid"], max_retries=0, timeout=120)

        def prompt(model: str, **extra) -> str:
            r = c.chat.completions.create(model=model, messages=ASK, max_tokens=1,
                                          extra_body={"return_token_ids": True, **extra})
            return tok.decode(r.model_extra["prompt_token_ids"])

        docs = [{"title": "Tiers", "text": "Paid requests go first."}, {"title": "Batch", "text": "Batch waits."}]
        told = prompt("rag", documents=docs)
        assert "[Tiers: Paid requests go first.]" in told and "[Batch: Batch waits.]" in told
        assert "Paid requests" not in prompt("rag")
        assert prompt("tiny-chat", documents=docs) == prompt("tiny-chat")
        for bad, param in (([{"title": 3}], "documents[0].title"), ("x", "documents"),
                           ([{"text": "t"}] * 1025, "documents")):
            with pytest.raises(openai.BadRequestError) as refused:
                prompt("rag", documents=bad)
            assert refused.value.body["param"] == param, bad
    finally:
        running.stop()


def test_vllms_request_id_names_the_answer_and_its_defaults_are_accepted(server):
    """vLLM's ``request_id`` is the answer's id after its prefix (chat, each chunk of a stream, a
    legacy completion); ``priority: 0``, ``use_beam_search: false`` and any ``length_penalty``
    (beam search's, unread without it), as clients send them, change nothing."""
    c = client(server)
    kw = dict(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    plain = c.chat.completions.create(**kw)
    named = c.chat.completions.create(extra_body={"request_id": "trace-42/a", "priority": 0, "use_beam_search": False,
                                                  "length_penalty": 2.0, "cache_salt": "tenant-7"}, **kw)
    assert named.id == "chatcmpl-trace-42/a" and named.choices[0].message.content == plain.choices[0].message.content
    assert plain.id != named.id and plain.id.startswith("chatcmpl-")
    chunks = list(c.chat.completions.create(stream=True, extra_body={"request_id": "s1"}, **kw))
    assert {ch.id for ch in chunks} == {"chatcmpl-s1"}
    legacy = c.completions.create(model="tiny-chat", prompt="Hi", max_tokens=2,
                                  extra_body={"request_id": "c1", "priority": 0, "cache_salt": "x"})
    assert legacy.id == "cmpl-c1"
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny-chat", prompt="Hi", max_tokens=2, extra_body={"use_beam_search": True})


def test_user_is_logged_scoped_to_the_key(server, caplog):
    caplog.set_level("INFO", logger="tiergate")
    client(server).chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=2, user="alice@example.com")
    assert "alice@example.com" not in caplog.text
    assert "user " in caplog.text


def test_the_end_user_and_prompt_cache_fields_are_accepted_and_logged_scoped(server, caplog):
    """``safety_identifier`` (OpenAI's successor to ``user``), ``prompt_cache_key`` and
    ``prompt_cache_retention``, ``verbosity``, ``modalities: ["text"]`` and
    ``stream_options.include_obfuscation``: accepted, the reply the same as without them; the
    end user logged only as its hash scoped to the key."""
    from gateway.auth import key_id
    from gateway.schemas import EndUser

    caplog.set_level("INFO", logger="tiergate")
    c = client(server)
    plain = c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=4, temperature=0)
    tagged = c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=4, temperature=0,
                                       safety_identifier="bob@example.com", prompt_cache_key="app-1",
                                       prompt_cache_retention="24h", verbosity="low", modalities=["text"])
    assert tagged.choices[0].message.content == plain.choices[0].message.content
    sdk_spelled = c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=4, temperature=0,
                                            prompt_cache_retention="in_memory")  # the openai SDK's literal
    assert sdk_spelled.choices[0].message.content == plain.choices[0].message.content
    assert "bob@example.com" not in caplog.text
    assert EndUser(safety_identifier="bob@example.com").end_user(key_id(server.keys["paid"])) in caplog.text
    chunks = list(c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "include_obfuscation": False}))
    assert "".join(k.choices[0].delta.content or "" for k in chunks if k.choices) == plain.choices[0].message.content
    for bad, param in ((dict(modalities=["text", "video"]), "modalities"), (dict(safety_identifier="x" * 65), "safety_identifier"),
                       (dict(prompt_cache_retention="1h"), "prompt_cache_retention")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=1, **bad)
        assert e.value.body["param"] == param, e.value.body
        assert param != "modalities" or '["text", "audio"]' in e.value.body["message"]


# -- clients ------------------------------------------------------------------------------------------


def test_langchain_structured_output_and_bind_tools(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tiny-chat", base_url=server.base_url, api_key=server.keys["paid"], max_tokens=128,
                     max_retries=0, seed=5)
    answer = llm.with_structured_output(Answer, method="json_schema").invoke("Pick a color")
    assert isinstance(answer, Answer)
    message = llm.bind_tools([GetWeather, SetAlarm], tool_choice="any").invoke("Weather in Oslo?")
    assert message.tool_calls
    models = {"GetWeather": GetWeather, "SetAlarm": SetAlarm}
    for call in message.tool_calls:
        models[call["name"]].model_validate(call["args"])
    # tools and a response format at once (LangChain's bind_tools(..., response_format=)): a call or the parsed answer
    seen = set()
    for seed in range(16):
        llm = ChatOpenAI(model="tiny-chat", base_url=server.base_url, api_key=server.keys["paid"], max_tokens=128,
                         max_retries=0, seed=seed)
        message = llm.bind_tools([GetWeather, SetAlarm], response_format=Answer).invoke("Weather in Oslo?")
        if message.tool_calls:
            for call in message.tool_calls:
                models[call["name"]].model_validate(call["args"])
            seen.add("calls")
        else:
            assert isinstance(message.additional_kwargs["parsed"], Answer), message
            seen.add("parsed")
        if len(seen) == 2:
            break
    assert seen == {"calls", "parsed"}


def test_instructor_tools_mode(server):
    import instructor

    ic = instructor.from_openai(client(server), mode=instructor.Mode.TOOLS)
    answer = ic.chat.completions.create(model="tiny-chat", response_model=Answer, max_retries=0, max_tokens=128,
                                        messages=[{"role": "user", "content": "Pick a color"}])
    assert isinstance(answer, Answer)


# -- service_tier -----------------------------------------------------------------------------------------


def test_priority_from_a_free_key_is_served_as_free(server):
    gate = server.services.gate
    paid, free = gate.admitted["paid"], gate.admitted["free"]
    raw = client(server, "free").chat.completions.with_raw_response.create(
        model="tiny-chat", messages=ASK, max_tokens=2, service_tier="priority")
    assert raw.headers["x-tiergate-tier"] == "free"
    assert raw.parse().service_tier == "default"
    assert gate.admitted["free"] == free + 1 and gate.admitted["paid"] == paid
    r = client(server).chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=2, service_tier="auto")
    assert r.service_tier == "priority"  # the paid key's own tier, the highest


def test_flex_runs_at_the_batch_tier_and_yields(server):
    s = server
    eos = str(tokenizer(s).eos_token_id)
    pauses = s.services.arbiter.counters.batch_pauses
    before = s.services.gate.admitted["batch"]
    seen: dict = {}
    started = threading.Event()

    def run_flex():
        with client(s).chat.completions.with_streaming_response.create(
                model="tiny-chat", messages=ASK, max_tokens=200, temperature=0, stream=True, service_tier="flex",
                logit_bias={eos: -100}) as raw:
            seen["tier"] = raw.headers["x-tiergate-tier"]
            for chunk in raw.parse():
                seen["label"] = chunk.service_tier
                if chunk.choices and chunk.choices[0].delta.content:
                    started.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    seen["finish"] = chunk.choices[0].finish_reason

    t = threading.Thread(target=run_flex)
    t.start()
    assert started.wait(60)
    r = client(s).chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=30, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    t.join(120)
    assert seen == {"tier": "batch", "label": "flex", "finish": "length"}
    assert s.services.gate.admitted["batch"] == before + 1
    assert s.services.arbiter.counters.batch_pauses > pauses


# -- bad input -------------------------------------------------------------------------------------------


GOOD = {"model": "tiny-chat", "messages": ASK, "max_tokens": 4}


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "("}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                         "pattern": "[a-z]{1,200}"}}}},
     "response_format"),  # xgrammar 0.2.8 fails to compile it in the engine (mlc-ai/xgrammar#863)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "([a-z]{1,100}){1,100}"}}}}}]},
     "tools[0].function.parameters"),  # 10,000 characters written out: seconds to compile
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "Missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools[0].type"),
    ({"functions": [t["function"] for t in TOOLS], "tools": TOOLS}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"functions": [t["function"] for t in TOOLS], "function_call": {"name": "Missing"}}, "function_call"),
    ({"functions": [{"name": "f", "parameters": {"type": "bogus"}}]}, "functions[0].parameters"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages[0].function_call"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "Missing"}}]}}}, "tool_choice.allowed_tools.tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": TOOLS}}},
     "tool_choice"),
    ({"n": 5}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"service_tier": "gold"}, "service_tier"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant"}]}, "messages[0].content"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a\x00"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "bogus"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern"),
    ({"priority": 1}, "priority"),  # vLLM's without its priority scheduler: the key's tier orders requests here
    ({"use_beam_search": True}, "use_beam_search"),
    ({"request_id": "has space"}, "request_id"),
    ({"request_id": "r1", "store": True}, "request_id"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"structured_outputs": {"regx": "a"}}, "structured_outputs.regx"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["x" * 1000] * 9}}, "structured_outputs.choice"),  # limits.grammar_max_chars 8192
    ({"structured_outputs": {"regex": "a" * 8193}}, "structured_outputs.regex"),
    # OpenAI's limit on a schema's names, enum and const values (120,000 characters): what compiling it costs
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"enum": ["x" * 1000 + str(i) for i in range(121)]}}}}}}, "response_format"),
    ({"structured_outputs": {"json": {"$defs": {"d" * 60_001: {}, "e" * 60_000: {}}}}}, "structured_outputs.json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"const": "c" * 120_001}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
        "a": {"const": "c" * 40_000}}}}} for i in range(3)]}, "tools"),  # each under it, together over
])
def test_bad_fields_are_400_naming_the_param(server, extra, param):
    r = httpx.post(f"{server.base_url}/chat/completions", json={**GOOD, **extra}, timeout=60,
                   headers={"Authorization": f"Bearer {server.keys['paid']}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and isinstance(err["code"], str) and err["message"]
    assert param != "tools[0].type" or "'custom' are not served here" in err["message"]


def test_openais_nullable_fields_sent_as_null_are_their_defaults(server):
    """The openai SDK sends an explicit None (``temperature=None``, as code that passes its own
    settings through does) as null: OpenAI's nullable fields take it, and vllm serve too, as if
    left out. A null where the field has no None (``min_tokens``) stays a 400."""
    c = client(server)
    nulls = dict.fromkeys(("temperature", "top_p", "n", "stream", "logprobs", "presence_penalty", "frequency_penalty"))
    left_out = c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=6, seed=3)
    sent = c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=6, seed=3, **nulls)
    assert len(sent.choices) == 1 and sent.choices[0].logprobs is None
    assert sent.choices[0].message.content == left_out.choices[0].message.content  # temperature 1, as OpenAI's default
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=6, extra_body={"min_tokens": None})
    assert bad.value.body["param"] == "min_tokens"
