"""Spoken chat replies: Chat Completions' ``modalities: ["text", "audio"]`` with ``audio: {"voice",
"format"}``, as OpenAI's audio models answer.

The reply is written as text first, then said by the text-to-speech model tiers.yaml names for the
chat model (``engine: {audio_output: <tts model>}``), as a request of the caller's tier: gated,
metered and limited as /v1/audio/speech is, but not the HTTP request's log line, which stays the
chat's. The message's ``content`` is then null and its ``audio`` is ``{"id", "data" (the file,
base64), "expires_at", "transcript"}``. Streamed (``format: "pcm16"`` only, as OpenAI's), each
choice's transcript goes out as its text is written (``delta.audio.transcript``), then its speech a
sentence at a time (``delta.audio.data``: 16-bit mono PCM at 24 kHz), then ``delta.audio: {"id",
"expires_at"}`` with the finish reason. A reply with no text (only tool calls) is not said.

A later turn may send the reply back as ``{"role": "assistant", "audio": {"id": ...}}``: it is read
as its transcript, by the key that asked for it, until ``expires_at`` (an hour, as OpenAI keeps
them; in this process's memory, as image urls are). The model hears the words it wrote: the voice
is the speech model's, not the chat model's.
"""

from __future__ import annotations

import base64
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from gateway.audio import SpeechJob, serve_speech
from gateway.auth import Caller
from gateway.errors import bad_request
from gateway.input_audio import chat_engine
from gateway.schemas import ChatCompletionRequest
from gateway.service import Services
from gateway.serving import Gone, weightless
from workers import audio as sound
from workers.tts import SpeechRequest, TTSWorker

if TYPE_CHECKING:
    from gateway.chat import Reply

FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "opus": "opus", "aac": "aac", "pcm16": "pcm"}  # OpenAI's -> ours
PCM16_RATE = 24_000  # OpenAI's pcm16: 16-bit little-endian mono at 24 kHz
KEPT_S = 3600.0  # how long a reply's audio id is read back (OpenAI's expires_at: an hour)


@dataclass(frozen=True)
class Voice:
    """How a request's replies are said: the speech model, the voice, and the encoding (as
    ``workers.audio`` names it) at ``rate`` (None: the model's own)."""

    model: str
    voice: str
    format: str
    rate: int | None
    model_rate: int  # the model's own sample rate

    def job(self, text: str) -> SpeechJob:
        return SpeechJob(self.model, SpeechRequest(text, self.voice, 1.0), self.format, self.model_rate,
                         out_rate=self.rate, quiet=True)


class SpokenReplies:
    """The transcripts of spoken replies by audio id, with the key that asked for each, for
    ``kept_s`` (at most ``max_items``, the oldest dropped first). Insertion order is expiry order."""

    def __init__(self, kept_s: float = KEPT_S, max_items: int = 100_000, clock: Callable[[], float] = time.time) -> None:
        self.kept_s, self.max_items, self.clock = kept_s, max_items, clock
        self._items: OrderedDict[str, tuple[str, float, str]] = OrderedDict()  # id -> (owner, expires_at, transcript)

    @staticmethod
    def new_id() -> str:
        return f"audio_{secrets.token_hex(16)}"

    def put(self, owner: str, audio_id: str, transcript: str) -> int:
        """Keep ``transcript`` as ``audio_id``'s; returns its ``expires_at`` (Unix seconds)."""
        self._expire()
        while len(self._items) >= self.max_items:
            self._items.popitem(last=False)
        expires_at = self.clock() + self.kept_s
        self._items[audio_id] = (owner, expires_at, transcript)
        return int(expires_at)

    def get(self, owner: str, audio_id: str) -> str | None:
        """The transcript of ``owner``'s reply ``audio_id`` while it is kept; else None."""
        self._expire()
        item = self._items.get(audio_id)
        if item is None or not secrets.compare_digest(item[0], owner):
            return None
        return item[2]

    def _expire(self) -> None:
        now = self.clock()
        while self._items and next(iter(self._items.values()))[1] <= now:
            self._items.popitem(last=False)


def _kept(svc: Services) -> SpokenReplies:
    assert svc.spoken is not None, "gateway.app.build_services sets Services.spoken"
    return svc.spoken


async def plan_voice(svc: Services, body: ChatCompletionRequest) -> Voice | None:
    """How ``body``'s replies are said (None: they are not), checked before any is written: a
    chat model without ``engine.audio_output``, a format this installation cannot encode, a
    streamed reply in another format than pcm16 and an unknown voice are 400s."""
    if not body.spoken:
        if body.audio is not None:
            raise bad_request('audio is how a spoken reply is said: ask for one with modalities ["text", "audio"]',
                              "audio", "invalid_value")
        return None
    if body.audio is None:
        raise bad_request('missing required parameter: audio (the voice and format), which modalities ["text", '
                          '"audio"] needs', "audio", "missing_required_parameter")
    engine = chat_engine(svc, body.model)
    if engine is None or engine.audio_output is None:
        raise bad_request(f"the model '{body.model}' does not speak here (tiers.yaml names no engine.audio_output "
                          'for it): ask for modalities ["text"], and say the text with /v1/audio/speech',
                          "modalities", "audio_output_not_supported")
    fmt = FORMATS[body.audio.format]
    if body.stream and fmt != "pcm":
        raise bad_request("a streamed spoken reply is pcm16 (16-bit PCM at 24 kHz), as OpenAI's is: set "
                          "audio.format to pcm16, or do not stream", "audio.format", "invalid_value")
    if fmt not in sound.supported_speech_formats():
        can = [name for name, ours in FORMATS.items() if ours in sound.supported_speech_formats()]
        raise bad_request(f"this installation cannot encode {body.audio.format}; audio.format is one of "
                          f"{', '.join(can)}", "audio.format", "invalid_value")
    spec = svc.spec(engine.audio_output, "tts")
    voices = await weightless(svc.voices, spec, TTSWorker)  # its voices, read from the folder
    try:
        voices.resolve_voice(body.audio.voice)
    except ValueError as exc:
        raise bad_request(str(exc), "audio.voice", "invalid_value") from None
    return Voice(spec.name, body.audio.voice, fmt, PCM16_RATE if fmt == "pcm" else None, voices.sample_rate)


async def say(svc: Services, caller: Caller, voice: Voice, text: str, gone: Gone | None) -> AsyncIterator[bytes]:
    """``text`` said in ``voice``, encoded, a sentence a piece for pcm16 and wav (whose first piece
    is a header of unknown length), whole for the others; nothing said for a text the model
    cannot say."""
    async for piece in serve_speech(svc, caller, voice.job(text), gone, recorded=False):
        yield piece


async def say_replies(svc: Services, caller: Caller, voice: Voice, replies: list["Reply"], gone: Gone | None) -> None:
    """Say each reply that has text, whole, and give it its ``audio`` (``Reply.audio``)."""
    for reply in replies:
        text = "".join(reply.content)
        if not text:
            continue
        data = b"".join([piece async for piece in say(svc, caller, voice, text, gone)])
        if voice.format == "wav":
            data = sound.sized_wav(data)
        audio_id = SpokenReplies.new_id()
        expires_at = _kept(svc).put(caller.key_id, audio_id, text)
        reply.audio = {"id": audio_id, "data": base64.b64encode(data).decode(), "expires_at": expires_at,
                       "transcript": text}


def heard_replies(svc: Services, caller: Caller, data: Any) -> Any:
    """A chat request's JSON with each assistant message's ``audio: {"id": ...}`` read as the
    transcript of that spoken reply (its ``content``, unless the message has one); ``data`` as it
    is when none has one. An id this key's replies do not have (any more) is a 400."""
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not any(isinstance(m, dict) and "audio" in m for m in messages):
        return data
    out = []
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and "audio" in message):
            out.append(message)
            continue
        where = f"messages[{i}].audio"
        if message.get("role") != "assistant":
            raise bad_request(f"audio is only for assistant messages (a spoken reply's id), not "
                              f"{str(message.get('role'))[:20]}: send a user's speech as an input_audio part",
                              where, "invalid_value")
        audio = message["audio"]
        if audio is None:
            out.append({k: v for k, v in message.items() if k != "audio"})
            continue
        if not isinstance(audio, dict) or not isinstance(audio.get("id"), str) or set(audio) != {"id"}:
            raise bad_request('an assistant message\'s audio is {"id": <a spoken reply\'s audio id>}', where,
                              "invalid_value")
        transcript = _kept(svc).get(caller.key_id, audio["id"])
        if transcript is None:
            raise bad_request(f"no spoken reply {audio['id'][:64]!r} is kept for this key (they are kept for an "
                              "hour after the reply, in the server that made it): send its transcript as content",
                              f"{where}.id", "invalid_value")
        kept = {k: v for k, v in message.items() if k != "audio"}
        if kept.get("content") is None:
            kept["content"] = transcript
        out.append(kept)
    return {**data, "messages": out}
