"""The loop that runs fine-tuning jobs: one at a time per process, each on its model's trainer
(``workers.trainer``) at the batch tier, and never lost.

One task owns the work (``gateway.claim_loop``, as the vector stores' indexer does): it claims the oldest waiting job (a
new one, or one whose process died: its lease ran out), and while the job runs it renews the
lease every ``RENEW_S``; a renewal that fails (the job was cancelled, or another process took it)
stops the training at its next optimizer step. The job asks the gate and the arbiter for the
trainer as batch work (``Services.hold``; a 429 or 503 there is waited out, not a failure), so it
trains only while the GPU has nothing else to do and yields at the next optimizer step when
anyone else arrives. The trainer's weights may be moved to host memory or freed meanwhile, and
the job goes on from the step it reached when they are back. Each job's epochs are written to its
folder in the data directory (``<data>/fine-tuning/<job id>``) with the state to go on from
(``TrainRun.resume``, written at each epoch's end and where a pause or a shutdown stops it): a job
paused and resumed, or whose process stopped, goes on from that step when a process with the
folder takes it again (after a crash: from its last finished epoch); a job that ended takes its
folder with it. A pause (``stop_job``) stops a job as a cancel does and leaves it ``paused``.

At the end the job's adapters are published in the model's adapter folder (``Config.tuning_dir``),
each copied beside it and renamed into place: the last three epochs' checkpoints as
``<name>:ckpt-step-<N>`` and the last one as the fine-tuned model, ``ft:<model>:<key id>:<suffix>:<id>``,
which requests can name at once. Its figures per step are a CSV result file
(``fine-tune-results``); its usage is the owner's, at the batch tier, under the base model
(``Tuner._meter``): each epoch's tokens when its checkpoint is written, under a metering id of
the epoch's (``gateway.auth.Metering``), so an epoch trained again (after a crash, from the last
epoch's end) is counted once, and each start's GPU-seconds, its time since the last epoch's end
metered when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from accounts.usage import Usage
from batch.store import FileInfo, Store as FileStore
from gateway.auth import Caller, Metering
from gateway.claim_loop import ClaimLoop
from gateway.errors import APIError
from gateway.service import Held, Services
from tuning.data import FileProblem, Preference, conversations, preferences
from tuning.store import FineTuningStore, Job
from workers.base import Cancelled, StepContext
from workers.trainer import Example, Pair, StartGone, StartMismatch, TemplateNotTurnByTurn, TrainerGone, TrainRun

log = logging.getLogger("tiergate.fine_tuning")
LEASE_S = 30.0  # a running job is another process's to take once its lease is this old
RENEW_S = 2.0  # how often a running job's lease is renewed (and a cancel seen)
CHECKPOINTS_KEPT = 3  # the last epochs' checkpoints published (OpenAI keeps three)
ESTIMATE_EVERY = 10  # steps between updates of a running job's ``estimated_finish``


def fine_tuned_name(job: Job) -> str:
    """The fine-tuned model's name, in OpenAI's shape ``ft:<model>:<organisation>:<suffix>:<id>``
    with the owner's key id for the organisation, so that an adapter allow-list pattern
    ``ft:*:<key id>:*`` admits one key's fine-tuned models and no other's."""
    return f"ft:{job.model}:{owner_label(job.owner)}:{job.suffix or ''}:{job.id.removeprefix('ftjob-')[:8]}"


def owner_label(key_id: str) -> str:
    """A key's id as it stands in its fine-tuned models' names (``_`` is in no adapter's name)."""
    return key_id.replace("_", "-")


@dataclass
class _Running:
    job: Job
    ctx: StepContext | None = None
    lost: bool = False  # its lease could not be renewed: cancelled, or another process has it
    rows: list[dict[str, Any]] = field(default_factory=list)  # the result file's rows, one per step
    total_steps: int = 0
    began: float = 0.0  # when its training started (monotonic), for ``estimated_finish``
    first_step: int = 0  # the step it started from: where an earlier start stopped, or 0
    step: int = 0  # the last step it ended
    steps_per_epoch: int = 1
    epoch_tokens: int = 0  # an epoch's tokens (each example once): what each epoch is metered
    metered_at: float = 0.0  # (monotonic) where the time metered so far ends, in this start
    metered_paused: float = 0.0  # the time paused by then (``ctx.paused_s``), which is not metered
    metered_step: int = 0  # the step the training not metered yet began at
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # set with ``lost``: ends a wait for the trainer

    def stop(self) -> None:
        """Stop the job: a wait for the trainer ends now, a training at its next step."""
        self.lost = True
        self.stopped.set()
        if self.ctx is not None:
            self.ctx.cancel()  # the training stops at its next optimizer step, paused or not


class Tuner(ClaimLoop[Job], Collector):
    """The process's fine-tuning runner (see the module's docstring)."""

    log = log
    work = "fine-tuning: claiming or running a job"

    def __init__(self, svc: Services, store: FineTuningStore, files: FileStore) -> None:
        super().__init__()
        self.svc, self.store, self.files = svc, store, files
        self.tier = next((t.name for t in svc.gate.tiers.values() if t.is_batch), svc.config.tier_names[-1])
        self.scratch = svc.config.data_dir() / "fine-tuning"  # checkpoints as they are written, per job
        self.ended: dict[str, int] = {"succeeded": 0, "failed": 0, "cancelled": 0}
        self.steps = 0
        self._current: _Running | None = None  # the job this process runs now
        self._swept = False  # the folders of jobs that ended elsewhere, removed at the first claim

    @property
    def running(self) -> bool:
        return self._current is not None

    def progress(self) -> tuple[str, int, int] | None:
        """The job this process trains now: its id, the steps it has ended and its steps in all."""
        running = self._current
        return None if running is None else (running.job.id, running.step, running.total_steps)

    def stop_job(self, job_id: str) -> None:
        """The job ``job_id`` was cancelled or paused: if this process runs it, stop it at its next
        step now (another process's notices when it next renews its lease)."""
        running = self._current
        if running is not None and running.job.id == job_id:
            running.stop()

    def collect(self):
        jobs = CounterMetricFamily("tiergate_fine_tuning_jobs", "Fine-tuning jobs this process ran to an end, by "
                                   "outcome (succeeded, failed, cancelled)", labels=["outcome"])
        for outcome, n in self.ended.items():
            jobs.add_metric([outcome], n)
        yield jobs
        yield CounterMetricFamily("tiergate_fine_tuning_steps", "Optimizer steps this process's fine-tuning ran",
                                  value=self.steps)
        yield GaugeMetricFamily("tiergate_fine_tuning_running", "1 while this process runs a fine-tuning job",
                                value=int(self.running))

    async def _claim(self) -> Job | None:
        if not self._swept:
            await self._sweep()
            self._swept = True
        return await self.store.claim(time.time(), LEASE_S)

    async def _sweep(self) -> None:
        """Remove the folders of jobs that ended (or are gone) while another process ran them, or
        while this one was down: kept folders are those a job may go on from."""
        folders = await asyncio.to_thread(lambda: [p for p in self.scratch.iterdir() if p.is_dir()]
                                          if self.scratch.is_dir() else [])
        for folder in folders:
            job = await self.store.get(folder.name, None)
            if job is None or job.status in ("succeeded", "failed", "cancelled"):
                await asyncio.to_thread(shutil.rmtree, folder, True)

    async def _work(self, job: Job) -> None:
        await self._job(job)

    async def _job(self, job: Job) -> None:
        running = self._current = _Running(job)
        keeper = asyncio.create_task(self._keep(running))
        ended = True  # False: its folder stays, to go on from (this process stops, or another has the job)
        stopping = False  # this process stops (a shutdown) while it holds the job
        try:
            await self._train(running)
        except (Cancelled, asyncio.CancelledError) as exc:
            status = await self._status(job) if running.lost else None
            if status == "cancelled":  # its cancel wrote the event
                self._count(job, "cancelled")
            else:  # paused (its pause wrote the event; queued: resumed too, before this start stopped), this
                ended = False  # process stops, or another has the job
                if running.lost and status not in ("paused", "queued"):
                    await self._event(job, "info", "This process stopped the job: another process has taken it over")
            if isinstance(exc, asyncio.CancelledError):
                stopping = not running.lost
                raise
        except _Failed as failed:
            await self._fail(running, failed.code, failed.message, failed.param)
        except Exception as exc:  # noqa: BLE001 - recorded on the job; the runner goes on
            log.exception("fine-tuning: job %s failed", job.id)
            message = exc.message if isinstance(exc, APIError) else f"the server failed while training ({type(exc).__name__})"
            await self._fail(running, "server_error", message)
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            # its lease given up: the next process to look (this one restarted) takes it at once; a store that
            # does not answer leaves the lease to run out, as at a crash
            if stopping:
                with contextlib.suppress(Exception):
                    await self.store.hold(running.job, time.time())
            self._current = None
            if ended:
                await asyncio.to_thread(shutil.rmtree, self.scratch / job.id, True)

    async def _keep(self, running: _Running) -> None:
        """Renew the job's lease until cancelled; when it cannot be renewed, stop the training."""
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                kept = await self.store.hold(running.job, time.time() + LEASE_S)
            except Exception:  # noqa: BLE001 - the store did not answer: try again; the lease still runs
                log.warning("fine-tuning: renewing the lease of %s failed", running.job.id, exc_info=True)
                continue
            if not kept:
                running.stop()
                return

    async def _train(self, running: _Running) -> None:
        job = running.job
        if job.model not in self.svc.config.fine_tuning.models:  # tiers.yaml changed since the job was made
            raise _Failed("model_not_available", f"the model '{job.model}' is no longer one fine_tuning.models names")
        await self._event(job, "info", f"Fine-tuning job started (attempt {job.attempt})")
        training = await self._read(job.training_file, "training_file", job.method)
        validation = await self._read(job.validation_file, "validation_file", job.method) if job.validation_file else []
        hp = job.hyperparameters
        held = await self._hold(running)
        running.metered_at = time.monotonic()
        try:
            worker = held.lease.worker
            limit = self.svc.config.fine_tuning.max_tokens or worker.describe(worker.spec).context_length or 2048
            examples, dropped = await asyncio.to_thread(_encode, worker, training, limit)
            checks, _ = await asyncio.to_thread(_encode, worker, validation, limit)
            if dropped:
                await self._event(job, "warn", f"{dropped} training example(s) left out: their assistant turns lie "
                                               f"past the first {limit} tokens")
            if not examples:
                raise _Failed("invalid_training_file", "no training example has an assistant turn within "
                                                       f"its first {limit} tokens")
            tuning = self.svc.config.fine_tuning
            run = TrainRun(examples, checks, hp["n_epochs"], hp["batch_size"],
                           tuning.learning_rate * hp["learning_rate_multiplier"], job.seed, tuning.lora_rank,
                           tuning.lora_alpha, self.scratch / job.id, self.scratch / job.id / "resume.pt",
                           hp.get("beta") if job.method == "dpo" else None, self._start(job))
            running.total_steps, running.began = run.total_steps, time.monotonic()
            running.steps_per_epoch, running.epoch_tokens = run.steps_per_epoch, sum(e.tokens for e in examples)
            running.ctx = ctx = held.lease.context()
            if running.lost:
                ctx.cancel()
            await self._steps(running, worker, run, ctx)
        finally:
            held.release(None)  # a job's hours teach the gate's cost model nothing about requests
            await self._meter(running, None)  # a stop's GPU time since the last epoch's end
        await self._publish(running, run)

    async def _steps(self, running: _Running, worker, run: TrainRun, ctx: StepContext) -> int:
        """Run the training in a worker thread; its reports become the job's events as they come."""
        loop = asyncio.get_running_loop()
        reports: asyncio.Queue[dict | None] = asyncio.Queue()

        async def record() -> None:
            while (report := await reports.get()) is not None:
                await self._progress(running, report)

        recorder = asyncio.create_task(record())
        thread = asyncio.ensure_future(asyncio.to_thread(worker.train, run, ctx,
                                                         lambda r: loop.call_soon_threadsafe(reports.put_nowait, r)))
        try:
            return await asyncio.shield(thread)
        except asyncio.CancelledError:  # shutting down: the thread stops at its next step, then the job's lease ends
            ctx.cancel()
            with contextlib.suppress(BaseException):
                await thread
            raise
        except TemplateNotTurnByTurn as exc:
            raise _Failed("unsupported_model", str(exc)) from None
        except StartMismatch as exc:
            raise _Failed("model_not_available", str(exc)) from None
        except StartGone:  # deleted after ``_start`` looked, before the trainer read it
            raise _Failed("model_not_available", _start_gone(running.job)) from None
        except TrainerGone as exc:
            raise _Failed("server_error", f"{exc}; create the job again") from None
        finally:
            reports.put_nowait(None)
            await recorder

    async def _progress(self, running: _Running, report: dict) -> None:
        job = running.job
        if "resumed" in report:
            await self._resumed(running, report)
            return
        if "checkpoint" in report:
            running.rows[-1].update(valid_loss=report["valid_loss"], valid_mean_token_accuracy=report["valid_mean_token_accuracy"])
            await self._meter(running, report["step"] // running.steps_per_epoch)
            return
        self.steps += 1
        running.step = report["step"]
        running.rows.append({"step": report["step"], "train_loss": report["train_loss"],
                             "train_accuracy": report["train_mean_token_accuracy"], "valid_loss": None,
                             "valid_mean_token_accuracy": None})
        await self.store.add_event(job.id, event("metrics", "info", f"Step {report['step']}/{running.total_steps}: "
                                                  f"training loss={report['train_loss']:.4f}",
                                                  {"step": report["step"], "train_loss": report["train_loss"],
                                                   "train_mean_token_accuracy": report["train_mean_token_accuracy"],
                                                   "total_steps": running.total_steps}))
        step = report["step"]
        done = step - running.first_step  # in this start
        if done % ESTIMATE_EVERY == 0 and done and step < running.total_steps:  # when it should end, at its pace so far
            elapsed = time.monotonic() - running.began
            finish = int(time.time() + elapsed / done * (running.total_steps - step))
            await self.store.change(job, ["running"], estimated_finish=finish)

    def _start(self, job: Job) -> Path | None:
        """The folder of the fine-tuned model ``job`` goes on from (None: from the base model);
        ``_Failed`` when it was deleted since the job was made (the trainer's ``StartGone`` when
        that happens after this look), unless the job goes on from a state of its own
        (``resume.pt``, from a pause, a shutdown or an epoch's end: the trainer then reads no start
        model; one it cannot read starts the job over, from the start model, and fails then)."""
        if job.start is None:
            return None
        folder = self.svc.config.tuning_dir(job.model)
        if folder is None:
            raise _Failed("model_not_available", _start_gone(job))
        if not (folder / job.start).is_dir() and not (self.scratch / job.id / "resume.pt").is_file():
            raise _Failed("model_not_available", _start_gone(job))
        return folder / job.start

    async def _resumed(self, running: _Running, report: dict) -> None:
        """The trainer goes on from where an earlier start stopped: the result file's rows up to
        there are the metrics events the earlier starts recorded (the latest of each step), with
        their epochs' validation scores."""
        job, step = running.job, report["resumed"]
        running.first_step = running.step = running.metered_step = step
        recorded: dict[int, dict] = {}
        after = None
        while page := await self.store.events(job.id, after, 1000):  # newest first
            for e in page:
                data = e.get("data") or {}
                if e.get("type") == "metrics" and data.get("step", step + 1) <= step:
                    recorded.setdefault(data["step"], data)
            after = page[-1]["id"]
        running.rows = []
        for n in sorted(recorded):
            valid = report["valid"].get(n)
            running.rows.append({"step": n, "train_loss": recorded[n]["train_loss"],
                                 "train_accuracy": recorded[n]["train_mean_token_accuracy"],
                                 "valid_loss": valid and valid[0], "valid_mean_token_accuracy": valid and valid[1]})
        await self._event(job, "info", f"Going on from step {step} of {running.total_steps}, where an earlier start "
                                       "of the job stopped")

    async def _publish(self, running: _Running, run: TrainRun) -> None:
        """The last epochs' adapters into the model's folder, the result file, and the job succeeded."""
        job = running.job
        folder = self.svc.config.tuning_dir(job.model)
        if folder is None:
            raise _Failed("server_error", f"the model '{job.model}' has no adapter folder any more")
        name = fine_tuned_name(job)
        steps = sorted((int(p.name.removeprefix("step-")) for p in run.out.glob("step-*")))[-CHECKPOINTS_KEPT:]
        for step in steps:
            await asyncio.to_thread(_place, run.out / f"step-{step}", folder, f"{name}:ckpt-step-{step}")
        await asyncio.to_thread(_place, run.out / f"step-{steps[-1]}", folder, name)
        result = await self._result_file(job, running.rows)
        now = int(time.time())
        by_step = {row["step"]: row for row in running.rows}
        for step in steps:
            row = by_step.get(step, {})
            await self.store.add_checkpoint(job.id, {
                "id": f"ftckpt-{secrets.token_hex(12)}", "object": "fine_tuning.job.checkpoint", "created_at": now,
                "fine_tuned_model_checkpoint": f"{name}:ckpt-step-{step}", "step_number": step,
                "fine_tuning_job_id": job.id, "metrics": _metrics(row)})
        tokens = sum(e.tokens for e in run.examples) * run.n_epochs
        done = await self.store.change(job, ["running"], status="succeeded", fine_tuned_model=name, finished_at=now,
                                       trained_tokens=tokens, result_files=[result], estimated_finish=None)
        if done is None:  # cancelled or paused as it published: nothing stays published (no job names these
            # adapters, so no DELETE /v1/models could remove them); another process that took the job over
            # publishes the same names itself. The job then ends as a stop ends it (``_job``).
            running.stop()
            if await self._status(job) in ("cancelled", "paused"):
                for gone in (name, *(f"{name}:ckpt-step-{step}" for step in steps)):
                    await asyncio.to_thread(remove_adapter, folder, gone)
            raise Cancelled()
        await self._event(job, "info", f"New fine-tuned model created: {name}")
        await self._event(job, "info", "The job has successfully completed")
        self._count(job, "succeeded")

    async def _result_file(self, job: Job, rows: list[dict]) -> str:
        out = io.StringIO()
        writer = csv.DictWriter(out, ["step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy"],
                                lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)
        content = out.getvalue().encode()
        now = int(time.time())
        info = FileInfo(f"file-{time.time_ns():016x}{secrets.token_hex(8)}", job.owner, "fine-tune-results",
                        "step_metrics.csv", len(content), now)
        await self.files.put_file(info, content)
        return info.id

    async def _read(self, file_id: str, param: str, method: str) -> list:
        content = await self.files.file_content(file_id)
        if content is None:
            raise _Failed("file_not_found", f"the {param.replace('_', ' ')} {file_id} was deleted before the job ran", param)
        try:
            return (preferences if method == "dpo" else conversations)(content, f"the {param.replace('_', ' ')}")
        except FileProblem as exc:
            raise _Failed(f"invalid_{param}", str(exc), param) from None

    async def _hold(self, running: _Running) -> Held:
        """The trainer, leased as batch work; a 429 or 503 is waited out (the lease goes on). A
        stop (a cancel, a pause) ends the wait at once: batch work may wait for hours on a busy GPU."""
        trainer = self.svc.config.fine_tuning.trainer(running.job.model)
        while not running.lost:
            hold = asyncio.ensure_future(self.svc.hold(self.tier, trainer, 1.0))
            stop = asyncio.ensure_future(running.stopped.wait())
            try:
                await asyncio.wait({hold, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                if not hold.done():  # stopped, or this task was cancelled: the wait in the gate ends
                    hold.cancel()
                    await asyncio.gather(hold, return_exceptions=True)
            if hold.cancelled():
                break
            try:
                return hold.result()  # granted as the stop came: the training sees ``lost`` and stops
            except APIError as exc:
                if exc.status not in (429, 503):
                    raise
                wait = exc.headers.get("retry-after", "1")
                with contextlib.suppress(asyncio.TimeoutError):  # a stop ends this wait too
                    async with asyncio.timeout(min(30.0, max(0.5, float(wait) if wait.isdigit() else 1.0))):
                        await running.stopped.wait()
        raise Cancelled()

    async def _meter(self, running: _Running, epoch: int | None) -> None:
        """Meter the training since this start last metered it: at the end of ``epoch`` (from 1)
        that epoch's tokens, under the id ``<job>:epoch-<n>``, so that an epoch is counted once
        however often it is trained (a start after a crash trains again the steps after the last
        epoch's end, or another process starts the job over) and a job that succeeds is metered its
        ``trained_tokens``; at the end of a start (``epoch`` None), the GPU time of the steps it
        trained since the last epoch's end (a pause, a shutdown, a cancel stopped it there), which
        the next start does not train again. GPU-seconds: the time since, less the time paused."""
        now, paused = time.monotonic(), running.ctx.paused_s if running.ctx is not None else 0.0
        gpu_s = max(now - running.metered_at - (paused - running.metered_paused), 0.0)
        first, step = running.metered_step, running.step
        running.metered_at, running.metered_paused, running.metered_step = now, paused, step
        if epoch is not None:  # the job's first epoch is its request
            part, usage = f"epoch-{epoch}", Usage(requests=int(epoch == 1), trained_tokens=running.epoch_tokens,
                                                  gpu_seconds=gpu_s)
        elif step > first:
            part, usage = f"steps-{first}-{step}", Usage(gpu_seconds=gpu_s)
        else:
            return
        if self.svc.accounts is not None:
            caller = Caller(self.tier, running.job.owner, metering=Metering(f"{running.job.id}:{part}"))
            await self.svc.accounts.finish(caller, running.job.model, None, usage)

    async def _fail(self, running: _Running, code: str, message: str, param: str | None = None) -> None:
        job = running.job
        if await self.store.change(job, ["running"], status="failed", finished_at=int(time.time()),
                                   estimated_finish=None,  # OpenAI's: null when not running
                                   error={"code": code, "message": message, "param": param}) is None:
            return
        await self._event(job, "error", f"Fine-tuning job failed: {message}")
        self._count(job, "failed")

    async def _status(self, job: Job) -> str | None:
        now = await self.store.get(job.id, None)
        return now.status if now is not None else None

    async def _event(self, job: Job, level: str, message: str) -> None:
        await self.store.add_event(job.id, event("message", level, message))

    def _count(self, job: Job, outcome: str) -> None:
        self.ended[outcome] += 1
        log.info("fine-tuning job %s on %s: %s", job.id, job.model, outcome)


def _start_gone(job: Job) -> str:
    return f"the model '{job.start}' this job goes on from was deleted"


class _Failed(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def _metrics(row: dict) -> dict:
    """A checkpoint's ``metrics``, in OpenAI's names (its validation figures are over the whole
    validation file, at the epoch's end: ``full_valid_*``, and ``valid_*`` the same)."""
    out = {"step": row.get("step"), "train_loss": row.get("train_loss"),
           "train_mean_token_accuracy": row.get("train_accuracy"), "valid_loss": row.get("valid_loss"),
           "valid_mean_token_accuracy": row.get("valid_mean_token_accuracy"), "full_valid_loss": row.get("valid_loss"),
           "full_valid_mean_token_accuracy": row.get("valid_mean_token_accuracy")}
    return {k: v for k, v in out.items() if v is not None}


def event(kind: str, level: str, message: str, data: dict | None = None) -> dict:
    """A ``fine_tuning.job.event``: ``kind`` is ``message`` or ``metrics``."""
    return {"id": f"ftevent-{secrets.token_hex(12)}", "object": "fine_tuning.job.event", "created_at": int(time.time()),
            "level": level, "message": message, "data": data or {}, "type": kind}


def _encode(worker, examples: list, limit: int) -> tuple[list[Example] | list[Pair], int]:
    """(thread) The examples as token ids and labels (a preference's as a ``Pair``, each answer
    labelled alone); those left with nothing to learn (their assistant turns cut off by ``limit``)
    are counted, not kept."""
    out = [Pair(worker.encode([*e.messages, e.preferred], e.tools, limit),
                worker.encode([*e.messages, e.non_preferred], e.tools, limit)) if isinstance(e, Preference)
           else worker.encode(e.messages, e.tools, limit) for e in examples]
    kept = [e for e in out if e.trained]
    return kept, len(out) - len(kept)


def remove_adapter(folder: Path, name: str) -> bool:
    """(thread) The adapter ``name`` out of ``folder``: renamed to a dot name (no request lists or
    reads those), then deleted. False when it is not there."""
    target = folder / name
    if not target.is_dir():
        return False
    gone = folder / f".deleted-{secrets.token_hex(6)}"
    try:
        target.rename(gone)
    except FileNotFoundError:  # another request removed it meanwhile
        return False
    shutil.rmtree(gone, ignore_errors=True)
    return True


def _place(source: Path, folder: Path, name: str) -> None:
    """(thread) ``source`` as the adapter ``name`` of ``folder``: copied beside it (a dot folder,
    which no request sees), then renamed into place, so no request reads it half written. One
    there already (an earlier attempt of the job that died while publishing) is replaced."""
    staged = folder / f".staging-{secrets.token_hex(6)}"
    shutil.copytree(source, staged)
    (staged / "README.md").unlink(missing_ok=True)  # peft's model card names the server's paths
    target = folder / name
    if target.exists():
        old = folder / f".replaced-{secrets.token_hex(6)}"
        os.rename(target, old)
        shutil.rmtree(old)
    os.rename(staged, target)
