"""Speech and transcriptions: the serving cores ``serve_speech`` and ``serve_transcription``
(shared with batch lines) and the HTTP handlers that render them, OpenAI-shaped: POST
/v1/audio/speech (text to speech, streamed as it is made) and POST /v1/audio/transcriptions
(multipart upload, speech to text)."""

from __future__ import annotations

import base64
import itertools
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import anyio
import numpy as np
from pydantic import Field
from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from accounts.rates import Ask
from accounts.usage import Usage
from gateway.auth import Caller
from gateway.errors import APIError, bad_request
from gateway.http import Streamed, disconnect_signal
from gateway.logprobs import token_entries
from gateway.multipart import Multipart, text_fields
from gateway.schemas import _Body, _Form, loads, parse, read_json
from gateway.service import ClientGone, Services
from gateway.serving import Finished, Gone, Serving, in_thread, relayed, weightless
from workers import audio as sound
from workers.base import Cancelled, StepContext
from workers.stt import ServerVad, STTWorker, TextDelta, Transcript, TranscriptionError, TranscriptionRequest
from workers.tts import MAX_SPEED, MIN_SPEED, SpeechRequest, TTSWorker

log = logging.getLogger("tiergate")

SPOKEN_CHARS_PER_S = 15.0  # speech's length estimated from its text, for the key's audio limit
# A streamed audio event's most: 100 ms of 24 kHz PCM16 (6.4 KB as base64), the scale of the small
# deltas OpenAI's own servers send. A sentence, or a whole file, in one event runs to megabytes: past
# the 1 MiB frame the openai SDK's realtime websocket takes (close 1009), and compressed for the
# websocket (permessage-deflate) on the event loop in one go, tens of ms a sentence; a delta this
# size takes well under a millisecond.
AUDIO_DELTA_BYTES = 4800


# ---------------------------------------------------------------- speech


class SpeechBody(_Body):
    model: str = Field(min_length=1)
    input: str
    voice: str = Field(min_length=1)
    speed: float = Field(default=1.0, ge=MIN_SPEED, le=MAX_SPEED)
    response_format: str | None = None  # checked against what this installation can encode
    stream_format: Literal["audio", "sse"] | None = None  # sse: base64 pieces as speech.audio.* events
    instructions: str | None = None  # gpt-4o-mini-tts's voice directions: refused unless empty (plan_speech)


def default_speech_format() -> str:
    """mp3 like OpenAI where this libsndfile writes it, else wav."""
    return "mp3" if "mp3" in sound.supported_speech_formats() else "wav"


@dataclass(frozen=True)
class SpeechJob:
    """A checked speech request: its model, what the worker gets, and the audio's encoding.
    ``out_rate``: the rate the audio is encoded at, when not the model's own ``sample_rate``
    (chat's pcm16 is 24 kHz); ``quiet``: a text with nothing the model can say is no audio, not a
    400 (a chat reply's, which was already written)."""

    model: str
    request: SpeechRequest
    format: str
    sample_rate: int
    out_rate: int | None = None
    quiet: bool = False

    @property
    def media_type(self) -> str:
        return sound.CONTENT_TYPES[self.format]


async def plan_speech(svc: Services, body: SpeechBody) -> SpeechJob:
    """The job of ``body``; an unknown voice, or an input with nothing the model can say, is refused
    before the request takes a slot (a refused request is not usage)."""
    spec = svc.spec(body.model, "tts")
    if body.instructions and body.instructions.strip():
        raise bad_request(f"the model '{spec.name}' speaks as its voice is; it cannot follow instructions (as "
                          "OpenAI's tts-1 cannot): leave instructions out", "instructions", "unsupported_parameter")
    fmt = _speech_format(body.response_format)
    _check_input(body.input, svc.config.limits.speech_max_chars)
    voices = await weightless(svc.voices, spec, TTSWorker.reader)  # its voices, read from the folder
    try:
        voices.resolve_voice(body.voice)
    except ValueError as exc:
        raise bad_request(str(exc), "voice") from None
    try:  # (the model's tokenizer over up to speech_max_chars characters: off the event loop)
        await anyio.to_thread.run_sync(voices.speakable, body.input)
    except ValueError as exc:
        raise bad_request(str(exc), "input") from None
    return SpeechJob(spec.name, SpeechRequest(body.input, body.voice, body.speed), fmt, voices.sample_rate)


async def serve_speech(svc: Services, caller: Caller, job: SpeechJob, gone: Gone | None,
                       read: list[int] | None = None, recorded: bool = True,
                       within: bool = False) -> AsyncGenerator[bytes, None]:
    """The serving core: the encoded audio, a sentence a piece for wav and pcm, whole for the
    others. What goes wrong before the first sentence is made (429/503, out of memory after
    relief) is raised by the first ``__anext__``; closing the iterator early stops the worker at
    its next sentence. ``read``, when given, gets the number of tokens the model reads (its
    tokenizer's, for the whole input). ``recorded`` False: the HTTP request's log line is not
    this speech's (a chat reply's, said after the reply was written). ``within``: said while the
    reply is written, a step of its request (not one more of the key's ``concurrent``)."""
    last: bytes | None = None  # each piece waits for the next, so the last goes out after the usage is written
    ask = Ask(audio_seconds=len(job.request.input) / SPOKEN_CHARS_PER_S)  # corrected by what was made
    async with Serving(svc, caller, job.model, float(len(job.request.input)), "speech", gone, ask,
                       recorded=recorded, within=within) as serving:
        worker = serving.worker
        ctx, chunks, first = await serving.step(lambda ctx: _first_sentence(worker, job, ctx, serving.refused),
                                                "speaking with")
        if read is not None:
            read.append(len(worker.tokenizer(job.request.input)["input_ids"]))
        rest = itertools.chain([first], chunks) if first is not None else iter(())
        made = _timed(rest, worker.sample_rate, serving.usage)
        rate = job.out_rate or worker.sample_rate
        if rate != worker.sample_rate:
            made = (sound.resample(chunk, worker.sample_rate, rate) for chunk in made)
        encoded = sound.encode_stream(made, rate, job.format)
        try:
            while (piece := await serving.until_gone(in_thread(lambda: next(encoded, None), ctx))) is not None:
                if last is not None:
                    yield last
                last = piece
        except Cancelled:
            raise ClientGone() from None
        finally:
            ctx.cancel()
            encoded.close()
    if last is not None:
        yield last


def deltas(piece: bytes) -> Iterator[bytes]:
    """``piece`` of the encoded audio in the deltas that stream it, each at most
    ``AUDIO_DELTA_BYTES`` (an even count: PCM's samples stay whole)."""
    for start in range(0, len(piece), AUDIO_DELTA_BYTES):
        yield piece[start:start + AUDIO_DELTA_BYTES]


def _timed(chunks: Iterator[np.ndarray], rate: int, usage: Usage) -> Iterator[np.ndarray]:
    """The audio as it is made, its seconds added to the request's usage."""
    for chunk in chunks:
        usage.audio_out_seconds += len(chunk) / rate
        yield chunk


async def _first_sentence(worker: TTSWorker, job: SpeechJob, ctx: StepContext,
                          refuse: Callable[[str, str], APIError] = bad_request,
                          ) -> tuple[StepContext, Iterator[np.ndarray], np.ndarray | None]:
    """The first sentence made; ``refuse`` makes the 400 for an input with nothing speakable
    (``Serving.refused``: not metered), which plan_speech checked but a chat reply's is not."""
    try:
        chunks = worker.synthesize(job.request, ctx)
    except ValueError as exc:
        if job.quiet:
            return ctx, iter(()), None
        raise refuse(str(exc), "input") from None
    return ctx, chunks, await in_thread(lambda: next(chunks, None), ctx)


async def speech(request: Request) -> Response:
    """POST /v1/audio/speech: the audio streamed as it is made."""
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    body = parse(SpeechBody, await read_json(request, svc.config.limits.max_body))
    job = await plan_speech(svc, body)
    sse = body.stream_format == "sse"
    read: list[int] = []  # filled (for the events' usage) before the first piece
    async with disconnect_signal(request) as gone:
        pieces = serve_speech(svc, caller, job, gone, read if sse else None)
        first = await pieces.__anext__()  # errors before any byte are HTTP errors
    headers = svc.gate.rate_headers(caller.tier)
    if job.format == "pcm":
        headers["x-sample-rate"] = str(job.sample_rate)
    if sse:
        return Streamed(_events(first, pieces, read), "text/event-stream", headers)
    return Streamed(_stream(first, pieces), job.media_type, headers)


async def _events(first: bytes, pieces: AsyncGenerator[bytes, None], read: list[int]) -> AsyncIterator[bytes]:
    """``stream_format: sse``: the encoded audio as ``speech.audio.delta`` events as it is made,
    each piece in ``deltas`` (base64; decoded and joined, they are the file), then ``speech.audio.done`` with the usage:
    the tokens the model read, and no output tokens (it writes a waveform, not audio tokens; its
    seconds are metered in /v1/usage). A stream cut short by a failure has no done event."""
    finished = False
    try:
        for delta in deltas(first):
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(delta).decode("ascii")})
        async for piece in pieces:
            for delta in deltas(piece):
                yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(delta).decode("ascii")})
        finished = True
    except Exception:  # noqa: BLE001 - the response has started: it ends short, and the gateway lives on
        log.exception("speech stream failed")
    finally:
        await pieces.aclose()
    if finished:
        tokens = read[0] if read else 0
        yield _event({"type": "speech.audio.done",
                      "usage": {"input_tokens": tokens, "output_tokens": 0, "total_tokens": tokens}})


def _event(data: dict) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def _stream(first: bytes, pieces: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    """The response has started: a failure ends it short, and the gateway lives on."""
    try:
        yield first
        async for piece in pieces:
            yield piece
    except Exception:  # noqa: BLE001
        log.exception("speech stream failed")
    finally:
        await pieces.aclose()


def _speech_format(requested: str | None) -> str:
    supported = sound.supported_speech_formats()
    fmt = requested or default_speech_format()
    if fmt not in supported:
        raise bad_request(f"response_format {fmt!r} is not supported here; supported: {', '.join(supported)}",
                          "response_format")
    return fmt


def _check_input(text: str, max_chars: int) -> None:
    if not text.strip():
        raise bad_request("input must not be empty", "input")
    if len(text) > max_chars:
        raise bad_request(f"input is {len(text)} characters, above this server's limit of {max_chars}", "input")


# ---------------------------------------------------------------- transcriptions


class TranslationForm(_Form):
    """``/v1/audio/translations``: OpenAI's fields (English text out, so no ``language``)."""

    model: str = Field(min_length=1)
    prompt: str | None = None
    temperature: float = Field(default=0.0, ge=0, le=1)
    response_format: Literal["json", "text", "srt", "vtt", "verbose_json"] = "json"


class TranscriptionForm(TranslationForm):
    language: str | None = None
    timestamp_granularities: list[Literal["segment", "word"]] | None = None  # verbose_json's segments and/or words
    stream: bool = False  # the text as it is decoded: transcript.text.delta events, then transcript.text.done
    include: list[Literal["logprobs"]] | None = None  # include[]=logprobs: the text's tokens' logprobs (json only)
    chunking_strategy: Literal["auto"] | None = None  # auto: the server's own cuts (STTWorker's quiet points); server_vad: _chunking


class _ServerVadForm(_Form):
    """``chunking_strategy: {"type": "server_vad", ...}``, OpenAI's fields and defaults (ServerVad)."""

    type: Literal["server_vad"]
    threshold: float = Field(default=ServerVad.threshold, ge=0, le=1)
    prefix_padding_ms: int = Field(default=ServerVad.prefix_padding_ms, ge=0, le=10_000)
    silence_duration_ms: int = Field(default=ServerVad.silence_duration_ms, ge=0, le=10_000)


class _Chunking(_Form):
    chunking_strategy: _ServerVadForm


def _chunking(fields: dict) -> ServerVad | None:
    """The ``server_vad`` chunking strategy, taken out of ``fields``, or None (``auto`` or none
    stays in ``fields``). The SDK sends the object's fields as ``chunking_strategy[type]``,
    ``chunking_strategy[threshold]``, ...; a client may also send the object as one JSON field."""
    name = "chunking_strategy"
    vad = {key[len(name) + 1:-1]: fields.pop(key) for key in list(fields)
           if key.startswith(f"{name}[") and key.endswith("]")}
    value = fields.get(name)
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            vad = loads(value)  # strict, as a body: no depth raises RecursionError
        except ValueError:
            raise bad_request(f"invalid value for {name}: not a JSON object", name, "invalid_value") from None
        if not isinstance(vad, dict):
            raise bad_request(f"invalid value for {name}: not a JSON object", name, "invalid_value")
        del fields[name]
    if not vad:
        return None
    if name in fields:
        raise bad_request(f"{name} was given twice: as a value and as an object's fields", name)
    got = parse(_Chunking, {name: vad}).chunking_strategy
    return ServerVad(got.threshold, got.prefix_padding_ms, got.silence_duration_ms)


@dataclass(frozen=True)
class TranscriptionJob:
    """A checked transcription request: its model, the decoded audio and the worker's request."""

    model: str
    audio: np.ndarray
    rate: int
    request: TranscriptionRequest

    @property
    def duration(self) -> float:
        return len(self.audio) / self.rate


async def check_transcription(svc: Services, job: TranscriptionJob) -> None:
    """What ``job`` asks that its model cannot do (a language it does not know, a translation, word
    timestamps or logprobs from a model without them): a 400 naming the field, read from the
    model's folder before the request takes a slot or spends its key's limits."""
    hearer = await weightless(svc.transcribers, svc.spec(job.model, "stt"), STTWorker.reader)
    try:
        hearer.check(job.request)
    except TranscriptionError as exc:
        raise bad_request(str(exc), exc.param) from None


async def serve_transcription(svc: Services, caller: Caller, job: TranscriptionJob, gone: Gone | None) -> Transcript:
    """The serving core: the transcript (or English translation) of one upload."""
    endpoint = "translations" if job.request.task == "translate" else "transcriptions"
    await check_transcription(svc, job)
    async with Serving(svc, caller, job.model, job.duration, endpoint, gone,
                       Ask(audio_seconds=job.duration)) as serving:
        serving.usage.audio_in_seconds = job.duration
        worker = serving.worker

        def run(ctx: StepContext) -> Transcript:
            return worker.transcribe(sound.resample(job.audio, job.rate, worker.sample_rate), job.request, ctx)

        try:
            return await serving.step(lambda ctx: in_thread(lambda: run(ctx), ctx), "transcribing with")
        except ValueError as exc:  # what the worker refuses after check_transcription's: not metered
            raise serving.refused(str(exc), exc.param if isinstance(exc, TranscriptionError) else None) from None


async def stream_transcription(svc: Services, caller: Caller, job: TranscriptionJob,
                               gone: Gone | None) -> AsyncGenerator[TextDelta | Transcript, None]:
    """The serving core, streamed: each piece of the text as the model decodes it, then the
    whole ``Transcript`` (the pieces join to its text). What goes wrong before the first piece
    is raised by the first ``__anext__``; closing the iterator early stops the model at its next
    token."""
    await check_transcription(svc, job)
    async with Serving(svc, caller, job.model, job.duration, "transcriptions", gone,
                       Ask(audio_seconds=job.duration)) as serving:
        serving.usage.audio_in_seconds = job.duration
        worker = serving.worker

        def run(ctx: StepContext, send: Callable[[TextDelta], None]) -> Transcript:
            # resampled on the model's thread, as serve_transcription does: a long utterance's took the event loop
            return worker.transcribe(sound.resample(job.audio, job.rate, worker.sample_rate), job.request, ctx, send)

        pieces = relayed(serving, run, "transcribing with")
        try:
            async for piece in pieces:
                yield piece.result if isinstance(piece, Finished) else piece
        except ValueError as exc:  # what the worker refuses after check_transcription's: not metered
            raise serving.refused(str(exc), exc.param if isinstance(exc, TranscriptionError) else None) from None
        finally:
            await pieces.aclose()


async def transcriptions(request: Request) -> Response:
    """POST /v1/audio/transcriptions: a multipart upload, transcribed."""
    return await _speech_to_text(request, TranscriptionForm, "transcribe")


async def translations(request: Request) -> Response:
    """POST /v1/audio/translations: a multipart upload, as English text."""
    return await _speech_to_text(request, TranslationForm, "translate")


async def _speech_to_text(request: Request, form_type: type[TranslationForm], task: str) -> Response:
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    limits = svc.config.limits
    async with Multipart(request, limits.transcription_max_bytes, "the audio in a 'file' part", "file") as form:
        fields = text_fields(form, ("file",))
        vad = _chunking(fields) if form_type is TranscriptionForm else None
        body = parse(form_type, fields)
        spec = svc.spec(body.model, "stt")
        if body.prompt is not None and len(body.prompt) > limits.prompt_max_chars:
            raise bad_request(f"prompt is {len(body.prompt)} characters, above this server's limit of "
                              f"{limits.prompt_max_chars}", "prompt")
        audio, rate = await _decode(form, limits.transcription_max_seconds)
    language = getattr(body, "language", None) or None
    words = "word" in (getattr(body, "timestamp_granularities", None) or ())
    if words and body.response_format != "verbose_json":
        raise bad_request(f"word timestamps come in response_format verbose_json, not {body.response_format}",
                          "timestamp_granularities")
    logprobs = "logprobs" in (getattr(body, "include", None) or ())
    if logprobs and body.response_format != "json":
        raise bad_request(f"logprobs come with response_format json, not {body.response_format}", "include")
    job = TranscriptionJob(spec.name, audio, rate, TranscriptionRequest(language, body.prompt or None, body.temperature,
                                                                       task, words,
                                                                       details=body.response_format == "verbose_json",
                                                                       logprobs=logprobs, vad=vad))
    if getattr(body, "stream", False):
        if body.response_format not in ("json", "text"):
            raise bad_request(f"a streamed transcription is text events: response_format json or text, "
                              f"not {body.response_format}", "response_format")
        async with disconnect_signal(request) as gone:
            pieces = stream_transcription(svc, caller, job, gone)
            first = await pieces.__anext__()  # errors before any event are HTTP errors
        return Streamed(_transcript_events(first, pieces), "text/event-stream", svc.gate.rate_headers(caller.tier))
    async with disconnect_signal(request) as gone:
        transcript = await serve_transcription(svc, caller, job, gone)
    return _transcript_response(transcript, body, task, svc.gate.rate_headers(caller.tier))


async def _transcript_events(first: TextDelta | Transcript,
                             pieces: AsyncGenerator[TextDelta | Transcript, None]) -> AsyncIterator[bytes]:
    """``stream: true``: ``transcript.text.delta`` with each piece of the text (and, with
    ``include[]=logprobs``, its tokens'), then ``transcript.text.done`` with the whole and its
    usage (seconds of audio, as the unstreamed answer's). A stream cut short by a failure ends
    with an ``error`` event and no done event."""
    try:
        item = first
        while True:
            if isinstance(item, Transcript):
                usage = {"type": "duration", "seconds": int(np.ceil(item.duration))}
                yield _event({"type": "transcript.text.done", "text": item.text, **_logprobs(item), "usage": usage})
                return
            yield _event({"type": "transcript.text.delta", "delta": item.text, **_logprobs(item)})
            item = await pieces.__anext__()
    except APIError as exc:
        yield _event({"type": "error", "error": exc.body()["error"]})
    except Exception:  # noqa: BLE001 - the response has started: it ends short, and the gateway lives on
        log.exception("transcription stream failed")
        yield _event({"type": "error", "error": {"message": "the transcription failed", "type": "server_error",
                                                 "param": None, "code": "server_error"}})
    finally:
        await pieces.aclose()


async def _decode(form: FormData, max_seconds: float) -> tuple[np.ndarray, int]:
    """The 'file' part decoded to float32 mono; 400 (param file) when missing, not audio, or too long."""
    files = form.getlist("file")
    if not files:
        raise bad_request("missing required parameter: file", "file", "missing_required_parameter")
    upload = files[0]
    if not isinstance(upload, UploadFile):
        raise bad_request("file must be an uploaded audio file (multipart file part), not a text field", "file")
    return await decoded_audio(await upload.read(), max_seconds, "file", upload.filename or "file", "invalid_file")


async def decoded_audio(data: bytes, max_seconds: float, param: str, name: str,
                        code: str) -> tuple[np.ndarray, int]:
    """An audio file's samples (float32 mono) and rate, decoded on a thread; a 400 naming
    ``param`` (``code``, the message headed ``name``) for one that is not audio, and
    ``audio_too_long`` past ``max_seconds``."""
    try:
        audio, rate = await anyio.to_thread.run_sync(sound.decode_audio, data, max_seconds)
    except ValueError as exc:
        raise bad_request(f"{name}: {exc}", param, code) from None
    if len(audio) / rate > max_seconds:  # decoded up to a second past the limit (compressed audio)
        raise bad_request(f"the audio is longer than this server's limit of {max_seconds:g} s "
                          f"({len(audio) / rate:.1f} s or more)", param, "audio_too_long")
    return audio, rate


def _logprobs(t: Transcript | TextDelta) -> dict:
    """``logprobs`` as OpenAI's transcriptions and their deltas carry them, when asked for (else nothing)."""
    return {} if t.logprobs is None else {"logprobs": token_entries(t.logprobs)}


def _transcript_response(t: Transcript, body: TranslationForm, task: str, headers: dict[str, str]) -> Response:
    """OpenAI's shapes; text, srt and vtt are all text/plain, as OpenAI sends them. A translation's
    ``language`` is the text's, always English (OpenAI's), and its JSON has no ``usage``."""
    fmt = body.response_format
    if fmt == "text":
        return PlainTextResponse(t.text, headers=headers)
    if fmt == "srt":
        return PlainTextResponse(sound.to_srt(t.segments), headers=headers)
    if fmt == "vtt":
        return PlainTextResponse(sound.to_vtt(t.segments), headers=headers)
    usage = {"usage": {"type": "duration", "seconds": int(np.ceil(t.duration))}} if task == "transcribe" else {}
    if fmt == "json":
        return JSONResponse({"text": t.text, **_logprobs(t), **usage}, headers=headers)
    segments = [{"id": s.id, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text,
                 "temperature": body.temperature,
                 **({"tokens": s.tokens} if s.tokens is not None else {}),
                 **{k: round(v, 6) for k in ("avg_logprob", "compression_ratio", "no_speech_prob")
                    if (v := getattr(s, k)) is not None}} for s in t.segments]
    language = "english" if task == "translate" else LANGUAGES.get(t.language, t.language)
    words = {"words": [{"word": w.word, "start": w.start, "end": w.end} for w in t.words]} if t.words is not None else {}
    return JSONResponse({"task": task, "language": language, "duration": round(t.duration, 3), "text": t.text,
                         **words, "segments": segments, **usage}, headers=headers)
