"""Compaction (``POST /v1/responses/compact``): a conversation's window becomes its user messages
and one ``compaction`` item, which a later response reads as the summary the model wrote. Checked
through the openai SDK: the summary is the model's greedy answer to the same window with the
compaction request's ask after it (as a chat completion), the compacted window continues as a
response whose prompt holds that summary, and bad input is a 400 naming it."""

from __future__ import annotations

import base64
import json
from typing import Literal

import openai
import pytest

from gateway.responses import COMPACTED
from gateway.responses_api import COMPACT_ASK
from tests.helpers import start_server, write_config

TURNS = [{"role": "user", "content": "Where is the gold?"},
         {"role": "assistant", "content": "Under the palm tree."},
         {"role": "user", "content": "And the map?"}]


@pytest.fixture(scope="module")
def server(tiny_chat, tmp_path_factory):
    running = start_server(write_config(tmp_path_factory.mktemp("compaction"), {"tiny-chat": ("chat", tiny_chat)},
                                        "limits:\n  max_chat_tokens: 24\n"))
    yield running
    running.stop()


def client(server, tier="paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, timeout=120)


def summary_of(item) -> str:
    return json.loads(base64.urlsafe_b64decode(item.encrypted_content))["summary"]


def test_a_window_compacts_to_its_user_messages_and_a_summary(server):
    c = client(server)
    compacted = c.responses.compact(model="tiny-chat", input=TURNS)
    assert compacted.object == "response.compaction"
    *users, last = compacted.output
    assert [(u.type, u.role, u.content[0].text) for u in users] == \
        [("message", "user", "Where is the gold?"), ("message", "user", "And the map?")]
    assert last.type == "compaction" and last.id.startswith("cmp_")
    # the summary is the model's own greedy answer to the window with the ask after it
    asked = c.chat.completions.create(model="tiny-chat", temperature=0, max_tokens=24,
                                      messages=TURNS + [{"role": "user", "content": COMPACT_ASK}])
    assert summary_of(last) == asked.choices[0].message.content.strip()
    assert (compacted.usage.input_tokens, compacted.usage.output_tokens) == \
        (asked.usage.prompt_tokens, asked.usage.completion_tokens)
    # the compacted window goes on as a response's input: the compaction item reads as that summary
    later = [*[u.model_dump(exclude_none=True, warnings=False) for u in users], last.model_dump(exclude_none=True, warnings=False),
             {"role": "user", "content": "Thanks."}]
    went_on = c.responses.create(model="tiny-chat", input=later, max_output_tokens=4, temperature=0)
    written = c.responses.create(model="tiny-chat", max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Where is the gold?"}, {"role": "user", "content": "And the map?"},
        {"role": "system", "content": COMPACTED + summary_of(last)}, {"role": "user", "content": "Thanks."}])
    assert (went_on.output_text, went_on.usage.input_tokens) == (written.output_text, written.usage.input_tokens)
    # and its input items list the compaction item as it was sent
    assert [i.type for i in c.responses.input_items.list(went_on.id, order="asc").data][-2:] == ["compaction", "message"]


def test_a_stored_response_chain_compacts_by_its_id(server):
    c = client(server)
    first = c.responses.create(model="tiny-chat", input="Where is the gold?", max_output_tokens=4, temperature=0)
    second = c.responses.create(model="tiny-chat", previous_response_id=first.id, input="And the map?",
                                max_output_tokens=4, temperature=0)
    compacted = c.responses.compact(model="tiny-chat", previous_response_id=second.id)
    *users, last = compacted.output
    assert [u.content[0].text for u in users] == ["Where is the gold?", "And the map?"]
    assert last.type == "compaction" and summary_of(last) is not None
    # compacting a window that holds a compaction item compacts the summary with the rest
    again = c.responses.compact(model="tiny-chat", input=[*[u.model_dump(exclude_none=True, warnings=False) for u in users],
                                                          last.model_dump(exclude_none=True, warnings=False),
                                                          {"role": "user", "content": "Thanks."}])
    assert [o.type for o in again.output] == ["message", "message", "message", "compaction"]


def test_the_summary_gets_the_room_the_context_leaves(server, monkeypatch):
    """With ``limits.max_chat_tokens`` past the model's context (a model whose context is under
    the limit), a window that fits compacts: the summary has at most what the context leaves
    after the window, as a chat asking for just that room. A window past the context is a 400
    naming ``input``."""
    config = server.services.config
    context = next(m for m in client(server).models.list() if m.id == "tiny-chat").model_extra["max_model_len"]
    monkeypatch.setattr(server.services, "config", config.model_copy(
        update={"limits": config.limits.model_copy(update={"max_chat_tokens": context + 100})}))
    c = client(server)
    compacted = c.responses.compact(model="tiny-chat", input=TURNS)
    room = context - compacted.usage.input_tokens
    assert 0 < compacted.usage.output_tokens <= room
    asked = c.chat.completions.create(model="tiny-chat", temperature=0, max_tokens=room,
                                      messages=TURNS + [{"role": "user", "content": COMPACT_ASK}])
    assert summary_of(compacted.output[-1]) == asked.choices[0].message.content.strip()
    assert (compacted.usage.input_tokens, compacted.usage.output_tokens) == \
        (asked.usage.prompt_tokens, asked.usage.completion_tokens)
    with pytest.raises(openai.BadRequestError) as caught:
        c.responses.compact(model="tiny-chat", input=[{"role": "user", "content": "gold " * context}])
    assert (caught.value.body["param"], caught.value.body["code"]) == ("input", "context_length_exceeded")


def test_what_cannot_be_compacted_is_a_400_or_404(server):
    c = client(server)
    for kw, status, param in [
        ({}, 400, "input"),
        ({"previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        ({"input": [{"type": "compaction", "encrypted_content": "not ours"}]}, 400, "input[0].encrypted_content"),
        ({"input": [{"type": "compaction", "encrypted_content": base64.urlsafe_b64encode(b'{"v": 2}').decode()}]},
         400, "input[0].encrypted_content"),
        ({"input": TURNS, "tools": []}, 400, "tools"),
    ]:
        with pytest.raises(openai.APIStatusError) as caught:
            c.post("/responses/compact", body={"model": "tiny-chat", **kw}, cast_to=object)
        assert (caught.value.status_code, caught.value.body["param"]) == (status, param), kw
    with pytest.raises(openai.NotFoundError):
        c.responses.compact(model="nope", input=TURNS)
    # another key's response is not found either
    mine = c.responses.create(model="tiny-chat", input="hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client(server, "free").responses.compact(model="tiny-chat", previous_response_id=mine.id)


def test_the_agents_sdk_compaction_session_compacts_through_the_server(tiny_chat, tmp_path):
    """The OpenAI Agents SDK's ``OpenAIResponsesCompactionSession`` (which takes only OpenAI model
    names: tiny-chat is served under the alias gpt-4.1) compacts a session's history after a turn
    through this server, and the next turn runs on the compacted history."""
    pytest.importorskip("agents")
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, SQLiteSession, set_tracing_disabled
    from agents.memory import OpenAIResponsesCompactionSession
    from pydantic import BaseModel

    class Place(BaseModel):  # an output type of bounded values: the reply ends where its JSON does (a random
        where: Literal["palm", "cave", "ship"]  # model's free text may not end within max_tokens)
        sure: bool

    set_tracing_disabled(True)  # the SDK would otherwise send traces to api.openai.com
    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, "limits:\n  max_chat_tokens: 64\n")
    entry = f"  - name: tiny-chat\n    kind: chat\n    path: {tiny_chat}\n"
    config.write_text(config.read_text().replace(entry, entry + "    aliases: [gpt-4.1]\n"))
    server = start_server(config)
    try:
        async def run() -> tuple[list, list]:
            c = openai.AsyncOpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0, timeout=120)
            session = OpenAIResponsesCompactionSession("s", SQLiteSession("s", str(tmp_path / "s.db")), client=c,
                                                       model="gpt-4.1", should_trigger_compaction=lambda ctx: True)
            agent = Agent(name="pirate", instructions="Answer briefly.", model=OpenAIResponsesModel("gpt-4.1", c),
                          output_type=Place, model_settings=ModelSettings(max_tokens=64, temperature=0))
            await Runner.run(agent, "Where is the gold?", session=session)
            first = await session.get_items()
            await Runner.run(agent, "And the map?", session=session)
            return first, await session.get_items()

        first, later = asyncio.run(run())
        assert [i.get("type", "message") for i in first] == ["message", "compaction"]
        assert first[0]["content"] in ("Where is the gold?", [{"type": "input_text", "text": "Where is the gold?"}])
        assert summary_of(openai.types.responses.ResponseCompactionItem(**first[1])) is not None
        texts = [json.dumps(i) for i in later]
        assert "Where is the gold?" in texts[0] and "And the map?" in "".join(texts) and later[-1]["type"] == "compaction"
    finally:
        server.stop()
