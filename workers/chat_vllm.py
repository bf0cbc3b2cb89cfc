"""Chat on vLLM: one long-lived ``AsyncLLM`` per model, priority-scheduled, streaming deltas.

vLLM owns the batching: its engine core runs in a spawned process, schedules by
``(priority, arrival)`` (``scheduling_policy="priority"``: lower number first, which is tiergate's
tier rank), and streams ``RequestOutputKind.DELTA`` outputs that this module turns into
``TextDelta`` events and one final ``ChatFinished``.

Where vLLM differs from the transformers worker (``workers.chat``):

* Cancellation. Closing the ``chat()`` iterator (client gone) or cancelling its task aborts the
  request in the engine at once. ``req.ctx.cancel()`` is also honoured: it is checked at every
  output and, while the request is still queued and produces none, by a watcher every 50 ms.
* Pausing. vLLM cannot hold one row of its batch. When ``req.ctx.must_pause()`` turns true the
  request is aborted (its KV blocks are freed), the tokens generated so far are kept, and once the
  pause lifts it is resubmitted as prompt + generated tokens with the remaining budget, as the
  transformers worker re-prefills. Not carried over a pause: the sampler state (a seeded request
  is reproducible only when it is not paused). vLLM's detokenizer starts again with each pass, so
  what it knew of the text is made good here: an incomplete UTF-8 character held back at the
  pause comes with the resumed pass's first text, after what the restarted detokenizer sends
  again, which is cut (``_Replay``); and a resumed pass with stop strings checks them itself on
  the whole reply's text, as the transformers worker does (``_resumed_text``), so that a stop
  string split across the pause ends the reply and the tail vLLM was holding back as a possible
  stop's start is sent. A greedy reply paused at any of its tokens streams the unpaused text.
* Constrained replies (``params.grammar``) go to vLLM's structured outputs as the same EBNF text
  the transformers engine's own matcher compiles (``workers.grammar.grammar_text``; the engine
  also starts with ``disable_any_whitespace``, which vLLM 0.32 reads per engine); a reasoning model's
  engine also gets vLLM's reasoning parser there, so its replies think before the grammar
  applies (``_thinking_gate``). A
  resubmission restarts the grammar from its beginning, so a constrained request is paused only
  before the grammar has seen a token (before its first token, or while a reasoning model still
  thinks: the resubmitted prompt ends inside the thinking, so vLLM's gate waits again); after that
  it runs to its end (it stays bounded by max_tokens).
* Logprobs are vLLM's (``SamplingParams(logprobs=k)``): by default the model's raw log
  probabilities, before penalties and bias, but after the grammar's mask (the alternatives it
  forbids are left out: ``_token_logprob``). So are the prompt's
  (``SamplingParams(prompt_logprobs=k)``, asked of the first pass only: a resubmission's prompt
  holds generated tokens), except on an engine with LoRA enabled, which refuses them
  (``workers.base.PROMPT_LOGPROBS_WITH_LORA``: there one such request beside another killed the engine core).
* LoRA. vLLM's CPU LoRA kernels (``vllm.lora.ops.torch_ops``) index the adapter stack with the
  row's slot, and rows without an adapter carry slot ``-1``, which Python indexing turns into the
  LAST slot: once an adapter has ever been activated in the last slot (vLLM only clears a slot's
  bookkeeping on eviction, not its weights), every base-model row is computed with that adapter.
  So the engine gives vLLM ``max_loras + 1`` slots and keeps at most ``max_loras`` adapters
  resident itself, evicting an idle one (``remove_lora``) before a new one is used: activation
  takes the lowest free slot, so the last slot stays empty and zero. Each request counts as its
  adapter's user while it is in the engine: a paused request gives its slot up and waits for one
  again when it resumes (paused batch rows holding every slot would otherwise leave a paid request
  for another LoRA waiting on them while they wait for it), in the engine's current run.
  Every LoRA vLLM gets is a folder tiergate wrote itself (``_write_stack``), never an adapter's own
  folder: vLLM reads a LoRA's files only when it first schedules a request for it, and a load that
  fails there (the folder deleted meanwhile, or one its loader refuses) kills the engine core.
* Engine death. Once the engine core has died (vLLM's ``EngineDeadError``: a crash, a killed
  process) every request on it fails: ``chat()`` raises ``WorkerFailed`` and ``failure`` says why,
  so that the gateway answers a 503 and the arbiter drops the engine and starts a fresh one.

On CPU the engine's processes run without TorchDynamo (``TORCHDYNAMO_DISABLE=1`` in their
environment, see ``_eager_on_cpu``): ``enforce_eager`` keeps the model out of ``torch.compile``,
but vLLM 0.32 still compiles a sampler helper with inductor (``batched_count_greater_than``, the
logprobs' ranks) at the first request that asks for logprobs, which then waited 9.5 s on a fresh
machine (a C++ compile) and ~2 s after every engine start with the compile cache warm. Eager, that
request takes what any other does (0.07 s, the tiny demo model).

Configuration: ``kv_cache_bytes`` is passed as vLLM's ``kv_cache_memory_bytes`` on every platform
(vLLM 0.32 honours it on CPU too; the legacy env ``VLLM_CPU_KVCACHE_SPACE``, in whole GiB, still
overrides it there when set). Without a cap vLLM on CPU asks for 92% of RAM and refuses to start.
Scripts that start an engine need an ``if __name__ == "__main__":`` guard: the engine core is a
spawned process that re-imports the main module.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import itertools
import logging
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from workers.base import (
    AdapterStackSpec,
    Cancelled,
    ChatEvent,
    ChatFinished,
    ChatParams,
    ChatRequest,
    PROMPT_LOGPROBS_WITH_LORA,
    InvalidParam,
    ModelSpec,
    StackKey,
    TextDelta,
    TokenLogprob,
    TokenReport,
    stack_key,
)
from workers import chat_prompt, reaper
from workers.grammar import Vocabulary, grammar_text
from workers.worker import ModelInfo, Worker, WorkerFailed
from workers.chat_prompt import ContextTooLong

# The gateway never talks to a model hub: every model is a local folder. Set before vLLM (and
# huggingface_hub) read it; the spawned engine core inherits it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

LoraRef = tuple[str, int, str]  # (name, int_id >= 1, local adapter folder)

_CANCEL_POLL_S = 0.05
_PAUSE_POLL_S = 0.02
_ABANDON_GRACE_S = 2.0  # an abandoned start's processes: from SIGTERM to SIGKILL
_ABANDON_WAIT_S = 10.0  # then its thread ends (its wait for them fails): waited for this long at most

log = logging.getLogger("tiergate.vllm")


@dataclass
class _Resident:
    """One adapter that the engine keeps loaded (it occupies one of vLLM's GPU/CPU slots)."""

    lora_id: int
    users: int = 0
    last_used: float = 0.0


@dataclass
class _StackLora:
    """The LoRA written for one adapter stack, and the ``chat()`` calls that hold its path (a
    request paused across an unload and reload keeps it)."""

    ref: LoraRef
    users: int = 0


_RPC_OWNER = "TIERGATE_VLLM_RPC_OWNER"  # the pid whose folder VLLM_RPC_BASE_PATH names, when tiergate made it


def _rpc_folder() -> Path:
    """Where vLLM puts its ZMQ socket files: ``VLLM_RPC_BASE_PATH``, by default the system's temp
    folder, where vLLM 0.32 leaves them after an engine shuts down (7 per engine start on this CPU
    build). Unless the operator set it, tiergate gives them a folder of its own, removed when this
    process exits (by the reaper if it is killed); each engine removes the files its start made
    when it shuts down.

    A folder another tiergate process made (a server started by this one inherits its
    environment) is not used: the process that made it removes it when it exits, under the
    sockets of whoever else binds there. The operator's own folder is shared and never removed."""
    inherited = os.environ.get(_RPC_OWNER) not in (None, str(os.getpid()))
    if "VLLM_RPC_BASE_PATH" not in os.environ or inherited:
        folder = tempfile.mkdtemp(prefix=f"tiergate-vllm-{os.getpid()}-")
        os.environ["VLLM_RPC_BASE_PATH"] = folder  # read by vLLM in this process and its engines
        os.environ[_RPC_OWNER] = str(os.getpid())
        atexit.register(shutil.rmtree, folder, True)
    folder = Path(os.environ["VLLM_RPC_BASE_PATH"])
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _import_vllm() -> None:
    """The vLLM modules an engine uses, imported (2-5 s the first time here, on a thread:
    ``gateway.loop_watch`` found the import holding the event loop)."""
    import vllm.lora.request  # noqa: F401
    import vllm.sampling_params  # noqa: F401
    import vllm.v1.engine.async_llm  # noqa: F401


def _started_engine(args, spawns: reaper.Spawns) -> asyncio.Future:
    """``AsyncLLM.from_engine_args(args)`` (the whole start-up: engine core spawn, weights, KV
    allocation), its processes spawned in a group of their own into ``spawns``, on a daemon thread
    of its own, as a future of this loop. Not ``asyncio.to_thread``: the process joins that
    executor's threads when it exits, so a server stopped during a start waited for the engine to
    finish starting, past its drain's timeout (hunt DD, finding 2)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    loop = asyncio.get_running_loop()
    engine = loop.create_future()

    def settle(llm, exc: BaseException | None) -> None:
        if exc is None:
            engine.set_result(llm)
        else:
            engine.set_exception(exc)

    def run() -> None:
        llm, exc = None, None
        try:
            with reaper.own_group(spawns):
                llm = AsyncLLM.from_engine_args(args)
        except BaseException as failed:  # noqa: BLE001 - handed to the loop, which raises it in start()
            exc = failed
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits (the reaper ends its processes)
            loop.call_soon_threadsafe(settle, llm, exc)

    threading.Thread(target=run, name="vllm-engine-start", daemon=True).start()
    return engine


def _eager_on_cpu() -> None:
    """On CPU, the engine processes spawned from now on start with TorchDynamo off (see the module
    doc): they inherit this process's environment. This process read the variable when it
    imported ``torch._dynamo`` (transformers imports it, before any engine starts) and reads it
    no more; tiergate compiles nothing here. Any other process it starts later inherits it too."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ["TORCHDYNAMO_DISABLE"] = "1"


class VllmChatEngine(Worker):
    """A chat model served by one ``vllm.v1.engine.async_llm.AsyncLLM``.

    ``await start()`` (tens of seconds: spawns the engine core and loads the weights),
    ``chat(req, lora)`` any number of times concurrently, ``await shutdown()`` to free the engine's
    processes and memory. A new engine may be started in the same process afterwards.
    """

    kind = "chat"
    engine = "vllm"
    reserves_memory = True  # its weights and KV cache live in the engine core's process

    def __init__(
        self,
        spec: ModelSpec,
        *,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = 1 << 30,
        gpu_memory_utilization: float | None = None,
        dtype: str = "auto",
        max_num_seqs: int = 8,
        enforce_eager: bool | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_stack_loras: int = 32,
        seed: int = 0,
        reasoning_parser: str = "none",
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        """``kv_cache_bytes``: KV-cache budget (``None``: vLLM's own sizing from
        ``gpu_memory_utilization``). ``dtype="auto"``: float32 on CPU, the checkpoint's dtype
        elsewhere. ``enforce_eager=None``: True on CPU (no graphs to capture there), vLLM's
        default elsewhere. ``max_loras``: adapters resident at once (vLLM gets one slot more,
        see the module doc). ``max_stack_loras``: stack LoRAs kept written on disk; the least
        recently used one that no request holds is deleted beyond it (see ``stack_lora``).
        ``reasoning_parser``: the model's (tiers.yaml), so that a constrained reply thinks first,
        and a ``thinking_token_budget`` cuts the thinking (vLLM's ``reasoning_config``).
        ``engine_args``: further ``AsyncEngineArgs`` fields, verbatim."""
        if spec.kind != "chat":
            raise ValueError(f"{spec.name}: a vLLM engine serves chat models, not {spec.kind}")
        if enable_lora and max_loras < 1:
            raise ValueError("max_loras must be >= 1 when LoRA is enabled")
        if max_stack_loras < 1:
            raise ValueError("max_stack_loras must be >= 1")
        self.spec = spec
        self.reasoning_parser = reasoning_parser
        self.max_model_len = max_model_len
        self.kv_cache_bytes = kv_cache_bytes
        self.gpu_memory_utilization = gpu_memory_utilization
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.enforce_eager = enforce_eager
        self.enable_lora = enable_lora
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_stack_loras = max_stack_loras
        self.seed = seed
        self.extra_engine_args = dict(engine_args or {})

        self.tokenizer = None
        self._vocab: Vocabulary | None = None  # each token's bytes, for logprobs (set at start)
        self._llm = None  # vllm AsyncLLM
        self._think_end_token: int | None = None  # </think>'s id where it is one token (set at start)
        self._think_end: int | None = None  # the same where ``_thinking_gate`` gates the grammar on it
        self._ids = itertools.count()
        self._tag = uuid.uuid4().hex[:8]
        self._inflight: set[str] = set()
        # LoRA residency (see the module doc): name -> _Resident, guarded by _lora_cond.
        self._resident: dict[str, _Resident] = {}
        self._residency = 0  # which engine run _resident describes: one more at each shutdown
        self._lora_cond: asyncio.Condition | None = None
        # adapter stack -> the LoRA that serves it, least recently used first
        self._stack_loras: OrderedDict[StackKey, _StackLora] = OrderedDict()
        self._stack_ids = itertools.count(1)  # never reused: vLLM may still hold a deleted stack's id
        self._stack_writes: dict[StackKey, asyncio.Task] = {}  # stacks being written, for those who wait
        self._stack_dir: Path | None = None
        self._sockets: set[Path] = set()  # the ZMQ socket files this engine's start made
        # a start under way: the processes it spawned, and the engine it is to give
        self._starting: tuple[reaper.Spawns, asyncio.Future] | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._llm is not None

    def engine_args(self):
        """The ``AsyncEngineArgs`` this engine starts with (imports vLLM)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        kwargs: dict[str, Any] = dict(
            model=str(self.spec.path),
            tokenizer=str(self.spec.path),
            served_model_name=self.spec.name,
            max_model_len=self.max_model_len,
            # sleep(level=1) puts the weights in host RAM and frees the KV cache: the warm place
            enable_sleep_mode=not on_cpu,
            max_num_seqs=self.max_num_seqs,
            scheduling_policy="priority",
            # a paused row comes back as prompt + tokens so far: its blocks are found in the cache
            # (vLLM 0.32's default on CUDA and x86 CPU alike; said here because pausing relies on it)
            enable_prefix_caching=True,
            seed=self.seed,
            dtype=("float32" if on_cpu else "auto") if self.dtype == "auto" else self.dtype,
            enforce_eager=on_cpu if self.enforce_eager is None else self.enforce_eager,
            disable_log_stats=True,
            enable_log_requests=False,
            # its weight-loading bar ("Loading safetensors checkpoint shards") at each engine start
            # in a terminal only, as the other libraries' (gateway.cli): in a log it is plain-text noise
            use_tqdm_on_load=sys.stderr.isatty(),
            # The model folder's generation_config.json must not change ChatParams' meaning.
            generation_config="vllm",
        )
        from vllm.config import StructuredOutputsConfig

        # compact JSON for every constrained reply (a random model wanders in free whitespace)
        kwargs["structured_outputs_config"] = StructuredOutputsConfig(
            backend="xgrammar", disable_any_whitespace=True, reasoning_parser=self._thinking_gate())
        if self.reasoning_parser != "none":
            from vllm.config.reasoning import ReasoningConfig

            # thinking_token_budget's markers, as the transformers engine's (workers.think_budget)
            kwargs["reasoning_config"] = ReasoningConfig(reasoning_start_str="<think>", reasoning_end_str="</think>")
        if self.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_bytes)
        if self.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.enable_lora:
            kwargs.update(
                enable_lora=True,
                max_loras=self.max_loras + 1,  # one slot always empty: see the module doc
                max_cpu_loras=self.max_loras + 1,
                max_lora_rank=self.max_lora_rank,
            )
        kwargs.update(self.extra_engine_args)
        return AsyncEngineArgs(**kwargs)

    def _thinking_gate(self) -> str:
        """vLLM's reasoning parser for its structured outputs: with it, a reasoning model's
        constrained reply is constrained after its first ``</think>``, unless the prompt's last
        marker closed the thinking (as the transformers engine does). vLLM's parsers find the
        markers by their token ids: a tokenizer without both as tokens (every real reasoning model
        has them) gets none, and its constrained replies are constrained from the first token."""
        if self.reasoning_parser == "none" or self.tokenizer is None:
            return ""
        vocab = self.tokenizer.get_vocab()
        # deepseek_r1's gate for both parsers: the last marker in the prompt, then the first </think>
        return "deepseek_r1" if "<think>" in vocab and "</think>" in vocab else ""

    async def start(self) -> None:
        if self._llm is not None:
            return
        await asyncio.to_thread(_import_vllm)  # seconds the first time: every tier's requests wait on the loop
        rpc = _rpc_folder()
        sockets_before = set(rpc.iterdir())
        from transformers import AutoTokenizer

        await asyncio.to_thread(self._check_head_size)  # imports vLLM's CPU attention: not on the loop either
        self._lora_cond = asyncio.Condition()
        self.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(self.spec.path))
        self._vocab = Vocabulary(self.tokenizer)
        self._think_end_token = chat_prompt.think_end_id(self.tokenizer)
        # the token that ends a reasoning reply's thinking, where vLLM gates its grammar on it
        self._think_end = self._think_end_token if self._thinking_gate() else None
        args = self.engine_args()
        # Blocking for the whole start-up: off the event loop (``_started_engine``). Its processes
        # start out of this process's group (a Ctrl+C reaches this process alone, which drains),
        # and end with this process even when it is killed, from their spawn on. A start
        # cancelled, or a shutdown meanwhile, abandons it: its processes end (``_abandon_start``).
        before = set(reaper.descendants(os.getpid()))
        _eager_on_cpu()
        spawns = reaper.Spawns()
        self._starting = (spawns, _started_engine(args, spawns))
        try:
            llm = await asyncio.shield(self._starting[1])
            if spawns.stopped:  # started as a shutdown abandoned it: that shutdown ends it
                raise RuntimeError(f"{self.spec.name}: the engine's start was abandoned (shutdown)")
            self._llm = llm
        except asyncio.CancelledError:
            await self._abandon_start(*self._starting)
            raise
        finally:  # a start that fails part-way has bound some of them already
            self._starting = None
            self._sockets = set(rpc.iterdir()) - sockets_before
            if self._llm is None:
                self._remove_sockets()
        await asyncio.to_thread(reaper.guard_new_descendants, before)
        if os.environ.get(_RPC_OWNER) == str(os.getpid()):  # tiergate's own folder: gone with this process
            reaper.remove_when_gone(str(rpc))
        self.max_model_len = self._llm.model_config.max_model_len

    def _check_head_size(self) -> None:
        """vLLM's CPU attention supports a fixed set of head sizes (32, 64, 80, ...), and 0.32
        does not check it at start-up: the first request kills the engine core ("Unsupported
        CPU attention configuration: head_dim=16"). Refuse such a model before spawning."""
        import json

        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        cfg = json.loads((Path(self.spec.path) / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        supported = CPUAttentionBackend.get_supported_head_sizes()
        if head not in supported:
            raise ValueError(
                f"{self.spec.name}: head size {head} is not supported by vLLM's CPU attention "
                f"(supported: {supported})"
            )

    async def shutdown(self) -> None:
        if self._starting is not None:  # a start under way (the server stopping as a model loads)
            await self._abandon_start(*self._starting)
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self._inflight and not llm.errored:  # a dead engine core takes no abort (it raises)
            await llm.abort(list(self._inflight))
        await asyncio.to_thread(llm.shutdown)
        self._resident.clear()
        self._residency += 1  # the counts of requests paused meanwhile are gone with it
        self._remove_sockets()

    async def _abandon_start(self, spawns: reaper.Spawns, engine: asyncio.Future) -> None:
        """End a start under way where it is: its processes (and those they started) end, which
        fails its thread's wait for them, and it spawns no more; an engine that finished starting
        meanwhile shuts down. Waited for ``_ABANDON_GRACE_S`` + ``_ABANDON_WAIT_S`` at most: the
        start's thread is a daemon, which the process's exit does not wait for."""
        log.info("%s: its engine's start is abandoned: its processes are stopped", self.spec.name)
        await asyncio.to_thread(spawns.stop, _ABANDON_GRACE_S)
        done, _ = await asyncio.wait([engine], timeout=_ABANDON_WAIT_S)
        if not done:
            log.warning("%s: the engine's start, abandoned, did not end within %.0f s", self.spec.name,
                        _ABANDON_WAIT_S)
        elif engine.exception() is None:
            await asyncio.to_thread(engine.result().shutdown)

    def _remove_sockets(self) -> None:
        for path in self._sockets:  # vLLM 0.32 leaves its socket files behind
            path.unlink(missing_ok=True)
        self._sockets = set()

    # -- residency (the arbiter's view) --------------------------------------------------------
    @classmethod
    def describe(cls, spec: ModelSpec) -> ModelInfo:
        from workers.chat import folder_context_length

        declared = spec.options.get("max_model_len")
        return ModelInfo(context_length=declared or folder_context_length(spec.path))

    async def place(self, device) -> None:
        """Start the engine (its device is vLLM's choice); a start that fails shuts down what it began."""
        try:
            await self.start()
        except BaseException:
            await self.shutdown()
            raise

    async def to_host(self, pin: bool) -> bool:
        """Sleep (level 1: weights to host RAM, KV cache freed); where it cannot sleep (CPU), shut
        down instead. The object stays: requests paused on it resume once it is placed again."""
        if self.can_sleep:
            await self.sleep()
            return True
        await self.shutdown()
        return False

    async def to_device(self, device) -> None:
        await self.wake_up()

    async def release(self) -> None:
        await self.shutdown()

    @property
    def can_sleep(self) -> bool:
        """Sleep mode (weights to host RAM, the warm place) exists on CUDA only."""
        from vllm.platforms import current_platform

        return self._llm is not None and not current_platform.is_cpu()

    async def sleep(self) -> None:
        await self._llm.sleep(level=1)

    async def wake_up(self) -> None:
        await self._llm.wake_up()

    # -- introspection -----------------------------------------------------------------------
    def num_unfinished(self) -> int:
        """Requests the engine still tracks (queued or running), as its front end counts them."""
        return 0 if self._llm is None else self._llm.get_num_unfinished_requests()

    @property
    def inflight(self) -> int:
        """``chat()`` calls of this engine that have a request in vLLM now."""
        return len(self._inflight)

    def resident_loras(self) -> list[str]:
        return sorted(self._resident)

    @property
    def failure(self) -> str | None:
        """Why this engine serves no more (its engine core died), or None. vLLM does not start
        the core again: every later request would fail, so the arbiter drops a failed engine."""
        return self._died if self._llm is not None and self._llm.errored else None

    @property
    def _died(self) -> str:
        return f"the vLLM engine core of {self.spec.name} died (the server's log says why)"

    # -- requests ----------------------------------------------------------------------------
    def encode(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return chat_prompt.encode(self.tokenizer, messages, tools)

    def chat(
        self,
        req: ChatRequest,
        lora: LoraRef | None = None,
        *,
        ignore_eos: bool = False,
    ) -> AsyncIterator[ChatEvent]:
        """Stream the reply to ``req``: ``TextDelta``s, then one ``ChatFinished``.

        ``lora``: ``(name, int_id, path)`` of a peft adapter folder to apply to this request only;
        without it, ``req.adapters`` (a stack) is served by ``stack_lora``'s LoRA.
        ``ignore_eos``: generate exactly ``max_tokens`` (benchmarks and tests).
        Closing the iterator or cancelling its task aborts the request in the engine;
        ``req.ctx.cancel()`` does too and makes the iterator raise ``Cancelled``.
        """
        if lora is None and req.adapters:
            return self._failing_loudly(self._chat_on_stack(req, ignore_eos))
        return self._failing_loudly(self._chat(req, lora, ignore_eos))

    async def _failing_loudly(self, events: AsyncIterator[ChatEvent]) -> AsyncIterator[ChatEvent]:
        """``events``, with what fails once the engine core is dead raised as ``WorkerFailed``
        (vLLM's ``EngineDeadError``, or the abort that follows it): not a request's own error."""
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        except Cancelled:
            raise
        except Exception as exc:
            from vllm.v1.engine.exceptions import EngineDeadError

            if self.failure is None and not isinstance(exc, EngineDeadError):  # (the engine dropped already)
                raise
            raise WorkerFailed(self._died) from exc

    async def _chat_on_stack(self, req: ChatRequest, ignore_eos: bool) -> AsyncIterator[ChatEvent]:
        """``_chat`` with the stack's LoRA held: its folder is not deleted while this runs."""
        if self._llm is None:
            raise RuntimeError(f"{self.spec.name}: engine not started")
        if not self.enable_lora:
            raise ValueError(f"{self.spec.name}: LoRA requested but the engine has enable_lora=False")
        stack = await self._hold_stack(req.adapters)
        try:
            async with contextlib.aclosing(self._chat(req, stack.ref, ignore_eos)) as events:
                async for event in events:
                    yield event
        finally:
            stack.users -= 1

    async def _chat(self, req: ChatRequest, lora: LoraRef | None, ignore_eos: bool) -> AsyncIterator[ChatEvent]:
        if self._llm is None:
            raise RuntimeError(f"{self.spec.name}: engine not started")
        if lora is not None and not self.enable_lora:
            raise ValueError(f"{self.spec.name}: LoRA requested but the engine has enable_lora=False")
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        from workers.chat import bad_words_ids, check_token_ids

        p = req.params
        if req.images:  # the gateway refuses them first (``gateway.vision``): vLLM's multimodal inputs are not wired here
            raise InvalidParam(f"the model {self.spec.name} runs on the vllm engine, which takes no image parts here",
                               "messages")
        if p.prompt_logprobs is not None and self.enable_lora:
            raise InvalidParam(PROMPT_LOGPROBS_WITH_LORA.format(model=self.spec.name), "prompt_logprobs")
        prompt_ids = await chat_prompt.prompt_ids(self.tokenizer, req, self.max_model_len)
        p = req.params  # (a default max_tokens fitted to the room the prompt leaves)
        check_token_ids(p, self._llm.model_config.get_vocab_size())
        if p.bad_words:  # refused here as a 400, as vLLM would refuse them in the stream
            bad_words_ids(self.tokenizer, p.bad_words)
        if p.logprobs is not None or p.prompt_logprobs is not None:
            await asyncio.to_thread(self._vocab.read)  # once per tokenizer: not on the event loop
        ctx = req.ctx
        if ctx.cancelled:
            raise Cancelled()
        ctx.prompt_tokens = len(prompt_ids)

        lora_request = await self._acquire_lora(lora, ctx) if lora is not None else None
        held = self._residency  # the engine run in which this request is counted as the LoRA's user
        generated: list[int] = []
        sent = ""  # the reply's text delivered so far, over every pass
        prompt_text = ""  # the prompt's text as vLLM's detokenizer renders it (made at the first resumption)
        prompt_logprobs = p.prompt_logprobs  # asked of the first pass that delivers output, then not again
        cached = 0  # the first pass's prompt tokens from the prefix cache (a resumed pass's count the reply's too)
        report = TokenReport(prompt_ids, generated) if req.token_ids else None
        try:
            while True:  # one pass per submission; a pause ends a pass and resubmits
                if lora is not None and held != self._residency:
                    # Resumed after a pause, which gave the LoRA's slot up (or, where the engine was
                    # shut down and started again meanwhile, an eviction on CPU, whose new run may
                    # not have the LoRA loaded): count it again, so that nobody evicts the LoRA
                    # under it and its release below lowers the right count.
                    held = None
                    lora_request = await self._acquire_lora(lora, ctx)
                    held = self._residency
                remaining = p.max_tokens - len(generated)
                still = max(p.min_tokens - len(generated), 0)  # a resumed pass: what the reply still needs
                # A resumed pass with stop strings checks them itself, on the whole reply's text:
                # vLLM's restarted detokenizer never saw the text before the pause (a stop string
                # split across it), nor sent the tail it was holding back as a possible stop's start.
                own_stops = bool(generated and p.stop)
                sp = SamplingParams(
                    max_tokens=max(remaining, 1),  # vLLM samples at least one: a prompt scored (0) gets none of it
                    temperature=p.temperature,
                    top_p=p.top_p,
                    stop=None if own_stops else list(p.stop) or None,
                    seed=p.seed,
                    ignore_eos=ignore_eos or p.ignore_eos,
                    min_tokens=min(still, max(remaining, 1)),
                    stop_token_ids=list(p.stop_token_ids) or None,
                    include_stop_str_in_output=p.include_stop_str,
                    output_kind=RequestOutputKind.DELTA,
                    prompt_logprobs=prompt_logprobs,
                    **_sampling_extras(p),
                )
                rid = f"{self._tag}-{next(self._ids)}"
                outcome = None  # "finished" | "paused"
                prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids + generated}
                if req.cache_salt is not None:  # its prefix-cache blocks are reused only under this salt
                    prompt["cache_salt"] = req.cache_salt
                stream = self._llm.generate(
                    prompt,
                    sp,
                    rid,
                    lora_request=lora_request,
                    priority=req.priority,
                )
                self._inflight.add(rid)
                # A resumed pass: vLLM's detokenizer, started on prompt + generated ids that end
                # inside a character (the pause came while it held back a partial UTF-8 byte),
                # can send the text of the prompt (whole, or its tail) and of the reply so far:
                # text the client has, cut off by _Replay (a pass that checks its own stop strings
                # reads no text of vLLM's: it needs none).
                replay = None
                if generated and not own_stops:
                    prompt_text = prompt_text or self._text(prompt_ids, p)
                    replay = _Replay(_complete_text(self._text(prompt_ids + generated, p)), prompt_text, sent)
                # a constrained reply cannot resume mid-way (see the module doc): no pause once the
                # grammar has seen a token (a reasoning reply's thinking is not constrained)
                thinking = self._think_end is not None and ctx.prompt_thinking != "closed" \
                    and self._think_end not in generated
                pausable = _may_pause(p.grammar is not None, bool(generated), thinking)
                watcher = asyncio.create_task(self._watch(ctx, rid, lambda: pausable))
                try:
                    async for out in stream:
                        if prompt_logprobs is not None and out.prompt_logprobs is not None:
                            scored = TextDelta("", None,
                                               self._prompt_logprobs(prompt_ids, out.prompt_logprobs, prompt_logprobs))
                            yield report.attach(scored) if report is not None else scored
                            prompt_logprobs = None
                        if not generated and out.num_cached_tokens:
                            cached = min(out.num_cached_tokens, len(prompt_ids))
                        if p.max_tokens == 0:  # the prompt scored: the token vLLM sampled is not delivered
                            if report is not None and report.owed():
                                yield report.attach(TextDelta(""))
                            yield ChatFinished("length", len(prompt_ids), 0, cached_tokens=cached)
                            return
                        c = out.outputs[0]
                        generated.extend(c.token_ids)
                        if thinking and self._think_end in c.token_ids:
                            thinking = False  # the answer began: the grammar holds it from here
                            pausable = _may_pause(p.grammar is not None, True, False)
                        ctx.completion_tokens = len(generated)
                        ctx.steps += 1
                        logprobs = self._logprobs(c, p.logprobs) if p.logprobs is not None else None
                        text = c.text
                        if own_stops:
                            # (a stop token's text is the reply's only with include_stop_str_in_output, as vLLM's)
                            by_token = out.finished and c.finish_reason == "stop" and not p.include_stop_str
                            whole = self._text(generated[:-1] if by_token else generated, p)
                            text, stopped = _resumed_text(whole, sent, p.stop, out.finished and c.finish_reason != "abort",
                                                          p.include_stop_str)
                            if stopped is not None:
                                outcome = "stopped"  # vLLM's request is aborted on the way out
                                if text or logprobs or (report is not None and report.owed()):
                                    yield _reported(report, TextDelta(text, logprobs))
                                yield self._finished("stop", req, prompt_ids, generated, cached, stopped)
                                return
                        elif replay is not None:
                            text = replay.cut(text)
                        sent += text
                        if text or logprobs or (report is not None and report.owed()):
                            yield _reported(report, TextDelta(text, logprobs))
                        if out.finished:
                            outcome = "finished"
                            if c.finish_reason == "abort" or ctx.cancelled:
                                # Aborted by the watcher (cancel or pause) or by shutdown().
                                if ctx.cancelled or self._llm is None:
                                    raise Cancelled()
                                outcome = "paused"
                                break
                            if c.finish_reason == "error":  # vLLM failed this request alone (its grammar did not
                                # compile, say): an error, as vllm serve answers it, not an empty reply that "stop"s
                                raise _ended_in_error(rid, p)
                            reason = "length" if c.finish_reason == "length" else "stop"
                            yield self._finished(reason, req, prompt_ids, generated, cached, c.stop_reason)
                            return
                        if ctx.cancelled:
                            raise Cancelled()
                        if pausable and ctx.must_pause():
                            outcome = "paused"
                            break
                finally:
                    watcher.cancel()
                    # Closing vLLM's generator while it is suspended aborts the request there;
                    # the explicit abort covers the other exits (a no-op for finished ids).
                    await stream.aclose()
                    if outcome != "finished" and self._llm is not None:
                        await self._llm.abort(rid)
                    self._inflight.discard(rid)
                if outcome != "paused":
                    raise RuntimeError(f"request {rid}: the engine's stream ended without finishing")
                if lora is not None and held == self._residency:
                    # A paused request gives its LoRA slot up, and takes one again when it resumes
                    # (at the loop's top): kept, the slots of paused batch rows would leave a paid
                    # request for another LoRA waiting for a slot while they wait for paid to go idle.
                    await self._release_lora(lora[0])  # (a cancel can only come before it counts)
                held = None
                while ctx.must_pause():
                    if ctx.cancelled:
                        raise Cancelled()
                    await asyncio.sleep(_PAUSE_POLL_S)
                if ctx.cancelled:
                    raise Cancelled()
                if len(generated) >= p.max_tokens and p.max_tokens:  # a prompt to score (0) is submitted again
                    if report is not None and report.owed():
                        yield report.attach(TextDelta(""))
                    yield self._finished("length", req, prompt_ids, generated, cached)
                    return
        finally:
            if lora is not None and held == self._residency:
                await self._release_lora(lora[0])

    def _text(self, ids: list[int], p: ChatParams) -> str:
        """``ids`` decoded whole as vLLM's detokenizer decodes a reply for ``p``."""
        return self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens,
                                     spaces_between_special_tokens=p.spaces_between_special_tokens)

    def _finished(self, reason: str, req: ChatRequest, prompt_ids: list[int], generated: list[int],
                  cached: int, stop_reason: int | str | None = None) -> ChatFinished:
        think = None
        if req.reasoning:
            think = chat_prompt.tokens_through_think_end(
                lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), generated, self._think_end_token)
        return ChatFinished(reason, len(prompt_ids), len(generated), think, cached,  # type: ignore[arg-type]
                            stop_reason=stop_reason)

    def _logprobs(self, c, k: int) -> list[TokenLogprob]:
        """vLLM's logprobs of the tokens in one delta output (``k`` alternatives each), the
        end-of-sequence token left out."""
        eos = self.tokenizer.eos_token_id
        return [self._token_logprob(token, entries, k) for token, entries in zip(c.token_ids, c.logprobs or [])
                if token != eos]

    def _prompt_logprobs(self, ids: list[int], entries: list, k: int) -> list[TokenLogprob | None]:
        """vLLM's prompt logprobs (``SamplingParams(prompt_logprobs=k)``: per position after the
        first, the prompt token's and the ``k`` best by rank) as the engines' shape."""
        return [None] + [self._token_logprob(token, at, k) for token, at in zip(ids[1:], entries[1:])]

    def _token_logprob(self, token: int, entries: dict, k: int) -> TokenLogprob:
        """One place of vLLM's logprobs (``{token id: Logprob}``: the token's and the ``k`` best by
        rank) as the engines' shape: vLLM's text for each token, and its own bytes. Tokens the
        grammar's mask forbids (``-inf``: vLLM masks the logits before its raw logprobs) are left
        out, as the transformers engine leaves them out: JSON has no infinity."""
        top = sorted(((t, e) for t, e in entries.items() if e.rank is not None and e.rank <= k
                      and math.isfinite(e.logprob)), key=lambda te: te[1].rank)
        entry = self._vocab.entry
        return entry(token, entries[token].logprob,
                     tuple(entry(t, e.logprob, text=e.decoded_token or "", rank=e.rank) for t, e in top),
                     text=entries[token].decoded_token or "", rank=entries[token].rank)

    async def _watch(self, ctx, rid: str, pausable: Callable[[], bool] = lambda: True) -> None:
        """Abort ``rid`` when its context is cancelled or (while ``pausable()``) asks to pause while
        it yields no output (queued behind others, or a long prefill)."""
        while True:
            await asyncio.sleep(_CANCEL_POLL_S)
            if ctx.cancelled or (pausable() and ctx.must_pause()):
                if self._llm is not None:
                    await self._llm.abort(rid)
                return

    # -- LoRA residency ----------------------------------------------------------------------
    def stack_lora(self, stack: AdapterStackSpec) -> LoraRef:
        """The one LoRA that serves a request's weighted adapter stack, unmerged: the stack (one
        adapter at weight 1 too) is concatenated along the rank with the weights folded in
        (lora_kernels.save_stack_as_peft) and written as a peft folder of rank sum(r_i) (see
        ``_write_stack``). Same stack -> same LoRA id while it is kept, so vLLM
        batches its rows. At most ``max_stack_loras`` are kept: beyond that the least recently
        used one that no request holds is forgotten and its folder deleted (a stack that comes
        back is written again, under a new id). Writes on the calling thread; ``chat()`` writes
        in a worker thread (``_hold_stack``)."""
        key = stack_key(stack)
        entry = self._stack_loras.get(key)
        if entry is None:
            entry = self._keep_stack(key, self._write_stack(stack, next(self._stack_ids), self._stack_folder()))
        self._stack_loras.move_to_end(key)
        return entry.ref

    async def _hold_stack(self, stack: AdapterStackSpec) -> _StackLora:
        """The stack's LoRA, counted as held by one more request. A new one is written in a
        worker thread (hundreds of MB for a large model: not on the event loop, which serves every
        tier), once for all the requests that want it meanwhile."""
        key = stack_key(stack)
        while True:
            entry = self._stack_loras.get(key)
            if entry is not None:
                self._stack_loras.move_to_end(key)
                entry.users += 1
                return entry
            writing = self._stack_writes.get(key)
            if writing is None:
                writing = self._stack_writes[key] = asyncio.create_task(self._write_and_keep(key, stack))
                writing.add_done_callback(lambda t: t.cancelled() or t.exception())  # all who waited may be gone
            await asyncio.shield(writing)  # a request cancelled meanwhile leaves the write to the others
            # (forgotten again before this request resumed, when others filled the room: write it again)

    async def _write_and_keep(self, key: StackKey, stack: AdapterStackSpec) -> None:
        try:
            ref = await asyncio.to_thread(self._write_stack, stack, next(self._stack_ids), self._stack_folder())
            self._keep_stack(key, ref)
        finally:
            del self._stack_writes[key]

    def _stack_folder(self) -> Path:
        if self._stack_dir is None:
            self._stack_dir = self._new_stack_dir()
        return self._stack_dir

    def _write_stack(self, stack: AdapterStackSpec, lora_id: int, into: Path) -> LoraRef:
        """(any thread) The LoRA of ``stack``: a plain peft folder of one rank under ``into``, written
        from the factors tiergate read and checked (lora_kernels.save_stack_as_peft), once per
        stack: its folder is named by the stack's identity (its adapters' contents and weights),
        and one already there is served again. Never an adapter's own folder, even for one adapter
        at weight 1: vLLM reads the files when it first schedules a request, by when that folder
        may be deleted or written again, and its loader refuses folders tiergate serves
        (``rank_pattern``, ``lora_A.<name>`` keys, no ``lora_alpha``, ``init_lora_weights``); a
        load that fails in vLLM kills its engine core. Refused (ValueError: a 400) above
        ``max_lora_rank``, every module's rank counted."""
        rank = stack_rank(stack)
        if rank > self.max_lora_rank:
            raise ValueError(f"the adapter stack has rank {rank}, above this engine's max_lora_rank of "
                             f"{self.max_lora_rank}")
        key = stack_key(stack)
        folder = into / f"stack-{hashlib.sha256(repr(key).encode()).hexdigest()[:24]}"
        if not (folder / "adapter_config.json").is_file():  # (written last: a folder with it is whole)
            from lora_kernels import save_stack_as_peft

            save_stack_as_peft(list(stack), folder)
        return "+".join(f"{n}*{w:g}" for n, w in key), lora_id, str(folder)

    def _keep_stack(self, key: StackKey, ref: LoraRef) -> _StackLora:
        self._forget_stacks(room_for=1)
        entry = self._stack_loras[key] = _StackLora(ref)
        return entry

    def _forget_stacks(self, room_for: int) -> None:
        """Forget the least recently used stack LoRAs that no request holds until ``room_for``
        more fit in ``max_stack_loras``, deleting the folders this engine wrote. One that vLLM
        still has loaded stays there until it is evicted as idle (``_acquire_lora``)."""
        excess = len(self._stack_loras) + room_for - self.max_stack_loras
        for key in [k for k, e in self._stack_loras.items() if e.users == 0][:max(0, excess)]:
            folder = Path(self._stack_loras.pop(key).ref[2])
            if self._stack_dir is not None and folder.parent == self._stack_dir:
                shutil.rmtree(folder, ignore_errors=True)

    def _new_stack_dir(self) -> Path:
        """The folder of this engine's stack LoRAs. It lives as long as this object: a request
        paused on it holds paths inside it across an unload and reload, so it is removed when the
        object is collected or at exit (weakref.finalize), or by the reaper when this process is
        killed. Before, every engine that served a stack left its folder in the temp folder."""
        folder = tempfile.mkdtemp(prefix=f"tiergate-{self.spec.name}-stacks-")
        weakref.finalize(self, shutil.rmtree, folder, True)
        reaper.remove_when_gone(folder)
        return Path(folder)

    async def _acquire_lora(self, lora: LoraRef, ctx):
        """Make ``lora`` resident (evicting an idle adapter when all ``max_loras`` are taken,
        waiting while every resident one is in use) and count this request as its user.
        A ``ctx.cancel()`` while waiting raises ``Cancelled``."""
        from vllm.lora.request import LoRARequest

        name, lora_id, path = lora
        assert self._lora_cond is not None
        async with self._lora_cond:
            while True:
                res = self._resident.get(name)
                if res is not None and res.lora_id == lora_id:
                    break
                if res is not None:  # an older LoRA of that name (a forgotten stack written again)
                    if res.users == 0:
                        await self._llm.remove_lora(self._resident.pop(name).lora_id)
                        continue
                else:
                    if any(r.lora_id == lora_id for r in self._resident.values()):
                        raise ValueError(f"LoRA id {lora_id} is already used by another adapter")
                    if len(self._resident) < self.max_loras:
                        res = self._resident[name] = _Resident(lora_id)
                        break
                    idle = [(r.last_used, n) for n, r in self._resident.items() if r.users == 0]
                    if idle:
                        _, victim = min(idle)
                        await self._llm.remove_lora(self._resident.pop(victim).lora_id)
                        continue
                try:  # not asyncio.wait_for: on 3.11 it can swallow a cancel (gh-86296)
                    async with asyncio.timeout(_CANCEL_POLL_S):
                        await self._lora_cond.wait()
                except TimeoutError:
                    pass
                if ctx.cancelled:
                    raise Cancelled()
            res.users += 1
            res.last_used = time.monotonic()
        return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=str(path))

    async def _release_lora(self, name: str) -> None:
        assert self._lora_cond is not None
        async with self._lora_cond:
            res = self._resident.get(name)
            if res is not None:
                res.users -= 1
                res.last_used = time.monotonic()
                if res.users == 0:
                    # Few waiters, and any of them may be able to go: wake them all.
                    self._lora_cond.notify_all()


def stack_rank(stack: AdapterStackSpec) -> int:
    """The rank of the one LoRA written for ``stack`` (``save_stack_as_peft``): per module, the
    ranks of the adapters that target it added up (a ``rank_pattern``'s own included); the largest."""
    ranks: dict[str, int] = {}
    for adapter, _ in stack:
        for module, lm in adapter.modules.items():
            ranks[module] = ranks.get(module, 0) + lm.rank
    return max(ranks.values(), default=0)


def _reported(report: TokenReport | None, delta: TextDelta) -> TextDelta:
    """``delta`` with the token ids it reports, where its request asked for them."""
    return report.attach(delta) if report is not None else delta


def _complete_text(text: str) -> str:
    """``text`` without a trailing undecodable (partial) character."""
    return text.rstrip("\ufffd")


def _resumed_text(whole: str, sent: str, stops: Sequence[str], final: bool,
                  include_stop: bool = False) -> tuple[str, str | None]:
    """What a resumed pass with stop strings sends now, from the whole reply's text decoded from
    its tokens (``whole``) and what the client has (``sent``), and the stop string that ended the
    reply (None: none did; kept in the text with ``include_stop``); held back, as vLLM holds back:
    a tail that may start a stop string, and an incomplete character (both sent at the end, but
    the incomplete character)."""
    from workers.chat import _first_stop, _safe_prefix_len, stop_string_at

    cut = _first_stop(whole, list(stops))
    stopped = None if cut is None else stop_string_at(whole, list(stops), cut)
    if cut is not None:
        whole = whole[:cut + len(stopped) * include_stop]
    end = len(whole.rstrip("\ufffd")) if cut is not None or final else _safe_prefix_len(whole, list(stops))
    return whole[len(sent):end], stopped


class _Replay:
    """What a resumed pass's restarted detokenizer sends again, cut from its deltas. It comes
    with the first delta that has text, which is not always the pass's first: while the
    detokenizer holds back a partial character its deltas are empty, for as many tokens as the
    character takes (seen in the suite: five empty deltas, then the prompt and the reply again)."""

    def __init__(self, repeated: str, prompt_text: str, sent: str) -> None:
        self.repeated, self.prompt_text, self.sent = repeated, prompt_text, sent
        self.pending = True

    def cut(self, text: str) -> str:
        if not self.pending or not text:
            return text
        self.pending = False
        return _without_replay(text, self.repeated, self.prompt_text, self.sent)


def _without_replay(text: str, repeated: str, prompt_text: str, sent: str) -> str:
    """The first delta with text of a resumed pass without what vLLM's restarted detokenizer
    sends again: either the whole prompt and reply as a full decode renders them (``repeated``), or a tail of
    the prompt's text (``prompt_text``) followed by the reply delivered so far (``sent``), as its
    own incremental decoding rendered it (seen in the suite: the user's message, then the reply
    from its start). A delta that is none of these is new text, and kept whole."""
    if repeated and text.startswith(repeated):
        return text[len(repeated):]
    if not sent:
        return text[len(prompt_text):] if prompt_text and text.startswith(prompt_text) else text
    at = text.find(sent)
    while at > 0:
        if prompt_text.endswith(text[:at]):
            return text[at + len(sent):]
        at = text.find(sent, at + 1)
    return text


def _ended_in_error(rid: str, p: ChatParams) -> Exception:
    """What a request vLLM ended with ``finish_reason == "error"`` raises. A constrained one that
    also restricts its tokens (``allowed_token_ids``, ``bad_words``) is a 400 naming that field:
    vLLM's scheduler ends a request whose grammar rejects the token sampled ("grammar rejected
    tokens"), which happens when those leave no token the grammar allows (the transformers engine's
    ``_no_token_left``); any other is the engine's own failure (a 500)."""
    if p.grammar is not None and p.allowed_token_ids:
        return InvalidParam("allowed_token_ids allow none of the tokens the reply's grammar allows next (the "
                            "request's constraints cannot all hold)", "allowed_token_ids")
    if p.grammar is not None and p.bad_words:
        return InvalidParam("bad_words bar every token the reply's grammar allows next (the request's constraints "
                            "cannot all hold)", "bad_words")
    return RuntimeError(f"vLLM ended request {rid} with an error (its log says why)")


def _may_pause(constrained: bool, generated: bool, thinking: bool) -> bool:
    """Whether a request may leave the engine to be resubmitted later: a free reply always; a
    constrained one (its grammar restarts on a resubmission) before its first token, or while a
    reasoning reply still thinks (its grammar has seen nothing yet)."""
    return not constrained or not generated or thinking


def _sampling_extras(p: ChatParams) -> dict[str, Any]:
    """SamplingParams fields for the request's logprobs, penalties, bias, vLLM's own sampling
    extensions (top_k, min_p, repetition_penalty) and grammar."""
    extras: dict[str, Any] = {
        "logprobs": p.logprobs,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "logit_bias": dict(p.logit_bias) or None,
        "top_k": p.top_k,
        "min_p": p.min_p,
        "repetition_penalty": p.repetition_penalty,
        "skip_special_tokens": p.skip_special_tokens,
        "spaces_between_special_tokens": p.spaces_between_special_tokens,
        "allowed_token_ids": list(p.allowed_token_ids) or None,
        "bad_words": list(p.bad_words) or None,
        "thinking_token_budget": p.thinking_budget,
    }
    if p.grammar is not None:  # as EBNF: a JSON schema's grammar mended as the transformers engine's is
        from vllm.sampling_params import StructuredOutputsParams

        extras["structured_outputs"] = StructuredOutputsParams(grammar=grammar_text(p.grammar))
    return extras


__all__ = ["VllmChatEngine", "ContextTooLong", "LoraRef"]

