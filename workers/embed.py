"""Embeddings: a transformers encoder (``AutoModel`` + ``AutoTokenizer``) from its folder, pooled
and normalized as the folder says, many inputs in one forward pass.

The folder is in sentence-transformers' on-disk format (read here without that package):

* ``modules.json`` lists the modules in order: ``Transformer`` (the encoder, at the folder's root),
  ``Pooling`` (its folder, e.g. ``1_Pooling/config.json``, names one mode:
  ``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``, ``pooling_mode_max_tokens`` or
  ``pooling_mode_lasttoken``) and optionally ``Normalize`` (unit-length vectors). Other module
  types (``Dense``, ...) are refused when the model is read. A folder without ``modules.json`` is
  a plain encoder: mean pooling, normalized.
* The context length is the smallest of ``sentence_bert_config.json``'s ``max_seq_length``, the
  tokenizer's ``model_max_length`` and the encoder's position embeddings. Longer inputs are
  refused, never truncated.
* The instructions it was trained with (``prompts``: ``config.json``'s ``task_instructions``, else
  ``config_sentence_transformers.json``'s ``prompts``, as vLLM reads them), by name, for the
  gateway to put before an input of that kind (Cohere's ``input_type``).
* ``dimensions`` (shorter vectors) is allowed only where ``config.json`` says the model was trained
  for it, as vLLM reads it: ``matryoshka_dimensions: [..]`` (those lengths) or
  ``is_matryoshka: true`` (any length up to the full one). The pooled vector is cut to its first
  ``dimensions`` values before it is normalized.

Inputs arrive as token ids (``tokenize`` turns strings into ids with the tokenizer's special
tokens; token-id inputs are used as given). ``embed`` pads them on the right into one batch and
runs one forward pass; it splits the batch only where one pass would exceed ``max_batch_tokens``
padded tokens (inputs sorted by length, so each pass pads little), with a step boundary between
passes. **Requests that arrive together share passes** (``EncoderWorker.run_rows``): the caller
that finds no pass running takes every request waiting and runs their rows as one batch, so
concurrent requests cost a forward pass between them instead of one each (scripts/bench_encoders.py);
each pass's time is charged to its requests by their rows in it. Batch-tier work, which must
yield between passes, shares passes only with batch-tier work (a lane of its own): a pass whose
rows wait at a pause holds no interactive request, and interactive passes run beside it.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from workers.base import Cancelled, ModelSpec, StepContext
from workers.sharing import SharedJob, SharedRuns
from workers.worker import ModelInfo, ThreadWorker

PoolingMode = Literal["mean", "cls", "max", "lasttoken"]
_POOLING_FLAGS: dict[str, PoolingMode] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "lasttoken",
}
_UNSUPPORTED_POOLING = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_MODULES = ("Transformer", "Pooling", "Normalize")
_HUGE = 1_000_000  # tokenizers without a real limit say model_max_length = 1e30


class InputError(ValueError):
    """An input the model cannot embed; ``too_long`` when it is over the context length."""

    def __init__(self, message: str, too_long: bool = False) -> None:
        super().__init__(message)
        self.too_long = too_long


@dataclass(frozen=True)
class EmbedConfig:
    """What an embedding model's folder says, read without loading tokenizer or weights."""

    pooling: PoolingMode
    normalize: bool
    context_length: int  # tokens per input, special tokens included
    dimensions: int  # the full vector's length
    vocab_size: int
    matryoshka: tuple[int, ...] | bool  # the shorter lengths it allows: listed, any (True) or none (False)
    pad_id: int = 0  # fills the batch past each input's end (masked out)
    # the instructions it was trained with, by name ("query": "query: "), put before an input of that kind
    # (Cohere's input_type): config.json's task_instructions, else config_sentence_transformers.json's prompts
    prompts: dict[str, str] = field(default_factory=dict)

    def check_dimensions(self, dimensions: int) -> None:
        """``ValueError`` unless the model may return vectors of ``dimensions`` values."""
        if not self.matryoshka:
            raise ValueError("this model does not support dimensions (its config declares no matryoshka "
                             "dimensions); leave it out for the full vectors")
        allowed = self.matryoshka if isinstance(self.matryoshka, tuple) else range(1, self.dimensions + 1)
        if dimensions not in allowed:
            which = ", ".join(map(str, allowed)) if isinstance(allowed, tuple) else f"1 to {self.dimensions}"
            raise ValueError(f"dimensions is {dimensions}; this model allows {which}")


def read_config(path: Path) -> EmbedConfig:
    """The pooling, normalization and limits of the model in ``path`` (see the module docstring)."""
    path = Path(path)
    model = _json(path / "config.json")
    pooling, normalize = _pooling(path)
    limits = [int(model.get("max_position_embeddings") or _HUGE)]
    st = _json(path / "sentence_bert_config.json", missing_ok=True)
    if st.get("max_seq_length"):
        limits.append(int(st["max_seq_length"]))
    tok_max = _json(path / "tokenizer_config.json", missing_ok=True).get("model_max_length")
    if isinstance(tok_max, (int, float)) and tok_max < _HUGE:
        limits.append(int(tok_max))
    listed = model.get("matryoshka_dimensions")
    matryoshka = tuple(int(d) for d in listed) if listed else bool(model.get("is_matryoshka", False))
    prompts = model.get("task_instructions") or \
        _json(path / "config_sentence_transformers.json", missing_ok=True).get("prompts") or {}
    return EmbedConfig(pooling, normalize, min(limits), int(model["hidden_size"]), int(model["vocab_size"]),
                       matryoshka, int(model.get("pad_token_id") or 0),
                       {k: v for k, v in prompts.items() if isinstance(v, str)} if isinstance(prompts, dict) else {})


def _json(file: Path, missing_ok: bool = False) -> dict:
    if missing_ok and not file.exists():
        return {}
    data = json.loads(file.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{file}: not a JSON object")
    return data


def _pooling(path: Path) -> tuple[PoolingMode, bool]:
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return "mean", True
    modules = json.loads(modules_file.read_text())
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    for kind in kinds:
        if kind not in _MODULES:
            raise ValueError(f"{modules_file}: module type {kind!r} is not supported (only {', '.join(_MODULES)})")
    pools = [m for m, kind in zip(modules, kinds) if kind == "Pooling"]
    if len(pools) != 1:
        raise ValueError(f"{modules_file}: expected one Pooling module, found {len(pools)}")
    pool_file = path / pools[0]["path"] / "config.json"
    config = json.loads(pool_file.read_text())
    modes = [mode for flag, mode in _POOLING_FLAGS.items() if config.get(flag)]
    unsupported = [flag for flag in _UNSUPPORTED_POOLING if config.get(flag)]
    if unsupported or len(modes) != 1:
        raise ValueError(f"{pool_file}: exactly one of {', '.join(_POOLING_FLAGS)} must be true"
                         + (f" ({', '.join(unsupported)} is not supported)" if unsupported else ""))
    return modes[0], "Normalize" in kinds


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
    """One vector per row of ``hidden`` (rows, tokens, dim), over the tokens where ``mask`` is 1
    (padding on the right)."""
    mask_f = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "mean":
        return (hidden * mask_f).sum(1) / mask_f.sum(1).clamp(min=1)
    if mode == "max":
        return hidden.masked_fill(mask_f == 0, torch.finfo(hidden.dtype).min).max(1).values
    last = mask.sum(1) - 1  # right padding: the last real token of each row
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


def finish(pooled: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Cut to ``dimensions`` (when given), then normalize to unit length (when the model does)."""
    out = pooled.float()
    if dimensions is not None:
        out = out[:, :dimensions]
    if normalize:
        out = torch.nn.functional.normalize(out, p=2, dim=-1)
    return out


SEGMENT_CHARS = 1 << 16  # ``EmbedWorker.cut`` tokenizes a long text this many characters at a time
LONGEST_PIECE = 1 << 18  # a run of this many characters with no whitespace or word's end is cut anyway
_SPACE = re.compile(r"\s")
_WORD_END = re.compile(r"(?<=\w)[^\w\s]")  # a word's last character is before it: punctuation after a word


def _pieces(text: str, length: int, longest: int = LONGEST_PIECE) -> Iterator[tuple[int, int]]:
    """``text`` as consecutive ``[start, end)`` pieces of about ``length`` characters, each but the
    last ending just before a whitespace character (so the whitespace begins the next piece, as
    tokenizers that fold a leading space into a token expect). Where there is none within twice
    ``length`` (compact JSON, minified code, a data URL), the piece ends where a word does, before
    the punctuation that follows it (which tokenizers split from a word too); a run without either
    ends at ``longest`` characters. So no piece, whatever the text, is tokenized whole: memory
    follows the piece."""
    start = 0
    while start < len(text):
        end = start + length
        if end >= len(text):
            end = len(text)
        else:
            near = min(len(text), start + 2 * length)
            found = (_SPACE.search(text, end, near) or _WORD_END.search(text, end, near)
                     or _SPACE.search(text, near, start + longest))
            end = found.start() if found else min(len(text), max(near, start + longest))
        yield start, end
        start = end


def windows(n: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """The token ranges ``[start, end)`` that cut ``n`` tokens into chunks of at most ``size``,
    each starting ``size - overlap`` after the one before (``0 <= overlap < size``), the last
    ending at ``n``; none for no tokens."""
    spans: list[tuple[int, int]] = []
    start = 0
    while start < n:
        end = min(start + size, n)
        spans.append((start, end))
        if end == n:
            break
        start += size - overlap
    return spans


def batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of the inputs, longest first, in groups whose padded size (rows x longest) stays
    within ``max_tokens``; one group whenever they all fit."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass(eq=False)
class _Job(SharedJob):
    """One request's rows waiting for, or in, shared passes (all its rows go in one run)."""

    rows: list[list[int]] = field(default_factory=list)
    parts: list[np.ndarray | None] = field(default_factory=list)


class EncoderWorker(ThreadWorker):
    """A transformers encoder (``auto_class``: ``AutoModel``, or a head such as a sequence
    classifier) with its tokenizer, read at the first use of ``tokenizer``, and its weights at
    ``load``; inputs arrive as token ids, and ``run_rows`` runs them in padded passes shared
    with the other requests waiting (the module doc). Embeddings and moderation run on it."""

    auto_class = AutoModel

    def __init__(self, spec: ModelSpec, max_batch_tokens: int = 16384, batch_width: int = 16) -> None:
        self.spec = spec
        self.max_batch_tokens = max_batch_tokens
        self.batch_width = batch_width  # Batch API lines run together (batch.shapes.width); they share passes
        self._tokenizer = None
        self._tokenizing = threading.Lock()  # a fast tokenizer's call sets its state: one call at a time
        self.model: torch.nn.Module | None = None
        self.shared: SharedRuns[_Job] = SharedRuns(self._take, self._passes)  # requests' passes, shared
        self.passes = 0  # forward passes run (shared ones once)
        self.share_passes = True  # False: each request its own passes (scripts/bench_encoders.py's baseline)

    @classmethod
    def reader(cls, spec: ModelSpec) -> "EncoderWorker":
        """A worker for ``spec`` (its options from tiers.yaml) with its config and tokenizer read
        and no weights: what the gateway checks and tokenizes requests with before they take a slot."""
        worker = cls(spec, **spec.options)
        worker.tokenizer  # noqa: B018 - read now, on the caller's thread (off the event loop)
        return worker

    def _rows_out(self, rows: list[list[int]]) -> np.ndarray:
        """One padded forward pass: an output row per input row (the subclass's)."""
        raise NotImplementedError

    def run_rows(self, rows: list[list[int]], ctx: StepContext) -> np.ndarray:
        """``_rows_out`` of every row, in order, in passes shared with the requests waiting then
        (``workers.sharing``: the caller that finds no pass running runs one for every request
        waiting, its own among them, and hands on), batch-tier work in a lane of its own.
        Returns when the rows are done or the work was cancelled (``Cancelled``, at a pass's
        boundary), never while a pass still holds them."""
        if self.model is None:
            raise RuntimeError(f"model {self.spec.name!r} is not loaded")
        job = _Job(ctx, rows=rows)
        if not self.share_passes:
            self._passes([job])
            if job.error is not None:
                raise job.error
        else:
            self.shared.join(job, [rows])
        ctx.gpu_s = (ctx.gpu_s or 0.0) + job.gpu_s
        return np.stack(job.parts)

    @staticmethod
    def _take(jobs: list[_Job]) -> tuple[list[_Job], list[_Job]]:
        """The next run: every waiting job's rows."""
        for job in jobs:
            job.pending.clear()
        return jobs, jobs

    def _passes(self, jobs: list[_Job]) -> None:
        """Every job's rows in padded passes of at most ``max_batch_tokens``, longest first; each
        job's step boundary before a pass holds its rows (a cancelled job leaves the batch, the
        others go on); each pass's time shared among its jobs by their rows in it. Batch jobs
        pause together: each asks whether it must yield before any waits at its gate, so one
        that waits behind another's pause counts that time as paused too (not service time)."""
        flat = [(job, i) for job in jobs for i in range(len(job.rows))]
        for job in jobs:
            job.parts = [None] * len(job.rows)
        for group in batches([len(job.rows[i]) for job, i in flat], self.max_batch_tokens):
            members = [flat[k] for k in group]
            holders = [job for job in dict.fromkeys(job for job, _ in members) if job.error is None]
            if len(holders) > 1:
                for job in holders:
                    job.ctx.must_pause()  # starts its paused clock now if the lane must yield
            for job in holders:
                try:
                    job.ctx.boundary()
                except Cancelled as exc:
                    job.error = exc
            members = [(job, i) for job, i in members if job.error is None]
            if not members:
                continue
            started = time.perf_counter()
            out = self._rows_out([job.rows[i] for job, i in members])
            share = (time.perf_counter() - started) / len(members)
            self.passes += 1
            for (job, i), row in zip(members, out):
                job.parts[i] = row
                job.gpu_s += share

    def load(self, device: torch.device) -> None:
        """The model onto ``device`` (fp16 on CUDA, fp32 elsewhere)."""
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        self.model = self.auto_class.from_pretrained(Path(self.spec.path), dtype=dtype).to(device).eval()
        self.device = device

    def unload(self) -> None:
        self.model = None

    def modules(self) -> list[torch.nn.Module]:
        return [self.model] if self.model is not None else []

    @property
    def tokenizer(self):
        """The model's tokenizer, read from its folder the first time it is asked for."""
        with self._tokenizing:
            if self._tokenizer is None:
                self._tokenizer = AutoTokenizer.from_pretrained(Path(self.spec.path))
            return self._tokenizer

    def whole_rows(self, inputs: list[str] | list[list[int]], truncate: int | None, side: str, limit: int,
                   vocab: int) -> list[list[int]]:
        """Token ids of each input: strings through the tokenizer (with its special tokens), token
        ids as given. ``truncate`` (vLLM's ``truncate_prompt_tokens``) keeps at most that many
        tokens of each input, from its start (``side`` right) or its end (left): a string's
        through the tokenizer's own truncation, its special tokens kept; below their count (1 on
        BERT's [CLS] ... [SEP]) that many of them, as vLLM cuts it. ``InputError`` for an empty
        input, an id outside the ``vocab``, or one over ``limit`` tokens (the context).
        Needs no weights; any thread."""
        if inputs and isinstance(inputs[0], str):
            if any(not text for text in inputs):
                raise InputError(f"input[{next(i for i, t in enumerate(inputs) if not t)}] is an empty string")
            tokenizer = self.tokenizer
            cut = {} if truncate is None else {"truncation": True, "max_length": truncate}
            with self._tokenizing:
                kept, tokenizer.truncation_side = tokenizer.truncation_side, side
                try:
                    ids = tokenizer(list(inputs), add_special_tokens=True, **cut)["input_ids"]
                finally:
                    tokenizer.truncation_side = kept
        else:
            ids = [list(row) for row in inputs]
        if truncate is not None:  # a token array's cut; a text's where the tokenizer will not cut below its specials
            ids = [row[-truncate:] if side == "left" else row[:truncate] for row in ids]
        for i, row in enumerate(ids):
            if not row:
                raise InputError(f"input[{i}] has no tokens")
            if len(row) > limit:
                raise InputError(f"input[{i}] is {len(row)} tokens, above this model's context length of {limit}",
                                 too_long=True)
            bad = next((t for t in row if not 0 <= t < vocab), None)
            if bad is not None:
                raise InputError(f"input[{i}] has token id {bad}, outside this model's vocabulary (0 to {vocab - 1})")
        return ids

    def padded(self, rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` padded on the right into one batch and its attention mask, on the model's device."""
        width = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            input_ids[r, : len(row)] = torch.tensor(row)
            mask[r, : len(row)] = 1
        device = self.model.device
        return input_ids.to(device), mask.to(device)


class EmbedWorker(EncoderWorker):
    """Runs one encoder; reads its config at construction, its tokenizer at the first
    ``tokenize`` and its weights at ``load`` (``embed`` takes token ids: the gateway tokenizes)."""

    kind = "embed"

    def __init__(self, spec: ModelSpec, max_batch_tokens: int = 16384, batch_width: int = 16) -> None:
        super().__init__(spec, max_batch_tokens, batch_width)
        self.config = read_config(Path(spec.path))

    @classmethod
    def describe(cls, spec: ModelSpec) -> ModelInfo:
        return ModelInfo(context_length=read_config(Path(spec.path)).context_length)

    def tokenize(self, inputs: list[str] | list[list[int]], truncate: int | None = None,
                 side: str = "right") -> list[list[int]]:
        """``whole_rows`` within the model's context and vocabulary (``EmbedConfig``)."""
        return self.whole_rows(inputs, truncate, side, self.config.context_length, self.config.vocab_size)

    @property
    def chunk_room(self) -> int:
        """The most tokens of text one input can hold: the context less the special tokens."""
        return self.config.context_length - self.tokenizer.num_special_tokens_to_add(pair=False)

    def cut(self, text: str, size: int, overlap: int, max_tokens: int | None = None,
            segment: int = SEGMENT_CHARS) -> Iterator[tuple[str, list[int]]]:
        """``text`` cut into chunks of at most ``size`` tokens (``chunk_room`` at most), each
        starting ``size - overlap`` tokens after the one before (``windows``): each chunk's text
        (the span of ``text`` its tokens came from, as written) and its ids with the model's
        special tokens, made as they are asked for. The text is tokenized ``segment`` characters
        at a time, each piece ending before whitespace or a word's punctuation (``_pieces``), so memory follows
        a piece and not the whole; past ``max_tokens`` tokens of text, ``InputError``. Needs a
        fast tokenizer (offsets) and no weights; may run on any thread."""
        prefix: list[int] | None = None
        suffix: list[int] = []
        ids: list[int] = []  # the tokens from the next chunk's start on, and where each is in ``text``
        spans: list[tuple[int, int]] = []
        seen = 0
        for start, end in _pieces(text, segment):
            piece_prefix, piece_ids, piece_suffix, offsets = self._tokens(text[start:end])
            if prefix is None:
                prefix, suffix = piece_prefix, piece_suffix
            ids += piece_ids
            spans += [(a + start, b + start) for a, b in offsets]
            seen += len(piece_ids)
            if max_tokens is not None and seen > max_tokens:
                raise InputError(f"the text has more than {max_tokens} tokens", too_long=True)
            at = 0
            while len(ids) - at > size:  # more tokens follow: this chunk is not the last
                yield text[spans[at][0]:spans[at + size - 1][1]], prefix + ids[at:at + size] + suffix
                at += size - overlap
            del ids[:at], spans[:at]
        for s, e in windows(len(ids), size, overlap):
            yield text[spans[s][0]:spans[e - 1][1]], (prefix or []) + ids[s:e] + suffix

    def _tokens(self, piece: str) -> tuple[list[int], list[int], list[int], list[tuple[int, int]]]:
        """``piece``'s special tokens before its text, its text's tokens, those after, and where each
        text token is in ``piece``."""
        tokenizer = self.tokenizer
        with self._tokenizing:
            encoded = tokenizer(piece, add_special_tokens=True, return_offsets_mapping=True,
                                return_special_tokens_mask=True, verbose=False)
        ids, offsets, special = encoded["input_ids"], encoded["offset_mapping"], encoded["special_tokens_mask"]
        head = special.index(0) if 0 in special else len(ids)
        tail = len(ids) - (special[::-1].index(0) if 0 in special else 0)
        return ids[:head], ids[head:tail], ids[tail:], offsets[head:tail]

    def embed(self, ids: list[list[int]], dimensions: int | None, ctx: StepContext) -> np.ndarray:
        """float32 vectors (one row per input, in order) of checked token ids (``tokenize``),
        cut to ``dimensions`` (when given) before they are normalized."""
        pooled = torch.from_numpy(self.run_rows(ids, ctx))
        return finish(pooled, dimensions, self.config.normalize).numpy()

    def _rows_out(self, rows: list[list[int]]) -> np.ndarray:
        """One padded forward pass over ``rows``: each row's pooled vector (float32, full length)."""
        input_ids, mask = self.padded(rows, self.config.pad_id)
        with torch.inference_mode():
            hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            return pool(hidden, mask, self.config.pooling).float().cpu().numpy()
