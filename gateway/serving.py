"""The one path every model request takes, for HTTP and batch alike: ``async with Serving(...)``.

A ``Serving`` owns, for one request:

* the gate slot plus the model lease (``Services.hold``: 429 / 503), given back together on exit;
* cancellation: ``gone`` is a :class:`Gone` signal set when the client leaves (None for a batch
  line, which is cancelled as a task). Waiting for the slot or for a step then stops with
  ``ClientGone``, and work on a model thread stops at its next step boundary;
* out-of-memory relief: ``step`` runs one attempt of the model work; on ``torch.OutOfMemoryError``
  the arbiter evicts the least valuable model this requester may evict, the eviction finishes,
  and the work is tried once more; a second failure (or nothing to evict) is a 503;
* a model that fails under it (``WorkerFailed``: its engine died): a 503 ``model_failed``, and the
  arbiter drops the worker as the lease ends, so the next request gets a fresh one;
* the outcome for the admission cost model: the service time is learned only when the request
  completed (the block ended without an exception) and none of its work was ever paused. A cut
  stream, a disconnect, an error or batch work that waited at a pause gate teach it nothing;
* the latency metric of its endpoint, and the latency the gate's SLO guard judges its tier by:
  time to first token for streamed text (``first_token``), else the whole request when it
  completed;
* the key's account (``gateway.accounts``): its model allow-list and limits before the slot is
  taken (404 / 429), and its usage (``usage``, which the core fills in: tokens, images, audio;
  the block adds GPU-seconds and swap seconds) written durably when the block ends, which every
  core arranges to be before the response's last byte. A reply cut before its end (the client
  left, or the server cancelled it) is metered by the tokens its engine had counted by then
  (``StepContext.prompt_tokens`` and ``completion_tokens``). A batch line's block that is cut is
  not metered at all: the line runs again (handed back at a drain) or never (its batch was
  cancelled), and its usage is the one of the attempt that ends, under the same metering ids; nor
  is a background response's block that a shutdown cuts (``Gone.hand_back``): it runs again, and
  the attempt that ends is metered; nor a block whose input the model's worker turned down before
  any work (``refused``: a 400, which refused requests are not usage);
* the request log's figures (``gateway.request_log``): the model, the queue wait at the gate, the
  wait for the model's load, the service time and (``count_tokens``) the tokens.

A request that runs as several blocks (a chat request's ``n`` choices, a completion's prompts) is
one request to its key's account: a :class:`Joint` admits it once, before any of its blocks takes
a slot, and writes its usage once, when its last block ends.

Endpoints build on it (``gateway.chat.serve_chat``, ``gateway.images.serve_images``, ...) and
HTTP handlers only render what those return.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, Generic, TypeVar

import anyio
import torch

from accounts.rates import Ask
from accounts.usage import Usage
from arbiter.residency import without_folder
from gateway.accounts import Admission
from gateway.auth import Caller
from gateway.errors import APIError, bad_request
from gateway.request_log import current as current_request
from gateway.service import ClientGone, Held, Services
from workers.base import Cancelled, ModelSpec, StepContext
from workers.worker import WorkerFailed

log = logging.getLogger("tiergate")

T = TypeVar("T")
R = TypeVar("R")


class Gone:
    """A request's cancellation signal: ``set()`` when its client leaves, which cancels the tasks
    waiting in ``Serving.until_gone`` (no task per wait: a request awaits several steps).
    ``watched`` turns False once nothing will set it any more (a streamed response watches its
    connection itself), so waits stop registering with it."""

    def __init__(self) -> None:
        self.is_set = False
        self.watched = True
        self.handed_back = False  # set by a shutdown: the work runs again elsewhere (or after the restart)
        self.waiting: set[asyncio.Task] = set()  # tasks in until_gone now

    def set(self) -> None:
        if not self.is_set:
            self.is_set = True
            for task in self.waiting:
                task.cancel()

    def hand_back(self) -> None:
        """Set, for a shutdown: the work stops to run again from its stored request, so a block it
        cuts writes no usage (as a batch line's cut attempt does); the attempt that ends is metered."""
        self.handed_back = True
        self.set()


class Serving:
    """``async with Serving(svc, caller, model, units, endpoint, gone) as serving:`` holds a slot
    and a lease for the block; see the module's docstring."""

    def __init__(self, svc: Services, caller: Caller, model: str, units: float, endpoint: str,
                 gone: Gone | None, ask: Ask = Ask(), adapters: tuple[str, ...] = (), own_adapter: bool = False,
                 recorded: bool = True, joint: "Joint | None" = None, part: int = 0, said: int = 0,
                 within: bool = False) -> None:
        self.svc, self.caller, self.model, self.units, self.endpoint = svc, caller, model, units, endpoint
        self.adapters = adapters  # its adapter stack's names: the key's allow-list checks them
        self.own_adapter = own_adapter  # the request's ``model`` named the first
        self.lora_names = adapters if endpoint == "chat" else ()  # vllm:lora_requests_info counts LLM adapters
        self.gone = gone
        self.ask = ask  # what the request spends of its key's minute limits, as estimated now
        self.joint = joint  # the request this block is one of, admitted and metered as a whole (else None)
        self.part = part  # which of the joint request's prompts this block answers (each is counted once)
        self.said = said  # the prompt's last tokens are the reply so far (``ChatJob.said``): counted as output
        self.within = within  # a step of a request admitted already: not one more of ``concurrent`` (Accounts.admit)
        self.usage = Usage(requests=1)  # filled in by the core; GPU and swap seconds by the block
        self.arrived = time.monotonic()
        self._latency_reported = False  # to the gate's SLO guard: once per request
        self._first_at: float | None = None  # when the first token went out (text requests)
        self.held: Held | None = None
        self.contexts: list[StepContext] = []
        self._admission = None
        self._counted = False  # the core counted the reply's tokens (it ran to its end)
        self._refused = False  # the model's worker turned the input down before any work (``refused``)
        # the HTTP request's log record; None for a batch line, and for work done for a request's reply
        # after its own (``recorded`` False: a chat reply's speech), whose figures are not the request's
        self.record = current_request() if recorded else None

    @property
    def rank(self) -> int:
        return self.svc.tier_rank[self.caller.tier]

    @property
    def worker(self):
        assert self.held is not None, "use inside 'async with'"
        return self.held.lease.worker

    @property
    def paused(self) -> bool:
        return any(ctx.paused for ctx in self.contexts)

    def count_tokens(self, prompt: int, completion: int, cached: int = 0) -> None:
        """The request's tokens, for its usage and the request log (completions add up over a
        request's blocks); ``cached``, of the prompt's, those the engine's prefix cache served. The
        block's ``said`` tokens, at the prompt's end, move from the prompt to the completion."""
        self._counted = True
        if self.said:
            said = min(self.said, prompt)
            prompt, completion, cached = prompt - said, completion + said, min(cached, prompt - said)
        self.usage.input_tokens = prompt
        self.usage.cached_input_tokens = cached
        self.usage.output_tokens += completion
        if self.record is not None:
            self.record.prompt_tokens = prompt
            self.record.completion_tokens = (self.record.completion_tokens or 0) + completion

    def refused(self, message: str, param: str | None, code: str = "invalid_value") -> APIError:
        """The 400 for an input the model's worker turned down before doing any work (what the
        gateway could not check before the slot): the block writes no usage, as a request refused
        before its slot writes none, and the key's minute limits get back all but the request."""
        self._refused = True
        return bad_request(message, param, code)

    def first_token(self) -> float:
        """The time to first token (seconds since the request arrived), which the gate's SLO guard
        judges a text request by; the request's whole time is then not reported. Returns it."""
        self._first_at = time.monotonic()
        ttft = self._first_at - self.arrived
        if not self._latency_reported:
            self._latency_reported = True
            self.svc.gate.observe_latency(self.caller.tier, ttft)
        return ttft

    def context(self) -> StepContext:
        """A step context for work on the leased model (batch work carries its pause gate)."""
        assert self.held is not None, "use inside 'async with'"
        ctx = self.held.lease.context()
        self.contexts.append(ctx)
        return ctx

    async def __aenter__(self) -> "Serving":
        if self.record is not None:
            self.record.model = self.model
        accounts = self.svc.accounts
        if accounts is not None and self.joint is None:  # (a joint request was admitted as a whole)
            self._admission = await admitted(self.svc, self.caller, self.model, self.ask, self.adapters,
                                             self.own_adapter, self._gpu_estimate, self.within)
        lora = self.svc.metrics.lora
        lora.move(self.lora_names, None, lora.waiting)
        try:
            self.held = await self.until_gone(self.svc.hold(self.caller.tier, self.model, self.units))
        except BaseException:
            lora.move(self.lora_names, lora.waiting, None)
            if self.joint is not None:  # this block never ran; the request's last block gives the limits back
                with anyio.CancelScope(shield=True):
                    await self.joint.ended(None, part=self.part)
            elif self._admission is not None:  # refused or gone before any work: give the limits back
                with anyio.CancelScope(shield=True):
                    await accounts.finish(self.caller, self.model, self._admission, None)
            raise
        lora.move(self.lora_names, lora.waiting, lora.running)
        if self.record is not None:
            queued = self.held.ticket.queued_s
            self.record.queue_wait_s = queued
            self.record.load_wait_s = max(0.0, self.held.started - self.arrived - queued)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        held = self.held
        if held is None:
            return
        self.svc.metrics.lora.move(self.lora_names, self.svc.metrics.lora.running, None)
        completed = exc_type is None  # a cut stream ends with GeneratorExit or CancelledError here
        cut = exc_type is not None and issubclass(exc_type, _CUT)
        if cut and not self._counted:  # the tokens it cost until the cut, as its engine counted them
            prompt = max((ctx.prompt_tokens for ctx in self.contexts), default=0)
            completion = sum(ctx.completion_tokens for ctx in self.contexts)
            if prompt or completion:
                self.count_tokens(prompt, completion)
        service_s = time.monotonic() - held.started
        held.release(service_s if completed and not self.paused else None)
        if self.record is not None:
            self.record.service_s = service_s
            if self.usage.embedding_tokens:  # an embedding's input tokens are its prompt
                self.record.prompt_tokens = self.usage.embedding_tokens
        latency = time.monotonic() - self.arrived
        self.svc.metrics.observe(self.svc.metrics.latency, latency, self.caller.tier, self.endpoint)
        if completed and not self._latency_reported:
            self._latency_reported = True
            self.svc.gate.observe_latency(self.caller.tier, latency)
        u = self.usage
        if self.joint is None:  # (a joint request's tokens are counted once it ends, each prompt once)
            self.svc.metrics.count_tokens(self.model, self.caller.tier, u.input_tokens, u.cached_input_tokens,
                                          u.output_tokens, u.embedding_tokens)
        tokens = self.usage.output_tokens
        if completed and self._first_at is not None and tokens > 1:  # its mean time per later token
            self.svc.gate.observe_token_latency(self.caller.tier, (time.monotonic() - self._first_at) / (tokens - 1))
        if self.svc.accounts is not None or self.joint is not None:
            self.usage.gpu_seconds = self._gpu_seconds(service_s)
            self.usage.swap_seconds = held.lease.swap_s
            # a batch line's cut block, or a handed-back one's: the attempt that ends is metered (see above)
            again = cut and (self.caller.metering is not None or (self.gone is not None and self.gone.handed_back))
            if self.joint is not None:  # (its last block's write goes uncut: Joint._end)
                finish = self.joint.ended(None if self._refused else self.usage, again, self.part, self._refused)
            else:
                assert self.svc.accounts is not None
                usage = None if again or self._refused else self.usage
                finish = self.svc.accounts.finish(self.caller, self.model, self._admission, usage)
                if cut:  # its task may be cancelled again while it writes (a spoken reply's speech: ``uncut``)
                    finish = uncut(finish)
            if in_cancel_scope():
                with anyio.CancelScope(shield=True):  # a cut stream is metered too
                    await finish
            else:
                await finish
        if isinstance(exc, WorkerFailed):  # the arbiter dropped the worker as the lease ended: the next one is fresh
            raise model_failed(self.model, exc) from exc

    def _gpu_estimate(self) -> float:
        """What this block may cost of its key's GPU budget, held while it runs: the service time
        the gate's cost model predicts for its model and size (its prior before it has measured one)."""
        return self.svc.gate.costs.predict(self.model, self.units)

    def _gpu_seconds(self, service_s: float) -> float:
        """The device time this request cost: what an engine that shares its steps among rows
        charged it (``StepContext.gpu_s``), else its service time less the time it was paused."""
        charged = [ctx.gpu_s for ctx in self.contexts if ctx.gpu_s is not None]
        if charged:
            return sum(charged)
        return max(service_s - sum(ctx.paused_s for ctx in self.contexts), 0.0)

    async def step(self, attempt: Callable[[StepContext], Awaitable[T]], doing: str) -> T:
        """Run ``attempt`` (given a fresh step context) until it returns; after out of memory,
        relieve the device and run it once more. Cancelled work becomes ``ClientGone``."""
        for tries in (1, 2):
            try:
                return await self.until_gone(attempt(self.context()))
            except Cancelled:
                raise ClientGone() from None
            except torch.OutOfMemoryError as exc:
                if tries == 2 or not await self.svc.arbiter.relieve_oom(self.model, self.rank):
                    raise APIError(503, f"out of memory {doing} {self.model}: {exc}", "out_of_memory") from None
        raise AssertionError("unreachable")

    async def until_gone(self, work: Awaitable[T]) -> T:
        """Await ``work``, cancelling it if the client leaves first (then ``ClientGone``): the
        signal cancels this task while it waits here, and the cancellation becomes ``ClientGone``
        unless the task was also cancelled for another reason."""
        gone = self.gone
        if gone is None or not gone.watched:
            return await work
        if gone.is_set:
            getattr(work, "close", lambda: None)()  # never started: no 'never awaited' warning
            raise ClientGone()
        task = asyncio.current_task()
        gone.waiting.add(task)
        try:
            result = await work
        except asyncio.CancelledError:
            if gone.is_set and task.uncancel() == 0:
                raise ClientGone() from None
            raise
        finally:
            gone.waiting.discard(task)
        if gone.is_set:  # it finished just as the client left: give back what it holds
            task.uncancel()
            if isinstance(result, Held):
                result.release(None)
            raise ClientGone()
        return result


async def admitted(svc: Services, caller: Caller, model: str, ask: Ask, adapters: tuple[str, ...], own_adapter: bool,
                   gpu_s: Callable[[], float], within: bool = False) -> Admission | None:
    """``Accounts.admit``, its 429s (the key's own limits) counted with the tier's refusals."""
    assert svc.accounts is not None
    try:
        return await svc.accounts.admit(caller, model, ask, adapters, own_adapter, gpu_s, within)
    except APIError as exc:
        if exc.status == 429:
            svc.gate.key_refused(caller.tier)
        raise


class Joint:
    """One request that runs as several ``Serving`` blocks (a chat request's ``n`` choices, a
    completion's prompts times ``n``), to its key's account: ``serve`` admits it once, for the whole
    request, before any block takes a slot (one of ``requests_per_min``, one of ``concurrent``, and
    ``ask``: its prompts plus every choice's ``max_tokens``), so it is refused whole or not at all;
    its usage is written once, when its last block ends, or when the request ends for blocks that
    never started, with each of its prompts counted once (as the response's usage counts them), not
    once per choice. Each block still takes a gate slot of its own: the engine serves each choice
    as a row of its own."""

    def __init__(self, svc: Services, caller: Caller, model: str, ask: Ask, blocks: int, units: float,
                 adapters: tuple[str, ...] = (), own_adapter: bool = False) -> None:
        self.svc, self.caller, self.model, self.ask, self.units = svc, caller, model, ask, units
        self.adapters, self.own_adapter = adapters, own_adapter
        self.left = blocks  # blocks yet to end
        self.usage = Usage(requests=1)  # its blocks' usage, summed, but its prompts counted once
        self.prompts: dict[int, tuple[int, int]] = {}  # prompt (``Serving.part``) -> its tokens, cached tokens
        self.record = current_request()  # the HTTP request's log record (None for a batch line)
        self.ran = False  # a block got its slot: the request is usage
        self.again = False  # a block was cut to run again (see Serving.__aexit__): the attempt is not metered
        self.refused = False  # a block's input was turned down before any work (``Serving.refused``): a 400, not usage
        self.done = False
        self._admission = None

    async def serve(self, blocks: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
        """What ``blocks`` yields, once the request is admitted (a refusal is raised by the first
        ``__anext__``, before any block starts); its usage is written once they have all ended."""
        accounts = self.svc.accounts
        if accounts is not None:
            count = self.left  # each holds what one block of its size is predicted to cost of a GPU budget
            predicted = self.svc.gate.costs.predict
            self._admission = await admitted(self.svc, self.caller, self.model, self.ask, self.adapters,
                                             self.own_adapter, lambda: count * predicted(self.model, self.units))
        try:
            async with contextlib.aclosing(blocks):
                async for item in blocks:
                    yield item
        finally:
            await self._end()

    async def ended(self, usage: Usage | None, again: bool = False, part: int = 0, refused: bool = False) -> None:
        """A block ended (``usage`` None: before it got its slot, or ``refused``); the last one writes
        the request's usage, before its last delta goes out. One block refused makes the request a
        400 whose input was turned down before any work, so not usage (its other blocks cancelled)."""
        self.left -= 1
        self.refused |= refused
        if usage is not None:
            self.ran = True
            self.again |= again
            self._add(usage, part)
        if self.left == 0:
            await self._end()

    def _add(self, usage: Usage, part: int) -> None:
        """A block's usage into the request's: each of its choices has the whole prompt in its usage
        (as far as the engine read it, when cut), which the request counts once."""
        total = self.usage
        total.add(usage)
        total.requests = 1  # one request, however many blocks
        prompt, cached = self.prompts.get(part, (0, 0))
        self.prompts[part] = (max(prompt, usage.input_tokens), max(cached, usage.cached_input_tokens))
        total.input_tokens = sum(tokens for tokens, _ in self.prompts.values())
        total.cached_input_tokens = sum(cached for _, cached in self.prompts.values())

    async def _end(self) -> None:
        if self.done:
            return
        self.done = True
        u = self.usage
        if self.ran:
            self.svc.metrics.count_tokens(self.model, self.caller.tier, u.input_tokens, u.cached_input_tokens,
                                          u.output_tokens, u.embedding_tokens)
            if self.record is not None and u.input_tokens:
                self.record.prompt_tokens = u.input_tokens  # (each block set its own prompt's)
        accounts = self.svc.accounts
        if accounts is None:
            return
        usage = u if self.ran and not self.again and not self.refused else None
        # uncut: its last block may end in a task that is cancelled while it writes (``interleave``
        # cancels the choices of a request that failed or was left, and they may be ending already)
        await uncut(accounts.finish(self.caller, self.model, self._admission, usage))


def model_failed(model: str, exc: WorkerFailed) -> APIError:
    """The 503 of a request whose model's engine died under it (``WorkerFailed``)."""
    return APIError(503, f"the model '{model}' failed while serving this request ({exc}); it is loaded again for "
                    "the next request: try again", "model_failed", headers={"retry-after": "1"})


# How a block ends when its reply is cut before its end: the client left (``ClientGone``, or the
# streamed response's generator closed), or the server cancelled it (a drain, a batch's cancel).
_CUT = (asyncio.CancelledError, GeneratorExit, ClientGone, Cancelled)


_finishing: set[asyncio.Task] = set()  # usage writes running in tasks of their own (``uncut``): held till done


async def uncut(finish: Coroutine[Any, Any, None]) -> None:
    """Await ``finish`` (``Accounts.finish``: a request's usage write and what it gives back of its
    key's limits) so that no cancel cuts it short. It runs in a task of its own, which a cancel of
    the awaiting task does not reach: asyncio's ``Task.cancel`` (a task cancelled again while it
    meters its cut block, as a stream's cancelled scope cancels it at every await, or ``interleave``
    cancelling the choices of a request that is over) then ends the wait only, and the write goes
    on to its end; inside a stream's cancelled scope the wait is shielded, so it is waited for.
    Cut short, the key's usage was lost, and on ``concurrent`` the request counted in flight
    for good (15 minutes on Redis)."""
    task = asyncio.ensure_future(finish)
    _finishing.add(task)
    task.add_done_callback(_finishing.discard)
    if in_cancel_scope():
        with anyio.CancelScope(shield=True):
            await asyncio.shield(task)
    else:
        await asyncio.shield(task)


def in_cancel_scope() -> bool:
    """Whether an anyio cancel scope encloses the running task, as a streamed response's task group
    does: a cancelled scope cancels the task again at every await until it is left, and only a
    shielded scope stops that. Elsewhere a shield stops nothing (anyio's shield does not hold off
    asyncio's own ``Task.cancel``), and it costs ~30 Python calls, so a non-streamed request's
    usage write goes without one. True when anyio's bookkeeping cannot be read (always shield)."""
    if _anyio_tasks is None:
        return True
    state = _anyio_tasks.get(asyncio.current_task())
    return state is not None and state.cancel_scope is not None


try:  # anyio's per-task state on asyncio: its cancel scopes (private; without it, always shield)
    from anyio._backends._asyncio import _task_states as _anyio_tasks
except ImportError:  # pragma: no cover - another anyio layout
    _anyio_tasks = None


class Threads(ThreadPoolExecutor):
    """A thread pool whose work's ``StopIteration`` comes back as a ``RuntimeError``. asyncio before
    3.12.1 cannot set a StopIteration on a future (CPython gh-112182): the callback copying the
    thread's outcome raises TypeError, the future stays pending, and the request awaiting it waits
    forever, holding its gate slot and lease. Library code raises one from a stray ``next()`` (a
    processor with more image placeholders than images did). tiergate's thread work, and asyncio's
    default executor (``use_threads``), runs on these."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return super().submit(_no_stop_iteration, fn, *args, **kwargs)


def _no_stop_iteration(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return fn(*args, **kwargs)
    except StopIteration as exc:
        raise RuntimeError(f"{getattr(fn, '__qualname__', fn)!s} raised StopIteration") from exc


def use_threads(loop: asyncio.AbstractEventLoop) -> None:
    """Make ``loop``'s default executor (``asyncio.to_thread``, ``run_in_executor(None, ...)``:
    the arbiter's loads and evictions, parsing, file reads) a ``Threads`` of asyncio's own size."""
    loop.set_default_executor(Threads(thread_name_prefix="asyncio"))


# Model work gets its own threads: on asyncio's default executor, long generations could starve
# the arbiter's loads and evictions (which run there) and deadlock the requests waiting on them.
# Batch work (a pause gate) gets threads apart from the others': a batch line holds its thread
# while it waits at a pause, or in an encoder's batch lane (16 lines of each embedding and
# moderation model), and the work it yields to must never wait for a thread behind it.
_MODEL_THREADS = Threads(max_workers=64, thread_name_prefix="tiergate-model")
_BATCH_THREADS = Threads(max_workers=256, thread_name_prefix="tiergate-batch")


async def in_thread(work: Callable[[], T], ctx: StepContext) -> T:
    """Run blocking model ``work`` on a model thread (batch work, whose ``ctx`` has a pause gate,
    on one of the batch threads). If the awaiting task is cancelled (client gone), cancel ``ctx``
    so the work stops at its next step boundary, and wait for the thread to end before
    re-raising: nothing may release the model while a thread still runs on it."""
    running = (_MODEL_THREADS if ctx.pause_gate is None else _BATCH_THREADS).submit(work)
    done = asyncio.wrap_future(running)
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        ctx.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait({done})
        if not done.cancelled():
            done.exception()  # retrieved: the caller is gone, the result or error goes nowhere
        raise


@dataclass(frozen=True)
class Finished(Generic[R]):
    """The last item ``relayed`` yields: the work's result."""

    result: R


async def relayed(serving: Serving, work: Callable[[StepContext, Callable[[T], None]], R],
                  doing: str) -> AsyncGenerator[T | Finished[R], None]:
    """Run blocking model ``work(ctx, send)`` on a model thread, with a fresh step context, and
    yield what it sends, as it sends it, then ``Finished`` with its result: a streamed answer's
    pieces (a transcript's text, an image's previews). Out of memory before anything was sent is
    relieved and the work run once more, as ``Serving.step`` does (``doing`` names the work in
    the 503 otherwise); after, pieces have gone out and it is a 503. What else the work raises is
    raised after the pieces sent before it, Cancelled as ``ClientGone``. The client leaving, or
    the generator closed early, cancels the context (the work stops at its next step boundary)
    and waits for the thread."""
    sent_any = False
    for tries in (1, 2):
        ctx, loop, sent = serving.context(), asyncio.get_running_loop(), asyncio.Queue()
        running = asyncio.ensure_future(in_thread(
            lambda: work(ctx, lambda item: loop.call_soon_threadsafe(sent.put_nowait, item)), ctx))
        try:
            while not running.done():
                item = asyncio.ensure_future(sent.get())
                try:
                    await serving.until_gone(asyncio.wait({item, running}, return_when=asyncio.FIRST_COMPLETED))
                finally:
                    if not item.done():
                        item.cancel()
                if item.done() and not item.cancelled():  # (a get cancelled unfinished leaves its item queued)
                    sent_any = True
                    yield item.result()
            while not sent.empty():  # the thread's last sends were queued before its result
                sent_any = True
                yield sent.get_nowait()
            try:
                result = running.result()
            except Cancelled:
                raise ClientGone() from None
            except torch.OutOfMemoryError as exc:
                if sent_any or tries == 2 or not await serving.svc.arbiter.relieve_oom(serving.model, serving.rank):
                    raise APIError(503, f"out of memory {doing} {serving.model}: {exc}", "out_of_memory") from None
                continue
        finally:
            if not running.done():
                ctx.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.wait({running})
            if not running.cancelled():
                running.exception()  # retrieved: raised above, or going nowhere
        yield Finished(result)
        return


W = TypeVar("W")


async def weightless(cache: dict[str, W], spec: ModelSpec, make: Callable[[ModelSpec], W]) -> W:
    """``make(spec)``: a worker that reads its model's folder (config, tokenizer, voices) but no
    weights, made once per model off the event loop and kept in ``cache``, so that a bad input is
    refused before the request takes a slot or loads the model; 503 when the folder is not a
    model that worker runs."""
    if spec.name not in cache:
        try:
            cache[spec.name] = await asyncio.to_thread(make, spec)
        except (OSError, ValueError, KeyError) as exc:
            log.error("the model %s cannot be used: %s", spec.name, exc)  # the folder for the log, not the caller
            raise APIError(503, f"the model '{spec.name}' cannot be used: {without_folder(str(exc), spec)}",
                           "model_unavailable") from None
    return cache[spec.name]
