"""Which worker class runs a model spec, and the worker for a spec.

Each class is imported only when a spec needs it: each kind pulls its own library (diffusers,
vLLM), and a server that serves no images never imports diffusers.
"""

from __future__ import annotations

import importlib

from workers.base import ModelSpec
from workers.worker import ModelInfo, Worker

# (kind, engine) -> "module:Class"
WORKERS: dict[tuple[str, str], str] = {
    ("chat", "transformers"): "workers.chat:ChatWorker",
    ("chat", "vllm"): "workers.chat_vllm:VllmChatEngine",
    ("image", "transformers"): "workers.image:ImageWorker",
    ("tts", "transformers"): "workers.tts:TTSWorker",
    ("stt", "transformers"): "workers.stt:STTWorker",
    ("embed", "transformers"): "workers.embed:EmbedWorker",
    ("moderation", "transformers"): "workers.moderation:ModerationWorker",
    ("rerank", "transformers"): "workers.rerank:RerankWorker",
    ("train", "transformers"): "workers.trainer:LoraTrainer",  # fine-tuning jobs' copy of a chat model
}


def worker_class(spec: ModelSpec) -> type[Worker]:
    """The class that runs ``spec`` (its kind, and for chat its engine)."""
    try:
        module, name = WORKERS[(spec.kind, spec.engine)].split(":")
    except KeyError:
        raise ValueError(f"{spec.name}: no worker runs a {spec.kind} model on {spec.engine!r}") from None
    return getattr(importlib.import_module(module), name)


def make_worker(spec: ModelSpec) -> Worker:
    """A new, unloaded worker for ``spec``; its engine settings come from ``spec.options``."""
    cls = worker_class(spec)
    return cls(spec, **spec.options)


def describe(spec: ModelSpec) -> ModelInfo:
    """What the gateway may know of ``spec``'s model before loading it (read from its folder)."""
    return worker_class(spec).describe(spec)
