"""The batch runner: one per process, it claims lines from the store, runs each through its
endpoint's serving core at the batch tier, records the outcome, and finishes batches.

A batch goes ``validating`` -> ``in_progress`` -> ``finalizing`` -> ``completed`` (or ``expired``
after 24 hours), or ``cancelling`` -> ``cancelled``, or ``failed`` when its input file has no
request at all. Bad lines do not fail a batch: they go to its error file, like requests the
endpoint refused. Every line runs as the batch's owner at the batch tier, whoever submitted it,
so batch work only ever uses an otherwise idle GPU.

The runner keeps every engine its lines need full: lines are claimed by shape (``batch.shapes``:
the model and adapter stack a line runs on), one shape per model at a time, each up to its
model's engine width (a chat engine's ``max_num_seqs``), so lines that run together share
forward passes and a merged stack, and a batch of many stacks does not make the engine re-merge
between lines. ``batch.concurrency``, when set, caps the lines in flight per process, as does the
batch tier's ``max_inflight``. The runner does not watch the other tiers: while they have work,
the gate holds new batch lines back and the arbiter pauses running ones at their next step, and
when they are done the same lines go on, the engine full again. For each line it calls the
endpoint (``batch.endpoints``: waiting at the gate like any batch-tier request; a 429 means
"later", never failure), and records the outcome. What survives a crash, and why nothing is recorded twice, is
the store's business (``batch.store``); the runner only has to keep its claims alive (``touch``)
while it works on them and give them back when it stops.

A line's usage is written by the serving core when the line's model work ends, before its outcome
is recorded, and to another store: a process that dies between the two leaves a metered line that
runs again elsewhere. So each line runs with its metering ids (``gateway.auth.Metering``:
``{batch_id}:{index}:{k}`` for its k-th serving block), the same in every attempt and delivery,
and the usage store counts each id once (``accounts.store``): the first delivery's usage is the
one kept. A batch that stops (cancelled, expired) has its lines' error outcomes filled in only once
no live process runs them (``_fill_stopped``): a line that ended first was metered, and keeps its
own outcome, so the owner is metered for what the output file shows.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import secrets
import socket
import time
import uuid
from pathlib import Path
from collections import Counter
from dataclasses import replace
from typing import Any, Awaitable, Literal

from batch.endpoints import ENDPOINTS, Endpoint, line_body
from batch.lines import error_line, parse_input, response_line, total_usage
from batch.redis_store import RedisStore
from batch.shapes import model_of, shape_of, width
from batch.sqlite_store import SQLiteStore
from batch.store import TERMINAL, BatchInfo, FileInfo, Job, Line, Outcome, Store
from gateway.adapters import resolve_as
from gateway.auth import Caller, Metering
from gateway.errors import APIError
from gateway.service import Services
from storage import Along, on_backend
from storage.outage import Outage, unanswered
from storage.redis import honour_cancel

log = logging.getLogger("tiergate.batches")

MAX_DELIVERIES = 5  # a line whose process died this many times running it is recorded as failed
MAX_STREAK = 8  # starts in a row of one shape on a model before an older shape goes first
RETRIES_503 = 5  # "model unavailable" is retried this often before the line fails
SLICE = 1000  # lines whose shapes are worked out between two turns of the event loop's other work


def runner_for(svc: Services) -> Runner:
    """The process's runner on the configured store, started and stopped with the app."""
    cfg = svc.config.batch
    data_dir = svc.config.data_dir()
    runner = Runner(svc, open_store(cfg.store, data_dir))
    svc.on_startup.append(runner.start)
    svc.on_shutdown.append(runner.stop)
    return runner


def open_store(spec: str, data_dir: Path) -> Store:
    """The batch store on ``spec``'s backend (``storage.on_backend``): the batch store's SQLite file in
    ``data_dir``, or Redis at that URL."""
    return on_backend(spec, lambda: SQLiteStore(data_dir / "batches.sqlite3"), RedisStore)


class Runner:
    """Claims lines from the store, runs them at the batch tier, records their outcomes, and
    finishes batches. One per process; any number of processes may share a store."""

    def __init__(self, svc: Services, store: Store, endpoints: dict[str, Endpoint] | None = None) -> None:
        cfg = svc.config.batch
        self.svc = svc
        self.store = store
        self.endpoints = dict(ENDPOINTS if endpoints is None else endpoints)  # url -> what runs its lines
        self.tier = next((t.name for t in svc.gate.tiers.values() if t.is_batch), svc.config.tier_names[-1])
        tier_cap = svc.gate.tiers[self.tier].max_inflight
        self.concurrency = tier_cap if cfg.concurrency is None else min(cfg.concurrency, tier_cap)  # per process
        self.reclaim_after_s = cfg.reclaim_after_s
        self.tick_s = min(1.0, cfg.reclaim_after_s / 4)  # heartbeat: well inside the reclaim timeout
        self.poll_s = 0.5  # how often an idle runner looks for work other processes queued
        self.name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.recorded = 0  # lines whose outcome this process wrote (tests, logs)
        self._running: dict[str, tuple[Job, asyncio.Task]] = {}
        self._dropping: set[str] = set()  # tokens of jobs cancelled because their batch stopped
        self._batches: dict[str, BatchInfo] = {}  # batches of running jobs, refreshed every tick
        self._soon: dict[tuple[str, str], asyncio.Task] = {}
        self._loops: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        self._shapes_at = -math.inf  # when the claim loop last listed the store's shapes
        self._last_shape: dict[str, str] = {}  # model -> the shape whose lines it ran last
        self._streak: Counter[str] = Counter()  # model -> starts in a row of that shape
        # each loop says once that the store does not answer, and once that it is back
        self._outages = {name: Outage(log, f"batch: {name}") for name in ("claiming lines", "heartbeat", "sweep")}

    async def start(self) -> None:
        await self.store.open()
        self._wake = asyncio.Event()
        self._loops = [asyncio.create_task(loop(), name=f"batch-{loop.__name__}")
                       for loop in (self._claim_loop, self._heartbeat_loop, self._sweep_loop)]
        log.info("batch runner %s: engine widths, at most %d lines at a time, at the %s tier, store %s", self.name,
                 self.concurrency, self.tier, type(self.store).__name__)

    async def stop(self) -> None:
        """Stop claiming, abandon running lines and hand them back for others (or the next start)."""
        await self.hand_back()
        await self.store.close()
        log.info("batch runner %s stopped: recorded %d lines", self.name, self.recorded)

    async def hand_back(self) -> str:
        """Stop claiming and abandon running lines, handing them back to the store (a drain does
        this first; the store stays open). Says how many went back."""
        loops, self._loops = self._loops, []
        for t in loops:
            t.cancel()
        # the loops end first: a claim whose store swallowed the cancel (``storage.redis``) starts
        # the lines it claimed before its loop sees the stop, and those are handed back too
        await asyncio.gather(*loops, return_exceptions=True)
        tasks = [t for _, t in self._running.values()] + list(self._soon.values())
        unfinished = [job for job, _ in self._running.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._running.clear()  # a task cancelled before it ran never removed itself
        try:
            await self.store.release(self.name, unfinished)
        except Exception:  # noqa: BLE001 - they will be reclaimed after the timeout instead
            log.warning("could not hand back %d batch lines; they run again after %gs",
                        len(unfinished), self.reclaim_after_s)
            return f"{len(unfinished)} batch lines will be reclaimed after {self.reclaim_after_s:g}s"
        return f"{len(unfinished)} batch line{'s' * (len(unfinished) != 1)} handed back to the store"

    def soon(self, what: Literal["validate", "finish"], batch_id: str) -> None:
        """Validate or finish ``batch_id`` in the background (once at a time per process)."""
        key = (what, batch_id)
        if key in self._soon:
            return
        work = self._validate(batch_id) if what == "validate" else self._finish(batch_id)
        task = asyncio.create_task(self._logged(work, f"{what} {batch_id}"))
        self._soon[key] = task
        task.add_done_callback(lambda _: self._soon.pop(key, None))

    @staticmethod
    async def _logged(work: Awaitable[None], what: str) -> None:
        try:
            await work
        except Exception as exc:  # noqa: BLE001 - the sweep tries again
            if not unanswered(exc):
                log.exception("batch: %s failed; will retry", what)
            else:  # (the sweep's own outage line says the store is down)
                log.info("batch: %s waits for the store: %s", what, exc)

    # -- loops
    async def _claim_loop(self) -> None:
        while True:
            try:
                claimed = await self._claim()
                self._outages["claiming lines"].answered()
            except Exception as exc:  # noqa: BLE001 - the store is down: keep trying
                self._outages["claiming lines"].failed(exc)
                claimed = 0
            honour_cancel()  # a cancel the store's client swallowed (storage.redis)
            if claimed:
                continue
            self._wake.clear()
            try:  # not asyncio.wait_for: on 3.11 it can swallow the stop's cancel (gh-86296)
                async with asyncio.timeout(self.poll_s):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _claim(self) -> int:
        """Fill the engines: top up each shape running here to its model's width, then start a
        waiting shape on every model with nothing running here: the shape that model ran last
        while it has lines left (so a shape whose rows all ended in the same step is not left for
        another stack and come back to: a merge each time), at most ``MAX_STREAK`` starts in a row
        so older shapes are not starved; else the oldest. Returns the lines claimed."""
        running = Counter(job.line.shape for job, _ in self._running.values())
        busy = {model_of(shape) for shape in running}
        claimed = 0
        for shape, n in list(running.items()):
            claimed += await self._take(shape, width(self.svc, model_of(shape)) - n)
        now = time.monotonic()
        if self.concurrency - len(self._running) <= 0 or (running and now - self._shapes_at < self.poll_s):
            return claimed  # new shapes are looked for every poll_s while lines run (a scan of the backlog)
        self._shapes_at = now
        waiting = await self.store.shapes(self.reclaim_after_s)
        last = [shape for model, shape in self._last_shape.items()
                if shape in waiting and self._streak[model] < MAX_STREAK]
        for shape in last + [shape for shape in waiting if shape not in last]:
            model = model_of(shape)
            if model not in busy:
                taken = await self._take(shape, width(self.svc, model))
                if taken:
                    busy.add(model)
                    self._streak[model] = self._streak[model] + 1 if self._last_shape.get(model) == shape else 1
                    self._last_shape[model] = shape
                claimed += taken
        return claimed

    async def _take(self, shape: str, room: int) -> int:
        """Claim and start up to ``room`` lines of ``shape`` (within the process's cap)."""
        room = min(room, self.concurrency - len(self._running))
        if room <= 0:
            return 0
        jobs = await self.store.claim(self.name, room, self.reclaim_after_s, shape)
        for job in jobs:
            if job.token not in self._running:  # not one of ours that was slow to be touched
                self._running[job.token] = (job, asyncio.create_task(self._run(job)))
        return len(jobs)

    async def _heartbeat_loop(self) -> None:
        """Keep our claims alive, and drop lines of batches that stopped (cancelled, expired)."""
        while True:
            honour_cancel()
            await asyncio.sleep(self.tick_s)
            running = dict(self._running)  # lines claimed while we await are looked at next tick
            try:
                await self.store.touch(self.name, [job for job, _ in running.values()])
                latest = {b: await self.store.get_batch(b) for b in {job.batch_id for job, _ in running.values()}}
            except Exception as exc:  # noqa: BLE001
                self._outages["heartbeat"].failed(exc)
                continue
            self._outages["heartbeat"].answered()
            self._batches = {b: info for b, info in latest.items() if info is not None}
            for token, (job, task) in running.items():
                if _stopped(latest[job.batch_id]) and token in self._running:
                    self._dropping.add(token)
                    task.cancel()

    async def _sweep_loop(self) -> None:
        """Pick up what a dead process left: unvalidated or unfinished batches, and expiry."""
        sweep_s = max(self.tick_s, min(5.0, self.reclaim_after_s / 2))
        while True:
            try:
                await self._sweep()
                self._outages["sweep"].answered()
            except Exception as exc:  # noqa: BLE001
                self._outages["sweep"].failed(exc)
            honour_cancel()
            await asyncio.sleep(sweep_s)

    async def _sweep(self) -> None:
        now = int(time.time())
        gone = await self.store.delete_expired_files(now)
        if gone and self.svc.vector_stores is not None:  # an expired document's text leaves the stores too
            await self.svc.vector_stores.remove_everywhere(gone)
        for batch_id in await self.store.open_batches():
            batch = await self.store.get_batch(batch_id)
            if batch is None:
                continue
            if batch.status == "validating":
                self.soon("validate", batch_id)
            elif batch.status in ("cancelling", "finalizing") or batch.done >= batch.total or now >= batch.expires_at:
                self.soon("finish", batch_id)

    # -- one line
    async def _run(self, job: Job) -> None:
        outcome: Outcome | None = None
        try:
            batch = self._batches.get(job.batch_id) or await self.store.get_batch(job.batch_id)
            if _stopped(batch):
                await self.store.ack(job)  # cancelled or over: its outcome is (or will be) filled in
                return
            self._batches.setdefault(job.batch_id, batch)
            if job.deliveries > MAX_DELIVERIES:
                outcome = error_line(job.line.index, job.line.custom_id, "too_many_attempts",
                                     f"the request was started {job.deliveries - 1} times and never finished")
            else:
                outcome = await self._call(batch, job.line)
            recorded = await self.store.record(job, outcome)
            if recorded.new:
                self.recorded += 1
                if recorded.done >= recorded.total:
                    self.soon("finish", job.batch_id)
        except asyncio.CancelledError:
            if job.token in self._dropping:  # its batch stopped: the entry goes, and the finisher fills its outcome,
                # unless the line had ended (and was metered) first: then that outcome is its own
                await asyncio.shield(self.store.ack(job) if outcome is None else self.store.record(job, outcome))
            raise
        except Exception as exc:  # noqa: BLE001 - the store failed: the line is reclaimed and runs again
            if not unanswered(exc):
                log.exception("batch: line %s of %s failed to record", job.line.custom_id, job.batch_id)
            else:  # (the loops' outage lines say the store is down)
                log.info("batch: line %s of %s not recorded, the store does not answer (%s); it runs again",
                         job.line.custom_id, job.batch_id, exc)
        finally:
            self._running.pop(job.token, None)
            self._dropping.discard(job.token)
            self._wake.set()

    async def _call(self, batch: BatchInfo, line: Line) -> Outcome:
        """Run one line as its batch's owner at the batch tier. Waiting is never failure: a 429
        (queue full, model protected) is retried after its Retry-After, for as long as it takes;
        a 503 a few times. Any other error is the line's outcome. Its usage is metered once
        (``gateway.auth.Metering``): an attempt after the first, here or after a reclaim, adds
        nothing to it."""
        endpoint = self.endpoints.get(batch.endpoint)
        attempt = 0
        while True:
            honour_cancel()  # a 429 is retried for as long as it takes: not past a stop
            request_id = f"req_{uuid.uuid4().hex}"
            # every attempt, here or in another process, writes its usage under the same ids
            caller = Caller(tier=self.tier, key_id=batch.owner, metering=Metering(f"{batch.id}:{line.index}"))
            if endpoint is None:
                return response_line(line, 404, APIError(404, f"{batch.endpoint} is not served here", "not_found").body(),
                                     request_id)
            resolve_as(self.svc.accounts, caller)  # its owner's allow-lists, as over HTTP
            try:
                status, body, headers = 200, line_body(await endpoint(self.svc, caller, dict(line.body))), {}
            except APIError as exc:
                status, body, headers = exc.status, exc.body(), exc.headers
            except Exception as exc:  # noqa: BLE001 - a bug or a worker crash: this line failed
                log.exception("batch: line %s of %s raised", line.custom_id, batch.id)
                err = APIError(500, f"the request failed: {type(exc).__name__}", "internal_error")
                status, body, headers = 500, err.body(), {}
            if status == 429 or (status == 503 and attempt < RETRIES_503):
                attempt += 1
                await asyncio.sleep(_backoff(headers, attempt))
                continue
            return response_line(line, status, body, request_id)

    # -- whole batches
    async def _ready_adapters(self, lines: list[Line]) -> None:
        """The folder adapters the lines name, each read once in a worker thread (``adapters.ready``),
        before the lines' shapes are worked out on the event loop. One whose files are being written
        is left for its lines to read when they run."""
        names: set[str] = set()
        for ln in lines:
            model, stack = ln.body.get("model"), ln.body.get("adapters")
            if isinstance(model, str):
                names.add(model)
            for choice in stack if isinstance(stack, list) else ():
                if isinstance(choice, dict) and isinstance(choice.get("name"), str):
                    names.add(choice["name"])
        for name in sorted(names):
            try:
                await self.svc.adapters.ready(name, None)
            except APIError as exc:  # its files are being written: its lines read it again when they run
                if exc.code != "adapter_changing":
                    raise

    async def _validate(self, batch_id: str) -> None:
        if not await self.store.lock(batch_id, self.name, self.reclaim_after_s):
            return  # another process is on it
        try:
            all_bad = await self._validate_locked(batch_id)
        finally:
            await self.store.unlock(batch_id, self.name)
        if all_bad:
            self.soon("finish", batch_id)

    async def _validate_locked(self, batch_id: str) -> bool:
        """Parse the input and start the batch; True if it started with nothing to run."""
        batch = await self.store.get_batch(batch_id)
        if batch is None or batch.status != "validating":
            return False
        content = await self.store.file_content(batch.input_file_id)
        if content is None:
            await self._fail(batch, "file_not_found", f"the input file {batch.input_file_id} was deleted")
            return False
        lines, invalid = await asyncio.to_thread(parse_input, content, batch.endpoint)
        await self._ready_adapters(lines)
        lines = await self._shaped(batch.endpoint, lines)
        if not lines and not invalid:
            await self._fail(batch, "empty_file", "the input file has no requests")
            return False
        if not await self.store.start(batch_id, lines, invalid, int(time.time())):
            return False
        models = {ln.body.get("model") for ln in lines}
        if len(models) == 1 and isinstance(model := models.pop(), str):  # several: none (OpenAI's take one)
            await self.store.set_status(batch_id, ["in_progress"], "in_progress", model=model)
        self._wake.set()
        return not lines

    async def _shaped(self, endpoint: str, lines: list[Line]) -> list[Line]:
        """``lines`` with their shapes. Worked out on the event loop (they read the models and
        adapters it keeps), a slice at a time: a 50,000-line batch's take most of a second, which
        would hold up every other request."""
        shaped: list[Line] = []
        for at in range(0, len(lines), SLICE):
            shaped += [replace(ln, shape=shape_of(self.svc, endpoint, ln.body)) for ln in lines[at:at + SLICE]]
            await asyncio.sleep(0)
        return shaped

    async def _fail(self, batch: BatchInfo, code: str, message: str) -> None:
        errors = {"object": "list", "data": [{"code": code, "message": message, "param": "input_file_id", "line": None}]}
        if await self.store.set_status(batch.id, ["validating"], "failed", self._event(batch, "failed"),
                                       failed_at=int(time.time()), errors=errors):
            self._ended()

    def _event(self, batch: BatchInfo, status: str) -> Along | None:
        """The webhook event of ``batch``'s end, written in the compare-and-set that ends it: only
        the process whose set ends it sends it, and no crash or stop right after loses it."""
        return None if self.svc.webhooks is None else self.svc.webhooks.along(f"batch.{status}", batch.id, batch.owner)

    def _ended(self) -> None:
        """A batch ended, its event in the outbox: the webhooks' delivery loop sends it now."""
        if self.svc.webhooks is not None:
            self.svc.webhooks.written()

    async def _finish(self, batch_id: str) -> None:
        if not await self.store.lock(batch_id, self.name, self.reclaim_after_s):
            return
        try:
            await self._finish_locked(batch_id)
        finally:
            await self.store.unlock(batch_id, self.name)

    async def _finish_locked(self, batch_id: str) -> None:
        """Write the output and error files and end the batch: ``completed``, ``expired`` (time ran
        out: what had not run gets a ``batch_expired`` error line) or ``cancelled`` (likewise,
        ``batch_cancelled``). Safe to repeat after a crash: the files get the same ids and
        content, and only one process's final compare-and-set succeeds."""
        now = int(time.time())
        batch = await self.store.get_batch(batch_id)
        if batch is None:
            return
        if batch.status == "in_progress":
            if now >= batch.expires_at:
                batch = await self._fill_stopped(batch_id, "batch_expired", "the batch expired before this request ran")
            if batch is None or batch.done < batch.total:
                return
            if await self.store.set_status(batch_id, ["in_progress"], "finalizing", finalizing_at=now):
                batch.status = "finalizing"
            else:
                batch = await self.store.get_batch(batch_id)  # cancelled meanwhile
        if batch.status == "cancelling":
            batch = await self._fill_stopped(batch_id, "batch_cancelled",
                                             "the batch was cancelled before this request ran")
            if batch is None or batch.status != "cancelling" or batch.done < batch.total:
                return
        elif batch.status != "finalizing":
            return
        outcomes = await self.store.outcomes(batch_id)
        usage, files, expired, succeeded = await asyncio.to_thread(_result_files, outcomes)  # (a big batch's: seconds)
        fields: dict[str, Any] = {"output_file_id": None, "error_file_id": None, "usage": usage}
        for ok, key, suffix in ((True, "output_file_id", "output"), (False, "error_file_id", "error")):
            content = files[ok]
            if content:
                expires = batch.output_expires_after_s
                info = FileInfo(f"file-{batch_id.removeprefix('batch_')}-{suffix}", batch.owner, "batch_output",
                                f"{batch_id}_{suffix}.jsonl", len(content), now, now + expires if expires else None)
                await self.store.put_file(info, content)
                fields[key] = info.id
        if batch.status == "cancelling":
            status = "cancelled"
        elif expired:
            status = "expired"
        else:
            status = "completed"
        fields[f"{status}_at"] = now
        if await self.store.set_status(batch_id, [batch.status], status, self._event(batch, status), **fields):
            self._ended()
            log.info("batch %s %s: %d completed, %d failed", batch_id, status, succeeded, len(outcomes) - succeeded)

    async def _fill_stopped(self, batch_id: str, code: str, message: str) -> BatchInfo | None:
        """Give each line of a stopped batch (cancelled, expired) that has no outcome the error
        ``code``, once no live process runs it: each line running is, within that process's
        heartbeat, either recorded (it ended first, and was metered: its outcome is kept, so what
        the owner is metered for is in the output) or cut unmetered and given up, and then filled.
        Returns the batch as it then stands; None if it is gone or the finishing lock lapsed."""
        def make(ln: Line) -> Outcome:
            return error_line(ln.index, ln.custom_id, code, message)

        while True:
            await self.store.fill(batch_id, make, self.reclaim_after_s)
            batch = await self.store.get_batch(batch_id)
            if batch is None or batch.done >= batch.total or batch.status in TERMINAL:
                return batch
            await asyncio.sleep(self.poll_s)
            if not await self.store.lock(batch_id, self.name, self.reclaim_after_s):  # renewed while it waits
                return None


def _stopped(batch: BatchInfo | None) -> bool:
    """Whether a batch's lines stop running: it is gone, cancelled, ending, or out of time."""
    return batch is None or batch.status != "in_progress" or time.time() >= batch.expires_at


def _result_files(outcomes: list[Outcome]) -> tuple[dict[str, Any], dict[bool, bytes], bool, int]:
    """A finished batch's usage, its output (True) and error (False) files' JSON lines, whether
    it expired (a line never ran for lack of time), and how many lines succeeded."""
    files = {ok: "".join(json.dumps(o.line) + "\n" for o in outcomes if o.ok is ok).encode() for ok in (True, False)}
    expired = any((o.line.get("error") or {}).get("code") == "batch_expired" for o in outcomes)
    return total_usage(outcomes), files, expired, sum(o.ok for o in outcomes)


def _backoff(headers: dict[str, str], attempt: int) -> float:
    """The error's Retry-After if it gave one, else exponential; with jitter, at most 60 s."""
    given = {k.lower(): v for k, v in headers.items()}.get("retry-after")
    base = float(given) if given and given.replace(".", "", 1).isdigit() else min(2.0 ** attempt, 30.0)
    return min(base, 60.0) * random.uniform(0.8, 1.2)
