"""Chat on transformers: a causal LM and its tokenizer's chat template, served by a small
continuous-batching loop.

One engine thread per loaded model owns the model and a batch of live sequences. Each loop
iteration admits newly arrived sequences (prefilled together, left-padded, where they may share a
pass, else one prefill each: ``chat_schedule.prefill_passes``; then their KV cache is merged into
the batch's cache with left padding), runs ONE forward pass that decodes a token for every live
sequence, and hands each sequence's new text to its asyncio consumer. Sequences join and leave at
any step, so concurrent requests share forward passes instead of queueing one behind another.

Sampling, per row: the logits get the row's ``logit_bias`` and repetition, presence and frequency
penalties, then its grammar's mask when it is constrained (``workers.grammar``: a matcher per row,
advanced by each sampled token; a reasoning model's row thinks unconstrained first, and its grammar
applies from the token after its first ``</think>`` unless the prompt closed the thinking); logprobs
are the log-softmax of these processed logits, before temperature. Then the temperature, min_p,
top_k and top_p, in vLLM's order (``_sample``).
A prompt's own logprobs (``ChatParams.prompt_logprobs``: legacy completions' ``echo``) come from
its prefill's logits at every place, raw, as vLLM's do, in one event before the first text.

A decode step is the step boundary: a cancelled sequence (client gone) leaves the batch there;
a sequence whose context asks it to pause (batch work yielding to another tier) leaves the batch
keeping its tokens, and rejoins later by re-prefilling prompt + generated tokens. A forward pass
over batch work alone (a decode step of batch rows, a prefill of batch rows) need not finish: a pause
order stops it at the next decoder layer (a forward pre-hook), or between two rows' sampling, and
its rows leave with the tokens they had (the half-stepped cache goes: they re-prefill anyway), so
the request they yield to waits for a layer rather than a step. With every row paused, the engine
thread waits on its inbox, so that request's arrival wakes it at once.

Each row's new text crosses to its asyncio consumer once per step (``loop.call_soon_threadsafe``),
unless the reply is read whole (``ChatRequest.stream`` False: a batch line, a non-streamed
response): then its first text goes at once (it times the first token) and the rest at the end,
and a row with no stop strings is not even detokenized between the two.

Which rows join, leave and wait, and when the adapter stack changes, is decided before every
step by a pure function, ``workers.chat_schedule.plan_step``; this module carries its plans out.

Images. A folder with a vision tower (``vision_config``: LLaVA and the like) loads with its
processor and ``AutoModelForImageTextToText``; a request's images become its prompt's image tokens
and the vision tower's inputs (``chat_prompt.vision_inputs``, off the loop), which every prefill of
the row passes to the model (a re-prefill after a pause too). Decode steps read the cache only, so
image rows and text rows share them.

Adapter stacks. Rows of one forward pass share the weights, so a batch serves ONE adapter stack
(``ChatRequest.adapters``, merged into the weights by ``lora_kernels.AdapterStack``). When the
plan says so (the batch has drained and the best ready row wants another stack) the engine thread
switches the weights between steps: restore for the base model, else merge from the pristine
copies.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import itertools
import json
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Collection

import torch

from lora_kernels import AdapterStack, NonFiniteFactors
from workers import chat_prompt
from workers.base import (
    AdapterStackSpec,
    Cancelled,
    ChatEvent,
    ChatFinished,
    ChatParams,
    ChatRequest,
    InvalidParam,
    ModelSpec,
    StackKey,
    TextDelta,
    TokenLogprob,
    TokenReport,
    stack_key,
)
from workers.grammar import PIECES, Grammars, RowGrammar, Vocabulary, xgrammar_reason
from workers.think_budget import ThinkBudget
from workers.worker import ModelInfo, ThreadWorker
from workers.chat_prompt import ContextTooLong  # noqa: F401 - the chat engines' 400, importable here
from workers.chat_schedule import EngineView, Prefill, Row, plan_step, prefill_passes

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - an older tokenizers: the whole text is decoded each step
    DecodeStream = None


_STEP_LOG = 20_000  # decode steps kept in step_log (read by tests and benchmarks; copy it with list())
_PROMPT_CHUNK = 256  # prompt positions whose log-softmax is taken at once (``params.prompt_logprobs``)
_PAUSED_POLL_S = 0.005  # while every row is paused, how often the engine looks whether their pause lifted
# The engine thread runs Python between its kernels (nearly all of a step, on a small model), so the
# event loop, where a paid arrival is parsed and admitted, waits for the GIL whenever it wakes:
# up to the interpreter's switch interval, 5 ms by default. The engine lowers it to this.
_SWITCH_INTERVAL_S = 0.0005


RESYNC_GRAM = 3  # the reply's last tokens that must be a run of the prediction to pick it up again
RESYNC_MAX = 128  # predicted tokens checked in one re-sync pass (a pass that fails early wastes the rest)


class _Yield(Exception):
    """Raised between decoder layers: a pause order came for every row of the forward pass."""


class AdapterStackFailed(RuntimeError):
    """The request's adapter stack could not be merged into the model."""


class NonFiniteLogits(RuntimeError):
    """The model's logits for the next token hold NaN or +inf: there is nothing to sample from. With
    an adapter stack merged, raised as ``ValueError`` (the request's stack: a 400, as a stack whose
    factors fold to inf is); without one, the model itself overflowed (a 500 with this message)."""


class NoTokenLeft(RuntimeError):
    """Every token is barred at once: the row's constraints together leave nothing to sample (a
    grammar that allows only the end, which ``min_tokens`` or ``ignore_eos`` bars; a grammar and
    ``allowed_token_ids`` or ``bad_words`` that allow nothing in common). The request's: a 400
    naming the field (``_no_token_left``), where it was a 500 (a draw from an all-zero
    distribution; at temperature 0 a token outside the grammar)."""


@dataclass
class _Seq:
    ids: list[int]  # prompt + generated tokens; the last one is not yet in the KV cache
    prompt_len: int
    params: ChatParams
    emit: Callable[[ChatEvent | BaseException], None]
    req: ChatRequest
    generator: torch.Generator
    arrival: int = 0  # order of submission: ties between equal priorities
    emitted_chars: int = 0
    done: bool = False
    grammar: RowGrammar | None = None  # the row's matcher when its reply is constrained
    thinking: bool = False  # a reasoning reply's grammar waits: it applies after the first </think>
    logprobs: list[TokenLogprob] = field(default_factory=list)  # sampled, not yet emitted
    detok: object | None = None  # its tokens' text decoded one token at a time (``ChatWorker._text``)
    decoded: int = 0  # generated tokens fed to ``detok`` so far
    text: str = ""  # their text: every complete character so far
    vision: dict | None = None  # a prompt with images: the vision tower's inputs (``pixel_values``), for every prefill
    draft: list[int] = field(default_factory=list)  # the prediction's tokens: the first prefill checks them
    accepted: int = 0  # predicted tokens the reply kept (each a decode step not run)
    aligned: int = 0  # the prediction's place where the reply may pick it up again
    checking: list[int] = field(default_factory=list)  # predicted tokens to check after this step (a re-sync)
    grams: dict[tuple[int, ...], list[int]] | None = None  # the prediction's RESYNC_GRAM-token runs -> their places
    outside: torch.Tensor | None = None  # allowed_token_ids: True for every token not allowed
    bad_words: list[list[int]] = field(default_factory=list)  # ``bad_words_ids``
    think: ThinkBudget | None = None  # ``thinking_token_budget``: the tokens it forces

    def prediction_counts(self) -> tuple[int, int]:
        """(accepted, rejected) tokens of the prediction: those the reply kept, and the rest."""
        return self.accepted, len(self.draft) - self.accepted

    def resync(self, room: int) -> None:
        """After the reply left the prediction: when its last ``RESYNC_GRAM`` tokens are a run of the
        prediction that ends at or after ``aligned``, the predicted tokens after that run (at most ``room``,
        and ``RESYNC_MAX`` a pass) are to be checked, as OpenAI's predicted outputs pick the
        prediction up again after an edit."""
        gen = self.generated
        if not self.draft or self.checking or len(gen) < RESYNC_GRAM or room < 2:
            return
        if self.grams is None:
            self.grams = {}
            for at in range(len(self.draft) - RESYNC_GRAM + 1):
                self.grams.setdefault(tuple(self.draft[at:at + RESYNC_GRAM]), []).append(at)
        places = self.grams.get(tuple(gen[-RESYNC_GRAM:]), ())
        at = next((a for a in places if a + RESYNC_GRAM > self.aligned), None)  # (a run may end past the last check)
        if at is None or at + RESYNC_GRAM >= len(self.draft):
            return
        self.aligned = at + RESYNC_GRAM
        self.checking = self.draft[self.aligned:self.aligned + min(room, RESYNC_MAX)]

    @property
    def holds_text(self) -> bool:
        """Its text waits for the end: the reply is read whole and its first text went out (the
        consumer times the first token by it), so each step's text need not cross to the loop."""
        return not self.req.stream and self.emitted_chars > 0

    def take_logprobs(self) -> list[TokenLogprob] | None:
        if self.params.logprobs is None:
            return None
        taken, self.logprobs = self.logprobs, []
        return taken

    @property
    def stack(self) -> AdapterStackSpec:
        return self.req.adapters

    @property
    def key(self) -> StackKey:
        return stack_key(self.req.adapters)

    def row(self) -> Row:
        """This sequence as the scheduler sees it now."""
        ctx = self.req.ctx
        return Row(self.arrival, self.req.priority, self.key, ctx.must_pause(), ctx.cancelled, bool(self.generated))

    @property
    def generated(self) -> list[int]:
        return self.ids[self.prompt_len :]


@dataclass
class _Preparing:
    """A request's images being made into its prompt (``ChatWorker._vision_prompt``)."""

    images: tuple[bytes, ...]  # held, so that their ids name them while the entry lives
    messages: list[dict]
    task: asyncio.Future
    waiting: int = 0


def _prepare(processor, req: ChatRequest, context_length: int) -> tuple[list[int], dict, str]:
    ids, vision = chat_prompt.vision_inputs(processor, req, context_length)
    return ids, vision, req.ctx.prompt_thinking


@dataclass
class _Batch:
    """The live sequences and their shared, left-padded KV cache."""

    seqs: list[_Seq] = field(default_factory=list)
    cache: object | None = None
    mask: torch.Tensor | None = None  # [B, T] 1 = real token, 0 = left padding


class ChatWorker(ThreadWorker):
    """A transformers chat model with a continuous-batching engine thread."""

    kind = "chat"

    def __init__(self, spec: ModelSpec, max_num_seqs: int = 8) -> None:
        self.spec = spec
        self.max_num_seqs = max_num_seqs  # rows decoded together in one step (vLLM's name)
        self.model: torch.nn.Module | None = None
        self.tokenizer = None
        self.processor = None  # a vision-language model's (images and text into prompt ids and pixel values)
        self.device = torch.device("cpu")
        self.clock = time.perf_counter  # times forward passes for GPU-seconds (a test gives its worker its own)
        self._inbox: queue.Queue[_Seq | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._waiting: list[_Seq] = []  # new sequences, and paused ones with their tokens
        self.steps = 0  # decode steps run (forward passes over the batch)
        self.checks = 0  # re-sync passes run (a row's predicted tokens checked after its reply left them)
        self.max_rows_seen = 0  # widest batch decoded in one step
        self.step_log: list[tuple[int, ...]] = []  # recent decode steps: the tier rank of each row in it
        self._arrivals = itertools.count()
        self.adapter_stack: AdapterStack | None = None  # merges adapter stacks into self.model
        self.stack_key: StackKey = ()  # the stack merged into the weights now; () = the base model
        self.stack_merges = 0  # stack switches that merged adapters (AdapterStack.apply calls)
        self._grammars: Grammars | None = None  # built on the first constrained request
        self._eos: set[int] = set()
        self._yielding: list[_Seq] | None = None  # rows of the forward pass running now, when it may stop at a pause order
        # read from the model's config once, at load: every request checks its prompt and its logit bias against them
        self.context_length = 0
        self.vocab_size = 0
        self._last_logits: dict[str, int] = {}  # the forward's argument that keeps the last place's logits only
        self._vocab: Vocabulary | None = None  # set at load
        self._streams = False  # set at load (``_text``)
        self._step_events: dict | None = None  # a decode step's events by loop, sent at its end (``_send``)
        # images being prepared, by the request's images and messages (``_vision_prompt``): the n choices
        # of one request share them; an entry lives while a request waits on it
        self._preparing: dict[tuple[int, int], _Preparing] = {}

    # -- residency -------------------------------------------------------------------------
    def load(self, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

        self.device = device
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        if folder_reads_images(self.spec.path):  # a vision-language model: its processor, and the image-text class
            if _uses_mrope(json.loads((Path(self.spec.path) / "config.json").read_text())):
                raise ValueError(f"{self.spec.name}: its positions depend on its images (M-RoPE, as Qwen2-VL's), "
                                 "which this engine's decode steps do not compute; serve it with another engine")
            self.processor = AutoProcessor.from_pretrained(self.spec.path)
            self.tokenizer = self.processor.tokenizer
            model = AutoModelForImageTextToText.from_pretrained(self.spec.path, dtype=dtype)
        else:
            self.processor = None
            self.tokenizer = AutoTokenizer.from_pretrained(self.spec.path)
            model = AutoModelForCausalLM.from_pretrained(self.spec.path, dtype=dtype)
        self.model = model.to(device).eval()
        # a prefill needs the logits of its last place only (but for prompt logprobs): on a model
        # that can keep just those, the LM head skips the others, a prompt x vocabulary product
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters \
            else {}
        self._eos = _eos_ids(self.model, self.tokenizer)
        self._think_end = chat_prompt.think_end_id(self.tokenizer)
        self.context_length = int(getattr(self.model.config.get_text_config(), "max_position_embeddings", 2048))
        self.vocab_size = int(self.model.config.get_text_config().vocab_size)
        self._grammars = None
        self._vocab = Vocabulary(self.tokenizer)  # each token's text and bytes, for logprobs
        # a reply's text decoded token by token (``_text``) where that gives the whole decode's text
        self._streams = (DecodeStream is not None and hasattr(self.tokenizer, "backend_tokenizer")
                         and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False))
        # pristine copies in host memory on CUDA: merging costs no device memory the arbiter did not count
        self.adapter_stack = AdapterStack(self.model, offload=device.type == "cuda")
        for layer in _decoder_layers(self.model):
            layer.register_forward_pre_hook(self._yield_between_layers)
        self.stack_key = ()
        sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name=f"chat:{self.spec.name}", daemon=True)
        self._thread.start()

    def unload(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join()
            self._thread = None
        self.model = None
        self.adapter_stack = None

    def modules(self) -> list[torch.nn.Module]:
        return [self.model] if self.model is not None else []

    @classmethod
    def describe(cls, spec: ModelSpec) -> ModelInfo:
        return ModelInfo(context_length=folder_context_length(spec.path), images=folder_reads_images(spec.path))

    # -- requests ----------------------------------------------------------------------------
    def encode(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return chat_prompt.encode(self.tokenizer, messages, tools)

    async def _vision_prompt(self, req: ChatRequest) -> tuple[list[int], dict]:
        """``chat_prompt.vision_inputs`` of ``req``, off the loop (decoding the images and running
        the processor take a while: ~0.2 s for a 12-megapixel photo here). The n choices of one
        request (the same images and messages objects) share one preparation: each joins the one
        under way."""
        key = (id(req.images), id(req.messages))
        entry = self._preparing.get(key)
        if entry is None or entry.images is not req.images or entry.messages is not req.messages:
            task = asyncio.ensure_future(asyncio.to_thread(_prepare, self.processor, req, self.context_length))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read, if every waiter left
            entry = self._preparing[key] = _Preparing(req.images, req.messages, task)
        entry.waiting += 1
        try:
            ids, vision, thinking = await asyncio.shield(entry.task)
        finally:
            entry.waiting -= 1
            if entry.waiting == 0 and self._preparing.get(key) is entry:
                del self._preparing[key]
        req.ctx.prompt_thinking = thinking
        return list(ids), vision

    def _row_grammar(self, req: ChatRequest) -> RowGrammar | None:
        if req.params.grammar is None:
            return None
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size, sorted(self._eos))
        try:
            return self._grammars.row(req.params.grammar)
        except RuntimeError as exc:  # xgrammar's own check failed: the request's grammar, not the engine
            raise InvalidParam(f"the reply's grammar cannot be compiled for the model {self.spec.name}: "
                               f"{xgrammar_reason(exc)}", req.params.grammar_param) from None

    async def chat(self, req: ChatRequest) -> AsyncIterator[ChatEvent]:
        """Stream the reply to ``req``. Closing the iterator cancels the work."""
        vision = None
        if not req.images:
            ids = await chat_prompt.prompt_ids(self.tokenizer, req, self.context_length)
        elif self.processor is None:
            raise InvalidParam(f"the model {self.spec.name} reads text only: it takes no image parts", "messages")
        else:
            ids, vision = await self._vision_prompt(req)
            req.params = chat_prompt.fit_context(req.params, len(ids), self.context_length)  # (n choices share it)
        check_token_ids(req.params, self.vocab_size)
        req.ctx.prompt_tokens = len(ids)
        # compiling a grammar may take a while (off the loop); most requests have none
        grammar = None if req.params.grammar is None else await asyncio.to_thread(self._row_grammar, req)
        if req.params.logprobs is not None or req.params.prompt_logprobs is not None:
            await asyncio.to_thread(self._vocab.read)  # once per tokenizer: not on the engine thread
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[ChatEvent | BaseException] = asyncio.Queue()
        gen = torch.Generator()
        gen.manual_seed(req.params.seed if req.params.seed is not None else secrets.randbits(63))
        seq = _Seq(
            ids=ids,
            prompt_len=len(ids),
            params=req.params,
            emit=lambda ev: self._send(loop, events, ev),
            req=req,
            generator=gen,
            arrival=next(self._arrivals),
            grammar=grammar,
            thinking=grammar is not None and req.reasoning and req.ctx.prompt_thinking != "closed",
            vision=vision,
            draft=self._draft(req, len(ids)),
            outside=self._outside(req.params),
            bad_words=bad_words_ids(self.tokenizer, req.params.bad_words) if req.params.bad_words else [],
            think=self._think_budget(req.params, ids),
        )
        if req.token_ids:
            seq.emit = _reporting_ids(seq, seq.emit)
        self._inbox.put(seq)
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, BaseException):
                    raise ev
                yield ev
                if isinstance(ev, ChatFinished):
                    return
        finally:
            req.ctx.cancel()  # no-op when finished; stops the row when the consumer left early

    def _draft(self, req: ChatRequest, prompt_len: int) -> list[int]:
        """The prediction's tokens the first prefill checks: no more than the reply may have, and
        within the context after the prompt (none for a prompt whose every place is scored)."""
        if not req.prediction or req.params.prompt_logprobs is not None:
            return []
        room = min(req.params.max_tokens, self.context_length - prompt_len) - 1  # the pass samples one more
        return self.tokenizer.encode(req.prediction, add_special_tokens=False)[: max(room, 0)]

    # -- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        batch = _Batch()
        while True:
            # a running batch only glances at the inbox; with every row paused, a new arrival
            # (the request they yield to) wakes the thread at once, else it looks again shortly
            timeout = 0.0 if batch.seqs else _PAUSED_POLL_S if self._waiting else None
            try:
                item = self._inbox.get(block=timeout != 0.0, timeout=timeout)
            except queue.Empty:
                item = False
            if item is None:
                self._fail_all(batch, Cancelled("model unloaded"))
                return
            try:
                if item is not False:
                    self._waiting.append(item)
                self._admit(batch)
                if batch.seqs and not self._yielded(batch):
                    self._decode_step(batch)
            except Exception as exc:  # noqa: BLE001 - delivered to every caller, engine survives
                self._fail_all(batch, exc)
                batch = _Batch()

    def _fail_all(self, batch: _Batch, exc: BaseException) -> None:
        for seq in batch.seqs + self._waiting:
            seq.emit(exc)
        batch.seqs.clear()
        self._waiting.clear()

    def _admit(self, batch: _Batch) -> None:
        """Drain the inbox, then carry out the scheduler's plan: forget cancelled rows, move paused
        rows out of the batch, switch the adapter stack, prefill the admitted rows."""
        self._drain_inbox()
        view = EngineView(self.stack_key, tuple(s.row() for s in batch.seqs),
                          tuple(s.row() for s in self._waiting), self.max_num_seqs)
        plan = plan_step(view)
        self._waiting = [seq for seq in self._waiting if seq.arrival not in plan.forget]
        if plan.pause:
            self._waiting += [seq for seq in batch.seqs if seq.arrival in plan.pause]
            _select(batch, [i for i, seq in enumerate(batch.seqs) if seq.arrival not in plan.pause])
        if plan.switch_to is not None:
            target = next(seq for seq in self._waiting if seq.key == plan.switch_to)
            if not self._switch_stack(target):
                return
        waiting = {seq.arrival: seq for seq in self._waiting}
        admitted = [waiting[arrival] for arrival in plan.admit]
        for rows in prefill_passes([Prefill(s.arrival, len(s.ids), _plain(s)) for s in admitted]):
            # a pause ordered while earlier rows prefilled holds the rows it reaches
            going = [waiting[arrival] for arrival in rows if not waiting[arrival].req.ctx.must_pause()]
            if len(going) > 1:
                self._prefill_together(batch, going)
            elif going:
                self._prefill_into(batch, going[0])

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is None:  # unload: left for the loop to see
                self._inbox.put(None)
                return
            self._waiting.append(item)

    def _switch_stack(self, seq: _Seq) -> bool:
        """Make the weights serve ``seq``'s adapter stack (only while no row is in the batch). On
        failure the pristine weights are back (``AdapterStack.switch``) and every waiting row that
        wants that stack gets the error."""
        self.stack_key = ()  # what a failed switch leaves: the pristine weights
        try:
            self.adapter_stack.switch(seq.stack)
        except Exception as exc:  # noqa: BLE001 - a bad stack fails its rows, not the engine
            names = ", ".join(name for name, _ in seq.key)
            why = f"adapter stack [{names}] cannot be merged into {self.spec.name}: {exc}"
            # weights that fold the factors to inf are the request's: a 400, as vLLM's engine refuses them
            error = ValueError(why) if isinstance(exc, NonFiniteFactors) else AdapterStackFailed(why)
            for other in [s for s in self._waiting if s.key == seq.key]:
                other.emit(error)
                self._waiting.remove(other)
            return False
        self.stack_key = seq.key
        self.stack_merges += bool(seq.stack)
        return True

    @torch.inference_mode()
    def _prefill_into(self, batch: _Batch, seq: _Seq) -> None:
        """Prefill a waiting row into the batch (it leaves ``_waiting``), unless a pause order
        stops it between two layers: then it stays waiting, as it was."""
        from transformers import DynamicCache

        fresh = seq.ids[:-1] if seq.generated else list(seq.ids)
        draft = [] if seq.generated else seq.draft  # a new sequence's prediction rides its prefill
        cache = DynamicCache()
        ids = torch.tensor([fresh + draft], device=self.device)
        self._yielding = [seq] if seq.req.ctx.pause_check is not None else None
        started = self.clock()
        every_place = not seq.generated and seq.params.prompt_logprobs is not None
        kept = {name: len(draft) + 1 for name in self._last_logits}  # the places whose next token is sampled
        try:
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, **self._vision(seq),
                             **({} if every_place else kept))
        except _Yield:
            self._charge([seq], started)
            return
        finally:
            self._yielding = None
        self._charge([seq], started)
        self._waiting.remove(seq)
        cached = len(fresh)
        if not seq.generated:  # a new sequence: its first token comes from the prefill
            if every_place:
                seq.emit(TextDelta("", None, self._prompt_logprobs(out.logits[0], fresh, seq.params.prompt_logprobs)))
            if seq.params.max_tokens == 0:  # the prompt scored, nothing to generate
                seq.done = True
                seq.emit(ChatFinished("length", seq.prompt_len, 0))
                return
            logits = out.logits[0, -(len(draft) + 1):]
            for place, predicted in enumerate([*draft, None]):
                # the token sampled here is the reply's own: sampling place by place, each given the
                # tokens before it, is sampling the reply. While it is the predicted one, the next
                # place's logits (computed with it) are the reply's next; the first other token
                # ends the check, and the cache keeps the places before it
                if self._sample_or_fail(seq, logits[place]):
                    return
                if seq.ids[-1] != predicted:
                    break
                cached += 1
                seq.accepted += 1
            seq.aligned = seq.accepted
            if cached < len(fresh) + len(draft):  # the places after the first other token go
                out.past_key_values.crop(cached - len(fresh) - len(draft))
        _merge(batch, _row(seq, out.past_key_values, cached, self.device))

    @torch.inference_mode()
    def _prefill_together(self, batch: _Batch, seqs: list[_Seq]) -> None:
        """Prefill rows that may share a pass (``_plain``) in one forward pass, left-padded to the
        longest as a decode step's rows are, and append to the batch those whose reply goes on: a
        new row's first token is sampled (the rows' first tokens go to the loop together), a row
        resuming after a pause re-prefills its tokens but the last, as alone. A pass of rows that
        all may pause stops between two layers at a pause order, as such a decode step does, and
        every row stays waiting."""
        from transformers import DynamicCache

        fresh = [s.ids[:-1] if s.generated else s.ids for s in seqs]
        new = [not s.generated for s in seqs]
        width = max(map(len, fresh))
        ids = torch.tensor([[0] * (width - len(f)) + f for f in fresh], device=self.device)
        mask = torch.tensor([[0] * (width - len(f)) + [1] * len(f) for f in fresh], device=self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        self._yielding = seqs if all(s.req.ctx.pause_check is not None for s in seqs) else None
        started = self.clock()
        try:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             past_key_values=DynamicCache(), use_cache=True, **{name: 1 for name in self._last_logits})
        except _Yield:
            self._charge(seqs, started)
            return
        finally:
            self._yielding = None
        self._charge(seqs, started)
        for seq in seqs:
            self._waiting.remove(seq)
        self._step_events = {}
        try:
            going = [i for i, seq in enumerate(seqs) if not new[i] or not self._sample_or_fail(seq, out.logits[i, -1])]
        finally:
            held, self._step_events = self._step_events, None
            for loop, items in held.items():
                loop.call_soon_threadsafe(_deliver, items)
        if going:
            group = _Batch(list(seqs), out.past_key_values, mask)
            if len(going) < len(seqs):
                _select(group, going)
            _merge(batch, group)

    def _vision(self, seq: _Seq) -> dict[str, torch.Tensor]:
        """The vision tower's inputs of ``seq``'s prompt on the model's device (pixels in its
        dtype): every prefill of the row takes them, a re-prefill after a pause too, since its
        image tokens are in the prompt again; {} for a text-only prompt."""
        if seq.vision is None:
            return {}
        dtype = self.model.dtype
        return {k: v.to(self.device, dtype=dtype) if v.is_floating_point() else v.to(self.device)
                for k, v in seq.vision.items()}

    def _charge(self, seqs: list[_Seq], started: float) -> None:
        """Share the forward pass that began at ``started`` among the rows it computed, before any
        of them can finish (their GPU-seconds are read when they do)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        share = (self.clock() - started) / len(seqs)
        for seq in seqs:
            ctx = seq.req.ctx
            ctx.gpu_s = (ctx.gpu_s or 0.0) + share

    def _send(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue, ev: object) -> None:
        """(engine thread) Hand ``ev`` to its request's loop: at once, or with the rest of a decode
        step's events (``_decode_step``), one wake-up of the loop for them all."""
        if self._step_events is None:
            loop.call_soon_threadsafe(events.put_nowait, ev)
        else:
            self._step_events.setdefault(loop, []).append((events, ev))

    @torch.inference_mode()
    def _decode_step(self, batch: _Batch) -> None:
        """One decode step of the batch; the rows' events go to the loop together at its end."""
        self._step_events = {}
        try:
            self._decode_rows(batch)
            if any(s.checking for s in batch.seqs):  # (a re-sync: rare; most steps skip it)
                self._check_predictions(batch)
        finally:
            held, self._step_events = self._step_events, None
            for loop, items in held.items():
                loop.call_soon_threadsafe(_deliver, items)

    def _decode_rows(self, batch: _Batch) -> None:
        rows = len(batch.seqs)
        self.max_rows_seen = max(self.max_rows_seen, rows)
        last = torch.tensor([[s.ids[-1]] for s in batch.seqs], device=self.device)
        mask = torch.cat([batch.mask, torch.ones(rows, 1, dtype=batch.mask.dtype, device=self.device)], 1)
        positions = (mask.sum(1, keepdim=True) - 1).long()
        # a step of rows that all may pause (batch work) stops where a pause order finds it
        pausable = all(s.req.ctx.pause_check is not None for s in batch.seqs)
        self._yielding = batch.seqs if pausable else None
        started = self.clock()
        try:
            out = self.model(
                input_ids=last,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=batch.cache,
                use_cache=True,
            )
        except _Yield:  # between two layers: the cache is half a step on, so it goes with the rows
            self._charge(batch.seqs, started)
            self._pause_all(batch)
            return
        finally:
            self._yielding = None
        self._charge(batch.seqs, started)
        batch.cache, batch.mask = out.past_key_values, mask
        self.steps += 1
        self.step_log.append(tuple(s.req.priority for s in batch.seqs))
        if len(self.step_log) > _STEP_LOG:
            del self.step_log[: _STEP_LOG // 2]
        keep = []
        for i, seq in enumerate(batch.seqs):
            if pausable and _must_yield(batch.seqs):  # rows not sampled yet keep their last token to feed
                self._waiting += [batch.seqs[j] for j in keep] + batch.seqs[i:]
                _select(batch, [])
                return
            seq.req.ctx.steps += 1
            if seq.req.ctx.cancelled:
                continue
            if self._sample_or_fail(seq, out.logits[i, -1]):
                continue
            if seq.draft:
                seq.resync(min(seq.params.max_tokens - len(seq.generated), self.context_length - len(seq.ids)) - 1)
            keep.append(i)
        if len(keep) < rows:
            _select(batch, keep)

    def _check_predictions(self, batch: _Batch) -> None:
        """Each row whose reply picked its prediction up again (``_Seq.resync``) checks the
        predicted tokens in one pass of its own: its cache taken out of the batch, its last token
        and the predicted ones fed, sampled place by place as the prefill's check does (each kept
        token a decode step not run), the cache cut after the first other token, and the row
        merged back. A batch row whose pause is ordered does not check (it yields first)."""
        from transformers import DynamicCache

        for seq in [s for s in batch.seqs if s.checking]:
            draft, seq.checking = seq.checking, []
            if seq.req.ctx.cancelled or (seq.req.ctx.pause_check is not None and _must_yield([seq])):
                continue
            i = batch.seqs.index(seq)
            first = int(batch.mask[i].nonzero()[0])  # the row's left padding ends here
            cache = DynamicCache()
            for n, layer in enumerate(_layers(batch.cache)):
                cache.update(layer.keys[i:i + 1, :, first:], layer.values[i:i + 1, :, first:], n)
            length = batch.mask.shape[1] - first
            _select(batch, [j for j in range(len(batch.seqs)) if j != i])
            ids = torch.tensor([[seq.ids[-1], *draft]], device=self.device)
            started = self.clock()
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                             attention_mask=torch.ones(1, length + len(ids[0]), dtype=torch.long, device=self.device),
                             position_ids=torch.arange(length, length + len(ids[0]), device=self.device)[None])
            self._charge([seq], started)
            self.checks += 1
            cached = length + 1  # the last token is in the cache now
            for place, predicted in enumerate([*draft, None]):
                if self._sample_or_fail(seq, out.logits[0, place]):
                    break
                if seq.ids[-1] != predicted:
                    if cached < length + 1 + len(draft):  # the places after the first other token go
                        out.past_key_values.crop(cached - length - 1 - len(draft))
                    _merge(batch, _row(seq, out.past_key_values, cached, self.device))
                    break
                cached += 1
                seq.accepted += 1
                seq.aligned += 1

    def _yielded(self, batch: _Batch) -> bool:
        """Pause the whole batch if it is batch work whose pause was ordered after the plan (while
        rows prefilled): the next step would be one too many."""
        if not all(s.req.ctx.pause_check is not None for s in batch.seqs) or not _must_yield(batch.seqs):
            return False
        self._pause_all(batch)
        return True

    def _pause_all(self, batch: _Batch) -> None:
        """Every row leaves the batch keeping its tokens (they re-prefill when the pause lifts)."""
        self._waiting += batch.seqs
        _select(batch, [])

    def _yield_between_layers(self, module: torch.nn.Module, args: object) -> None:
        """A decoder layer's forward pre-hook: stop a forward pass of batch rows alone when their
        pause was ordered (``_Yield``), so the request they yield to waits for a layer, not a step."""
        if self._yielding is not None and _must_yield(self._yielding):
            raise _Yield()

    def _sample_or_fail(self, seq: _Seq, logits: torch.Tensor) -> bool:
        """``_sample_and_emit``; a row whose own sampling fails gets the error and leaves (True),
        and the other rows go on. (Raised out of a prefill, the error reached no one: the row had
        left the waiting list and was not in the batch yet, so its request waited forever.)"""
        try:
            return self._sample_and_emit(seq, logits)
        except Exception as exc:  # noqa: BLE001 - delivered to the row's caller
            seq.emit(exc)
            return True

    def _sample_and_emit(self, seq: _Seq, logits: torch.Tensor) -> bool:
        """Sample one token, emit the new text; True when the sequence has finished."""
        p = seq.params
        ends = self._ends(p)
        short = p.min_tokens and len(seq.ids) - seq.prompt_len < p.min_tokens  # no slice per step when off
        logits = _process(logits.float().clone(), seq, ends if short else ())
        try:
            token = _sample(logits, p, seq.generator)
        except NoTokenLeft:
            raise _no_token_left(seq, bool(short)) from None
        except NonFiniteLogits:
            if not seq.key:
                raise NonFiniteLogits(f"{self.spec.name}'s output is not finite (NaN or inf logits)") from None
            names = ", ".join(name for name, _ in seq.key)
            raise ValueError(f"adapter stack [{names}] makes {self.spec.name}'s output non-finite (NaN or inf "
                             "logits): its factors are too large") from None
        if seq.grammar is not None and not seq.thinking:
            seq.grammar.accept(token)
        seq.ids.append(token)
        if seq.think is not None:
            seq.think.advance(seq.ids)
        gen = seq.generated
        if seq.thinking and "</think>" in self._decode(gen[-len("</think>"):]):  # a token holds a byte or more
            seq.thinking = False  # the answer starts: constrained from the next token
        seq.req.ctx.completion_tokens = len(gen)  # read from the loop if the reply is cut (an int: no lock)
        eos = token in ends
        if seq.params.logprobs is not None and not eos:
            seq.logprobs.append(self._logprob(logits, token, seq.params.logprobs, gen[-PIECES - 1 : -1]))
        reason = "stop" if eos else "length" if len(gen) >= seq.params.max_tokens else None
        if reason is None and seq.holds_text and not seq.params.stop:
            return False  # nothing to look for in the text, and none of it goes out before the end
        text = self._text(seq, len(gen) - 1 if eos and not p.include_stop_str else len(gen))
        cut = _first_stop(text, seq.params.stop)
        stop_reason = token if eos and token in p.stop_token_ids else None
        if cut is not None:
            stop_reason = stop_string_at(text, p.stop, cut)
            text, reason = text[:cut + len(stop_reason) * p.include_stop_str], "stop"
        # at the end, an undecodable tail is dropped rather than sent as U+FFFD, as vLLM does
        safe = len(text.rstrip("\ufffd")) if reason else _safe_prefix_len(text, seq.params.stop)
        if safe > seq.emitted_chars and (reason or not seq.holds_text):
            seq.emit(TextDelta(text[seq.emitted_chars : safe], seq.take_logprobs()))
            seq.emitted_chars = safe
        if reason is None:
            return False
        if seq.logprobs:  # tokens whose text was held back or dropped still report theirs
            seq.emit(TextDelta("", seq.take_logprobs()))
        seq.done = True
        think = chat_prompt.tokens_through_think_end(self._decode, gen, self._think_end) if seq.req.reasoning else None
        seq.emit(ChatFinished(reason, seq.prompt_len, len(gen), think, 0, *seq.prediction_counts(),
                              stop_reason=stop_reason))
        return True

    def _outside(self, p: ChatParams) -> torch.Tensor | None:
        """``allowed_token_ids`` as the mask of every other token (None: any token)."""
        if not p.allowed_token_ids:
            return None
        outside = torch.ones(self.vocab_size, dtype=torch.bool, device=self.device)
        outside[list(p.allowed_token_ids)] = False
        return outside

    def _think_budget(self, p: ChatParams, prompt: list[int]) -> ThinkBudget | None:
        """``thinking_token_budget``'s state for a reply to ``prompt`` (None: no budget)."""
        if p.thinking_budget is None:
            return None
        start, end = (tuple(self.tokenizer.encode(m, add_special_tokens=False)) for m in ("<think>", "</think>"))
        return ThinkBudget.after_prompt(start, end, p.thinking_budget, prompt)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _reply_text(self, ids: list[int], p: ChatParams) -> str:
        """The text of a reply's ``ids``, decoded whole, with the request's detokenizing options."""
        return self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens,
                                     spaces_between_special_tokens=p.spaces_between_special_tokens)

    def _ends(self, p: ChatParams) -> set[int] | frozenset[int]:
        """The tokens that end a row's reply: the model's end of text (unless ``ignore_eos``) and
        its ``stop_token_ids``."""
        if not p.stop_token_ids and not p.ignore_eos:
            return self._eos
        return (frozenset() if p.ignore_eos else frozenset(self._eos)) | frozenset(p.stop_token_ids)

    def _text(self, seq: _Seq, upto: int) -> str:
        """The text of the reply's first ``upto`` tokens. Decoded incrementally, each token once
        (tokenizers' ``DecodeStream``: it holds back a character whose bytes have not all come,
        as the whole decode's trailing U+FFFD is held back), where the tokenizer is a fast one that
        does not clean up spaces; the whole decode of every token so far each step (O(n) a
        step, 57 us for 400 tokens of tiny-chat) otherwise, or after the stream refuses a step."""
        if seq.detok is None and seq.decoded == 0 and self._streams:
            seq.detok = DecodeStream(skip_special_tokens=seq.params.skip_special_tokens)
        if seq.detok is None:
            return self._reply_text(seq.generated[:upto], seq.params)
        backend = self.tokenizer.backend_tokenizer
        try:
            for token in seq.generated[seq.decoded : upto]:
                piece = seq.detok.step(backend, token)
                seq.decoded += 1
                if piece:
                    seq.text += piece
        except Exception:  # noqa: BLE001 - a decode that does not extend its prefix: decode it whole from now on
            seq.detok = None
            return self._reply_text(seq.generated[:upto], seq.params)
        return seq.text

    def _prompt_logprobs(self, logits: torch.Tensor, ids: list[int], top: int) -> list[TokenLogprob | None]:
        """Each prompt token's log probability given the tokens before it (the model's raw
        logits: no bias, penalty or grammar applies to a prompt), with the ``top`` most likely
        tokens at its place; None for the first, which nothing precedes. A chunk of positions at
        a time, so the float32 copy stays small beside the logits."""
        vocab = self._vocab
        out: list[TokenLogprob | None] = [None]
        for start in range(0, len(ids) - 1, _PROMPT_CHUNK):
            end = min(start + _PROMPT_CHUNK, len(ids) - 1)  # the places that predict ids[start + 1 : end + 1]
            rows = torch.log_softmax(logits[start:end].float(), dim=-1)
            targets = torch.tensor(ids[start + 1 : end + 1], device=rows.device)
            picked = rows.gather(1, targets[:, None])
            ranks = ((rows > picked).sum(dim=-1) + 1).tolist()  # (1 + the tokens likelier than it)
            chosen = picked[:, 0].tolist()
            best = torch.topk(rows, min(top, rows.shape[-1])) if top else None
            for i, token in enumerate(targets.tolist()):
                at = start + i + 1  # its place: the tokens before it with entries of their own are its context
                before = ids[max(1, at - PIECES) : at]
                alternatives = () if best is None else tuple(
                    vocab.entry(t, v, rank=r + 1, before=before)
                    for r, (v, t) in enumerate(zip(best.values[i].tolist(), best.indices[i].tolist())))
                out.append(vocab.entry(token, chosen[i], alternatives, rank=ranks[i], before=before))
        return out

    def _logprob(self, logits: torch.Tensor, token: int, top: int, before: list[int]) -> TokenLogprob:
        """The sampled token's log probability under the processed logits, and the ``top`` most
        likely tokens' (those the grammar forbids are left out); their texts as after the reply's
        tokens ``before`` (``Vocabulary.text_after``: a piece of a character is "", as vLLM's)."""
        logprobs = torch.log_softmax(logits, dim=-1)
        vocab = self._vocab
        best = []
        if top:
            values, ids = torch.topk(logprobs, min(top, logprobs.numel()))
            best = [vocab.entry(int(i), float(v), before=before) for v, i in zip(values, ids) if torch.isfinite(v)]
        return vocab.entry(token, float(logprobs[token]), tuple(best), before=before)


# -- helpers: sampling, stop strings, cache surgery ----------------------------------------------


def check_token_ids(p: ChatParams, vocab_size: int) -> None:
    """Refuse a ``logit_bias``, ``stop_token_ids`` or ``allowed_token_ids`` naming a token outside
    the vocabulary (``InvalidParam``)."""
    for param, ids in (("logit_bias", p.logit_bias), ("stop_token_ids", p.stop_token_ids),
                       ("allowed_token_ids", p.allowed_token_ids)):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidParam(f"{param} names token {bad[0]}, outside this model's vocabulary "
                               f"(0..{vocab_size - 1})", param)


MAX_BAD_WORD_IDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS: token sequences after tokenizing


def bad_words_ids(tokenizer, words: Collection[str]) -> list[list[int]]:
    """The token sequences ``bad_words`` bars, as vLLM tokenizes them (``SamplingParams.
    update_from_tokenizer``): each word as it starts a text and, where that tokenizes to a
    different first token and as many tokens, after a space; a word that tokenizes to nothing, or
    more than ``MAX_BAD_WORD_IDS`` sequences, is an ``InvalidParam``."""
    out: list[list[int]] = []
    for word in words:
        for spaced in (False, True):
            ids = tokenizer.encode((" " if spaced else "") + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not spaced:
                    raise InvalidParam(f"bad_words entry {word[:40]!r} tokenizes to no token", "bad_words")
                continue
            if not spaced or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    if len(out) > MAX_BAD_WORD_IDS:
        raise InvalidParam(f"bad_words make {len(out)} token sequences, above {MAX_BAD_WORD_IDS}", "bad_words")
    return out


def _process(logits: torch.Tensor, seq: _Seq, barred: Collection[int] = ()) -> torch.Tensor:
    """The row's logits after its logit bias, penalties, grammar mask and token constraints (in
    place); ``barred``: tokens that may not come now (the ends of a reply shorter than its
    ``min_tokens``). A token its thinking budget forces is the only one left."""
    p = seq.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=logits.device)
        logits[ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)
    if p.repetition_penalty != 1.0:  # on the prompt's tokens and the reply's, as vLLM's (and transformers')
        seen = torch.unique(torch.tensor(seq.ids, device=logits.device))
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.generated:
        counts = torch.bincount(torch.tensor(seq.generated), minlength=logits.numel())[: logits.numel()]
        counts = counts.to(logits.device, logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if seq.grammar is not None and not seq.thinking:
        seq.grammar.mask(logits)
    if seq.outside is not None:  # allowed_token_ids: every other token barred
        logits.masked_fill_(seq.outside, float("-inf"))
    if seq.bad_words:
        made = len(seq.ids) - seq.prompt_len
        for *head, last in seq.bad_words:  # a word's last token, where the reply ends with the rest of it
            if len(head) <= made and (not head or seq.ids[-len(head):] == head):
                logits[last] = float("-inf")
    if barred:
        logits[torch.tensor(sorted(barred), device=logits.device)] = float("-inf")
    forced = seq.think.forced() if seq.think is not None else None
    if forced is not None:  # thinking_token_budget spent: </think>'s next token, whatever else holds
        logits.fill_(float("-inf"))
        logits[forced] = 0.0
    return logits


def folder_reads_images(path: Path) -> bool:
    """Whether a model folder holds a vision-language model: its ``config.json`` has a vision
    tower (``vision_config``: LLaVA and the like), loaded with its processor. Tested here on LLaVA
    (the demo's tiny-vlm); a model whose positions depend on the image (M-RoPE: Qwen2-VL and its
    successors) is refused at load, since the engine's decode steps count positions by tokens."""
    return "vision_config" in json.loads((Path(path) / "config.json").read_text())


def _uses_mrope(config: object) -> bool:
    """Whether a model's config (as JSON) has multimodal rotary positions (``mrope_section``)."""
    if isinstance(config, dict):
        return "mrope_section" in config or any(_uses_mrope(v) for v in config.values())
    return isinstance(config, list) and any(_uses_mrope(v) for v in config)


def folder_context_length(path: Path) -> int:
    """The context window a model folder's ``config.json`` declares (as ``context_length``)."""
    config = json.loads((Path(path) / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config.get("max_position_embeddings", 2048))


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                         "frequency_penalty")


def folder_sampling_defaults(path: Path) -> dict[str, float | int]:
    """The sampling fields a model folder's ``generation_config.json`` sets away from
    transformers' defaults, read as vLLM reads them (``ModelConfig.get_diff_sampling_param``
    under ``--generation-config auto``): what a request that leaves one out gets (Qwen3's
    temperature 0.6, top_k 20, ...), and its ``max_new_tokens`` as ``max_tokens``, the reply's
    length where a request sets none. Empty without the file."""
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(path).to_diff_dict()
    except OSError:  # no generation_config.json
        return {}
    out = {k: diff[k] for k in SAMPLING_DEFAULT_KEYS if diff.get(k) is not None}
    if diff.get("max_new_tokens") is not None:
        out["max_tokens"] = int(diff["max_new_tokens"])
    return out


Emit = Callable[[ChatEvent | BaseException], None]


def _reporting_ids(seq: _Seq, emit: Emit) -> Emit:
    """(engine thread) ``emit`` for a row whose request asked for its token ids: each TextDelta
    carries the generated tokens not yet reported, the first the prompt's too; tokens after the
    last text (the end of text, a tail held back or cut by a stop string) go in one more before
    ChatFinished."""
    report = TokenReport(seq.ids[:seq.prompt_len], seq.ids, seq.prompt_len)

    def send(ev: ChatEvent | BaseException) -> None:
        if isinstance(ev, ChatFinished) and report.owed():
            emit(report.attach(TextDelta("")))
        emit(report.attach(ev) if isinstance(ev, TextDelta) else ev)

    return send


_MIN_TEMPERATURE = 0.01  # a temperature above 0 and below this samples at this, as vLLM does (its
# _MAX_TEMP): dividing by a tiny one overflows the logits (1e-45 is 0 in float32), and softmax gives NaN


def _sample(logits: torch.Tensor, params: ChatParams, generator: torch.Generator) -> int:
    """One token from the processed ``logits``: the likeliest at temperature 0, else a draw from
    ``_probs``. ``NonFiniteLogits`` where they hold NaN or +inf (-inf is a token masked out),
    ``NoTokenLeft`` where every token is masked out."""
    top, best = torch.max(logits, 0)  # NaN is the max where there is one
    if not float(top) < float("inf"):
        raise NonFiniteLogits()
    if float(top) == float("-inf"):
        raise NoTokenLeft()
    if params.temperature <= 0:
        return int(best)
    return int(torch.multinomial(_probs(logits, params).cpu(), 1, generator=generator))


def _no_token_left(seq: _Seq, barred: bool) -> InvalidParam:
    """The 400 for a row whose constraints leave no token (``NoTokenLeft``), naming the field
    that barred the last ones: the end ``min_tokens`` or ``ignore_eos`` keeps from a finished
    grammar, else the tokens ``allowed_token_ids`` or ``bad_words`` take from it."""
    p, made = seq.params, len(seq.ids) - seq.prompt_len
    if barred:
        param, why = "min_tokens", f"min_tokens ({p.min_tokens}) bars the reply's end"
    elif p.ignore_eos:
        param, why = "ignore_eos", "ignore_eos makes the end the reply's grammar allows no end"
    elif seq.outside is not None:
        param, why = "allowed_token_ids", "allowed_token_ids allow none of the tokens the reply's grammar allows"
    elif seq.bad_words:
        param, why = "bad_words", "bad_words bar every token the reply's grammar allows"
    else:
        param, why = p.grammar_param, "the reply's grammar allows none"
    return InvalidParam(f"no token may come after the reply's {made} tokens: {why} (the request's constraints "
                        "cannot all hold)", param)


def _probs(logits: torch.Tensor, params: ChatParams) -> torch.Tensor:
    """The distribution a token is drawn from: the logits after the temperature, then min_p,
    top_k and top_p, in vLLM's order (each on what the one before left; the kept tokens'
    probabilities in the proportions they had)."""
    logits = logits / max(params.temperature, _MIN_TEMPERATURE)
    if params.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if 0 < params.top_k < logits.numel():
        logits = logits.masked_fill(logits < torch.topk(logits, params.top_k).values[-1], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return probs


def _eos_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    ids = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    return set(ids) if isinstance(ids, list) else {ids}


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    """(event loop) A decode step's events, each to its request's queue, in the order sent."""
    for events, ev in items:
        events.put_nowait(ev)


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def stop_string_at(text: str, stops: list[str], cut: int) -> str:
    """The stop string that ``_first_stop`` found at ``cut`` (the first listed, where several start there)."""
    return next(s for s in stops if s and text.startswith(s, cut))


def _safe_prefix_len(text: str, stops: list[str]) -> int:
    """How much of ``text`` can be sent: hold back a tail that may start a stop string, and an
    incomplete UTF-8 character."""
    n = len(text.rstrip("\ufffd"))  # undecodable bytes may be the start of a character
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, n), 0, -1):
            if text[:n].endswith(s[:k]):
                hold = max(hold, k)
                break
    return n - hold


def _must_yield(seqs: list[_Seq]) -> bool:
    """Every row is batch work whose pause was ordered (the flag only; ``must_pause`` starts the
    paused clock when the plan moves the row)."""
    return all(s.req.ctx.pause_check() for s in seqs)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's stack of decoder layers (where a step can stop); [] when it has none we know."""
    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def _layers(cache) -> list:
    return list(cache.layers)


def _plain(seq: _Seq) -> bool:
    """Whether ``seq``'s prefill may share a forward pass with others (``chat_schedule``): a prompt
    of text alone, new (to be answered, with no prediction to check and no prompt to score) or
    resuming after a pause (its tokens re-prefilled)."""
    if seq.vision is not None:
        return False
    return bool(seq.generated) or (not seq.draft and seq.params.max_tokens > 0 and seq.params.prompt_logprobs is None)


def _row(seq: _Seq, cache, length: int, device: torch.device) -> _Batch:
    """One prefilled row with its cache, ``length`` places, none of them padding."""
    return _Batch([seq], cache, torch.ones(1, length, dtype=torch.long, device=device))


def _merge(batch: _Batch, rows: _Batch) -> None:
    """Append prefilled rows (their own cache and mask) to the batch, left-padding whichever side
    is shorter."""
    if not batch.seqs:
        batch.seqs, batch.cache, batch.mask = list(rows.seqs), rows.cache, rows.mask
        return
    width = max(batch.mask.shape[1], rows.mask.shape[1])
    for old, new in zip(_layers(batch.cache), _layers(rows.cache)):
        old.keys = torch.cat([_pad_left(old.keys, width), _pad_left(new.keys, width)], 0)
        old.values = torch.cat([_pad_left(old.values, width), _pad_left(new.values, width)], 0)
    batch.mask = torch.cat([_pad_left_2d(batch.mask, width), _pad_left_2d(rows.mask, width)], 0)
    batch.seqs += rows.seqs


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - t.shape[2]
    if pad == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], pad, t.shape[3]), t], 2)


def _pad_left_2d(m: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - m.shape[1]
    return m if pad == 0 else torch.cat([m.new_zeros(m.shape[0], pad), m], 1)


def _select(batch: _Batch, keep: list[int]) -> None:
    """Keep only rows ``keep`` and drop columns that are padding in every remaining row."""
    batch.seqs = [batch.seqs[i] for i in keep]
    if not keep:
        batch.cache, batch.mask = None, None
        return
    index = torch.tensor(keep, device=batch.mask.device)
    mask = batch.mask.index_select(0, index)
    first = int((mask.sum(0) > 0).nonzero()[0])
    batch.mask = mask[:, first:]
    for layer in _layers(batch.cache):
        layer.keys = layer.keys.index_select(0, index)[:, :, first:]
        layer.values = layer.values.index_select(0, index)[:, :, first:]
