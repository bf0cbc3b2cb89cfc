"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) through the
``anthropic`` SDK against a real server on tiny-chat (random weights, the transformers engine):
each answer against the chat completion it stands for (same text, same token counts), stop
reasons, streaming events, tool use and tool results, token counting, the key as the SDK sends it
(``x-api-key``), and errors both SDKs read."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.helpers import start_server, write_config

ASK = [{"role": "user", "content": "What is the weather?"}]
GREEDY = {"temperature": 0}  # (the SDK no longer types the sampling fields; vLLM's endpoint, and this one, take them)
WEATHER = {"name": "get_weather", "description": "Weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["paris", "oslo", "lima"]},
                                                             "celsius": {"type": "boolean"}},
                            "required": ["city", "celsius"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_chat, tiny_vlm, tiny_embed, tmp_path_factory):
    """tiny-chat, tiny-vlm (it reads images), tiny-chat with a template that thinks unless
    ``enable_thinking`` is false (Qwen3's rule), and an embedding model (no Messages model)."""
    from tests.test_reasoning import QWEN3_PROMPT, THINKING_ASSISTANT, _model

    root = tmp_path_factory.mktemp("messages")
    thinker = _model(tiny_chat, root / "thinker", QWEN3_PROMPT, THINKING_ASSISTANT)
    running = start_server(write_config(root, {"tiny-chat": ("chat", tiny_chat), "tiny-vlm": ("chat", tiny_vlm),
                                               "thinker": ("chat", thinker), "tiny-embed": ("embed", tiny_embed)}))
    yield running
    running.stop()


def claude(server, tier: str = "paid") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=server.keys[tier], max_retries=0, timeout=120)


def gpt(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0, timeout=120)


def tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(server.services.arbiter.specs["tiny-chat"].path))


def test_a_message_is_the_chat_completion_it_stands_for(server):
    """The system prompt and the turns become the chat's messages: the reply, its token counts and
    its stop reason are the chat completion's; the key goes as the SDK sends it (x-api-key)."""
    system = "You answer briefly."
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is the weather?"}]}]
    m = claude(server).messages.create(model="tiny-chat", max_tokens=8, system=system, messages=turns,
                                       extra_body=GREEDY)
    chat = gpt(server).chat.completions.create(model="tiny-chat", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is the weather?"}])
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny-chat" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    counted = claude(server).messages.count_tokens(model="tiny-chat", system=system, messages=turns)
    assert counted.input_tokens == m.usage.input_tokens


def test_anthropics_service_tiers_are_served_at_the_keys_tier(server):
    """Anthropic's ``service_tier`` (``auto``, ``standard_only``), which its docs have clients
    set, is accepted: the key's tier serves the message either way, as the header says."""
    for tier in ("auto", "standard_only"):
        r = httpx.post(f"{server.url}/v1/messages", timeout=60, headers={"x-api-key": server.keys["free"]},
                       json={"model": "tiny-chat", "max_tokens": 2, "messages": ASK, "service_tier": tier, **GREEDY})
        assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "free", r.text


def test_stop_reasons(server):
    """``max_tokens``, and ``stop_sequences`` (the sequence that ended it named, the text cut
    before it), on greedy replies."""
    c = claude(server)

    long = c.messages.create(model="tiny-chat", max_tokens=3, messages=ASK, extra_body=GREEDY)
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 3
    text = c.messages.create(model="tiny-chat", max_tokens=12, messages=ASK, extra_body=GREEDY).content[0].text
    cut = text[2:5]
    ended = c.messages.create(model="tiny-chat", max_tokens=12, messages=ASK, stop_sequences=["zzz", cut],
                              extra_body=GREEDY)
    assert (ended.stop_reason, ended.stop_sequence) == ("stop_sequence", cut)
    assert ended.content[0].text == text[:text.index(cut)]


def test_a_streamed_message_is_the_whole_ones_in_anthropics_events(server):
    """``messages.stream``: message_start first, a text block started, filled and stopped, then
    message_delta (stop reason, usage) and message_stop; its text and usage are the whole answer's."""
    c = claude(server)
    kw = dict(model="tiny-chat", max_tokens=10, messages=ASK, extra_body=GREEDY)
    whole = c.messages.create(**kw)
    with c.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens > 0  # known when the stream starts
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)


def test_tool_use_and_tool_results(server):
    """A forced tool (``tool_choice`` by name): a ``tool_use`` block whose input is the schema's
    (the call is constrained), ``stop_reason`` tool_use; streamed, its ``input_json_delta``
    pieces join to the same input. The result goes back as a ``tool_result`` block: the next
    turn's prompt holds the call and the result."""
    c = claude(server)
    kw = dict(model="tiny-chat", max_tokens=64, messages=ASK, tools=[WEATHER], extra_body=GREEDY,
              tool_choice={"type": "tool", "name": "get_weather"})
    m = c.messages.create(**kw)
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and call.name == "get_weather" and call.id
    assert set(call.input) == {"city", "celsius"} and call.input["city"] in ("paris", "oslo", "lima")
    with c.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [b.input for b in streamed] == [call.input] and final.stop_reason == "tool_use"
    turns = ASK + [{"role": "assistant", "content": m.content},  # the SDK's own blocks, as clients send them back
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees"},
                                                {"type": "text", "text": "Thanks. And tomorrow?"}]}]
    after = c.messages.count_tokens(model="tiny-chat", messages=turns, tools=[WEATHER])
    before = c.messages.count_tokens(model="tiny-chat", messages=ASK, tools=[WEATHER])
    assert after.input_tokens > before.input_tokens
    reply = c.messages.create(model="tiny-chat", max_tokens=4, messages=turns, tools=[WEATHER])
    assert reply.usage.input_tokens == after.input_tokens
    rendered = httpx.post(f"{server.url}/tokenize", timeout=60, headers={"Authorization": f"Bearer {server.keys['paid']}"},
                          json={"model": "tiny-chat", "return_token_strs": False, "messages": [
                              *ASK, {"role": "assistant", "content": "",
                                     "tool_calls": [{"id": call.id, "type": "function", "function": {
                                         "name": "get_weather", "arguments": json.dumps(call.input)}}]},
                              {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"},
                              {"role": "user", "content": "Thanks. And tomorrow?"}]}).json()
    assert "18 degrees" in tokenizer(server).decode(rendered["tokens"])
    # (with the tools the template renders them too, so only the count without them is the chat's)
    assert c.messages.count_tokens(model="tiny-chat", messages=turns).input_tokens == rendered["count"]


def test_stop_sequences_do_not_cut_a_forced_tool_use(server):
    """``stop_sequences`` beside ``tool_choice: any``: a sequence the call writes (its input's key)
    does not cut it, so the reply is a ``tool_use`` whose input is the schema's, whole and streamed
    (cut, it was text ``{"`` with ``end_turn``, and streamed a ``tool_use`` with an empty input)."""
    c = claude(server)
    kw = dict(model="tiny-chat", max_tokens=64, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"},
              stop_sequences=["city"], extra_body=GREEDY)
    m = c.messages.create(**kw)
    with c.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    for answer in (m, final):
        (call,) = answer.content
        assert (answer.stop_reason, answer.stop_sequence, call.type) == ("tool_use", None, "tool_use"), answer
        assert set(call.input) == {"city", "celsius"} and call.input["city"] in ("paris", "oslo", "lima")


def test_a_tool_without_arguments_is_called_with_an_empty_input(server):
    """A tool declared as Anthropic's docs and MCP servers declare one without arguments,
    ``input_schema: {"type": "object"}``, forced: a ``tool_use`` whose input is ``{}``, whole and
    streamed (taken as an open object, random weights wrote keys until ``max_tokens``). One call
    (``disable_parallel_tool_use``): random weights may write call after call. 64 tokens: the call
    sampled at temperature 1 may spell its ~50 characters in small pieces (16-29 tokens seen in
    1,500 draws; 32 was cut about once in 10,000 runs), and an open object still runs past 64."""
    c = claude(server)
    now = {"name": "now", "description": "The time.", "input_schema": {"type": "object"}}
    kw = dict(model="tiny-chat", max_tokens=64, messages=ASK, tools=[now],
              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    for temperature in (0, 1, 1):
        m = c.messages.create(**kw, extra_body={"temperature": temperature})
        assert m.stop_reason == "tool_use" and [(b.type, b.input) for b in m.content] == [("tool_use", {})], m
    with c.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.input for b in final.content] == [{}]


def test_a_stop_sequence_that_ended_a_reply_is_named_whatever_its_calls():
    """The stop sequence that ended a reply is named: beside ``tool_use`` when calls came before
    the text it cut, and as the stop reason when the reply's call is not one a client can run
    (its arguments, not JSON, answered as text)."""
    from gateway.chat import Reply
    from gateway.messages import message
    from gateway.tools import ToolCalls
    from workers.base import ChatFinished

    def answer(arguments: str) -> dict:
        calls = ToolCalls([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}])
        reply = Reply(0, ["Observation"], calls=calls, finish_reason="tool_calls",
                      finished=ChatFinished("stop", 5, 9, stop_reason="\nObs"))
        return message("msg_1", "tiny-chat", reply)

    ran = answer('{"x": 1}')
    assert (ran["stop_reason"], ran["stop_sequence"]) == ("tool_use", "\nObs")
    assert [b["type"] for b in ran["content"]] == ["text", "tool_use"] and ran["content"][1]["input"] == {"x": 1}
    cut = answer('{"')
    assert (cut["stop_reason"], cut["stop_sequence"]) == ("stop_sequence", "\nObs")
    assert cut["content"] == [{"type": "text", "text": 'Observation{"'}]
    # a call max_tokens cut after its name, before any argument, is no call a client can run either
    for arguments in ("", '{"'):
        calls = ToolCalls([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}])
        cut = message("msg_1", "tiny-chat", Reply(0, [], calls=calls, finish_reason="length",
                                                  finished=ChatFinished("length", 5, 9)))
        assert cut["stop_reason"] == "max_tokens" and [b["type"] for b in cut["content"]] == ["text"]


def test_a_call_whose_arguments_nest_past_the_json_parser_is_text():
    """Arguments a model wrote nested past json.loads' ~1000 levels (RecursionError, a 500) are no
    call a client can run: answered as text, as arguments that are not JSON are."""
    from gateway.chat import Reply
    from gateway.messages import message
    from gateway.tools import ToolCalls
    from workers.base import ChatFinished

    deep = "[" * 2000 + "]" * 2000
    calls = ToolCalls([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep}}])
    answer = message("msg_1", "tiny-chat", Reply(0, [], calls=calls, finish_reason="tool_calls",
                                                 finished=ChatFinished("stop", 5, 9)))
    assert answer["content"] == [{"type": "text", "text": deep}]


def test_output_config_format_constrains_the_reply_to_its_schema(server):
    """``output_config.format``: the reply's text is JSON the schema allows (constrained as chat's
    response_format is), even on random weights; a schema that is not one is a 400 naming
    ``output_config``."""
    c = claude(server)
    m = c.messages.create(model="tiny-chat", max_tokens=64, messages=ASK, extra_body=GREEDY,
                          output_config={"format": {"type": "json_schema", "schema": WEATHER["input_schema"]}})
    answer = json.loads(m.content[0].text)
    assert set(answer) == {"city", "celsius"} and answer["city"] in ("paris", "oslo", "lima")
    assert isinstance(answer["celsius"], bool) and m.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(model="tiny-chat", max_tokens=8, messages=ASK,
                          output_config={"format": {"type": "json_schema", "schema": {"type": "nonsense"}}})
    assert bad.value.body["error"]["param"].startswith("output_config")


def test_image_blocks_and_thinking(server):
    """An image block (base64, or a url as chat takes one) reaches a model that reads images: its
    tokens count; a model that does not is a 400 naming the messages. ``thinking`` sets the chat
    template's ``enable_thinking``: disabled, the template writes the empty thinking block."""
    from tests.test_vision import data_url, picture

    c = claude(server)
    png = picture(1)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data_url(png).split(",", 1)[1]}}
    asked = [{"role": "user", "content": [image, {"type": "text", "text": "What is in the picture?"}]}]
    plain = [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"}]}]
    seen = c.messages.count_tokens(model="tiny-vlm", messages=asked).input_tokens
    assert seen > c.messages.count_tokens(model="tiny-vlm", messages=plain).input_tokens + 1
    assert c.messages.create(model="tiny-vlm", max_tokens=4, messages=asked).usage.input_tokens == seen
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(model="tiny-chat", max_tokens=4, messages=asked)
    assert bad.value.body["error"]["param"].startswith("messages")
    thinking = c.messages.count_tokens(model="thinker", messages=ASK).input_tokens
    quiet = c.messages.count_tokens(model="thinker", messages=ASK, thinking={"type": "disabled"}).input_tokens
    on = c.messages.count_tokens(model="thinker", messages=ASK,
                                 thinking={"type": "enabled", "budget_tokens": 1024}).input_tokens
    assert quiet > thinking == on


def test_the_sdks_strict_tools_and_redacted_thinking_are_taken(server):
    """A tool's ``strict: true`` (typed in the SDK's ToolParam) is accepted: a forced call is
    constrained to its schema either way. A ``redacted_thinking`` block sent back as history is
    accepted and not rendered (it has no text), as vLLM's endpoint skips it."""
    c = claude(server)
    m = c.messages.create(model="tiny-chat", max_tokens=64, messages=ASK, tools=[{**WEATHER, "strict": True}],
                          tool_choice={"type": "any"}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use" and m.content[0].input["city"] in ("paris", "oslo", "lima")
    turns = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
             {"role": "user", "content": "And tomorrow?"}]
    redacted = [dict(t) for t in turns]
    redacted[1]["content"] = [{"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"}, *turns[1]["content"]]
    counted = c.messages.count_tokens(model="tiny-chat", messages=redacted).input_tokens
    assert counted == c.messages.count_tokens(model="tiny-chat", messages=turns).input_tokens
    assert c.messages.create(model="tiny-chat", max_tokens=2, messages=redacted).usage.input_tokens == counted


@pytest.mark.parametrize("extra, param, says", [
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "a doc"}},
        {"type": "text", "text": "Sum it up."}]}]},
     "messages[0].content[0]", "document blocks are not supported"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name", "tool_choice of type tool needs"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences", "invalid value for stop_sequences: at most 4"),
])
def test_refusals_name_the_messages_apis_own_fields_and_blocks(server, extra, param, says):
    """A block type this server does not take is named (not "Input should be a valid string"); a
    ``tool`` choice without a name and too many ``stop_sequences`` are worded in the Messages
    API's terms, not chat's (``'none', 'auto' or 'required'``, ``stop``)."""
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude(server).messages.create(**{"model": "tiny-chat", "max_tokens": 4, "messages": ASK, **extra})
    err = bad.value.body["error"]
    assert err["param"] == param and says in err["message"], err


def test_an_error_after_the_stream_started_is_an_error_event_both_sdks_read():
    """The engine failing mid-reply: the blocks so far are stopped by an ``error`` event (no
    message_stop) carrying the same error object as a refusal's, which Anthropic's SDK raises."""
    import asyncio

    from gateway.chat import ChoiceDelta
    from gateway.messages import _events

    async def failing():
        raise RuntimeError("the engine died")
        yield  # (an async generator)

    async def read() -> list[dict]:
        lines = [line async for line in _events(failing(), ChoiceDelta(0, "Hel"), "msg_1", "tiny-chat")]
        return [json.loads(line.split("data: ", 1)[1]) for line in lines]

    events = asyncio.run(read())
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    err = events[-1]["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "generation_failed"
    assert "RuntimeError" in err["message"]


@pytest.mark.parametrize("body, status, param", [
    ({"messages": ASK}, 400, "max_tokens"),  # required, as Anthropic's
    ({"messages": ASK, "max_tokens": 4, "stop_sequences": ["a", "b", "c", "d", "e"]}, 400, "stop_sequences"),
    ({"messages": [], "max_tokens": 4}, 400, "messages"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "y"}]}],
      "max_tokens": 4}, 400, "messages"),
    ({"messages": ASK, "max_tokens": 4, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]},
     400, "tool_choice"),
    ({"messages": ASK, "max_tokens": 4, "model": "nope"}, 404, "model"),
    ({"messages": ASK, "max_tokens": 4, "logit_bias": {}}, 400, "logit_bias"),
    ({"messages": ASK, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 4}}, 400,
     "thinking.budget_tokens"),  # less than max_tokens, as Anthropic's and vLLM's
    ({"messages": ASK, "max_tokens": 4, "service_tier": "priority"}, 400, "service_tier"),  # auto or standard_only
])
def test_bad_requests_are_errors_both_sdks_read(server, body, status, param):
    r = httpx.post(f"{server.url}/v1/messages", timeout=30, headers={"x-api-key": server.keys["paid"]},
                   json={"model": "tiny-chat", **body})
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["param"] == param and isinstance(err["error"]["code"], str)
    assert err["error"]["message"]


def test_a_bad_key_is_the_sdks_authentication_error(server):
    with pytest.raises(anthropic.AuthenticationError) as bad:
        anthropic.Anthropic(base_url=server.url, api_key="nobody", max_retries=0).messages.create(
            model="tiny-chat", max_tokens=4, messages=ASK)
    assert bad.value.status_code == 401 and bad.value.body["type"] == "error"


@pytest.mark.parametrize("method, path, anthropic_header, status", [
    ("GET", "/v1/messages", False, 405),
    ("PUT", "/v1/messages/count_tokens", False, 405),
    ("POST", "/v1/messages/nowhere", False, 404),
    ("GET", "/v1/nowhere", True, 404),  # the SDK's header, off the Messages paths
    ("DELETE", "/v1/models", True, 405),
    ("GET", "/v1/nowhere", False, 404),  # neither: OpenAI's shape alone
])
def test_routing_errors_carry_anthropics_type_as_other_errors_do(server, method, path, anthropic_header, status):
    """No route (404) and a method the route does not take (405) are errors like the others: on
    the Messages API's paths, or with Anthropic's ``anthropic-version`` header, they carry its
    ``"type": "error"`` beside the OpenAI-shaped ``error``."""
    headers = {"x-api-key": server.keys["paid"], **({"anthropic-version": "2023-06-01"} if anthropic_header else {})}
    r = httpx.request(method, f"{server.url}{path}", timeout=30, headers=headers)
    assert r.status_code == status, r.text
    body = r.json()
    anthropic_shaped = anthropic_header or path.startswith("/v1/messages")
    assert set(body) == ({"type", "error"} if anthropic_shaped else {"error"}), body
    assert body.get("type", "error") == "error" and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == {404: "not_found", 405: "method_not_allowed"}[status]
    if status == 405:
        assert method not in r.headers["allow"]


def test_anthropics_models_list_shows_the_chat_models_in_its_shape(server):
    """Anthropic's SDK (its ``anthropic-version`` header) gets the models its Messages API serves,
    as Anthropic's ``model`` objects, paged as its SDK pages them; the OpenAI SDK still gets every
    model in OpenAI's shape. Another model is Anthropic's 404."""
    c = claude(server)
    openai_rows = {m.id: m for m in gpt(server).models.list()}
    assert "tiny-embed" in openai_rows and openai_rows["tiny-embed"].object == "model"
    chats = [name for name, m in openai_rows.items() if m.model_extra.get("kind") == "chat"]
    models = list(c.models.list(limit=1))  # the SDK pages on with after_id
    assert [m.id for m in models] == chats and len(chats) == 3
    m = c.models.retrieve("tiny-chat")
    assert m.type == "model" and m.display_name == "tiny-chat" and m.created_at.year == 1970
    assert m.max_input_tokens == openai_rows["tiny-chat"].model_extra["max_model_len"] and m.max_tokens > 0
    first = c.models.list(limit=2)
    assert [x.id for x in first.data] == chats[:2] and first.has_more and first.last_id == chats[1]
    back = c.models.list(limit=2, before_id=chats[2])
    assert [x.id for x in back.data] == chats[:2] and not back.has_more
    just_before = c.models.list(limit=1, before_id=chats[2])
    assert [x.id for x in just_before.data] == [chats[1]] and just_before.has_more
    for name in ("tiny-embed", "nope"):
        with pytest.raises(anthropic.NotFoundError):
            c.models.retrieve(name)
    with pytest.raises(anthropic.BadRequestError):
        c.models.list(limit=0)
    for limit in ("²", "x", "1001"):  # ("²" is a digit to str.isdigit, not to int)
        r = httpx.get(f"{server.url}/v1/models", params={"limit": limit}, timeout=30,
                      headers={"x-api-key": server.keys["paid"], "anthropic-version": "2023-06-01"})
        assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["param"] == "limit", r.text


def keepalive(server, monkeypatch, seconds: float) -> None:
    """The running server's ``server.keepalive_s`` set to ``seconds`` (its config is frozen: a copy)."""
    config = server.services.config
    monkeypatch.setattr(server.services, "config", config.model_copy(
        update={"server": config.server.model_copy(update={"keepalive_s": seconds})}))


def slowed(server, monkeypatch, model: str, seconds: float) -> None:
    """The running server's engine for ``model`` (loaded: its worker exists) made to wait
    ``seconds`` after each of its events."""
    import asyncio

    worker = server.services.arbiter.workers[model]
    chat = worker.chat

    async def slow(req):
        async for event in chat(req):
            await asyncio.sleep(seconds)
            yield event

    monkeypatch.setattr(worker, "chat", slow)


def test_a_stream_that_waits_sends_keep_alives_both_sdks_skip(server, monkeypatch):
    """``server.keepalive_s``: an event stream idle that long sends a keep-alive, Anthropic's
    ``ping`` event on /v1/messages and an SSE comment on chat, and both SDKs read the same reply
    as without them. (The engine slowed to one event per 0.3 s, keep-alives every 0.1 s; none at 0.)"""
    kw = dict(model="tiny-chat", max_tokens=4, messages=ASK)
    quick = claude(server).messages.create(**kw, extra_body=GREEDY)  # (loads the model: its worker exists)
    quick_chat = gpt(server).chat.completions.create(**kw, temperature=0)
    slowed(server, monkeypatch, "tiny-chat", 0.3)
    keepalive(server, monkeypatch, 0.1)
    headers = {"x-api-key": server.keys["paid"]}
    with httpx.stream("POST", f"{server.url}/v1/messages", json={**kw, "stream": True, **GREEDY}, headers=headers,
                      timeout=60) as r:
        lines = list(r.iter_lines())
    assert lines.count("event: ping") >= 3 and 'data: {"type": "ping"}' in lines
    with claude(server).messages.stream(**kw, extra_body=GREEDY) as stream:
        assert [b.text for b in stream.get_final_message().content] == [b.text for b in quick.content]
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json={**kw, "stream": True, "temperature": 0},
                      headers={"Authorization": f"Bearer {server.keys['paid']}"}, timeout=60) as r:
        assert [ln for ln in r.iter_lines() if ln.startswith(":")].count(": keep-alive") >= 3
    text = "".join(c.choices[0].delta.content or "" for c in gpt(server).chat.completions.create(
        **kw, temperature=0, stream=True) if c.choices)
    assert text == quick_chat.choices[0].message.content
    keepalive(server, monkeypatch, 0)
    with httpx.stream("POST", f"{server.url}/v1/messages", json={**kw, "stream": True, **GREEDY}, headers=headers,
                      timeout=60) as r:
        assert "event: ping" not in list(r.iter_lines())


def test_a_tool_results_images_follow_it_as_a_user_message(server):
    """A ``tool_result`` holding images (a screenshot a tool took) becomes the tool message with
    its text and, after it, a user message with its images, as vLLM turns it: counted as the same
    result written as text with the image block beside it, the image's tokens included; refused
    on a model that does not read images."""
    from tests.test_vision import data_url, picture

    c = claude(server)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data_url(picture(2)).split(",", 1)[1]}}
    call = {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "oslo", "celsius": True}}

    def turns(*result) -> list[dict]:
        return ASK + [{"role": "assistant", "content": [call]}, {"role": "user", "content": list(result)}]

    text = {"type": "text", "text": "the sky, as a picture"}
    inside = turns({"type": "tool_result", "tool_use_id": "call_1", "content": [text, image]})
    beside = turns({"type": "tool_result", "tool_use_id": "call_1", "content": [text]}, image)
    alone = turns({"type": "tool_result", "tool_use_id": "call_1", "content": [text]})
    counted = c.messages.count_tokens(model="tiny-vlm", messages=inside).input_tokens
    assert counted == c.messages.count_tokens(model="tiny-vlm", messages=beside).input_tokens
    assert counted > c.messages.count_tokens(model="tiny-vlm", messages=alone).input_tokens + 1
    assert c.messages.create(model="tiny-vlm", max_tokens=2, messages=inside).usage.input_tokens == counted
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model="tiny-chat", max_tokens=2, messages=inside)
