"""``semantic_vad``: the Realtime API's turn detection that asks a model whether the user has
finished speaking, not only whether they are silent.

Silero VAD hears the stream as it does for ``server_vad`` (``workers.stt.TurnDetector``). At a
pause (``PAUSE_MS`` of silence after speech) the turn's audio so far is transcribed and a chat
model reads the transcript as a user's message: the probability ``p`` that the message ends
there, which is the probability of its chat template's end-of-message token next (the way
LiveKit's turn detector reads a language model). The turn ends once the silence since the speech
reaches :func:`turn_wait_ms`: ``MIN_WAIT_MS`` for a message the model is sure has ended
(``p = 1``), up to the eagerness' longest wait for one it is sure has not (``p = 0``; OpenAI's
figures: ``low`` 8 s, ``medium`` and ``auto`` 4 s, ``high`` 2 s). Speech again before then goes
on in the same turn. Silence is counted in the stream's own samples, so the same audio ends its
turns at the same places however fast it arrives.

The judge is the session's own chat model in a conversation, and the server's first chat model
(tiers.yaml's order) in a transcription session. Its transcription and its scoring are requests
of the caller's tier, gated and metered as ``/v1/audio/transcriptions`` and ``/v1/completions``
are (the scoring is a completion of ``max_tokens: 0`` that reads its prompt's last log-probability).
A judgement that cannot be had (a 429, a key that may not use the judge) waits the longest, as
``p = 0`` would. A turn that ends where it was judged keeps the judge's transcript as its own
(``gateway.realtime``): its audio is transcribed, and metered, once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gateway.audio import TranscriptionJob, stream_transcription
from gateway.auth import Caller
from gateway.completions import completion_result, tokenizer_of
from gateway.service import Services
from gateway.serving import Gone
from workers.stt import Transcript, TranscriptionRequest

EAGERNESS_MAX_MS = {"low": 8000, "medium": 4000, "auto": 4000, "high": 2000}  # OpenAI's longest waits
PAUSE_MS = 200  # the silence after speech that asks for a judgement
MIN_WAIT_MS = 500  # the shortest silence that ends a turn: server_vad's default silence_duration_ms
TRANSCRIPT_TOKENS = 128  # the judge reads at most the transcript's last this many tokens (LiveKit's detector: 128)
_MARK = "\x00tiergate-turn\x00"


@dataclass(frozen=True)
class SemanticVad:
    """``turn_detection: {"type": "semantic_vad", "eagerness": ...}``. ``threshold``,
    ``prefix_padding_ms`` and ``silence_duration_ms`` are what the voice activity detector hears
    with (OpenAI's server_vad defaults; the silence is the pause that asks for a judgement)."""

    eagerness: str = "auto"
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = PAUSE_MS


def turn_wait_ms(p: float | None, eagerness: str) -> int:
    """The silence after speech that ends the turn, for a judged probability ``p`` that the user
    has finished (None: not judged, the longest wait)."""
    longest = EAGERNESS_MAX_MS[eagerness]
    if p is None or math.isnan(p):
        return longest
    p = min(max(p, 0.0), 1.0)
    return round(MIN_WAIT_MS + (longest - MIN_WAIT_MS) * (1.0 - p))


@dataclass(frozen=True)
class EndOfMessage:
    """A chat template's user message around its content: the text before it, and the token that
    follows a finished one."""

    head: str
    end_id: int


_ends: dict[Path, EndOfMessage] = {}


async def end_of_message(path: Path) -> EndOfMessage:
    """The chat model's end-of-message token, from its own template (cached per model folder)."""
    if path not in _ends:
        tok = await tokenizer_of(path)
        rendered = tok.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
        head, _, tail = rendered.partition(_MARK)
        tail_ids = tok.encode(tail.strip(" "), add_special_tokens=False) if tail.strip() else []
        end_id = tail_ids[0] if tail_ids else tok.eos_token_id
        if end_id is None:
            raise ValueError(f"{path}: its chat template closes a user message with nothing, and it has no end token")
        _ends[path] = EndOfMessage(head, int(end_id))
    return _ends[path]


def prompt_ids(tok, end: EndOfMessage, transcript: str) -> list[int]:
    """The judge's prompt: the user message's head, ``transcript``'s last ``TRANSCRIPT_TOKENS``
    tokens, then the end-of-message token whose log-probability is read."""
    text = tok.encode(transcript[-8 * TRANSCRIPT_TOKENS:], add_special_tokens=False)[-TRANSCRIPT_TOKENS:]
    return tok.encode(end.head, add_special_tokens=False) + text + [end.end_id]


async def end_probability(svc: Services, caller: Caller, model: str, transcript: str) -> float:
    """The probability that ``transcript`` is a whole user message, by chat model ``model``."""
    path = Path(svc.spec(model, "chat").path)
    end = await end_of_message(path)
    ids = prompt_ids(await tokenizer_of(path), end, transcript)
    scored = await completion_result(svc, caller, {"model": model, "prompt": ids, "max_tokens": 0, "echo": True,
                                                   "logprobs": 0})
    return math.exp(scored["choices"][0]["logprobs"]["token_logprobs"][-1])


async def transcript_of(svc: Services, caller: Caller, model: str, audio: np.ndarray, rate: int,
                        request: TranscriptionRequest, gone: Gone) -> Transcript | None:
    """The turn so far as text (``audio``: int16 samples at ``rate``), by the session's speech model."""
    job = TranscriptionJob(model, audio.astype(np.float32) / 32768.0, rate, request)
    pieces = stream_transcription(svc, caller, job, gone)
    try:
        async for piece in pieces:
            if isinstance(piece, Transcript):
                return piece
    finally:
        await pieces.aclose()
    return None
