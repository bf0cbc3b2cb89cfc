"""The Realtime API's conversation sessions (gateway/realtime_conversation.py) through the openai
SDK's realtime client: a voice agent as a cascade of the server's models. Each turn is checked
against the endpoints it is made of: the user's speech against /v1/audio/transcriptions of the
same audio, the reply against a greedy chat completion over the same conversation, and its speech
against /v1/audio/speech of the reply (its length: the demo VITS' durations are deterministic).
Speech from Debian's espeak-ng (``tests.helpers.spoken``)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Literal

import numpy as np
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.helpers import RunningServer, declare_vram, spoken, start_server, write_config
from tests.test_realtime import RATE, b64, events_until, wav_of

ASK = "Where is the gold?"
MANUAL = {"type": "realtime", "instructions": "Answer briefly.", "max_output_tokens": 12,
          "audio": {"input": {"turn_detection": None}}}
ANSWERED = ("completed", "incomplete")  # a whole reply, or one max_output_tokens cut (the random models seldom stop)


@pytest.fixture(scope="module")
def server(tiny_stt, tiny_chat, tiny_tts, tmp_path_factory) -> RunningServer:
    folder = tmp_path_factory.mktemp("realtime-conversation")
    running = start_server(write_config(folder, {"tiny-chat": ("chat", tiny_chat), "tiny-stt": ("stt", tiny_stt),
                                                 "tiny-tts": ("tts", tiny_tts)}))
    yield running
    running.stop()


def client(server: RunningServer, tier: str = "paid") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0)


def http(server: RunningServer) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0)


def answer(server: RunningServer, messages: list[dict]) -> tuple[str, int]:
    """The reply a greedy chat completion gives the same conversation, and its tokens."""
    r = http(server).chat.completions.create(model="tiny-chat", temperature=0, max_tokens=12,
                                             messages=[{"role": "system", "content": "Answer briefly."}, *messages])
    return r.choices[0].message.content, r.usage.completion_tokens


def speech_seconds(server: RunningServer, text: str) -> float:
    import io

    import soundfile as sf

    x, rate = sf.read(io.BytesIO(http(server).audio.speech.create(model="tiny-tts", voice="alloy", input=text,
                                                                response_format="wav").content))
    return len(x) / rate


def said(events) -> tuple[str, bytes]:
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    return transcript, audio


async def begin(conn, session: dict, text: str | None = ASK) -> None:
    """A conversation's opening: the session made, updated with ``session``, and (unless None) the
    user's ``text`` as its first item."""
    await events_until(conn, "session.created")
    await conn.session.update(session=session)
    await events_until(conn, "session.updated")
    if text is not None:
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": text}]})


def test_a_text_turn_is_answered_in_speech_with_its_transcript(server):
    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            created = await events_until(conn, "session.created")
            await conn.session.update(session=MANUAL)
            updated = await events_until(conn, "session.updated")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": ASK}]})
            await conn.response.create()
            return created[-1], updated[-1], await events_until(conn, "response.done")

    created, updated, events = asyncio.run(run())
    assert created.session.type == "realtime" and created.session.model == "tiny-chat"
    assert updated.session.instructions == "Answer briefly." and updated.session.audio.input.turn_detection is None
    kinds = [e.type for e in events]
    order = ["conversation.item.added", "conversation.item.done", "response.created", "response.output_item.added",
             "conversation.item.added", "response.content_part.added", "response.output_audio_transcript.delta",
             "response.output_audio.delta", "response.output_audio.done", "response.output_audio_transcript.done",
             "response.content_part.done", "response.output_item.done", "conversation.item.done", "response.done"]
    assert [k for k in dict.fromkeys(kinds)] == list(dict.fromkeys(order))  # each kind first where the protocol has it
    transcript, audio = said(events)
    expected, tokens = answer(server, [{"role": "user", "content": ASK}])
    assert transcript == expected == next(e for e in events if e.type == "response.output_audio_transcript.done").transcript
    assert len(audio) % 2 == 0 and abs(len(audio) / 2 / 24000 - speech_seconds(server, expected)) < 0.1
    done = events[-1].response
    assert done.status == ("completed" if tokens < 12 else "incomplete") and done.usage.output_tokens == tokens
    assert done.output[0].content[0].transcript == expected


def test_speech_in_is_heard_then_answered(server):
    speech = spoken("Where is the gold hidden?", rate=RATE)
    heard = http(server).audio.transcriptions.create(model="tiny-stt", file=("a.wav", wav_of(speech))).text

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await events_until(conn, "session.created")
            await conn.session.update(session=MANUAL)
            await events_until(conn, "session.updated")
            await conn.input_audio_buffer.append(audio=b64(speech))
            await conn.input_audio_buffer.commit()
            await conn.response.create()  # it waits for the turn's transcript
            return await events_until(conn, "response.done")

    events = asyncio.run(run())
    user = next(e.item for e in events if e.type == "conversation.item.done" and e.item.role == "user")
    assert user.content[0].transcript == heard
    transcript, audio = said(events)
    assert transcript == answer(server, [{"role": "user", "content": heard}])[0] and audio
    kinds = [e.type for e in events]
    assert kinds.index("conversation.item.input_audio_transcription.completed") < kinds.index("response.output_item.added")


@pytest.mark.parametrize("detection", [None, {"type": "semantic_vad", "eagerness": "high"}], ids=["server_vad", "semantic_vad"])
def test_the_turn_detection_answers_when_a_turn_ends_and_the_conversation_goes_on(server, detection):
    """A spoken turn ended by the turn detection is answered (create_response). With
    ``semantic_vad`` (``high``: 2 s at most) the judge is the session's own chat model, tiny-chat,
    whose doubt waits about the longest: 2.5 s of silence ends the turn. The ``server_vad`` case
    hears its audio through ``noise_reduction`` (``far_field``), which the session shows."""
    speech = spoken("Tell me about the sea.", rate=RATE)
    silence = np.zeros(RATE if detection is None else int(2.5 * RATE), np.float32)
    settings = {"audio": {"input": {"noise_reduction": {"type": "far_field"}} if detection is None else
                          {"turn_detection": detection}}}

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await events_until(conn, "session.created")  # server_vad and create_response: the defaults
            await conn.session.update(session={"type": "realtime", "instructions": "Answer briefly.",
                                               "max_output_tokens": 12, **settings})
            updated = (await events_until(conn, "session.updated"))[-1]
            assert updated.session.audio.input.turn_detection.type == (detection or {"type": "server_vad"})["type"]
            assert updated.session.audio.input.turn_detection.create_response is True
            noise = updated.session.audio.input.noise_reduction
            assert (noise.type if noise else None) == ("far_field" if detection is None else None)
            await conn.input_audio_buffer.append(audio=b64(np.concatenate([speech, silence])))
            first = await events_until(conn, "response.done")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "And then?"}]})
            await conn.response.create()
            return first, await events_until(conn, "response.done")

    first, second = asyncio.run(run())
    kinds = [e.type for e in first]
    assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index("input_audio_buffer.committed") < \
        kinds.index("response.created")
    heard = next(e.transcript for e in first if e.type == "conversation.item.input_audio_transcription.completed")
    reply = said(first)[0]
    # the second turn reads the whole conversation: the heard turn, the spoken reply, the typed turn
    assert said(second)[0] == answer(server, [{"role": "user", "content": heard}, {"role": "assistant", "content": reply},
                                              {"role": "user", "content": "And then?"}])[0]


def test_text_output_cancel_and_refusals_leave_the_session_open(server):
    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "output_modalities": ["text"]})
            await conn.response.create()
            text = await events_until(conn, "response.done")
            refusals = []
            for event in [{"type": "conversation.item.create", "item": {"type": "function_call", "call_id": "c",
                                                                         "name": "f", "arguments": "{}"}},
                          {"type": "conversation.item.create", "item": {"type": "function_call_output",
                                                                         "call_id": "c", "output": "x"}},
                          {"type": "session.update", "session": {"type": "realtime", "tools": [{"type": "web_search"}]}},
                          {"type": "session.update", "session": {"type": "realtime", "tools": [
                              {"type": "function", "name": "f", "parameters": {"type": "object"}}],
                              "tool_choice": {"type": "function", "name": "g"}}},
                          {"type": "session.update", "session": {"type": "realtime",
                                                                 "audio": {"output": {"voice": "nobody"}}}},
                          {"type": "response.cancel"}, {"type": "bogus.event"}]:
                await conn.send(event)
                refusals.append((await events_until(conn, "error"))[-1].error)
            await conn.send({"type": "response.create", "response": {"max_output_tokens": 12}})
            await conn.send({"type": "response.create"})
            busy = (await events_until(conn, "error"))[-1].error
            await conn.send({"type": "response.cancel"})
            cancelled = await events_until(conn, "response.done")
            return text, refusals, busy, cancelled

    text, refusals, busy, cancelled = asyncio.run(run())
    written = "".join(e.delta for e in text if e.type == "response.output_text.delta")
    assert written == answer(server, [{"role": "user", "content": ASK}])[0]
    assert not any(e.type.startswith("response.output_audio") for e in text)
    assert [(r.param, r.code) for r in refusals] == [
        ("item.type", "unsupported_item_type"), ("item.call_id", "invalid_value"),
        ("session.tools[0].type", "invalid_value"), ("session.tool_choice", "invalid_value"),
        ("session.audio.output.voice", "invalid_value"), (None, "response_cancel_not_active"),
        ("type", "invalid_event")]
    assert "'bogus.event' on a conversation session" in refusals[-1].message
    assert busy.code == "conversation_already_has_active_response"
    assert cancelled[-1].response.status in ("cancelled", *ANSWERED)  # it may have ended before the cancel


def test_the_user_speaking_interrupts_the_reply_and_the_conversation_keeps_what_was_written(server):
    """server_vad with interrupt_response (the default): speech that starts while a reply is being
    written or said cancels it (``reason: "turn_detected"``, as OpenAI's, with the usage metered
    so far); the conversation goes on with the words it had written."""
    speech = spoken("Stop, and listen to me.", rate=RATE)

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {"type": "realtime", "instructions": "Answer briefly.", "audio": {
                "input": {"turn_detection": {"type": "server_vad", "create_response": False}}}})
            await conn.response.create()  # as long as the server's limit allows
            await events_until(conn, "response.output_audio_transcript.delta")
            await conn.input_audio_buffer.append(audio=b64(speech))
            return await events_until(conn, "response.done")

    events = asyncio.run(run())
    kinds = [e.type for e in events]
    assert "input_audio_buffer.speech_started" in kinds
    done = events[-1].response
    assert done.status == "cancelled" and done.status_details.reason == "turn_detected"  # (not the client's cancel)
    assert done.output[0].status == "incomplete" and done.usage.output_tokens > 0


async def sdk_session(server: RunningServer, agent, **settings):
    """The Agents SDK's ``RealtimeRunner`` session for ``agent`` on this server's conversation
    session, with the model settings it needs here (its defaults name OpenAI's models, and its
    ``semantic_vad`` would wait seconds on tiny-chat's doubtful judgement); ``settings`` override
    them, and a setting given as None is left to the SDK's default."""
    from agents.realtime import RealtimeRunner

    settings = {"model_name": "tiny-chat", "voice": "alloy", "input_audio_transcription": {"model": "tiny-stt"},
                "turn_detection": {"type": "server_vad"}, "max_output_tokens": 12, **settings}
    runner = RealtimeRunner(agent, config={"model_settings": {k: v for k, v in settings.items() if v is not None}})
    return await runner.run(model_config={"url": server.url.replace("http", "ws") + "/v1/realtime?model=tiny-chat",
                                          "api_key": server.keys["paid"]})


def test_the_agents_sdk_realtime_runner_talks_to_the_session(server):
    """The OpenAI Agents SDK's ``RealtimeRunner`` (its realtime voice agents) on this server, with
    the SDK's own turn detection (``semantic_vad``, judged by the session's chat model): a typed
    message in, the agent's spoken reply out, and the session's history holding both."""
    pytest.importorskip("agents")
    from agents import set_tracing_disabled
    from agents.realtime import RealtimeAgent

    set_tracing_disabled(True)  # the SDK would otherwise send traces to api.openai.com

    async def run():
        agent = RealtimeAgent(name="pirate", instructions="Answer briefly.")
        session = await sdk_session(server, agent, turn_detection=None)
        kinds, audio = [], 0
        async with session:
            await session.send_message(ASK)
            async with asyncio.timeout(60):
                async for event in session:
                    kinds.append(event.type)
                    if event.type == "audio":
                        audio += len(event.audio.data)
                    if event.type in ("agent_end", "error"):
                        break
            return kinds, audio, list(session._history), session._model._created_session

    kinds, audio, history, created = asyncio.run(run())
    assert created.audio.input.turn_detection.type == "semantic_vad"  # the SDK's default, as the server took it
    assert "error" not in kinds and kinds[-1] == "agent_end" and audio > 0
    user, reply = history[-2], history[-1]
    assert user.role == "user" and user.content[0].text == ASK
    expected = answer(server, [{"role": "user", "content": ASK}])[0]
    assert reply.role == "assistant" and reply.content[0].transcript == expected


def speech_requests(server: RunningServer) -> float:
    """The paid tier's speech requests so far, from /metrics."""
    import re

    import httpx

    text = httpx.get(f"{server.url}/metrics").text
    found = re.search(r'^tiergate_request_seconds_count\{(?=[^}]*tier="paid")(?=[^}]*endpoint="speech")[^}]*\} (\S+)$',
                      text, re.M)
    return float(found.group(1)) if found else 0.0


def test_the_speech_follows_the_words_a_phrase_at_a_time(server):
    """A longer reply is said a phrase at a time, each phrase a speech request of its own started
    as soon as the phrase is written (how much sooner the first sound comes is bench_voice's to
    measure: on a machine this fast the words may all be written before the first phrase is
    said), the sound each phrase said apart, in order."""
    before = speech_requests(server)

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "max_output_tokens": 64})
            await conn.response.create()
            return await events_until(conn, "response.done")

    events = asyncio.run(run())
    kinds = [e.type for e in events]
    transcript, audio = said(events)
    phrases = phrases_said(events)
    assert len(phrases) >= 2, transcript  # the premise: a reply of several phrases
    assert speech_requests(server) == before + len(phrases)
    assert kinds.index("response.output_audio_transcript.delta") < kinds.index("response.output_audio.delta")
    expected = sum(speech_seconds(server, p) for p in phrases)
    assert abs(len(audio) / 2 / 24000 - expected) < 0.05 * len(phrases)


def phrases_said(events) -> list[str]:
    """The phrases a reply was said in, from its transcript's deltas as the server cut them."""
    from gateway.output_audio import phrases_of

    pending, phrases = "", []
    for e in events:
        if e.type == "response.output_audio_transcript.delta":
            ready, pending = phrases_of(pending + e.delta, first=not phrases)
            phrases += ready
    return phrases + ([pending] if pending.strip() else [])


def test_long_phrases_stream_in_small_deltas_that_the_sdk_takes_whole(server):
    """The speech goes out in deltas of at most 100 ms of audio (``AUDIO_DELTA_BYTES``), as it is
    made, however long a phrase is: a reply said slowly (speed 0.25), whose phrases run to many
    seconds, more than the 1 MiB frame the openai SDK's websocket takes by default (a phrase in
    one event was a close 1009), reaches that client whole: every phrase as long as
    ``/v1/audio/speech`` says it at that speed."""
    import io

    import soundfile as sf

    from gateway.audio import AUDIO_DELTA_BYTES

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:  # the SDK's default max_size
            slow = {**MANUAL["audio"], "output": {"speed": 0.25}}
            await begin(conn, {**MANUAL, "max_output_tokens": 64, "audio": slow})
            await conn.response.create()
            return await events_until(conn, "response.done", timeout=120)

    events = asyncio.run(run())
    transcript, audio = said(events)
    sizes = [len(base64.b64decode(e.delta)) for e in events if e.type == "response.output_audio.delta"]
    assert events[-1].response.status in ANSWERED
    assert len(base64.b64encode(audio)) > 2**20  # the premise: more than one frame could carry
    assert max(sizes) <= AUDIO_DELTA_BYTES and all(size % 2 == 0 for size in sizes)
    seconds = 0.0
    for phrase in phrases_said(events):
        slow = sf.read(io.BytesIO(http(server).audio.speech.create(model="tiny-tts", voice="alloy", input=phrase,
                                                                   speed=0.25, response_format="wav").content))
        seconds += len(slow[0]) / slow[1]
    assert abs(len(audio) / 2 / 24000 - seconds) < 0.1 * len(phrases_said(events)), transcript


def test_call_arguments_nested_past_the_json_parser_are_not_whole():
    """json.loads raises RecursionError past ~1000 levels: such arguments are not whole JSON (the
    response's end read them, a model's text, and the session ended on the exception)."""
    from gateway.realtime_conversation import _whole

    assert not _whole("[" * 2000 + "]" * 2000) and _whole('{"a": [1]}')


@pytest.mark.parametrize("text, whole, rest", [
    ("Hello there. How are", ["Hello there."], "How are"),
    ("One, two; three: four", ["One,", "two;", "three:"], "four"),
    ("no end yet", [], "no end yet"),
    ("a" * 30 + " " + "b" * 30 + " cc", ["a" * 30 + " " + "b" * 30], "cc"),
    ("Line one\nLine two", ["Line one"], "Line two"),
])
def test_phrases_are_said_once_whole(text, whole, rest):
    from gateway.output_audio import phrases_of

    assert phrases_of(text) == (whole, rest)
    if not any(c in text for c in ".,;:\n"):  # after the first phrase, a long one waits longer for an end
        assert phrases_of(text, first=False) == ([], text)


LOOKUP = {"type": "function", "name": "lookup", "description": "Look a place up.",
          "parameters": {"type": "object", "properties": {"place": {"type": "string", "maxLength": 6}},
                         "required": ["place"], "additionalProperties": False}}


def test_a_function_call_and_its_output_go_on_as_chat_would(server):
    """A session's function tools: with tool_choice required the reply is a function_call item,
    its arguments streamed, the same call a chat completion makes of the same conversation; the
    client's function_call_output then answers it, and the next reply reads the call and its
    output as chat reads them."""
    chat_tool = {"type": "function", "function": {k: v for k, v in LOOKUP.items() if k != "type"}}

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await events_until(conn, "session.created")
            await conn.session.update(session={**MANUAL, "max_output_tokens": 40, "tools": [LOOKUP],
                                               "tool_choice": "required"})
            updated = (await events_until(conn, "session.updated"))[-1]
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": ASK}]})
            await conn.response.create()
            called = await events_until(conn, "response.done")
            call = called[-1].response.output[0]
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id,
                                                      "output": '{"found": "under the palm"}'})
            await conn.session.update(session={"type": "realtime", "tool_choice": "none", "max_output_tokens": 12})
            await conn.response.create()
            return updated, called, await events_until(conn, "response.done")

    updated, called, answered = asyncio.run(run())
    assert updated.session.tools[0].name == "lookup" and updated.session.tool_choice == "required"
    call = called[-1].response.output[0]
    assert call.type == "function_call" and call.name == "lookup" and called[-1].response.status in ANSWERED
    deltas = "".join(e.delta for e in called if e.type == "response.function_call_arguments.delta")
    done = next(e for e in called if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments
    assert not any(e.type.startswith("response.output_audio") for e in called)  # a call is not said
    asked = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}]
    want = http(server).chat.completions.create(model="tiny-chat", temperature=0, max_tokens=40, messages=asked,
                                                tools=[chat_tool], tool_choice="required")
    assert [(c.function.name, c.function.arguments) for c in want.choices[0].message.tool_calls] == \
        [(call.name, call.arguments)]
    then = http(server).chat.completions.create(model="tiny-chat", temperature=0, max_tokens=12, tools=[chat_tool],
                                                tool_choice="none", messages=[*asked, {
        "role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                              "function": {"name": "lookup", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"found": "under the palm"}'}])
    assert said(answered)[0] == then.choices[0].message.content


def test_the_agents_sdk_realtime_agent_calls_its_function_tool(server):
    """The Agents SDK's ``RealtimeAgent`` with a ``function_tool``: the session's call reaches the
    SDK, which runs the tool with the call's arguments and sends its output back."""
    pytest.importorskip("agents")
    from agents import function_tool, set_tracing_disabled
    from agents.realtime import RealtimeAgent

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def lookup(place: Literal["palm", "cave", "ship"]) -> str:  # bounded: the call ends within max_output_tokens
        """Look a place up."""
        seen.append(place)
        return "under the palm"

    async def run():
        agent = RealtimeAgent(name="pirate", instructions="Answer briefly.", tools=[lookup])
        session = await sdk_session(server, agent, max_output_tokens=40, tool_choice="required")
        kinds = []
        async with session:
            await session.send_message(ASK)
            async with asyncio.timeout(60):
                async for event in session:
                    kinds.append(event.type)
                    if event.type in ("tool_end", "error"):
                        break
        return kinds

    kinds = asyncio.run(run())
    assert "error" not in kinds and kinds[-1] == "tool_end"
    assert seen and seen[0] in ("palm", "cave", "ship")  # the SDK ran the tool with the call's arguments


def test_a_cancel_right_after_a_create_ends_that_response_and_the_next_one_runs(server):
    """A response cancelled before its task began (the two events sent back to back) still ends,
    cancelled; it once stayed "in progress" for ever and refused every later response. A create
    right after a cancel (interrupt and ask again) is taken, in turn after the cancelled one's end:
    it was once refused, conversation_already_has_active_response, while that end was under way."""
    async def two_done_or_an_error(conn) -> list:
        out = []
        async with asyncio.timeout(60):
            async for event in conn:
                out.append(event)
                if event.type == "error" or sum(e.type == "response.done" for e in out) == 2:
                    return out
        raise AssertionError(f"the session ended: {[e.type for e in out]}")

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "output_modalities": ["text"]})
            await conn.send({"type": "response.create"})
            await conn.send({"type": "response.cancel"})
            first = await events_until(conn, "response.done")
            await conn.response.create()
            second = await events_until(conn, "response.done")
            again = []
            for _ in range(3):
                await conn.send({"type": "response.create"})
                started = await events_until(conn, "response.created")
                await conn.send({"type": "response.cancel"})
                await conn.send({"type": "response.create"})
                again.append(started + await two_done_or_an_error(conn))
                if again[-1][-1].type == "error":
                    break
            return first, second, again

    first, second, again = asyncio.run(run())
    assert [e.type for e in first if e.type.startswith("response.")][0] == "response.created"
    assert first[-1].response.status == "cancelled"
    assert second[-1].response.status in ANSWERED
    for events in again:
        assert not [e.error for e in events if e.type == "error"]
        done = [e.response for e in events if e.type == "response.done"]
        assert done[0].status == "cancelled" and done[1].status in ANSWERED
        created = [e.response.id for e in events if e.type == "response.created"]
        assert created == [d.id for d in done]  # the second begins once the cancelled one has ended


@pytest.mark.parametrize("seed", range(3))
def test_generated_client_events_leave_the_session_answering(server, seed):
    """Random client events, well-formed and not (fields of the wrong type, unknown items and item
    ids, creates and cancels back to back), each an error event or done; then a plain turn is answered."""
    import random

    rng = random.Random(seed)
    values = [None, 1, -1, "x", "", [], {}, True, 1e9, "inf", "auto", "required", ["audio"], ["text"], {"a": 1}]
    events = []
    for _ in range(30):
        kind = rng.choice(["session.update", "conversation.item.create", "response.create", "response.cancel",
                           "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
                           "conversation.item.retrieve", "conversation.item.delete", "conversation.item.truncate"])
        event = {"type": kind}
        if kind.startswith("conversation.item.") and kind != "conversation.item.create":
            event.update(item_id=rng.choice(values), content_index=rng.choice(values), audio_end_ms=rng.choice(values))
        if kind == "session.update":
            event["session"] = {"type": "realtime", **{k: rng.choice(values) for k in rng.sample(
                ["instructions", "output_modalities", "max_output_tokens", "audio", "tools", "tool_choice"], 2)}}
        elif kind == "conversation.item.create":
            event["item"] = rng.choice([{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                                        "text": "hi"}]},
                                        rng.choice(values), {"type": "function_call_output", "call_id": "c", "output": 1},
                                        {"type": "message", "role": rng.choice(values), "content": rng.choice(values)}])
        elif kind == "response.create":
            event["response"] = rng.choice([{}, {"output_modalities": rng.choice(values)},
                                            {"max_output_tokens": rng.choice(values)},
                                            {"conversation": rng.choice(["none", *values]), "input": rng.choice(values),
                                             "metadata": rng.choice(values)}])
        elif kind == "input_audio_buffer.append":
            event["audio"] = rng.choice(["AAAA" * 1200, rng.choice(values)])
        elif kind == "response.cancel" and rng.random() < 0.5:
            event["response_id"] = rng.choice(values)
        events.append(event)

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await events_until(conn, "session.created")
            for event in events:
                await conn.send(json.loads(json.dumps(event)))
            await conn.send({"type": "response.cancel"})
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 4,
                                               "tools": [], "tool_choice": "auto"})
            await events_until(conn, "session.updated")
            answered, seen = None, []
            while answered is None:  # responses before the last one end first
                await conn.send({"type": "response.create"})
                seen += await events_until(conn, "response.done")
                done = seen[-1].response
                if done.status in (*ANSWERED, "failed") and done.output_modalities == ["text"]:
                    answered = done
            return seen, answered

    seen, answered = asyncio.run(run())
    assert answered.status in ANSWERED
    assert not any(e.type == "error" and e.error.code == "server_error" for e in seen)


def test_a_part_type_that_is_a_list_or_an_object_is_an_error_event_and_the_session_goes_on(server):
    """A content part whose ``type`` is a list or an object (unhashable) once dropped the socket
    with a traceback: it is an ``invalid_value`` naming the part, as any other malformed part."""
    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "output_modalities": ["text"]}, text=None)
            errors = []
            for role, bad in [("user", ["input_text"]), ("user", {"a": 1}), ("assistant", ["text"])]:
                await conn.send({"type": "conversation.item.create", "item": {
                    "type": "message", "role": role, "content": [{"type": bad, "text": "hi", "transcript": "hi"}]}})
                errors.append((await events_until(conn, "error"))[-1].error)
            await conn.conversation.item.create(item=user("item_q", ASK))
            await conn.response.create()
            return errors, await events_until(conn, "response.done")

    errors, done = asyncio.run(run())
    assert [(e.type, e.code, e.param) for e in errors] == [("invalid_request_error", "invalid_value",
                                                            "item.content[0]")] * 3
    assert done[-1].response.status in ANSWERED


def test_transcription_null_hears_without_transcript_events_and_include_asks_logprobs(server):
    """OpenAI's session settings: ``audio.input.transcription: null`` (no input transcription) sends
    no transcription events, yet the speech is still heard (the cascade's chat model reads its
    transcript) and answered; ``include: ["item.input_audio_transcription.logprobs"]`` is taken
    as a transcription session takes it, and a transcription set again brings the events back with
    their logprobs."""
    speech = b64(spoken("Where is the gold?", rate=RATE))
    transcribed = ("conversation.item.input_audio_transcription.delta",
                   "conversation.item.input_audio_transcription.completed")

    async def turn(conn) -> list:
        await conn.input_audio_buffer.append(audio=speech)
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        return await events_until(conn, "response.done")

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            text = {**MANUAL, "output_modalities": ["text"], "max_output_tokens": 2}
            await begin(conn, {**text, "include": ["item.input_audio_transcription.logprobs"],
                               "audio": {"input": {"turn_detection": None, "transcription": None}}}, text=None)
            unheard = await turn(conn)
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"transcription": {
                "model": "tiny-stt"}}}})
            shown = (await events_until(conn, "session.updated"))[-1].session
            return unheard, shown, await turn(conn)

    unheard, shown, heard = asyncio.run(run())
    assert not [e for e in unheard if e.type in transcribed] and unheard[-1].response.status in ANSWERED
    user_item = next(e.item for e in unheard if e.type == "conversation.item.done" and e.item.role == "user")
    assert user_item.content[0].type == "input_audio"
    assert shown.audio.input.transcription.model == "tiny-stt"
    assert shown.include == ["item.input_audio_transcription.logprobs"]
    completed = next(e for e in heard if e.type == "conversation.item.input_audio_transcription.completed")
    assert completed.logprobs and heard[-1].response.status in ANSWERED


async def each(conn, kind: str, n: int) -> list:
    """Server events up to and including the ``n``-th of type ``kind``."""
    out = []
    while sum(e.type == kind for e in out) < n:
        out += await events_until(conn, kind)
    return out


def user(item_id: str, text: str) -> dict:
    return {"id": item_id, "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def test_items_are_placed_retrieved_and_deleted_and_the_reply_reads_what_is_left(server):
    """``previous_item_id`` places an item ("root": first), ``conversation.item.retrieve`` shows
    it, ``conversation.item.delete`` takes it out of what the next reply reads; an unknown or
    reused id is an error event, and the session goes on."""
    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "output_modalities": ["text"]}, text=None)
            await conn.conversation.item.create(item=user("item_b", ASK))
            await conn.conversation.item.create(item=user("item_a", "Ahoy."), previous_item_id="root")
            await conn.conversation.item.create(item=user("item_x", "Forget this."), previous_item_id="item_a")
            added = [e for e in await each(conn, "conversation.item.done", 3) if e.type == "conversation.item.added"]
            await conn.conversation.item.retrieve(item_id="item_x")
            retrieved = (await events_until(conn, "conversation.item.retrieved"))[-1]
            await conn.conversation.item.delete(item_id="item_x")
            deleted = (await events_until(conn, "conversation.item.deleted"))[-1]
            errors = []
            for event in [{"type": "conversation.item.retrieve", "item_id": "item_x"},
                          {"type": "conversation.item.delete", "item_id": "item_x"},
                          {"type": "conversation.item.create", "item": user("item_c", "x"), "previous_item_id": "nope"},
                          {"type": "conversation.item.create", "item": user("item_a", "again")}]:
                await conn.send(event)
                errors.append((await events_until(conn, "error"))[-1].error)
            await conn.response.create()
            return added, retrieved, deleted, errors, await events_until(conn, "response.done")

    added, retrieved, deleted, errors, reply = asyncio.run(run())
    assert [(e.item.id, e.previous_item_id) for e in added] == [("item_b", None), ("item_a", None),
                                                                 ("item_x", "item_a")]
    assert retrieved.item.id == "item_x" and retrieved.item.content[0].text == "Forget this."
    assert deleted.item_id == "item_x"
    assert [(e.param, e.code) for e in errors] == [("item_id", "invalid_value"), ("item_id", "invalid_value"),
                                                  ("previous_item_id", "invalid_value"), ("item.id", "invalid_value")]
    written = "".join(e.delta for e in reply if e.type == "response.output_text.delta")
    assert written == answer(server, [{"role": "user", "content": "Ahoy."}, {"role": "user", "content": ASK}])[0]


def test_a_truncated_reply_keeps_the_words_said_by_then_and_the_next_reply_reads_them(server):
    """``conversation.item.truncate``: the client stopped playing a spoken reply partway through its
    second phrase, so the reply keeps its first phrase's words and, of the second, the share of
    words its sound had reached (each phrase's length from /v1/audio/speech of that phrase: the
    demo VITS' durations are deterministic); the next reply reads that, as chat would. A cut past
    the sound, or of a message never spoken, is an error."""
    from gateway.output_audio import phrases_of

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "max_output_tokens": 64})
            await conn.response.create()
            first = await events_until(conn, "response.done")
            text, audio = said(first)
            pending, phrases = "", []
            for e in first:
                if e.type == "response.output_audio_transcript.delta":
                    ready, pending = phrases_of(pending + e.delta, first=not phrases)
                    phrases += ready
            phrases += [pending] if pending.strip() else []
            assert len(phrases) >= 2, text  # the premise: a reply of several phrases
            seconds = [await asyncio.to_thread(speech_seconds, server, p) for p in phrases[:2]]
            words = len(phrases[1].split())
            kept = words // 2  # a cut halfway between two words' shares, so that no rounding moves it
            end_ms = int((seconds[0] + seconds[1] * (kept + 0.5) / words) * 1000)
            reply = first[-1].response.output[0]
            errors = []
            for event in [{"type": "conversation.item.truncate", "item_id": reply.id, "content_index": 0,
                           "audio_end_ms": len(audio) // 48 + 50},
                          {"type": "conversation.item.truncate", "item_id": first[0].item.id, "content_index": 0,
                           "audio_end_ms": 0}]:
                await conn.send(event)
                errors.append((await events_until(conn, "error"))[-1].error)
            await conn.conversation.item.truncate(item_id=reply.id, content_index=0, audio_end_ms=end_ms)
            truncated = (await events_until(conn, "conversation.item.truncated"))[-1]
            await conn.conversation.item.retrieve(item_id=reply.id)
            retrieved = (await events_until(conn, "conversation.item.retrieved"))[-1]
            await conn.conversation.item.create(item=user("item_then", "And then?"))
            await conn.response.create(response={"max_output_tokens": 12})
            second = await events_until(conn, "response.done")
            return text, phrases, kept, errors, truncated, retrieved, second, end_ms

    text, phrases, kept, errors, truncated, retrieved, second, end_ms = asyncio.run(run())
    assert "already shorter than" in errors[0].message and errors[0].param == "audio_end_ms"
    assert errors[1].param == "item_id" and "truncated" in errors[1].message
    assert truncated.audio_end_ms == end_ms and truncated.content_index == 0
    heard = " ".join(phrases[0].split() + phrases[1].split()[:kept])
    assert " ".join(retrieved.item.content[0].transcript.split()) == heard
    assert text.startswith(retrieved.item.content[0].transcript) and len(heard) < len(" ".join(text.split()))
    assert said(second)[0] == answer(server, [{"role": "user", "content": ASK},
                                              {"role": "assistant", "content": retrieved.item.content[0].transcript},
                                              {"role": "user", "content": "And then?"}])[0]


def test_the_agents_sdk_speaks_a_turn_after_a_spoken_reply_without_errors(server):
    """The Agents SDK retrieves its last spoken reply after each transcription and truncates it
    when the user speaks over it: a spoken turn after a spoken reply raises no error event, and
    the SDK's history has the turn as /v1/audio/transcriptions hears it."""
    pytest.importorskip("agents")
    from agents import set_tracing_disabled
    from agents.realtime import RealtimeAgent

    from tests.test_realtime import pcm16

    set_tracing_disabled(True)
    speech = spoken("Where is the gold hidden?", rate=RATE)
    heard = http(server).audio.transcriptions.create(model="tiny-stt", file=("a.wav", wav_of(speech))).text

    async def run():
        agent = RealtimeAgent(name="pirate", instructions="Answer briefly.")
        session = await sdk_session(server, agent)
        kinds, ends = [], 0
        async with session:
            await session.send_message(ASK)
            async with asyncio.timeout(90):
                async for event in session:
                    kinds.append(event.type)
                    if event.type == "agent_end":
                        ends += 1
                        if ends == 1:
                            await session.send_audio(pcm16(np.concatenate([speech, np.zeros(RATE, np.float32)])))
                    if ends == 2 or event.type == "error":
                        break
            return kinds, list(session._history)

    kinds, history = asyncio.run(run())
    assert "error" not in kinds and kinds.count("agent_end") == 2
    turns = [h for h in history if h.role == "user"]
    assert [t.content[0].transcript if t.content[0].type == "input_audio" else t.content[0].text for t in turns] == \
        [ASK, heard]


@pytest.fixture(scope="module")
def text_only_server(tiny_chat, tiny_tts, tmp_path_factory) -> RunningServer:
    folder = tmp_path_factory.mktemp("realtime-no-stt")
    running = start_server(write_config(folder, {"tiny-chat": ("chat", tiny_chat), "tiny-tts": ("tts", tiny_tts)}))
    yield running
    running.stop()


def test_a_server_without_speech_to_text_serves_text_turns_and_refuses_audio(text_only_server):
    server = text_only_server

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            created = (await events_until(conn, "session.created"))[-1]
            await conn.input_audio_buffer.append(audio=b64(np.zeros(RATE, np.float32)))
            refused = (await events_until(conn, "error"))[-1].error
            await conn.session.update(session=MANUAL)
            await events_until(conn, "session.updated")
            await conn.conversation.item.create(item=user("item_q", ASK))
            await conn.response.create()
            return created, refused, await events_until(conn, "response.done")

    created, refused, reply = asyncio.run(run())
    assert created.session.audio.input.transcription is None and created.session.audio.input.turn_detection is None
    assert refused.code == "audio_input_not_supported"
    assert said(reply)[0] == answer(server, [{"role": "user", "content": ASK}])[0] and said(reply)[1]


def test_a_key_that_may_not_use_the_speech_models_gets_a_text_session_that_names_neither(server):
    """A key whose allow-list leaves out the speech models has them as a server without them
    (docs/ACCOUNTS.md: "as if the model did not exist"): its session names no transcription model
    and answers in text, so a default response completes instead of failing once the reply is
    written; asking for the speech-to-text model by name is the 404 a name nobody has gets, and
    for spoken output the refusal a server without text-to-speech gives, both at session.update."""
    import httpx

    admin = {"Authorization": f"Bearer {server.keys['admin']}"}
    made = httpx.post(f"{server.url}/admin/keys", json={"name": "chat only", "tier": "paid", "models": ["tiny-chat"]},
                      headers=admin, timeout=30)
    assert made.status_code == 201, made.text
    chat_only = AsyncOpenAI(base_url=server.base_url, api_key=made.json()["value"], max_retries=0)

    def hear_with(model: str) -> dict:
        return {"type": "realtime", "audio": {"input": {"transcription": {"model": model}}}}

    async def default():
        async with chat_only.realtime.connect(model="tiny-chat") as conn:
            created = (await events_until(conn, "session.created"))[-1]
            await conn.conversation.item.create(item=user("item_q", ASK))
            await conn.response.create(response={"max_output_tokens": 12, "instructions": "Answer briefly."})
            return created.session, await events_until(conn, "response.done")

    async def refused():
        async with chat_only.realtime.connect(model="tiny-chat") as conn:
            await events_until(conn, "session.created")
            refusals = []
            for session in (hear_with("tiny-stt"), hear_with("no-such-model"),
                            {"type": "realtime", "output_modalities": ["audio"]}):
                await conn.session.update(session=session)
                refusals.append((await events_until(conn, "error"))[-1].error)
            return refusals

    session, reply = asyncio.run(default())
    shown = json.dumps(session.model_dump())
    assert "tiny-stt" not in shown and "tiny-tts" not in shown, shown
    assert session.audio.input.transcription is None and session.audio.input.turn_detection is None
    assert session.output_modalities == ["text"] and session.audio.output.voice is None
    done = reply[-1].response
    assert done.status in ANSWERED, done.status_details
    text = "".join(e.delta for e in reply if e.type == "response.output_text.delta")
    assert text == answer(server, [{"role": "user", "content": ASK}])[0]
    assert not [e for e in reply if e.type == "response.output_audio.delta"]
    hidden, nobody, spoken_out = asyncio.run(refused())
    assert (hidden.code, hidden.param) == (nobody.code, nobody.param) == \
        ("model_not_found", "session.audio.input.transcription.model")
    assert hidden.message == nobody.message.replace("no-such-model", "tiny-stt")
    assert spoken_out.code == "audio_output_not_supported" and "tiny-tts" not in spoken_out.message


def test_an_out_of_band_response_answers_beside_the_conversation_and_leaves_it_as_it_was(server):
    """``conversation: "none"`` with an ``input`` of its own: a text response runs beside the
    conversation's spoken one, answers its own context as chat would, comes back with its
    ``metadata`` and no conversation, and adds nothing to the conversation; one cancelled by its
    ``response_id`` ends cancelled while the other goes on."""
    side = {"conversation": "none", "output_modalities": ["text"], "max_output_tokens": 12,
            "metadata": {"purpose": "classify"},
            "input": [{"type": "item_reference", "id": "item_ask"},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Is that a question?"}]}]}

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, MANUAL, text=None)
            await conn.conversation.item.create(item=user("item_ask", ASK))
            await conn.response.create()
            await conn.send({"type": "response.create", "response": side})
            both = await each(conn, "response.done", 2)
            oob = next(e.response for e in both if e.type == "response.done" and e.response.conversation_id is None)
            await conn.conversation.item.retrieve(item_id=oob.output[0].id)
            missing = (await events_until(conn, "error"))[-1].error
            await conn.send({"type": "response.cancel", "response_id": "resp_nobody"})
            unknown = (await events_until(conn, "error"))[-1].error
            await conn.send({"type": "response.create", "response": {**side, "max_output_tokens": "inf", "input": []}})
            created = (await events_until(conn, "response.created"))[-1].response
            await conn.send({"type": "response.cancel", "response_id": created.id})
            cancelled = (await events_until(conn, "response.done"))[-1].response
            await conn.conversation.item.create(item=user("item_then", "And then?"))
            await conn.response.create(response={"max_output_tokens": 12})
            return both, missing, unknown, cancelled, await events_until(conn, "response.done")

    both, missing, unknown, cancelled, then = asyncio.run(run())
    done = {("side" if e.response.conversation_id is None else "main"): e.response for e in both
            if e.type == "response.done"}
    assert done["side"].metadata == {"purpose": "classify"} and done["side"].output_modalities == ["text"]
    assert done["main"].conversation_id and {done["main"].status, done["side"].status} <= set(ANSWERED)
    side_text = "".join(e.delta for e in both if e.type == "response.output_text.delta")
    assert side_text == answer(server, [{"role": "user", "content": ASK},
                                        {"role": "user", "content": "Is that a question?"}])[0]
    reply = said([e for e in both if getattr(e, "response_id", None) == done["main"].id])[0]
    assert reply == answer(server, [{"role": "user", "content": ASK}])[0]
    added = [e.item.id for e in both if e.type == "conversation.item.added"]
    assert done["main"].output[0].id in added and done["side"].output[0].id not in added
    assert missing.param == "item_id" and (unknown.param, unknown.code) == ("response_id", "response_cancel_not_active")
    assert cancelled.status == "cancelled" and cancelled.conversation_id is None
    assert said(then)[0] == answer(server, [{"role": "user", "content": ASK}, {"role": "assistant", "content": reply},
                                            {"role": "user", "content": "And then?"}])[0]


@pytest.mark.parametrize("law", ["pcmu", "pcma"])
def test_a_reply_to_a_phone_call_is_said_in_g711_at_8khz(server, law):
    """``audio.output.format`` audio/pcmu or audio/pcma (a phone network's): the reply's speech,
    resampled to 8 kHz and encoded as it streams, is byte for byte the 24 kHz reply the same
    conversation gets in PCM, encoded at once (the speech model samples its noise from torch's
    generator, seeded alike before each reply; this server runs in the test's process); the
    session reports the format it took."""
    import torch

    from workers.audio import G711Stream

    async def reply(fmt: dict):
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "max_output_tokens": 24, "audio": {**MANUAL["audio"], "output": {"format": fmt}}})
            torch.manual_seed(2024)
            await conn.response.create()
            events = await events_until(conn, "response.done")
            await conn.session.update(session={"type": "realtime"})
            return (await events_until(conn, "session.updated"))[-1].session, said(events)

    speech_seconds(server, "Ahoy.")  # the speech model loaded before the seed (a load draws from the generator)
    _, (text, pcm) = asyncio.run(reply({"type": "audio/pcm", "rate": RATE}))
    session, (phoned, g711) = asyncio.run(reply({"type": f"audio/{law}"}))
    assert session.audio.output.format.type == f"audio/{law}" and phoned == text
    assert abs(len(g711) * 3 - len(pcm) // 2) <= 3  # a byte a sample at 8 kHz: a third of 24 kHz's samples
    encoder = G711Stream(law, RATE, encode=True)
    assert g711 == encoder.feed(pcm) + encoder.flush()


def test_a_message_may_carry_its_audio_or_be_the_assistant_s_and_the_reply_reads_both(server):
    """``conversation.item.create`` with a user message of one ``input_audio`` part with its audio
    (the session's input format): transcribed as /v1/audio/transcriptions hears it, in turn, and
    no response of its own (server_vad is on); an assistant message (a restored history) is read
    as the assistant's words. The next reply reads both as chat would."""
    speech = spoken("Where is the gold hidden?", rate=RATE)
    heard = http(server).audio.transcriptions.create(model="tiny-stt", file=("a.wav", wav_of(speech))).text

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {"type": "realtime", "instructions": "Answer briefly.", "max_output_tokens": 12},
                        text=None)
            await conn.conversation.item.create(item={"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Ahoy, I am the captain."}]})
            await conn.conversation.item.create(item={"id": "item_said", "type": "message", "role": "user",
                                                      "content": [{"type": "input_audio", "audio": b64(speech)}]})
            transcribed = await events_until(conn, "conversation.item.input_audio_transcription.completed")
            done = await events_until(conn, "conversation.item.done")
            errors = []
            for item in [{"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": b64(speech)},
                                                                          {"type": "input_text", "text": "and?"}]},
                         {"type": "message", "role": "system", "content": [{"type": "input_audio", "transcript": "x"}]},
                         {"type": "message", "role": "assistant", "content": [{"type": "output_audio"}]}]:
                await conn.send({"type": "conversation.item.create", "item": item})
                errors.append((await events_until(conn, "error"))[-1].error)
            await conn.response.create()
            return transcribed, done, errors, await events_until(conn, "response.done")

    transcribed, done, errors, reply = asyncio.run(run())
    assert not any(e.type == "response.created" for e in transcribed + done)  # no response of its own
    assert transcribed[-1].item_id == "item_said" and transcribed[-1].transcript == heard
    assert done[-1].item.id == "item_said" and done[-1].item.content[0].transcript == heard
    assert [e.param for e in errors] == ["item.content", "item.content[0]", "item.content[0]"]
    assert said(reply)[0] == answer(server, [{"role": "assistant", "content": "Ahoy, I am the captain."},
                                             {"role": "user", "content": heard}])[0]


def test_a_deleted_audio_item_keeps_its_id_until_its_audio_is_heard(server, monkeypatch):
    """A user audio item deleted while its transcription waits keeps its id until that ends: a
    new item with the id is an error event (it would get the deleted audio's transcript, and the
    reply would not wait for its own); the session goes on and the next reply reads the new
    item's words. (Transcriptions slowed by 1 s, so the deleted one is still waiting.)"""
    import gateway.realtime as realtime

    hear = realtime.stream_transcription

    async def slow(*args, **kwargs):
        await asyncio.sleep(1)
        async for piece in hear(*args, **kwargs):
            yield piece

    monkeypatch.setattr(realtime, "stream_transcription", slow)
    long, short = spoken("Where is the gold hidden, captain?", rate=RATE), spoken("Ahoy.", rate=RATE)
    heard = http(server).audio.transcriptions.create(model="tiny-stt", file=("a.wav", wav_of(short))).text

    def audio(item_id: str, speech: np.ndarray) -> dict:
        return {"id": item_id, "type": "message", "role": "user", "content": [{"type": "input_audio",
                                                                                "audio": b64(speech)}]}

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "output_modalities": ["text"]}, text=None)
            await conn.conversation.item.create(item=audio("item_x", long))
            await conn.conversation.item.delete(item_id="item_x")
            await events_until(conn, "conversation.item.deleted")
            await conn.send({"type": "conversation.item.create", "item": audio("item_x", short)})
            error = (await events_until(conn, "error", timeout=10))[-1].error
            await conn.conversation.item.create(item=audio("item_y", short))
            await conn.response.create()
            return error, await events_until(conn, "response.done")

    error, events = asyncio.run(run())
    assert (error.param, error.code) == ("item.id", "invalid_value")
    kinds = [(e.type, getattr(e, "item_id", None)) for e in events]
    heard_at = kinds.index(("conversation.item.input_audio_transcription.completed", "item_y"))
    assert heard_at < kinds.index(("response.done", None))  # the reply waited for item_y's words
    assert events[heard_at].transcript == heard
    written = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert written == answer(server, [{"role": "user", "content": heard}])[0]


def test_audio_output_speed_is_said_as_the_speech_endpoint_says_it(server):
    """``audio.output.speed`` 1.5 (the Realtime API's most): the reply sounds as long as
    ``/v1/audio/speech`` makes its text at 1.5 (a phrase at a time: within 0.1 s), well under its
    length at 1.0; the session shows the speed. A speed outside 0.25-1.5, or not a number, is an
    ``error`` naming ``session.audio.output.speed``, and the speed stays as it was; null is 1.0."""
    import io

    import soundfile as sf

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await events_until(conn, "session.created")
            await conn.session.update(session={**MANUAL, "audio": {**MANUAL["audio"], "output": {"speed": 1.5,
                                                                                               "voice": "alloy"}}})
            output = (await events_until(conn, "session.updated"))[-1].session.audio.output
            shown = output.speed, output.voice
            errors = []
            for bad in (2.0, "fast", True):
                await conn.send({"type": "session.update", "session": {"type": "realtime", "audio": {"output": {"speed": bad}}}})
                errors.append((await events_until(conn, "error"))[-1].error)
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": ASK}]})
            await conn.response.create()
            replied = await events_until(conn, "response.done")
            await conn.send({"type": "session.update", "session": {"type": "realtime", "audio": {"output": {"speed": None}}}})
            reset = (await events_until(conn, "session.updated"))[-1].session.audio.output.speed
            return shown, errors, replied, reset

    shown, errors, events, reset = asyncio.run(run())
    assert shown == (1.5, "alloy")  # a voice in the same update keeps the speed
    assert reset == 1.0  # null: the default
    assert [(e.param, e.code) for e in errors] == [("session.audio.output.speed", "invalid_value")] + \
        [("session.audio.output.speed", "invalid_type")] * 2
    text, audio = said(events)
    fast = sf.read(io.BytesIO(http(server).audio.speech.create(model="tiny-tts", voice="alloy", input=text, speed=1.5,
                                                               response_format="wav").content))
    seconds = len(audio) / 2 / 24000
    assert abs(seconds - len(fast[0]) / fast[1]) < 0.1
    assert seconds < 0.8 * speech_seconds(server, text)


def test_a_response_may_bring_its_own_tools_and_audio_and_the_session_keeps_its_own(server):
    """``response.create`` with ``tools`` / ``tool_choice`` and ``audio.output``: that response
    calls the function (as chat does with the same tools) and speaks in G.711; the session's own
    settings (no tools, PCM) stay, and a bad per-response tool is an error named ``response.*``."""
    chat_tool = {"type": "function", "function": {k: v for k, v in LOOKUP.items() if k != "type"}}

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, MANUAL)
            await conn.send({"type": "response.create", "response": {"tools": [{"type": "web_search"}]}})
            refused = (await events_until(conn, "error"))[-1].error
            await conn.send({"type": "response.create", "response": {"tools": [LOOKUP], "tool_choice": "required",
                                                                     "max_output_tokens": 40}})
            called = await events_until(conn, "response.done")
            call = called[-1].response.output[0]
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id,
                                                      "output": '{"found": "under the palm"}'})
            await conn.send({"type": "response.create", "response": {"audio": {"output": {"format": {"type": "audio/pcmu"}}},
                                                                     "tool_choice": "none", "tools": [LOOKUP]}})
            phoned = await events_until(conn, "response.done")
            await conn.session.update(session={"type": "realtime"})
            return refused, called, phoned, (await events_until(conn, "session.updated"))[-1].session

    refused, called, phoned, session = asyncio.run(run())
    assert refused.param == "response.tools[0].type"
    call = called[-1].response.output[0]
    asked = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}]
    want = http(server).chat.completions.create(model="tiny-chat", temperature=0, max_tokens=40, messages=asked,
                                                tools=[chat_tool], tool_choice="required")
    assert [(c.function.name, c.function.arguments) for c in want.choices[0].message.tool_calls] == \
        [(call.name, call.arguments)]
    text, g711 = said(phoned)
    assert text and abs(len(g711) * 3 / 24000 - speech_seconds(server, text)) < 0.05 * (text.count(" ") + 1)
    assert session.tools == [] and session.audio.output.format.type == "audio/pcm"


def test_idle_timeout_answers_a_silence_after_the_reply_has_been_heard(server):
    """``server_vad`` with ``idle_timeout_ms`` (a phone agent's "are you still there?"): once the
    reply's sound has had time to play and the user has said nothing for the timeout, the session
    sends ``input_audio_buffer.timeout_triggered`` and answers again, unprompted; the wait counts
    from the reply's end plus its sound's length."""

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {"type": "realtime", "instructions": "Answer briefly.", "max_output_tokens": 12,
                               "audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 1000}}}})
            await conn.response.create()
            first = await events_until(conn, "response.done")
            done_at = time.monotonic()
            idle = await events_until(conn, "input_audio_buffer.timeout_triggered", timeout=30)
            waited = time.monotonic() - done_at
            second = await events_until(conn, "response.done")
            await conn.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
                "turn_detection": {"type": "server_vad", "idle_timeout_ms": 5}}}}})
            refused = (await events_until(conn, "error"))[-1].error
            await conn.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
                "turn_detection": {"type": "semantic_vad", "idle_timeout_ms": 2000}}}}})
            semantic = (await events_until(conn, "error"))[-1].error
            return first, waited, idle, second, refused, semantic

    first, waited, idle, second, refused, semantic = asyncio.run(run())
    played = len(said(first)[1]) / 2 / RATE
    # the server starts the wait as it sends response.done, a little before this client reads it
    assert played > 0.2 and played + 1.0 - 0.1 <= waited < played + 1.0 + 5  # (generous: a loaded machine)
    assert idle[-1].type == "input_audio_buffer.timeout_triggered"
    assert second[-1].response.status in ANSWERED and said(second)[0]
    assert refused.param == "session.audio.input.turn_detection.idle_timeout_ms"
    # idle_timeout_ms is server_vad's: semantic_vad has none (OpenAI's)
    assert semantic.param == "session.audio.input.turn_detection.idle_timeout_ms" and semantic.code == "unknown_parameter"


def test_a_client_secret_opens_sessions_with_its_settings_and_nothing_else(server):
    """``POST /v1/realtime/client_secrets`` (the SDK's ``realtime.client_secrets.create``): a
    short-lived ``ek_`` key for a browser. It opens a conversation already set as the secret says
    (through the SDK, and as a browser sends it: a subprotocol), answered and metered as its key's;
    it opens nothing else (an HTTP endpoint answers 401), a bad setting is a 400 when the secret is
    made, and an unknown secret is refused at the handshake."""
    import httpx
    import websockets

    made = http(server).realtime.client_secrets.create(
        expires_after={"anchor": "created_at", "seconds": 60},
        session={"type": "realtime", "model": "tiny-chat", **{k: v for k, v in MANUAL.items() if k != "type"},
                 "output_modalities": ["text"]})
    assert made.value.startswith("ek_") and abs(made.expires_at - (time.time() + 60)) < 5
    assert made.session.instructions == "Answer briefly." and made.session.output_modalities == ["text"]
    ws_url = server.url.replace("http", "ws") + "/v1/realtime"

    async def run():
        async with AsyncOpenAI(base_url=server.base_url, api_key=made.value, max_retries=0).realtime.connect(
                model="tiny-chat") as conn:
            created = (await events_until(conn, "session.created"))[-1]
            await conn.conversation.item.create(item=user("item_q", ASK))
            await conn.response.create()
            reply = await events_until(conn, "response.done")
        async with websockets.connect(ws_url, subprotocols=["realtime", "openai-insecure-api-key." + made.value]) as ws:
            browser = json.loads(await ws.recv())
        unknown = None
        try:
            async with websockets.connect(ws_url, subprotocols=["realtime", "openai-insecure-api-key.ek_nobody"]):
                pass
        except websockets.InvalidStatus as exc:
            unknown = exc.response.status_code
        return created, reply, browser, unknown

    created, reply, browser, unknown = asyncio.run(run())
    assert created.session.instructions == "Answer briefly." and created.session.audio.input.turn_detection is None
    written = "".join(e.delta for e in reply if e.type == "response.output_text.delta")
    assert written == answer(server, [{"role": "user", "content": ASK}])[0]
    assert browser["type"] == "session.created" and browser["session"]["output_modalities"] == ["text"]
    assert unknown == 401
    assert httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {made.value}"}).status_code == 401
    for body, param in [({"expires_after": {"seconds": 5}}, "expires_after.seconds"),
                        ({"session": {"type": "realtime"}}, "session.model"),
                        ({"session": {"type": "realtime", "model": "tiny-chat", "tools": [{"type": "web_search"}]}},
                         "session.tools[0].type")]:
        r = httpx.post(f"{server.base_url}/realtime/client_secrets", json=body,
                       headers={"Authorization": f"Bearer {server.keys['paid']}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    transcribing = http(server).realtime.client_secrets.create(session={"type": "transcription"})

    async def transcription():
        async with websockets.connect(ws_url, additional_headers={"Authorization": f"Bearer {transcribing.value}"}) as ws:
            return json.loads(await ws.recv())

    assert asyncio.run(transcription())["session"]["type"] == "transcription"


def test_a_client_secret_stops_with_the_key_that_made_it(server):
    """A managed key revoked: the client secrets it made open no more sessions."""
    import httpx
    import websockets

    admin = {"Authorization": "Bearer key-admin"}
    key = httpx.post(f"{server.url}/admin/keys", json={"tier": "subscriber", "name": "browser-app"}, headers=admin).json()
    made = OpenAI(base_url=server.base_url, api_key=key["value"], max_retries=0).realtime.client_secrets.create(
        session={"type": "realtime", "model": "tiny-chat"})
    ws_url = server.url.replace("http", "ws") + "/v1/realtime"

    async def opened() -> str:
        try:
            async with websockets.connect(ws_url, additional_headers={"Authorization": f"Bearer {made.value}"}) as ws:
                return json.loads(await ws.recv())["type"]
        except websockets.InvalidStatus as exc:
            return str(exc.response.status_code)

    assert asyncio.run(opened()) == "session.created"
    assert httpx.delete(f"{server.url}/admin/keys/{key['id']}", headers=admin).status_code == 200
    assert asyncio.run(opened()) == "401"


def test_a_client_secret_follows_its_key_out_of_the_key_files_and_to_another_tier(server):
    """A client secret stands for its key as the key stands when a session opens: a key taken
    out of the key files (their reload makes a new ``KeyRing``) stops its secrets as it stops
    itself, and a managed key moved to another tier opens its secrets' sessions at that tier
    (both once went on as the key was when the secret was made)."""
    import httpx
    import websockets

    from gateway.auth import KeyRing

    ws_url = server.url.replace("http", "ws") + "/v1/realtime"
    original = server.services.keys
    tiers = ["paid", "subscriber", "free", "batch"]
    with_extra = KeyRing({t: [server.keys[t]] + (["key-paid-leaked"] if t == "paid" else []) for t in tiers},
                         [server.keys["admin"]])

    def mint(key: str) -> str:
        return OpenAI(base_url=server.base_url, api_key=key, max_retries=0).realtime.client_secrets.create(
            session={"type": "realtime", "model": "tiny-chat"}).value

    async def opened(value: str) -> tuple[str, dict]:
        try:
            async with websockets.connect(ws_url, additional_headers={"Authorization": f"Bearer {value}"}) as ws:
                kind = json.loads(await ws.recv())["type"]
                return kind, dict(server.services.metrics.realtime_sessions)  # counted while it is open
        except websockets.InvalidStatus as exc:
            return str(exc.response.status_code), {}

    server.services.keys = with_extra
    try:
        leaked = mint("key-paid-leaked")
        assert asyncio.run(opened(leaked))[0] == "session.created"
    finally:
        server.services.keys = original  # the key file's reload, the key taken out
    gone = httpx.get(f"{server.base_url}/models", headers={"Authorization": "Bearer key-paid-leaked"})
    assert gone.status_code == 401
    assert asyncio.run(opened(leaked))[0] == "401"

    admin = {"Authorization": "Bearer key-admin"}
    key = httpx.post(f"{server.url}/admin/keys", json={"tier": "paid", "name": "moved"}, headers=admin).json()
    made = mint(key["value"])
    assert httpx.patch(f"{server.url}/admin/keys/{key['id']}", json={"tier": "free"}, headers=admin).status_code == 200
    before = dict(server.services.metrics.realtime_sessions)
    kind, during = asyncio.run(opened(made))
    assert kind == "session.created"
    assert during.get("free", 0) == before.get("free", 0) + 1 and during.get("paid", 0) <= before.get("paid", 0)


def test_a_client_secret_expires():
    from gateway.auth import Caller
    from gateway.realtime_secrets import ClientSecrets

    now = [1000.0]
    store = ClientSecrets(clock=lambda: now[0])
    caller = Caller("paid", "k1")
    value, secret = store.issue(caller, 10, "settings")
    assert store.redeem(value) is secret and store.redeem(value + "x") is None
    now[0] += 9.9
    assert store.redeem(value) is secret
    now[0] += 0.2
    assert store.redeem(value) is None


def test_a_key_at_its_cap_of_client_secrets_drops_its_own_oldest_and_no_one_elses():
    """The cap on secrets is each key's: a key making more drops its own oldest (it once dropped
    the oldest of all keys', so one key could void every other key's). Expiry is swept in order."""
    from gateway.auth import Caller
    from gateway.realtime_secrets import ClientSecrets

    now = [1000.0]
    store = ClientSecrets(clock=lambda: now[0], max_per_key=3)
    customer = store.issue(Caller("paid", "customer"), 7200, None)[0]
    flood = [store.issue(Caller("free", "flooder"), 60, None)[0] for _ in range(2000)]
    assert store.redeem(customer) is not None
    assert [store.redeem(v) is not None for v in flood[-4:]] == [False, True, True, True]
    assert len(store) == 4 and len(store._expiring) <= 2 * len(store) + 1024  # dropped ones' entries are let go
    now[0] += 61
    store.issue(Caller("free", "other"), 60, None)  # the flooder's expired secrets are swept as it makes one
    assert len(store) == 2 and store.redeem(customer) is not None


def test_a_key_s_client_secrets_hold_at_most_its_bytes_of_settings_dropping_its_own_oldest():
    """Each secret keeps the settings it was made with (``instructions``, ``tools``: up to a 25 MiB
    request) for up to 2 h: a key's secrets hold at most ``max_bytes_per_key`` of them, its own
    oldest dropped to make room, no other key's. (Only their count was bounded: 20 secrets with
    10 MB of instructions held 200 MB of the server's memory, 10,000 could hold 250 GB; hunt report
    GG, finding 3.)"""
    from gateway.auth import Caller
    from gateway.realtime_secrets import MAX_BYTES_PER_KEY, ClientSecrets

    assert MAX_BYTES_PER_KEY == 32 * 2**20
    store = ClientSecrets(max_bytes_per_key=100)
    customer = store.issue(Caller("paid", "customer"), 7200, None, 60)[0]
    flood = [store.issue(Caller("free", "flooder"), 7200, None, 40)[0] for _ in range(5)]
    assert [store.redeem(v) is not None for v in flood] == [False, False, False, True, True]
    assert store.redeem(customer) is not None
    assert store.redeem(store.issue(Caller("free", "flooder"), 7200, None, 100)[0]) is not None  # the whole bound
    assert [store.redeem(v) is not None for v in flood[-2:]] == [False, False] and len(store) == 2
    store.issue(Caller("paid", "customer"), 7200, None, 40)  # its 60 and 40 fit: nothing dropped
    assert store.redeem(customer) is not None and len(store) == 3


@pytest.fixture(scope="module")
def tight_server(tiny_stt, tiny_chat, tiny_tts, tmp_path_factory) -> RunningServer:
    """A budget of 4 GiB and three models of 3 GiB: one at a time; protection for 30 s."""
    models = {"tiny-chat": ("chat", tiny_chat), "tiny-stt": ("stt", tiny_stt), "tiny-tts": ("tts", tiny_tts)}
    config = write_config(tmp_path_factory.mktemp("realtime-tight"), models, "eviction:\n  protect_window_s: 30\n")
    declare_vram(config, "3GiB", tiny_chat, tiny_stt, tiny_tts)
    running = start_server(config)
    yield running
    running.stop()


def test_a_sessions_turns_take_turns_on_a_budget_that_holds_one_model(tight_server):
    """Each turn is a chain (its chat, then its speech) and the next turn's chat evicts the speech
    model the session itself used moments ago: a session's steps are one request's, not refused
    for the protection its own earlier steps gave (another paid request would be, for 30 s)."""
    async def run():
        async with client(tight_server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, MANUAL)
            turns = []
            for _ in range(2):
                await conn.response.create()
                turns.append(await events_until(conn, "response.done"))
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": "And?"}]})
            return turns

    for events in asyncio.run(run()):
        assert events[-1].response.status in ANSWERED, events[-1].response.status_details
        transcript, audio = said(events)
        assert transcript and len(audio) > 0
    with pytest.raises(Exception) as held_off:  # tiny-tts, just used by this paid session, protects itself from others
        http(tight_server).chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=2)
    assert getattr(held_off.value, "status_code", None) == 429


def test_a_long_conversation_drops_its_oldest_turns_unless_truncation_is_disabled(server):
    """``truncation: "auto"`` (OpenAI's default): a conversation past the model's context (tiny-chat's
    512 tokens) drops its oldest turns for each response, where every response after that failed
    with context_length_exceeded; ``"disabled"`` keeps them all (and fails so), and a ratio is
    refused by name."""
    said = "Tell me more about where the pirates buried the gold, and who keeps the map now. " * 2

    async def run(truncation: str | None) -> list:
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "output_modalities": ["text"],
                               **({"truncation": truncation} if truncation else {})}, text=None)
            done = []
            for _ in range(12):
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": said}]})
                await conn.response.create(response={"max_output_tokens": 16})
                done.append((await events_until(conn, "response.done"))[-1].response)
            return done

    auto = asyncio.run(run(None))
    assert len(auto) == 12 and all(r.status in ANSWERED for r in auto)
    kept = asyncio.run(run("disabled"))
    failed = [r for r in kept if r.status == "failed"]
    assert failed and failed[0].status_details.error.code == "context_length_exceeded"

    async def ratio():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await events_until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "truncation": {"type": "retention_ratio",
                                                                                  "retention_ratio": 0.5}})
            return (await events_until(conn, "error"))[-1].error

    error = asyncio.run(ratio())
    assert (error.param, error.code) == ("session.truncation", "unsupported_value")


def test_a_reply_cut_by_max_output_tokens_is_incomplete_and_a_whole_one_completed(server):
    """A reply that ``max_output_tokens`` cuts (chat's ``finish_reason: "length"``) ends
    ``incomplete``, ``status_details`` naming ``max_output_tokens`` as OpenAI's does, its item
    ``incomplete`` in every event that shows it; a reply that ends by itself is ``completed``."""
    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "output_modalities": ["text"]})
            await conn.response.create(response={"max_output_tokens": 2})
            cut = await events_until(conn, "response.done")
            await conn.response.create(response={"max_output_tokens": 200})
            return cut, await events_until(conn, "response.done")

    cut, whole = asyncio.run(run())
    done = cut[-1].response
    assert done.status == "incomplete" and done.usage.output_tokens == 2
    assert (done.status_details.type, done.status_details.reason) == ("incomplete", "max_output_tokens")
    items = [e.item for e in cut if e.type in ("response.output_item.done", "conversation.item.done")
             and e.item.id == done.output[0].id]
    assert len(items) == 2 and {i.status for i in items + done.output} == {"incomplete"}
    reply = http(server).chat.completions.create(model="tiny-chat", temperature=0, max_tokens=200, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK},
        {"role": "assistant", "content": done.output[0].content[0].text}])
    assert whole[-1].response.status == ("incomplete" if reply.choices[0].finish_reason == "length" else "completed")
    assert whole[-1].response.output[0].status == whole[-1].response.status


def managed_key(server: RunningServer, **limits) -> str:
    """A new paid key of its own (its usage and buckets no other test's), with ``limits``."""
    import httpx

    made = httpx.post(f"{server.url}/admin/keys", json={"name": "rt", "tier": "paid", "limits": limits},
                      headers={"Authorization": f"Bearer {server.keys['admin']}"}, timeout=30)
    assert made.status_code == 201, made.text
    return made.json()["value"]


def test_a_key_with_concurrent_1_gets_its_reply_said(server):
    """A reply is said a phrase at a time while it is written: the speech is a step of the reply's
    own request, which the key's ``concurrent`` limit counts once. (A key with ``concurrent: 1``
    had every spoken response fail, its speech refused by its own reply: hunt report GG, finding 4.)"""

    async def run():
        async with AsyncOpenAI(base_url=server.base_url, api_key=managed_key(server, concurrent=1),
                               max_retries=0).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "max_output_tokens": 32})
            await conn.response.create()
            return await events_until(conn, "response.done")

    events = asyncio.run(run())
    assert events[-1].response.status in ANSWERED, events[-1].response.status_details
    transcript, audio = said(events)
    assert transcript and audio


def test_a_cancelled_response_reports_the_usage_that_was_metered(server):
    """``response.cancel`` mid-reply: the cancelled ``response.done`` carries the tokens the key
    was metered for it (the prompt, and the reply as far as the engine had written it), not null."""
    import httpx

    key = managed_key(server)

    async def run():
        conn_client = AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0)
        async with conn_client.realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "output_modalities": ["text"], "max_output_tokens": 200})
            await conn.response.create()
            for _ in range(3):
                await events_until(conn, "response.output_text.delta")
            await conn.response.cancel()
            return await events_until(conn, "response.done")

    done = asyncio.run(run())[-1].response
    assert done.status == "cancelled" and done.status_details.reason == "client_cancelled"
    usage = httpx.get(f"{server.base_url}/usage", headers={"Authorization": f"Bearer {key}"}).json()["data"]
    metered = (sum(r.get("input_tokens", 0) for r in usage), sum(r.get("output_tokens", 0) for r in usage))
    assert done.usage is not None and metered[1] >= 3
    assert (done.usage.input_tokens, done.usage.output_tokens) == metered
    assert done.usage.total_tokens == sum(metered)


def test_committed_audio_names_the_item_before_it_in_the_conversation(server):
    """``input_audio_buffer.committed``'s ``previous_item_id`` is the conversation's item before the
    user item, the one its ``conversation.item.added`` names: a text item before the first turn,
    the assistant's reply before the next (not the last committed audio)."""
    speech = spoken("Where is the gold hidden?", rate=RATE)

    async def turn(conn) -> tuple[str | None, str | None]:
        await conn.input_audio_buffer.append(audio=b64(speech))
        await conn.input_audio_buffer.commit()
        committed = (await events_until(conn, "input_audio_buffer.committed"))[-1]
        added = (await events_until(conn, "conversation.item.added"))[-1]
        assert added.item.id == committed.item_id
        return committed.previous_item_id, added.previous_item_id

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "output_modalities": ["text"]}, text=None)
            await conn.conversation.item.create(item=user("item_text1", ASK))
            first = await turn(conn)
            await conn.response.create()
            reply = (await events_until(conn, "response.done"))[-1].response.output[0].id
            return first, reply, await turn(conn)

    first, reply, second = asyncio.run(run())
    assert first == ("item_text1", "item_text1")
    assert second == (reply, reply)


def test_tool_choice_is_checked_with_or_without_tools_naming_the_field_sent(server):
    """``tool_choice`` is checked whenever it is sent, tools or none: a value OpenAI does not take,
    a function no tool has and an MCP choice (no MCP tools here) are errors naming it; a session
    whose named choice the new ``tools`` leave out is an error naming ``tools``, the field sent."""
    weather = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "output_modalities": ["text"]}, text=None)
            refusals = []
            for choice in (5, "sometimes", {"type": "function", "name": "nope"}, {"type": "function"},
                           {"type": "mcp", "server_label": "deepwiki"}):
                await conn.send({"type": "session.update", "session": {"type": "realtime", "tool_choice": choice}})
                refusals.append((await events_until(conn, "error"))[-1].error)
            for response in ({"tool_choice": "sometimes"}, [], {"audio": []}):  # (a list was taken as {})
                await conn.send({"type": "response.create", "response": response})
                refusals.append((await events_until(conn, "error"))[-1].error)
            await conn.session.update(session={"type": "realtime", "tool_choice": "required"})  # no tools: kept
            required = (await events_until(conn, "session.updated"))[-1].session.tool_choice
            await conn.session.update(session={"type": "realtime", "tools": [weather],
                                               "tool_choice": {"type": "function", "name": "get_weather"}})
            await events_until(conn, "session.updated")
            await conn.send({"type": "session.update", "session": {"type": "realtime", "tools": [
                {**weather, "name": "get_time"}]}})
            refusals.append((await events_until(conn, "error"))[-1].error)
            return refusals, required

    refusals, required = asyncio.run(run())
    assert [(r.param, r.code) for r in refusals] == [
        ("session.tool_choice", "invalid_type"), ("session.tool_choice", "invalid_value"),
        ("session.tool_choice", "invalid_value"), ("session.tool_choice.name", "invalid_type"),
        ("session.tool_choice.type", "unsupported_value"), ("response.tool_choice", "invalid_value"),
        ("response", "invalid_type"), ("response.audio", "invalid_type"), ("session.tools", "invalid_value")]
    assert required == "required" and "get_weather" in refusals[-1].message


def test_rate_limits_updated_follows_each_response_with_the_keys_header_figures(server):
    """A key with per-minute limits gets ``rate_limits.updated`` after each ``response.done``: its
    ``requests`` and ``tokens`` buckets as the response left them, the figures an HTTP answer's
    ``x-ratelimit-*`` headers then carry; a key without limits gets none."""
    import httpx

    key = managed_key(server, requests_per_min=5, tokens_per_min=100_000)

    async def run(api_key: str):
        async with AsyncOpenAI(base_url=server.base_url, api_key=api_key, max_retries=0).realtime.connect(
                model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "output_modalities": ["text"], "max_output_tokens": 4})
            await conn.response.create()
            await events_until(conn, "response.done")
            await conn.send({"type": "conversation.item.retrieve", "item_id": "nope"})  # a marker: the next error
            events = await events_until(conn, "error")
            headers = httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {api_key}"}).headers
            return [e for e in events if e.type == "rate_limits.updated"], headers

    updates, headers = asyncio.run(run(key))
    assert len(updates) == 1
    limits = {r.name: r for r in updates[0].rate_limits}
    assert limits["requests"].limit == int(headers["x-ratelimit-limit-requests"]) == 5
    assert limits["requests"].remaining == int(headers["x-ratelimit-remaining-requests"]) == 4
    assert limits["tokens"].limit == int(headers["x-ratelimit-limit-tokens"]) == 100_000
    assert abs(limits["tokens"].remaining - int(headers["x-ratelimit-remaining-tokens"])) < 100_000 / 60 * 5
    assert 0 < limits["requests"].reset_seconds <= 60
    assert asyncio.run(run(server.keys["paid"]))[0] == []


def test_a_conversation_s_items_are_bounded_and_deleting_makes_room(server, monkeypatch):
    """``conversation.item.create`` past ``limits.realtime_max_items`` items, or past
    ``realtime_max_chars`` of text in the conversation, is an ``error`` event
    (``conversation_too_large``) and adds nothing; deleting items makes room; replies go on."""
    config = server.services.config
    monkeypatch.setattr(server.services, "config", config.model_copy(update={"limits": config.limits.model_copy(
        update={"realtime_max_items": 3, "realtime_max_chars": 1000})}))

    async def create(conn, item: dict):
        await conn.send({"type": "conversation.item.create", "item": item})
        async for event in conn:
            if event.type in ("conversation.item.done", "error"):
                return event

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "output_modalities": ["text"], "max_output_tokens": 4}, text=None)
            out = [await create(conn, user("a", "x" * 1001)), await create(conn, user("a", "x" * 600)),
                   await create(conn, user("b", "x" * 401)), await create(conn, user("b", "x" * 300))]
            await conn.response.create()  # a third item, the reply: replies go on
            out.append((await events_until(conn, "response.done"))[-1])
            out.append(await create(conn, user("c", "y")))
            await conn.conversation.item.delete(item_id="a")
            await events_until(conn, "conversation.item.deleted")
            out.append(await create(conn, user("c", "y")))
            return out

    too_long, a, too_much, b, reply, too_many, c = asyncio.run(run())
    for refused in (too_long, too_much, too_many):
        assert refused.type == "error" and refused.error.code == "conversation_too_large", refused
        assert refused.error.param == "item"
    assert "1001 characters" in too_long.error.message and "3 items" in too_many.error.message
    assert (a.item.id, b.item.id, c.item.id) == ("a", "b", "c") and reply.response.status in ANSWERED


async def answer_to(conn, event: dict):
    """The answer to the client ``event`` about an item: the item done, retrieved or deleted, or an error."""
    await conn.send(event)
    async with asyncio.timeout(10):
        async for reply in conn:
            if reply.type in ("conversation.item.done", "conversation.item.retrieved", "conversation.item.deleted",
                              "error"):
                return reply


def test_an_item_id_past_64_characters_is_an_error_event_and_adds_nothing(server):
    """A client's item id is at most 64 characters: a longer one is an ``error`` event
    (``string_above_max_length``, ``param: "item.id"``) that adds nothing. (Ids were kept whole and
    the bounds count only text: a session held 200 MB for 20 one-character items with 10 MB ids;
    hunt report GG, finding 1.)"""

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {**MANUAL, "output_modalities": ["text"]}, text=None)
            items = (user("x" * 65, "a"), {**user("y" * 65, "a"), "type": "function_call_output"}, user("z" * 64, "a"))
            out = [await answer_to(conn, {"type": "conversation.item.create", "item": item}) for item in items]
            return out + [await answer_to(conn, {"type": "conversation.item.retrieve", "item_id": "x" * 65})]

    long, long_output, kept, retrieved = asyncio.run(run())
    for refused in (long, long_output):
        assert (refused.error.code, refused.error.param) == ("string_above_max_length", "item.id"), refused
        assert "65 characters" in refused.error.message
    assert kept.type == "conversation.item.done" and kept.item.id == "z" * 64
    assert retrieved.type == "error" and retrieved.error.param == "item_id"  # the refused item was never added


def test_an_item_may_not_take_the_id_of_the_user_s_turn_in_progress(server):
    """``speech_started`` names the user's turn before its commit adds the item: a
    ``conversation.item.create`` with that id meanwhile is an ``error`` event, so the committed turn
    is the one item with it. (It was accepted, and the commit added a second item with the same
    id: the transcript overwrote the client's text in both; hunt report GG, finding 2.)"""
    speech = spoken("Tell me about the sea.", rate=RATE)

    async def run():
        async with client(server).realtime.connect(model="tiny-chat") as conn:
            await begin(conn, {"type": "realtime", "output_modalities": ["text"], "audio": {"input": {
                "turn_detection": {"type": "server_vad", "create_response": False}}}}, text=None)
            await conn.input_audio_buffer.append(audio=b64(speech))
            turn = (await events_until(conn, "input_audio_buffer.speech_started"))[-1].item_id
            refused = await answer_to(conn, {"type": "conversation.item.create", "item": user(turn, "typed")})
            await conn.input_audio_buffer.append(audio=b64(np.zeros(RATE, np.float32)))
            heard = await events_until(conn, "conversation.item.done")  # (its transcript's)
            deletes = [await answer_to(conn, {"type": "conversation.item.delete", "item_id": turn}) for _ in range(2)]
            return turn, refused, heard, deletes

    turn, refused, heard, (deleted, none_left) = asyncio.run(run())
    assert (refused.error.code, refused.error.param) == ("invalid_value", "item.id")
    assert "in progress" in refused.error.message
    assert [e.item_id for e in heard if e.type == "input_audio_buffer.committed"] == [turn]
    assert deleted.type == "conversation.item.deleted" and deleted.item_id == turn
    assert none_left.type == "error" and none_left.error.param == "item_id"  # one item had the id


def test_a_revoked_or_removed_key_ends_its_open_sessions_at_their_next_step(server):
    """A session looks its key up again, as HTTP would, before each step that makes a request: a
    managed key revoked (here through a client secret it made) or a key taken out of the key files
    ends its open session at the next response or transcription (an ``error`` event,
    ``invalid_api_key``, and a close with 1008), which starts no request; a key moved to another
    tier goes on. (Both went on for up to the session's 60 minutes, metered: hunt report GG, finding 5.)"""
    import httpx
    import websockets

    from gateway.auth import KeyRing

    admin = {"Authorization": f"Bearer {server.keys['admin']}"}
    ws_url = server.url.replace("http", "ws") + "/v1/realtime"
    hi = {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                       "content": [{"type": "input_text", "text": "hi"}]}}

    async def until(ws, last: str) -> tuple[list[dict], int | None]:
        """Events up to ``last``, or to the socket's close (then its code)."""
        out = []
        async with asyncio.timeout(60):
            try:
                while out[-1:] == [] or out[-1]["type"] != last:
                    out.append(json.loads(await ws.recv()))
            except websockets.ConnectionClosed as exc:
                return out, exc.rcvd.code if exc.rcvd else None
        return out, None

    key = httpx.post(f"{server.url}/admin/keys", json={"tier": "paid", "name": "revoked"}, headers=admin).json()
    secret = OpenAI(base_url=server.base_url, api_key=key["value"], max_retries=0).realtime.client_secrets.create(
        session={**MANUAL, "model": "tiny-chat", "output_modalities": ["text"], "max_output_tokens": 2}).value

    async def conversation():
        async with websockets.connect(ws_url, additional_headers={"Authorization": f"Bearer {secret}"}) as ws:
            await until(ws, "session.created")
            await ws.send(json.dumps(hi))
            await ws.send(json.dumps({"type": "response.create"}))
            before = await until(ws, "response.done")
            moved = httpx.patch(f"{server.url}/admin/keys/{key['id']}", json={"tier": "free"}, headers=admin)
            await ws.send(json.dumps({"type": "response.create"}))
            after_move = await until(ws, "response.done")
            revoked = httpx.delete(f"{server.url}/admin/keys/{key['id']}", headers=admin)
            await ws.send(json.dumps({"type": "response.create"}))
            return before, (moved.status_code, after_move), (revoked.status_code, await until(ws, "response.done"))

    before, (moved, after_move), (revoked, (events, code)) = asyncio.run(conversation())
    assert before[1] is None and before[0][-1]["response"]["status"] in ANSWERED
    assert moved == 200 and after_move[1] is None and after_move[0][-1]["response"]["status"] in ANSWERED
    assert revoked == 200 and code == 1008
    assert [e["type"] for e in events] == ["error"]  # no response.created: nothing more was asked of a model
    assert (events[0]["error"]["code"], events[0]["error"]["type"]) == ("invalid_api_key", "invalid_request_error")

    original, removed = server.services.keys, "key-paid-removed"
    tiers = ["paid", "subscriber", "free", "batch"]
    server.services.keys = KeyRing({t: [server.keys[t]] + ([removed] if t == "paid" else []) for t in tiers},
                                   [server.keys["admin"]])

    async def transcription():
        try:
            async with websockets.connect(f"{ws_url}?model=tiny-stt",
                                          additional_headers={"Authorization": f"Bearer {removed}"}) as ws:
                await until(ws, "session.created")
                server.services.keys = original  # the key files' reload, the key taken out
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(np.zeros(RATE // 2))}))
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                return await until(ws, "conversation.item.input_audio_transcription.completed")
        finally:
            server.services.keys = original

    events, code = asyncio.run(transcription())
    assert code == 1008  # (the commit, or the session's own look at its key, came first: either ends it)
    assert [e["type"] for e in events] in (["input_audio_buffer.committed", "error"], ["error"])
    assert events[-1]["error"]["code"] == "invalid_api_key"


def test_an_idle_session_of_a_revoked_key_ends_within_a_second(server):
    """A session that sends nothing after its key is revoked (no step to look the key up before)
    still ends: it looks its key up every ``KEY_CHECK_S``, so within about a second there is an
    ``error`` event, ``invalid_api_key``, and a close with 1008, not the session's 60 minutes.
    A key that stands is not disturbed: its idle session stays open."""
    import httpx
    import websockets

    admin = {"Authorization": f"Bearer {server.keys['admin']}"}
    ws_url = server.url.replace("http", "ws") + "/v1/realtime?model=tiny-stt"
    key = httpx.post(f"{server.url}/admin/keys", json={"tier": "paid", "name": "idle"}, headers=admin).json()
    revoking, standing = ({"Authorization": f"Bearer {k}"} for k in (key["value"], server.keys["paid"]))

    async def idle():
        async with websockets.connect(ws_url, additional_headers=revoking) as ws, \
                websockets.connect(ws_url, additional_headers=standing) as kept:
            assert json.loads(await ws.recv())["type"] == "session.created"
            assert json.loads(await kept.recv())["type"] == "session.created"
            assert httpx.delete(f"{server.url}/admin/keys/{key['id']}", headers=admin).status_code == 200
            revoked = time.monotonic()
            events = []
            with pytest.raises(websockets.ConnectionClosed) as closed:
                async with asyncio.timeout(10):
                    while True:
                        events.append(json.loads(await ws.recv()))
            ended = time.monotonic() - revoked
            await kept.send(json.dumps({"type": "input_audio_buffer.clear"}))
            return events, closed.value.rcvd.code, ended, json.loads(await kept.recv())["type"]

    events, code, ended, still = asyncio.run(idle())
    assert [(e["type"], e["error"]["code"]) for e in events] == [("error", "invalid_api_key")] and code == 1008
    assert ended < 5 and still == "input_audio_buffer.cleared"
