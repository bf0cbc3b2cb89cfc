"""Text-to-speech: a transformers TTS model from its folder, one sentence per work step.

Two families, told apart by the folder's ``config.json``:

* VITS (``model_type: vits``): ``VitsModel`` + ``VitsTokenizer``; speakers are the model's
  ``num_speakers`` (named by an optional ``voices.json`` list), speed is VITS' own ``speaking_rate``.
* SpeechT5 (``model_type: speecht5``): ``SpeechT5ForTextToSpeech``, its tokenizer, a
  ``SpeechT5HifiGan`` in the ``vocoder/`` subfolder, and ``speakers.safetensors`` holding one
  x-vector per voice (key = voice name). Speed is a pitch-preserving time-stretch of the output.

OpenAI voice names map round-robin onto the model's own voices, in order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

from workers.audio import time_stretch
from workers.base import ModelSpec, StepContext
from workers.worker import ModelInfo, ThreadWorker

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse")
MIN_SPEED, MAX_SPEED = 0.25, 4.0
MAX_SENTENCE_CHARS = 300


@dataclass
class SpeechRequest:
    """One ``/v1/audio/speech`` call (the response format is the encoder's business, not the worker's)."""

    input: str
    voice: str = "alloy"
    speed: float = 1.0


def split_sentences(text: str, max_chars: int = MAX_SENTENCE_CHARS) -> list[str]:
    """Split at sentence ends and line breaks; pieces longer than ``max_chars`` split at spaces."""
    pieces = [p.strip() for p in re.split(r"(?<=[.!?;。！？…])\s+|\n+", text)]
    out: list[str] = []
    for piece in filter(None, pieces):
        while len(piece) > max_chars:
            cut = piece.rfind(" ", 0, max_chars)
            cut = cut if cut > 0 else max_chars
            out.append(piece[:cut].strip())
            piece = piece[cut:].strip()
        out.append(piece)
    return [p for p in out if any(c.isalnum() for c in p)]


class TTSWorker(ThreadWorker):
    """Runs one VITS or SpeechT5 text-to-speech model."""

    kind = "tts"

    def __init__(self, spec: ModelSpec) -> None:
        """Read the folder's metadata (family, voices, sample rate); weights wait for ``load``."""
        self.spec = spec
        path = Path(spec.path)
        config = AutoConfig.from_pretrained(path)
        self.family: str = config.model_type
        if self.family == "vits":
            names = path / "voices.json"
            n = config.num_speakers
            self.voices: list[str] = json.loads(names.read_text()) if names.exists() else [f"speaker_{i}" for i in range(n)]
            if len(self.voices) != n:
                raise ValueError(f"{names}: {len(self.voices)} names for {n} speakers")
            self.sample_rate: int = config.sampling_rate
        elif self.family == "speecht5":
            from safetensors import safe_open

            with safe_open(path / "speakers.safetensors", "pt") as f:
                self.voices = sorted(f.keys())
            self.sample_rate = AutoConfig.from_pretrained(path / "vocoder").sampling_rate
        else:
            raise ValueError(f"{path}: unsupported TTS model type {self.family!r} (vits or speecht5)")
        self.model: torch.nn.Module | None = None
        self.vocoder: torch.nn.Module | None = None
        self.tokenizer = None
        self.speakers: torch.Tensor | None = None  # SpeechT5 only: one x-vector per voice, in voice order

    @classmethod
    def describe(cls, spec: ModelSpec) -> ModelInfo:
        return ModelInfo(voices=tuple(cls(spec).voices))

    @classmethod
    def reader(cls, spec: ModelSpec) -> "TTSWorker":
        """A worker for ``spec`` with its voices and tokenizer read and no weights: what the gateway
        checks a request's voice and input with (``resolve_voice``, ``speakable``) before it takes a slot."""
        worker = cls(spec)
        worker.tokenizer = AutoTokenizer.from_pretrained(Path(spec.path))
        return worker

    @property
    def voice_map(self) -> dict[str, str]:
        """OpenAI voice name -> the model's own voice (round-robin, in order)."""
        return {v: self.voices[i % len(self.voices)] for i, v in enumerate(OPENAI_VOICES)}

    def load(self, device: torch.device) -> None:
        """Load the model (and vocoder and speaker table for SpeechT5) onto ``device``, in fp32."""
        path = Path(self.spec.path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.family == "vits":
            from transformers import VitsModel

            self.model = VitsModel.from_pretrained(path).to(device).eval()
        else:
            from safetensors.torch import load_file
            from transformers import SpeechT5ForTextToSpeech, SpeechT5HifiGan

            self.model = SpeechT5ForTextToSpeech.from_pretrained(path).to(device).eval()
            self.vocoder = SpeechT5HifiGan.from_pretrained(path / "vocoder").to(device).eval()
            table = load_file(path / "speakers.safetensors")
            self.speakers = torch.stack([table[v].float() for v in self.voices])

    def unload(self) -> None:
        self.model = self.vocoder = self.tokenizer = self.speakers = None

    def modules(self) -> list[torch.nn.Module]:
        return [m for m in (self.model, self.vocoder) if m is not None]

    def resolve_voice(self, name: str) -> int:
        """The model's speaker index for a model voice name or an OpenAI voice name."""
        if name in self.voices:
            return self.voices.index(name)
        mapped = self.voice_map.get(name.lower())
        if mapped is None:
            raise ValueError(
                f"unknown voice {name!r}; valid voices: {', '.join(self.voices)}"
                f" (or the OpenAI names {', '.join(OPENAI_VOICES)})"
            )
        return self.voices.index(mapped)

    def synthesize(self, req: SpeechRequest, ctx: StepContext) -> Iterator[np.ndarray]:
        """Speak ``req.input`` sentence by sentence: float32 mono chunks at ``sample_rate``.

        Voice and speed are checked before this returns (``ValueError``); ``ctx.boundary()`` runs
        before each sentence, so the caller can stream each chunk while the next one is made.
        """
        if self.model is None:
            raise RuntimeError(f"model {self.spec.name!r} is not loaded")
        speaker = self.resolve_voice(req.voice)
        if not MIN_SPEED <= req.speed <= MAX_SPEED:
            raise ValueError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {req.speed}")
        return self._chunks(self.speakable(req.input), speaker, req.speed, ctx)

    def speakable(self, text: str) -> list[str]:
        """The sentences of ``text`` the model can say; ``ValueError`` when there are none. A sentence of
        characters the tokenizer does not know ("¹", emoji, for VITS' character vocabulary) is no tokens
        at all, which the model cannot run on: it is left out."""
        sentences = [s for s in split_sentences(text) if self.tokenizer(s)["input_ids"]]
        if not sentences:
            raise ValueError("input has no speakable text (no characters this model's tokenizer knows)")
        return sentences

    def _chunks(self, sentences: list[str], speaker: int, speed: float, ctx: StepContext) -> Iterator[np.ndarray]:
        speak = self._vits if self.family == "vits" else self._speecht5
        for sentence in sentences:
            ctx.boundary()
            yield speak(sentence, speaker, speed)

    def _vits(self, text: str, speaker: int, speed: float) -> np.ndarray:
        inputs = self.tokenizer(text, return_tensors="pt").to(self.model.device)
        multi = self.model.config.num_speakers > 1
        with torch.inference_mode():
            out = self.model(**inputs, speaker_id=speaker if multi else None, speaking_rate=speed)
        return out.waveform[0, : int(out.sequence_lengths[0])].float().cpu().numpy()

    def _speecht5(self, text: str, speaker: int, speed: float) -> np.ndarray:
        device = self.model.device
        inputs = self.tokenizer(text, return_tensors="pt").to(device)
        with torch.inference_mode():
            wave = self.model.generate_speech(
                inputs["input_ids"],
                self.speakers[speaker : speaker + 1].to(device, self.model.dtype),
                attention_mask=inputs.get("attention_mask"),
                vocoder=self.vocoder,
            )
        return time_stretch(wave.float().cpu().numpy(), speed)
