"""Moderation: a transformers sequence classifier (``AutoModelForSequenceClassification`` +
``AutoTokenizer``) from its folder, scoring texts against the categories its config names.

* The categories are the config's ``id2label`` values, in label order: a model trained on
  OpenAI's category names (``harassment``, ``hate/threatening``, ``self-harm/intent``, ...)
  answers in OpenAI's shape; any other model answers with its own names.
* Scores are read as transformers' text-classification pipeline reads them: a config whose
  ``problem_type`` is ``multi_label_classification``, or that has one label, scores each
  category on its own (a sigmoid), any other one softmax over the categories (a text is one of
  them at most).
* A category is flagged at a score of ``threshold`` or more (tiers.yaml, 0.5 by default).
* A text longer than the model's context is scored in full, never truncated: cut into pieces of
  the context (the tokenizer's special tokens added to each, neighbours overlapping by a quarter
  of a piece so no phrase is only ever seen cut in two), each piece scored, and each category's
  score the highest of its pieces, so what the end of a long text says is seen.

Texts arrive as strings; ``tokenize`` (no weights needed) turns each into its pieces' token ids,
and ``classify`` runs every piece of a request through the model in padded forward passes of at
most ``max_batch_tokens`` tokens (``workers.embed.batches``), a step boundary between passes.

vLLM's classification (``/v1/classify``) reads each input whole instead, as one distribution
over the labels: ``rows`` tokenizes it (a text or token ids; over the context it is refused, or
cut by ``truncate_prompt_tokens``), ``probs`` scores each row, or gives its raw logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from workers.base import ModelSpec, StepContext
from workers.embed import EncoderWorker, InputError
from workers.worker import ModelInfo

_HUGE = 1_000_000  # tokenizers without a real limit say model_max_length = 1e30


def context_length(config, tokenizer_limit: int | None) -> int:
    """Tokens per piece, special tokens included: the smaller of the tokenizer's and the
    position embeddings' limits."""
    limits = [n for n in (tokenizer_limit, getattr(config, "max_position_embeddings", None)) if n and n < _HUGE]
    if not limits:
        raise ValueError("neither the tokenizer nor the config gives a context length")
    return min(limits)


def pieces(ids: list[int], width: int) -> list[list[int]]:
    """``ids`` (without special tokens) cut into pieces of at most ``width`` tokens, each starting
    a quarter of a piece before the previous one ends; one piece when they fit."""
    if len(ids) <= width:
        return [ids]
    step = max(1, width - width // 4)
    out = []
    for start in range(0, len(ids), step):
        out.append(ids[start:start + width])
        if start + width >= len(ids):
            break
    return out


def _special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after one text's own (``[CLS]`` ... ``[SEP]``,
    ``<s>`` ... ``</s>``, a BOS alone), read off its output for a one-word text."""
    plain = tokenizer("moderation", add_special_tokens=False)["input_ids"]
    full = tokenizer("moderation", add_special_tokens=True)["input_ids"]
    at = next(i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain)
    return full[:at], full[at + len(plain):]


class ModerationWorker(EncoderWorker):
    """Runs one sequence classifier; reads its config at construction, its tokenizer at the first
    ``tokenize`` and its weights at ``load``."""

    kind = "moderation"
    auto_class = AutoModelForSequenceClassification

    def __init__(self, spec: ModelSpec, threshold: float = 0.5, max_batch_tokens: int = 16384,
                 batch_width: int = 16) -> None:
        super().__init__(spec, max_batch_tokens, batch_width)
        self.threshold = threshold
        config = AutoConfig.from_pretrained(Path(spec.path))
        labels = getattr(config, "id2label", None) or {}
        self.categories: list[str] = [labels[i] for i in sorted(labels)]
        if not self.categories:
            raise ValueError("the config names no labels (id2label)")
        self.multi_label = config.problem_type == "multi_label_classification" or len(self.categories) == 1
        self.config = config

    @classmethod
    def describe(cls, spec: ModelSpec) -> ModelInfo:
        return ModelInfo(context_length=getattr(AutoConfig.from_pretrained(Path(spec.path)),
                                                "max_position_embeddings", None))

    def tokenize(self, texts: list[str]) -> list[list[list[int]]]:
        """Each text's pieces as token ids, special tokens included (module doc). ``InputError``
        for an empty text. Needs no weights, and may run on any thread."""
        for i, text in enumerate(texts):
            if not text.strip():
                raise InputError(f"input[{i}] is an empty string")
        tokenizer = self.tokenizer
        with self._tokenizing:
            ids = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
            head, tail = _special_tokens(tokenizer)
        width = self.context_length - len(head) - len(tail)
        return [[head + piece + tail for piece in pieces(row, width)] for row in ids]

    @property
    def context_length(self) -> int:
        return context_length(self.config, self.tokenizer.model_max_length)

    def rows(self, inputs: list[str] | list[list[int]], truncate: int | None = None,
             side: str = "right") -> list[list[int]]:
        """Each input whole as one row (``EncoderWorker.whole_rows``): a text with the tokenizer's
        special tokens, token ids as given; ``InputError`` over the context unless ``truncate``."""
        return self.whole_rows(inputs, truncate, side, self.context_length, self.config.vocab_size)

    def classify(self, texts: list[list[list[int]]], ctx: StepContext) -> np.ndarray:
        """Scores, one row per text and one column per category (``categories``), of tokenized
        texts (``tokenize``): each category's highest over the text's pieces."""
        rows = [piece for text in texts for piece in text]
        owner = np.repeat(np.arange(len(texts)), [len(text) for text in texts])
        scores = self._activated(self.run_rows(rows, ctx))  # in passes shared with the other requests waiting
        out = np.full((len(texts), len(self.categories)), -np.inf, dtype=np.float32)
        np.maximum.at(out, owner, scores)
        return out

    def probs(self, rows: list[list[int]], ctx: StepContext, activation: bool = True) -> np.ndarray:
        """Each row's scores per label (``rows``), or with ``activation`` false its raw logits."""
        logits = self.run_rows(rows, ctx)
        return self._activated(logits) if activation else logits

    def _activated(self, logits: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(logits)
        return (torch.sigmoid(t) if self.multi_label else torch.softmax(t, dim=-1)).numpy()

    def _rows_out(self, rows: list[list[int]]) -> np.ndarray:
        """One padded forward pass over ``rows``: their logits."""
        input_ids, mask = self.padded(rows, self.tokenizer.pad_token_id or 0)
        with torch.inference_mode():
            logits = self.model(input_ids=input_ids, attention_mask=mask).logits.float()
        return logits.cpu().numpy()
