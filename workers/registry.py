"""Which worker class runs a model spec, and the worker for a spec.

Each class is imported only when a spec needs it: each kind pulls its own library (diffusers,
vLLM), and a server that serves no images never imports diffusers.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

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


def folder_kind_mismatch(spec: ModelSpec) -> str | None:
    """Why ``spec``'s folder holds another kind of model than its ``kind``, or None: an image
    model's folder is a diffusers pipeline (``model_index.json``), every other kind's a
    transformers model (``config.json``). An image model's ``describe`` reads no file that tells
    them apart, so a chat folder given as ``kind: image`` passed ``tiergate check`` and failed at
    its first request."""
    path = Path(spec.path)
    diffusers, transformers = (path / "model_index.json").is_file(), (path / "config.json").is_file()
    if spec.kind == "image" and transformers and not diffusers:
        return (f"{spec.name} is kind image, but its folder holds {_transformers_kind(path)} "
                "(config.json, no model_index.json of a diffusers pipeline)")
    if spec.kind != "image" and diffusers and not transformers:
        return (f"{spec.name} is kind {spec.kind}, but its folder holds an image model "
                "(a diffusers pipeline's model_index.json)")
    return None


def context_over_folder(spec: ModelSpec, environ=os.environ) -> str | None:
    """Why a vLLM chat model's ``engine.max_model_len`` cannot be served, or None: it is above the
    context its folder's ``config.json`` declares (``max_position_embeddings``), and vLLM refuses
    such a load (unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set, as vLLM allows then). A config
    that scales its positions (``rope_scaling``) is left to vLLM, which stretches the context by it."""
    declared = spec.options.get("max_model_len")
    allowed = environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")
    if spec.engine != "vllm" or not declared or allowed:
        return None
    config = json.loads((Path(spec.path) / "config.json").read_text())
    config = config.get("text_config", config)
    own = config.get("max_position_embeddings")
    if not isinstance(own, int) or config.get("rope_scaling") or declared <= own:
        return None
    return (f"engine.max_model_len {declared} is above the model's context of {own} (max_position_embeddings "
            "in its config.json): vLLM refuses to load it")


def _transformers_kind(path: Path) -> str:
    """The kind of model a transformers folder's ``config.json`` names, as well as it tells."""
    try:
        config = json.loads((path / "config.json").read_text())
        family, architectures = str(config.get("model_type", "")), " ".join(config.get("architectures") or ())
    except (OSError, ValueError, AttributeError, TypeError):
        return "a transformers model"
    if family == "whisper":
        return "a speech-to-text (stt) model"
    if family in ("vits", "speecht5"):
        return "a text-to-speech (tts) model"
    if "ForCausalLM" in architectures or "ForConditionalGeneration" in architectures:
        return f"a chat model ({family or architectures})"
    return f"a transformers model ({family or 'no model_type'})"
