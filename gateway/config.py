"""tiers.yaml: the one file that configures tiers, keys, models, the GPU and request limits.

``load_config(path)`` returns a validated :class:`Config` or raises :class:`ConfigError` whose
message is one line naming the file, the field and the problem, e.g.
``tiers.yaml: models[1].vram: not a size: '6 gigs'``.

A model entry is one of seven shapes, chosen by its ``kind``; only ``chat`` takes an ``engine``
block (``engine: {name: vllm, kv_cache: 256MiB, ...}``, or just ``engine: vllm``). ``engine: auto``
is resolved once, when the file is loaded, and the choice is logged with its reason. The batch
tier is the one marked ``batch: true``, which must be the last. Reading the file imports no model
library (sizes come from the torch-free ``arbiter.units``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from accounts.config import AccountsConfig, Price, check_tiers
from arbiter.units import parse_size
from gateway.auth import ADMIN_ENV
from gateway.slo_guard import GuardSettings
from workers.base import ModelSpec

log = logging.getLogger("tiergate")


class ConfigError(Exception):
    """A configuration problem; the message is one line naming file, field and problem."""


Size = Annotated[int, BeforeValidator(parse_size)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierConfig(_Strict):
    name: str = Field(pattern=r"^[a-z][a-z0-9_-]*$")
    keys_env: str  # environment variable holding comma-separated API keys
    # None: 8; on the batch tier, every engine's width together (strict: YAML's true is not 1)
    max_inflight: int | None = Field(default=None, ge=1, strict=True)
    max_queued: int = Field(default=64, ge=0)
    latency_target_s: float = Field(default=30.0, gt=0)
    # text replies: the time per token (after the first) this tier should see; the SLO guard shrinks
    # the tiers below while this tier's replies come slower (None: only latency_target_s is judged)
    token_latency_target_s: float | None = Field(default=None, gt=0)
    batch: bool = False  # the batch tier: runs only on an otherwise idle GPU and always yields; at most one, last

    @model_validator(mode="after")
    def _batch_is_marked(self) -> "TierConfig":
        if self.name == "batch" and not self.batch:
            raise ValueError("a tier named 'batch' must say batch: true (the batch tier is marked explicitly)")
        return self


class EngineConfig(_Strict):
    """A chat model's engine and its settings: ``engine: {name: vllm, kv_cache: 256MiB, ...}``."""

    # "auto": vLLM where it imports (the production engine), transformers otherwise; resolved at load
    name: Literal["auto", "transformers", "vllm"] = "auto"
    kv_cache: Size = parse_size("256MiB")  # vLLM's KV-cache reservation (never its default of ~all memory)
    max_model_len: int | None = Field(default=None, ge=16)  # vLLM; None: the model's own
    max_num_seqs: int = Field(default=8, ge=1)  # rows decoded together in one step (both engines)
    lora_slots: int = Field(default=2, ge=1)  # vLLM: adapter stacks resident at once (plus one spare slot)
    max_lora_rank: Literal[8, 16, 32, 64, 128, 256, 320, 512] = 64  # vLLM: the largest stack rank served
    stack_loras: int = Field(default=32, ge=1)  # vLLM: stacks' LoRAs kept written on disk (LRU beyond)
    tool_parser: Literal["hermes"] = "hermes"  # how tool calls are read from the model's text (tool_choice auto)
    reasoning_parser: Literal["none", "qwen3", "deepseek_r1"] = "none"  # where a reasoning model's <think> is
    # the Responses API's file_search: what is searched for. "message": the latest user message's text;
    # "model": queries the model writes first, in a forced call (gateway.responses.written_queries)
    search_queries: Literal["message", "model"] = "message"
    # chat's input_audio parts: the speech-to-text model that hears them (gateway.input_audio); None: refused
    audio_input: str | None = None
    # chat's spoken replies (modalities ["text", "audio"]): the text-to-speech model that says them
    # (gateway.output_audio); None: refused
    audio_output: str | None = None
    # vLLM: further AsyncEngineArgs fields, verbatim (quantization, max_num_batched_tokens, ...);
    # checked against vLLM's own list at load, except those tiergate sets (VLLM_OWNED_ARGS)
    vllm_args: dict[str, Any] = Field(default_factory=dict)


# AsyncEngineArgs fields tiergate sets itself (workers/chat_vllm.py): where to say what instead
VLLM_OWNED_ARGS = {
    "model": "the model's path", "tokenizer": "the model's path", "served_model_name": "the model's name",
    "max_model_len": "engine.max_model_len", "max_num_seqs": "engine.max_num_seqs",
    "kv_cache_memory_bytes": "engine.kv_cache", "gpu_memory_utilization": "engine.kv_cache (a size, counted in the budget)",
    "enable_sleep_mode": "nothing: the arbiter's warm place needs it", "scheduling_policy": "nothing: tiers are priorities",
    "enable_prefix_caching": "nothing: a paused row resumes from the cache", "seed": "nothing: requests carry seeds",
    "enable_lora": "adapters: in tiers.yaml", "max_loras": "engine.lora_slots", "max_cpu_loras": "engine.lora_slots",
    "max_lora_rank": "engine.max_lora_rank", "structured_outputs_config": "nothing: tools and response_format use it",
    "generation_config": "nothing: a request's sampling is its own", "enable_log_requests": "nothing: the request log",
    "tensor_parallel_size": "cluster.tensor_parallel (docs/CLUSTER.md)",
    "pipeline_parallel_size": "cluster.tensor_parallel (docs/CLUSTER.md)",
}


def check_vllm_args(args: dict[str, Any]) -> str | None:
    """What is wrong with ``engine.vllm_args`` (None: nothing): a field tiergate sets, or one
    vLLM's AsyncEngineArgs does not have (imports vLLM; not checked where it is not installed)."""
    for name in args:
        if name in VLLM_OWNED_ARGS:
            return f"{name!r} is set by tiergate; use {VLLM_OWNED_ARGS[name]}"
    if importlib.util.find_spec("vllm") is None:
        return None
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    unknown = sorted(set(args) - known)
    return f"{unknown[0]!r} is not an argument of vLLM's AsyncEngineArgs" if unknown else None


def _engine_block(value: Any) -> Any:
    """``engine: vllm`` is short for ``engine: {name: vllm}``."""
    return {"name": value} if isinstance(value, str) else value


NAME = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"


class _Model(_Strict):
    name: str = Field(pattern=NAME)
    path: Path
    vram: Size | None = None
    # other names requests may call it by (gpt-4o-mini, whisper-1, ...): resolved at the door, so
    # a client written for OpenAI runs unchanged; everything after (leases, limits, metrics) sees `name`
    aliases: list[Annotated[str, Field(pattern=NAME)]] = Field(default_factory=list)
    # loaded when the server starts, in the order of models:, and /readyz says "loading" until then
    # (otherwise a model loads at its first request, which then waits for it)
    preload: bool = False

    def spec(self, with_adapters: bool = False) -> ModelSpec:
        return ModelSpec(self.name, self.kind, self.path, self.vram)


class FimTokens(_Strict):
    """A code model's fill-in-the-middle tokens (``/v1/completions`` with ``suffix``), for a model
    whose tokenizer has none of the layouts ``gateway.completions`` knows by their tokens."""

    prefix: str = Field(min_length=1)
    suffix: str = Field(min_length=1)
    middle: str = Field(min_length=1)


class ChatModel(_Model):
    kind: Literal["chat"]
    engine: Annotated[EngineConfig, BeforeValidator(_engine_block)] = EngineConfig()
    fim: FimTokens | None = None  # None: found in the tokenizer by their names (gateway.completions.FIM_LAYOUTS)
    # what a request that leaves a sampling field out gets: "model", the folder's generation_config.json (as vllm
    # serve's default --generation-config auto), then OpenAI's; "none": OpenAI's (vllm serve --generation-config vllm)
    sampling_defaults: Literal["model", "none"] = "model"

    def spec(self, with_adapters: bool = False) -> ModelSpec:
        engine = self.engine
        if engine.name == "auto":
            raise RuntimeError(f"{self.name}: engine 'auto' is resolved by load_config")
        options: dict = {"max_num_seqs": engine.max_num_seqs}
        if engine.name == "vllm":
            options.update(kv_cache_bytes=engine.kv_cache, max_model_len=engine.max_model_len)
            if engine.reasoning_parser != "none":  # constrained replies think first (vLLM's structured outputs)
                options.update(reasoning_parser=engine.reasoning_parser)
            if engine.vllm_args:
                options.update(engine_args=dict(engine.vllm_args))
            if with_adapters:  # unmerged multi-LoRA: a request's stack is served as one LoRA
                options.update(enable_lora=True, max_loras=engine.lora_slots, max_lora_rank=engine.max_lora_rank,
                               max_stack_loras=engine.stack_loras)
        return ModelSpec(self.name, self.kind, self.path, self.vram, engine.name, options)


class ImageModel(_Model):
    kind: Literal["image"]


class TTSModel(_Model):
    kind: Literal["tts"]


class STTModel(_Model):
    kind: Literal["stt"]
    # the chat model that judges realtime turns heard by this model (semantic_vad: gateway.turn_end);
    # None: a conversation's own chat model, or in a transcription session the first chat model
    turn_model: str | None = None
    batch_windows: int = Field(default=8, ge=1)  # 30 s windows decoded together in one generate, at most

    def spec(self, with_adapters: bool = False) -> ModelSpec:
        options = {"batch_windows": self.batch_windows}
        return ModelSpec(self.name, self.kind, self.path, self.vram, options=options)


class EmbedModel(_Model):
    kind: Literal["embed"]
    max_batch_tokens: int = Field(default=16384, ge=1)  # padded tokens (rows x longest) in one forward pass
    batch_width: int = Field(default=16, ge=1)  # Batch API lines run together, sharing passes

    def spec(self, with_adapters: bool = False) -> ModelSpec:
        options = {"max_batch_tokens": self.max_batch_tokens, "batch_width": self.batch_width}
        return ModelSpec(self.name, self.kind, self.path, self.vram, options=options)


class ModerationModel(_Model):
    kind: Literal["moderation"]
    threshold: float = Field(default=0.5, ge=0, le=1)  # a category is flagged at this score or more
    max_batch_tokens: int = Field(default=16384, ge=1)  # padded tokens (rows x longest) in one forward pass
    batch_width: int = Field(default=16, ge=1)  # Batch API lines run together, sharing passes

    def spec(self, with_adapters: bool = False) -> ModelSpec:
        options = {"threshold": self.threshold, "max_batch_tokens": self.max_batch_tokens,
                   "batch_width": self.batch_width}
        return ModelSpec(self.name, self.kind, self.path, self.vram, options=options)


class RerankModel(_Model):
    kind: Literal["rerank"]  # a cross-encoder: /v1/rerank and /v1/score (gateway/rerank.py)
    max_batch_tokens: int = Field(default=16384, ge=1)  # padded tokens (rows x longest) in one forward pass
    batch_width: int = Field(default=16, ge=1)  # Batch API lines run together, sharing passes

    def spec(self, with_adapters: bool = False) -> ModelSpec:
        options = {"max_batch_tokens": self.max_batch_tokens, "batch_width": self.batch_width}
        return ModelSpec(self.name, self.kind, self.path, self.vram, options=options)


ModelConfig = Annotated[Union[ChatModel, ImageModel, TTSModel, STTModel, EmbedModel, ModerationModel, RerankModel],
                        Field(discriminator="kind")]
KINDS = ("chat", "image", "tts", "stt", "embed", "moderation", "rerank")


def a_kind(kind: str) -> str:
    """``kind`` with its article, for messages: "a chat model", "an embed model"."""
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} model"


ENGINE_FIELDS = ("engine", *EngineConfig.model_fields)  # engine settings: chat models only


def resolve_engine(model: ChatModel) -> tuple[ChatModel, str]:
    """The model with ``engine: auto`` made concrete, and why that engine."""
    if model.engine.name != "auto":
        return model, "set in the config"
    if importlib.util.find_spec("vllm") is not None:
        name, why = "vllm", "engine auto: vllm is installed"
    else:
        name, why = "transformers", "engine auto: vllm is not installed"
    return model.model_copy(update={"engine": model.engine.model_copy(update={"name": name})}), why


class AdapterConfig(_Strict):
    """One LoRA adapter a request can select: by its name as the model, or in ``adapters:``."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    model: str  # the base model (a chat or image entry of ``models:``) it was trained on
    path: Path  # a peft LoRA folder, or a diffusers LoRA folder/file; relative to this file
    format: Literal["peft", "diffusers"] | None = None  # None = detect from the folder


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")  # a folder adapter's name: no path separator, no dot first


class AdapterDirConfig(_Strict):
    """A folder of LoRA adapters for one base model: each subfolder whose name is a valid adapter
    name is an adapter of that name, read when a request first names it (gateway/adapters.py)."""

    model: str  # the base model (a chat or image entry of ``models:``) every adapter in it was trained on
    path: Path  # relative to this file
    format: Literal["peft", "diffusers"] | None = None  # None = detect from each subfolder


class FineTuningConfig(_Strict):
    """``fine_tuning:``: the chat models fine-tuning jobs may train a LoRA adapter for (each needs
    an ``adapter_dirs`` folder: the trained adapters are written there) and how (tuning/)."""

    models: list[str] = Field(default_factory=list)
    lora_rank: int = Field(default=8, ge=1, le=256)
    lora_alpha: int = Field(default=16, ge=1)
    learning_rate: float = Field(default=2e-4, gt=0, le=1)  # the base rate; a job's multiplier scales it
    max_tokens: int | None = Field(default=None, ge=16)  # an example's tokens kept (None: the model's context)
    training_memory: Size = parse_size("512MiB")  # counted beside the weights: LoRA factors, Adam's moments, activations
    max_jobs_per_key: int = Field(default=4, ge=1)  # queued, running or paused at once (more: a 429)

    def trainer(self, model: str) -> str:
        """The arbiter's name for ``model``'s trainer (a model of its own: the weights it trains on)."""
        return f"{model}{TRAINER_SUFFIX}"


TRAINER_SUFFIX = "~train"  # no model, alias or adapter has such a name ('~' is in none), and URLs need not escape it


class GpuConfig(_Strict):
    device: Literal["auto", "cuda", "cpu"] = "auto"
    vram_budget: Size | None = Field(default=None, gt=0)  # required on CPU: the simulated budget
    reserve: Size = parse_size("1GiB")  # CUDA: left free when the budget is the free memory
    host_cache_budget: Size = parse_size("8GiB")
    adapter_cache_budget: Size = parse_size("2GiB")  # host memory for adapters read from adapter_dirs (LRU)

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "protect_window_s" in data:
            raise ValueError("protect_window_s moved to eviction.protect_window_s (an eviction rule, not a GPU setting)")
        return data


class EvictionConfig(_Strict):
    """Who may evict whom (arbiter/policy.py)."""

    protect_window_s: float = Field(default=60.0, ge=0)  # a model served to tier T is evictable only by a higher tier for this long


class SloGuardConfig(_Strict):
    """gate.slo_guard: lower tiers' effective max_inflight shrinks while a higher tier's recent
    latency nears its target (see gateway/slo_guard.py). On by default."""

    enabled: bool = True
    trigger: float = Field(default=0.8, gt=0)  # fraction of a higher tier's latency target
    recover: float = Field(default=0.5, gt=0)
    quantile: float = Field(default=0.9, gt=0, le=1)
    window_s: float = Field(default=10.0, gt=0)
    interval_s: float = Field(default=1.0, ge=0)
    min_samples: int = Field(default=3, ge=1)

    @model_validator(mode="after")
    def _recover_below_trigger(self) -> "SloGuardConfig":
        if self.recover > self.trigger:
            raise ValueError(f"recover ({self.recover:g}) must not be above trigger ({self.trigger:g})")
        return self

    def settings(self) -> GuardSettings:
        return GuardSettings(**self.model_dump())


class GateConfig(_Strict):
    slots: int = Field(default=8, ge=1)  # requests in flight at once, all tiers together
    slo_guard: SloGuardConfig = SloGuardConfig()


class LimitsConfig(_Strict):
    max_body: Size = parse_size("25MiB")
    max_chat_tokens: int = Field(default=1024, ge=1)
    max_n: int = Field(default=4, ge=1)  # chat choices per request (n); each takes its own gate slot
    chat_max_images: int = Field(default=8, ge=1)  # image parts in one chat request, for a model that reads images
    image_fetch_timeout_s: float = Field(default=10.0, gt=0)  # an image URL on server.image_url_hosts: the whole fetch
    image_fetch_max_bytes: Size = parse_size("20MiB")  # and its file
    file_fetch_timeout_s: float = Field(default=30.0, gt=0)  # a document URL on server.file_url_hosts: the whole fetch
    file_fetch_max_bytes: Size = parse_size("50MiB")  # and its file
    prompt_max_chars: int = Field(default=4000, ge=1)  # image prompts (and negative prompts), transcription prompts
    image_max_n: int = Field(default=4, ge=1)
    image_max_side: int = Field(default=1024, ge=8)  # pixels, either side
    image_max_steps: int = Field(default=50, ge=1)  # num_inference_steps
    image_url_ttl_s: float = Field(default=3600.0, gt=0)  # response_format=url: how long an image stays fetchable
    image_url_store: Size = parse_size("256MiB")  # image bytes kept for urls; the oldest go first when full
    image_edit_max_bytes: Size = parse_size("25MiB")  # /v1/images/edits and variations: the uploaded image (and mask)
    speech_max_chars: int = Field(default=4096, ge=1)
    transcription_max_bytes: Size = parse_size("25MiB")  # the uploaded file
    transcription_max_seconds: float = Field(default=1800.0, gt=0)  # of decoded audio
    # a Realtime session's length, as OpenAI's 60 minutes: then an error event (session_expired) and a close
    realtime_max_session_s: float = Field(default=3600.0, gt=0)
    # a Realtime conversation's items, and their text all together (characters): a conversation.item.create past
    # either is an error event (deleting items makes room); its turns and replies, metered requests, go on
    realtime_max_items: int = Field(default=4096, ge=1)
    realtime_max_chars: int = Field(default=4_000_000, ge=1)
    embed_max_inputs: int = Field(default=256, ge=1)  # inputs in one /v1/embeddings request
    moderation_max_inputs: int = Field(default=64, ge=1)  # texts in one /v1/moderations (or /classify) request
    # characters of a structured_outputs regex, grammar or choices (all together): what xgrammar compiles
    # against the vocabulary takes time with their length (1,024 choices of 1,000 characters: 250 s here)
    grammar_max_chars: int = Field(default=8192, ge=1)
    rerank_max_documents: int = Field(default=1000, ge=1)  # documents in one /v1/rerank (pairs in one /v1/score)
    # tokens in one /v1/rerank or /v1/score request, every (query, document) piece together: this bounds the work
    rerank_max_tokens: int = Field(default=262144, ge=1)
    # tokens in one /v1/moderations request, all texts together (long texts are scored in full: this bounds the work)
    moderation_max_tokens: int = Field(default=32768, ge=1)
    # tokens one /tokenize counts (or the model's context, if longer): its answer and the work grow with them
    tokenize_max_tokens: int = Field(default=262144, ge=1)
    body_timeout_s: float = Field(default=60.0, gt=0)  # a request body must arrive whole within this; else 408
    # a request's line and headers must arrive whole within this, from the connection's start (or, kept alive, from
    # its first byte); else 408 and the connection closed (gateway/http11.py)
    head_timeout_s: float = Field(default=10.0, gt=0)


class BatchConfig(_Strict):
    """The Batch API's store and runner (see docs/BATCH.md)."""

    store: str = Field(default="sqlite", pattern=r"^(sqlite|rediss?://\S+)$")  # "sqlite" or a redis:// URL
    data_dir: Path = Path("tiergate-data")  # the SQLite file's folder; relative to this file
    max_file_bytes: Size = parse_size("200MiB")
    max_lines: int = Field(default=50_000, ge=1)
    reclaim_after_s: float = Field(default=30.0, gt=0)  # a line held this long by a silent process runs elsewhere
    concurrency: int | None = Field(default=None, ge=1)  # a cap on lines in flight per process; None: the engines' widths


class ResponsesConfig(_Strict):
    """Stored responses (``/v1/responses`` with ``store: true``), in the batch store's backend."""

    # deleted this long after they were made, as OpenAI keeps them 30 days; null: until deleted
    retention_days: float | None = Field(default=30, gt=0)
    # a background response unwritten this long had its process die: another process runs it again
    reclaim_after_s: float = Field(default=30.0, gt=0)


class StoredCompletionsConfig(_Strict):
    """Stored chat completions (``/v1/chat/completions`` with ``store: true``), in the batch store's backend."""

    retention_days: float | None = Field(default=30, gt=0)  # as OpenAI keeps them; null: until deleted


Host = Annotated[str, Field(pattern=r"^(\*\.)?[A-Za-z0-9.-]+$")]  # a host name, or *.example.com for its subdomains


class ServerConfig(_Strict):
    """How the server stops (gateway/drain.py), and which web pages may call it (CORS)."""

    drain_timeout_s: float = Field(default=30.0, ge=0)  # on SIGTERM: how long requests in flight may finish
    # an event stream idle this long sends a keep-alive (an SSE comment; Anthropic's ping on /v1/messages), so that
    # proxies' idle timeouts (nginx's 60 s) do not cut a stream that waits; 0: none (gateway.http.Streamed)
    keepalive_s: float = Field(default=15.0, ge=0)
    # the event loop running a timer this late is a stall: counted, logged and sent to the dashboard with
    # where the loop was (gateway/loop_watch.py); 0: not watched
    loop_stall_s: float = Field(default=0.1, ge=0)
    # browser apps on these origins may call the API with their keys ("*": any origin); none: no CORS headers
    cors_origins: list[Annotated[str, Field(pattern=r"^(\*|https?://[^/\s]+)$")]] = []
    # vLLM's prefix cache: per_key, a key's requests reuse only their own key's cached prompt blocks
    # (another key cannot learn from a cache hit's speed what prompts it was sent); shared: any key's
    prefix_cache: Literal["per_key", "shared"] = "per_key"
    # hosts whose http(s) image URLs chat requests may name, fetched by the gateway: exact names, or
    # "*.example.com" for its subdomains; none: images come inline as data: URLs only (gateway/vision.py)
    image_url_hosts: list[Host] = []
    # hosts whose http(s) document URLs (input_file's file_url) requests may name, fetched as above;
    # none: documents come inline or as uploads (gateway/input_files.py)
    file_url_hosts: list[Host] = []
    # true: GET /metrics needs an admin key (Prometheus: the scrape job's ``authorization``), as /admin/* does;
    # false: open, as Prometheus endpoints usually are (it names every model and tier, hidden ones too)
    metrics_need_admin: bool = False

    @field_validator("loop_stall_s")
    @classmethod
    def _watchable(cls, seconds: float) -> float:
        if 0 < seconds < 0.01:  # the watch wakes the loop and a thread every loop_stall_s / 2
            raise ValueError("0 (not watched) or at least 0.01 s: a shorter threshold would wake the event loop "
                             "and a thread 200 times a second or more")
        return seconds


WEBHOOK_EVENTS = ("response.completed", "response.incomplete", "response.failed", "response.cancelled",
                  "batch.completed", "batch.failed", "batch.expired", "batch.cancelled")


class WebhookConfig(_Strict):
    """One endpoint that gets signed events (gateway/webhooks.py); its secret comes from the
    environment, never from this file."""

    url: str = Field(pattern=r"^https?://\S+$")
    secret_env: str = Field(min_length=1)  # the variable holding its secret (whsec_<base64>, as OpenAI's)
    events: list[Literal[WEBHOOK_EVENTS]] | None = None  # None: every event
    keys: list[str] | None = None  # the key ids whose events it gets; None: every key's


class ClusterConfig(_Strict):
    """``tiergate cluster``: the same tiers on a Ray cluster, one replica (gate + arbiter) per
    device (docs/CLUSTER.md). Read only by the ``cluster`` package."""

    replicas_per_node: int = Field(default=1, ge=1)  # one per GPU on CUDA
    nodes: int = Field(default=1, ge=1)  # replicas = nodes x replicas_per_node
    devices: str = Field(default="auto", pattern=r"^(auto|cpu|cuda)$")  # cuda: num_gpus 1 per replica
    replica_cpus: float = Field(default=1.0, gt=0)  # CPUs Ray reserves per replica (fractions allowed)
    redis_url: str | None = Field(default=None, pattern=r"^rediss?://\S+$")  # keys, quotas, usage, batch backlog
    stats_period_s: float = Field(default=2.0, gt=0)  # how often replicas report to the router
    max_copies: dict[str, int] = Field(default_factory=dict)  # model -> replicas it may be resident on (default 1)
    # model -> devices it spans (tensor parallel): its own deployment, pinned, outside the swap pool
    tensor_parallel: dict[str, Annotated[int, Field(ge=2)]] = Field(default_factory=dict)
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=1, le=65535)

    def check(self, models: list[ModelConfig]) -> None:
        """What the cluster section says of models: they exist; a tensor-parallel model is a chat
        model on vLLM with its ``vram`` declared (its deployment's budget), and the devices left
        hold the other models."""
        by_name = {m.name: m for m in models}
        for field_name in ("max_copies", "tensor_parallel"):
            unknown = sorted(set(getattr(self, field_name)) - set(by_name))
            if unknown:
                raise ValueError(f"cluster.{field_name}: no model named {', '.join(map(repr, unknown))}")
        for name in self.tensor_parallel:
            model = by_name[name]
            if not isinstance(model, ChatModel) or model.engine.name == "transformers":
                raise ValueError(f"cluster.tensor_parallel.{name}: only a chat model on the vllm engine can span devices")
            if model.vram is None:
                raise ValueError(f"cluster.tensor_parallel.{name}: declare the model's vram (its deployment's budget)")
            if name in self.max_copies:
                raise ValueError(f"cluster.tensor_parallel.{name}: a tensor-parallel model has one copy; drop its max_copies")
        devices = self.nodes * self.replicas_per_node
        spanned = sum(self.tensor_parallel.values())
        pooled = [m for m in models if m.name not in self.tensor_parallel]
        if spanned > devices or (pooled and spanned >= devices):
            raise ValueError(f"cluster.tensor_parallel: {spanned} devices spanned, of {devices} "
                             "(nodes x replicas_per_node), leave none for the other models")


class Config(_Strict):
    tiers: list[TierConfig] = Field(min_length=1)
    models: list[ModelConfig] = Field(default_factory=list)
    adapters: list[AdapterConfig] = Field(default_factory=list)
    adapter_dirs: list[AdapterDirConfig] = Field(default_factory=list)
    gpu: GpuConfig = GpuConfig()
    eviction: EvictionConfig = EvictionConfig()
    gate: GateConfig = GateConfig()
    limits: LimitsConfig = LimitsConfig()
    batch: BatchConfig = BatchConfig()
    responses: ResponsesConfig = ResponsesConfig()
    stored_completions: StoredCompletionsConfig = StoredCompletionsConfig()
    webhooks: list[WebhookConfig] = Field(default_factory=list)
    server: ServerConfig = ServerConfig()
    cluster: ClusterConfig = ClusterConfig()
    accounts: AccountsConfig = AccountsConfig()  # per-tier default limits of each key (docs/ACCOUNTS.md)
    fine_tuning: FineTuningConfig = FineTuningConfig()  # /v1/fine_tuning/jobs (tuning/)
    prices: dict[str, Price] = Field(default_factory=dict)  # tier -> what usage costs there
    source: Path = Path("tiers.yaml")

    def folder_adapter_base(self, name: str) -> str | None:
        """The base model of the ``adapter_dirs`` folder that holds an adapter named ``name`` (the
        first that does: a subfolder, or an image LoRA's file), by its place alone: its files are
        read and checked where it is served."""
        if not ADAPTER_NAME.fullmatch(name):
            return None
        return next((d.model for d in self.adapter_dirs
                     if (d.path / name).is_dir() or (d.path / f"{name}.safetensors").is_file()), None)

    def data_dir(self) -> Path:
        """``batch.data_dir``, a relative one taken from this file's folder: where the SQLite stores live."""
        d = self.batch.data_dir
        return d if d.is_absolute() else self.source.parent / d

    def fim_tokens(self, model: str) -> tuple[str, str, str] | None:
        """The fill-in-the-middle tokens tiers.yaml names for the chat model ``model`` (``fim:``)."""
        for m in self.models:
            if m.name == model and isinstance(m, ChatModel) and m.fim is not None:
                return m.fim.prefix, m.fim.suffix, m.fim.middle
        return None

    @model_validator(mode="after")
    def _aliases_name_nothing_else(self) -> "Config":
        taken = {m.name for m in self.models} | {a.name for a in self.adapters}
        seen: set[str] = set()
        for i, m in enumerate(self.models):
            for alias in m.aliases:
                if alias in taken:
                    raise ValueError(f"models[{i}].aliases: {alias!r} is the name of a model or adapter")
                if alias in seen:
                    whose = "listed twice" if m.aliases.count(alias) > 1 else "another model's alias too"
                    raise ValueError(f"models[{i}].aliases: {alias!r} is {whose}")
                seen.add(alias)
        return self

    @property
    def aliases(self) -> dict[str, str]:
        """Each alias -> the name of its model."""
        return {alias: m.name for m in self.models for alias in m.aliases}

    @model_validator(mode="after")
    def _audio_models_are_speech_models(self) -> "Config":
        for field, kind, what in (("audio_input", "stt", "speech-to-text"), ("audio_output", "tts", "text-to-speech")):
            named = {m.name for m in self.models if m.kind == kind}
            for i, m in enumerate(self.models):
                chosen = getattr(m.engine, field) if isinstance(m, ChatModel) else None
                if chosen is not None and chosen not in named:
                    raise ValueError(f"models[{i}].engine.{field}: {chosen!r} is not a {what} model "
                                     f"(kind: {kind}) here{': ' + ', '.join(sorted(named)) if named else ''}")
        chats = {m.name for m in self.models if m.kind == "chat"}
        for i, m in enumerate(self.models):
            if isinstance(m, STTModel) and m.turn_model is not None and m.turn_model not in chats:
                raise ValueError(f"models[{i}].turn_model: {m.turn_model!r} is not a chat model here"
                                 f"{': ' + ', '.join(sorted(chats)) if chats else ''}")
        return self

    @model_validator(mode="after")
    def _accounts_name_tiers_and_models(self) -> "Config":
        check_tiers(self.accounts, self.prices, self.tier_names)
        self.cluster.check(self.models)
        known = {m.name for m in self.models}
        for tier, limits in self.accounts.limits.items():
            unknown = sorted(set(limits.models or ()) - known)
            if unknown:
                raise ValueError(f"accounts.limits.{tier}.models: no model named {', '.join(map(repr, unknown))}")
        return self

    @field_validator("tiers")
    @classmethod
    def _unique_tiers(cls, tiers: list[TierConfig]) -> list[TierConfig]:
        _no_duplicates([t.name for t in tiers])
        envs = [t.keys_env for t in tiers] + [ADMIN_ENV]
        for i, t in enumerate(tiers):  # one variable's keys in two places would serve them at one tier only
            if t.keys_env in envs[:i] or t.keys_env == ADMIN_ENV:
                raise ValueError(f"tiers[{i}].keys_env: {t.keys_env!r} is another tier's or the admin keys' "
                                 "variable; a key has one tier")
            if t.keys_env.removesuffix(KEY_FILE_SUFFIX) in envs and t.keys_env.endswith(KEY_FILE_SUFFIX):
                raise ValueError(f"tiers[{i}].keys_env: {t.keys_env!r} names the file of "
                                 f"{t.keys_env.removesuffix(KEY_FILE_SUFFIX)}'s keys: its path would be a key here")
        marked = [t.name for t in tiers if t.batch]
        if len(marked) > 1:
            raise ValueError(f"only one tier may be the batch tier; batch: true on {', '.join(marked)}")
        if marked and not tiers[-1].batch:
            raise ValueError(f"the batch tier ({marked[0]!r}) must be the last, the lowest tier")
        return tiers

    @field_validator("models")
    @classmethod
    def _unique_models(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        _no_duplicates([m.name for m in models])
        return models

    @field_validator("adapters")
    @classmethod
    def _unique_adapters(cls, adapters: list[AdapterConfig]) -> list[AdapterConfig]:
        _no_duplicates([a.name for a in adapters])
        return adapters

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self.tiers]

    @property
    def batch_rank(self) -> int:
        """The rank of the batch tier; the lowest tier's when none is marked."""
        return len(self.tiers) - 1

    def max_inflight(self, tier: TierConfig) -> int:
        """The tier's slots: as set, else 8; the batch tier's default is room to fill every
        model's engine at once (its ``max_num_seqs``, an encoder's ``batch_width``, 1 for models
        without one), so batch work is held back only by the other tiers' demand, never by its own
        limit."""
        if tier.max_inflight is not None:
            return tier.max_inflight
        if not tier.batch:
            return 8
        return max(1, sum(m.engine.max_num_seqs if isinstance(m, ChatModel)
                          else m.batch_width if isinstance(m, (EmbedModel, ModerationModel)) else 1
                          for m in self.models))

    def model_specs(self) -> list[ModelSpec]:
        """Every model's spec, then a trainer's for each model ``fine_tuning`` names."""
        with_adapters = {a.model for a in self.adapters} | {d.model for d in self.adapter_dirs}
        specs = [m.spec(m.name in with_adapters) for m in self.models]
        tuning = self.fine_tuning
        for m in self.models:
            if m.name in tuning.models:
                specs.append(ModelSpec(tuning.trainer(m.name), "train", m.path, None, "transformers",
                                       {"training_bytes": tuning.training_memory}))
        return specs

    def tuning_dir(self, model: str) -> Path | None:
        """Where fine-tuning writes ``model``'s trained adapters: its first ``adapter_dirs`` folder."""
        return next((d.path for d in self.adapter_dirs if d.model == model), None)


def _no_duplicates(names: list[str]) -> None:
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise ValueError(f"duplicate name {n!r}")
        seen.add(n)


def load_config(path: str | Path, check_paths: bool = True) -> Config:
    """Read and validate ``path``; model paths are resolved relative to the file's folder."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader) or {}
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:  # read_text's, before YAML sees it: the file is not UTF-8 text
        raise ConfigError(f"{path}: not UTF-8 text: byte {exc.object[exc.start]:#04x} at offset {exc.start}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    try:
        config = Config.model_validate({**raw, "source": path})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = _loc(err["loc"]) + (".kind" if err["type"].startswith("union_tag") else "")
        # checks across fields (Config's own validators) have no location: their message names the fields
        raise ConfigError(f"{path}: {where + ': ' if where else ''}{_message(err)}") from None
    base = path.parent
    models = []
    for i, m in enumerate(config.models):
        resolved = m.path if m.path.is_absolute() else (base / m.path)
        if check_paths and not resolved.is_dir():
            raise ConfigError(f"{path}: models[{i}].path: no such folder: {resolved}")
        m = m.model_copy(update={"path": resolved})
        if isinstance(m, ChatModel):
            explicit = m.engine.name
            m, why = resolve_engine(m)
            log.info("%s: chat engine %s (%s)", m.name, m.engine.name, why)
            if m.engine.vllm_args:
                if m.engine.name != "vllm" and explicit == "transformers":
                    raise ConfigError(f"{path}: models[{i}].engine.vllm_args: for engine vllm, not transformers")
                problem = check_vllm_args(m.engine.vllm_args) if m.engine.name == "vllm" else None
                if problem:
                    raise ConfigError(f"{path}: models[{i}].engine.vllm_args: {problem}")
                if m.engine.name != "vllm":
                    log.warning("%s: engine.vllm_args left unused: the engine is transformers (%s)", m.name, why)
        models.append(m)
    adapters = [_check_adapter(path, i, a, models, check_paths) for i, a in enumerate(config.adapters)]
    dirs = [_check_adapter_dir(path, i, d, models, check_paths) for i, d in enumerate(config.adapter_dirs)]
    for i, name in enumerate(config.fine_tuning.models):
        where = f"{path}: fine_tuning.models[{i}]"
        base = next((m for m in models if m.name == name), None)
        if base is None or base.kind != "chat":
            raise ConfigError(f"{where}: {name!r} is not a chat model of models (only chat models are fine-tuned)")
        if not any(d.model == name for d in dirs):
            raise ConfigError(f"{where}: {name!r} has no adapter_dirs folder for its trained adapters to go in")
        rank = config.fine_tuning.lora_rank
        if base.engine.name == "vllm" and rank > base.engine.max_lora_rank:
            raise ConfigError(f"{where}: fine_tuning.lora_rank {rank} is above {name!r}'s engine.max_lora_rank "
                              f"{base.engine.max_lora_rank}: vLLM would refuse its fine-tuned adapters")
    return config.model_copy(update={"models": models, "adapters": adapters, "adapter_dirs": dirs})


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key written twice in one mapping is an error, where
    ``safe_load`` keeps the last silently (a second ``tiers:`` replaced every tier)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # keys written beside a merge (<<) override what it merges, as YAML means
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, Hashable):
                    continue  # the base class refuses it
                if key in first:
                    raise yaml.constructor.ConstructorError(
                        problem=f"duplicate key {key!r} (first at line {first[key].line + 1})",
                        problem_mark=key_node.start_mark)
                first[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's problem and where it is (``line 12, column 1: found character '\\t' ...``), on one line;
    ``str(exc)`` spreads them over several, its first line only the context."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is None:
        return problem
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and start is not None and start.line != mark.line:  # an unclosed list: where it opened
        problem += f" ({context} from line {start.line + 1}, column {start.column + 1})"
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _adapter_base(where: str, model: str, models: list[ModelConfig]) -> None:
    base = next((m for m in models if m.name == model), None)
    if base is None:
        raise ConfigError(f"{where}.model: no model named {model!r} in models")
    if base.kind not in ("chat", "image"):
        raise ConfigError(f"{where}.model: {model!r} is {a_kind(base.kind)}; adapters are for chat and image models")


def _check_adapter_dir(path: Path, i: int, d: AdapterDirConfig, models: list[ModelConfig], check_paths: bool) -> AdapterDirConfig:
    """The folder with its path resolved; its base must be a chat or image model and it must be a
    folder. What is in it is read when requests name it."""
    where = f"{path}: adapter_dirs[{i}]"
    _adapter_base(where, d.model, models)
    resolved = d.path if d.path.is_absolute() else (path.parent / d.path)
    if check_paths and not resolved.is_dir():
        raise ConfigError(f"{where}.path: no such folder: {resolved}")
    return d.model_copy(update={"path": resolved})


def _check_adapter(path: Path, i: int, a: AdapterConfig, models: list[ModelConfig], check_paths: bool) -> AdapterConfig:
    """The adapter with its path resolved; its name must not be a model's, its base must be a chat
    or image model, and its folder must exist. Its files are read at start-up
    (gateway/adapters.py)."""
    where = f"{path}: adapters[{i}]"
    if any(m.name == a.name for m in models):
        raise ConfigError(f"{where}.name: {a.name!r} is also a model's name")
    _adapter_base(where, a.model, models)
    resolved = a.path if a.path.is_absolute() else (path.parent / a.path)
    if check_paths and not resolved.exists():
        raise ConfigError(f"{where}.path: no such folder: {resolved}")
    return a.model_copy(update={"path": resolved})


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for i, part in enumerate(loc):
        if part in KINDS and i >= 2 and loc[i - 2] == "models":
            continue  # the union's tag: the kind the entry was read as
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(err: dict[str, Any]) -> str:
    loc = err["loc"]
    if err["type"] == "extra_forbidden":
        field = loc[-1]
        if loc[:1] == ("models",) and len(loc) == 4 and field in ENGINE_FIELDS:
            if loc[2] != "chat":
                return f"engine settings are for chat models, not {loc[2]} models"
            return f"unknown field; engine settings go in the engine block: engine: {{name: ..., {field}: ...}}"
        return "unknown field"
    if err["type"] == "union_tag_invalid":
        return f"must be one of {', '.join(KINDS)}, not {err['ctx']['tag']!r}"
    if err["type"] == "union_tag_not_found":
        return f"missing: one of {', '.join(KINDS)}"
    msg = err["msg"]
    return msg.removeprefix("Value error, ")


KEY_FILE_SUFFIX = "_FILE"  # TIERGATE_KEYS_PAID_FILE=/run/secrets/paid: the keys of TIERGATE_KEYS_PAID in a file


def env_keys(var: str, environ: os._Environ[str] | dict[str, str] = os.environ) -> list[str]:
    """The API keys of the environment variable ``var`` (comma-separated), and those in the file
    that ``<var>_FILE`` names, if it is set (as Docker and Kubernetes mount secrets): one key a
    line or comma-separated, blank lines and lines starting with ``#`` skipped, and a comment after
    a key (``sk-... # alice``: a ``#`` after a space) left out of it. A file that
    cannot be read is a :class:`ConfigError` naming the variable and the path, never a key."""
    keys = _split_keys(environ.get(var, ""))
    path = environ.get(var + KEY_FILE_SUFFIX)
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8-sig")  # a BOM (Notepad, PowerShell) is not the first key's
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise ConfigError(f"{var}{KEY_FILE_SUFFIX}: cannot read {path}: {reason}") from None
        for line in text.splitlines():
            if not line.lstrip().startswith("#"):
                keys += _split_keys(_INLINE_COMMENT.split(line, maxsplit=1)[0])
    return keys


_INLINE_COMMENT = re.compile(r"\s#")  # a comment after a key in a key file (keys have no spaces)


def _split_keys(raw: str) -> list[str]:
    return [k.strip() for k in raw.split(",") if k.strip()]


def key_variables(config: Config) -> list[str]:
    """The environment variables keys come from: each tier's ``keys_env`` and the admin keys'."""
    return [t.keys_env for t in config.tiers] + [ADMIN_ENV]


def tier_keys(config: Config, environ: os._Environ[str] | dict[str, str] = os.environ) -> dict[str, list[str]]:
    """API keys per tier, read from each tier's environment variable and its file (``env_keys``)."""
    return {tier.name: env_keys(tier.keys_env, environ) for tier in config.tiers}


def check_keys_apart(config: Config, keys: dict[str, list[str]], admin: list[str],
                     environ: os._Environ[str] | dict[str, str] = os.environ) -> None:
    """A key is listed in one place only: in two tiers it would serve at the first alone, and a
    tier key also listed as an admin key would lose its admin rights (tier keys match first). A
    :class:`ConfigError` names the two variables (or files), never the key."""
    where: dict[str, str] = {}
    for var, listed in [*((t.keys_env, keys[t.name]) for t in config.tiers), (ADMIN_ENV, admin)]:
        for key in listed:
            if where.setdefault(key, var) != var:
                raise ConfigError(f"a key is listed in both {_key_source(where[key], key, environ)} and "
                                  f"{_key_source(var, key, environ)}: a key has one tier, or is an admin key "
                                  "(which acts at the top tier)")


def _key_source(var: str, key: str, environ: os._Environ[str] | dict[str, str]) -> str:
    """Where ``key`` of ``var`` was read: the variable, or the file its ``_FILE`` variable names."""
    if key in _split_keys(environ.get(var, "")):
        return var
    return f"{var}{KEY_FILE_SUFFIX} ({environ.get(var + KEY_FILE_SUFFIX)})"
