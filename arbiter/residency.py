"""The arbiter's owner: it keeps every model's state and carries out the policy's decisions.

All state lives on the event loop and changes only in plain (non-async) methods, so there are no
locks: a request for a model (``acquire``) registers a waiter and calls ``_schedule``, which asks
``arbiter.policy`` what to do for each waiter (best tier first) and starts the effects. Loads,
evictions and warm reloads are the workers' own calls (``workers.worker.Worker``: ``place``,
``to_host``, ``to_device``, ``release``), awaited one at a time per device; their completion comes
back to the loop and schedules again. Batch work is paused and resumed through a per-model
``threading.Event`` that the work checks at its step boundaries.

A resident worker whose engine died (``Worker.failure``: vLLM's engine core, which does not come
back by itself) is dropped as soon as the arbiter sees it, at a lease's end, a grant or a look at
the table: marked ``loading`` while it is released, then ``cold``, so that the next request for the
model places a fresh one (``engine_failed`` event). Its requests in flight fail with a 503.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from arbiter import footprint as fp
from arbiter import policy
from arbiter.events import EventLog
from arbiter.policy import ArbiterView, Evict, Fit, Impossible, ModelState, Refuse
from workers.base import ModelSpec, StepContext
from workers.registry import make_worker
from workers.worker import Worker

log = logging.getLogger("tiergate")


class Refused(Exception):
    """429: only recently used (protected) models stand in the way."""

    def __init__(self, retry_after: int, reason: str) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class Unavailable(Exception):
    """503: the model cannot be served now (failed load, cooling down, cannot fit, OOM)."""

    def __init__(self, reason: str, retry_after: int | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


@dataclass(eq=False)
class Lease:
    """A request's use of a resident model. ``context()`` makes the step context for its work:
    for batch work it carries the pause gate."""

    model: str
    tier: int
    is_batch: bool
    worker: Worker
    _arbiter: "Arbiter" = field(repr=False)
    released: bool = False
    swap_s: float = 0.0  # seconds of the load (evictions included) this request triggered
    used: dict[str, float] | None = field(default=None, repr=False)  # its request's own uses (``Arbiter.acquire``)

    def context(self) -> StepContext:
        if not self.is_batch:
            return StepContext()
        run = self._arbiter._may_run[self.model]
        return StepContext(pause_gate=self._arbiter._pause_gate(self.model), pause_check=lambda: not run.is_set())

    def release(self) -> None:
        self._arbiter.release(self)


@dataclass(eq=False)
class _Waiter:
    model: str
    tier: int
    is_batch: bool
    future: asyncio.Future
    swap_s: float = 0.0  # the load this waiter triggered, once it is done
    used: dict[str, float] | None = None  # its request's own uses (``Arbiter.acquire``)
    loads_only: bool = False  # ``Arbiter.load``: no lease, no serve


@dataclass
class Counters:
    loads: dict[str, int] = field(default_factory=dict)  # by model
    evictions: dict[tuple[str, str], int] = field(default_factory=dict)  # (model, reason)
    swap_seconds: dict[str, float] = field(default_factory=dict)  # by model
    last_load: dict[str, tuple[str, float]] = field(default_factory=dict)  # model -> (from place, seconds)
    batch_pauses: int = 0


class Arbiter:
    def __init__(
        self,
        specs: list[ModelSpec],
        device: torch.device,
        budget: int,
        host_cache_budget: int,
        protect_window_s: float,
        batch_rank: int,
        clock: Callable[[], float] = time.monotonic,
        worker_factory: Callable[[ModelSpec], Worker] = make_worker,
        events: EventLog | None = None,
        tier_names: Sequence[str] = (),
    ) -> None:
        self.specs = {s.name: s for s in specs}
        self.device = device
        self.budget = budget
        self.host_cache_budget = host_cache_budget
        self.protect_window_s = protect_window_s
        self.batch_rank = batch_rank
        self.clock = clock
        self._factory = worker_factory
        self.states = {s.name: ModelState(s.name, s.kind, _estimate(s)) for s in specs}
        self._declared = {s.name for s in specs if s.vram is not None}
        self.workers: dict[str, Worker] = {}  # loaded (resident or warm), or cold holding paused work
        self._waiters: list[_Waiter] = []
        self._loading: str | None = None
        self._loads: set[asyncio.Task] = set()  # the load under way (and an OOM retry's): cancelled at stop
        self._cooldowns: dict[str, policy.LoadCooldown] = {}
        self._may_run = {s.name: _set_event() for s in specs}
        self._others_busy = False
        self._oom_retried: set[str] = set()
        self.counters = Counters()
        self.events = events or EventLog()  # loads, evictions, refusals, pauses, OOM relief
        self.tier_names = list(tier_names)  # rank -> name, for the events
        self._paused: set[str] = set()  # models whose batch work is paused now
        self._later: asyncio.TimerHandle | None = None  # ``_look_again``'s timer

    # -- requests --------------------------------------------------------------------------------
    async def acquire(self, model: str, tier: int, is_batch: bool = False,
                      used: dict[str, float] | None = None) -> Lease:
        """Wait until ``model`` is resident and hold it for one request of ``tier``. ``used``: the
        request's own uses, one dict for all its leases (a chain: speech in, a chat, speech out):
        each lease's release writes in it when its use of its model ended, and a model protected
        only by the request's own use may be evicted for the request's next step; without it a
        chain whose models do not fit together would be refused by its own first step, again at
        every retry."""
        return await self._wait(_Waiter(model, tier, is_batch, asyncio.get_running_loop().create_future(), used=used))

    async def _wait(self, waiter: "_Waiter") -> "Lease | None":
        self._waiters.append(waiter)
        self._schedule(non_batch_only=not waiter.is_batch)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                if (lease := waiter.future.result()) is not None:
                    lease.release()
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        now = self.clock()
        if lease.used is not None:  # the same instant as its serve below: protected_until compares them
            lease.used[lease.model] = now
        self.states[lease.model] = _leased(self.states[lease.model], lease.tier, now, lease.is_batch, -1)
        self._drop_if_failed(lease.model)
        self._schedule(non_batch_only=not lease.is_batch)

    def set_demand(self, others_busy: bool) -> None:
        """Told by the admission gate whether any non-batch tier has work admitted or queued."""
        if others_busy != self._others_busy:
            self._others_busy = others_busy
            self._schedule(non_batch_only=True)  # pauses or resumes batch work; brings back a model it needs

    # -- admin -----------------------------------------------------------------------------------
    def pin(self, model: str, pinned: bool) -> None:
        self.states[model] = replace(self.states[model], pinned=pinned)
        self._schedule()

    async def load(self, model: str, tier: int = 0) -> None:
        """Make ``model`` resident with ``tier``'s right to make room (a preload, an admin's load),
        serving no one: it is no tier's use, so it gives the model no protection (a preload once
        locked even paid out of the memory it held, for a protection window nobody was served in:
        hunt 4 U3); until a request uses it, it is the first to make room."""
        await self._wait(_Waiter(model, tier, False, asyncio.get_running_loop().create_future(), loads_only=True))

    async def unload(self, model: str) -> bool:
        """Evict ``model`` to the host cache (or disk) now, if nothing runs on it."""
        state = self.states[model]
        if state.place != "resident" or state.running_nonbatch or state.running_batch or self._loading:
            return False
        plan = policy.host_cache_plan(self._view(), [model])
        self._loading = model  # the device is busy moving it
        try:
            await self._evict(Evict((model,), (), plan.to_warm, plan.to_cold, plan.drop_warm), "admin", None)
        finally:
            self._loading = None
            self._schedule()
        return True

    def table(self) -> list[dict]:
        for name in self.states:  # a dead engine shows as what it is, not as resident
            self._drop_if_failed(name)
        now = self.clock()
        rows = []
        for name, s in self.states.items():
            rows.append({
                "id": name,
                "kind": s.kind,
                "place": s.place,
                "footprint_bytes": s.footprint,
                "footprint_source": "declared" if name in self._declared else ("measured" if name in self.counters.loads else "estimated"),
                "last_tier": s.last_tier,
                "protected_until_s": max(0.0, s.protected_until(self.batch_rank, self.protect_window_s) - now),
                "pinned": s.pinned,
                "running": s.running_nonbatch + s.running_batch,
            })
        return rows

    async def stop(self) -> None:
        """Release every worker; a load under way first stops where it is (a vLLM engine's start
        abandoned, its processes ended): its worker is not yet among them, and the server's exit
        would otherwise wait for it to finish."""
        if self._later is not None:
            self._later.cancel()
        for task in self._loads:
            task.cancel()
        await asyncio.gather(*self._loads, return_exceptions=True)
        for worker in self.workers.values():
            await worker.release()
        self.workers.clear()

    def view(self) -> ArbiterView:
        """The state as the policy sees it now: places, footprints, budgets and their use."""
        return self._view()

    # -- the owner ---------------------------------------------------------------------------------
    def _view(self) -> ArbiterView:
        queued: dict[int, int] = {}
        for w in self._waiters:
            queued[w.tier] = queued.get(w.tier, 0) + 1
        return ArbiterView(self.states, self.budget, self.host_cache_budget, self.clock(), self.protect_window_s, queued)

    def _schedule(self, non_batch_only: bool = False) -> None:
        """Grant every waiter whose model is resident; start at most one load for the best of
        the rest; refuse the ones the policy refuses; then pause or resume batch work.

        ``non_batch_only``: what changed since the last call is a non-batch lease asked for or
        ended, or the other tiers' demand. While no batch work runs or is paused anywhere, that
        changes nothing the batch decisions depend on (``policy.batch_must_yield`` pauses only models with batch work; a model is
        brought back only for its paused batch work), so they are skipped unless this call
        granted batch work or started a load."""
        self._waiters.sort(key=lambda w: w.tier)  # stable: arrival order within a tier
        draining: dict[str, int] = {}  # a busy model -> the highest tier waiting for its work to end
        for w in list(self._waiters):
            if w.future.done():
                self._waiters.remove(w)
                continue
            state = self.states[w.model]
            if state.place == "resident" and not self._drop_if_failed(w.model):
                if draining.get(w.model, w.tier) < w.tier:  # no new lower-tier work: the higher tier goes first
                    if not w.is_batch:  # (batch work waits: it yields anyway)
                        self._fail(w, Refused(1, f"{w.model} is being freed for a higher tier's request"))
                    continue
                self._grant(w)
                continue
            if self.states[w.model].place == "loading":
                continue
            if self._loading is not None:  # the device is busy: nothing starts, but what this waiter drains holds
                decision = policy.plan_load(self._view(), w.model, w.tier, self.batch_rank, w.used or {})
                for name in decision.drain if isinstance(decision, Impossible) else ():
                    draining.setdefault(name, w.tier)
                continue
            cooldown = self._cooldowns.get(w.model)
            if cooldown and cooldown.active(self.clock()):
                self._fail(w, Unavailable(f"loading {w.model} failed recently; cooling down", cooldown.retry_after(self.clock())))
                continue
            decision = policy.plan_load(self._view(), w.model, w.tier, self.batch_rank, w.used or {})
            if isinstance(decision, Refuse):
                self._fail(w, Refused(decision.retry_after, decision.reason))
            elif isinstance(decision, Impossible) and not decision.waiting_on:
                self._fail(w, Unavailable(decision.reason))
            elif isinstance(decision, (Fit, Evict)):
                if min(draining.values(), default=w.tier) < w.tier:  # a higher tier counts on every free byte
                    if not w.is_batch:
                        self._fail(w, Refused(1, f"the memory {w.model} needs is being freed for a higher tier's "
                                                 "request"))
                    continue
                self._start_load(w.model, decision if isinstance(decision, Evict) else None, w.tier, w)
            else:  # Impossible with waiting_on: stay queued until that work ends, lower tiers starting none
                for name in decision.drain:
                    draining.setdefault(name, w.tier)
        if non_batch_only and self._loading is None and self._batch_idle():
            return
        self._bring_back_batch()
        self._apply_batch_yield()

    def _batch_idle(self) -> bool:
        """No batch work runs or is paused on any model."""
        if self._paused:
            return False
        for state in self.states.values():
            if state.running_batch:
                return False
        return True

    def _bring_back_batch(self) -> None:
        """Batch work paused on a model that was evicted meanwhile: when nothing else waits and
        the other tiers are idle, load the model again so the work can resume where it stopped."""
        if self._waiters or self._loading is not None or self._others_busy:
            return
        for name, state in self.states.items():
            if state.running_batch > 0 and state.place in ("warm", "cold"):
                cooldown = self._cooldowns.get(name)
                if cooldown and cooldown.active(self.clock()):  # its last load failed: look again after the
                    self._look_again(cooldown.retry_after(self.clock()))  # cooldown, not at once (a busy loop)
                    return
                decision = policy.plan_load(self._view(), name, self.batch_rank, self.batch_rank)
                if isinstance(decision, (Fit, Evict)):
                    self._start_load(name, decision if isinstance(decision, Evict) else None, self.batch_rank)
                elif isinstance(decision, Refuse):  # look again when the protection ends
                    self._look_again(decision.retry_after)
                return

    def _look_again(self, seconds: float) -> None:
        """Schedule again in ``seconds``, or sooner where a timer set before comes first: one timer
        (each pass that found the same wait added a timer of its own); the pass it runs sets the
        next one still needed."""
        loop = asyncio.get_running_loop()
        at = loop.time() + seconds
        if self._later is not None:
            if loop.time() < self._later.when() <= at and not self._later.cancelled():
                return
            self._later.cancel()
        self._later = loop.call_at(at, self._schedule)

    def _grant(self, w: _Waiter) -> None:
        self._waiters.remove(w)
        if w.loads_only:  # resident now, and nobody served
            w.future.set_result(None)
            return
        self.states[w.model] = _leased(self.states[w.model], w.tier, self.clock(), w.is_batch, +1)
        w.future.set_result(Lease(w.model, w.tier, w.is_batch, self.workers[w.model], self, swap_s=w.swap_s,
                                  used=w.used))

    def _fail(self, w: _Waiter, exc: Exception) -> None:
        self._waiters.remove(w)
        w.future.set_exception(exc)
        self.events.emit("refusal", tier=self._tier(w.tier), model=w.model,
                         reason="model_protected" if isinstance(exc, Refused) else "model_unavailable",
                         retry_after_s=getattr(exc, "retry_after", None))

    def _tier(self, rank: int) -> str:
        return self.tier_names[rank] if rank < len(self.tier_names) else str(rank)

    def _apply_batch_yield(self) -> None:
        must_pause = policy.batch_must_yield(self._view(), self.batch_rank, self._others_busy)
        paused = set()
        for name, event in self._may_run.items():
            run = name not in must_pause and self.states[name].place == "resident"
            if run and not event.is_set():
                event.set()
            elif not run and event.is_set():
                if self.states[name].running_batch > 0:
                    self.counters.batch_pauses += 1
                event.clear()
            if not run and self.states[name].running_batch > 0:
                paused.add(name)
        for name in sorted(paused - self._paused):
            self.events.emit("batch_paused", model=name)
        for name in sorted(self._paused - paused):
            self.events.emit("batch_resumed", model=name)
        self._paused = paused

    def _pause_gate(self, model: str) -> Callable[[StepContext], None]:
        event = self._may_run[model]

        def gate(ctx: StepContext) -> None:
            while not event.wait(0.05):
                if ctx.cancelled:
                    return

        return gate

    def _start_load(self, model: str, evict: Evict | None, tier: int, trigger: _Waiter | None = None) -> None:
        """Load ``model`` (after ``evict``); the waiter whose request caused it, if any, is
        charged the seconds it takes (``Lease.swap_s``)."""
        self._loading = model
        prior_place = self.states[model].place
        self.states[model] = replace(self.states[model], place="loading")
        self._moving(evict)
        self.events.emit("load_started", model=model, from_place=prior_place, tier=self._tier(tier))
        for name in evict.pause_batch_on if evict else ():
            if self._may_run[name].is_set():  # (batch work the gate's demand paused already counted then)
                self.counters.batch_pauses += 1
            self._may_run[name].clear()
            if name not in self._paused:
                self._paused.add(name)
                self.events.emit("batch_paused", model=name)
        task = asyncio.get_running_loop().create_task(self._load_task(model, evict, prior_place, tier, trigger))
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    def _moving(self, evict: Evict | None) -> None:
        """Mark ``evict``'s victims busy (``loading``) now, as their eviction is decided, not when
        its task first runs: until then a waiter for one of them was granted it, in the same
        pass of ``_schedule`` or the next, and ran on a model being evicted (hunt 4 U1)."""
        for name in evict.victims if evict else ():
            self.states[name] = replace(self.states[name], place="loading")

    async def _load_task(self, model: str, evict: Evict | None, prior_place: str, tier: int,
                         trigger: _Waiter | None = None) -> None:
        started = time.perf_counter()
        failure: Exception | None = None
        try:
            if evict is not None:
                await self._evict(evict, "make_room", (model, tier))
            worker, seconds, footprint = await self._bring_in(model, prior_place)
        except Exception as exc:  # noqa: BLE001 - a failed load answers 503 and cools down (out of memory: retried once)
            failure = exc
            if prior_place == "warm" and not isinstance(exc, torch.OutOfMemoryError) and model in self.workers:
                # it goes cold below: its host copy (and engine thread) freed first, not dropped unreleased
                await _release_anyway(model, self.workers[model])
        finally:
            # The device is free before anything below schedules: a load the failure's handling
            # starts (the OOM retry, the next waiter's) is not cleared by this one's end, and no
            # waiter is left waiting on a load that ended.
            self._loading = None
        if isinstance(failure, torch.OutOfMemoryError):
            self._after_oom(model, prior_place, tier, failure)
            return
        if failure is not None:
            log.error("loading %s failed: %s: %s", model, type(failure).__name__, failure)
            # the reason reaches callers of every tier (503) and /readyz: the log has the folder, they do not
            public = without_folder(str(failure), self.specs[model])
            self._after_failure(model, f"loading {model} failed: {type(failure).__name__}: {public}")
            return
        self.workers[model] = worker
        if trigger is not None:
            trigger.swap_s = time.perf_counter() - started
        state = self.states[model]
        if model in self._declared:
            footprint = state.footprint
        self.states[model] = replace(state, place="resident", footprint=footprint)
        self._cooldowns.pop(model, None)
        self._oom_retried.discard(model)
        self.counters.loads[model] = self.counters.loads.get(model, 0) + 1
        self.counters.swap_seconds[model] = self.counters.swap_seconds.get(model, 0.0) + seconds
        self.counters.last_load[model] = (prior_place, seconds)
        self.events.emit("load_finished", model=model, from_place=prior_place, seconds=round(seconds, 4),
                         footprint_bytes=self.states[model].footprint)
        self._schedule()

    def _after_failure(self, model: str, reason: str) -> None:
        self.events.emit("load_failed", model=model, reason=reason)
        self._went_cold(model)
        self._cooldowns[model] = policy.after_load_failure(self._cooldowns.get(model), self.clock())
        retry = self._cooldowns[model].retry_after(self.clock())
        for w in [w for w in self._waiters if w.model == model]:
            self._fail(w, Unavailable(reason, retry))
        self._schedule()

    def _drop_if_failed(self, model: str) -> bool:
        """Whether ``model`` is resident on a worker that failed (``Worker.failure``: its engine
        died); if so, start dropping it: ``loading`` (its memory still taken) until its worker is
        released, then ``cold``, and the next request loads it again."""
        worker = self.workers.get(model)
        if self.states[model].place != "resident" or worker is None:
            return False
        reason = worker.failure
        if reason is None:
            return False
        log.error("%s failed: %s; it is dropped and loaded again for its next request", model, reason)
        self.states[model] = replace(self.states[model], place="loading")
        self.events.emit("engine_failed", model=model, reason=without_folder(reason, self.specs[model]))
        asyncio.get_running_loop().create_task(self._drop_failed(model, worker))
        return True

    async def _drop_failed(self, model: str, worker: Worker) -> None:
        try:
            await worker.release()  # its processes and memory: the engine shuts down
        except Exception:  # noqa: BLE001 - it is dropped all the same; the next load starts afresh
            log.exception("releasing the failed %s", model)
        finally:
            self._went_cold(model)  # (batch work paused on it keeps the object: placed again, it resumes)
            self._schedule()

    def _after_oom(self, model: str, prior_place: str, tier: int, exc: Exception) -> None:
        """Out of memory while loading: evict the least valuable model and retry once."""
        self.states[model] = replace(self.states[model], place="cold" if prior_place == "cold" else prior_place)
        victim = policy.pick_oom_victim(self._view(), {model}, tier, self.batch_rank)
        if model in self._oom_retried or victim is None:
            self._oom_retried.discard(model)
            self._after_failure(model, f"out of memory loading {model}: {exc}")
            return
        self._oom_retried.add(model)
        self.events.emit("oom_relief", model=model, victim=victim.victims[0], tier=self._tier(tier))
        self._start_load(model, victim, tier)

    async def relieve_oom(self, model: str, tier: int) -> bool:
        """Out of memory during a step of ``model``: evict the least valuable other model that
        ``tier`` may evict and return once that eviction has finished, so the caller's one retry
        finds the memory free. False (nothing evicted) when there is no such model or the device
        is busy loading. The eviction runs to its end even if the caller is cancelled."""
        victim = policy.pick_oom_victim(self._view(), {model}, tier, self.batch_rank)
        if victim is None or self._loading is not None:
            return False
        self._loading = victim.victims[0]
        self._moving(victim)
        self.events.emit("oom_relief", model=model, victim=victim.victims[0], tier=self._tier(tier))

        async def run() -> None:
            try:
                await self._evict(victim, "oom", (model, tier))
            finally:
                self._loading = None
                self._schedule()

        await asyncio.shield(asyncio.get_running_loop().create_task(run()))
        return True

    # -- effects ------------------------------------------------------------------------------------
    async def _bring_in(self, model: str, prior_place: str) -> tuple[Worker, float, int]:
        """Place the model from disk (cold) or bring its host copy back (warm). Returns the
        worker, the seconds it took and the bytes it occupies: measured (plus the kind's margin)
        for a worker whose weights live in this process, its reservation for one whose memory
        lives in other processes. A failed attempt frees what it took, except a host copy."""
        start = time.perf_counter()
        before = fp.cuda_allocated(self.device) if self.device.type == "cuda" else 0
        worker = self.workers.get(model)  # warm, or cold holding paused work
        if worker is None:
            worker = self._factory(self.specs[model])
        try:
            if prior_place == "warm":
                await worker.to_device(self.device)
            else:
                await worker.place(self.device)
            footprint = _estimate(self.specs[model]) if worker.reserves_memory else await asyncio.to_thread(
                self._measure, worker, before)
        except BaseException:
            if prior_place != "warm":
                await worker.release()
            raise
        return worker, time.perf_counter() - start, footprint

    def _measure(self, worker: Worker, before: int) -> int:
        """(thread) The bytes a just-placed in-process worker occupies, with its kind's margin, and
        a trainer's room for training (``training_bytes``: not allocated until a job trains, so not
        in the measurement; without it, after its first load the trainer's room was given away)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            measured = fp.cuda_allocated(self.device) - before
        else:
            measured = fp.measure_modules(worker.modules())
        training = int(worker.spec.options.get("training_bytes") or 0)
        return fp.footprint_from_measurement(measured, worker.spec.kind) + training

    async def _evict(self, evict: Evict, reason: str, cause: tuple[str, int] | None) -> None:
        """Carry out an eviction: the victims are marked busy (``loading``) while their weights
        move, then recorded in their new place: ``warm`` when the worker kept a host copy, else
        ``cold``. A worker that goes cold while batch work is paused on it keeps its object, so
        that work resumes on it once the model is placed again. ``cause`` is the requesting
        model and tier (None for an admin unload), for the events."""
        by = {"by_model": cause[0], "by_tier": self._tier(cause[1])} if cause else {"by_model": None, "by_tier": None}
        for name in evict.victims:
            self.states[name] = replace(self.states[name], place="loading")
        for name in evict.drop_warm:
            if name in self.workers:
                await _release_anyway(name, self.workers[name])
            self._went_cold(name)
            self.events.emit("eviction", model=name, from_place="warm", to_place="cold", reason="host_cache", **by)
        pin = self.device.type == "cuda"
        for name in evict.victims:
            worker = self.workers.get(name)
            warm = False
            if worker is not None:
                try:
                    if name in evict.to_warm:
                        warm = await worker.to_host(pin)
                    else:
                        await worker.release()
                except Exception:  # noqa: BLE001 - a move that failed (pinning host memory) must not strand it
                    # ``loading`` for good: its requests waited forever and its bytes stayed counted
                    log.exception("evicting %s failed; it is released and goes cold", name)
                    warm = False
                    await _release_anyway(name, worker)
            if warm:
                self.states[name] = replace(self.states[name], place="warm")
            else:
                self._went_cold(name)
            key = (name, reason)
            self.counters.evictions[key] = self.counters.evictions.get(key, 0) + 1
            self.events.emit("eviction", model=name, from_place="resident", to_place=self.states[name].place,
                             reason=reason, **by)
        if torch.cuda.is_available():
            await asyncio.to_thread(torch.cuda.empty_cache)

    def _went_cold(self, name: str) -> None:
        """Record ``name`` as cold (its weights are freed); keep its worker only while paused
        batch work holds it."""
        if self.states[name].running_batch == 0:
            self.workers.pop(name, None)
        self.states[name] = replace(self.states[name], place="cold")


def _leased(state: ModelState, tier: int, now: float, is_batch: bool, delta: int) -> ModelState:
    """``policy.served(state, tier, now)`` with ``delta`` more (or fewer) leases of the kind in
    flight: one new state per lease change instead of two. (Twice per request: its fields are
    copied whole rather than through ``dataclasses.replace``, which looks each one up by name.)"""
    fields = vars(state).copy()
    fields["served_at"] = {**state.served_at, tier: now}
    if is_batch:
        fields["running_batch"] = state.running_batch + delta
    else:
        fields["running_nonbatch"] = state.running_nonbatch + delta
    return ModelState(**fields)


def _estimate(spec: ModelSpec) -> int:
    """The footprint before loading: declared, else weights plus margin (plus an engine's KV cache,
    or a trainer's room for training).
    A ValueError names the model (a folder without weights)."""
    if spec.vram is not None:
        return spec.vram
    try:
        weights = fp.estimate_footprint(spec.path, spec.kind)
    except ValueError as exc:
        raise ValueError(f"model {spec.name!r}: {exc}") from None
    return weights + int(spec.options.get("kv_cache_bytes") or 0) + int(spec.options.get("training_bytes") or 0)


async def _release_anyway(name: str, worker: Worker) -> None:
    """Release ``worker`` for an eviction; a failure is logged, and the model counts as cold all
    the same (its next load starts afresh)."""
    try:
        await worker.release()
    except Exception:  # noqa: BLE001
        log.exception("releasing %s failed; it counts as cold", name)


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


def without_folder(message: str, spec: ModelSpec) -> str:
    """``message`` with the model's folder (as configured and resolved) written as its name's:
    a library's error names the server's files, which are no caller's business."""
    for folder in sorted({str(spec.path), os.path.realpath(spec.path), os.path.abspath(spec.path)}, key=len,
                         reverse=True):
        message = message.replace(folder, f"<{spec.name}'s folder>")
    return message
