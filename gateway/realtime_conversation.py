"""The Realtime API's conversation sessions (``/v1/realtime?model=<chat model>``, a session of
``type: "realtime"``): a voice agent as a cascade of the models this server runs. Speech streams
in and is transcribed (as a transcription session's is, ``gateway.realtime``), the chat model
answers the conversation so far, and its reply is said by a text-to-speech model, streamed back
as 24 kHz PCM16 with its transcript. OpenAI's protocol, as its SDK speaks it:

* ``session.update`` (``type: "realtime"``): ``instructions``, ``output_modalities`` (``["audio"]``,
  the default, or ``["text"]``), ``max_output_tokens``, ``audio.input`` (``format``: 24 kHz PCM16,
  or G.711 telephone audio, as ``gateway.realtime`` takes it; ``transcription.model``, a
  speech-to-text model, or ``transcription: null``: no transcription events, the speech still heard;
  ``turn_detection``, ``server_vad``, ``semantic_vad`` (judged by the
  session's own chat model: ``gateway.turn_end``) or null, with ``create_response``,
  ``interrupt_response`` and, for ``server_vad``, ``idle_timeout_ms``), ``truncation`` (``auto``:
  each response reads the conversation without its oldest turns when it outgrows the context,
  ``gateway.responses.fitting``; or ``disabled``) and
  ``audio.output`` (``format``: the same three, the speech resampled to 8 kHz and encoded as it
  streams for G.711; ``voice``; ``speed``, 0.25 to 1.5, as ``/v1/audio/speech`` says it).
* Turns: ``input_audio_buffer.append`` / ``commit`` / ``clear`` (or the turn detection), each committed
  utterance a user item whose transcript comes as ``conversation.item.input_audio_transcription.*``;
  ``conversation.item.create`` adds a message (last, or after its ``previous_item_id``, or first
  with ``"root"``): a user or system message's text, an assistant's (a restored history: its
  text, or a spoken part's transcript), or a user message of one ``input_audio`` part with its
  ``audio`` in the session's input format, transcribed in turn as a committed utterance is (it
  starts no response of its own).
* The conversation's items: ``conversation.item.retrieve`` (the item as kept: a spoken turn's
  transcript, not its sound), ``conversation.item.delete``, and ``conversation.item.truncate``: the
  client's playback of a spoken reply stopped at ``audio_end_ms`` (the user spoke over it), so the
  reply's transcript, the text the next reply reads, becomes the words said by then (those of the
  phrases said whole, and of the phrase cut, its words in proportion to the part of its sound
  played: the speech model gives no word timings).
* ``response.create`` (its ``response`` may set ``instructions``, ``output_modalities``,
  ``max_output_tokens``, ``tools``, ``tool_choice`` and ``audio.output`` for itself; or
  ``server_vad``'s end of a turn, with ``create_response``, the default;
  its start, with ``interrupt_response``, the default, cancels a response in progress) answers: ``response.created``, the assistant item's ``response.output_item.added`` and
  ``conversation.item.added``, ``response.content_part.added``, the reply's text as
  ``response.output_audio_transcript.delta`` events as it is written, and its speech a phrase at a
  time as ``response.output_audio.delta`` while the rest is written, in deltas of at most 100 ms
  (``gateway.audio.AUDIO_DELTA_BYTES``) (``response.output_text.delta``
  with text output), the ``.done`` events in reverse order, and ``response.done`` with its usage (as
  metered: a cancelled reply's too), ``status: "incomplete"`` (reason ``max_output_tokens``) where
  that limit cut it. One response at a time;
  ``response.cancel`` stops it (``response.done`` with ``status: "cancelled"``, reason
  ``client_cancelled``; ``turn_detected`` where the user's speech did). A key with per-minute
  limits gets ``rate_limits.updated`` after each ``response.done``.
* Out-of-band responses: ``response.create`` with ``conversation: "none"`` answers beside the
  conversation (its items are not added to it, its ``conversation_id`` is null), as many at once
  as the client asks, each cancelled by its ``response_id``; ``input`` (item references and text
  messages) gives any response a context of its own instead of the conversation; ``metadata``
  comes back in its ``response`` so that the client can tell the responses apart.

The three models are the session's: the chat model the URL names, its tiers.yaml
``engine.audio_input`` (else the first speech-to-text model) and ``engine.audio_output`` (else the
first text-to-speech model), each only one the key may use (``may_use``: one it may not is, to the
session, a model the server does not have: never named, and without a speech model its output is
text). Each transcription, reply and speech is a request of the caller's tier:
gated, metered and limited as its endpoint's (a reply's speech, said while it is written, as a
step of the reply's request for the key's ``concurrent`` limit: ``say``'s ``within``). The
reply is greedy (the session has no temperature); the words are heard, not the voice, as chat's
``input_audio`` hears them.

Function tools (``session.tools``, ``tool_choice``) are chat's: a reply of calls is
``function_call`` items (arguments streamed as ``response.function_call_arguments.delta``), not
said; the client's ``function_call_output`` item answers one, and the next reply reads both as chat
reads a tool call and a tool message.

With no speech-to-text model on the server (none the key may use) a session takes text turns
only (no turn detection; the audio buffer's events are refused).

A conversation holds at most ``limits.realtime_max_items`` items and ``realtime_max_chars`` of
text: ``conversation.item.create`` past either is an ``error`` (``conversation_too_large``), and
so is an item id of the client's past ``MAX_ITEM_ID_CHARS`` (``string_above_max_length``).

Not served (an ``error`` event naming it): items other than messages and function call outputs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from gateway import realtime_secrets
from gateway.adapters import may_use, resolve_as
from gateway.auth import Caller, bearer_token, subprotocol_key
from gateway.chat import plan_chat, serve_chat
from gateway.errors import APIError, bad_request
from gateway.input_audio import chat_engine
from gateway.output_audio import PCM16_RATE, Voice, phrases_of, say
from gateway.realtime import (CUT_WAIT_S, DEFAULT_VAD, FORMATS, LOGPROBS, MIN_COMMIT_S, RATE, SessionConfig,
                              TranscriptionSession, _audio_bytes, _new_id, _object, audio_format, detection_event,
                              judge_of, noise_event, shutting_down, updated)
from gateway.request_log import RequestRecord, note, tallied
from gateway.turn_end import SemanticVad
from gateway.schemas import ChatCompletionRequest, json_object, parse, read_body
from gateway.responses import fitting
from gateway.service import ClientGone, Services, own_uses
from gateway.serving import weightless
from workers.audio import G711Stream
from workers.tts import TTSWorker

log = logging.getLogger("tiergate.realtime")

SPEED = (0.25, 1.5)  # audio.output.speed's range in the Realtime API (/v1/audio/speech allows up to 4.0)
_TRANSCRIPTS = ("conversation.item.input_audio_transcription.delta",  # not sent with audio.input.transcription null
                "conversation.item.input_audio_transcription.completed")
MAX_ITEM_ID_CHARS = 64  # a client's item id (as OpenAI's item ids): ids are kept, and the bounds count text only


def _speed(value: object, param: str) -> float:
    if value is None:  # as OpenAI's: the default
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request("speed is a number", param, "invalid_type")
    if not SPEED[0] <= value <= SPEED[1]:
        raise bad_request(f"speed must be between {SPEED[0]} and {SPEED[1]}, not {value}", param, "invalid_value")
    return float(value)


def _usage(record: RequestRecord | None) -> dict:
    """A response's ``usage``: its chat's tokens as they were metered (a cancelled reply's, as far
    as its engine had counted them), from the response's own record (``tallied``)."""
    prompt = (record.prompt_tokens or 0) if record is not None else 0
    completion = (record.completion_tokens or 0) if record is not None else 0
    return {"total_tokens": prompt + completion, "input_tokens": prompt, "output_tokens": completion,
            "input_token_details": {"text_tokens": prompt, "audio_tokens": 0, "cached_tokens": 0},
            "output_token_details": {"text_tokens": completion, "audio_tokens": 0}}


def _chars(item: dict) -> int:
    """The text a conversation item holds: its parts' text or transcript, a call's arguments, its output."""
    return sum(len(p.get("text") or p.get("transcript") or "") for p in item.get("content") or ()) + \
        len(item.get("arguments") or "") + len(item.get("output") or "")


def _whole(arguments: str) -> bool:
    """A function call's arguments are whole JSON (those of a call cut short are not)."""
    try:
        json.loads(arguments)
    except (ValueError, RecursionError):  # nested past the parser's depth: not whole either
        return False
    return True


def _given(value: object) -> object:
    """An object field as sent: null (or absent) is an empty object; anything else is checked as it
    is (``_object``: a list or a string is ``invalid_type``, where ``or {}`` took it as empty)."""
    return {} if value is None else value


def _tool_choice(choice: object, param: str) -> Any:
    """A ``tool_choice`` as the Realtime API takes it (``auto``, ``none``, ``required`` or
    ``{"type": "function", "name"}``), as chat takes it (``APIError`` naming ``param``); OpenAI's
    MCP choice names a tool of a kind not served here."""
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "mcp":
        raise bad_request("MCP tools are not served here: tool_choice names a function tool", f"{param}.type",
                          "unsupported_value")
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise bad_request('tool_choice is "auto", "none", "required" or {"type": "function", "name": ...}', param,
                          "invalid_value" if isinstance(choice, (str, dict)) else "invalid_type")
    for key in sorted(set(choice) - {"type", "name"}):
        raise bad_request(f"unknown field tool_choice.{key}", f"{param}.{key}", "unknown_parameter")
    if not isinstance(choice.get("name"), str) or not choice["name"]:
        raise bad_request("tool_choice.name is the function's name", f"{param}.name", "invalid_type")
    return {"type": "function", "function": {"name": choice["name"]}}


def _choice_shown(choice: Any) -> Any:
    """A tool choice as the Realtime API shows it (a named function flat, as it takes it)."""
    if isinstance(choice, dict) and "function" in choice:
        return {"type": "function", "name": choice["function"]["name"]}
    return choice


@dataclass(frozen=True)
class Conversing:
    """What a conversation session answers with, beside its transcription (``SessionConfig``)."""

    model: str  # the chat model
    voice: Voice | None  # None: no text-to-speech model here, so text output only
    instructions: str = ""
    modalities: tuple[str, ...] = ("audio",)
    max_output_tokens: int | None = None  # None: "inf", as long as a chat completion without max_tokens
    create_response: bool = True  # server_vad's end of a turn starts a response
    interrupt_response: bool = True  # server_vad's start of a turn cancels the response in progress
    tools: tuple[dict, ...] = ()  # function tools, as chat takes them ({"type": "function", "function": {...}})
    tool_choice: Any = "auto"  # as chat takes it
    codec: str = "pcm"  # the speech's format: a key of gateway.realtime.FORMATS
    idle_timeout_ms: int | None = None  # server_vad: answer unprompted after this long a silence
    truncation: str = "auto"  # auto: the oldest turns dropped until the conversation fits the context; disabled
    # audio.input.transcription null (OpenAI's "no input transcription"): the user's speech is still transcribed,
    # as that is how the chat model hears it, but no conversation.item.input_audio_transcription delta or
    # completed event is sent
    transcripts: bool = True


@dataclass
class _Response:
    id: str
    settings: Conversing
    conversation: bool = True  # False: out of band ("conversation": "none"), its items not the conversation's
    context: list[dict[str, Any]] | None = None  # the items it answers ("input"); None: the conversation's
    metadata: dict | None = None
    task: asyncio.Task | None = None
    started: bool = False  # its task has begun (a task cancelled before it begins never runs its cleanup)
    cancelled: str | None = None  # why: "client_cancelled" (response.cancel), "turn_detected" (speech), "shutting_down"
    items: list[dict[str, Any]] = field(default_factory=list)
    record: RequestRecord | None = None  # what its steps cost, as the serving core counts them (``tallied``)

    def cancel(self, reason: str = "client_cancelled") -> None:
        """Stop it: at once when it has begun, else as it begins (it then ends cancelled)."""
        self.cancelled = self.cancelled or reason
        if self.started and self.task is not None:
            self.task.cancel()


@dataclass
class _Said:
    """An assistant message's speech as it went out: each phrase with the samples it spans, and,
    once the client truncates the message (its playback stopped there), how much it heard."""

    phrases: list[list] = field(default_factory=list)  # [first sample, end sample, phrase], in order
    samples: int = 0  # sent so far
    written: str = ""  # the message's whole text, once written
    end_ms: int | None = None

    @property
    def ms(self) -> int:
        return self.samples * 1000 // PCM16_RATE

    def heard(self, text: str) -> str:
        """``text`` as far as the client heard it: whole, or after a truncation its words up to
        the phrases said by then and, of the phrase cut, its share of words in proportion to the
        part of its sound played (an estimate: the speech model gives no word timings)."""
        if self.end_ms is None:
            return text
        at, words = self.end_ms * PCM16_RATE / 1000, 0
        for first, end, phrase in self.phrases:
            count = len(phrase.split())
            words += count if end <= at else int(count * (at - first) / (end - first)) if first < at else 0
        found = list(re.finditer(r"\S+", text))
        return text if words >= len(found) else text[:found[words - 1].end()] if words else ""


def _own(svc: Services, named: str | None, kind: str) -> str | None:
    """A session's model of ``kind`` (stt or tts): the chat model's own (``named``), else the first
    of its kind, either only if the key may use it (a hidden model is one the server does not have:
    its name is never shown, nor is it used); None: none."""
    if named and may_use(svc.model_name(named)):
        return named
    return next((s.name for s in svc.arbiter.specs.values() if s.kind == kind and may_use(s.name)), None)


async def opening(svc: Services, model: str) -> tuple[SessionConfig, Conversing]:
    """The session's models, from the chat model the URL names (``APIError`` naming ``model``)."""
    engine = chat_engine(svc, model)
    heard = _own(svc, engine and engine.audio_input, "stt")  # None: text turns only
    spoken = _own(svc, engine and engine.audio_output, "tts")
    voice = None
    if spoken is not None:
        spec = svc.spec(spoken, "tts")
        voices = await weightless(svc.voices, spec, TTSWorker.reader)
        voice = Voice(spec.name, "alloy", "pcm", PCM16_RATE, voices.sample_rate)
    modalities = ("audio",) if voice is not None else ("text",)
    return SessionConfig(heard, vad=DEFAULT_VAD if heard else None), Conversing(svc.spec(model, "chat").name, voice, modalities=modalities)


class ConversationSession(TranscriptionSession):
    """A transcription session that also answers (the module's doc)."""

    kind = "conversation"

    def __init__(self, ws, svc: Services, caller: Caller, config: SessionConfig, conversing: Conversing) -> None:
        super().__init__(ws, svc, caller, config)
        self.conversing = conversing
        self.items: list[dict[str, Any]] = []  # the conversation: messages, with their text once known
        self._heard: dict[str, asyncio.Event] = {}  # a committed utterance's item: set once transcribed
        self._response: _Response | None = None  # the conversation's, in progress
        self._side: dict[str, _Response] = {}  # out-of-band responses in progress, by id
        self._ending: dict[str, _Response] = {}  # cancelled conversation responses a newer one waits for, by id
        self._said: dict[str, _Said] = {}  # a spoken assistant message's id -> its speech
        self._typed_audio: set[str] = set()  # user items created with audio (no response of their own)
        self._idle: asyncio.Task | None = None  # idle_timeout_ms's wait, after a reply has been heard
        self._responding: set[asyncio.Task] = set()  # the responses' tasks running (the conversation's and out of band)

    def session_event(self) -> dict:
        c, detection = self.conversing, detection_event(self.config.vad)
        if detection is not None:
            detection.update(create_response=c.create_response, interrupt_response=c.interrupt_response)
            if detection["type"] == "server_vad":
                detection["idle_timeout_ms"] = c.idle_timeout_ms
        return {"type": "realtime", "object": "realtime.session", "id": self.id, "model": c.model,
                "output_modalities": list(c.modalities), "instructions": c.instructions,
                "max_output_tokens": "inf" if c.max_output_tokens is None else c.max_output_tokens,
                "tools": [{"type": "function", **t["function"]} for t in c.tools], "tool_choice": _choice_shown(c.tool_choice),
                "truncation": c.truncation, "include": [LOGPROBS] if self.config.logprobs else [],
                "audio": {"input": {"format": FORMATS[self.config.codec],
                                    "transcription": {"model": self.config.model}
                                    if self.config.model and c.transcripts else None,
                                    "turn_detection": detection,
                                    "noise_reduction": noise_event(self.config.noise_reduction)},
                          "output": {"format": FORMATS[c.codec], "voice": c.voice.voice if c.voice else None,
                                     "speed": c.voice.speed if c.voice else 1.0}}}

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            self._not_idle()
            for response in [self._response, *self._ending.values(), *self._side.values()]:
                if response is not None and response.task is not None:
                    response.task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await response.task

    async def send(self, event: dict) -> None:
        if event.get("type") == "session.created":  # the transcription session's own opening, as a conversation's
            event = {**event, "session": self.session_event()}
        elif event.get("type") in _TRANSCRIPTS and not self.conversing.transcripts:
            return
        elif event.get("type") == "input_audio_buffer.speech_started":
            self._not_idle()
            self._interrupt()
        await super().send(event)

    def judge_model(self) -> str | None:
        """semantic_vad's judge in a conversation: the speech model's ``turn_model``, else the session's own chat model."""
        return judge_of(self.svc, self.config.model, self.conversing.model)

    def _interrupt(self) -> None:
        """With ``interrupt_response``, the user's turn starting (server_vad) cancels the response in
        progress; what it wrote stays, as its transcript so far."""
        if self.conversing.interrupt_response and self._response is not None:
            self._response.cancel("turn_detected")

    def _not_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    async def _idle_wait(self, seconds: float) -> None:
        """``idle_timeout_ms``: the user said nothing for that long after the reply was heard (its
        sound's length after its ``response.done``): ``input_audio_buffer.timeout_triggered``, and
        a response that carries the conversation on, as if the user had asked for one."""
        await asyncio.sleep(seconds)
        self._idle = None
        if self._response is not None or self.config.vad is None or self._speech is not None or self.ending:
            return
        at = round((self._start + self._buffered) / RATE * 1000)
        await self.send({"type": "input_audio_buffer.timeout_triggered", "item_id": _new_id("item"),
                         "audio_start_ms": at, "audio_end_ms": at})
        await self._start_response(self.conversing)

    # -- client events ----------------------------------------------------------------------------

    async def _handle(self, event: dict) -> None:
        kind = event["type"]
        if kind == "session.update":
            await self._update(event.get("session"))
        elif kind == "conversation.item.create":
            await self._create_item(event.get("item"), event.get("previous_item_id"))
        elif kind == "conversation.item.retrieve":
            await self.send({"type": "conversation.item.retrieved", "item": self._item(event.get("item_id"))})
        elif kind == "conversation.item.delete":
            item = self._item(event.get("item_id"))
            self.items.remove(item)
            self._said.pop(item["id"], None)
            await self.send({"type": "conversation.item.deleted", "item_id": item["id"]})
        elif kind == "conversation.item.truncate":
            await self._truncate(event)
        elif kind.startswith("input_audio_buffer.") and self.config.model is None:
            raise bad_request("this server has no speech-to-text model to hear audio with: send text items",
                              "type", "audio_input_not_supported")
        elif kind == "response.create":
            await self._start_response(**await self._response_fields(_given(event.get("response"))))
        elif kind == "response.cancel":
            wanted = event.get("response_id")
            if wanted is not None and not isinstance(wanted, str):
                raise bad_request("response_id is a response's id", "response_id", "invalid_type")
            response = self._response if wanted is None or (self._response and self._response.id == wanted) else \
                self._side.get(wanted)
            if response is None:
                raise bad_request("no response is in progress to cancel" if wanted is None else
                                  f"no response {str(wanted)[:64]!r} is in progress", None if wanted is None else
                                  "response_id", "response_cancel_not_active")
            response.cancel()
        else:
            await super()._handle(event)

    async def _update(self, session: object) -> None:
        config, conversing = await self.applied(session)
        if config.vad != self.config.vad:
            self.new_detection()
        self._quiet(config.noise_reduction)
        self.config, self.conversing = config, conversing
        await self.send({"type": "session.updated", "session": self.session_event()})

    async def applied(self, session: object) -> tuple[SessionConfig, Conversing]:
        """The session's settings with a ``session.update``'s ``session`` applied (``APIError``
        naming the field); nothing is changed or sent (a client secret's session is checked so)."""
        session = dict(_object(session, "session"))
        if session.pop("type", "realtime") != "realtime":
            raise bad_request("this is a conversation session: session.type is 'realtime' (open a transcription "
                              "session with ?intent=transcription)", "session.type", "unsupported_session_type")
        conversing = self._settings(session, "session")
        audio = dict(_object(_given(session.pop("audio", None)), "session.audio"))
        output = _object(_given(audio.pop("output", None)), "session.audio.output")
        for key in set(audio) - {"input"}:
            raise bad_request(f"unknown field audio.{key}", f"session.audio.{key}", "unknown_parameter")
        conversing = await self._output(conversing, output, "session")
        given_input = dict(_object(_given(audio.get("input")), "session.audio.input"))
        if "transcription" in given_input:  # null: no transcription events (the speech is still heard: ``Conversing``)
            conversing = replace(conversing, transcripts=given_input["transcription"] is not None)
            if given_input["transcription"] is None:
                del given_input["transcription"]
        detection = given_input.get("turn_detection")
        for flag in ("create_response", "interrupt_response"):
            if isinstance(detection, dict) and flag in detection:
                if not isinstance(detection[flag], bool):
                    raise bad_request(f"{flag} is true or false", f"session.audio.input.turn_detection.{flag}",
                                      "invalid_type")
                conversing = replace(conversing, **{flag: detection[flag]})
        if isinstance(detection, dict) and "idle_timeout_ms" in detection:
            if detection.get("type") == "semantic_vad" and detection["idle_timeout_ms"] is not None:
                raise bad_request("idle_timeout_ms is server_vad's: semantic_vad has none",
                                  "session.audio.input.turn_detection.idle_timeout_ms", "unknown_parameter")
            idle = detection["idle_timeout_ms"]
            if idle is not None and (isinstance(idle, bool) or not isinstance(idle, int) or not 1_000 <= idle <= 60_000):
                raise bad_request("idle_timeout_ms is a whole number of milliseconds from 1000 to 60000, or null",
                                  "session.audio.input.turn_detection.idle_timeout_ms", "invalid_value")
            conversing = replace(conversing, idle_timeout_ms=idle)
            given_input["turn_detection"] = {k: v for k, v in detection.items() if k != "idle_timeout_ms"}
        model = session.pop("model", None)
        if model is not None and model != conversing.model and self.svc.model_name(str(model)) != conversing.model:
            raise bad_request(f"the session's model is {conversing.model!r}, the one it was opened on",
                              "session.model", "invalid_value")
        if "tools" in session or "tool_choice" in session:
            conversing = self._tools(conversing, session.pop("tools", None), session.pop("tool_choice", None), "session")
        if "truncation" in session:
            truncation = session.pop("truncation")
            if truncation not in ("auto", "disabled"):  # (OpenAI's retention_ratio object is not served)
                raise bad_request('truncation is "auto" (the oldest turns dropped until the conversation fits the '
                                  'model\'s context) or "disabled"', "session.truncation",
                                  "unsupported_value" if isinstance(truncation, dict) else "invalid_value")
            conversing = replace(conversing, truncation=truncation)
        transcription: dict[str, Any] = {"type": "transcription"}  # what the transcription session's update checks
        if "include" in session:  # the logprobs of the user's transcripts, as a transcription session includes them
            transcription["include"] = session.pop("include")
        for key in ("id", "object", "tracing"):
            session.pop(key, None)
        if session:
            key = sorted(session)[0]
            raise bad_request(f"unknown or unsupported session field {key!r} for a conversation session",
                              f"session.{key}", "unknown_parameter")
        if given_input:
            transcription["audio"] = {"input": given_input}
        config = updated(self.config, transcription, self.svc, self.limits.prompt_max_chars) if len(transcription) > 1 \
            else self.config
        if isinstance(config.vad, SemanticVad):  # idle_timeout_ms is server_vad's
            conversing = replace(conversing, idle_timeout_ms=None)
        return config, conversing

    def _settings(self, given: dict, where: str) -> Conversing:
        """``instructions``, ``output_modalities`` and ``max_output_tokens`` of a session update or
        a response's settings, taken out of ``given`` (checked, named ``where.field``)."""
        c = self.conversing
        if "instructions" in given:
            instructions = given.pop("instructions")
            if not isinstance(instructions, str):
                raise bad_request("instructions must be a string", f"{where}.instructions", "invalid_type")
            c = replace(c, instructions=instructions)
        if "output_modalities" in given:
            modalities = given.pop("output_modalities")
            if modalities not in (["audio"], ["text"]):
                raise bad_request('output_modalities is ["audio"] or ["text"]', f"{where}.output_modalities")
            if modalities == ["audio"] and c.voice is None:
                raise bad_request("this server has no text-to-speech model to speak with: ask for [\"text\"]",
                                  f"{where}.output_modalities", "audio_output_not_supported")
            c = replace(c, modalities=tuple(modalities))
        if "max_output_tokens" in given:
            limit = given.pop("max_output_tokens")
            if limit != "inf" and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                raise bad_request('max_output_tokens is a whole number from 1, or "inf"', f"{where}.max_output_tokens")
            c = replace(c, max_output_tokens=None if limit == "inf" else limit)
        given.pop("metadata", None)
        return c

    async def _output(self, conversing: Conversing, output: dict, where: str) -> Conversing:
        """``conversing`` with a session's or a response's ``audio.output`` (``format``, ``voice``,
        ``speed``), errors named ``where.audio.output...``."""
        for key in output:
            if key not in ("format", "voice", "speed"):
                raise bad_request(f"unknown field audio.output.{key}", f"{where}.audio.output.{key}", "unknown_parameter")
        if "format" in output:
            conversing = replace(conversing, codec=audio_format(output["format"], f"{where}.audio.output.format"))
        if "voice" in output:
            name = await self._voice(output["voice"], f"{where}.audio.output.voice")
            conversing = replace(conversing, voice=replace(conversing.voice, voice=name))
        if "speed" in output:
            speed = _speed(output["speed"], f"{where}.audio.output.speed")
            if conversing.voice is None and speed != 1.0:
                raise bad_request("this server has no text-to-speech model to speak with", f"{where}.audio.output.speed",
                                  "audio_output_not_supported")
            if conversing.voice is not None:
                conversing = replace(conversing, voice=replace(conversing.voice, speed=speed))
        return conversing

    def _tools(self, conversing: Conversing, tools: object, choice: object, where: str) -> Conversing:
        """``conversing`` with a session update's (or a response's) function ``tools`` (the
        Realtime API's flat shape: ``{"type": "function", "name", "description", "parameters"}``)
        and ``tool_choice`` (``auto``, ``none``, ``required`` or ``{"type": "function", "name"}``),
        checked as chat checks them (errors named ``where.tools[i]...``)."""
        given = list(conversing.tools) if tools is None else tools
        if not isinstance(given, list):
            raise bad_request("tools is a list of function tools", f"{where}.tools", "invalid_type")
        chat_tools = []
        for i, tool in enumerate(given):
            if isinstance(tool, dict) and "function" in tool:  # (kept from an earlier update: chat's shape)
                chat_tools.append(tool)
                continue
            if not isinstance(tool, dict) or tool.get("type", "function") != "function":
                raise bad_request("only function tools are served here", f"{where}.tools[{i}].type", "invalid_value")
            chat_tools.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        sent = choice is not None
        choice = _tool_choice(choice, f"{where}.tool_choice") if sent else conversing.tool_choice
        if isinstance(choice, dict) and not chat_tools:  # (chat checks a choice only beside its tools)
            raise bad_request(f"tool_choice names the function {choice['function']['name']!r}, and there are no "
                              "tools", f"{where}.tool_choice" if sent else f"{where}.tools", "invalid_value")
        try:
            plan_chat(self.svc, parse(ChatCompletionRequest, {
                "model": conversing.model, "messages": [{"role": "user", "content": "-"}],
                **({"tools": chat_tools, "tool_choice": choice} if chat_tools else {})}))
        except APIError as exc:
            param = (exc.param or "tools").replace(".function.", ".").replace(".function", "")
            if param.startswith("tool_choice") and not sent:  # the session's choice, which these tools leave out
                param = "tools"
            raise APIError(exc.status, exc.message, exc.code, f"{where}.{param}") from None
        return replace(conversing, tools=tuple(chat_tools), tool_choice=choice)

    async def _voice(self, name: object, param: str) -> str:
        """A voice the session's speech model has (``APIError`` naming ``param``)."""
        if self.conversing.voice is None:
            raise bad_request("this server has no text-to-speech model to speak with", param,
                              "audio_output_not_supported")
        if not isinstance(name, str) or not name:
            raise bad_request("voice is a voice's name", param, "invalid_type")
        spoken = self.svc.spec(self.conversing.voice.model, "tts")
        voices = await weightless(self.svc.voices, spoken, TTSWorker.reader)
        try:
            voices.resolve_voice(name)
        except ValueError as exc:
            raise bad_request(str(exc), param, "invalid_value") from None
        return name

    async def _create_item(self, item: object, previous: object = None) -> None:
        item = _object(item, "item")
        kind = item.get("type", "message")
        if isinstance(item.get("id"), str) and len(item["id"]) > MAX_ITEM_ID_CHARS:
            raise bad_request(f"item.id is {len(item['id'])} characters, more than {MAX_ITEM_ID_CHARS}", "item.id",
                              "string_above_max_length")
        if previous is not None and previous != "root":
            self._item(previous, "previous_item_id")
        if isinstance(item.get("id"), str) and any(i["id"] == item["id"] for i in self.items):
            raise bad_request(f"the conversation already has an item {item['id'][:64]!r}", "item.id", "invalid_value")
        # a deleted item's audio, still in the transcription queue, keeps its id until it is heard
        if isinstance(item.get("id"), str) and item["id"] in self._heard:
            raise bad_request(f"item {item['id'][:64]!r} was deleted while its audio is still being transcribed: "
                              "choose another id", "item.id", "invalid_value")
        # the turn detection named the user's turn in progress (speech_started): its commit adds that item
        if self._speech is not None and item.get("id") == self._speech[0]:
            raise bad_request(f"item {item['id']!r} is the user's turn in progress (input_audio_buffer."
                              "speech_started): choose another id", "item.id", "invalid_value")
        if kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
                raise bad_request("a function_call_output item has the call's call_id and its output, both strings",
                                  "item.call_id", "invalid_value")
            if not any(i["type"] == "function_call" and i["call_id"] == item["call_id"] for i in self.items):
                raise bad_request(f"no function call {item['call_id'][:64]!r} in this conversation", "item.call_id",
                                  "invalid_value")
            added = {"id": item.get("id") if isinstance(item.get("id"), str) else _new_id("item"),
                     "type": "function_call_output", "object": "realtime.item", "status": "completed",
                     "call_id": item["call_id"], "output": item["output"]}
            self._room_for_item(added)
            await self._add(added, previous)
            await self.send({"type": "conversation.item.done", "item": added})
            return
        if kind != "message":
            raise bad_request(f"items of type {str(kind)[:40]!r} are not served here: a conversation session takes "
                              "messages and function_call_output", "item.type", "unsupported_item_type")
        role = item.get("role")
        if role not in ("user", "system", "assistant"):
            raise bad_request("a message item's role is user, system or assistant", "item.role", "invalid_value")
        content = item.get("content")
        if not isinstance(content, list) or not content or not all(isinstance(p, dict) for p in content):
            raise bad_request("a message's content is a list of parts", "item.content", "invalid_value")
        item_id = item.get("id") if isinstance(item.get("id"), str) else _new_id("item")
        if any(p.get("type") == "input_audio" and p.get("audio") is not None for p in content) and role == "user":
            await self._spoken_item(item_id, content, previous)
            return
        kinds = {"user": ("input_text", "input_audio"), "system": ("input_text",),
                 "assistant": ("output_text", "output_audio", "text", "audio")}[role]
        said_as = {"input_text": "text", "output_text": "text", "text": "text"}
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part.get("type"), str) else None  # a list or object is no part type
            field = said_as.get(kind, "transcript")
            if kind not in kinds or not isinstance(part.get(field), str):
                raise bad_request(f"a {role} message's parts here are {' or '.join(kinds)}, each with its {field} "
                                  "(spoken parts: their transcript)", f"item.content[{i}]", "invalid_value")
        content = [{"type": p["type"], said_as.get(p["type"], "transcript"): p[said_as.get(p["type"], "transcript")]}
                   for p in content]  # (the words: a spoken part's sound is not kept)
        added = {"id": item_id, "type": "message", "object": "realtime.item", "status": "completed", "role": role,
                 "content": content}
        self._room_for_item(added)
        await self._add(added, previous)
        await self.send({"type": "conversation.item.done", "item": added})

    async def _spoken_item(self, item_id: str, content: list[dict], previous: str | None) -> None:
        """A user message of one ``input_audio`` part with its ``audio`` (base64, in the session's
        input format): added at once, and transcribed as a committed utterance is, in turn after
        them; it starts no response of its own."""
        if len(content) != 1:
            raise bad_request("a message with audio has that one input_audio part: send text as an item of its own",
                              "item.content", "invalid_value")
        if self.config.model is None:
            raise bad_request("this server has no speech-to-text model to hear audio with: send text items",
                              "item.content[0].audio", "audio_input_not_supported")
        samples = await self._samples(_audio_bytes(content[0]["audio"]), whole=True, param="item.content[0].audio")
        seconds = len(samples) / RATE
        if seconds < MIN_COMMIT_S:
            raise bad_request(f"the audio is {seconds * 1000:.0f} ms: at least {MIN_COMMIT_S * 1000:.0f} ms are needed",
                              "item.content[0].audio", "invalid_value")
        self._room_for(seconds)
        self._room_for_item({})  # (its transcript is bounded by the audio's limits)
        self._heard[item_id] = asyncio.Event()
        self._typed_audio.add(item_id)
        await self._add({"id": item_id, "type": "message", "object": "realtime.item", "status": "completed",
                         "role": "user", "content": [{"type": "input_audio", "transcript": None}]}, previous)
        self._transcribe_later(item_id, samples)

    def _room_for_item(self, item: dict) -> None:
        """A ``conversation.item.create``'s ``item`` fits the conversation: ``limits.realtime_max_items``
        items, and ``realtime_max_chars`` of text all together (the client's items are requests of
        no one's; the turns and replies, each a metered request of the tier, go on past them)."""
        limits = self.limits
        if len(self.items) >= limits.realtime_max_items:
            raise bad_request(f"the conversation holds {len(self.items)} items, this server's limit: delete some "
                              "(conversation.item.delete) to add more", "item", "conversation_too_large")
        chars = sum(map(_chars, self.items)) + _chars(item)
        if chars > limits.realtime_max_chars:
            raise bad_request(f"the conversation's text would be {chars} characters, above this server's limit of "
                              f"{limits.realtime_max_chars}: delete items (conversation.item.delete) to add this one",
                              "item", "conversation_too_large")

    async def _add(self, item: dict, previous: str | None = None) -> None:
        """Add ``item`` after the item ``previous`` ("root": first; None: last)."""
        at = len(self.items) if previous is None else 0 if previous == "root" else \
            next(i for i, entry in enumerate(self.items) if entry["id"] == previous) + 1
        self.items.insert(at, item)
        await self.send({"type": "conversation.item.added", "previous_item_id": self._before(item), "item": item})

    def _item(self, item_id: object, param: str = "item_id") -> dict:
        """The conversation's item ``item_id`` (an error naming ``param`` when it has none)."""
        found = next((i for i in self.items if i["id"] == item_id), None) if isinstance(item_id, str) else None
        if found is None:
            raise bad_request(f"the conversation has no item {str(item_id)[:64]!r}", param, "invalid_value")
        return found

    async def _truncate(self, event: dict) -> None:
        """``conversation.item.truncate``: the client's playback of an assistant message stopped at
        ``audio_end_ms``; the message's transcript becomes the words said by then (``_Said``), the
        text the next reply reads."""
        item = self._item(event.get("item_id"))
        said = self._said.get(item["id"])
        if said is None:
            raise bad_request("only model output audio messages can be truncated", "item_id", "invalid_value")
        if event.get("content_index", 0) != 0:
            raise bad_request("a spoken message has one content part: content_index is 0", "content_index",
                              "invalid_value")
        end_ms = event.get("audio_end_ms")
        if isinstance(end_ms, bool) or not isinstance(end_ms, int) or end_ms < 0:
            raise bad_request("audio_end_ms is a whole number of milliseconds from 0", "audio_end_ms", "invalid_value")
        if end_ms > said.ms:
            raise bad_request(f"audio content of {said.ms} ms is already shorter than {end_ms} ms", "audio_end_ms",
                              "invalid_value")
        said.end_ms = end_ms
        if item["status"] != "in_progress":  # (one in progress is cut as it ends)
            item["content"] = [{**item["content"][0], "transcript": said.heard(said.written)}]
        await self.send({"type": "conversation.item.truncated", "item_id": item["id"], "content_index": 0,
                         "audio_end_ms": end_ms})

    # -- committed utterances: user items ----------------------------------------------------------

    async def _commit(self, item: str, end: int, heard: bool = False) -> None:
        self._heard[item] = asyncio.Event()
        try:
            await super()._commit(item, end, heard)
        except APIError:
            del self._heard[item]
            raise
        entry = next((i for i in self.items if i["id"] == item), None)
        if entry is not None:  # (not deleted meanwhile)
            await self.send({"type": "conversation.item.added", "previous_item_id": self._before(entry), "item": entry})

    def _placed(self, item: str) -> str | None:
        """A committed utterance's user item goes last in the conversation as it is committed, so
        that ``input_audio_buffer.committed`` and ``conversation.item.added`` name the same item
        before it."""
        self.items.append({"id": item, "type": "message", "object": "realtime.item", "status": "completed",
                           "role": "user", "content": [{"type": "input_audio", "transcript": None}]})
        return self._before(self.items[-1])

    def _before(self, item: dict) -> str | None:
        """The id of the conversation's item before ``item`` (None: it is first)."""
        at = next(i for i, entry in enumerate(self.items) if entry is item)
        return self.items[at - 1]["id"] if at else None

    async def transcribed(self, item: str, transcript: str | None) -> None:
        """The user item of a committed utterance (or of a message created with audio) gets its
        transcript; after a committed one, with ``server_vad`` and ``create_response``, a response
        to it starts."""
        for entry in self.items:
            if entry["id"] == item:
                entry["content"] = [{"type": "input_audio", "transcript": transcript}]
                await self.send({"type": "conversation.item.done", "item": entry})
        heard = self._heard.pop(item, None)
        if heard is not None:
            heard.set()
        if item in self._typed_audio:
            self._typed_audio.discard(item)
            return
        if transcript is not None and not self.gone.is_set and self.config.vad is not None \
                and self.conversing.create_response and self._response is None and not self.ending:
            await self._start_response(self.conversing)

    # -- responses --------------------------------------------------------------------------------

    async def _response_fields(self, given: object) -> dict:
        """A ``response.create``'s ``response``: its settings (``_settings``; ``tools`` and
        ``tool_choice``; ``audio.output``), ``conversation`` ("auto", or "none": out of band),
        ``input`` (the items it answers: item references and messages; absent, the conversation's)
        and ``metadata``. What it sets is this response's only; the session's stay."""
        given = dict(_object(given, "response"))
        unknown = sorted(set(given) - {"instructions", "output_modalities", "max_output_tokens", "metadata",
                                       "conversation", "input", "tools", "tool_choice", "audio"})
        if unknown:
            raise bad_request(f"response.{unknown[0]} is not served here", f"response.{unknown[0]}",
                              "unsupported_parameter")
        conversation = given.pop("conversation", "auto")
        if conversation not in ("auto", "none"):
            raise bad_request('conversation is "auto" (the session\'s) or "none" (out of band)', "response.conversation",
                              "invalid_value")
        metadata = given.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or any(
                not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512
                for k, v in metadata.items())):
            raise bad_request("metadata is up to 16 string pairs (keys up to 64 characters, values up to 512)",
                              "response.metadata", "invalid_value")
        context = None
        if "input" in given:
            context = self._context(given.pop("input"))
        settings = self._settings(given, "response")
        if "tools" in given or "tool_choice" in given:
            settings = self._tools(settings, given.pop("tools", None), given.pop("tool_choice", None), "response")
        if "audio" in given:
            audio = _object(_given(given.pop("audio")), "response.audio")
            for key in set(audio) - {"output"}:
                raise bad_request(f"a response has no audio.{key}", f"response.audio.{key}", "unknown_parameter")
            settings = await self._output(settings, _object(_given(audio.get("output")), "response.audio.output"),
                                          "response")
        return {"settings": settings, "conversation": conversation == "auto", "context": context, "metadata": metadata}

    def _context(self, given: object) -> list[dict]:
        """A response's ``input``: item references (the conversation's items) and messages (user,
        system or assistant, their text parts)."""
        if not isinstance(given, list):
            raise bad_request("input is a list of items", "response.input", "invalid_type")
        out = []
        for i, item in enumerate(given):
            param = f"response.input[{i}]"
            item = _object(item, param)
            if item.get("type") == "item_reference":
                out.append(self._item(item.get("id"), f"{param}.id"))
                continue
            if item.get("type", "message") != "message" or item.get("role") not in ("user", "system", "assistant"):
                raise bad_request("an input item is an item_reference or a user, system or assistant message",
                                  param, "invalid_value")
            content = item.get("content")
            if not isinstance(content, list) or any(
                    not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text")
                    or not isinstance(p.get("text"), str) for p in content):
                raise bad_request("a message's content is a list of text parts here", f"{param}.content", "invalid_value")
            out.append({"type": "message", "role": item["role"], "content": content})
        return out

    async def _start_response(self, settings: Conversing, conversation: bool = True,
                              context: list[dict] | None = None, metadata: dict | None = None) -> None:
        if self.ending:
            raise shutting_down("the server is shutting down: this session starts no new response; open a new "
                                "session on another instance")
        if not await self.key_stands():  # revoked or removed: the session has ended
            return
        ending = self._response if conversation and self._response is not None and self._response.cancelled else None
        if conversation and self._response is not None and ending is None:
            raise bad_request("the conversation has a response in progress: wait for its response.done, or cancel "
                              "it (an out-of-band response, conversation: \"none\", may run beside it)", None,
                              "conversation_already_has_active_response")
        response = _Response(_new_id("resp"), settings, conversation, context, metadata)
        if conversation:
            self._not_idle()
            self._response = response
            if ending is not None:  # cancelled, its end still under way: this one begins once it is over
                self._ending[ending.id] = ending
        else:
            self._side[response.id] = response
        response.task = asyncio.create_task(self._respond(response, settings, ending))
        self._responding.add(response.task)
        response.task.add_done_callback(self._responding.discard)

    def busy(self) -> bool:
        """Whether work is under way: an utterance to transcribe, or a response running."""
        return super().busy() or bool(self._responding)

    async def cut_work(self) -> None:
        """The drain was cut short: each response running ends ``cancelled`` (reason ``shutting_down``),
        its ``response.done`` with the usage metered so far."""
        for response in [self._response, *self._ending.values(), *self._side.values()]:
            if response is not None:
                response.cancel("shutting_down")
        if self._responding:
            await asyncio.wait(list(self._responding), timeout=CUT_WAIT_S)

    def _shown(self, response: _Response, status: str, usage: dict | None = None, error: dict | None = None) -> dict:
        details = None if error is None else {"type": "failed", "error": error}
        if status == "cancelled":
            details = {"type": "cancelled", "reason": response.cancelled}
        elif status == "incomplete":  # (OpenAI's other reason, content_filter, has no filter here to give it)
            details = {"type": "incomplete", "reason": "max_output_tokens"}
        return {"object": "realtime.response", "id": response.id, "status": status, "status_details": details,
                "output": response.items, "conversation_id": self.id if response.conversation else None,
                "output_modalities": list(response.settings.modalities), "metadata": response.metadata,
                "usage": usage}

    async def _respond(self, response: _Response, settings: Conversing, after: _Response | None = None) -> None:
        """Run ``response`` to its ``response.done``; ``after``: a cancelled response of the
        conversation's still ending, waited for first (its events and items come before this one's)."""
        if after is not None and after.task is not None and not after.task.done():
            await asyncio.wait([after.task])  # (a cancel meanwhile only marks this one: it ends as it begins)
        response.started = True
        response.record = tallied()  # its chat's tokens, a cut one's too, as they are metered
        try:
            await self.send({"type": "response.created", "response": self._shown(response, "in_progress")})
            if response.cancelled:  # before it began
                raise asyncio.CancelledError()
            cut = await self._answer(response, settings)
        except ClientGone:  # the session closed: nobody to answer
            if response.cancelled:
                await self.send({"type": "response.done", "response": self._shown(response, "cancelled",
                                                                                  _usage(response.record))})
        except asyncio.CancelledError:
            if not response.cancelled:  # the session closed
                raise
            await self.send({"type": "response.done", "response": self._shown(response, "cancelled",
                                                                              _usage(response.record))})
        except APIError as exc:
            error = {"type": exc.type, "code": exc.code, "message": exc.message, "param": exc.param}
            await self.send({"type": "error", "error": {**error, "event_id": None}})
            await self.send({"type": "response.done", "response": self._shown(response, "failed", error=error)})
        except Exception:  # noqa: BLE001 - this response fails; the session goes on
            log.exception("realtime response failed")
            error = {"type": "server_error", "code": "server_error", "message": "the response failed", "param": None}
            await self.send({"type": "response.done", "response": self._shown(response, "failed", error=error)})
        else:
            status = "incomplete" if cut else "completed"
            shown = self._shown(response, status, _usage(response.record))
            await self.send({"type": "response.done", "response": shown})
        finally:
            if self._response is response:
                self._response = None
                self._idle_after(response)
            self._side.pop(response.id, None)
            self._ending.pop(response.id, None)
        await self._rate_limits()

    async def _rate_limits(self) -> None:
        """``rate_limits.updated`` after a response's ``response.done``, for a key with per-minute
        request or token limits: its buckets as the response left them, the figures its HTTP
        ``x-ratelimit-*`` headers carry (a key without any gets none)."""
        if self.gone.is_set or self.svc.accounts is None:
            return
        buckets = await self.svc.accounts.buckets(self.caller)
        if buckets:
            await self.send({"type": "rate_limits.updated", "rate_limits": [
                {"name": name, "limit": int(b.limit), "remaining": int(b.remaining),
                 "reset_seconds": round(b.reset_s, 3)} for name, b in buckets.items()]})

    def _idle_after(self, response: _Response) -> None:
        """Start ``idle_timeout_ms``'s wait once the conversation's response is over: after its
        sound has played (its length), then the timeout."""
        idle = self.conversing.idle_timeout_ms
        if idle is None or self.config.vad is None or self.gone.is_set or response.cancelled or self._speech is not None:
            return  # (a reply cut by the user speaking: their turn is under way)
        played = sum(self._said[i["id"]].ms for i in response.items if i["id"] in self._said)
        self._not_idle()
        self._idle = asyncio.create_task(self._idle_wait((played + idle) / 1000))

    def _messages(self, settings: Conversing, items: list[dict]) -> list[dict]:
        """Conversation items as chat messages: a message's text (a spoken turn's transcript), a
        function call as its assistant message's tool call, a call's output as a tool message."""
        out = [{"role": "system", "content": settings.instructions}] if settings.instructions else []
        for item in items:
            if item["type"] == "function_call":
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif item["type"] == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            else:
                text = "".join(p.get("text") or p.get("transcript") or "" for p in item["content"])
                if text:
                    out.append({"role": item["role"], "content": text})
        return out

    async def _say(self, phrases: asyncio.Queue, voice: Voice, base: dict, said: _Said, codec: str) -> None:
        """Say each phrase as it comes (None: the reply is written), in order, as
        ``response.output_audio.delta`` events in ``codec``; each is a speech request of the
        caller's tier."""
        telephone = G711Stream(codec, PCM16_RATE, encode=True) if codec != "pcm" else None

        async def send(data: bytes) -> None:
            if data:
                await self.send({"type": "response.output_audio.delta", **base, "delta": base64.b64encode(data).decode()})

        while (phrase := await phrases.get()) is not None:
            said.phrases.append([said.samples, said.samples, phrase])
            async with contextlib.aclosing(say(self.svc, self.caller, voice, phrase, self.gone, within=True)) as pieces:
                async for piece in pieces:
                    said.samples += len(piece) // 2
                    said.phrases[-1][1] = said.samples
                    await send(telephone.feed(piece) if telephone is not None else piece)
        if telephone is not None:
            await send(telephone.flush())

    async def _answer(self, response: _Response, settings: Conversing) -> bool:
        """Write (and say) ``response``'s reply; True when ``max_output_tokens`` cut it (its items
        are then ``incomplete``)."""
        if response.context is None:
            for heard in list(self._heard.values()):  # the turns committed before it, transcribed
                await heard.wait()
        items = self.items if response.context is None else response.context
        asked = {"model": settings.model, "messages": self._messages(settings, items) or [{"role": "user", "content": ""}],
                 "temperature": 0, "stream": True}  # the text as it is written (an engine may hold a whole reply's)
        if settings.max_output_tokens is not None:  # "inf": as long as a chat completion's default (gateway.chat)
            asked["max_completion_tokens"] = min(settings.max_output_tokens, self.limits.max_chat_tokens)
        if settings.tools:
            asked.update(tools=list(settings.tools), tool_choice=settings.tool_choice)
        job = plan_chat(self.svc, parse(ChatCompletionRequest, asked))
        if settings.truncation == "auto":  # OpenAI's default: a long conversation drops its oldest turns
            messages = asked["messages"]
            system = messages[:1] if messages[0]["role"] == "system" else []
            kept = await fitting(self.svc, job, system, messages[len(system):])
            if len(kept) < len(messages) - len(system):
                job = plan_chat(self.svc, parse(ChatCompletionRequest, {**asked, "messages": system + kept}))
        audio = "audio" in settings.modalities
        # a content part event names its part "audio" or "text"; the item's content, "output_audio" or "output_text"
        part_type, event_part, said_as = ("output_audio", "audio", "transcript") if audio else ("output_text", "text", "text")
        text_delta = "response.output_audio_transcript.delta" if audio else "response.output_text.delta"
        message: dict | None = None  # the reply's message, made at its first words (a reply of calls has none)
        base: dict = {}
        calls: dict[int, tuple[dict, int]] = {}  # a tool call's index -> its function_call item, its output index
        written: list[str] = []
        finished = None
        # the speech follows the words a phrase at a time: a task says each phrase as soon as it is
        # written, while the reply goes on; the writing never waits for the speech
        phrases: asyncio.Queue[str | None] = asyncio.Queue()
        speaking: asyncio.Task | None = None

        def kept(text: str) -> str:
            """The message's text as the conversation keeps it: as heard, once truncated."""
            said = self._said.get(message["id"]) if message is not None else None
            if said is None:
                return text
            said.written = text
            return said.heard(text)

        async def output(item: dict) -> int:
            index = len(response.items)
            response.items.append(item)
            await self.send({"type": "response.output_item.added", "response_id": response.id, "output_index": index,
                             "item": item})
            if response.conversation:
                await self._add(item)
            return index

        async def open_message() -> None:
            nonlocal message, base, speaking
            message = {"id": _new_id("item"), "type": "message", "object": "realtime.item", "status": "in_progress",
                       "role": "assistant", "content": []}
            base = {"response_id": response.id, "item_id": message["id"], "output_index": await output(message),
                    "content_index": 0}
            await self.send({"type": "response.content_part.added", **base, "part": {"type": event_part, said_as: ""}})
            if audio:
                said = _Said()
                if response.conversation:  # (its transcript may be truncated)
                    self._said[message["id"]] = said
                speaking = asyncio.create_task(self._say(phrases, settings.voice, base, said, settings.codec))

        try:
            pending, spoken_any = "", False
            async with contextlib.aclosing(serve_chat(self.svc, self.caller, job, self.gone)) as deltas:
                async for delta in deltas:
                    if delta.content:
                        if message is None:
                            await open_message()
                        written.append(delta.content)
                        await self.send({"type": text_delta, **base, "delta": delta.content})
                        ready, pending = phrases_of(pending + delta.content, first=not spoken_any)
                        for phrase in ready:
                            phrases.put_nowait(phrase)
                        spoken_any = spoken_any or bool(ready)
                    for call in delta.calls:
                        if call.id is not None:  # its first piece
                            item = {"id": _new_id("item"), "type": "function_call", "object": "realtime.item",
                                    "status": "in_progress", "call_id": call.id, "name": call.name, "arguments": ""}
                            calls[call.index] = (item, await output(item))
                        item, index = calls[call.index]
                        if call.arguments:
                            item["arguments"] += call.arguments
                            await self.send({"type": "response.function_call_arguments.delta", "response_id": response.id,
                                             "item_id": item["id"], "output_index": index, "call_id": item["call_id"],
                                             "delta": call.arguments})
                    if delta.finished is not None:
                        finished = delta.finished
            if message is None and not calls:  # nothing written: an empty message, as a reply of no words
                await open_message()
            if message is not None:  # (what a retrieve shows while the speech goes on)
                message["content"] = [{"type": part_type, said_as: "".join(written)}]
            if speaking is not None:
                if pending.strip():
                    phrases.put_nowait(pending)
                phrases.put_nowait(None)
                await speaking
        except BaseException:  # cut: the conversation keeps what was written
            if message is not None:
                message.update(status="incomplete", content=[{"type": part_type, said_as: kept("".join(written))}])
            for item, _ in calls.values():
                item["status"] = "incomplete"
            if speaking is not None:
                speaking.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await speaking
            raise
        whole = "".join(written)
        text = kept(whole)
        cut = finished is not None and finished.finish_reason == "length"

        def ended(item: dict) -> str:
            """``incomplete``: the item the limit cut (the last written; a call only when its
            arguments are not whole JSON, as a call whose end the parser has is whole)."""
            last = item is response.items[-1] and not (item["type"] == "function_call" and _whole(item["arguments"]))
            return "incomplete" if cut and last else "completed"
        if message is not None:
            if audio:
                await self.send({"type": "response.output_audio.done", **base})
                await self.send({"type": "response.output_audio_transcript.done", **base, "transcript": text})
            else:
                await self.send({"type": "response.output_text.done", **base, "text": text})
            part = {"type": part_type, said_as: text}
            await self.send({"type": "response.content_part.done", **base, "part": {**part, "type": event_part}})
            message.update(status=ended(message), content=[{**part, said_as: kept(whole)}])  # (a truncate meanwhile)
            await self.send({"type": "response.output_item.done", "response_id": response.id,
                             "output_index": base["output_index"], "item": message})
            if response.conversation:
                await self.send({"type": "conversation.item.done", "item": message})
        for item, index in calls.values():
            item["status"] = ended(item)
            await self.send({"type": "response.function_call_arguments.done", "response_id": response.id,
                             "item_id": item["id"], "output_index": index, "call_id": item["call_id"],
                             "name": item["name"], "arguments": item["arguments"]})
            await self.send({"type": "response.output_item.done", "response_id": response.id, "output_index": index,
                             "item": item})
            if response.conversation:
                await self.send({"type": "conversation.item.done", "item": item})
        return cut


# -- the endpoint: a transcription session or a conversation ------------------------------------


async def client_secrets(request: Request) -> JSONResponse:
    """``POST /v1/realtime/client_secrets`` (``gateway.realtime_secrets``): a short-lived key for a
    browser, standing for the caller's key, that opens sessions with ``session``'s settings
    (checked now, as a ``session.update`` checks them; ``type`` "realtime", the default, with its
    chat ``model``, or "transcription") until ``expires_after.seconds`` (10 to 7200, 600 by
    default) have passed."""
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    raw = await read_body(request, svc.config.limits.max_body)
    body = json_object(raw)
    for key in sorted(set(body) - {"expires_after", "session"}):
        raise bad_request(f"unknown parameter {key!r}", key, "unknown_parameter")
    expires = _object(_given(body.get("expires_after")), "expires_after")
    if expires.get("anchor", "created_at") != "created_at":
        raise bad_request('expires_after.anchor is "created_at"', "expires_after.anchor", "invalid_value")
    seconds = expires.get("seconds", realtime_secrets.DEFAULT_S)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or \
            not realtime_secrets.MIN_S <= seconds <= realtime_secrets.MAX_S:
        raise bad_request(f"expires_after.seconds is a whole number from {realtime_secrets.MIN_S} to "
                          f"{realtime_secrets.MAX_S}", "expires_after.seconds", "invalid_value")
    session = dict(_object(body.get("session") or {"type": "realtime"}, "session"))
    if session.get("type", "realtime") == "transcription":
        first = svc.first_spec("stt", "transcription (stt) model for realtime sessions").name
        config = updated(SessionConfig(first), session, svc, svc.config.limits.prompt_max_chars)
        opened, shown = ("transcription", config, None), config.as_event(_new_id("sess"))
    else:
        if not isinstance(session.get("model"), str):
            raise bad_request("a realtime session's client secret names its chat model", "session.model", "missing_required_parameter")
        try:
            config, conversing = await opening(svc, session["model"])
        except APIError as exc:
            raise APIError(exc.status, exc.message, exc.code, "session.model") from None
        detached = ConversationSession(None, svc, caller, config, conversing)  # no socket: its checks only
        config, conversing = await detached.applied(session)
        opened = ("realtime", config, conversing)
        shown = ConversationSession(None, svc, caller, config, conversing).session_event()
    value, secret = svc.client_secrets.issue(caller, seconds, opened, len(raw))  # (its settings' size, bounded per key)
    return JSONResponse({"value": value, "expires_at": int(secret.expires_at), "session": shown})


def _redeemed(ws: WebSocket, svc: Services, value: str) -> tuple[Caller, Callable[[], TranscriptionSession]]:
    """A session opened with a client secret: its key's caller as the key stands now (a key
    revoked or taken out of its file is refused as an unknown key; a key moved to another tier
    opens the session at that tier) and the settings it was made with (a model the URL names
    must be the secret's)."""
    secret = svc.client_secrets.redeem(value)
    if secret is None:
        raise APIError(401, "the client secret is unknown or has expired", "invalid_api_key")
    caller = svc.caller_of(secret.key_id)  # the key as it stands now: its tier, or gone
    if caller is None:
        raise APIError(401, "the key that made this client secret has been revoked or removed", "invalid_api_key")
    kind, config, conversing = secret.session
    named = ws.query_params.get("model")
    model = conversing.model if conversing is not None else config.model
    if named and named != model and svc.model_name(named) != model:
        raise bad_request(f"this client secret opens sessions on {model!r}", "model", "invalid_value")
    note(key_id=caller.key_id, tier=caller.tier)
    resolve_as(svc.accounts, caller)
    if kind == "transcription":
        return caller, lambda: TranscriptionSession(ws, svc, caller, config)
    return caller, lambda: ConversationSession(ws, svc, caller, config, conversing)


async def _opening(ws: WebSocket, svc: Services) -> tuple[Caller, Callable[[], TranscriptionSession]]:
    """The handshake's checks: the key (or a client secret, ``client_secrets``), the drain, the
    model the URL names (``?model=``): a speech-to-text model (or none) opens a transcription
    session, a chat model a conversation (``gateway.realtime_conversation``) unless
    ``?intent=transcription`` asks for the other."""
    presented = bearer_token(ws.headers.get("authorization")) or subprotocol_key(ws.scope)
    secret = presented is not None and presented.startswith(realtime_secrets.PREFIX)
    caller, session = _redeemed(ws, svc, presented) if secret else (svc.authenticate(ws, subprotocol_key(ws.scope)), None)
    if ws.app.state.drain.draining:
        raise APIError(503, "the server is draining: open the session on another one", "draining")
    if session is not None:
        return caller, session
    model = ws.query_params.get("model")
    transcribing = ws.query_params.get("intent") == "transcription"
    if model:
        try:
            model = svc.spec(model, "stt").name
        except APIError as exc:
            if exc.status != 400:
                raise
            if transcribing:
                raise bad_request(f"{exc.message}; a transcription session's model is a speech-to-text model",
                                  "model", "unsupported_model") from None
            try:
                config, conversing = await opening(svc, model)
            except APIError as other:  # not a chat model either
                raise bad_request(f"{other.message}; a realtime session's model is a chat model (a conversation) or "
                                  "a speech-to-text model (a transcription)", "model", "unsupported_model") from None
            return caller, lambda: ConversationSession(ws, svc, caller, config, conversing)
    config = SessionConfig(model or svc.first_spec("stt", "transcription (stt) model for realtime sessions").name)
    return caller, lambda: TranscriptionSession(ws, svc, caller, config)


async def realtime(ws: WebSocket) -> None:
    """``/v1/realtime``: a transcription session (``gateway.realtime``) or a conversation (this
    module's doc), by the model the URL names."""
    svc: Services = ws.app.state.services
    try:
        caller, session = await _opening(ws, svc)
        own_uses()  # the session's steps (speech in, its chat, speech out) as one request's
    except APIError as exc:
        try:
            await ws.send_denial_response(exc.response())
        except RuntimeError:  # a server without the denial extension: a policy close
            await ws.close(code=1008, reason=exc.message[:120])
        return
    # a client that offers subprotocols (a browser's "realtime" and its key) fails unless one is
    # chosen; the key is never echoed
    await ws.accept(subprotocol="realtime" if "realtime" in ws.scope.get("subprotocols", ()) else None)
    sessions = svc.metrics.realtime_sessions
    sessions[caller.tier] += 1
    running, drain = session(), ws.app.state.drain
    drain.open_session(running.end_for_drain)  # a drain lets its work under way end, then ends it
    try:
        await running.run()
    finally:
        drain.close_session(running.end_for_drain)
        sessions[caller.tier] -= 1
