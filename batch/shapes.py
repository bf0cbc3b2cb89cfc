"""A batch line's shape: the model it runs on and the adapter stack merged for it, as one string.

Lines of one shape can share forward passes: the chat engines batch rows of one model and one
stack, and the transformers engine (and the image worker) merge a stack into the weights, so
running lines of two stacks of one model side by side makes the engine drain and re-merge
between them. The store keeps each line's shape (``Store.claim`` takes one), and the runner
(``batch.runner``) runs at most one shape per model at a time, each up to its model's engine
width (:func:`width`).

A shape is ``model`` for the base model, or ``model+adapter*weight+...`` for a stack, in the
stack's order (the order changes the merge's rounding). Model and adapter names contain no
``+`` or ``*`` (tiers.yaml's name pattern), so the string splits back unambiguously.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import APIError
from gateway.schemas import AdapterChoice
from gateway.service import Services
from workers.base import stack_key

# the kind of model each batch endpoint runs on
ENDPOINT_KINDS = {"/v1/chat/completions": "chat", "/v1/images/generations": "image", "/v1/audio/speech": "tts",
                  "/v1/embeddings": "embed", "/v1/moderations": "moderation", "/v1/rerank": "rerank",
                  "/v1/score": "rerank", "/v1/classify": "moderation", "/v1/messages": "chat"}


def shape_of(svc: Services, endpoint: str, body: dict[str, Any]) -> str:
    """The shape of a line calling ``endpoint`` with ``body``. A line whose model or adapters do
    not resolve gets the name it gave (it fails when it runs, with the endpoint's own error)."""
    model = body.get("model")
    kind = ENDPOINT_KINDS.get(endpoint)
    if model is None and kind == "moderation":  # optional: the first moderation model serves
        model = next((name for name, spec in svc.arbiter.specs.items() if spec.kind == "moderation"), None)
    if not isinstance(model, str):
        return ""
    model = svc.model_name(model)
    if kind not in ("chat", "image"):
        return model
    try:
        raw = body.get("adapters")
        choices = [AdapterChoice.model_validate(c) for c in raw] if isinstance(raw, list) else None
        stack = svc.adapters.stack(model, choices, kind)
    except (APIError, ValueError):
        return model
    base = svc.adapters.base_model(model)
    return "+".join([base, *(f"{name}*{weight:g}" for name, weight in stack_key(stack))])


def model_of(shape: str) -> str:
    return shape.split("+", 1)[0]


def width(svc: Services, model: str) -> int:
    """How many requests ``model``'s engine serves together: a chat engine's ``max_num_seqs``; an
    embedding, moderation or rerank model's ``batch_width`` (its lines share forward passes,
    ``workers.embed``); 1 for the others (an image, speech or transcription worker runs one
    request at a time, batching only inside it), and for a model this server does not have."""
    spec = svc.arbiter.specs.get(model)
    if spec is None:
        return 1
    return int(spec.options.get("max_num_seqs", spec.options.get("batch_width", 1)))
