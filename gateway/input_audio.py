"""Audio in a chat message, heard through a speech-to-text model.

Chat Completions' ``{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav" |
"mp3"}}`` part (what OpenAI's audio models take) is served for a chat model whose tiers.yaml
entry names a speech-to-text model, ``engine: {audio_input: <stt model>}``: the audio is
transcribed by that model (a request of the caller's tier, gated, metered and logged as a
transcription is) and the transcript becomes a ``text`` part where the audio was, which the chat
model reads. The chat model hears the words, not the voice: tone and other sounds are lost, as
they are in the Realtime API's turns here. For a model without ``audio_input`` the part is a 400
naming it (``audio_input_not_supported``).

:func:`chat_audio` works on the request's JSON before it is parsed (as ``gateway.input_files``
does for documents), so a stored completion keeps the transcript, not the audio. It checks and
decodes every part, an empty text part standing in for each, and :func:`hear` transcribes them
once the whole request has been checked: a request refused for any field (a later part's bad
base64 too) spends no speech-to-text work and is not metered.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.adapters import may_use, resolve_request
from gateway.audio import TranscriptionJob, decoded_audio, serve_transcription
from gateway.auth import Caller
from gateway.config import EngineConfig
from gateway.errors import bad_request
from gateway.service import Services
from workers.stt import TranscriptionRequest

FORMATS = ("wav", "mp3")  # OpenAI's input_audio formats
INLINE_DECODE = 64 * 1024  # base64 characters decoded on the event loop; longer data on a thread (a 25 MiB
# file's base64 takes 0.1-0.25 s to decode here, time every other request would wait)


def _has_audio(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_audio" for p in content)


@dataclass(frozen=True)
class Speech:
    """An ``input_audio`` part checked and decoded, still to be heard: ``messages[message].content[part]``."""

    message: int
    part: int
    samples: np.ndarray
    rate: int


@dataclass(frozen=True)
class Unheard:
    """A request's audio parts, checked, and the speech-to-text model that hears them."""

    stt: str
    speech: tuple[Speech, ...]


async def chat_audio(svc: Services, data: Any) -> tuple[Any, Unheard | None]:
    """A chat request's JSON with each ``input_audio`` part of its user messages checked, decoded
    and an empty ``text`` part for now (:func:`hear` gives it the transcript), and those parts;
    ``(data, None)`` when none has one. 400s name the part (``messages[i].content[j].input_audio...``)."""
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not any(_has_audio(m) for m in messages):
        return data, None
    stt = _hearing_model(svc, data.get("model"))
    out, speech = [], []
    for i, message in enumerate(messages):
        if not _has_audio(message):
            out.append(message)
            continue
        where = f"messages[{i}]"
        if message.get("role") != "user":
            raise bad_request(f"content parts of type 'input_audio' are only for user messages, not "
                              f"{str(message.get('role'))[:20]}", f"{where}.role")
        if stt is None:
            raise bad_request(f"the model '{data.get('model')}' takes no audio here (tiers.yaml names no "
                              "engine.audio_input for it that this key may use): send text, or transcribe with "
                              "/v1/audio/transcriptions",
                              f"{where}.content", "audio_input_not_supported")
        parts = []
        for j, part in enumerate(message["content"]):
            if isinstance(part, dict) and part.get("type") == "input_audio":
                speech.append(Speech(i, j, *await _decoded(svc, part, f"{where}.content[{j}]")))
                part = {"type": "text", "text": ""}
            parts.append(part)
        out.append({**message, "content": parts})
    return {**data, "messages": out}, Unheard(stt, tuple(speech))


async def hear(svc: Services, caller: Caller, data: dict, unheard: Unheard) -> dict:
    """``data`` (as :func:`chat_audio` gave it) with each audio part's text its transcript: a
    transcription of the caller's tier each, gated and metered as /v1/audio/transcriptions is."""
    messages = [{**m, "content": list(m["content"])} if isinstance(m, dict) and isinstance(m.get("content"), list)
                else m for m in data["messages"]]
    name = svc.spec(unheard.stt, "stt").name
    for s in unheard.speech:
        job = TranscriptionJob(name, s.samples, s.rate, TranscriptionRequest())
        text = (await serve_transcription(svc, caller, job, None)).text.strip()
        messages[s.message]["content"][s.part] = {"type": "text", "text": text}
    return {**data, "messages": messages}


def chat_engine(svc: Services, model: Any) -> EngineConfig | None:
    """The engine settings tiers.yaml gives the chat model ``model`` calls (an alias or an
    adapter's name calls its base model); None where ``model`` is not a string. The usual 404 for
    a model that is not served (named ``model``, as chat's own check names it)."""
    if not isinstance(model, str):
        return None  # (chat's own check refuses it)
    name = resolve_request(svc, model, None, "chat")[0].name
    entry = next((m for m in svc.config.models if m.name == name), None)
    return getattr(entry, "engine", None)


def _hearing_model(svc: Services, model: Any) -> str | None:
    """The speech-to-text model tiers.yaml names for the chat model ``model`` (None: none, or one
    the key may not use: a model it does not have, so refused before any audio is read, unnamed)."""
    engine = chat_engine(svc, model)
    stt = engine.audio_input if engine is not None else None
    return stt if stt is not None and may_use(svc.model_name(stt)) else None


async def _decoded(svc: Services, part: dict[str, Any], where: str) -> tuple[np.ndarray, int]:
    """The samples and rate of one ``input_audio`` part, checked."""
    audio = part.get("input_audio")
    if not isinstance(audio, dict) or set(part) - {"type", "input_audio"}:
        raise bad_request('an input_audio part is {"type": "input_audio", "input_audio": {"data": <base64>, '
                          '"format": "wav" or "mp3"}}', where, "invalid_value")
    extra = sorted(set(audio) - {"data", "format"})
    if extra:
        raise bad_request(f"unrecognized field of input_audio: {extra[0]}", f"{where}.input_audio.{extra[0]}",
                          "unknown_parameter")
    if audio.get("format") not in FORMATS:
        raise bad_request(f"input_audio.format is {str(audio.get('format'))[:20]!r}; it is one of "
                          f"{', '.join(FORMATS)}", f"{where}.input_audio.format", "invalid_value")
    if not isinstance(audio.get("data"), str):
        raise bad_request("input_audio.data is the audio file as base64", f"{where}.input_audio.data",
                          "missing_required_parameter" if audio.get("data") is None else "invalid_type")
    limits = svc.config.limits
    data = audio["data"]
    try:
        raw = _base64(data) if len(data) <= INLINE_DECODE else await asyncio.to_thread(_base64, data)
    except (binascii.Error, ValueError):
        raise bad_request("input_audio.data is not valid base64", f"{where}.input_audio.data", "invalid_value") from None
    if len(raw) > limits.transcription_max_bytes:
        raise bad_request(f"the audio is larger than {limits.transcription_max_bytes} bytes",
                          f"{where}.input_audio.data", "audio_too_large")
    return await decoded_audio(raw, limits.transcription_max_seconds, f"{where}.input_audio.data",
                               "input_audio.data", "invalid_value")


def _base64(data: str) -> bytes:
    return base64.b64decode(data, validate=True)
