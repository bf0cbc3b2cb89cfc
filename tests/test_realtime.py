"""The Realtime API's transcription sessions (``/v1/realtime``) through the openai SDK's own
realtime client: committed by the client and by ``server_vad``, errors as ``error`` events that
leave the session open, the handshake's refusals, and each utterance metered as a request of the
caller's tier. Speech from Debian's espeak-ng (``tests.helpers.spoken``)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets
from openai import AsyncOpenAI, OpenAI
from starlette.websockets import WebSocketState

from gateway.realtime import SessionConfig, TranscriptionSession
from tests.helpers import RunningServer, spoken, start_server, write_config
from workers.stt import ServerVad, Transcript, TurnDetector

RATE = 24000


@pytest.fixture(scope="module")
def server(tiny_stt, tiny_chat, tmp_path_factory) -> RunningServer:
    folder = tmp_path_factory.mktemp("realtime-server")
    running = start_server(write_config(folder, {"tiny-stt": ("stt", tiny_stt), "tiny-chat": ("chat", tiny_chat)}))
    yield running
    running.stop()


def client(server: RunningServer, tier: str = "paid") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0)


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def b64(x: np.ndarray) -> str:
    return base64.b64encode(pcm16(x)).decode()


def wav_of(x: np.ndarray) -> bytes:
    """``x`` as the session hears it (PCM16), in a WAV file for the HTTP endpoint."""
    out = io.BytesIO()
    sf.write(out, np.frombuffer(pcm16(x), "<i2").astype(np.float32) / 32768, RATE, format="WAV")
    return out.getvalue()


async def events_until(conn, last: str, timeout: float = 60) -> list:
    """Server events up to and including the first of type ``last``."""
    out = []
    async with asyncio.timeout(timeout):
        async for event in conn:
            out.append(event)
            if event.type == last:
                return out
    raise AssertionError(f"the session ended before {last}: {[e.type for e in out]}")


async def manual(conn) -> None:
    """A session opened and set to ``MANUAL`` (the client commits each utterance)."""
    await events_until(conn, "session.created")
    await conn.session.update(session=MANUAL)
    await events_until(conn, "session.updated")


MANUAL = {"type": "transcription", "audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE},
                                                        "transcription": {"model": "tiny-stt", "language": "en"},
                                                        "turn_detection": None}}}


def test_a_committed_utterance_streams_the_text_the_http_endpoint_gives(server):
    speech = spoken("Hello from the realtime session.", rate=RATE)
    http = OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0)
    expected = http.audio.transcriptions.create(model="tiny-stt", file=("a.wav", wav_of(speech)), language="en").text

    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as conn:
            created = await events_until(conn, "session.created")
            assert created[-1].session.type == "transcription"
            await conn.session.update(session=MANUAL)
            updated = await events_until(conn, "session.updated")
            assert updated[-1].session.audio.input.turn_detection is None
            for i in range(0, len(speech), 4800):  # 200 ms chunks
                await conn.input_audio_buffer.append(audio=b64(speech[i:i + 4800]))
            await conn.input_audio_buffer.commit()
            return await events_until(conn, "conversation.item.input_audio_transcription.completed")

    events = asyncio.run(run())
    committed = next(e for e in events if e.type == "input_audio_buffer.committed")
    deltas = [e for e in events if e.type == "conversation.item.input_audio_transcription.delta"]
    done = events[-1]
    assert {e.item_id for e in deltas} <= {committed.item_id} and done.item_id == committed.item_id
    assert done.transcript == expected == "".join(e.delta for e in deltas)
    assert done.usage.type == "duration" and done.usage.seconds == pytest.approx(len(speech) / RATE, abs=1e-3)


def test_noise_reduction_cleans_the_audio_before_the_buffer_and_goes_off_when_set_to_null(server):
    """Speech under white noise, sent in 20 ms pieces with ``noise_reduction: near_field``: the
    committed turn is the denoised stream, NoiseReducer's output (as long as the audio sent), not
    the noisy one: its token log-probabilities are those the HTTP endpoint gives for that output
    (tiny-stt's random weights say the same tokens for both, with slightly other confidence). Set
    to null, the same audio is heard as sent. The SDK's session shows the setting each time."""
    from workers.audio import NoiseReducer

    speech = spoken("Hello from a noisy room.", rate=RATE)
    noisy = np.concatenate([speech, np.zeros(RATE // 4, np.float32)])
    noisy = noisy + np.random.default_rng(0).standard_normal(len(noisy)).astype(np.float32) * 0.05
    pieces = [noisy[i:i + 480] for i in range(0, len(noisy), 480)]
    reducer = NoiseReducer(RATE)
    denoised = np.concatenate([reducer.feed(np.frombuffer(pcm16(x), "<i2")) for x in pieces]).astype(np.float32) / 32768
    reducer.close()

    def logprobs(x: np.ndarray) -> list[float]:
        r = httpx.post(f"{server.base_url}/audio/transcriptions", headers={"Authorization": f"Bearer {server.keys['paid']}"},
                       files={"file": ("a.wav", wav_of(x))},
                       data={"model": "tiny-stt", "language": "en", "include[]": "logprobs"}, timeout=60)
        assert r.status_code == 200, r.text
        return [t["logprob"] for t in r.json()["logprobs"]]

    expected = {"near_field": logprobs(denoised), None: logprobs(noisy)}
    # tiny-stt's random weights hear little of any audio: the two differ by ~1e-4, which is some
    # hundred times what float32 rounding could make of the same audio (the session and the
    # endpoint run the same code on the same samples, so theirs agree to 1e-6)
    assert max(abs(a - b) for a, b in zip(expected["near_field"], expected[None])) > 2e-5

    async def run():
        heard = {}
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await events_until(conn, "session.created")
            for kind in ("near_field", None):
                await conn.session.update(session={**MANUAL, "include": ["item.input_audio_transcription.logprobs"],
                                                   "audio": {"input": {**MANUAL["audio"]["input"],
                                                                       "noise_reduction": kind and {"type": kind}}}})
                updated = (await events_until(conn, "session.updated"))[-1]
                shown = updated.session.audio.input.noise_reduction
                assert (shown.type if shown else None) == kind
                for x in pieces:
                    await conn.input_audio_buffer.append(audio=b64(x))
                await conn.input_audio_buffer.commit()
                heard[kind] = (await events_until(conn, "conversation.item.input_audio_transcription.completed"))[-1]
        return heard

    heard = asyncio.run(run())
    for kind, done in heard.items():
        assert [t.logprob for t in done.logprobs] == pytest.approx(expected[kind], abs=1e-6), kind
        assert done.usage.seconds == pytest.approx(len(noisy) / RATE, abs=1e-3)


def test_server_vad_ends_each_utterance_at_a_silence(server):
    """Two sentences with a second of silence between them and after: two turns, each started,
    stopped, committed and transcribed without a client commit, in order."""
    silence = np.zeros(RATE, np.float32)
    stream = np.concatenate([silence, spoken("The first sentence is here.", rate=RATE), silence,
                             spoken("And now the second one.", rate=RATE), silence])

    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await events_until(conn, "session.created")  # server_vad is the default
            for i in range(0, len(stream), 960):  # 40 ms chunks, as a microphone sends them
                await conn.input_audio_buffer.append(audio=b64(stream[i:i + 960]))
            first = await events_until(conn, "conversation.item.input_audio_transcription.completed")
            second = await events_until(conn, "conversation.item.input_audio_transcription.completed")
            return first + second

    events = asyncio.run(run())
    kinds = [e.type for e in events if e.type.startswith("input_audio_buffer.")]
    assert kinds == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                     "input_audio_buffer.committed"] * 2
    starts = [e for e in events if e.type == "input_audio_buffer.speech_started"]
    stops = [e for e in events if e.type == "input_audio_buffer.speech_stopped"]
    committed = [e for e in events if e.type == "input_audio_buffer.committed"]
    done = [e for e in events if e.type == "conversation.item.input_audio_transcription.completed"]
    assert [e.item_id for e in starts] == [e.item_id for e in stops] == [e.item_id for e in committed] \
        == [e.item_id for e in done]
    assert committed[0].previous_item_id is None and committed[1].previous_item_id == committed[0].item_id
    # where the speech is, in the stream (ms), and what each turn may add to it: the prefix padding
    # before (300 ms), as much after, and a 32 ms frame of the detector either side
    lengths = [len(spoken(t, rate=RATE)) / RATE * 1000 for t in ("The first sentence is here.", "And now the second one.")]
    speech = [(1000, 1000 + lengths[0]), (2000 + lengths[0], 2000 + lengths[0] + lengths[1])]
    for (begin, end), start, stop, d in zip(speech, starts, stops, done):
        assert begin - 400 <= start.audio_start_ms <= begin - 200
        assert end + 200 <= stop.audio_end_ms <= end + 450
        # the turn's audio only: the silences between the turns are not transcribed
        assert d.usage.seconds == pytest.approx((stop.audio_end_ms - start.audio_start_ms) / 1000, abs=0.002)


class _Socket:
    """A connected WebSocket that keeps what the session sends (the session driven in-process)."""

    def __init__(self) -> None:
        self.application_state, self.sent = WebSocketState.CONNECTED, []

    async def send_text(self, text: str) -> None:
        self.sent.append(json.loads(text))


@pytest.mark.parametrize("chunk_ms, silence_ms, pause_ms", [(200, 500, 520), (40, 300, 328)])
def test_server_vad_places_a_turn_that_starts_in_the_append_that_ends_the_one_before(chunk_ms, silence_ms, pause_ms,
                                                                                     monkeypatch):
    """A pause just past ``silence_duration_ms`` (300 ms of padding): one detector feed hears the
    first turn's end and the second's start together (200 ms appends, as OpenAI's example sends,
    and a microphone's 40 ms). Both turns are placed where the detector heard them, in order, and
    each commits the audio of its phrase."""
    first = spoken("Where is the gold hidden?", rate=RATE)
    second = spoken("The pirates buried it under the old oak tree.", rate=RATE)
    lead, pause = 0, RATE * pause_ms // 1000
    stream = np.concatenate([np.zeros(lead, np.float32), first, np.zeros(pause, np.float32), second,
                             np.zeros(3 * RATE // 2, np.float32)])
    samples = np.frombuffer(pcm16(stream), "<i2")
    svc = SimpleNamespace(config=SimpleNamespace(limits=SimpleNamespace(transcription_max_seconds=1800,
                                                                        prompt_max_chars=4000)))
    together, feed = [], TurnDetector.feed

    def heard(detector, audio):
        edges = feed(detector, audio)
        together.append(len({kind for kind, _ in edges}) == 2)
        return edges

    monkeypatch.setattr(TurnDetector, "feed", heard)

    async def run():
        socket = _Socket()
        config = SessionConfig("tiny-stt", vad=ServerVad(0.5, 300, silence_ms))
        session = TranscriptionSession(socket, svc, None, config)
        committed = []
        session._transcribe_later = lambda item, audio: committed.append((item, audio))
        step = RATE * chunk_ms // 1000
        try:
            for i in range(0, len(samples), step):
                await session._append(samples[i:i + step].copy())
        finally:
            session._detector.close()
        return socket.sent, committed

    sent, committed = asyncio.run(run())
    assert any(together)  # the case at hand: a feed with an end and a start
    kinds = [e["type"] for e in sent]
    assert kinds == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                     "input_audio_buffer.committed"] * 2
    starts = [round(e["audio_start_ms"] * RATE / 1000) for e in sent if e["type"].endswith("speech_started")]
    stops = [round(e["audio_end_ms"] * RATE / 1000) for e in sent if e["type"].endswith("speech_stopped")]
    assert starts[0] < stops[0] <= starts[1] < stops[1]
    turns = []  # each turn's committed audio is the stream's, from where its events say (to the ms)
    for start, stop, (_, audio) in zip(starts, stops, committed):
        assert abs(len(audio) - (stop - start)) <= RATE // 1000
        (at,) = [k for k in range(start - RATE // 1000, start + RATE // 1000 + 1)
                 if np.array_equal(audio, samples[k:k + len(audio)])]
        turns.append((at, at + len(audio)))
    # every sample of both phrases is in a turn: the first's padding after it may hold the second's first samples
    a_end, b_begin = lead + len(first), lead + len(first) + pause
    assert turns[0][0] <= lead and a_end <= turns[0][1]
    assert turns[1][0] <= max(b_begin, turns[0][1]) and b_begin + len(second) <= turns[1][1]


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_large_telephone_appends_and_long_utterances_are_worked_on_off_the_event_loop(monkeypatch):
    """G.711 past a second is decoded on a thread (a 12 MB append froze every session for a
    second), in the order it came; a short append stays on the loop, where the hop would cost as
    much as the work. A long committed utterance is converted to float32 on a thread too."""
    import gateway.realtime as realtime
    from workers.audio import G711Stream

    law = np.frombuffer(pcm16(spoken("Hello from the telephone.", rate=8000)), "<i2")
    encoder = G711Stream("pcmu", 8000, encode=True)
    pcmu = encoder.feed(np.tile(law, 3).tobytes()) + encoder.flush()
    decoded, floats, feed = [], [], G711Stream.feed

    def heard(stream, data):
        decoded.append((len(data), _on_loop()))
        return feed(stream, data)

    def to_float(samples):
        floats.append((len(samples), _on_loop()))
        return samples.astype(np.float32) / 32768.0

    async def told(svc, caller, job, gone):
        yield Transcript("heard", None, 1.0)

    monkeypatch.setattr(G711Stream, "feed", heard)
    monkeypatch.setattr(realtime, "_float", to_float)
    monkeypatch.setattr(realtime, "stream_transcription", told)
    svc = SimpleNamespace(config=SimpleNamespace(limits=SimpleNamespace(transcription_max_seconds=1800,
                                                                        prompt_max_chars=4000)))

    async def run():
        session = TranscriptionSession(_Socket(), svc, None, SessionConfig("tiny-stt", vad=None, codec="pcmu"))
        small, large = pcmu[:1600], pcmu[1600:]  # 200 ms, then the rest (more than a second)
        pieces = [await session._samples(small), await session._samples(large)]
        for speech in ((np.zeros(RATE, np.int16)), np.zeros(11 * RATE, np.int16)):
            await session._transcribe("item", speech, session.config)
        return pieces

    pieces = asyncio.run(run())
    large = len(pcmu) - 1600
    assert large > 2 * 8000 and decoded == [(1600, True), (large, False)]
    one = G711Stream("pcmu", RATE, encode=False)  # in order: the stream decoded as one piece
    whole = np.frombuffer(one.feed(pcmu), "<i2")
    assert np.array_equal(np.concatenate(pieces), whole[:sum(map(len, pieces))])
    assert floats == [(RATE, True), (11 * RATE, False)]


def test_a_streamed_transcription_resamples_its_audio_on_the_model_s_thread(server, monkeypatch):
    """A committed utterance's resampling to the model's rate ran on the event loop (a second for
    25 minutes of audio); it runs where the model does, as an upload's does."""
    from workers import audio as sound

    resampled, resample = [], sound.resample

    def recorded(x, rate, to):
        resampled.append((rate, to, _on_loop()))
        return resample(x, rate, to)

    speech = spoken("Resample me.", rate=RATE)
    monkeypatch.setattr(sound, "resample", recorded)

    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await manual(conn)
            await conn.input_audio_buffer.append(audio=b64(speech))
            await conn.input_audio_buffer.commit()
            return await events_until(conn, "conversation.item.input_audio_transcription.completed")

    asyncio.run(run())
    assert [(rate, on_loop) for rate, _, on_loop in resampled] == [(RATE, False)]


@pytest.mark.parametrize("event, param, code", [
    ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "audio", "invalid_value"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}, "audio", "invalid_value"),
    ({"type": "input_audio_buffer.commit"}, None, "input_audio_buffer_commit_empty"),
    ({"type": "response.create"}, "type", "invalid_event"),
    ({"type": 5}, "type", "invalid_event"),  # a type that is not a string: its event_id is still echoed
    ({"type": "session.update", "session": {"type": "realtime"}}, "session.type", "unsupported_session_type"),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/wav"}}}}}, "session.audio.input.format.type", "unsupported_format"),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcmu", "rate": 16000}}}}}, "session.audio.input.format.rate", "unsupported_format"),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 16000}}}}}, "session.audio.input.format.rate", "unsupported_format"),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "transcription": {"model": "nope"}}}}}, "session.audio.input.transcription.model", "model_not_found"),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "transcription": {"model": "tiny-chat"}}}}}, "session.audio.input.transcription.model", None),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "turn_detection": {"type": "semantic_vad", "eagerness": "sometimes"}}}}},
     "session.audio.input.turn_detection.eagerness", "invalid_value"),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "turn_detection": {"type": "semantic_vad", "eagerness": ["high"]}}}}},
     "session.audio.input.turn_detection.eagerness", "invalid_value"),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "turn_detection": {"type": "semantic_vad", "silence_duration_ms": 100}}}}},
     "session.audio.input.turn_detection.silence_duration_ms", "unknown_parameter"),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "turn_detection": {"type": "vad_by_mood"}}}}}, "session.audio.input.turn_detection.type", "unsupported_parameter"),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "turn_detection": {"type": "server_vad", "threshold": 2}}}}}, "session.audio.input.turn_detection.threshold",
     "invalid_value"),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "noise_reduction": {"type": "studio"}}}}}, "session.audio.input.noise_reduction.type", "invalid_value"),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "noise_reduction": {"type": "near_field", "level": 3}}}}}, "session.audio.input.noise_reduction.level",
     "unknown_parameter"),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "noise_reduction": "near_field"}}}}, "session.audio.input.noise_reduction", "invalid_type"),
    ({"type": "session.update", "session": {"type": "transcription", "include": ["item.audio"]}}, "session.include",
     "invalid_value"),
])
def test_a_bad_client_event_is_an_error_event_and_the_session_goes_on(server, event, param, code):
    speech = spoken("Still here.", rate=RATE)

    async def run():
        async with websockets.connect(server.url.replace("http", "ws") + "/v1/realtime",
                                      additional_headers={"Authorization": f"Bearer {server.keys['paid']}"}) as ws:
            async def until(kind):
                while True:
                    got = json.loads(await asyncio.wait_for(ws.recv(), 60))
                    if got["type"] == kind:
                        return got

            await until("session.created")
            await ws.send(json.dumps({**event, "event_id": "evt_1"}))
            error = await until("error")
            # the session is still usable, and still as it was: a manual commit transcribes
            await ws.send(json.dumps({"type": "session.update", "session": MANUAL}))
            await until("session.updated")
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(speech)}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            done = await until("conversation.item.input_audio_transcription.completed")
            return error, done

    error, done = asyncio.run(run())
    assert error["error"]["param"] == param and error["error"]["event_id"] == "evt_1"
    assert error["error"]["type"] == ("not_found_error" if code == "model_not_found" else "invalid_request_error")
    assert error["error"]["message"]
    if code is not None:
        assert error["error"]["code"] == code
    assert isinstance(done["transcript"], str) and done["usage"]["seconds"] == pytest.approx(len(speech) / RATE, abs=1e-3)


@pytest.mark.parametrize("headers, query, status", [
    ({}, "", 401),
    ({"Authorization": "Bearer wrong"}, "", 401),
    (None, "?model=nope", 404),
    (None, "?model=tiny-chat&intent=transcription", 400),  # (a chat model's session is a conversation)
])
def test_the_handshake_refuses_with_an_http_error(server, headers, query, status):
    headers = {"Authorization": f"Bearer {server.keys['paid']}"} if headers is None else headers

    async def run():
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            async with websockets.connect(server.url.replace("http", "ws") + "/v1/realtime" + query,
                                          additional_headers=headers):
                pass
        return refused.value.response

    response = asyncio.run(run())
    assert response.status_code == status
    assert json.loads(response.body)["error"]["message"]


def test_each_utterance_is_metered_and_timed_as_a_request_of_the_tier(server):
    """Two utterances of a free key's session: two free transcription requests in /metrics, and
    their audio seconds in the key's usage."""
    speech = spoken("Count me.", rate=RATE)

    def requests_seen() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        found = re.search(r'^tiergate_request_seconds_count\{(?=[^}]*tier="free")(?=[^}]*endpoint="transcriptions")[^}]*\}'
                          r" (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    def audio_seconds() -> float:
        r = httpx.get(f"{server.url}/admin/usage", params={"group_by": "tier"},
                      headers={"Authorization": f"Bearer {server.keys['admin']}"})
        assert r.status_code == 200, r.text
        return sum(row.get("audio_in_seconds", 0) for row in r.json()["data"] if row.get("tier") == "free")

    before = requests_seen(), audio_seconds()

    async def run():
        async with client(server, "free").realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await events_until(conn, "session.created")
            await conn.session.update(session=MANUAL)
            for _ in range(2):
                await conn.input_audio_buffer.append(audio=b64(speech))
                await conn.input_audio_buffer.commit()
                await events_until(conn, "conversation.item.input_audio_transcription.completed")

    asyncio.run(run())
    assert requests_seen() == before[0] + 2
    assert audio_seconds() == pytest.approx(before[1] + 2 * len(speech) / RATE, abs=0.01)


def test_a_session_that_closes_gives_back_its_slot_and_its_detector(server):
    """The client leaves right after a commit, with server_vad on: the utterance's gate slot is
    given back (whether its transcription had started or not) and the turn detector's model goes
    back to the pool."""
    from workers import stt

    speech = spoken("Leaving now, goodbye.", rate=RATE)
    pooled = stt._vad_models.qsize()

    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await events_until(conn, "session.created")
            await conn.input_audio_buffer.append(audio=b64(np.concatenate([speech] * 8)))
            await conn.input_audio_buffer.commit()
            await events_until(conn, "input_audio_buffer.committed")

    asyncio.run(run())

    async def settled():
        async with asyncio.timeout(20):
            while server.services.gate.total_inflight or stt._vad_models.qsize() < max(pooled, 1):
                await asyncio.sleep(0.05)

    asyncio.run(settled())
    assert server.services.gate.total_inflight == 0 and stt._vad_models.qsize() >= max(pooled, 1)


@pytest.mark.parametrize("frame, code", [(b"\x00\x01binary", "invalid_event"), ("{not json", "invalid_json"),
                                         ('["a list"]', "invalid_event"), ('{"type": 5}', "invalid_event"),
                                         # nested past the 32 levels HTTP bodies may have (too deep for Python's parser)
                                         ("[" * 100_000 + "]" * 100_000, "invalid_json"),
                                         ('{"type": "session.update", "x": ' + "[" * 33 + "]" * 33 + "}",
                                          "invalid_json")])
def test_a_frame_that_is_no_client_event_is_an_error_event(server, frame, code):
    async def run():
        async with websockets.connect(server.url.replace("http", "ws") + "/v1/realtime",
                                      additional_headers={"Authorization": f"Bearer {server.keys['paid']}"}) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(frame)
            first = json.loads(await asyncio.wait_for(ws.recv(), 30))
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))  # still answering
            second = json.loads(await asyncio.wait_for(ws.recv(), 30))
            return first, second

    error, cleared = asyncio.run(run())
    assert error["type"] == "error" and error["error"]["code"] == code and error["error"]["event_id"] is None
    assert cleared["type"] == "input_audio_buffer.cleared"
    if isinstance(frame, str) and frame.count("[") > 32:  # refused by the HTTP bodies' rule, before parsing
        assert error["error"]["message"] == "the client event nests arrays and objects deeper than 32 levels"


def test_a_browser_sends_its_key_as_a_subprotocol_and_sessions_are_counted(server):
    """A browser cannot set headers on a WebSocket: OpenAI's ``openai-insecure-api-key.<key>``
    subprotocol carries the key, ``realtime`` is the one chosen (never the key), and
    ``tiergate_realtime_sessions{tier}`` counts the session while it is open."""
    def open_sessions() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        found = re.search(r'^tiergate_realtime_sessions\{tier="subscriber"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    url = server.url.replace("http", "ws") + "/v1/realtime"

    def dashboard_sessions() -> int:
        state = httpx.get(f"{server.url}/admin/state", headers={"Authorization": f"Bearer {server.keys['admin']}"}).json()
        return next(t["realtime_sessions"] for t in state["tiers"] if t["name"] == "subscriber")

    async def run():
        key = "openai-insecure-api-key." + server.keys["subscriber"]
        async with websockets.connect(url, subprotocols=["realtime", key]) as ws:
            created = json.loads(await ws.recv())
            during = await asyncio.to_thread(open_sessions), await asyncio.to_thread(dashboard_sessions)
            return ws.subprotocol, created, during

    chosen, created, during = asyncio.run(run())
    assert chosen == "realtime" and created["type"] == "session.created"
    assert during == (1, 1)  # in /metrics and on the dashboard's state

    async def gone():
        async with asyncio.timeout(10):
            while await asyncio.to_thread(open_sessions):
                await asyncio.sleep(0.05)

    asyncio.run(gone())

    async def wrong():
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            async with websockets.connect(url, subprotocols=["realtime", "openai-insecure-api-key.wrong"]):
                pass
        return refused.value.response.status_code

    assert asyncio.run(wrong()) == 401


def test_logprobs_when_the_session_includes_them_and_a_failing_utterance_does_not_end_the_session(server, monkeypatch):
    """``include: [item.input_audio_transcription.logprobs]``: the completed event carries each
    token's log-probability, as the HTTP endpoint's json does, and each delta event those of its
    own tokens, which join to them. An utterance whose transcription breaks unexpectedly gets a
    ``failed`` event (server_error), and the next one is transcribed."""
    from gateway import realtime

    speech = spoken("Log these probabilities.", rate=RATE)
    real = realtime.stream_transcription
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return real(*args, **kwargs)

    monkeypatch.setattr(realtime, "stream_transcription", flaky)

    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await events_until(conn, "session.created")
            await conn.session.update(session={**MANUAL, "include": ["item.input_audio_transcription.logprobs"]})
            updated = await events_until(conn, "session.updated")
            for _ in range(2):
                await conn.input_audio_buffer.append(audio=b64(speech))
                await conn.input_audio_buffer.commit()
            events = await events_until(conn, "conversation.item.input_audio_transcription.completed")
            return updated[-1], events

    updated, events = asyncio.run(run())
    committed = [e for e in events if e.type == "input_audio_buffer.committed"]
    (failed,) = [e for e in events if e.type == "conversation.item.input_audio_transcription.failed"]
    done = events[-1]
    assert updated.session.include == ["item.input_audio_transcription.logprobs"]
    assert failed.item_id == committed[0].item_id and failed.error.code == "server_error"
    assert done.item_id == committed[1].item_id
    # the same as the HTTP endpoint's for the same audio (json, include[]=logprobs)
    http = httpx.post(f"{server.base_url}/audio/transcriptions", headers={"Authorization": f"Bearer {server.keys['paid']}"},
                      files={"file": ("a.wav", wav_of(speech))},
                      data={"model": "tiny-stt", "language": "en", "include[]": "logprobs"}, timeout=60).json()
    assert http["text"] == done.transcript and len(http["logprobs"]) == len(done.logprobs) > 0
    for mine, theirs in zip(done.logprobs, http["logprobs"]):
        assert mine.token == theirs["token"] and mine.bytes == theirs["bytes"]
        assert mine.logprob == pytest.approx(theirs["logprob"], abs=1e-4)
    # the delta events of the second utterance carry its tokens as they are decoded: together, the completed event's
    deltas = [e for e in events if e.type == "conversation.item.input_audio_transcription.delta"
              and e.item_id == committed[1].item_id]
    assert deltas and all(d.logprobs is not None for d in deltas)
    assert [e.token for d in deltas for e in d.logprobs] == [e.token for e in done.logprobs]


def test_server_vad_turned_on_mid_session_times_turns_in_the_session_s_audio(server):
    """Audio buffered without turn detection, then ``server_vad`` switched on: the detector hears
    what comes after, and its turn's times count from the session's first sample."""
    silence = np.zeros(RATE, np.float32)
    speech = spoken("Switched on late.", rate=RATE)

    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await events_until(conn, "session.created")
            await conn.session.update(session=MANUAL)
            await events_until(conn, "session.updated")
            await conn.input_audio_buffer.append(audio=b64(silence))  # 1 s, not committed
            await conn.session.update(session={"type": "transcription", "audio": {"input": {
                "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}}})
            await events_until(conn, "session.updated")
            stream = np.concatenate([silence, speech, silence])
            for i in range(0, len(stream), 960):
                await conn.input_audio_buffer.append(audio=b64(stream[i:i + 960]))
            return await events_until(conn, "conversation.item.input_audio_transcription.completed")

    events = asyncio.run(run())
    (start,) = [e for e in events if e.type == "input_audio_buffer.speech_started"]
    (stop,) = [e for e in events if e.type == "input_audio_buffer.speech_stopped"]
    begin, end = 2000, 2000 + len(speech) / RATE * 1000  # the speech, in the session's audio
    assert begin - 400 <= start.audio_start_ms <= begin - 200 and end + 200 <= stop.audio_end_ms <= end + 450
    assert events[-1].usage.seconds == pytest.approx((stop.audio_end_ms - start.audio_start_ms) / 1000, abs=0.002)


def test_server_vad_keeps_no_more_silence_than_a_turn_may_reach_back(server):
    """Minutes of silence must not fill the buffer: with ``server_vad`` and no speech heard, only
    the last prefix padding plus a second stay buffered (what a manual commit then takes)."""
    silence = np.zeros(4 * RATE, np.float32)

    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await events_until(conn, "session.created")  # server_vad, 300 ms of prefix padding
            for i in range(0, len(silence), 4800):
                await conn.input_audio_buffer.append(audio=b64(silence[i:i + 4800]))
            await conn.input_audio_buffer.commit()
            return await events_until(conn, "conversation.item.input_audio_transcription.completed")

    events = asyncio.run(run())
    assert not [e for e in events if e.type.startswith("input_audio_buffer.speech")]
    assert events[-1].usage.seconds == pytest.approx(1.3, abs=0.01)


def test_a_setting_the_model_refuses_fails_its_utterance_naming_the_session_field(server):
    """A language the model does not know is accepted by ``session.update`` (the model decides)
    and refused when an utterance is transcribed: ``failed`` names the session's field. The audio
    was taken; a corrected setting transcribes the next utterance."""
    speech = spoken("Which language is this?", rate=RATE)

    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await events_until(conn, "session.created")
            await conn.session.update(session={**MANUAL, "audio": {"input": {
                **MANUAL["audio"]["input"], "transcription": {"model": "tiny-stt", "language": "klingon"}}}})
            await events_until(conn, "session.updated")
            await conn.input_audio_buffer.append(audio=b64(speech))
            await conn.input_audio_buffer.commit()
            failed = await events_until(conn, "conversation.item.input_audio_transcription.failed")
            await conn.session.update(session=MANUAL)
            await events_until(conn, "session.updated")
            await conn.input_audio_buffer.append(audio=b64(speech))
            await conn.input_audio_buffer.commit()
            done = await events_until(conn, "conversation.item.input_audio_transcription.completed")
            return failed[-1], done[-1]

    failed, done = asyncio.run(run())
    assert failed.error.param == "session.audio.input.transcription.language" and failed.error.type == "invalid_request_error"
    assert "klingon" in failed.error.message and done.transcript is not None


def test_a_server_without_a_transcription_model_refuses_the_handshake(tiny_chat, tmp_path):
    running = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}))
    try:
        async def run():
            with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
                async with websockets.connect(running.url.replace("http", "ws") + "/v1/realtime",
                                              additional_headers={"Authorization": f"Bearer {running.keys['paid']}"}):
                    pass
            return refused.value.response

        response = asyncio.run(run())
    finally:
        running.stop()
    error = json.loads(response.body)["error"]
    assert response.status_code == 404 and error["code"] == "model_not_found" and "no transcription" in error["message"]


def test_audio_waiting_past_the_limit_is_a_429_and_stays_in_the_buffer_to_commit_later(tiny_stt, tmp_path, monkeypatch):
    """A session may have at most ``limits.transcription_max_seconds`` of committed audio waiting
    to be transcribed: a commit past it is an ``error`` event (429 ``too_much_pending_audio``), and
    its audio stays in the buffer, so that once the earlier utterance is transcribed the same
    commit goes through and is heard as the HTTP endpoint hears that audio."""
    import threading

    from gateway import realtime

    running = start_server(write_config(tmp_path, {"tiny-stt": ("stt", tiny_stt)},
                                        "limits:\n  transcription_max_seconds: 2\n"))
    release, real = threading.Event(), realtime.stream_transcription

    def held(*args, **kwargs):  # the first utterance is transcribed only once the test lets it
        async def pieces():
            while not release.is_set():
                await asyncio.sleep(0.01)
            async for piece in real(*args, **kwargs):
                yield piece
        return pieces()

    monkeypatch.setattr(realtime, "stream_transcription", held)
    speech = spoken("Wait for the first one.", rate=RATE)
    first, second = speech[: int(1.5 * RATE)], speech[-RATE:]  # 1.5 s waiting, then 1 s more: past 2 s

    async def run():
        async with client(running).realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await manual(conn)
            await conn.input_audio_buffer.append(audio=b64(first))
            await conn.input_audio_buffer.commit()
            committed = await events_until(conn, "input_audio_buffer.committed")
            await conn.input_audio_buffer.append(audio=b64(second))
            await conn.input_audio_buffer.commit()
            refused = await events_until(conn, "error")
            release.set()
            done = await events_until(conn, "conversation.item.input_audio_transcription.completed")
            await conn.input_audio_buffer.commit()  # the refused audio, still buffered
            later = await events_until(conn, "conversation.item.input_audio_transcription.completed")
            return committed[-1], refused[-1], done[-1], later

    try:
        committed, refused, done, later = asyncio.run(run())
        http = OpenAI(base_url=running.base_url, api_key=running.keys["paid"], max_retries=0)
        expected = http.audio.transcriptions.create(model="tiny-stt", file=("a.wav", wav_of(second)), language="en").text
    finally:
        running.stop()
    assert refused.error.code == "too_much_pending_audio" and "2 s" in refused.error.message
    assert done.item_id == committed.item_id
    (again,) = [e for e in later if e.type == "input_audio_buffer.committed"]
    assert later[-1].item_id == again.item_id != committed.item_id
    assert later[-1].usage.seconds == pytest.approx(1.0, abs=1e-3)  # all of it: nothing was dropped
    assert later[-1].transcript == expected


@pytest.mark.parametrize("law", ["pcmu", "pcma"])
def test_telephone_audio_is_heard_as_the_same_sound_at_24khz(server, law):
    """A phone network's media stream (G.711 at 8 kHz, sent in 20 ms frames, as Twilio's is):
    the utterance is transcribed as /v1/audio/transcriptions transcribes the same bytes decoded and
    resampled to 24 kHz, and its seconds are the call's."""
    from workers.audio import G711Stream

    speech = spoken("Hello from the telephone.", rate=8000)
    encoder = G711Stream(law, 8000, encode=True)
    call = encoder.feed(pcm16(speech)) + encoder.flush()
    heard = np.frombuffer(G711Stream(law, RATE, encode=False).feed(call), "<i2").astype(np.float32) / 32768
    http = OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0)
    expected = http.audio.transcriptions.create(model="tiny-stt", file=("a.wav", wav_of(heard)), language="en").text

    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await events_until(conn, "session.created")
            await conn.session.update(session={**MANUAL, "audio": {"input": {**MANUAL["audio"]["input"],
                                                                              "format": {"type": f"audio/{law}"}}}})
            updated = (await events_until(conn, "session.updated"))[-1]
            for i in range(0, len(call), 160):  # 20 ms frames
                await conn.input_audio_buffer.append(audio=base64.b64encode(call[i:i + 160]).decode())
            await conn.input_audio_buffer.commit()
            return updated, await events_until(conn, "conversation.item.input_audio_transcription.completed")

    updated, events = asyncio.run(run())
    assert updated.session.audio.input.format.type == f"audio/{law}"
    done = events[-1]
    assert done.transcript == expected
    assert done.usage.seconds == pytest.approx(len(heard) / RATE, abs=1e-3)
    assert abs(len(heard) / RATE - len(speech) / 8000) < 0.005  # (the resampler holds back a few ms)


# -- semantic_vad (gateway.turn_end) ----------------------------------------------------------------

SEMANTIC = {"type": "transcription", "audio": {"input": {"transcription": {"model": "tiny-stt", "language": "en"}}}}


def semantic(eagerness: str) -> dict:
    session = json.loads(json.dumps(SEMANTIC))
    session["audio"]["input"]["turn_detection"] = {"type": "semantic_vad", "eagerness": eagerness}
    return session


def requests_of(server: RunningServer, endpoint: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    found = re.findall(rf'^tiergate_request_seconds_count\{{(?=[^}}]*endpoint="{endpoint}")[^}}]*\}} (\S+)$', text, re.M)
    return sum(float(x) for x in found)


async def turns_of(server: RunningServer, session: dict, stream: np.ndarray, turns: int) -> list:
    """The events of a transcription session with ``session`` fed ``stream`` in 40 ms chunks,
    until ``turns`` transcriptions have completed."""
    async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as conn:
        await events_until(conn, "session.created")
        await conn.session.update(session=session)
        updated = await events_until(conn, "session.updated")
        for i in range(0, len(stream), 960):
            await conn.input_audio_buffer.append(audio=b64(stream[i:i + 960]))
        out = updated
        for _ in range(turns):
            out += await events_until(conn, "conversation.item.input_audio_transcription.completed")
        return out


def test_semantic_vad_keeps_a_short_pause_in_the_turn_and_waits_its_eagerness_for_a_doubtful_judge(server):
    """``eagerness: high`` (2 s at most): two phrases 300 ms apart, less than any turn's wait, then
    2.5 s of silence. One turn, started once and stopped once, holding both phrases. tiny-chat
    (random weights) judges: its end-of-message probability is ~1/568, so the turn waits about the
    longest (the audio comes faster than real time here, so the 2 s may pass before a judgement:
    then the turn ends unjudged, as it would with p = 0)."""
    silence, gap = np.zeros(RATE, np.float32), np.zeros(int(0.3 * RATE), np.float32)
    first, second = spoken("The first part is here", rate=RATE), spoken("and the rest of it.", rate=RATE)
    stream = np.concatenate([silence, first, gap, second, np.zeros(int(2.5 * RATE), np.float32)])
    events = asyncio.run(turns_of(server, semantic("high"), stream, 1))
    assert events[0].session.audio.input.turn_detection.type == "semantic_vad"
    assert events[0].session.audio.input.turn_detection.eagerness == "high"
    kinds = [e.type for e in events if e.type.startswith("input_audio_buffer.")]
    assert kinds == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                     "input_audio_buffer.committed"]
    start = next(e for e in events if e.type == "input_audio_buffer.speech_started")
    stop = next(e for e in events if e.type == "input_audio_buffer.speech_stopped")
    end_of_speech = (len(silence) + len(first) + len(gap) + len(second)) / RATE * 1000
    assert 600 <= start.audio_start_ms <= 800 and end_of_speech <= stop.audio_end_ms <= end_of_speech + 450


def test_semantic_vad_waits_the_longest_while_the_judge_doubts(server):
    """``eagerness: low`` (8 s at most) and the same doubtful judge: 2.5 s of silence after the
    speech ends no turn, even once the pause has been judged (a transcription and a completion of
    the caller's tier, seen in /metrics); a client's commit then takes the whole turn."""
    stream = np.concatenate([np.zeros(RATE // 2, np.float32), spoken("Wait for me.", rate=RATE),
                             np.zeros(int(2.5 * RATE), np.float32)])

    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await events_until(conn, "session.created")
            await conn.session.update(session=semantic("low"))
            await events_until(conn, "session.updated")
            before = requests_of(server, "chat"), requests_of(server, "transcriptions")
            for i in range(0, len(stream), 960):
                await conn.input_audio_buffer.append(audio=b64(stream[i:i + 960]))
            async with asyncio.timeout(60):  # the judgement: a completion (served, and timed, as chat)
                while requests_of(server, "chat") < before[0] + 1:
                    await asyncio.sleep(0.1)
            assert requests_of(server, "transcriptions") == before[1] + 1  # the judge's transcription
            await conn.input_audio_buffer.commit()
            return await events_until(conn, "conversation.item.input_audio_transcription.completed")

    events = asyncio.run(run())
    kinds = [e.type for e in events if e.type.startswith("input_audio_buffer.")]
    assert kinds == ["input_audio_buffer.speech_started", "input_audio_buffer.committed"]  # no speech_stopped


def with_turn_model(config: Path, stt: Path, judge: str) -> Path:
    """``config`` (``write_config``'s) with the speech model at ``stt`` given ``turn_model: judge``."""
    text = config.read_text()
    entry = f"    kind: stt\n    path: {stt}\n"
    assert entry in text
    config.write_text(text.replace(entry, entry + f"    turn_model: {judge}\n"))
    return config


def test_semantic_vad_ends_a_turn_the_judge_is_sure_of_after_the_shortest_wait(tiny_stt, tiny_chat, tmp_path):
    """A judge sure that the user has finished (``demo.chat.build_sure_turn_judge``), named by the speech model's
    ``turn_model`` (the first chat model, tiny-chat, doubts): with ``eagerness: low`` the turn ends
    after 1.2 s of silence, not 8 s: the wait is the judgement's (500 ms for p = 1). The judge's
    probability is checked against the model's own softmax, computed here with transformers. The
    turn ended where it was judged, so its transcript is the judge's: one transcription request in
    all, not two."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gateway.turn_end import EndOfMessage, prompt_ids, turn_wait_ms

    from demo.chat import build_sure_turn_judge

    judge = build_sure_turn_judge(tiny_chat, tmp_path / "sure-chat")
    tok, model = AutoTokenizer.from_pretrained(judge), AutoModelForCausalLM.from_pretrained(judge)
    ids = prompt_ids(tok, EndOfMessage("<|user|>", tok.convert_tokens_to_ids("</s>")), "and then we")
    with torch.no_grad():
        p = torch.softmax(model(torch.tensor([ids[:-1]])).logits[0, -1], -1)[ids[-1]].item()
    assert p > 0.999 and turn_wait_ms(p, "low") < 600
    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat), "sure-chat": ("chat", judge),
                                     "tiny-stt": ("stt", tiny_stt)})
    running = start_server(with_turn_model(config, tiny_stt, "sure-chat"))
    try:
        stream = np.concatenate([np.zeros(RATE // 2, np.float32), spoken("Done already.", rate=RATE),
                                 np.zeros(int(1.2 * RATE), np.float32)])
        before = requests_of(running, "transcriptions")
        events = asyncio.run(turns_of(running, semantic("low"), stream, 1))
        transcriptions = requests_of(running, "transcriptions") - before
    finally:
        running.stop()
    assert transcriptions == 1
    done = [e for e in events if e.type == "conversation.item.input_audio_transcription.completed"]
    deltas = "".join(e.delta for e in events if e.type == "conversation.item.input_audio_transcription.delta")
    assert len(done) == 1 and done[0].transcript == deltas
    kinds = [e.type for e in events if e.type.startswith("input_audio_buffer.")]
    assert kinds == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                     "input_audio_buffer.committed"]


def test_the_judge_reads_the_end_of_message_token_of_the_model_s_own_template(server, tiny_chat):
    """``end_of_message`` from tiny-chat's template (``<|user|>{content}</s>``); the judge's prompt
    keeps the transcript's last 128 tokens; and the completion the judge asks for (its body
    as ``end_probability`` sends it) gives the model's own softmax of the end token, computed here
    with transformers (fp32 on both sides: within 1e-4)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gateway.turn_end import TRANSCRIPT_TOKENS, end_of_message, prompt_ids

    end = asyncio.run(end_of_message(tiny_chat))
    tok = AutoTokenizer.from_pretrained(tiny_chat)
    assert end.head == "<|user|>" and end.end_id == tok.convert_tokens_to_ids("</s>")
    ids = prompt_ids(tok, end, "x" * 3000 + " is it over")
    head = tok.encode("<|user|>", add_special_tokens=False)
    assert ids[:len(head)] == head and ids[-1] == end.end_id and len(ids) == len(head) + TRANSCRIPT_TOKENS + 1
    assert tok.decode(ids[len(head):-1]).endswith(" is it over")
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {server.keys['paid']}"},
                   json={"model": "tiny-chat", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}, timeout=60)
    assert r.status_code == 200, r.text
    served = r.json()["choices"][0]["logprobs"]["token_logprobs"][-1]
    model = AutoModelForCausalLM.from_pretrained(tiny_chat)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0, -1], -1)[ids[-1]].item()
    assert math.exp(served) == pytest.approx(math.exp(reference), rel=1e-4)


def test_semantic_vad_on_a_server_without_a_chat_model_is_an_error_event_and_server_vad_stays(tiny_stt, tmp_path):
    """No chat model to judge with: ``semantic_vad`` is refused naming ``turn_detection.type``, and
    the session keeps the turn detection it had."""
    running = start_server(write_config(tmp_path, {"tiny-stt": ("stt", tiny_stt)}))
    try:
        async def run():
            async with client(running).realtime.connect(extra_query={"intent": "transcription"}) as conn:
                await events_until(conn, "session.created")
                await conn.session.update(session=semantic("auto"))
                refused = (await events_until(conn, "error"))[-1].error
                await conn.session.update(session=SEMANTIC)  # a change of nothing else: the session as it was
                kept = (await events_until(conn, "session.updated"))[-1].session
                return refused, kept

        refused, kept = asyncio.run(run())
    finally:
        running.stop()
    assert refused.param == "session.audio.input.turn_detection.type" and refused.code == "unsupported_parameter"
    assert "no" in refused.message and kept.audio.input.turn_detection.type == "server_vad"


def test_turn_model_must_name_a_chat_model(tiny_chat, tiny_stt, tmp_path):
    from gateway.config import ConfigError, load_config

    models = {"tiny-chat": ("chat", tiny_chat), "tiny-stt": ("stt", tiny_stt)}
    (tmp_path / "bad").mkdir(), (tmp_path / "good").mkdir()
    with pytest.raises(ConfigError, match=r"models\[1\].turn_model: 'tiny-stt' is not a chat model here: tiny-chat"):
        load_config(with_turn_model(write_config(tmp_path / "bad", models), tiny_stt, "tiny-stt"))
    good = load_config(with_turn_model(write_config(tmp_path / "good", models), tiny_stt, "tiny-chat"))
    assert good.models[1].turn_model == "tiny-chat"


def test_a_session_ends_at_its_maximum_length_with_an_error_event_and_a_normal_close(server, monkeypatch):
    """A session open ``limits.realtime_max_session_s`` (OpenAI's 60 minutes) gets an ``error``
    event, ``session_expired``, and the socket is closed normally (1000); the next one opens."""
    config = server.services.config
    monkeypatch.setattr(server.services, "config", config.model_copy(update={"limits": config.limits.model_copy(
        update={"realtime_max_session_s": 1.5})}))

    async def run():
        events = []
        async with websockets.connect(server.url.replace("http", "ws") + "/v1/realtime",
                                      additional_headers={"Authorization": f"Bearer {server.keys['paid']}"}) as ws:
            async with asyncio.timeout(30):
                with pytest.raises(websockets.exceptions.ConnectionClosedOK):
                    while True:
                        events.append(json.loads(await ws.recv()))
            return events, ws.close_code, ws.close_reason

    events, code, reason = asyncio.run(run())
    assert [e["type"] for e in events] == ["session.created", "error"]
    error = events[-1]["error"]
    assert error["code"] == "session_expired" and error["type"] == "invalid_request_error"
    assert "1.5 seconds" in error["message"] and error["event_id"] is None
    assert (code, reason) == (1000, "session_expired")
