"""Spoken chat replies: Chat Completions' ``modalities: ["text", "audio"]`` with ``audio: {"voice",
"format"}``, as OpenAI's audio models answer.

The reply is written as text first, then said by the text-to-speech model tiers.yaml names for the
chat model (``engine: {audio_output: <tts model>}``), as a request of the caller's tier: gated,
metered and limited as /v1/audio/speech is, but not the HTTP request's log line, which stays the
chat's. The message's ``content`` is then null and its ``audio`` is ``{"id", "data" (the file,
base64), "expires_at", "transcript"}``. Streamed (``format: "pcm16"`` only, as OpenAI's), each
choice's transcript goes out as its text is written (``delta.audio.transcript``), and its speech a
phrase at a time as soon as the phrase is written (``delta.audio.data``: 16-bit mono PCM at 24 kHz,
in deltas of at most 100 ms; ``SpokenStream``, each phrase a speech request of its own), then ``delta.audio: {"id",
"expires_at"}`` with the finish reason. A reply with no text (only tool calls) is not said.

A later turn may send the reply back as ``{"role": "assistant", "audio": {"id": ...}}``: it is read
as its transcript, by the key that asked for it, until ``expires_at`` (an hour, as OpenAI keeps
them; in this process's memory, as image urls are). The model hears the words it wrote: the voice
is the speech model's, not the chat model's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from gateway.adapters import may_use
from gateway.audio import SpeechJob, deltas, serve_speech
from gateway.auth import Caller
from gateway.errors import bad_request
from gateway.input_audio import chat_engine
from gateway.origin import AUDIO, tagged
from gateway.schemas import ChatCompletionRequest
from gateway.service import Services
from gateway.serving import Gone, weightless
from workers import audio as sound
from workers.tts import SpeechRequest, TTSWorker

if TYPE_CHECKING:
    from gateway.chat import Reply

FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "opus": "opus", "aac": "aac", "pcm16": "pcm"}  # OpenAI's -> ours
PCM16_RATE = 24_000  # OpenAI's pcm16: 16-bit little-endian mono at 24 kHz
FIRST_WORDS_CHARS = 60  # the first phrase without a sentence's end is said once this long, at a space
LATER_WORDS_CHARS = 240  # later ones: fewer speech requests, each said while the next is written
_PHRASE_END = re.compile(r"(?<=[.!?;:,。！？…])\s+|\n+")
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
    speed: float = 1.0  # as /v1/audio/speech takes it (a realtime session's audio.output.speed)

    def job(self, text: str) -> SpeechJob:
        return SpeechJob(self.model, SpeechRequest(text, self.voice, self.speed), self.format, self.model_rate,
                         out_rate=self.rate, quiet=True)


class SpokenReplies:
    """The transcripts of spoken replies by audio id, with the key that asked for each, for
    ``kept_s`` (at most ``max_items``, the oldest dropped first). Insertion order is expiry order."""

    def __init__(self, kept_s: float = KEPT_S, max_items: int = 100_000, clock: Callable[[], float] = time.time,
                 origin: str = "") -> None:
        """``origin``: the cluster replica that makes the ids (``gateway.origin``)."""
        self.kept_s, self.max_items, self.clock, self.origin = kept_s, max_items, clock, origin
        self._items: OrderedDict[str, tuple[str, float, str]] = OrderedDict()  # id -> (owner, expires_at, transcript)

    def new_id(self) -> str:
        return tagged(AUDIO, self.origin, secrets.token_hex(16))

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
    # a speech model the key may not use is one it does not have: refused now, unnamed, not once the reply is written
    if engine is None or engine.audio_output is None or not may_use(svc.model_name(engine.audio_output)):
        raise bad_request(f"the model '{body.model}' does not speak here (tiers.yaml names no engine.audio_output "
                          'for it that this key may use): ask for modalities ["text"], and say the text with '
                          "/v1/audio/speech", "modalities", "audio_output_not_supported")
    fmt = FORMATS[body.audio.format]
    if body.stream and fmt != "pcm":
        raise bad_request("a streamed spoken reply is pcm16 (16-bit PCM at 24 kHz), as OpenAI's is: set "
                          "audio.format to pcm16, or do not stream", "audio.format", "invalid_value")
    if fmt not in sound.supported_speech_formats():
        can = [name for name, ours in FORMATS.items() if ours in sound.supported_speech_formats()]
        raise bad_request(f"this installation cannot encode {body.audio.format}; audio.format is one of "
                          f"{', '.join(can)}", "audio.format", "invalid_value")
    spec = svc.spec(engine.audio_output, "tts")
    voices = await weightless(svc.voices, spec, TTSWorker.reader)  # its voices, read from the folder
    try:
        voices.resolve_voice(body.audio.voice)
    except ValueError as exc:
        raise bad_request(str(exc), "audio.voice", "invalid_value") from None
    return Voice(spec.name, body.audio.voice, fmt, PCM16_RATE if fmt == "pcm" else None, voices.sample_rate)


def phrases_of(text: str, first: bool = True) -> tuple[list[str], str]:
    """The phrases of ``text`` that are whole, to be said now, and the rest, still being written:
    a phrase ends at a sentence's or a clause's end followed by a space, or else, once the text is
    ``FIRST_WORDS_CHARS`` long (the reply's ``first`` phrase: its first sound waits for no more) or
    ``LATER_WORDS_CHARS`` long, at its last space."""
    ends = [m.end() for m in _PHRASE_END.finditer(text)]
    long = FIRST_WORDS_CHARS if first else LATER_WORDS_CHARS
    cut = ends[-1] if ends else (text.rfind(" ") + 1 if len(text) >= long else 0)
    whole = [p.strip() for p in _PHRASE_END.split(text[:cut]) if p.strip()]
    return whole, text[cut:]


async def say(svc: Services, caller: Caller, voice: Voice, text: str, gone: Gone | None,
              within: bool = False) -> AsyncIterator[bytes]:
    """``text`` said in ``voice``, encoded, as it is made (a sentence at a time for pcm16 and wav,
    whose first piece is a header of unknown length; whole for the others), in the deltas that
    stream it (``gateway.audio.deltas``); nothing said for a text the model cannot say.
    ``within``: a phrase of a reply said while the reply is written, a step of the reply's own
    request, which its key's ``concurrent`` limit counts once (``Accounts.admit``): else a key
    with ``concurrent: 1`` would have every such phrase refused by its own reply."""
    async for piece in serve_speech(svc, caller, voice.job(text), gone, recorded=False, within=within):
        for i, delta in enumerate(deltas(piece)):
            if i:  # a sentence's deltas are sent back to back, unawaited: the loop runs others between them
                await asyncio.sleep(0)
            yield delta


class SpokenStream:
    """The speech of a streamed reply's choices, a phrase at a time while the rest is written
    (``phrases_of``): each choice's phrases are said in order by a task of its own, each phrase a
    speech request, and the sound waits in one queue for the stream to send it."""

    def __init__(self, speaker: Callable[[str], AsyncIterator[bytes]], n: int) -> None:
        self.speaker = speaker
        self.text: dict[int, list[str]] = {i: [] for i in range(n)}  # each choice's words so far
        self._pending = {i: "" for i in range(n)}  # written, not yet a whole phrase
        self._phrases: dict[int, asyncio.Queue[str | None]] = {}
        self._tasks: dict[int, asyncio.Task] = {}
        self._ended: set[int] = set()
        self._sound: asyncio.Queue[tuple[int, bytes | Exception | None]] = asyncio.Queue()  # None: a choice's end

    def write(self, index: int, text: str) -> None:
        """Choice ``index`` wrote ``text``: the phrases it completes start to be said."""
        self.text[index].append(text)
        ready, self._pending[index] = phrases_of(self._pending[index] + text, first=index not in self._tasks)
        for phrase in ready:
            self._say(index, phrase)

    def ready(self) -> list[tuple[int, bytes]]:
        """The sound said so far and not yet taken, as (choice, PCM piece); a failed speech
        request raises its error."""
        out = []
        while not self._sound.empty():
            piece = self._take(self._sound.get_nowait())
            if piece is not None:
                out.append(piece)
        return out

    async def rest(self, index: int) -> AsyncIterator[tuple[int, bytes]]:
        """Choice ``index`` is written: its last words said, the sound (of any choice) as it comes
        until that choice's speech has ended."""
        if self._pending[index].strip():
            self._say(index, self._pending[index])
        self._pending[index] = ""
        if index not in self._tasks:
            return
        self._phrases[index].put_nowait(None)
        while index not in self._ended:
            piece = self._take(await self._sound.get())
            if piece is not None:
                yield piece

    async def aclose(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _say(self, index: int, phrase: str) -> None:
        if index not in self._tasks:
            self._phrases[index] = asyncio.Queue()
            self._tasks[index] = asyncio.create_task(self._speak(index))
        self._phrases[index].put_nowait(phrase)

    async def _speak(self, index: int) -> None:
        try:
            while (phrase := await self._phrases[index].get()) is not None:
                async with contextlib.aclosing(self.speaker(phrase)) as pieces:
                    async for piece in pieces:
                        self._sound.put_nowait((index, piece))
        except Exception as exc:  # noqa: BLE001 - the stream reports it (a 429 from the speech model's gate)
            self._sound.put_nowait((index, exc))
        else:
            self._sound.put_nowait((index, None))

    def _take(self, item: tuple[int, bytes | Exception | None]) -> tuple[int, bytes] | None:
        index, piece = item
        if isinstance(piece, Exception):
            raise piece
        if piece is None:
            self._ended.add(index)
            return None
        return index, piece


async def say_replies(svc: Services, caller: Caller, voice: Voice, replies: list["Reply"], gone: Gone | None) -> None:
    """Say each reply that has text, whole, and give it its ``audio`` (``Reply.audio``)."""
    for reply in replies:
        text = "".join(reply.content)
        if not text:
            continue
        data = b"".join([piece async for piece in say(svc, caller, voice, text, gone)])
        if voice.format == "wav":
            data = sound.sized_wav(data)
        audio_id = _kept(svc).new_id()
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
