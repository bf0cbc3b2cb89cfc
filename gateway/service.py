"""What every endpoint shares: the services (config, keys, gate, arbiter, metrics and each
feature's state), caller authentication, and ``hold``: a slot at the gate plus a lease on a
resident model, released together. The serving core (``gateway.serving``) builds on this."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol, TypeVar

from starlette.requests import HTTPConnection, Request

from arbiter.residency import Arbiter, Lease, Refused, Unavailable
from gateway.adapters import AdapterRegistry, may_use, resolve_as
from gateway.admission import Arrival, Gate, Rejected, Ticket
from gateway.auth import Caller, KeyRing, bearer_token
from gateway.config import Config, a_kind
from gateway.errors import APIError, bad_request, not_found
from gateway.image_store import ImageStore
from gateway.metrics import Metrics
from gateway.request_log import note
from workers.base import ModelSpec
from workers.registry import describe

log = logging.getLogger("tiergate")

TEXT_KINDS = ("chat", "embed", "moderation", "rerank")  # the models with a tokenizer and a context window

if TYPE_CHECKING:
    from batch.store import Store as FileStore
    from gateway.output_audio import SpokenReplies
    from gateway.realtime_secrets import ClientSecrets
    from gateway.accounts import Accounts
    from gateway.vector_store import VectorStoreStore
    from gateway.webhooks import Webhooks
    from workers.embed import EmbedWorker
    from workers.moderation import ModerationWorker
    from workers.rerank import RerankWorker
    from workers.stt import STTWorker
    from workers.tts import TTSWorker


# the request's own arrival at the gate (``Gate.arrive``), from ``admit_caller`` until ``hold``
_arrival: contextvars.ContextVar[Arrival | None] = contextvars.ContextVar("tiergate_arrival", default=None)
# The request's own uses of models, model -> when each ended (``Arbiter.acquire``'s ``used``): one
# dict per request from the door on, shared by the tasks it starts, so the steps of a chain (speech
# in, a chat, speech out) are not refused by the protection their own earlier steps gave.
_used: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("tiergate_used", default=None)


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


@dataclass
class Held:
    """A request's slot at the gate and its lease on the model; ``release`` frees both, tells
    the gate's cost model the measured service time, when there is one worth learning from, and
    records the request's latency since it asked for the slot (``arrived``) in the tier's figures."""

    ticket: Ticket
    lease: Lease
    gate: Gate
    arrived: float
    started: float = field(default_factory=time.monotonic)
    released: bool = False

    def release(self, service_s: float | None) -> None:
        if self.released:
            return
        self.released = True
        self.lease.release()
        self.gate.release(self.ticket, service_s)
        self.gate.stats.latency(self.ticket.tier.name, time.monotonic() - self.arrived)


class _Store(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...


S = TypeVar("S", bound=_Store)


@dataclass
class Services:
    config: Config
    keys: KeyRing
    gate: Gate
    arbiter: Arbiter
    metrics: Metrics
    adapters: AdapterRegistry  # the LoRA adapters requests may select
    images: ImageStore  # the PNGs behind image urls
    native_sizes: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # image model -> size
    voices: dict[str, "TTSWorker"] = field(default_factory=dict)  # tts model -> its voices and tokenizer (no weights)
    transcribers: dict[str, "STTWorker"] = field(default_factory=dict)  # stt model -> its configs (no weights)
    # embed, moderation or rerank model -> its tokenizer and config (no weights)
    encoders: dict[str, "EmbedWorker | ModerationWorker | RerankWorker"] = field(default_factory=dict)
    on_startup: list[Callable[[], Awaitable[None]]] = field(default_factory=list)  # run by the app's lifespan
    on_shutdown: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    accounts: "Accounts | None" = None  # managed keys, per-key limits, usage (None: env keys only, unmetered)
    vector_stores: "VectorStoreStore | None" = None  # what file_search searches (gateway/vector_store.py)
    files: "FileStore | None" = None  # /v1/files' uploads (batch/store.py): what an input_image's file_id reads
    webhooks: "Webhooks | None" = None  # signed events when background work ends (gateway/webhooks.py)
    spoken: "SpokenReplies | None" = None  # spoken chat replies' transcripts by audio id (gateway/output_audio.py)
    client_secrets: "ClientSecrets | None" = None  # the Realtime API's short-lived keys (gateway/realtime_secrets.py)
    # read from the models' folders as the app starts (``read_model_folders``): each text model's context window in
    # tokens (/v1/models' max_model_len, vLLM's field), each chat model's sampling defaults (its generation_config.json)
    context_lengths: dict[str, int] = field(default_factory=dict)
    sampling_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)

    @functools.cached_property
    def tier_rank(self) -> dict[str, int]:  # looked up per request: made once
        return {t.name: i for i, t in enumerate(self.config.tiers)}

    @functools.cached_property
    def aliases(self) -> dict[str, str]:  # tiers.yaml's model aliases -> model names; made once
        return self.config.aliases

    def model_name(self, name: str) -> str:
        """The model ``name`` calls: the model itself, or the model an alias names."""
        return self.aliases.get(name, name)

    async def read_model_folders(self) -> None:
        """Fill ``context_lengths`` (each chat, embedding and moderation model's: the engine's
        ``max_model_len`` where set, else its config's) and ``sampling_defaults`` (each chat
        model's whose ``sampling_defaults`` is ``model``), off the event loop; a folder that cannot
        be read is left out (its requests say why)."""
        entries = {m.name: m for m in self.config.models}

        def read() -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
            from workers.chat import folder_sampling_defaults

            lengths, defaults = {}, {}
            for name, spec in self.arbiter.specs.items():
                try:
                    if spec.kind in TEXT_KINDS:
                        lengths[name] = describe(spec).context_length
                    if spec.kind == "chat" and getattr(entries.get(name), "sampling_defaults", "none") == "model":
                        defaults[name] = folder_sampling_defaults(spec.path)
                except Exception:  # noqa: BLE001 - what the model's own requests would meet
                    continue
            return lengths, defaults

        lengths, defaults = await asyncio.to_thread(read)
        self.context_lengths.update(lengths)
        self.sampling_defaults.update(defaults)
        for name, chosen in defaults.items():
            if chosen:
                log.info("%s: requests that leave them out sample with its generation_config.json's %s", name,
                         ", ".join(f"{k} {v}" for k, v in chosen.items()))

    def keep_open(self, store: S) -> S:
        """Open ``store`` when the app starts and close it when the app stops; returns it."""
        self.on_startup.append(store.open)
        self.on_shutdown.append(store.close)
        return store

    def authenticate(self, request: HTTPConnection, token: str | None = None) -> Caller:
        """The caller of ``request``'s key: its ``Authorization: Bearer`` header's, else its
        ``x-api-key`` header's (as Anthropic's SDK sends it), else ``token`` (a WebSocket's key,
        sent another way)."""
        token = bearer_token(request.headers.get("authorization")) or request.headers.get("x-api-key") or token
        if token is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", "missing_api_key")
        caller = self.keys.lookup(token)
        if caller is None and self.accounts is not None:
            caller = self.accounts.lookup(token)
        if caller is None:
            raise APIError(401, "incorrect API key provided", "invalid_api_key")
        if self.accounts is not None:
            caller = self.accounts.for_http(caller)
            request.state.caller = caller  # its rate-limit headers go on the response
        note(key_id=caller.key_id, tier=caller.tier)  # the request log knows the key by its id only
        resolve_as(self.accounts, caller)  # adapters outside its allow-lists do not exist for it
        return caller

    def caller_of(self, key_id: str) -> Caller | None:
        """The caller of the key whose id is ``key_id`` as it stands now (a configured key's, else
        an active managed key's, at its current tier), or None: a key taken out of its file or
        revoked. What a realtime client secret that key made is redeemed as."""
        caller = self.keys.by_id(key_id)
        if caller is None and self.accounts is not None:
            caller = self.accounts.current(key_id)
        if caller is not None and self.accounts is not None:
            caller = self.accounts.for_http(caller)
        return caller

    def admit_caller(self, request: Request) -> Caller:
        """Authenticate a model request and refuse it at once (429) if its tier can neither start
        nor queue: before its body is read or parsed. One that passes counts as demand from here
        (``Gate.arrive``: batch work pauses while its body is read and parsed) until it reaches
        the gate in ``hold``, fails on the way (``left_door``), or ``DOOR_WINDOW_S`` passes."""
        caller = self.authenticate(request)
        try:
            self.gate.refuse_if_full(caller.tier)
        except Rejected as exc:
            raise _too_many(self.gate, caller.tier, exc) from None
        _arrival.set(self.gate.arrive(caller.tier))
        own_uses()
        return caller

    def left_door(self) -> None:
        """The request failed between the door and the gate (bad input, say): it stops counting
        as demand now rather than when ``DOOR_WINDOW_S`` passes."""
        self.gate.left(_arrival.get())

    def require_admin(self, request: Request) -> Caller:
        caller = self.authenticate(request)
        if not caller.admin:
            raise APIError(403, "this endpoint needs an admin key", "admin_only")
        return caller

    def spec(self, name: str, kind: str | tuple[str, ...]) -> ModelSpec:
        """The spec of the model ``name`` (or an alias) calls; 404 for none, or for one this task's
        key may not use (``may_use``: named as asked, never by the name an alias hides, before its
        kind is said; a model the server picks for a request, a chat model's speech model or a turn
        judge, is picked among those the key may use); 400 for one of another kind (``kind``, or any of several),
        an adapter of a model of another kind included (it is listed by /v1/models: refused as its
        base is; one the key may not use stays a 404)."""
        spec = self.arbiter.specs.get(self.aliases.get(name, name))
        if spec is not None and not may_use(spec.name):
            spec = None
        kinds = (kind,) if isinstance(kind, str) else kind
        wanted = " or ".join(a_kind(k) for k in kinds)
        if spec is None:
            adapter = self.adapters.base_of(name)
            if adapter is not None and adapter[1] not in kinds:
                raise bad_request(f"the model '{name}' is an adapter of {a_kind(adapter[1])} ('{adapter[0]}'), "
                                  f"not {wanted}", "model", "model_not_supported")
        if spec is None or spec.kind == "train":  # a fine-tuning trainer's weights: no request calls them
            raise not_found(f"the model '{name}' does not exist", "model", "model_not_found")
        if spec.kind not in kinds:
            raise bad_request(f"the model '{name}' is {a_kind(spec.kind)}, not {wanted}", "model", "model_not_supported")
        return spec

    def first_spec(self, kind: str, what: str) -> ModelSpec:
        """The first model of ``kind`` in tiers.yaml that this task's key may use: an endpoint's
        default when a request names none; 404 naming ``what`` (e.g. "moderation model"), and no
        model, when the server has none (none for this key)."""
        spec = next((s for s in self.arbiter.specs.values() if s.kind == kind and may_use(s.name)), None)
        if spec is None:
            raise not_found(f"this server has no {what}", "model", "model_not_found")
        return spec

    async def hold(self, tier: str, model: str, units: float) -> Held:
        """Admission then residency; 429 / 503 as OpenAI-shaped errors with Retry-After."""
        arrived = time.monotonic()
        try:
            ticket = await self.gate.acquire(tier, model, units, _arrival.get())
        except Rejected as exc:
            raise _too_many(self.gate, tier, exc) from None
        self.metrics.observe(self.metrics.queue_wait, ticket.queued_s, tier)
        rank = self.tier_rank[tier]
        try:
            lease = await self.arbiter.acquire(model, rank, is_batch=self.gate.tiers[tier].is_batch, used=_used.get())
        except Refused as exc:
            self.gate.turned_back(ticket, "model_protected")
            headers = {**retry_headers(exc.retry_after), **self.gate.rate_headers(tier, refused_for=exc.retry_after)}
            raise APIError(429, str(exc), "model_protected", headers=headers, type="rate_limit_error") from None
        except Unavailable as exc:
            self.gate.turned_back(ticket, "model_unavailable")
            headers = retry_headers(exc.retry_after) if exc.retry_after else {}
            raise APIError(503, str(exc), "model_unavailable", headers=headers) from None
        except BaseException:
            self.gate.release(ticket)
            raise
        self.gate.holds_its_model(tier)  # here, not in the gate's admission path (bench_admission times that)
        return Held(ticket, lease, self.gate, arrived)


def own_uses() -> None:
    """From here on, the current request (or Realtime session) and the tasks it starts keep one
    record of the models they used (``_used``): its later steps are not refused for the protection
    its earlier steps gave. ``admit_caller`` starts one for every model request."""
    _used.set({})


def _too_many(gate: Gate, tier: str, exc: Rejected) -> APIError:
    headers = {**retry_headers(exc.retry_after), **gate.rate_headers(tier, refused_for=exc.retry_after)}
    return APIError(429, str(exc), exc.reason, headers=headers, type="rate_limit_error")


def retry_headers(seconds: float) -> dict[str, str]:
    seconds = int(seconds)
    return {"retry-after": str(seconds), "retry-after-ms": str(seconds * 1000)}
