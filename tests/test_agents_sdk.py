"""The OpenAI Agents SDK (``openai-agents``) against a real server on tiny-chat (random weights),
through both of its model classes: ``OpenAIResponsesModel`` (the Responses API, its default) and
``OpenAIChatCompletionsModel``. What an agent needs of the server: function tools called with
valid arguments and their outputs read back, an ``output_type`` answered in its schema (beside
the tools), handoffs, streamed runs, the server keeping the conversation
(``previous_response_id``, ``conversation_id``), the hosted ``FileSearchTool``, and a clear 400 for
a hosted tool that is not served. Chat runs on the transformers engine here; both engines'
grammars (tools beside a response format) are tested in ``test_chat_api``. The SDK's voice
pipeline runs speech to text, the agent and text to speech on one server, its streamed input
through ``/v1/realtime``.

A random model may call tools for ever when it may choose; where a test needs the run to end,
a run hook (the SDK's own extension point) turns tools off after the first call, so the next
turn answers (``reset_tool_choice=False``, or the SDK would set ``tool_choice`` back to auto).
Each test makes its clients inside one event loop (``asyncio.run``): an ``AsyncOpenAI`` client's
connections belong to the loop that opened them."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

agents = pytest.importorskip("agents")
from agents import (Agent, FileSearchTool, ModelSettings, OpenAIChatCompletionsModel,  # noqa: E402
                    OpenAIResponsesModel, RunHooks, Runner, WebSearchTool, function_tool, set_tracing_disabled)

from tests.helpers import start_server, write_config  # noqa: E402

set_tracing_disabled(True)  # the SDK would otherwise send traces to api.openai.com

MODELS = ["responses", "chat_completions"]


class Answer(BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool


@pytest.fixture(scope="module")
def server(tiny_chat, tiny_embed, tiny_stt, tiny_tts, tmp_path_factory):
    folder = tmp_path_factory.mktemp("agents")
    models = {"tiny-chat": ("chat", tiny_chat), "tiny-embed": ("embed", tiny_embed), "tiny-stt": ("stt", tiny_stt),
              "tiny-tts": ("tts", tiny_tts)}
    s = start_server(write_config(folder, models, "limits:\n  max_chat_tokens: 256\n"))
    yield s
    s.stop()


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0, timeout=120)


def model(server, api: str):
    c = client(server)
    return OpenAIResponsesModel("tiny-chat", c) if api == "responses" else OpenAIChatCompletionsModel("tiny-chat", c)


class AnswerAfterOneCall(RunHooks):
    """After the first tool call, the agent's tools are off (``tool_choice: "none"``): the next
    turn is its answer in ``output_type``."""

    async def on_tool_end(self, context, agent, tool, result) -> None:
        agent.model_settings = agent.model_settings.resolve(ModelSettings(tool_choice="none"))


def weather_tool(calls: list[str]):
    @function_tool
    def get_weather(city: Literal["paris", "oslo", "lima"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"WEATHER-REPORT: sunny in {city}"

    return get_weather


@pytest.mark.parametrize("api", MODELS)
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_an_agent_calls_its_tool_reads_the_output_and_answers_in_its_output_type(server, api, streamed):
    calls: list[str] = []
    agent = Agent(name="weather", instructions="Look the weather up, then answer.", model=model(server, api),
                  tools=[weather_tool(calls)], output_type=Answer, reset_tool_choice=False,
                  model_settings=ModelSettings(max_tokens=96, tool_choice="required", parallel_tool_calls=False))

    chain = api == "responses" and not streamed  # each turn sends only what is new, after the one before

    async def run():
        if not streamed:
            result, events = await Runner.run(agent, "Weather in Oslo?", hooks=AnswerAfterOneCall(), max_turns=4,
                                              auto_previous_response_id=chain), []
        else:
            result = Runner.run_streamed(agent, "Weather in Oslo?", hooks=AnswerAfterOneCall(), max_turns=4)
            events = [e async for e in result.stream_events()]
        items, last = [], None
        if api == "responses":
            c = client(server)
            items = [i async for i in c.responses.input_items.list(result.last_response_id, order="asc")]
            last = await c.responses.retrieve(result.last_response_id)
        return result, events, items, last

    result, events, items, last = asyncio.run(run())
    assert isinstance(result.final_output, Answer)
    assert calls and calls[0] in ("paris", "oslo", "lima")
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert result.new_items[1].output == f"WEATHER-REPORT: sunny in {calls[0]}"
    if streamed:
        names = [e.name for e in events if e.type == "run_item_stream_event"]
        assert names == ["tool_called", "tool_output", "message_output_created"], names
        assert any(e.type == "raw_response_event" for e in events)  # the text arrived as it was made
    if api == "responses":  # the server read the tool's output as the second turn's input
        # chained or sent whole, the same conversation (input_items lists a chain's earlier turns too)
        assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
        assert items[-1].output == result.new_items[1].output
        assert (last.previous_response_id is not None) == chain
        assert last.usage.input_tokens > 0


@pytest.mark.parametrize("api", MODELS)
def test_a_handoff_passes_the_conversation_to_the_other_agent(server, api):
    m = model(server, api)
    specialist = Agent(name="colors", handoff_description="Knows colors", instructions="Pick a color.", model=m,
                       output_type=Answer, model_settings=ModelSettings(max_tokens=64))
    triage = Agent(name="triage", instructions="Hand the question off.", model=m, handoffs=[specialist],
                   model_settings=ModelSettings(max_tokens=64, tool_choice="required", parallel_tool_calls=False))
    result = asyncio.run(Runner.run(triage, "Which color?", max_turns=4))
    assert result.last_agent is specialist
    assert isinstance(result.final_output, Answer)
    assert [item.type for item in result.new_items] == ["handoff_call_item", "handoff_output_item", "message_output_item"]


def test_the_server_keeps_the_conversation_by_response_id_and_by_conversation(server):
    """``previous_response_id`` sends only the new turn; the server adds the earlier ones.
    ``conversation_id`` keeps every turn in a conversation. (``auto_previous_response_id``, which
    chains the turns of one run, is in the tool test.)"""
    async def run():
        c = client(server)
        agent = Agent(name="a", instructions="Pick.", model=OpenAIResponsesModel("tiny-chat", c), output_type=Answer,
                      model_settings=ModelSettings(max_tokens=64))
        first = await Runner.run(agent, "FIRST-QUESTION?")
        second = await Runner.run(agent, "SECOND-QUESTION?", previous_response_id=first.last_response_id)
        chained = [await c.responses.retrieve(r.last_response_id) for r in (first, second)]
        conversation = await c.conversations.create()
        await Runner.run(agent, "FIRST-QUESTION?", conversation_id=conversation.id)
        await Runner.run(agent, "SECOND-QUESTION?", conversation_id=conversation.id)
        return chained, [i async for i in c.conversations.items.list(conversation.id, order="asc")]

    (first, second), items = asyncio.run(run())
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn was in the second prompt
    said = [part.text for i in items if i.type == "message" and i.role == "user" for part in i.content]
    assert said == ["FIRST-QUESTION?", "SECOND-QUESTION?"]
    assert sum(i.type == "message" and i.role == "assistant" for i in items) == 2


def test_an_openai_conversations_session_keeps_the_turns_on_the_server(server):
    """The SDK's ``OpenAIConversationsSession``: the session's items live in a conversation of the
    Conversations API here (created, added to, read back, an item popped, deleted), so the second
    run's prompt holds the first turn. (Through the Responses model: SDK 0.24 strips the ids of
    the assistant messages it reads back, which its own Chat Completions converter then refuses,
    whatever the server.)"""
    from agents import OpenAIConversationsSession

    async def run():
        c = client(server)
        agent = Agent(name="a", instructions="Pick.", model=OpenAIResponsesModel("tiny-chat", c), output_type=Answer,
                      model_settings=ModelSettings(max_tokens=64))
        session = OpenAIConversationsSession(openai_client=c)
        first = await Runner.run(agent, "FIRST-QUESTION?", session=session)
        second = await Runner.run(agent, "SECOND-QUESTION?", session=session)
        conversation = await session._get_session_id()
        items = [i async for i in c.conversations.items.list(conversation, order="asc")]
        popped = await session.pop_item()
        left = await session.get_items()
        await session.clear_session()
        with pytest.raises(openai.NotFoundError):
            await c.conversations.retrieve(conversation)
        return first, second, items, popped, left

    first, second, items, popped, left = asyncio.run(run())
    assert isinstance(first.final_output, Answer) and isinstance(second.final_output, Answer)
    said = [part.text for i in items if i.type == "message" and i.role == "user" for part in i.content]
    assert said == ["FIRST-QUESTION?", "SECOND-QUESTION?"]
    assert [i.type == "message" and i.role for i in items] == ["user", "assistant", "user", "assistant"]
    assert popped["role"] == "assistant" and len(left) == 3
    assert second.context_wrapper.usage.input_tokens > first.context_wrapper.usage.input_tokens  # the first turn, read


def test_the_hosted_file_search_tool_searches_the_callers_vector_store(server):
    c = client(server)

    async def run():
        f = await c.files.create(file=("eviction.txt", b"The arbiter evicts the model a lower tier used last."),
                                 purpose="assistants")
        store = await c.vector_stores.create(name="docs", file_ids=[f.id])
        for _ in range(300):
            store = await c.vector_stores.retrieve(store.id)
            if store.status == "completed":
                break
            await asyncio.sleep(0.2)
        agent = Agent(name="docs", instructions="Answer from the files.", model=OpenAIResponsesModel("tiny-chat", c),
                      tools=[FileSearchTool(vector_store_ids=[store.id], include_search_results=True)],
                      output_type=Answer, model_settings=ModelSettings(max_tokens=64))
        return f, await Runner.run(agent, "How are models evicted?")

    f, result = asyncio.run(run())
    search = result.new_items[0]
    assert search.type == "tool_call_item" and search.raw_item.type == "file_search_call"
    assert search.raw_item.queries == ["How are models evicted?"]
    assert [r.file_id for r in search.raw_item.results] == [f.id]
    assert isinstance(result.final_output, Answer)


def test_a_hosted_tool_that_is_not_served_is_a_400_naming_it(server):
    async def run():
        agent = Agent(name="web", instructions="Search.", model=model(server, "responses"), tools=[WebSearchTool()])
        return await Runner.run(agent, "News?")

    with pytest.raises(openai.BadRequestError) as err:
        asyncio.run(run())
    assert err.value.body["param"] == "tools[0].type" and "'web_search'" in err.value.body["message"]


@pytest.mark.parametrize("streamed", [False, True], ids=["AudioInput", "StreamedAudioInput"])
def test_the_voice_pipeline_hears_answers_and_speaks_through_one_server(server, streamed):
    """The SDK's ``VoicePipeline``: speech (espeak-ng's) to tiny-stt, its text to the agent on
    tiny-chat, the agent's text to tiny-tts, back as PCM16 at 24 kHz. Whole audio goes to
    ``/v1/audio/transcriptions``; streamed audio to a ``/v1/realtime`` transcription session that
    ends the turn at the silence after it (``server_vad``). The settings the README gives: no TTS
    ``instructions`` (the demo voice cannot follow directions) and ``server_vad`` (the SDK's default
    ``semantic_vad`` is served, but tiny-chat's random weights doubt every turn's end: it would
    wait 4 s)."""
    import httpx
    import numpy as np
    from agents.voice import (AudioInput, OpenAIVoiceModelProvider, SingleAgentVoiceWorkflow, StreamedAudioInput,
                              STTModelSettings, TTSModelSettings, VoicePipeline, VoicePipelineConfig)

    from tests.helpers import spoken

    sent: list[tuple[str, bytes]] = []

    async def record(request: httpx.Request) -> None:
        sent.append((request.url.path, request.content if request.url.path != "/v1/audio/transcriptions" else b""))

    async def run():
        c = openai.AsyncOpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0,
                               http_client=httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120))
        # greedy: a sampled reply may end at once (EOS first) or in bytes that make no character:
        # no text, so nothing is spoken
        agent = Agent(name="voice", instructions="Answer briefly.", model=OpenAIChatCompletionsModel("tiny-chat", c),
                      model_settings=ModelSettings(max_tokens=16, temperature=0))
        config = VoicePipelineConfig(model_provider=OpenAIVoiceModelProvider(openai_client=c),
                                     stt_settings=STTModelSettings(turn_detection={"type": "server_vad"}),
                                     tts_settings=TTSModelSettings(instructions=""))
        pipeline = VoicePipeline(workflow=SingleAgentVoiceWorkflow(agent), stt_model="tiny-stt", tts_model="tiny-tts",
                                 config=config)
        speech = (spoken("what is the weather in oslo", rate=24000) * 32767).astype(np.int16)
        if not streamed:
            result = await pipeline.run(AudioInput(buffer=speech, frame_rate=24000))
        else:
            audio_in = StreamedAudioInput()
            result = await pipeline.run(audio_in)
            for i in range(0, len(speech), 2400):  # 100 ms at a time, then a second of silence
                await audio_in.add_audio(speech[i:i + 2400])
            await audio_in.add_audio(np.zeros(24000, dtype=np.int16))
        events = []
        async for event in result.stream():
            events.append(event)
            if streamed and event.type == "voice_stream_event_lifecycle" and event.event == "turn_ended":
                break
        return events

    events = asyncio.run(asyncio.wait_for(run(), 120))
    lifecycle = [e.event for e in events if e.type == "voice_stream_event_lifecycle"]
    assert lifecycle[:1] == ["turn_started"] and "turn_ended" in lifecycle, lifecycle
    audio = [e.data for e in events if e.type == "voice_stream_event_audio" and e.data is not None]
    assert audio and all(a.dtype == np.int16 for a in audio) and sum(len(a) for a in audio) > 2400
    paths = [path for path, _ in sent]
    assert paths[0] == ("/v1/chat/completions" if streamed else "/v1/audio/transcriptions"), paths
    assert "/v1/chat/completions" in paths and paths[-1] == "/v1/audio/speech", paths
    chat = json.loads(next(body for path, body in sent if path == "/v1/chat/completions"))
    assert chat["messages"][-1]["role"] == "user" and chat["messages"][-1]["content"].strip()  # the transcript
