"""Speech-to-text: a transformers speech seq2seq model (Whisper-style) from its folder, one
audio window per work step.

Audio longer than the model's window (``feature_extractor.chunk_length``, 30 s for Whisper) is cut
into windows, each cut placed at the quietest 20 ms inside the last 5 s of the window so words are
rarely split. Each window is transcribed separately (no conditioning on the previous window's
text); its segments are shifted to the window's start time.

With ``TranscriptionRequest.vad`` (OpenAI's ``chunking_strategy: server_vad``) the windows come
from a voice activity detector instead: Silero VAD (the ``silero-vad`` package, whose wheel carries
its model) finds the stretches of speech, each padded by ``prefix_padding_ms`` and ended by
``silence_duration_ms`` of silence; neighbouring stretches share a window while they fit in one
(as WhisperX merges them), and only those windows are decoded, so silence before, after and
between them is never transcribed (nor hallucinated over), and audio with no speech has an
empty transcript.

Word timestamps (``TranscriptionRequest.words``) are Whisper's: dynamic time warping over the
cross-attention of its alignment heads (transformers' ``return_token_timestamps``), each token's
span read as transformers' ASR pipeline reads it, and tokens grouped into words by the Whisper
tokenizer's own rules (spaces, punctuation joined to its word; per character for languages
written without spaces). A Whisper folder whose generation config names no alignment heads gets
openai-whisper's default: every head of the decoder's last half of layers.

A verbose transcript's segments (``TranscriptionRequest.details``, Whisper only) carry their
token ids (``_segment_tokens``) and openai-whisper's confidence figures, per window (a window's segments share them; openai-whisper's
share them per decoding pass, which is the window but for a window decoded in more than one pass):
``avg_logprob``, the mean log-probability of the tokens the decoder chose (end of text included),
under the scores it chose them from (after Whisper's logit rules; at a temperature above 0,
scaled by it); ``no_speech_prob``, the probability of ``<|nospeech|>`` right after
``<|startoftranscript|>`` (raw logits, as openai-whisper reads it); ``compression_ratio``, the
window's text's UTF-8 length over its zlib-compressed length.

Token log-probabilities (``TranscriptionRequest.logprobs``, Whisper only): each text token of the
transcript, in order (timestamps and special tokens left out), with its log-probability under the
same scores as ``avg_logprob``'s, read from the decoding pass each segment came from. Streamed,
each ``TextDelta`` carries the text tokens decoded since the one before, under the scores the
decoder chose them from as it chose them (the last logits processor keeps them: ``_StepScores``).
The tokens a window's streamed pieces did not carry (those a further decoding pass of the window
added, and those decoded after its last piece) go with the next piece, as the transcript has
them. So the pieces' tokens join to the transcript's, but where Whisper decoded a window again
from its last timestamp after some of the tokens it dropped went out (as with the streamed text,
what went out stands).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import queue
import threading
import time
import unicodedata
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForSpeechSeq2Seq, AutoProcessor, GenerationConfig
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE, _combine_tokens_into_words

from workers.audio import resample
from workers.base import Cancelled, ModelSpec, StepContext, TokenLogprob
from workers.grammar import Vocabulary
from workers.sharing import SharedJob, SharedRuns
from workers.worker import ModelInfo, ThreadWorker


class _BothLengths(logging.Filter):
    """Drops transformers' "Both `max_new_tokens` and `max_length` seem to have been set": Whisper's
    generate fills ``max_length`` (20) into the config of each pass it makes, so a model whose
    generation config sets ``max_new_tokens`` (the demo's) logged it twice per transcription, 93% of
    a soak's warnings (hunt 4 Z2). ``max_new_tokens`` winning is what the config asks for."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Both `max_new_tokens`")


logging.getLogger("transformers.generation.utils").addFilter(_BothLengths())

_SEARCH_S = 5.0  # how far back from a window's end to look for a quiet cut
_FRAME_S = 0.02
_VAD_RATE = 16000  # Silero VAD hears 16 kHz (or 8 kHz) audio
_VAD_FRAME = 512  # samples per speech probability at 16 kHz (32 ms)


@dataclass(frozen=True)
class ServerVad:
    """OpenAI's ``chunking_strategy: {"type": "server_vad", ...}`` and its defaults: ``threshold``,
    the speech probability above which a 32 ms frame is speech; ``prefix_padding_ms``, the audio
    kept before each stretch of speech (Silero pads after it by as much); ``silence_duration_ms``,
    the silence that ends a stretch."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 200


@dataclass
class TranscriptionRequest:
    """One ``/v1/audio/transcriptions`` or ``/v1/audio/translations`` call, besides the audio itself.

    ``language`` is an ISO-639-1 code or an English name (None = detect on the first window); ``prompt`` is passed as Whisper prompt ids
    to every window (ignored by models whose processor has no ``get_prompt_ids``);
    ``temperature`` 0 decodes greedily, above 0 samples. ``task`` "translate" asks a multilingual
    Whisper for English text whatever the language spoken (its ``<|translate|>`` token); an
    English-only Whisper hears English and transcribes it; other models cannot translate.
    """

    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    task: Literal["transcribe", "translate"] = "transcribe"
    words: bool = False  # word timestamps too (Whisper only)
    details: bool = False  # each segment's confidence figures too (Whisper only; verbose_json)
    logprobs: bool = False  # each text token's log-probability too (Whisper only; include[]=logprobs)
    vad: ServerVad | None = None  # windows at the silences a voice activity detector hears (module doc)


class TranscriptionError(ValueError):
    """A request the model cannot serve as asked; ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Segment:
    id: int
    start: float  # seconds from the start of the audio
    end: float
    text: str
    seek: int = 0  # the start of the window it was decoded in, in 10 ms feature frames (openai-whisper's unit)
    tokens: list[int] | None = None  # its token ids, timestamps included (``details``)
    avg_logprob: float | None = None  # the window's figures (``details``), as the module doc says
    compression_ratio: float | None = None
    no_speech_prob: float | None = None


@dataclass
class Word:
    word: str
    start: float  # seconds from the start of the audio
    end: float


@dataclass(frozen=True)
class TextDelta:
    """A streamed transcription's piece of text; with ``logprobs`` asked for, the text tokens
    decoded since the piece before, each with its log-probability (else None). The last piece
    may carry tokens and no text: the last window's tokens that no piece carried yet, when its
    finished text adds nothing to what went out."""

    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Transcript:
    text: str
    language: str | None  # ISO-639-1 code; None when the model does not tell
    duration: float  # seconds of audio
    segments: list[Segment] = field(default_factory=list)
    words: list[Word] | None = None  # only when the request asked for them
    logprobs: list[TokenLogprob] | None = None  # the text's tokens, in order; only when asked for


def split_windows(audio: np.ndarray, sample_rate: int, window_s: float) -> list[tuple[int, int]]:
    """(start, end) sample ranges of at most ``window_s`` each, cut at quiet points."""
    window, frame = int(window_s * sample_rate), int(_FRAME_S * sample_rate)
    search = min(int(_SEARCH_S * sample_rate), window // 2)
    bounds, start = [], 0
    while len(audio) - start > window:
        tail = audio[start + window - search : start + window]
        energy = (tail[: len(tail) // frame * frame].reshape(-1, frame) ** 2).sum(axis=1)
        quietest = len(energy) - 1 - int(np.argmin(energy[::-1]))  # the latest of equally quiet frames
        end = start + window - search + quietest * frame + frame // 2
        bounds.append((start, end))
        start = end
    bounds.append((start, len(audio)))
    return bounds


def speech_windows(spans: list[tuple[int, int]], audio: np.ndarray, sample_rate: int,
                   window_s: float) -> list[tuple[int, int]]:
    """The windows to decode for stretches of speech (sample ranges, in order): neighbours share
    a window while the window spans at most ``window_s``; a stretch longer than that alone is cut
    at its quiet points (``split_windows``)."""
    window = int(window_s * sample_rate)
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and end - merged[-1][0] <= window:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return [(start + a, start + b) for start, end in merged
            for a, b in split_windows(audio[start:end], sample_rate, window_s)]


_vad_models: queue.SimpleQueue = queue.SimpleQueue()  # idle Silero models (each keeps state while it runs)


def speech_spans(audio: np.ndarray, sample_rate: int, vad: ServerVad, max_s: float,
                 boundary: Callable[[], None] = lambda: None) -> list[tuple[int, int]]:
    """The stretches of speech Silero VAD hears in float32 mono ``audio``, as sample ranges at
    ``sample_rate``, padded as ``vad`` asks, none longer than ``max_s`` but for its padding (a
    longer one is cut at its longest silence). ``boundary`` is called once per second of audio
    heard (a work step's boundary: the detector runs ~100x real time on one CPU core)."""
    try:
        model = _vad_models.get_nowait()
    except queue.Empty:
        model = _load_vad()
    from silero_vad import get_speech_timestamps

    frames = itertools.count(1)
    per_second = _VAD_RATE // _VAD_FRAME

    def heard(_percent: float) -> None:
        if next(frames) % per_second == 0:
            boundary()

    try:
        with torch.inference_mode():
            found = get_speech_timestamps(
                torch.from_numpy(resample(audio, sample_rate, _VAD_RATE)), model, threshold=vad.threshold,
                sampling_rate=_VAD_RATE, min_silence_duration_ms=vad.silence_duration_ms,
                speech_pad_ms=vad.prefix_padding_ms, max_speech_duration_s=max_s, progress_tracking_callback=heard)
    finally:
        _vad_models.put(model)
    scale = sample_rate / _VAD_RATE
    return [(min(len(audio), round(f["start"] * scale)), min(len(audio), round(f["end"] * scale))) for f in found]


class TurnDetector:
    """Turn detection on a live stream (the Realtime API's ``server_vad``): feed it audio as it
    arrives; it says where speech started and where it stopped, as sample indices of the stream
    at its own rate. Silero VAD heard frame by frame (``silero_vad.VADIterator``), so each sample
    is heard once however long the stream: a start comes ``prefix_padding_ms`` early, a stop
    once ``silence_duration_ms`` of silence has followed the speech (padded after by as much as
    before). Holds one of the pooled VAD models until ``close``, which waits for a feed in
    progress (a session's feed runs on a worker thread, and a closing session must not hand the
    model to another while it is still in use); otherwise one stream, one caller at a time."""

    def __init__(self, vad: ServerVad, rate: int) -> None:
        from silero_vad import VADIterator

        try:
            self._model = _vad_models.get_nowait()
        except queue.Empty:
            self._model = _load_vad()
        self.rate = rate
        self._iterator = VADIterator(self._model, threshold=vad.threshold, sampling_rate=_VAD_RATE,
                                     min_silence_duration_ms=vad.silence_duration_ms, speech_pad_ms=vad.prefix_padding_ms)
        self._raw = np.zeros(0, np.float32)  # at ``rate``: not yet resampled (a whole number of resampling periods)
        self._heard = np.zeros(0, np.float32)  # at 16 kHz: less than a frame, not yet heard
        self._period = rate // math.gcd(rate, _VAD_RATE)  # input samples per whole resampling period
        self._using = threading.Lock()

    def feed(self, audio: np.ndarray) -> list[tuple[str, int]]:
        """Hear float32 mono ``audio`` (the stream's next samples): ``("start", i)`` and
        ``("end", i)`` for the turns' edges found in it, ``i`` a sample index of the stream."""
        with self._using:
            if self._model is None:
                raise RuntimeError("this turn detector is closed")
            return self._feed(audio)

    def _feed(self, audio: np.ndarray) -> list[tuple[str, int]]:
        self._raw = np.concatenate([self._raw, audio.astype(np.float32, copy=False)])
        whole = len(self._raw) - len(self._raw) % self._period
        if whole:
            self._heard = np.concatenate([self._heard, resample(self._raw[:whole], self.rate, _VAD_RATE)])
            self._raw = self._raw[whole:]
        frames = len(self._heard) // _VAD_FRAME
        edges = []
        with torch.inference_mode():
            for f in range(frames):
                found = self._iterator(torch.from_numpy(self._heard[f * _VAD_FRAME:(f + 1) * _VAD_FRAME].copy()))
                for kind, at in (found or {}).items():
                    edges.append((kind, round(max(0, at) * self.rate / _VAD_RATE)))
        self._heard = self._heard[frames * _VAD_FRAME:]
        return edges

    def reset(self) -> None:
        """Forget the stream heard so far (a commit or clear by the client): the next sample fed
        is heard as a new stream's first, whatever was speaking before."""
        self._iterator.reset_states()
        self._raw = np.zeros(0, np.float32)
        self._heard = np.zeros(0, np.float32)

    def close(self) -> None:
        """Hand the model back to the pool (once a feed in progress has ended)."""
        with self._using:
            if self._model is not None:
                self._model.reset_states()
                _vad_models.put(self._model)
                self._model = None


def _load_vad() -> torch.nn.Module:
    """A Silero VAD model from the package's own file (no hub), on the CPU. Importing the package
    sets torch's threads to 1 for the whole process; the count is put back."""
    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():  # its loader's importlib and torch.jit deprecations
            warnings.simplefilter("ignore", DeprecationWarning)
            from silero_vad import load_silero_vad

            return load_silero_vad()
    finally:
        torch.set_num_threads(threads)


class STTWorker(ThreadWorker):
    """Runs one speech seq2seq model (Whisper-style) with its processor."""

    kind = "stt"
    # a streamed transcription reads its text again at most this often (``_Tokens``); 0: at every token
    stream_every_s = 0.05

    def __init__(self, spec: ModelSpec, batch_windows: int = 8) -> None:
        self.spec = spec
        self.batch_windows = batch_windows  # windows decoded together in one ``generate`` at most
        self.model: torch.nn.Module | None = None
        self.processor = None
        self._vocab: Vocabulary | None = None  # each token's text and bytes, for logprobs (set at load)
        self.shared: SharedRuns[_Job] = SharedRuns(self._take, self._decode_taken, long_runs=True)  # requests' decodes, shared
        self.decodes = 0  # ``generate`` calls run (a shared one once)
        self.share_decodes = True  # False: each request decodes its own windows, one at a time (the baseline)
        self._folder: tuple[str, GenerationConfig] | None = None  # (model type, generation config): ``reader``'s

    @classmethod
    def describe(cls, spec: ModelSpec) -> ModelInfo:
        return ModelInfo()

    @classmethod
    def reader(cls, spec: ModelSpec) -> "STTWorker":
        """A worker for ``spec`` with its config and generation config read and no weights: what the
        gateway checks a request with (``check``) before it takes a slot."""
        worker = cls(spec, **spec.options)
        path = Path(spec.path)
        config = AutoConfig.from_pretrained(path)
        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: the model's config stands for it, as when it is loaded
            generation = GenerationConfig.from_model_config(config)
        worker._folder = (config.model_type, generation)
        return worker

    @property
    def sample_rate(self) -> int:
        return self.processor.feature_extractor.sampling_rate

    @property
    def window_s(self) -> float:
        return float(getattr(self.processor.feature_extractor, "chunk_length", 30))

    def load(self, device: torch.device) -> None:
        """Load model and processor onto ``device`` (fp16 on CUDA, fp32 elsewhere)."""
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        self.processor = AutoProcessor.from_pretrained(Path(self.spec.path))
        self._vocab = Vocabulary(self.processor.tokenizer)
        self.model = AutoModelForSpeechSeq2Seq.from_pretrained(Path(self.spec.path), dtype=dtype).to(device).eval()
        config = self.model.config
        if config.model_type == "whisper" and not getattr(self._gen, "alignment_heads", None):
            half = config.decoder_layers // 2
            self._gen.alignment_heads = [[layer, head] for layer in range(half, config.decoder_layers)
                                         for head in range(config.decoder_attention_heads)]

    def unload(self) -> None:
        self.model = self.processor = self._vocab = None

    def modules(self) -> list[torch.nn.Module]:
        return [self.model] if self.model is not None else []

    def transcribe(self, audio: np.ndarray, req: TranscriptionRequest, ctx: StepContext,
                   on_text: Callable[[TextDelta], None] | None = None) -> Transcript:
        """Transcribe float32 mono ``audio`` at ``sample_rate``; ``ctx.boundary()`` before each window.

        ``on_text`` (a streamed transcription) is called, on this thread, with each piece of the
        transcript's text as it is decoded (and ``ctx.boundary()`` is passed at every token): the
        text so far is the windows done, then the current window's tokens read as its finished
        segments will be (``_segments``), and each call adds what that text grew by. The pieces
        join to ``Transcript.text``; in the rare case the finished window reads other than its
        tokens so far did, what was already sent stands and the last piece is left out. With
        ``req.logprobs`` each piece carries the text tokens decoded since the last (module doc)."""
        if self.model is None:
            raise RuntimeError(f"model {self.spec.name!r} is not loaded")
        language = self.check(req)
        if len(audio) == 0:
            raise TranscriptionError("no audio samples to transcribe", "file")
        sr = self.sample_rate
        prompt_ids = self._prompt_ids(req.prompt)
        segments: list[Segment] = []
        words: list[Word] | None = [] if req.words else None
        logprobs: list[TokenLogprob] | None = [] if req.logprobs else None
        if req.logprobs:
            self._vocab.read()  # once per tokenizer, on this request's thread, not in a decode shared with others
        sent = ""  # what on_text was given
        owed: list[TokenLogprob] = []  # streamed tokens decoded after the last piece of a window done
        if req.vad is None:
            windows = split_windows(audio, sr, self.window_s)
        else:
            pad_s = req.vad.prefix_padding_ms / 1000
            spans = speech_spans(audio, sr, req.vad, max(1.0, self.window_s - 2 * pad_s), ctx.boundary)
            windows = speech_windows(spans, audio, sr, self.window_s)
        job = _Job(ctx, decode=_Decode(None if prompt_ids is None else tuple(prompt_ids.tolist()), req.temperature,
                                       req.task, req.words, req.details and self._whisper_timestamps(), req.logprobs),
                   language=language)
        rows: list[_Row] = []
        step = 1 if on_text is not None else self.batch_windows  # a streamed window's text goes out before the next's
        for at in range(0, len(windows), step):
            chunk = [self._row(job, audio[start:end], start / sr, end / sr) for start, end in windows[at:at + step]]
            if job.language is None:  # heard in the first window, then asked for in every window
                began = time.perf_counter()
                language = job.language = self._detect_language(chunk[0].features.to(self.model.device, self.model.dtype))
                job.gpu_s += time.perf_counter() - began
            if on_text is not None:
                row = chunk[0]
                done = _joined(text for r in rows for _, _, text in r.window.segments)

                def grown(tokens: _Tokens, done: str = done, length_s: float = row.length_s) -> None:
                    nonlocal sent, owed
                    so_far = _joined([done, _joined(t for _, _, t in self._segments(tokens.ids, length_s))])
                    if so_far.startswith(sent) and len(so_far) > len(sent):
                        on_text(TextDelta(so_far[len(sent):], owed + tokens.take_entries() if req.logprobs else None))
                        sent, owed = so_far, []

                scored = self._vocab.entry if req.logprobs else None
                row.tokens = _Tokens(ctx, grown, self.stream_every_s, self._end_ids(), scored,
                                     self.processor.tokenizer.eos_token_id)
            self._run(job, chunk)
            if on_text is not None and req.logprobs:  # the window's tokens no piece carried yet, as the transcript has them
                owed += chunk[0].window.logprobs[chunk[0].tokens.delivered:]
            rows += chunk
        ctx.gpu_s = (ctx.gpu_s or 0.0) + job.gpu_s
        for row in rows:
            window = row.window
            t0 = row.t0
            figures = {}
            if window.avg_logprob is not None:
                said = _joined(text for _, _, text in window.segments).encode()
                figures = {"avg_logprob": window.avg_logprob, "no_speech_prob": window.no_speech_prob,
                           "compression_ratio": len(said) / len(zlib.compress(said))}
            tokens = window.tokens or [None] * len(window.segments)
            for (s0, s1, text), ids in zip(window.segments, tokens):
                segments.append(Segment(len(segments), round(t0 + s0, 3), round(t0 + s1, 3), text,
                                        round(t0 * 100), ids, **figures))
            if words is not None:
                words += [Word(w, round(t0 + w0, 3), round(t0 + w1, 3)) for w0, w1, w in window.words]
            if logprobs is not None:
                logprobs += window.logprobs
        text = _joined(s.text for s in segments)
        if on_text is not None and text.startswith(sent) and len(text) > len(sent):
            on_text(TextDelta(text[len(sent):], owed if req.logprobs else None))
        elif on_text is not None and owed:
            on_text(TextDelta("", owed))
        return Transcript(text=text, language=language, duration=len(audio) / sr, segments=segments, words=words,
                          logprobs=logprobs)

    def _features(self, audio: np.ndarray, frames: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The window's input features, and with ``frames`` the mask of its (padded) feature
        frames that hold audio, for the word alignment to stop at the audio's end (on the CPU)."""
        out = self.processor.feature_extractor(audio, sampling_rate=self.sample_rate, return_tensors="pt",
                                               return_attention_mask=frames)
        return out.input_features, out.attention_mask if frames else None

    def _row(self, job: "_Job", audio: np.ndarray, t0: float, t1: float) -> "_Row":
        features, frames = self._features(audio, job.decode.words)
        return _Row(job, features, frames, t0, t1 - t0)

    # -- decodes shared among requests -------------------------------------------------------------

    def _run(self, job: "_Job", rows: list["_Row"]) -> None:
        """Decode ``rows`` (windows of ``job``'s request), each ``row.window`` set on return, in
        ``generate`` calls shared with the windows of the requests waiting then that decode as
        this one does (``_Decode``), ``batch_windows`` at most in one (``workers.sharing``: the
        caller that finds no decode running leads one, and hands on). A window is taken from
        each waiting request in turn, so a long file does not hold the next request back by more
        than one decode. Raises what ended the job (``Cancelled`` at a step boundary), never
        while a decode still holds its windows."""
        if self.model is None:
            raise RuntimeError(f"model {self.spec.name!r} is not loaded")
        if self.share_decodes:
            self.shared.join(job, rows)
            return
        for row in rows:
            self._decode_group(job.decode, [row])
        if job.error is not None:
            raise job.error

    def _take(self, jobs: list["_Job"]) -> tuple[tuple["_Decode", list["_Row"]], list["_Job"]]:
        """The next decode: the oldest waiting request's settings, and a window from each waiting
        request with those settings in turn, up to ``batch_windows``."""
        decode, taken = jobs[0].decode, []
        while len(taken) < self.batch_windows:
            before = len(taken)
            for job in jobs:
                if job.decode == decode and job.pending and len(taken) < self.batch_windows:
                    taken.append(job.pending.pop(0))
            if len(taken) == before:
                break
        return (decode, taken), [row.job for row in taken]

    def _decode_taken(self, work: tuple["_Decode", list["_Row"]]) -> None:
        self._decode_group(*work)

    def _decode_group(self, decode: "_Decode", rows: list["_Row"]) -> None:
        """One ``generate`` over ``rows`` (all decoded as ``decode`` says): each request's step
        boundary first, once per window (a request cancelled there leaves the decode, the others
        go on); the decode's time shared among its windows. Batch requests pause together: each
        asks whether it must yield before any waits at its gate, so one that waits behind
        another's pause counts that time as paused too (not service time)."""
        jobs = list(dict.fromkeys(row.job for row in rows))
        if len(jobs) > 1:
            for job in jobs:
                job.ctx.must_pause()
        live = []
        for row in rows:
            if row.job.error is None:
                try:
                    row.job.ctx.boundary()
                except Cancelled as exc:
                    row.job.error = exc
            if row.job.error is None:
                live.append(row)
        if not live:
            return
        started = time.perf_counter()
        windows = self._windows(decode, live)
        share = (time.perf_counter() - started) / len(live)
        self.decodes += 1
        for row, window in zip(live, windows):
            row.job.gpu_s += share
            if row.job.error is None and row.job.ctx.cancelled:  # cancelled during a decode others wanted
                row.job.error = Cancelled()
            row.window = window

    def check(self, req: TranscriptionRequest) -> str | None:
        """What ``req`` asks of the model that it cannot do (``TranscriptionError`` naming the field),
        checked from its weights' configs or, on a ``reader``, from its folder's; its language's code."""
        if req.temperature < 0:
            raise TranscriptionError("temperature must be >= 0", "temperature")
        if req.task == "translate" and not self._multilingual() and self._model_type != "whisper":
            raise TranscriptionError(f"the model {self.spec.name!r} transcribes only: it cannot translate", "model")
        if req.words and not self._whisper_timestamps():
            raise TranscriptionError(f"the model {self.spec.name!r} gives no word timestamps (only Whisper models do)",
                                     "timestamp_granularities")
        if req.logprobs and not self._whisper_timestamps():
            raise TranscriptionError(f"the model {self.spec.name!r} gives no token logprobs (only Whisper models do)",
                                     "include")
        return self._language(req.language)

    @property
    def _gen(self):
        return self.model.generation_config if self.model is not None else self._folder[1]

    @property
    def _model_type(self) -> str:
        return self.model.config.model_type if self.model is not None else self._folder[0]

    def _multilingual(self) -> bool:
        return bool(getattr(self._gen, "is_multilingual", False) and getattr(self._gen, "lang_to_id", None))

    def _timestamps(self) -> bool:
        return getattr(self._gen, "no_timestamps_token_id", None) is not None

    def _whisper_timestamps(self) -> bool:
        return self._model_type == "whisper" and self._timestamps()

    def _language(self, language: str | None) -> str | None:
        """The requested language as an ISO code; ``ValueError`` if the model has no such token."""
        if not language:
            return None
        code = TO_LANGUAGE_CODE.get(language.lower(), language.lower())
        if self._multilingual() and f"<|{code}|>" not in self._gen.lang_to_id:
            known = sorted(t.strip("<|>") for t in self._gen.lang_to_id)
            raise TranscriptionError(f"unsupported language {language!r}; supported: {', '.join(known)}", "language")
        return code

    def _detect_language(self, features: torch.Tensor) -> str | None:
        """The language code the model hears; English-only Whisper says "en", other models None."""
        if not self._multilingual():
            return "en" if self._model_type == "whisper" else None
        with torch.inference_mode():
            lang_id = int(self.model.detect_language(features)[0])
        token = self.processor.tokenizer.convert_ids_to_tokens(lang_id)
        return token.strip("<|>")

    def _prompt_ids(self, prompt: str | None) -> torch.Tensor | None:
        """Whisper prompt ids (``<|startofprev|>`` + text), keeping the last tokens that fit.

        Like OpenAI's Whisper, a prompt keeps at most half the decoder's context.
        """
        if not prompt or not hasattr(self.processor, "get_prompt_ids"):
            return None
        ids = self.processor.get_prompt_ids(prompt, return_tensors="pt")
        budget = self.model.config.max_target_positions // 2 - 1
        if len(ids) > budget:
            ids = torch.cat([ids[:1], ids[len(ids) - budget + 1 :]])
        return ids.to(self.model.device)

    def _windows(self, decode: "_Decode", rows: list["_Row"]) -> list["_Window"]:
        """``rows`` decoded in one ``generate``, each row's window read as ``_read`` says; the
        decode stops at its next token once every row's request is cancelled (``_Unwanted``: a
        request cancelled while others go on is told so when the decode ends), and a streamed
        row's tokens go to its ``_Tokens`` as they come (``_Streams``).

        Lengths come from the model's generation config (``max_new_tokens`` or ``max_length``).
        """
        device, dtype = self.model.device, self.model.dtype
        features = torch.cat([row.features for row in rows]).to(device, dtype)
        kwargs: dict = {"do_sample": decode.temperature > 0,
                        "stopping_criteria": StoppingCriteriaList([_Unwanted(rows)])}
        if decode.temperature > 0:
            kwargs["temperature"] = decode.temperature
        if self._multilingual():  # a language for each row (Whisper's prompt is per row), one when they agree
            languages = [row.job.language for row in rows]
            kwargs.update(language=languages[0] if len(set(languages)) == 1 else languages, task=decode.task)
        if decode.prompt is not None:
            kwargs["prompt_ids"] = torch.tensor(decode.prompt, device=device)
        if self._timestamps():
            kwargs["return_timestamps"] = True
        if any(row.tokens is not None for row in rows):
            kwargs["streamer"] = streams = _Streams(rows)
            if decode.logprobs:  # each streamed token's log-probability, from the scores it was chosen from
                kwargs["logits_processor"] = LogitsProcessorList([_StepScores(streams)])
        if decode.words:
            kwargs.update(attention_mask=torch.cat([row.frames for row in rows]).to(device),
                          return_token_timestamps=True, return_segments=True)
        if decode.details or decode.logprobs:
            kwargs.update(return_segments=True, return_dict_in_generate=True, output_scores=True)
        with torch.inference_mode(), _NoSpeech(self.model, self._gen.decoder_start_token_id, self._no_speech_id()) \
                if decode.details else contextlib.nullcontext() as no_speech:
            out = self.model.generate(features, **kwargs)
        if not (decode.words or decode.details or decode.logprobs):
            return [_Window(self._segments(ids.tolist(), row.length_s)) for ids, row in zip(out, rows)]
        return [self._read(decode, row, out["sequences"][i].tolist(), out["segments"][i],
                           no_speech.first[i] if decode.details and no_speech.first else None)
                for i, row in enumerate(rows)]

    def _read(self, decode: "_Decode", row: "_Row", ids: list[int], passes: list[dict],
              no_speech: float | None) -> "_Window":
        """One decoded window: its segments; its words when the decode asked for word timestamps;
        its confidence figures with ``details``; its text tokens' log-probabilities with
        ``logprobs``. Times relative to the window's start. ``passes`` are generate's segments for
        the row, each with the decoding pass it came from (``result``)."""
        window = _Window(self._segments(ids, row.length_s))
        if decode.details:
            window.tokens = self._segment_tokens(ids, len(window.segments))
        if decode.words:
            # Each segment has its tokens' times from the start of the window; the flat
            # ``token_timestamps`` beside ``sequences`` count each decoding pass from its own start.
            flat = [i for s in passes for i in s["tokens"].tolist()]
            times = [t for s in passes for t in s["token_timestamps"].tolist()]
            window.words = self._words(flat, times, row.job.language, row.length_s)
        if decode.details:
            window.avg_logprob = _mean_logprob(list({id(s["result"]): s["result"] for s in passes}.values()))
            window.no_speech_prob = no_speech
        if decode.logprobs:
            window.logprobs = self._token_logprobs(passes)
        return window

    def _token_logprobs(self, segments: list[dict]) -> list[TokenLogprob]:
        """The text tokens of ``generate``'s ``segments``, in the order the window's sequence joins
        them, each with its log-probability under the scores of the decoding pass it came from
        (``result``; a segment's ``idxs`` are its place in that pass's ``sequences``, whose last
        ``len(scores)`` tokens are the generated ones). Text tokens are those below end of text,
        as ``_words`` reads them; timestamps and other special tokens are left out."""
        tok = self.processor.tokenizer
        out: list[TokenLogprob] = []
        for segment in segments:
            result = segment["result"]
            sequence, scores = result["sequences"], result["scores"]
            first = len(sequence) - len(scores)
            for at in range(*segment["idxs"]):
                token = int(sequence[at])
                if token < tok.eos_token_id:
                    logprob = torch.log_softmax(scores[at - first].float().reshape(-1), -1)[token]
                    out.append(self._vocab.entry(token, float(logprob)))
        return out

    def _end_ids(self) -> frozenset[int]:
        """The generation config's end-of-text ids (one id or a list of them)."""
        eos = self._gen.eos_token_id
        return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def _no_speech_id(self) -> int | None:
        """``<|nospeech|>``'s id (``<|nocaptions|>`` in the first Whisper tokenizers); None for a
        tokenizer with neither (its segments then have no ``no_speech_prob``)."""
        tok = self.processor.tokenizer
        for name in ("<|nospeech|>", "<|nocaptions|>"):
            found = tok.convert_tokens_to_ids(name)
            if found is not None and found != tok.unk_token_id:
                return found
        return None

    def _segments(self, ids: list[int], length_s: float) -> list[tuple[float, float, str]]:
        """(start, end, text) segments of a window's generated ``ids`` (with or without the
        decoder's prompt), by their timestamps where the model writes them."""
        ids = self._text_and_timestamp_ids(ids)
        tok = self.processor.tokenizer
        text = tok.decode(ids, skip_special_tokens=True).strip()
        if not self._timestamps():
            return [(0.0, length_s, text)]
        offsets = tok.decode(ids, output_offsets=True).get("offsets", [])
        return _clean_offsets(offsets, length_s) or [(0.0, length_s, text)]

    def _segment_tokens(self, ids: list[int], count: int) -> list[list[int]] | None:
        """Each of ``_segments``'s segments' token ids (its timestamps included): the pieces the
        tokenizer's ``output_offsets`` cuts ``ids`` into (from a timestamp to the end of the next
        pair of timestamps, or to the last timestamp), less those without text, as
        ``_clean_offsets`` leaves them; all the ids for a window read as one segment. None should
        they not come out as ``count`` pieces (a tokenizer that cuts otherwise)."""
        tok = self.processor.tokenizer
        ids = self._text_and_timestamp_ids(ids)
        stamp = tok.all_special_ids[-1] + 1  # the first timestamp token, as the tokenizer finds it
        at = [n for n, i in enumerate(ids) if i >= stamp]
        ends = [n + 1 for n in at if n + 1 < len(ids) and ids[n + 1] >= stamp]  # after the first of each pair
        pieces = []
        if at and (ends or len(at) > 1):
            ends += [] if at[-1] + 1 in ends else [at[-1] + 1]
            last = at[0]
            for end in ends:
                if end - last > 1 and tok.decode(ids[last:end], skip_special_tokens=True).strip():
                    pieces.append(ids[last:end])
                last = end
        if not pieces:
            pieces = [ids]
        return pieces if len(pieces) == count else None

    def _text_and_timestamp_ids(self, ids: list[int]) -> list[int]:
        """Drop any echoed prompt (up to the last start token) and every special token but timestamps."""
        start = self._gen.decoder_start_token_id
        if start in ids:
            ids = ids[len(ids) - ids[::-1].index(start) :]
        special = set(self.processor.tokenizer.all_special_ids)
        return [i for i in ids if i not in special]


    def _words(self, ids: list[int], times: list[float], language: str | None,
               length_s: float) -> list[tuple[float, float, str]]:
        """(start, end, word) of a window's generated ``ids``, ``times`` being generate's token
        timestamps for the same positions. Token i spans ``times[i-1]`` to ``times[i]`` (from 0
        for the first), as transformers' ASR pipeline reads them; a word spans its tokens. Words
        are made of text tokens (the prompt and special tokens dropped) and never cross a
        timestamp token, as the transcript's segments do not. Times are clamped into the window
        and made non-decreasing."""
        tok = self.processor.tokenizer
        start = self._gen.decoder_start_token_id
        first = len(ids) - ids[::-1].index(start) if start in ids else 0
        special = set(tok.all_special_ids)
        runs: list[list[tuple[int, float, float]]] = [[]]  # text tokens between timestamp tokens
        for n in range(first, len(ids)):
            if ids[n] < tok.eos_token_id:
                runs[-1].append((ids[n], times[n - 1] if n > 0 else 0.0, times[n]))
            elif ids[n] not in special and runs[-1]:  # a timestamp token closes a run
                runs.append([])
        name = LANGUAGES.get(language or "", "english")
        out: list[tuple[float, float, str]] = []
        last = 0.0
        for run in runs:
            if not run:
                continue
            found, _, indices = _combine_tokens_into_words(tok, [i for i, _, _ in run], name)
            for word, at in zip(found, indices):
                if not word.strip():
                    continue
                w0 = min(max(float(run[at[0]][1]), last), length_s)
                w1 = min(max(float(run[at[-1]][2]), w0), length_s)
                out.append((w0, w1, word.strip()))
                last = w1
        return out


@dataclass
class _Window:
    """What ``STTWorker._read`` read from one window (times from its start)."""

    segments: list[tuple[float, float, str]]
    tokens: list[list[int]] | None = None  # each segment's, with ``details``
    words: list[tuple[float, float, str]] = field(default_factory=list)
    avg_logprob: float | None = None
    no_speech_prob: float | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with ``logprobs``


@dataclass(frozen=True)
class _Decode:
    """What the windows decoded in one ``generate`` share: every setting its arguments are made
    of but the language (Whisper takes one per row). Only windows of requests that agree on all
    of them are decoded together."""

    prompt: tuple[int, ...] | None  # Whisper prompt ids
    temperature: float
    task: str
    words: bool
    details: bool
    logprobs: bool


@dataclass(eq=False, kw_only=True)
class _Job(SharedJob):
    """One request's windows waiting for a decode (``pending``, ``_Row``s), how many are in one,
    and how they are decoded."""

    decode: _Decode
    language: str | None  # as asked or heard in its first window (None: a model that does not tell)


@dataclass(eq=False)
class _Row:
    """One window of a request: its features (on the CPU until its decode) and what was read."""

    job: _Job
    features: torch.Tensor  # (1, mel bins, frames)
    frames: torch.Tensor | None  # (1, frames): which frames hold audio, for word timestamps
    t0: float  # the window's start in the audio, seconds
    length_s: float
    tokens: "_Tokens | None" = None  # a streamed window's tokens as they come
    window: _Window | None = None


class _Unwanted(StoppingCriteria):
    """Ends a ``generate`` at its next token once no row's request wants it any more (each was
    cancelled or failed): ``Cancelled`` is raised out of it. A row alone cannot be ended: Whisper
    decodes a window in passes of a shrinking batch whose rows it does not name, and a row
    stopped short would be decoded again from its last timestamp in the next pass."""

    def __init__(self, rows: list[_Row]) -> None:
        self.rows = rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        if all(row.job.error is not None or row.job.ctx.cancelled for row in self.rows):
            raise Cancelled()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _Streams(BaseStreamer):
    """``generate``'s tokens, a row's at each step to that row's ``_Tokens`` (streamed rows
    only). A decoding pass begins with its rows' prompts (one ``put`` of a row each), then a
    token a row at each step. Only the first pass's tokens are read as text: Whisper runs a
    further pass for the rows whose window the last one did not cover, from its last timestamp,
    having dropped the tokens after it, which were already read (so what a further pass adds
    goes out when the window ends, as ``transcribe`` sends what a read missed). A further pass of
    every row, in the same order, still makes each token a step boundary of its row; of fewer
    rows, which ones Whisper does not say, so none is. What a row's reading raises ends that
    row's request, not the shared decode (which ends when no row's request wants it)."""

    def __init__(self, rows: list[_Row]) -> None:
        self.rows = rows
        self.passes = 0
        self.mapped = True  # this pass's rows are self.rows, in order
        self.scores: torch.Tensor | None = None  # this step's, (rows, vocabulary), with ``_StepScores``

    def put(self, value: torch.Tensor) -> None:
        if value.dim() > 1:  # a pass's prompts
            self.mapped = self.passes == 0 or value.shape[0] == len(self.rows)
            self.passes += 1
            return
        if not self.mapped:
            return
        for i, (row, token) in enumerate(zip(self.rows, value.tolist())):
            if row.tokens is not None and row.job.error is None:
                try:
                    if self.passes == 1 and not row.tokens.ended:
                        row.tokens.take(token, None if self.scores is None else self.scores[i])
                    else:
                        row.job.ctx.boundary()
                except Exception as exc:  # noqa: BLE001 - Cancelled, or the request's own callback
                    row.job.error = exc

    def end(self) -> None:
        pass


class _StepScores(LogitsProcessor):
    """The last of ``generate``'s logits processors: keeps each step's scores, as the token is
    chosen from them (and as ``output_scores`` keeps them), for ``_Streams`` to read the chosen
    token's log-probability when it is put. Changes nothing."""

    def __init__(self, streams: _Streams) -> None:
        self.streams = streams

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.streams.scores = scores
        return scores


class _NoSpeech:
    """Reads, during ``generate``, the probability of ``<|nospeech|>`` after
    ``<|startoftranscript|>`` in the first decoding pass, for each row: the decoder's first call
    (its prompt's prefill; the rows' prompts differ at most in their language token, so the start
    token is at one place in all) is seen by a pre-hook (its ids: where the start token is) and
    the LM head's output for that call by a hook. Calls from other threads (another request's
    language detection) are not this decode's and are ignored."""

    def __init__(self, model: torch.nn.Module, start: int, no_speech: int | None) -> None:
        self.model, self.start, self.no_speech = model, start, no_speech
        self.ids: list[int] | None = None
        self.first: list[float | None] | None = None
        self.thread = threading.get_ident()

    def __enter__(self) -> "_NoSpeech":
        def prompt(module, args, kwargs) -> None:
            if self.ids is None and threading.get_ident() == self.thread:
                ids = kwargs.get("input_ids")
                self.ids = (ids if ids is not None else args[0])[0].tolist()

        def logits(module, args, out: torch.Tensor) -> None:
            if threading.get_ident() != self.thread or self.first is not None or self.ids is None:
                return
            if self.no_speech is not None and self.start in self.ids:
                at = self.ids.index(self.start)
                self.first = [float(p) for p in out[:, at].float().softmax(-1)[:, self.no_speech]]
            else:
                self.first = [None] * len(out)

        self.hooks = [self.model.get_decoder().register_forward_pre_hook(prompt, with_kwargs=True),
                      self.model.get_output_embeddings().register_forward_hook(logits)]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()


def _mean_logprob(passes: list[dict]) -> float:
    """The mean log-probability of the tokens each decoding pass chose, under the scores it chose
    them from (``generate``'s ``scores``, one per step, after its logit processors)."""
    total, n = 0.0, 0
    for result in passes:
        scores = result["scores"]
        chosen = result["sequences"][-len(scores):].tolist() if scores else []
        for step, token in zip(scores, chosen):
            total += float(torch.log_softmax(step.float().reshape(-1), -1)[token])
            n += 1
    return total / n if n else 0.0


def _joined(texts) -> str:
    """Pieces of a transcript as it reads: the non-empty ones, a space between, except where either
    side is a script written without spaces (Chinese, Japanese, Thai, ...), where Whisper's own
    transcript (its segments' tokens, decoded together) has none either."""
    out = ""
    for t in texts:
        if t:
            out += t if not out or _unspaced(out[-1]) or _unspaced(t[0]) else " " + t
    return out


_UNSPACED = ("CJK", "HIRAGANA", "KATAKANA", "IDEOGRAPHIC", "FULLWIDTH", "HALFWIDTH KATAKANA", "THAI", "LAO", "KHMER",
             "MYANMAR", "TIBETAN", "BOPOMOFO", "YI ")


def _unspaced(char: str) -> bool:
    """Whether ``char`` belongs to a script (or is punctuation of one) written without spaces
    between words."""
    return unicodedata.name(char, "").startswith(_UNSPACED)


class _Tokens:
    """A streamed window's tokens as they come (``_Streams`` hands them on): each is a step
    boundary, and ``grown`` is told all tokens so far; none after the window's end of text.

    ``grown`` reads all of them again (``_segments``, offsets and all): 0.3-0.9 ms a token at
    50-440 tokens on this CPU, up to ~0.26 s over a full 30 s window. Decoding only the open
    segment was tried and dropped: Whisper's generate trims what it streamed (tokens after its
    last timestamp), so text sent from the open segment was later not in the transcript, where
    reading the finished segments as ``_segments`` does stays a prefix of it.

    So the text is read again at most every ``every_s`` (the first token's at once): a fast model
    decodes many tokens in that time, and each read costs what the tokens so far cost. Whatever
    the last read missed goes out when the window ends (``transcribe`` sends the rest). Measured
    on the demo's tiny Whisper (docs/BENCHMARKS.md, "Live transcription"): a streamed 2 s
    utterance took +11 ms over the unstreamed one when every token was read."""

    def __init__(self, ctx: StepContext, grown: Callable[["_Tokens"], None], every_s: float = 0.05,
                 end_ids: frozenset[int] = frozenset(),
                 scored: Callable[[int, float], TokenLogprob] | None = None, text_below: int = 0) -> None:
        self.ctx, self.grown, self.every_s, self.end_ids = ctx, grown, every_s, end_ids
        self.scored, self.text_below = scored, text_below  # logprobs: a text token's entry; text ids are below
        self.ids: list[int] = []
        self.entries: list[TokenLogprob] = []  # with ``scored``: the text tokens not yet taken by a piece
        self.delivered = 0  # text tokens taken by pieces
        self.ended = False
        self._read_at = -math.inf

    def take(self, token: int, scores: torch.Tensor | None = None) -> None:
        self.ids.append(token)
        self.ended = token in self.end_ids  # what comes after it in a shared decode is padding
        if self.scored is not None and scores is not None and token < self.text_below:
            self.entries.append(self.scored(token, float(torch.log_softmax(scores.float(), -1)[token])))
        self.ctx.boundary()
        now = time.monotonic()
        if now - self._read_at >= self.every_s:
            self._read_at = now
            self.grown(self)

    def take_entries(self) -> list[TokenLogprob]:
        """The text tokens' entries since the last call, for a piece."""
        taken, self.entries = self.entries, []
        self.delivered += len(taken)
        return taken


def _clean_offsets(offsets: list[dict], length_s: float) -> list[tuple[float, float, str]]:
    """Timestamped pieces clamped into the window and made non-decreasing; empty pieces dropped."""
    out: list[tuple[float, float, str]] = []
    last = 0.0
    for o in offsets:
        text = o["text"].strip()
        start, end = o["timestamp"]
        if not text:
            continue
        start = min(max(float(start if start is not None else last), last), length_s)
        end = min(max(float(end if end is not None else length_s), start), length_s)
        out.append((start, end, text))
        last = end
    return out
