"""What every worker shares: the model spec, the step context, and the request/result types.

A worker runs one model of one kind. Model compute always runs on threads owned by the worker
(never on the event loop). Work is done in *steps* (a decode step, a denoising step, a sentence,
a window); between steps the worker calls ``StepContext.boundary()``, which is the one place where
work can be cancelled (client gone) or paused (the arbiter making batch work yield).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

if TYPE_CHECKING:
    from lora_kernels import LoraAdapter

ModelKind = Literal["chat", "image", "tts", "stt", "embed", "moderation", "rerank", "train"]  # train: workers.trainer


@dataclass(frozen=True)
class ModelSpec:
    """One entry of tiers.yaml ``models:``."""

    name: str
    kind: ModelKind
    path: Path
    vram: int | None = None  # declared footprint in bytes; None = estimate
    engine: str = "transformers"  # chat only: "transformers" or "vllm"
    options: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)  # engine settings


class Cancelled(Exception):
    """The work was cancelled at a step boundary (client went away, or the server is stopping)."""


class StepContext:
    """Handed to running work; ``boundary()`` is called between steps.

    ``cancel()`` may be called from any thread; the work stops at its next boundary.
    ``pause_gate`` (set by the arbiter) is called at each boundary and may block while the
    work must yield; it returns when the work may continue. ``pause_check`` is its non-blocking
    twin for batched engines. ``steps`` counts boundaries passed; ``paused`` says whether the work
    was ever made to yield and ``paused_s`` for how long (such time is not service time).
    ``gpu_s`` is set by an engine that runs many requests in one step (the transformers chat
    engine): each step's time shared among its rows; None means the work's service time is its
    device time. ``prompt_tokens`` and ``completion_tokens`` are a chat engine's running count of
    the request's tokens (the prompt once it is tokenized, every token sampled so far): what a
    reply cut before its end is metered by. ``prompt_thinking`` says whether the rendered chat
    prompt left a reasoning model's ``<think>`` open (``gateway.reasoning``).
    """

    def __init__(
        self,
        pause_gate: Callable[["StepContext"], None] | None = None,
        pause_check: Callable[[], bool] | None = None,
    ) -> None:
        self._cancelled = threading.Event()
        self.pause_gate = pause_gate
        self.pause_check = pause_check
        self.steps = 0
        self.gpu_s: float | None = None  # device seconds an engine that shares steps among rows charged this work
        self.prompt_tokens = 0  # a chat engine's running count of this request's tokens
        self.completion_tokens = 0
        # the rendered chat prompt's last thinking marker (set when a chat engine renders it): "open"
        # (<think>: the reply starts thinking), "closed" (</think>) or "none"
        self.prompt_thinking = "none"
        self.paused = False
        self._paused_s = 0.0
        self._paused_since: float | None = None

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def paused_s(self) -> float:
        since = self._paused_since
        return self._paused_s + (time.monotonic() - since if since is not None else 0.0)

    def must_pause(self) -> bool:
        """Non-blocking form of the pause gate, for engines that batch many requests in one
        thread (chat): a paused row leaves the batch, keeps its tokens, and rejoins later. The
        time from the first True to the next False is counted as paused."""
        pause = self.pause_check() if self.pause_check is not None else False
        if pause and self._paused_since is None:
            self.paused, self._paused_since = True, time.monotonic()
        elif not pause and self._paused_since is not None:
            self._paused_s += time.monotonic() - self._paused_since
            self._paused_since = None
        return pause

    def boundary(self) -> None:
        self.steps += 1
        if self._cancelled.is_set():
            raise Cancelled()
        if self.pause_gate is not None:
            pausing = self.must_pause()  # starts the paused clock when the work must yield
            self.pause_gate(self)
            if pausing:
                self.must_pause()  # the gate let it go: ends the paused interval
            if self._cancelled.is_set():
                raise Cancelled()


# A weighted adapter stack: the adapters merged into the base weights for one request, W' = W +
# sum_i w_i * delta_i, in this order. () is the base model. Requests with equal keys share weights.
AdapterStackSpec = tuple[tuple["LoraAdapter", float], ...]
StackKey = tuple[tuple[str, float], ...]


def stack_key(stack: AdapterStackSpec) -> StackKey:
    """The identity of a stack: adapter names (unique per server) and weights, in order (the order
    changes the rounding of the merge, so it is part of the key)."""
    return tuple((adapter.name, float(weight)) for adapter, weight in stack)


@dataclass(frozen=True)
class JsonGrammar:
    """Constrained decoding: the reply is JSON valid against ``schema`` (JSON Schema text), with
    no free whitespace (compact: separators ``","`` and ``":"``). Both engines compile it with
    xgrammar (see ``workers.grammar``)."""

    schema: str


@dataclass(frozen=True)
class EbnfGrammar:
    """Constrained decoding by a grammar in xgrammar's EBNF (start rule ``root``): a reply that
    may take one of several shapes, such as the requested JSON or the model's own tool calls
    (``workers.grammar.reply_or_calls``)."""

    ebnf: str


Grammar = JsonGrammar | EbnfGrammar


@dataclass
class ChatParams:
    max_tokens: int = 256  # 0: nothing generated (a prompt scored for its ``prompt_logprobs``)
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the k most likely (0..20)
    presence_penalty: float = 0.0  # subtracted once from a token that was generated before
    frequency_penalty: float = 0.0  # subtracted per earlier generation of a token
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # vLLM's sampling extensions, in vLLM's order: the repetition penalty with the other penalties
    # (a token of the prompt or the reply: its logit divided by it if positive, else multiplied),
    # then after the temperature min_p (tokens under min_p x the likeliest's probability out), top_k
    # (the k likeliest kept), top_p; 0 min_p and 0 top_k are off, 1 is no penalty
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # vLLM's ends of a reply: the tokens besides the model's end of text that end it (not in its text), how many
    # tokens it has at least before any of them may (they are barred until then), and the end of text not ending it
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    # vLLM's include_stop_str_in_output: the stop string that ended it kept in its text, or the stop token's text
    # (the end of text's too: empty unless special tokens are kept)
    include_stop_str: bool = False
    # vLLM's detokenizing options: special tokens (``<|im_end|>``, ...) left out of the reply's text, and a slow
    # tokenizer's spaces between them (a fast tokenizer, as vLLM's fast detokenizer, puts none)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's token constraints: the only tokens the reply may have (empty: any), and words it may not write
    # (``workers.chat.bad_words_ids``: a word's last token barred where the reply ends with the rest of it)
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    # vLLM's thinking_token_budget: a reasoning reply's thinking cut at so many tokens by forcing ``</think>``
    # (``workers.think_budget``; the gateway takes it for a model with a reasoning_parser only); None: uncut
    thinking_budget: int | None = None
    grammar: Grammar | None = None
    grammar_param: str = "response_format"  # the request field ``grammar`` came from, named in its 400s
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's and the k most likely there
    # max_tokens is the server's default, not the client's: a prompt that leaves less room shrinks it to that
    # room, as vLLM's default (``workers.chat_prompt.fit_context``), where the client's own is refused
    max_tokens_default: bool = False


class InvalidParam(ValueError):
    """A request field the engine cannot serve for this model (HTTP 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# vLLM 0.32 computes a prompt's logprobs with the LoRA mapping of the step's sampled rows, one per request:
# with one request in the step it broadcasts, with two its CPU kernels fail (einsum: subscript b has size 2
# against the prompt's length) and the engine core dies, with every tier's requests on it; on CUDA an
# adapter's lm_head is left out of them (vllm-project/vllm#29955, #51594). So the vLLM engine with LoRA
# refuses them (workers.chat_vllm), and the gateway before it (gateway.logprobs.check_prompt_logprobs).
PROMPT_LOGPROBS_WITH_LORA = ("prompt_logprobs are not available on the model {model}: it runs on the vllm engine with "
                             "LoRA adapters enabled, where vLLM 0.32 cannot compute them")


# where a chat prompt ends (vLLM's add_generation_prompt / continue_final_message): the assistant's turn
# opened for the reply (the default); after the last message, closed; or inside the last message, left open
# for the reply to continue it (a prefilled start)
PromptEnd = Literal["generation", "closed", "open"]


@dataclass
class ChatRequest:
    messages: list[dict]  # OpenAI's shape: role, content, and tool_calls / tool_call_id where given
    params: ChatParams
    priority: int = 0  # 0 is the highest tier
    ctx: StepContext = field(default_factory=StepContext)
    adapters: AdapterStackSpec = ()  # the adapter stack this request runs with; () = the base model
    tools: list[dict] | None = None  # function tools, rendered by the chat template
    template_kwargs: dict[str, Any] | None = None  # the chat template's own variables (enable_thinking, ...)
    prompt_end: PromptEnd = "generation"  # where the rendered prompt ends
    prompt_ids: list[int] | None = None  # a raw prompt (legacy completions): these ids, no chat template
    # the images of the messages' image parts (``{"type": "image"}`` in ``messages``), in order: each an
    # encoded file (PNG, JPEG, WebP, GIF) the gateway has checked; for a model that reads images only
    images: tuple[bytes, ...] = ()
    stream: bool = True  # False: only the whole reply is read (a batch line, a non-streamed response), so an
    # engine may hold its text back after the first delta (which times the first token) until the end
    # a reasoning model's reply (its model has a reasoning_parser): the engine reports the tokens
    # through its first </think> (ChatFinished.think_tokens), and a constrained reply (``params.grammar``)
    # thinks first: the grammar applies after that </think>, unless the prompt closed the thinking
    reasoning: bool = False
    # vLLM's prefix cache: blocks are reused only among requests with the same salt (the caller's
    # key, unless tiers.yaml's server.prefix_cache is shared); None: shared with every request
    cache_salt: str | None = None
    # Predicted Outputs: text the reply is expected to repeat. The transformers engine checks it in the
    # prefill's one pass and keeps the tokens the reply would have had anyway (the reply is the same
    # with or without it); other engines may ignore it
    prediction: str | None = None
    # vLLM's truncate_prompt_tokens: the rendered prompt cut to this many tokens (-1: the context less one), keeping
    # its start (truncation_side "right") or its end ("left"; None: the tokenizer's own side)
    truncate: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's add_special_tokens: the rendered chat prompt encoded with the tokenizer's special tokens (BOS) on top of
    # what the template writes (False, the default: the template's alone)
    add_special_tokens: bool = False
    # vLLM's return_token_ids: each TextDelta carries the ids of the tokens generated since the last one's
    # (``TextDelta.token_ids``), and the first the prompt's (``prompt_ids``); the tokens after the last
    # text (the end of text, a held-back tail) come in a TextDelta of their own before ChatFinished
    token_ids: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's text and log probability, the ``top`` most likely tokens at its step
    (most likely first; each without a ``top`` of its own), and ``raw``, the token's own bytes
    where the engine knows them: a piece of a multi-byte character is that byte (b"\\xc3"), where
    a chat engine's text for it is "" (the piece that completes the character has the whole
    character: ``workers.grammar.Vocabulary.text_after``) and a transcription's U+FFFD."""

    token: str
    logprob: float
    top: tuple[TokenLogprob, ...] = ()
    raw: bytes | None = None
    id: int | None = None  # the token's id in the model's vocabulary
    rank: int | None = None  # its place among the tokens by probability there (1: the likeliest), where known


@dataclass
class TextDelta:
    text: str
    logprobs: list[TokenLogprob] | None = None  # the tokens behind this text (when asked for)
    # ``params.prompt_logprobs``: one entry per prompt token, the first None (nothing precedes it),
    # on the request's first event, before any text; the model's raw log probabilities
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # ``ChatRequest.token_ids``: the generated tokens behind this text (and any before it not yet
    # reported), and on the request's first event the rendered prompt's; None when not asked
    token_ids: list[int] | None = None
    prompt_ids: list[int] | None = None


class TokenReport:
    """``ChatRequest.token_ids``: what an engine has reported of a request's tokens. ``ids[start:]``
    are the generated tokens (a list the engine extends as it samples); ``attach`` puts those not yet
    reported on a text event, and the prompt's on the first."""

    def __init__(self, prompt: list[int], ids: list[int], start: int = 0) -> None:
        self.prompt: list[int] | None = list(prompt)
        self._ids, self._at = ids, start

    def owed(self) -> bool:
        """Tokens (or the prompt) not yet reported."""
        return self.prompt is not None or len(self._ids) > self._at

    def attach(self, delta: TextDelta) -> TextDelta:
        delta.token_ids, self._at = self._ids[self._at:], len(self._ids)
        delta.prompt_ids, self.prompt = self.prompt, None
        return delta


@dataclass
class ChatFinished:
    finish_reason: Literal["stop", "length"]
    prompt_tokens: int
    completion_tokens: int
    # ``ChatRequest.reasoning``: how many generated tokens it took to write the first
    # ``</think>`` (None: not written, or not asked); the gateway counts the reasoning tokens from it
    think_tokens: int | None = None
    # prompt tokens the engine read from its prefix cache instead of computing them (vLLM's
    # num_cached_tokens, of the request's first pass); 0 on the transformers engine, which keeps none
    cached_tokens: int = 0
    # ``ChatRequest.prediction``, as an engine that checked it counts it: the predicted tokens the reply
    # kept, and those it did not (both 0 where the prediction was not checked)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    # vLLM's stop_reason: the stop string or stop token id (``ChatParams.stop_token_ids``) that ended the
    # reply; None when it ended otherwise (the model's end of text, max_tokens)
    stop_reason: int | str | None = None


ChatEvent = TextDelta | ChatFinished
