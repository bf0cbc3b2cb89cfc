"""The Realtime API's transcription sessions: ``/v1/realtime``, a WebSocket. Audio streams in,
text streams out, one utterance at a time, through the serving core of
``/v1/audio/transcriptions`` (``gateway.audio.stream_transcription``).

The protocol is OpenAI's for a session of ``type: "transcription"`` (the SDK's
``client.realtime.connect``): the server opens with ``session.created``; the client may send
``session.update`` (``session.audio.input``: ``format``, ``transcription`` {model,
language, prompt}, ``turn_detection`` ``server_vad``, ``semantic_vad`` or null), then streams
``input_audio_buffer.append`` (base64 PCM16, little-endian, mono, 24 kHz) and ends each utterance
with ``input_audio_buffer.commit``, or lets ``server_vad`` end it at a silence, or ``semantic_vad``
at a silence as long as a model's judgement that the user has finished asks for
(``gateway.turn_end``; both send ``input_audio_buffer.speech_started`` / ``speech_stopped``). For each utterance the server sends
``input_audio_buffer.committed``, ``conversation.item.input_audio_transcription.delta`` events as
the model decodes, then ``...completed`` (the transcript and its usage in seconds) or ``...failed``
(the error: a full gate, a quota, a language the model lacks). A bad client event gets an
``error`` event naming it and its ``param``; the session stays open and nothing accepted is lost.

Each committed utterance is one request of the caller's tier: it waits for a gate slot and a
lease on the model like any other request, is metered by its audio seconds, and the session's
utterances are transcribed in order. The key is checked at the handshake (the
``Authorization`` header, or for a browser, which cannot set one, the subprotocol
``openai-insecure-api-key.<key>``, as OpenAI takes it; a refused key gets an HTTP error before the
upgrade), and again before each step that makes a request (``key_stands``), and every
``KEY_CHECK_S`` while the session is open: a key revoked or taken out of its file since ends the
session there, an idle one too (an ``error`` event, ``invalid_api_key``, and a close with 1008).
``tiergate_realtime_sessions{tier}`` counts the sessions open. A session lasts at most
``limits.realtime_max_session_s`` (OpenAI's 60 minutes): then an ``error`` event,
``session_expired``, and a normal close. When the server drains (SIGTERM), a session takes no new
work, its work under way (utterances committed; a conversation's replies) runs to its end, then
an ``error`` event, ``shutting_down``, and a close with 1012 (service restart): ``end_for_drain``.

Audio formats, as OpenAI names them: ``{"type": "audio/pcm", "rate": 24000}`` (16-bit mono
little-endian, the default), and telephone audio, ``{"type": "audio/pcmu"}`` (G.711 mu-law) or
``{"type": "audio/pcma"}`` (A-law), 8 kHz, as a phone network's media stream carries it (Twilio's,
for one): decoded and resampled to 24 kHz as it streams in (``workers.audio.G711Stream``), so the
turn detection, the limits and the ``audio_*_ms`` fields are the same for every format.

``noise_reduction`` (``near_field`` or ``far_field``: one denoiser serves both) takes background
noise out of each append before the buffer, the turn detection and the model hear it
(``workers.audio.NoiseReducer``, RNNoise); the denoised stream is as long as the audio sent,
its speech 31 ms later.

A session opened on a chat model is a conversation instead (``gateway.realtime_conversation``,
which builds on this one and holds the ``/v1/realtime`` endpoint that opens either kind). A browser may open a session with a client secret instead of a key
(``/v1/realtime/client_secrets``, ``gateway.realtime_secrets``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import secrets
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from gateway.adapters import may_use
from gateway.audio import TranscriptionJob, stream_transcription
from gateway.auth import Caller
from gateway.errors import APIError, bad_request
from gateway.logprobs import token_entries
from gateway.schemas import InvalidJSON, check_shape
from gateway.service import ClientGone, Services
from gateway.serving import Gone
from gateway.turn_end import EAGERNESS_MAX_MS, SemanticVad, end_probability, transcript_of, turn_wait_ms
from workers.audio import G711_RATE, G711Stream, NoiseReducer
from workers.stt import ServerVad, TextDelta, TranscriptionRequest, Transcript, TurnDetector

log = logging.getLogger("tiergate.realtime")

RATE = 24_000  # PCM16 mono: the rate audio/pcm is taken and said at, and that telephone audio is heard at
FORMATS = {"pcm": {"type": "audio/pcm", "rate": RATE}, "pcmu": {"type": "audio/pcmu"}, "pcma": {"type": "audio/pcma"}}
MIN_COMMIT_S = 0.1  # a shorter buffer is refused at commit, as OpenAI's is
LOGPROBS = "item.input_audio_transcription.logprobs"  # the one thing a transcription session may include
DEFAULT_VAD = ServerVad(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500)  # OpenAI's session defaults
NOISE_REDUCTION = ("near_field", "far_field")  # OpenAI's types; both run the one denoiser (NoiseReducer)
# audio work past these sizes runs on a thread: below them it takes about what the hop there does (~50 µs)
_OFF_LOOP_G711_BYTES = G711_RATE  # a second of telephone audio: ~0.2 ms to decode and resample
_OFF_LOOP_SAMPLES = 10 * RATE  # ten seconds of PCM16 to float32: ~0.8 ms
_SESSION_PARAMS = ("model", "language", "prompt")  # the HTTP fields a session sets in audio.input.transcription
WORK_POLL_S = 0.05  # while the server drains, how often a session looks whether its work under way has ended
CUT_WAIT_S = 1.0  # the drain cut short: how long a session's work cut gets to say how it ended
KEY_CHECK_S = 0.5  # how often an open session looks its key up (in memory), so that a revoke ends an idle one too


@dataclass(frozen=True)
class SessionConfig:
    """What a session transcribes with; ``vad`` None: the client commits each utterance. ``model``
    None: a conversation on a server with no speech-to-text model (text turns only)."""

    model: str | None
    language: str | None = None
    prompt: str = ""
    vad: ServerVad | SemanticVad | None = DEFAULT_VAD
    logprobs: bool = False  # include: ["item.input_audio_transcription.logprobs"]
    codec: str = "pcm"  # the audio it is sent in: a key of FORMATS
    noise_reduction: str | None = None  # a NOISE_REDUCTION type: the buffer's audio is denoised first

    def as_event(self, session_id: str) -> dict:
        return {"type": "transcription", "id": session_id, "object": "realtime.transcription_session",
                "audio": {"input": {"format": FORMATS[self.codec],
                                    "transcription": {"model": self.model, "language": self.language,
                                                      "prompt": self.prompt},
                                    "turn_detection": detection_event(self.vad),
                                    "noise_reduction": noise_event(self.noise_reduction)}},
                "include": [LOGPROBS] if self.logprobs else []}


def detection_event(vad: ServerVad | SemanticVad | None) -> dict | None:
    """A session's ``turn_detection`` as its events show it."""
    if vad is None:
        return None
    if isinstance(vad, SemanticVad):
        return {"type": "semantic_vad", "eagerness": vad.eagerness}
    return {"type": "server_vad", "threshold": vad.threshold, "prefix_padding_ms": vad.prefix_padding_ms,
            "silence_duration_ms": vad.silence_duration_ms}


def noise_event(kind: str | None) -> dict | None:
    """A session's ``noise_reduction`` as its events show it."""
    return None if kind is None else {"type": kind}


def _noise_reduction(value: object) -> str | None:
    param = "session.audio.input.noise_reduction"
    if value is None:
        return None
    value = _object(value, param)
    for key in value:
        if key != "type":
            raise bad_request(f"unknown field noise_reduction.{key}", f"{param}.{key}", "unknown_parameter")
    kind = value.get("type")
    if kind not in NOISE_REDUCTION:
        raise bad_request(f"noise_reduction.type must be one of {', '.join(NOISE_REDUCTION)}, not {str(kind)[:40]!r}",
                          f"{param}.type", "invalid_value")
    return kind


def _object(value: object, param: str) -> dict:
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object", param, "invalid_type")
    return value


def updated(config: SessionConfig, session: object, svc: Services, limits_prompt: int) -> SessionConfig:
    """``config`` with a ``session.update``'s ``session`` applied (``APIError`` naming the field)."""
    session = _object(session, "session")
    kind = session.get("type", "transcription")
    if kind != "transcription":
        raise bad_request(f"this is a transcription session, not type {kind!r}: a conversation is a session opened "
                          "on a chat model (/v1/realtime?model=<chat model>)", "session.type", "unsupported_session_type")
    for key in session:
        if key not in ("type", "audio", "include", "id", "object"):
            raise bad_request(f"unknown or unsupported session field {key!r} for a transcription session",
                              f"session.{key}", "unknown_parameter")
    if "include" in session:
        include = session["include"] or []
        if not isinstance(include, list) or any(x != LOGPROBS for x in include):
            raise bad_request(f"include may list only {LOGPROBS!r}", "session.include", "invalid_value")
        config = replace(config, logprobs=bool(include))
    audio = _object(session.get("audio", {}), "session.audio")
    for key in audio:
        if key != "input":
            raise bad_request(f"a transcription session has no audio.{key}", f"session.audio.{key}", "unknown_parameter")
    given = _object(audio.get("input", {}), "session.audio.input")
    for key in given:
        if key not in ("format", "transcription", "turn_detection", "noise_reduction"):
            raise bad_request(f"unknown field audio.input.{key}", f"session.audio.input.{key}", "unknown_parameter")
    if "noise_reduction" in given:
        config = replace(config, noise_reduction=_noise_reduction(given["noise_reduction"]))
    if "format" in given:
        config = replace(config, codec=audio_format(given["format"], "session.audio.input.format"))
    if "transcription" in given:
        config = _transcription(config, given["transcription"], svc, limits_prompt)
    if "turn_detection" in given:
        config = replace(config, vad=_turn_detection(given["turn_detection"]))
        if isinstance(config.vad, SemanticVad) and judge_of(svc, config.model) is None:
            raise bad_request("semantic_vad asks a chat model whether the user has finished, and this server has none: "
                              "use server_vad", "session.audio.input.turn_detection.type", "unsupported_parameter")
    return config


def judge_of(svc: Services, heard_by: str | None, chat: str | None = None) -> str | None:
    """The chat model that judges turns (``semantic_vad``) heard by the speech model ``heard_by``:
    its tiers.yaml ``turn_model``, else the conversation's chat model ``chat``, else the first;
    only one the key may use (``may_use``: a judge it may not would fail each turn's judgement)."""
    name = svc.model_name(heard_by) if heard_by else None
    turn_model = next((m.turn_model for m in svc.config.models if m.name == name and m.kind == "stt"), None)
    chosen = turn_model if turn_model and may_use(svc.model_name(turn_model)) else chat
    return chosen or next((s.name for s in svc.arbiter.specs.values() if s.kind == "chat" and may_use(s.name)), None)


def audio_format(value: object, param: str) -> str:
    """A session's audio ``format`` (``FORMATS``' values) as its key (``APIError`` naming ``param``)."""
    fmt = _object(value, param)
    kind = fmt.get("type", "audio/pcm")
    codec = next((k for k, v in FORMATS.items() if v["type"] == kind), None)
    if codec is None:
        raise bad_request(f"audio format {str(kind)[:40]!r} is not served: audio/pcm (PCM16 at {RATE} Hz), audio/pcmu "
                          "or audio/pcma (G.711 at 8 kHz)", f"{param}.type", "unsupported_format")
    rate = RATE if codec == "pcm" else G711_RATE
    if fmt.get("rate", rate) != rate:
        raise bad_request(f"{kind} audio is at {rate} Hz, not {str(fmt.get('rate'))[:20]}", f"{param}.rate",
                          "unsupported_format")
    return codec


def _transcription(config: SessionConfig, value: object, svc: Services, limits_prompt: int) -> SessionConfig:
    param = "session.audio.input.transcription"
    value = _object(value, param)
    for key in value:
        if key not in ("model", "language", "prompt"):
            raise bad_request(f"unknown field transcription.{key}", f"{param}.{key}", "unknown_parameter")
    model = value.get("model", config.model)
    if not isinstance(model, str):
        raise bad_request("model must be a string", f"{param}.model", "invalid_type")
    try:
        model = svc.spec(model, "stt").name
    except APIError as exc:
        raise APIError(exc.status, exc.message, exc.code, f"{param}.model") from None
    language, prompt = value.get("language", config.language), value.get("prompt", config.prompt)
    if language is not None and not isinstance(language, str):
        raise bad_request("language must be a string or null", f"{param}.language", "invalid_type")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string", f"{param}.prompt", "invalid_type")
    if len(prompt) > limits_prompt:
        raise bad_request(f"prompt is {len(prompt)} characters, above this server's limit of {limits_prompt}",
                          f"{param}.prompt")
    return replace(config, model=model, language=language or None, prompt=prompt)


def _turn_detection(value: object) -> ServerVad | SemanticVad | None:
    param = "session.audio.input.turn_detection"
    if value is None:
        return None
    value = _object(value, param)
    kind = value.get("type")
    if kind == "semantic_vad":
        return _semantic(value, param)
    if kind != "server_vad":
        raise bad_request(f"turn detection {kind!r} is not served: use server_vad or semantic_vad, or null to commit "
                          "yourself", f"{param}.type", "unsupported_parameter")
    for key in value:
        if key not in ("type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                       "interrupt_response", "idle_timeout_ms"):
            raise bad_request(f"unknown field turn_detection.{key}", f"{param}.{key}", "unknown_parameter")
    if value.get("idle_timeout_ms") is not None:
        raise bad_request("idle_timeout_ms is not served", f"{param}.idle_timeout_ms", "unsupported_parameter")
    threshold = value.get("threshold", DEFAULT_VAD.threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
        raise bad_request("threshold must be a number from 0 to 1", f"{param}.threshold")
    out = {}
    for key in ("prefix_padding_ms", "silence_duration_ms"):
        ms = value.get(key, getattr(DEFAULT_VAD, key))
        if isinstance(ms, bool) or not isinstance(ms, int) or not 0 <= ms <= 10_000:
            raise bad_request(f"{key} must be a whole number of milliseconds from 0 to 10000", f"{param}.{key}")
        out[key] = ms
    return ServerVad(float(threshold), out["prefix_padding_ms"], out["silence_duration_ms"])


def _semantic(value: dict, param: str) -> SemanticVad:
    for key in value:
        if key not in ("type", "eagerness", "create_response", "interrupt_response"):
            raise bad_request(f"unknown field turn_detection.{key} for semantic_vad", f"{param}.{key}", "unknown_parameter")
    eagerness = "auto" if value.get("eagerness") is None else value["eagerness"]  # null: the default, as OpenAI's
    if not isinstance(eagerness, str) or eagerness not in EAGERNESS_MAX_MS:
        raise bad_request(f"eagerness is one of {', '.join(EAGERNESS_MAX_MS)}", f"{param}.eagerness", "invalid_value")
    return SemanticVad(eagerness)


def _float(samples: np.ndarray) -> np.ndarray:
    """int16 samples as float32 in [-1, 1)."""
    return samples.astype(np.float32) / 32768.0


def _audio_bytes(value: object) -> bytes:
    """An append's ``audio``: base64 bytes."""
    if not isinstance(value, str):
        raise bad_request("audio must be a base64 string of audio in the session's format", "audio", "invalid_type")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("audio is not valid base64", "audio", "invalid_value") from None


def _kept_silence(vad: ServerVad | SemanticVad) -> int:
    """Samples of silence ``server_vad`` keeps buffered: a turn's start reaches back its prefix
    padding, plus a second for the frames the detector hears before it decides."""
    return round((vad.prefix_padding_ms / 1000 + 1.0) * RATE)


async def _told(transcript: Transcript):
    """A transcript already made, as ``stream_transcription`` gives one: its text (and tokens), then itself."""
    if transcript.text:
        yield TextDelta(transcript.text, transcript.logprobs)
    yield transcript


def shutting_down(message: str) -> APIError:
    """A session's work refused, or its end, as the server drains (HTTP's code for the same)."""
    return APIError(503, message, "shutting_down")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class _Pause:
    """semantic_vad: a pause in the turn's speech, while its judgement is made and its wait runs.
    ``end``: where the turn's audio would end (the detector's end of speech, padded);
    ``silent_from``: where the silence began; ``p``: the judgement, once made (None: none could be had)."""

    end: int
    silent_from: int
    judge: asyncio.Task | None = None
    judged: bool = False
    p: float | None = None
    heard: tuple[Transcript, int, SessionConfig] | None = None  # the judge's transcript, of so many samples, so made


class TranscriptionSession:
    """One WebSocket's session: the reader (client events, in order) and a transcriber task
    (committed utterances, in order), with one send lock between them."""

    kind = "transcription"  # the session's type, as errors name it

    def __init__(self, ws: WebSocket, svc: Services, caller: Caller, config: SessionConfig) -> None:
        self.ws, self.svc, self.caller, self.config = ws, svc, caller, config
        self.id = _new_id("sess")
        self.limits = svc.config.limits
        self.gone = Gone()  # set when the socket closes: a waiting or running utterance stops
        self._send_lock = asyncio.Lock()
        self._buffer: list[np.ndarray] = []  # int16 at RATE, not yet committed
        self._buffered = 0  # samples in _buffer
        self._start = 0  # the stream's sample index of the buffer's first sample
        self._detector: TurnDetector | None = None  # server_vad's, made at the first append
        self._vad_origin = 0  # the stream's sample index that the detector's own index 0 stands for
        self._speech: tuple[str, int] | None = None  # (item id, start sample) while server_vad hears speech
        self._pause: _Pause | None = None  # semantic_vad: a pause in that speech, being judged
        self._known: dict[str, tuple[Transcript, int, SessionConfig]] = {}  # items the judge transcribed already
        self._previous: str | None = None  # the last committed item
        self._queued_s = 0.0  # audio committed and not yet transcribed
        self._untranscribed = 0  # utterances committed and not yet transcribed
        self.ending = False  # the server drains: the session takes no new work (``end_for_drain``)
        self._utterances: asyncio.Queue[tuple[str, np.ndarray, SessionConfig]] = asyncio.Queue()
        self._telephone: tuple[str, G711Stream] | None = None  # G.711 in: its decoder, which keeps its state
        self._denoiser: NoiseReducer | None = None  # noise_reduction's, made at the first append it hears
        self.key_gone = False  # the key was revoked or taken out of its file: the session ended (``key_stands``)

    async def run(self) -> None:
        await self.send({"type": "session.created", "session": self.config.as_event(self.id)})
        transcriber = asyncio.create_task(self._transcribe_all())
        watcher = asyncio.create_task(self._watch_key())
        try:
            try:
                async with asyncio.timeout(self.limits.realtime_max_session_s):
                    await self._read()
            except TimeoutError:
                await self._expired()
        finally:
            self.gone.set()
            self._forget_pause()
            for task in (transcriber, watcher):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self._detector is not None:
                self._detector.close()
            self._quiet(None)

    async def send(self, event: dict) -> None:
        event = {"event_id": _new_id("event"), **event}
        async with self._send_lock:
            if self.ws.application_state == WebSocketState.CONNECTED:
                with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # the client left meanwhile
                    await self.ws.send_text(json.dumps(event))

    async def _expired(self) -> None:
        """The session reached ``limits.realtime_max_session_s`` (OpenAI's 60 minutes): an
        ``error`` event, ``session_expired``, and the socket closed normally."""
        limit = self.limits.realtime_max_session_s
        length = f"{limit / 60:g} minutes" if limit % 60 == 0 else f"{limit:g} seconds"
        await self.error(APIError(400, f"Your session hit the maximum duration of {length}: open a new one",
                                  "session_expired"), None)
        await self._close(1000, "session_expired")

    async def _close(self, code: int, reason: str) -> None:
        async with self._send_lock:  # (after any event being sent)
            if self.ws.application_state == WebSocketState.CONNECTED:
                with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                    await self.ws.close(code=code, reason=reason)

    async def end_for_drain(self) -> None:
        """The server drains (``Drain.open_session``): the session takes no new work (``shutting_down``),
        its work under way runs to its end (its events sent, its usage metered, as ever), then an
        ``error`` event, ``shutting_down``, and the socket closed with 1012 (service restart, as
        uvicorn closes what is left open at shutdown). An idle session ends at once. The drain's cut
        (its timeout, a second signal) cuts the work under way instead."""
        self.ending = True
        try:
            while self.busy() and not self.gone.is_set:
                await asyncio.sleep(WORK_POLL_S)
        except asyncio.CancelledError:
            await self.cut_work()
            raise
        finally:
            if not self.gone.is_set:
                await self.error(shutting_down("the server is shutting down: open a new session on another instance"),
                                 None)
                await self._close(1012, "shutting_down")

    async def key_stands(self) -> bool:
        """Whether the session's key still stands, looked up as HTTP's would be now
        (``Services.caller_of``: the key files' ring and the managed keys' copy in memory, no I/O):
        asked before each step that makes a request (an utterance's transcription, a
        ``semantic_vad`` judgement, a response), not per audio chunk. A key revoked or taken out of
        its file since (a client secret's: the key that made it) ends the session: an ``error``
        event, ``invalid_api_key``, the socket closed with 1008 (policy violation), and the work
        under way cut (``gone``: a reply stops where it is, metered as far as it ran). A key moved
        to another tier stands: the session goes on at the tier it opened at."""
        if not self.key_gone and self.svc.caller_of(self.caller.key_id) is not None:
            return True
        if not self.key_gone:
            self.key_gone = True
            await self.error(APIError(401, "the API key of this session has been revoked or removed: the session has "
                                           "ended", "invalid_api_key", type="invalid_request_error"), None)
            await self._close(1008, "invalid_api_key")
            self.gone.set()
        return False

    async def _watch_key(self) -> None:
        """``key_stands`` every ``KEY_CHECK_S`` too, so that a session with nothing to do (no step
        to look its key up before) ends within about a second of its key's revoke, not at its next
        step or its ``realtime_max_session_s``: a lookup in memory, as ``key_stands``' own."""
        while await self.key_stands():
            await asyncio.sleep(KEY_CHECK_S)

    def busy(self) -> bool:
        """Whether work is under way: an utterance committed and not yet transcribed."""
        return self._untranscribed > 0

    async def cut_work(self) -> None:
        """The drain was cut short: the work under way stops (the socket's close stops a transcription)."""

    async def error(self, exc: APIError, event_id: str | None) -> None:
        await self.send({"type": "error", "error": {"type": exc.type, "code": exc.code, "message": exc.message,
                                                   "param": exc.param, "event_id": event_id}})

    # -- client events ----------------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            event_id = None
            try:
                if text is None:
                    raise bad_request("client events are JSON text frames, not binary ones", None, "invalid_event")
                try:
                    check_shape(text, "the client event")  # as HTTP bodies: no depth can raise RecursionError
                    event = json.loads(text)
                except InvalidJSON as exc:
                    raise bad_request(str(exc), None, "invalid_json") from None
                except ValueError:
                    raise bad_request("the client event is not valid JSON", None, "invalid_json") from None
                if isinstance(event, dict) and isinstance(event.get("event_id"), str):
                    event_id = event["event_id"]  # echoed by any error about the event, its type's too
                if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                    raise bad_request("a client event is a JSON object with a string 'type'", "type", "invalid_event")
                await self._handle(event)
            except APIError as exc:
                await self.error(exc, event_id)

    async def _handle(self, event: dict) -> None:
        kind = event["type"]
        if kind == "session.update":
            config = updated(self.config, event.get("session"), self.svc, self.limits.prompt_max_chars)
            if config.vad != self.config.vad:  # a new detector hears what comes next
                self.new_detection()
            self._quiet(config.noise_reduction)
            self.config = config
            await self.send({"type": "session.updated", "session": config.as_event(self.id)})
        elif kind == "input_audio_buffer.append":
            await self._append(await self._samples(_audio_bytes(event.get("audio"))))
        elif kind == "input_audio_buffer.commit":
            if self._buffered < MIN_COMMIT_S * RATE:
                raise bad_request(f"buffer too small: {self._buffered / RATE * 1000:.0f} ms of audio, at least "
                                  f"{MIN_COMMIT_S * 1000:.0f} ms are needed", None, "input_audio_buffer_commit_empty")
            item = self._speech[0] if self._speech else _new_id("item")
            await self._commit(item, self._start + self._buffered)
        elif kind == "input_audio_buffer.clear":
            self._drop(self._start + self._buffered)
            await self.send({"type": "input_audio_buffer.cleared"})
        else:
            raise bad_request(f"unknown or unsupported client event type {kind!r} on a {self.kind} session",
                              "type", "invalid_event")

    async def _samples(self, raw: bytes, whole: bool = False, param: str = "audio") -> np.ndarray:
        """Bytes in the session's format as int16 samples at ``RATE``: an append's, the next piece
        of the stream (G.711's decoder keeps its state from one to the next), or with ``whole``, a
        recording of its own, to its end (errors name ``param``). G.711 past a second is decoded
        and resampled on a thread (0.7-1.2 s for 25 minutes of it here); the reader awaits it, so
        appends stay in order."""
        codec = self.config.codec
        if codec == "pcm":
            if len(raw) % 2:
                raise bad_request("audio has an odd number of bytes: PCM16 samples are 2 bytes each", param)
            return np.frombuffer(raw, dtype="<i2")
        if whole:
            telephone = G711Stream(codec, RATE, encode=False)

            def decode() -> bytes:
                return telephone.feed(raw) + telephone.flush()
        else:
            if self._telephone is None or self._telephone[0] != codec:
                self._telephone = (codec, G711Stream(codec, RATE, encode=False))
            decode = partial(self._telephone[1].feed, raw)
        pcm = await asyncio.to_thread(decode) if len(raw) > _OFF_LOOP_G711_BYTES else decode()
        return np.frombuffer(pcm, dtype="<i2")

    def _quiet(self, kind: str | None) -> None:
        """Noise reduction set to ``kind``: a denoiser dropped when it goes off (its state freed)."""
        if kind is None and self._denoiser is not None:
            self._denoiser.close()
            self._denoiser = None

    async def _append(self, samples: np.ndarray) -> None:
        if not len(samples):
            return
        if (self._buffered + len(samples)) / RATE > self.limits.transcription_max_seconds:
            raise bad_request(f"the audio buffer would pass this server's limit of "
                              f"{self.limits.transcription_max_seconds:g} s: commit or clear it first", "audio",
                              "input_audio_buffer_too_long")
        if self.config.noise_reduction is not None:  # before the buffer, the turn detection and the model hear it
            if self._denoiser is None:  # loading RNNoise's library reads a file: off the event loop
                self._denoiser = await asyncio.to_thread(NoiseReducer, RATE)
            samples = await asyncio.to_thread(self._denoiser.feed, samples)  # as many samples: the check holds
        self._buffer.append(samples)
        self._buffered += len(samples)
        if self.config.vad is None:
            return
        if self._detector is None:  # loading the detector's model reads a file: off the event loop
            self._detector = await asyncio.to_thread(TurnDetector, self.config.vad, RATE)
            self._vad_origin = self._start + self._buffered - len(samples)  # it hears from these samples on
        edges = await asyncio.to_thread(self._detector.feed, samples.astype(np.float32) / 32768.0)
        # all of one feed's edges are placed from the origin it was heard from: a turn's end and the
        # next one's start may come together (a short pause), and the end's commit must not move the start
        origin = self._vad_origin
        for kind, at in edges:
            at += origin
            if kind == "start" and self._speech is None:
                item, start = _new_id("item"), max(self._start, at)
                self._speech = (item, start)
                await self.send({"type": "input_audio_buffer.speech_started", "item_id": item,
                                 "audio_start_ms": round(start / RATE * 1000)})
            elif kind == "start" and self._pause is not None:  # speech again within the wait: the same turn
                self._forget_pause()
            elif kind == "end" and self._speech is not None and self._pause is None:
                end = min(max(at, self._speech[1]), self._start + self._buffered)
                if isinstance(self.config.vad, SemanticVad):
                    silent_from = at - round(self.config.vad.prefix_padding_ms / 1000 * RATE)
                    self._pause = _Pause(end, max(self._speech[1], silent_from))
                    self._pause.judge = asyncio.create_task(self._judge(self._pause))
                else:
                    await self._end_turn(end)
        await self._turn_over()
        if self._speech is None:  # silence is kept only as far back as a turn's start may reach
            self._take(self._start + self._buffered - _kept_silence(self.config.vad))

    async def _end_turn(self, end: int) -> None:
        """The turn detection's end of the turn in progress: its audio, to the stream's ``end``, is committed."""
        item, start = self._speech
        await self.send({"type": "input_audio_buffer.speech_stopped", "item_id": item,
                         "audio_end_ms": round(end / RATE * 1000)})
        self._drop(start)  # the silence before the speech is not transcribed
        await self._commit(item, end, heard=True)

    # -- semantic_vad -------------------------------------------------------------------------------

    def judge_model(self) -> str | None:
        """The chat model that judges this session's turns."""
        return judge_of(self.svc, self.config.model)

    async def _judge(self, pause: _Pause) -> None:
        """Transcribe the turn so far and ask the judge whether it is over; then end it if the
        silence heard meanwhile is already long enough."""
        if self._speech is None or self._pause is not pause:  # the turn ended before this task began
            return
        start = self._speech[1]
        whole = np.concatenate(self._buffer) if self._buffer else np.zeros(0, np.int16)
        audio = whole[max(0, start - self._start):max(0, pause.end - self._start)]
        config, judge = self.config, self.judge_model()
        if not await self.key_stands():
            return
        try:
            heard = await transcript_of(self.svc, self.caller, config.model, audio, RATE,
                                        TranscriptionRequest(config.language, config.prompt or None,
                                                             logprobs=config.logprobs), self.gone)
            if heard is not None:
                pause.heard = (heard, len(audio), config)
                if heard.text.strip() and judge is not None:
                    pause.p = await end_probability(self.svc, self.caller, judge, heard.text)
        except ClientGone:
            return
        except APIError as exc:  # a full gate, a quota, a key that may not use the judge: the longest wait
            log.info("semantic_vad: no judgement (%s): the turn waits the longest", exc.code)
        except Exception:  # noqa: BLE001 - the session goes on; the turn waits the longest
            log.exception("semantic_vad: the judgement failed")
        pause.judged = True
        try:
            await self._turn_over()
        except APIError as exc:  # the commit's own refusal (too much audio waiting): as at a client's commit
            await self.error(exc, None)

    async def _turn_over(self) -> None:
        """semantic_vad: end the turn once the silence since its pause reaches the wait its judgement asks for."""
        pause, vad = self._pause, self.config.vad
        if pause is None or not isinstance(vad, SemanticVad):
            return
        wait = turn_wait_ms(pause.p, vad.eagerness) if pause.judged else EAGERNESS_MAX_MS[vad.eagerness]
        if (self._start + self._buffered - pause.silent_from) / RATE * 1000 < wait:
            return
        self._forget_pause()
        if pause.heard is not None and self._speech is not None:  # the turn's audio is what the judge heard
            self._known[self._speech[0]] = pause.heard
        await self._end_turn(pause.end)

    def _forget_pause(self) -> None:
        pause, self._pause = self._pause, None
        if pause is not None and pause.judge is not None and pause.judge is not asyncio.current_task():
            pause.judge.cancel()

    def new_detection(self) -> None:
        """The turn detection changed: the turn in progress is forgotten, and a new detector hears what comes next."""
        self._forget_pause()
        if self._detector is not None:
            self._detector.close()
            self._detector, self._speech = None, None

    async def _commit(self, item: str, end: int, heard: bool = False) -> None:
        """Commit the buffer up to the stream's sample ``end`` as utterance ``item``. A turn the
        detector ended (``heard``) leaves it hearing on: the stream it heard is still the session's,
        and the next turn may already have started in it. A client's commit restarts it."""
        audio = self._take(end)
        try:
            self._room_for(len(audio) / RATE)
        except APIError:
            self._buffer.insert(0, audio)  # nothing accepted is lost: it stays in the buffer
            self._buffered += len(audio)
            self._start -= len(audio)
            raise
        previous = self._placed(item)
        await self.send({"type": "input_audio_buffer.committed", "item_id": item, "previous_item_id": previous})
        self._previous = item
        self._speech = None
        if heard:
            self._forget_pause()
        else:
            self._restart_detector()
        self._transcribe_later(item, audio)

    def _placed(self, item: str) -> str | None:
        """The committed utterance ``item`` placed: the id of the item before it (here the last
        committed; a conversation places its user item among its own)."""
        return self._previous

    def _room_for(self, seconds: float) -> None:
        """429 when ``seconds`` more audio would pass what a session may have waiting to be
        transcribed (``limits.transcription_max_seconds``); 503 while the server drains."""
        if self.ending:
            raise shutting_down("the server is shutting down: this session takes no new audio to transcribe; open "
                                "a new session on another instance")
        if self._queued_s + seconds > self.limits.transcription_max_seconds:
            raise APIError(429, "this session's audio waits to be transcribed beyond the server's limit of "
                                f"{self.limits.transcription_max_seconds:g} s: send it again later",
                           "too_much_pending_audio")

    def _transcribe_later(self, item: str, audio: np.ndarray) -> None:
        """Queue ``audio`` as utterance ``item``, transcribed after those before it."""
        self._queued_s += len(audio) / RATE
        self._untranscribed += 1
        self._utterances.put_nowait((item, audio, self.config))

    def _take(self, end: int) -> np.ndarray:
        """The buffered samples before the stream's index ``end``; the rest stays buffered."""
        whole = np.concatenate(self._buffer) if self._buffer else np.zeros(0, np.int16)
        cut = max(0, min(len(whole), end - self._start))
        taken, rest = whole[:cut], whole[cut:]
        self._buffer = [rest] if len(rest) else []
        self._buffered = len(rest)
        self._start += cut
        return taken

    def _drop(self, end: int) -> None:
        """Forget the buffered samples before ``end`` (a clear: all of them; then the detector too)."""
        self._take(end)
        if not self._buffered:
            self._speech = None
            self._restart_detector()

    def _restart_detector(self) -> None:
        """The detector hears the stream afresh from the buffer's end (after a commit or a clear)."""
        self._forget_pause()
        if self._detector is not None:
            self._detector.reset()
        self._vad_origin = self._start + self._buffered

    # -- committed utterances -------------------------------------------------------------------

    async def _transcribe_all(self) -> None:
        while True:
            item, audio, config = await self._utterances.get()
            try:
                await self._transcribe(item, audio, config)
            finally:
                self._queued_s -= len(audio) / RATE
                self._untranscribed -= 1

    async def _transcribe(self, item: str, samples: np.ndarray, config: SessionConfig) -> None:
        # a long utterance is converted on a thread (0.04-0.3 s for 25 minutes here); resampled on the model's
        audio = await asyncio.to_thread(_float, samples) if len(samples) > _OFF_LOOP_SAMPLES else _float(samples)
        job = TranscriptionJob(config.model, audio, RATE, TranscriptionRequest(config.language, config.prompt or None,
                                                                              logprobs=config.logprobs))
        base = {"item_id": item, "content_index": 0}
        pieces = None
        heard: str | None = None
        known = self._known.pop(item, None)
        known = known[0] if known is not None and known[1:] == (len(samples), config) else None
        try:
            if not await self.key_stands():  # the session has ended (its item's waiters still hear it went untold)
                return
            # a turn semantic_vad ended where it was judged: its transcript is the judge's (made, and metered, once)
            pieces = _told(known) if known is not None else stream_transcription(self.svc, self.caller, job, self.gone)
            async for piece in pieces:
                logprobs = {} if piece.logprobs is None else {"logprobs": token_entries(piece.logprobs)}
                if isinstance(piece, Transcript):
                    heard = piece.text
                    await self.send({"type": "conversation.item.input_audio_transcription.completed", **base,
                                     "transcript": piece.text, **logprobs,
                                     "usage": {"type": "duration", "seconds": round(job.duration, 3)}})
                elif piece.text or piece.logprobs:
                    await self.send({"type": "conversation.item.input_audio_transcription.delta", **base,
                                     "delta": piece.text, **logprobs})
        except APIError as exc:  # a setting the serving core refused is named as the session has it
            param = f"session.audio.input.transcription.{exc.param}" if exc.param in _SESSION_PARAMS else exc.param
            await self.failed(base, {"type": exc.type, "code": exc.code, "message": exc.message, "param": param})
        except ClientGone:
            return
        except Exception:  # noqa: BLE001 - this utterance fails; the session and its next utterances go on
            log.exception("realtime transcription failed")
            await self.failed(base, {"type": "server_error", "code": "server_error", "message": "the transcription failed",
                                     "param": None})
        finally:
            if pieces is not None:
                await pieces.aclose()
            await self.transcribed(item, heard)

    async def transcribed(self, item: str, transcript: str | None) -> None:
        """An utterance's transcription ended: its transcript, None when it failed (a conversation
        session adds it to its user item)."""

    async def failed(self, base: dict, error: dict) -> None:
        await self.send({"type": "conversation.item.input_audio_transcription.failed", **base, "error": error})
