"""Audio in a chat message (gateway/input_audio.py): an ``input_audio`` part is heard by the
speech-to-text model tiers.yaml names for the chat model (``engine.audio_input``), and its
transcript read where the audio was. Checked against /v1/audio/transcriptions of the same file
and the same chat request with that transcript as text."""

from __future__ import annotations

import base64
import io
import json
import struct

import numpy as np
import openai
import pytest
import soundfile as sf

from tests.helpers import engine_options, run_batch, spoken, start_server, write_config

SAID = "Where is the gold?"


@pytest.fixture(scope="module")
def server(tiny_chat, tiny_stt, tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("input-audio"), {
        "tiny-chat": ("chat", tiny_chat), "tiny-chat-deaf": ("chat", tiny_chat), "tiny-stt": ("stt", tiny_stt)})
    engine_options(config, "tiny-chat", tiny_chat, audio_input="tiny-stt")
    running = start_server(config)
    yield running
    running.stop()


def client(server, tier="paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, timeout=120)


def wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    sf.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def claiming(data: bytes, rate: int) -> bytes:
    """The WAV ``data`` with its header's sample rate (and byte rate) made ``rate``."""
    out = bytearray(data)
    struct.pack_into("<II", out, 24, rate, (rate * 2) & 0xFFFFFFFF)
    return bytes(out)


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def test_an_input_audio_part_is_read_as_its_transcript(server):
    c = client(server)
    speech = wav(spoken(SAID))
    heard = c.audio.transcriptions.create(model="tiny-stt", file=("said.wav", io.BytesIO(speech))).text.strip()
    assert heard  # the random model hears something; what, the test takes from the endpoint

    def chat(part: dict, model: str = "tiny-chat", key=c):
        return key.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "Listen:"}, part]}])

    got = chat(audio_part(speech))
    want = chat({"type": "text", "text": heard})
    assert (got.choices[0].message.content, got.usage.prompt_tokens) == \
        (want.choices[0].message.content, want.usage.prompt_tokens)
    # in a Batch API line too
    body = {"model": "tiny-chat", "max_tokens": 6, "temperature": 0, "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Listen:"}, audio_part(speech)]}]}
    batch = run_batch(c, "/v1/chat/completions", [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                                   "body": body}])
    assert batch.request_counts.completed == 1
    line = json.loads(c.files.content(batch.output_file_id).text)
    assert line["response"]["body"]["choices"][0]["message"]["content"] == want.choices[0].message.content

    deaf = "messages[1].content"
    part = "messages[1].content[1]"
    for model, given, param, code in [
        ("tiny-chat-deaf", audio_part(speech), deaf, "audio_input_not_supported"),
        ("tiny-chat", audio_part(speech, "flac"), f"{part}.input_audio.format", "invalid_value"),
        ("tiny-chat", {"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}},
         f"{part}.input_audio.data", "invalid_value"),
        ("tiny-chat", audio_part(b"RIFF not a wave file"), f"{part}.input_audio.data", "invalid_value"),
        # a header's rate no audio has (2**31-1 Hz was a 500: the resampling filter's 320 GiB)
        ("tiny-chat", audio_part(claiming(speech, 2**31 - 1)), f"{part}.input_audio.data", "invalid_value"),
        ("tiny-chat", {"type": "input_audio", "input_audio": {"format": "wav"}}, f"{part}.input_audio.data",
         "missing_required_parameter"),
        ("tiny-chat", {"type": "input_audio", "input_audio": "x"}, part, "invalid_value"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            chat(given, model)
        assert (caught.value.body["param"], caught.value.body["code"]) == (param, code), given
    with pytest.raises(openai.BadRequestError) as caught:  # audio is the user's
        c.chat.completions.create(model="tiny-chat", max_tokens=2, messages=[
            {"role": "system", "content": [audio_part(speech)]}, {"role": "user", "content": "hi"}])
    assert caught.value.body["param"] == "messages[0].role"


def test_a_key_that_may_not_use_the_speech_to_text_model_is_refused_audio_as_by_a_deaf_model(server):
    """A key whose allow-list leaves out the chat model's speech-to-text model has a chat model
    that takes no audio (docs/ACCOUNTS.md: "as if the model did not exist"): the 400 a model with
    no engine.audio_input gets, naming no speech model, not a 404 for tiny-stt."""
    import httpx

    made = httpx.post(f"{server.url}/admin/keys", json={"name": "chat only", "tier": "paid",
                                                         "models": ["tiny-chat", "tiny-chat-deaf"]},
                      headers={"Authorization": f"Bearer {server.keys['admin']}"}, timeout=30)
    assert made.status_code == 201, made.text
    c = openai.OpenAI(base_url=server.base_url, api_key=made.json()["value"], max_retries=0, timeout=120)
    refused = []
    for model in ("tiny-chat", "tiny-chat-deaf"):
        with pytest.raises(openai.BadRequestError) as caught:
            c.chat.completions.create(model=model, max_tokens=2, messages=[
                {"role": "user", "content": [audio_part(wav(spoken(SAID)))]}])
        refused.append(caught.value.body)
    assert (refused[0]["param"], refused[0]["code"]) == ("messages[0].content", "audio_input_not_supported")
    assert refused[0]["message"] == refused[1]["message"].replace("tiny-chat-deaf", "tiny-chat")
    assert "tiny-stt" not in refused[0]["message"]


def test_audio_input_must_name_a_speech_to_text_model(tiny_chat, tiny_stt, tmp_path):
    from gateway.config import ConfigError, load_config

    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat), "tiny-stt": ("stt", tiny_stt)})
    engine_options(config, "tiny-chat", tiny_chat, audio_input="tiny-chat")
    with pytest.raises(ConfigError, match=r"models\[0\].engine.audio_input: 'tiny-chat' is not a speech-to-text model"):
        load_config(config)


def test_a_request_refused_for_any_field_hears_no_audio_and_is_not_metered(server):
    """The whole request is checked before its audio is heard: a 400 for another field (a sampling
    value, an unknown field, the reply limit, a later audio part's bad base64) spends no
    speech-to-text work and leaves nothing in the key's usage (it was heard, and billed, first)."""
    import httpx

    c = client(server, "subscriber")
    part = audio_part(wav(spoken(SAID)))
    bad = {"type": "input_audio", "input_audio": {"data": "@@@", "format": "wav"}}
    for extra, parts, param in [({"temperature": 99}, [part], "temperature"),
                                ({"extra_body": {"bogus_field": 1}}, [part], "bogus_field"),
                                ({"max_tokens": 100000}, [part], "max_tokens"),
                                ({}, [part, bad], "messages[0].content[1].input_audio.data")]:
        with pytest.raises(openai.BadRequestError) as caught:
            c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": parts}],
                                      **{"max_tokens": 2, **extra})
        assert caught.value.body["param"] == param, extra

    def usage() -> list[dict]:
        return httpx.get(f"{server.base_url}/usage", headers={"Authorization": f"Bearer {server.keys['subscriber']}"},
                         timeout=30).json()["data"]

    assert usage() == []
    c.chat.completions.create(model="tiny-chat", max_tokens=2, messages=[{"role": "user", "content": [part]}])
    assert sum(row["audio_in_seconds"] for row in usage()) > 0  # what a served one is metered


def test_long_base64_audio_is_decoded_off_the_event_loop(monkeypatch):
    """An input_audio part's base64 past INLINE_DECODE characters is decoded on a thread (a
    25 MiB file's took the event loop from every other request for 0.1-0.25 s); a short one
    stays on the loop, where the hop would cost as much as the work. Both decode the same."""
    import asyncio
    from types import SimpleNamespace

    import gateway.input_audio as input_audio

    where, decode = [], input_audio._base64

    def watched(data: str) -> bytes:
        try:
            asyncio.get_running_loop()
            where.append("loop")
        except RuntimeError:
            where.append("thread")
        return decode(data)

    monkeypatch.setattr(input_audio, "_base64", watched)
    limits = SimpleNamespace(transcription_max_bytes=2**24, transcription_max_seconds=1800)
    svc = SimpleNamespace(config=SimpleNamespace(limits=limits))
    short, long = audio_part(wav(np.zeros(1600, np.float32))), audio_part(wav(np.zeros(64000, np.float32)))
    assert len(short["input_audio"]["data"]) <= input_audio.INLINE_DECODE < len(long["input_audio"]["data"])
    got = [asyncio.run(input_audio._decoded(svc, p, "messages[0].content[0]")) for p in (short, long)]
    assert where == ["loop", "thread"]
    assert [(len(samples), rate) for samples, rate in got] == [(1600, 16000), (64000, 16000)]
