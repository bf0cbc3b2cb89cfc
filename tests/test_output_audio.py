"""Spoken chat replies (gateway/output_audio.py): ``modalities: ["text", "audio"]`` writes the reply,
then the text-to-speech model tiers.yaml names for the chat model (``engine.audio_output``) says it.
Checked against the same request without audio (the transcript is that reply's text) and against
/v1/audio/speech of that text (the audio's length: the demo VITS' durations are deterministic, its
waveform is not), through the openai SDK."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import math
import re
import time

import av
import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from gateway.output_audio import PCM16_RATE, SpokenReplies
from tests.helpers import declare_vram, engine_options, run_batch, start_server, write_config

ASK = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Tell me about the sea."}]
SPOKEN = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}


@pytest.fixture(scope="module")
def server(tiny_chat, tiny_tts, tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("output-audio"), {
        "tiny-chat": ("chat", tiny_chat), "tiny-chat-mute": ("chat", tiny_chat), "tiny-tts": ("tts", tiny_tts)})
    engine_options(config, "tiny-chat", tiny_chat, audio_output="tiny-tts")
    running = start_server(config)
    yield running
    running.stop()


def client(server, tier="paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, timeout=120)


def chat(c: openai.OpenAI, messages=ASK, model="tiny-chat", **kw):
    return c.chat.completions.create(**{"model": model, "messages": messages, "max_tokens": 12, "temperature": 0, **kw})


def speech_samples(c: openai.OpenAI, text: str) -> tuple[int, int]:
    """(samples, rate) of /v1/audio/speech saying ``text`` in alloy's voice, as wav."""
    x, rate = sf.read(io.BytesIO(c.audio.speech.create(model="tiny-tts", voice="alloy", input=text,
                                                       response_format="wav").content))
    return len(x), rate


def test_a_spoken_reply_is_the_written_reply_said(server):
    c = client(server)
    written = chat(c).choices[0].message.content
    assert written  # the random model writes something; what, the test takes from the text reply
    reply = chat(c, **SPOKEN)
    message = reply.choices[0].message
    assert message.content is None
    assert message.audio.transcript == written
    assert message.audio.id.startswith("audio_") and message.audio.expires_at > reply.created + 3500
    data = base64.b64decode(message.audio.data)
    assert data[:4] == b"RIFF" and int.from_bytes(data[4:8], "little") == len(data) - 8  # a whole file's sizes
    x, rate = sf.read(io.BytesIO(data))
    assert (len(x), rate) == speech_samples(c, written)
    assert np.abs(x).max() > 0.001  # sound, not silence
    assert reply.usage.completion_tokens == chat(c).usage.completion_tokens


def test_the_request_log_line_is_the_chats(server, caplog):
    """The speech is metered and gated as its own request, but the HTTP request's log line keeps
    the chat's model, waits and tokens."""
    caplog.set_level("INFO", logger="tiergate.requests")
    reply = client(server).chat.completions.with_raw_response.create(
        model="tiny-chat", messages=ASK, max_tokens=12, temperature=0, extra_headers={"x-request-id": "spoken-1"},
        **SPOKEN).parse()
    deadline = time.monotonic() + 10  # the line is logged once the response's last byte has gone out
    while not (lines := [r.request for r in caplog.records if getattr(r, "request", {}).get("request_id") == "spoken-1"]):
        assert time.monotonic() < deadline, "no request log line"
        time.sleep(0.01)
    line = lines[0]
    assert (line["model"], line["completion_tokens"], line["status"]) == \
        ("tiny-chat", reply.usage.completion_tokens, 200)


def test_the_speech_is_metered_as_a_speech_request_of_the_tier(server):
    """A subscriber's spoken reply: one subscriber speech request in /metrics, and the audio's
    seconds in the key's usage (on the speech model)."""
    def seen() -> tuple[float, float]:
        text = httpx.get(f"{server.url}/metrics").text
        found = re.search(r'^tiergate_request_seconds_count\{(?=[^}]*tier="subscriber")(?=[^}]*endpoint="speech")[^}]*\}'
                          r" (\S+)$", text, re.M)
        r = httpx.get(f"{server.url}/admin/usage", params={"group_by": "tier", "model": "tiny-tts"},
                      headers={"Authorization": f"Bearer {server.keys['admin']}"})
        assert r.status_code == 200, r.text
        said = sum(row.get("audio_out_seconds", 0) for row in r.json()["data"] if row.get("tier") == "subscriber")
        return float(found.group(1)) if found else 0.0, said

    before = seen()
    message = chat(client(server, "subscriber"), **SPOKEN).choices[0].message
    x, rate = sf.read(io.BytesIO(base64.b64decode(message.audio.data)))
    after = seen()
    assert after[0] == before[0] + 1
    assert after[1] == pytest.approx(before[1] + len(x) / rate, abs=0.01)


@pytest.mark.parametrize("fmt", ["mp3", "flac", "opus", "aac"])
def test_every_format_decodes_to_the_same_speech(server, fmt):
    from workers.audio import supported_speech_formats

    if fmt not in supported_speech_formats():
        pytest.skip(f"this libsndfile cannot write {fmt}")
    c = client(server)
    message = chat(c, modalities=["text", "audio"], audio={"voice": "alloy", "format": fmt}).choices[0].message
    data = base64.b64decode(message.audio.data)
    samples, rate = speech_samples(c, message.audio.transcript)
    if fmt == "aac":
        with av.open(io.BytesIO(data)) as f:
            decoded = np.concatenate([frame.to_ndarray().ravel() for frame in f.decode(audio=0)])
            seconds = len(decoded) / f.streams.audio[0].rate
    else:
        x, got = sf.read(io.BytesIO(data))
        seconds = len(x) / got
    assert abs(seconds - samples / rate) < 0.1  # encoders pad to their frames and may resample


def test_a_streamed_spoken_reply_sends_its_speech_a_phrase_at_a_time_in_pcm16_at_24khz(server):
    """Streamed, the transcript goes out as it is written and the speech a phrase at a time, each
    phrase a speech request of its own (counted in /metrics) started as soon as it is written (how
    much sooner the first sound comes is bench_voice's to measure, on the realtime path that shares
    the phrasing), its sound the phrases' sound said apart, in order, in deltas of at most 100 ms
    (``AUDIO_DELTA_BYTES``)."""
    from gateway.audio import AUDIO_DELTA_BYTES
    from gateway.output_audio import phrases_of
    from tests.test_realtime_conversation import speech_requests

    c = client(server)
    whole = chat(c, max_tokens=64, **SPOKEN).choices[0].message.audio.transcript
    before = speech_requests(server)
    chunks = list(chat(c, max_tokens=64, stream=True, modalities=["text", "audio"],
                       audio={"voice": "alloy", "format": "pcm16"}))
    deltas = [(ch.choices[0].delta.model_extra or {}).get("audio") for ch in chunks if ch.choices]
    opening, final = deltas[0], deltas[-1]
    assert opening["transcript"] == "" and opening["id"].startswith("audio_")
    assert chunks[0].choices[0].delta.content is None
    transcript = "".join(d.get("transcript", "") for d in deltas if d)
    assert transcript == whole
    pending, phrases = "", []
    for d in deltas:
        if d and d.get("transcript"):
            ready, pending = phrases_of(pending + d["transcript"], first=not phrases)
            phrases += ready
    phrases += [pending] if pending.strip() else []
    assert len(phrases) >= 2, whole  # the premise: a reply of several phrases
    assert speech_requests(server) == before + len(phrases)
    first_data = next(i for i, d in enumerate(deltas) if d and "data" in d)
    assert any(d and d.get("transcript") for d in deltas[1:first_data])  # a phrase is written before it is said
    pieces = [base64.b64decode(d["data"]) for d in deltas if d and "data" in d]
    pcm = b"".join(pieces)
    assert len(pcm) % 2 == 0 and len(pcm) > AUDIO_DELTA_BYTES and max(map(len, pieces)) <= AUDIO_DELTA_BYTES
    expected, rounding = 0.0, 0
    for phrase in phrases:
        samples, rate = speech_samples(c, phrase)
        expected += samples * PCM16_RATE / rate
        rounding += phrase.count(".") + phrase.count("!") + phrase.count("?") + 1  # each sentence resampled apart
    assert abs(len(pcm) // 2 - expected) <= rounding
    assert final == {"id": opening["id"], "expires_at": final["expires_at"]}
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1] if ch.choices)
    # and the id reads back as the transcript in the next turn
    back = chat(c, messages=[*ASK, {"role": "assistant", "audio": {"id": opening["id"]}},
                             {"role": "user", "content": "And?"}])
    said = chat(c, messages=[*ASK, {"role": "assistant", "content": whole}, {"role": "user", "content": "And?"}])
    assert back.usage.prompt_tokens == said.usage.prompt_tokens


def test_a_later_turn_sends_the_reply_back_by_its_audio_id(server):
    c = client(server)
    message = chat(c, **SPOKEN).choices[0].message
    turn = [*ASK, {"role": "assistant", "audio": {"id": message.audio.id}}, {"role": "user", "content": "More?"}]
    written = [*ASK, {"role": "assistant", "content": message.audio.transcript}, {"role": "user", "content": "More?"}]
    assert (chat(c, messages=turn).choices[0].message.content, chat(c, messages=turn).usage.prompt_tokens) == \
        (chat(c, messages=written).choices[0].message.content, chat(c, messages=written).usage.prompt_tokens)
    # another key's reply, an id never made, and audio on a user message are 400s naming the field
    for key, sent, param in [
        (client(server, "free"), {"role": "assistant", "audio": {"id": message.audio.id}}, "messages[2].audio.id"),
        (c, {"role": "assistant", "audio": {"id": "audio_nope"}}, "messages[2].audio.id"),
        (c, {"role": "assistant", "audio": {"id": message.audio.id, "data": "x"}}, "messages[2].audio"),
        (c, {"role": "user", "audio": {"id": message.audio.id}}, "messages[2].audio"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            chat(key, messages=[*ASK, sent, {"role": "user", "content": "More?"}])
        assert caught.value.body["param"] == param, sent


def test_what_cannot_be_spoken_is_refused_before_anything_is_written(server):
    c = client(server)
    for kw, param, code in [
        ({"model": "tiny-chat-mute", **SPOKEN}, "modalities", "audio_output_not_supported"),
        ({"modalities": ["text", "audio"]}, "audio", "missing_required_parameter"),
        ({"audio": SPOKEN["audio"]}, "audio", "invalid_value"),
        ({"modalities": ["audio"], "audio": SPOKEN["audio"]}, "modalities", "invalid_value"),
        ({**SPOKEN, "audio": {"voice": "nobody", "format": "wav"}}, "audio.voice", "invalid_value"),
        ({**SPOKEN, "audio": {"voice": "alloy", "format": "ogg"}}, "audio.format", "invalid_value"),
        ({**SPOKEN, "stream": True}, "audio.format", "invalid_value"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            chat(c, **kw)
        assert (caught.value.body["param"], caught.value.body["code"]) == (param, code), kw


def test_a_key_with_concurrent_1_gets_its_streamed_reply_said(server):
    """A streamed reply is said a phrase at a time while it is written: each phrase's speech is a
    step of the reply's own request, which the key's ``concurrent`` limit counts once. (A key with
    ``concurrent: 1`` had its first phrase refused by its own reply, ``rate_limit_exceeded`` in
    the stream: hunt report GG, finding 4.) Nothing stays counted once the reply has ended."""
    made = httpx.post(f"{server.url}/admin/keys", json={"name": "one at a time", "tier": "paid",
                                                         "limits": {"concurrent": 1}},
                      headers={"Authorization": f"Bearer {server.keys['admin']}"}, timeout=30)
    assert made.status_code == 201, made.text
    c = openai.OpenAI(base_url=server.base_url, api_key=made.json()["value"], max_retries=0, timeout=120)
    chunks = list(chat(c, max_tokens=64, stream=True, modalities=["text", "audio"],
                       audio={"voice": "alloy", "format": "pcm16"}))
    deltas = [(ch.choices[0].delta.model_extra or {}).get("audio") for ch in chunks if ch.choices]
    assert sum(1 for d in deltas if d and d.get("data")) >= 2  # the phrases were said
    assert server.services.accounts.limiter._inflight.get(made.json()["id"], 0) == 0
    assert chat(c).choices[0].message.content  # and the key's next request is admitted


def test_a_key_that_may_not_use_the_speech_model_is_refused_a_spoken_reply_before_it_is_written(server):
    """A key whose allow-list leaves out the chat model's speech model has a chat model that does
    not speak (docs/ACCOUNTS.md: "as if the model did not exist"): the refusal tiny-chat-mute gets,
    naming no speech model, before the reply is written, rather than a 404 for tiny-tts once it is."""
    made = httpx.post(f"{server.url}/admin/keys", json={"name": "chat only", "tier": "paid",
                                                         "models": ["tiny-chat", "tiny-chat-mute"]},
                      headers={"Authorization": f"Bearer {server.keys['admin']}"}, timeout=30)
    assert made.status_code == 201, made.text
    c = openai.OpenAI(base_url=server.base_url, api_key=made.json()["value"], max_retries=0, timeout=120)
    assert chat(c).choices[0].message.content  # the chat model itself it may use
    for kw in ({**SPOKEN}, {**SPOKEN, "audio": {"voice": "alloy", "format": "pcm16"}, "stream": True}):
        refused = []
        for model in ("tiny-chat", "tiny-chat-mute"):
            with pytest.raises(openai.BadRequestError) as caught:
                chat(c, **{**kw, "model": model})
            refused.append(caught.value.body)
        assert (refused[0]["param"], refused[0]["code"]) == ("modalities", "audio_output_not_supported"), kw
        assert refused[0]["message"] == refused[1]["message"].replace("tiny-chat-mute", "tiny-chat")
        assert "tiny-tts" not in refused[0]["message"]


def test_a_reply_with_only_tool_calls_is_not_said(server):
    c = client(server)
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
        "q": {"type": "string", "maxLength": 4}}, "required": ["q"], "additionalProperties": False}}}
    reply = c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=40, temperature=0, tools=[tool],
                                      tool_choice="required", **SPOKEN)
    message = reply.choices[0].message
    assert message.tool_calls and message.audio is None and message.content is None


def test_a_batch_line_and_a_stored_completion(server):
    c = client(server)
    body = {"model": "tiny-chat", "messages": ASK, "max_tokens": 12, "temperature": 0, **SPOKEN}
    batch = run_batch(c, "/v1/chat/completions", [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                                   "body": body}])
    assert batch.request_counts.completed == 1
    line = json.loads(c.files.content(batch.output_file_id).text)
    audio = line["response"]["body"]["choices"][0]["message"]["audio"]
    assert audio["transcript"] == chat(c).choices[0].message.content
    assert sf.read(io.BytesIO(base64.b64decode(audio["data"])))[0].size > 0
    # stored: the transcript and the id, not the file
    reply = chat(c, store=True, **SPOKEN)
    stored = c.chat.completions.retrieve(reply.id).choices[0].message
    assert stored.audio.transcript == reply.choices[0].message.audio.transcript
    assert stored.audio.id == reply.choices[0].message.audio.id and not stored.audio.data


def test_audio_output_must_name_a_text_to_speech_model(tiny_chat, tiny_tts, tmp_path):
    from gateway.config import ConfigError, load_config

    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat), "tiny-tts": ("tts", tiny_tts)})
    engine_options(config, "tiny-chat", tiny_chat, audio_output="tiny-chat")
    with pytest.raises(ConfigError, match=r"models\[0\].engine.audio_output: 'tiny-chat' is not a text-to-speech model"):
        load_config(config)


def test_spoken_replies_are_kept_for_their_key_until_they_expire():
    now = [1000.0]
    kept = SpokenReplies(kept_s=60, max_items=2, clock=lambda: now[0])
    assert kept.put("k1", "audio_a", "one") == 1060
    kept.put("k1", "audio_b", "two")
    assert (kept.get("k1", "audio_a"), kept.get("k2", "audio_a"), kept.get("k1", "audio_z")) == ("one", None, None)
    kept.put("k2", "audio_c", "three")  # past max_items: the oldest goes
    assert (kept.get("k1", "audio_a"), kept.get("k1", "audio_b"), kept.get("k2", "audio_c")) == (None, "two", "three")
    now[0] = 1060.0
    assert kept.get("k1", "audio_b") is None and kept.get("k2", "audio_c") is None
    assert math.isclose(kept.put("k1", "audio_d", "four"), 1120)


def test_a_reply_the_speech_model_cannot_say_is_no_audio_not_an_error():
    """A written reply of only characters the speech model does not know (emoji, for VITS'
    character vocabulary) was already sent to the engine and paid for: it is said as nothing
    (``SpeechJob.quiet``), where /v1/audio/speech answers such an input with a 400."""

    from gateway.audio import _first_sentence
    from gateway.errors import APIError
    from gateway.output_audio import Voice
    from workers.base import StepContext

    class Unspeaking:
        def synthesize(self, request, ctx):
            raise ValueError("input has no speakable text")

    voice = Voice("tiny-tts", "alloy", "wav", None, 16000)
    ctx, chunks, first = asyncio.run(_first_sentence(Unspeaking(), voice.job("💥💥"), StepContext()))
    assert (list(chunks), first) == ([], None)
    with pytest.raises(APIError) as caught:
        asyncio.run(_first_sentence(Unspeaking(), dataclasses.replace(voice.job("💥💥"), quiet=False), StepContext()))
    assert (caught.value.status, caught.value.param) == (400, "input")


def test_each_choice_is_said_apart(server):
    c = client(server)
    whole = chat(c, n=2, seed=5, temperature=1.0, **SPOKEN)
    chunks = list(chat(c, n=2, seed=5, temperature=1.0, stream=True, modalities=["text", "audio"],
                       audio={"voice": "alloy", "format": "pcm16"}))
    by_choice: dict[int, list[dict]] = {0: [], 1: []}
    for ch in chunks:
        for choice in ch.choices:
            if (choice.delta.model_extra or {}).get("audio"):
                by_choice[choice.index].append(choice.delta.model_extra["audio"])
    ids = set()
    for i, deltas in by_choice.items():
        assert "".join(d.get("transcript", "") for d in deltas) == whole.choices[i].message.audio.transcript
        assert b"".join(base64.b64decode(d["data"]) for d in deltas if "data" in d)
        ids.add(deltas[-1]["id"])
        assert deltas[-1]["id"] == deltas[0]["id"] and deltas[-1]["expires_at"]
    assert len(ids) == 2 and ids.isdisjoint({c.message.audio.id for c in whole.choices})


def test_a_spoken_stream_says_each_phrase_once_written_in_order_and_raises_a_refusal():
    """``SpokenStream`` (a streamed reply's speech): a phrase is said as soon as it is written, the
    rest once the choice is written, each choice's pieces in order; a speech request refused
    mid-stream (a 429 from the speech model's gate) raises where the stream takes its sound."""
    from gateway.errors import APIError
    from gateway.output_audio import SpokenStream

    asked: list[str] = []

    async def speaker(text: str):
        asked.append(text)
        if text.startswith("Refused"):
            raise APIError(429, "the speech model is busy", "rate_limit_exceeded")
        for word in text.split():
            await asyncio.sleep(0)
            yield word.encode()

    async def run():
        stream = SpokenStream(speaker, 2)
        stream.write(0, "Hello there. How")
        await asyncio.sleep(0.05)
        early = stream.ready()
        stream.write(0, " are you")
        rest = [piece async for piece in stream.rest(0)]
        stream.write(1, "Refused, at once. More")
        with pytest.raises(APIError) as caught:
            for _ in range(100):
                stream.ready()
                await asyncio.sleep(0.01)
        await stream.aclose()
        return early, rest, caught.value

    early, rest, refusal = asyncio.run(run())
    assert early == [(0, b"Hello"), (0, b"there.")]  # said before the choice was written
    assert rest == [(0, b"How"), (0, b"are"), (0, b"you")]
    assert asked == ["Hello there.", "How are you", "Refused,"]
    assert (refusal.status, refusal.code) == (429, "rate_limit_exceeded")


TIGHT_WINDOW_S = 2


@pytest.fixture(scope="module")
def tight(tiny_chat, tiny_tts, tiny_stt, tmp_path_factory):
    """A budget of 4 GiB and three models of 3 GiB: the chat model and either speech model do
    not fit together; protection for 2 s."""
    models = {"tiny-chat": ("chat", tiny_chat), "tiny-tts": ("tts", tiny_tts), "tiny-stt": ("stt", tiny_stt)}
    config = write_config(tmp_path_factory.mktemp("tight-audio"), models,
                          f"eviction:\n  protect_window_s: {TIGHT_WINDOW_S}\n")
    engine_options(config, "tiny-chat", tiny_chat, audio_output="tiny-tts", audio_input="tiny-stt")
    declare_vram(config, "3GiB", tiny_chat, tiny_tts, tiny_stt)
    running = start_server(config)
    yield running
    running.stop()


def test_a_chain_whose_models_do_not_fit_together_is_served_step_by_step(tight):
    """Speech in, a chat, speech out, on a budget that holds one of them: each step evicts the
    model the request's own step before used (its protection from that use does not hold against
    the request itself), where each step's 429 "model_protected" came back at every retry. Another
    request is still held off by the chain's protection (and the next chain waits out the last's)."""
    c = client(tight)
    spoken = chat(c, **SPOKEN).choices[0].message
    assert spoken.audio.transcript and base64.b64decode(spoken.audio.data)[:4] == b"RIFF"
    time.sleep(TIGHT_WINDOW_S + 0.2)
    chunks = list(chat(c, max_tokens=64, stream=True, modalities=["text", "audio"],
                       audio={"voice": "alloy", "format": "pcm16"}))
    deltas = [(ch.choices[0].delta.model_extra or {}).get("audio") for ch in chunks if ch.choices]
    assert "".join(d.get("transcript", "") for d in deltas if d)
    assert sum(len(base64.b64decode(d["data"])) for d in deltas if d and "data" in d) > 0
    assert chunks[-1].choices[0].finish_reason == "length"
    time.sleep(TIGHT_WINDOW_S + 0.2)
    said = io.BytesIO()
    sf.write(said, np.sin(np.arange(16000) * 0.05) * 0.3, 16000, format="WAV", subtype="PCM_16")
    data = base64.b64encode(said.getvalue()).decode()
    heard = chat(c, messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}]}])
    assert heard.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.RateLimitError) as held_off:  # tiny-chat, just used by paid, is protected from free
        client(tight, "free").audio.speech.create(model="tiny-tts", voice="alloy", input="Hello.",
                                                  response_format="wav")
    assert held_off.value.body["code"] == "model_protected"
