"""Reranking: a cross-encoder, a transformers sequence classifier with one label
(``AutoModelForSequenceClassification`` + ``AutoTokenizer``, what sentence-transformers'
``CrossEncoder`` saves: ms-marco-MiniLM, bge-reranker, ...), scoring how well each document
answers a query, read from its folder.

* Each (query, document) pair is one input, encoded as the tokenizer encodes a pair (``[CLS]``
  query ``[SEP]`` document ``[SEP]`` on BERT, with token type ids where the model has them).
* A document too long for the context beside the query is scored in full, never cut off: its
  pair is split into pieces (the query in each, neighbouring pieces of the document overlapping
  by a quarter of the room the query leaves it; the tokenizer's own overflow), and the
  document's score is its best piece's, as moderation scores a long text. ``max_tokens`` cuts
  each document to its first so many tokens first.
* A score is the label's logit through the model's activation: a sigmoid (0..1), as vLLM and
  ``CrossEncoder`` apply to a one-label model, unless the config names another
  (sentence-transformers' ``activation_fn``; Identity: the raw logit); ``activation=False`` gives
  the raw logit always (vLLM's ``use_activation``).

``tokenize`` (no weights needed) turns pairs into their pieces; ``score`` runs every piece of a
request through the model in padded passes shared with the requests waiting
(``workers.embed.EncoderWorker``), a step boundary between passes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from workers.base import ModelSpec, StepContext
from workers.embed import EncoderWorker, InputError
from workers.moderation import context_length
from workers.worker import ModelInfo


class QueryError(InputError):
    """The query itself cannot be scored (empty, or too long to leave a document room)."""


class PairRow(list):
    """One (query, document piece) input's token ids; ``types`` its token type ids."""

    __slots__ = ("types",)

    def __init__(self, ids: list[int], types: list[int] | None) -> None:
        super().__init__(ids)
        self.types = types


def read_config(folder: Path):
    """The folder's config, checked to be a reranker's: one label, an activation applied here
    (``tiergate check`` reads it so, before any request)."""
    config = AutoConfig.from_pretrained(folder)
    if getattr(config, "num_labels", 0) != 1:
        raise ValueError(f"a reranker scores with one label; this config has {getattr(config, 'num_labels', 0)}")
    activation_of(config)
    return config


def activation_of(config) -> bool:
    """Whether the model's default activation is a sigmoid (False: the raw logit). A
    sentence-transformers cross-encoder names its own in its config (``sentence_transformers:
    {activation_fn}`` since v4, ``sbert_ce_default_activation_function`` before)."""
    named = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn") \
        or getattr(config, "sbert_ce_default_activation_function", None) or "Sigmoid"
    if named.rsplit(".", 1)[-1] not in ("Sigmoid", "Identity"):
        raise ValueError(f"the config's activation {named!r} is not one tiergate applies (Sigmoid, Identity)")
    return named.endswith("Sigmoid")


class RerankWorker(EncoderWorker):
    """Runs one cross-encoder; reads its config at construction, its tokenizer at the first
    ``tokenize`` and its weights at ``load``."""

    kind = "rerank"
    auto_class = AutoModelForSequenceClassification

    def __init__(self, spec: ModelSpec, max_batch_tokens: int = 16384, batch_width: int = 16) -> None:
        super().__init__(spec, max_batch_tokens, batch_width)
        config = read_config(Path(spec.path))
        self.sigmoid = activation_of(config)
        self.typed = getattr(config, "type_vocab_size", 1) > 1  # BERT's segments: query 0, document 1
        self.config = config

    @classmethod
    def describe(cls, spec: ModelSpec) -> ModelInfo:
        return ModelInfo(context_length=getattr(read_config(Path(spec.path)), "max_position_embeddings", None))

    def tokenize(self, query: str, documents: list[str], max_tokens: int = 0) -> list[list[PairRow]]:
        """Each document's pieces beside ``query`` (module doc); ``max_tokens`` > 0 cuts each
        document to that many tokens first. ``InputError`` for an empty text, or a query that
        leaves a document less than a quarter of the context. Needs no weights; any thread."""
        if not query.strip():
            raise QueryError("the query is an empty string")
        for i, doc in enumerate(documents):
            if not doc.strip():
                raise InputError(f"document {i} is an empty string")  # its index among ``documents``
        tokenizer = self.tokenizer
        width = context_length(self.config, tokenizer.model_max_length)
        with self._tokenizing:
            if max_tokens:
                documents = _cut(tokenizer, documents, max_tokens)
            query_tokens = len(tokenizer(query, add_special_tokens=False)["input_ids"])
            room = width - query_tokens - tokenizer.num_special_tokens_to_add(pair=True)  # a document's tokens
            if room < width // 4:
                raise QueryError(f"the query leaves {max(room, 0)} of the model's {width} tokens for a document "
                                 f"(at least {width // 4} are needed)", too_long=True)
            enc = tokenizer([query] * len(documents), documents, truncation="only_second", max_length=width,
                            stride=room // 4, return_overflowing_tokens=True, return_token_type_ids=self.typed)
        out: list[list[PairRow]] = [[] for _ in documents]
        types = enc.get("token_type_ids") if self.typed else None
        for k, doc in enumerate(enc["overflow_to_sample_mapping"]):
            out[doc].append(PairRow(enc["input_ids"][k], types[k] if types is not None else None))
        return out

    def score(self, pieces: list[list[PairRow]], ctx: StepContext, activation: bool | None = None) -> np.ndarray:
        """One score per document of tokenized pairs (``tokenize``): its best piece's, through the
        model's activation (``activation`` None), a sigmoid (True) or none (False)."""
        rows = [piece for doc in pieces for piece in doc]
        owner = np.repeat(np.arange(len(pieces)), [len(doc) for doc in pieces])
        logits = self.run_rows(rows, ctx)  # in passes shared with the other requests waiting
        best = np.full(len(pieces), -np.inf, dtype=np.float32)
        np.maximum.at(best, owner, logits)
        sigmoid = self.sigmoid if activation is None else activation
        return 0.5 * (1.0 + np.tanh(best / 2)) if sigmoid else best  # the sigmoid, without exp's overflow

    def _rows_out(self, rows: list[PairRow]) -> np.ndarray:
        """One padded forward pass over ``rows``: each row's logit."""
        input_ids, mask = self.padded(rows, self.tokenizer.pad_token_id or 0)
        kwargs = {}
        if self.typed:
            types = torch.zeros_like(input_ids)
            for r, row in enumerate(rows):
                if row.types is not None:
                    types[r, : len(row.types)] = torch.tensor(row.types)
            kwargs["token_type_ids"] = types
        with torch.inference_mode():
            logits = self.model(input_ids=input_ids, attention_mask=mask, **kwargs).logits.float()
        return logits[:, 0].cpu().numpy()


def _cut(tokenizer, documents: list[str], max_tokens: int) -> list[str]:
    """Each document cut after its first ``max_tokens`` tokens (at the character the next one starts)."""
    enc = tokenizer(documents, add_special_tokens=False, return_offsets_mapping=True)
    return [doc if len(offsets) <= max_tokens else doc[: offsets[max_tokens - 1][1]]
            for doc, offsets in zip(documents, enc["offset_mapping"])]
