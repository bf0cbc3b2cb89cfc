"""OpenAI's fine-tuning API: ``/v1/fine_tuning/jobs`` (create, list, retrieve, cancel, pause,
resume, events, checkpoints), for ``client.fine_tuning.jobs``.

A job fine-tunes a chat model that ``fine_tuning.models`` names, from a training file uploaded
with purpose ``fine-tune`` (checked whole when the job is made: a 400 names the line), with
``hyperparameters`` (or ``method: {type: supervised, supervised: {hyperparameters}}``) of
``n_epochs``, ``batch_size`` and ``learning_rate_multiplier``, each a number or ``auto``; or, with
``method: {type: dpo, dpo: {hyperparameters}}`` (``beta`` too), from a file of preferences
(``tuning.data.preferences``). A key
sees its own jobs (an admin key every key's), as it sees its files and batches.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.adapters import may_use
from gateway.auth import Caller
from gateway.config import ADAPTER_NAME
from gateway.errors import APIError, bad_request, not_found
from gateway.schemas import Metadata, _Body, is_count, parse, read_json
from gateway.service import Services
from tuning.data import FileProblem, conversations, preferences, resolve
from tuning.runner import Tuner, event, fine_tuned_name, owner_label, remove_adapter
from tuning.store import OPEN, Job, TooManyJobs

SUFFIX = re.compile(r"[A-Za-z0-9.-]{1,40}")  # within an adapter's name (no '_' or ':')
CKPT = "ckpt-step-"  # a checkpoint's name is its model's with ":ckpt-step-<N>" after it
CKPT_ROOM = len(f":{CKPT}") + 9  # a checkpoint's name adds this much to the model's at most
CHECKPOINT = re.compile(rf"(.+):{CKPT}[0-9]+")  # its model's name, read from the right end
Auto = Literal["auto"]


class Hyperparameters(_Body):
    n_epochs: int | Auto = Field(default="auto")
    batch_size: int | Auto = Field(default="auto")
    learning_rate_multiplier: float | Auto = Field(default="auto")

    @field_validator("n_epochs")
    @classmethod
    def _epochs(cls, v):
        if v != "auto" and not 1 <= v <= 50:
            raise ValueError("n_epochs must be from 1 to 50, or 'auto'")
        return v

    @field_validator("batch_size")
    @classmethod
    def _batch(cls, v):
        if v != "auto" and not 1 <= v <= 256:
            raise ValueError("batch_size must be from 1 to 256, or 'auto'")
        return v

    @field_validator("learning_rate_multiplier")
    @classmethod
    def _rate(cls, v):
        if v != "auto" and not 0 < v <= 10:
            raise ValueError("learning_rate_multiplier must be above 0 and at most 10, or 'auto'")
        return v

    def asked(self) -> dict[str, Any]:
        return self.model_dump()


class DpoHyperparameters(Hyperparameters):
    beta: float | Auto = Field(default="auto")

    @field_validator("beta")
    @classmethod
    def _beta(cls, v):
        if v != "auto" and not 0 < v <= 2:
            raise ValueError("beta must be above 0 and at most 2, or 'auto'")
        return v


class Supervised(_Body):
    hyperparameters: Hyperparameters = Hyperparameters()


class Dpo(_Body):
    hyperparameters: DpoHyperparameters = DpoHyperparameters()


class Method(_Body):
    type: Literal["supervised", "dpo"]
    supervised: Supervised | None = None
    dpo: Dpo | None = None

    def asked(self) -> dict[str, Any]:
        if self.type == "dpo":
            if self.supervised is not None:
                raise bad_request("a dpo method takes method.dpo, not method.supervised", "method.supervised")
            return (self.dpo or Dpo()).hyperparameters.asked()
        if self.dpo is not None:
            raise bad_request("a supervised method takes method.supervised, not method.dpo", "method.dpo")
        return (self.supervised or Supervised()).hyperparameters.asked()


class CreateJob(_Body):
    model: str
    training_file: str
    validation_file: str | None = None
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    suffix: str | None = None
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    metadata: Metadata = None
    integrations: list[Any] | None = None


def _context(request: Request) -> tuple[Services, Tuner, Caller]:
    svc: Services = request.app.state.services
    return svc, request.app.state.tuner, svc.authenticate(request)


def public(job: Job) -> dict[str, Any]:
    return {"id": job.id, "object": "fine_tuning.job", "created_at": job.created_at, "error": job.error,
            "fine_tuned_model": job.fine_tuned_model, "finished_at": job.finished_at,
            "hyperparameters": job.hyperparameters, "model": job.start or job.model, "organization_id": owner_label(job.owner),
            "result_files": job.result_files, "seed": job.seed, "status": job.status,
            "trained_tokens": job.trained_tokens, "training_file": job.training_file,
            "validation_file": job.validation_file, "estimated_finish": job.estimated_finish, "integrations": [],
            "metadata": job.metadata or None, "user_provided_suffix": job.suffix,
            "method": {"type": job.method, job.method: {"hyperparameters": job.hyperparameters}}}


async def create_job(request: Request) -> Response:
    """POST /v1/fine_tuning/jobs."""
    svc, tuner, caller = _context(request)
    body = parse(CreateJob, await read_json(request, svc.config.limits.max_body))
    model, start = svc.model_name(body.model), None
    if body.model.startswith("ft:"):  # go on from one of this key's fine-tuned models (or its checkpoints)
        made = await _job_of(tuner, caller, body.model)
        folder = svc.config.tuning_dir(made.model) if made is not None else None
        if folder is None or not (folder / body.model).is_dir():
            raise not_found(f"the model '{body.model}' does not exist", "model", "model_not_found")
        model, start = made.model, body.model
    if model not in svc.config.fine_tuning.models:
        raise bad_request(f"the model '{body.model}' cannot be fine-tuned here (fine_tuning.models in tiers.yaml names "
                          "those that can)", "model", "model_not_available")
    if svc.accounts is not None and not svc.accounts.allows(caller, model):
        raise not_found(f"the model '{body.model}' does not exist", "model", "model_not_found")
    if body.integrations:
        raise bad_request("integrations are not supported here", "integrations", "unsupported_parameter")
    if body.hyperparameters is not None and body.method is not None:
        raise bad_request("give hyperparameters in method.supervised.hyperparameters or in hyperparameters, not both",
                          "hyperparameters")
    if body.suffix is not None and not SUFFIX.fullmatch(body.suffix):
        raise bad_request("suffix is 1 to 40 letters, digits, '.' or '-'", "suffix")
    if body.suffix is not None and CKPT in body.suffix.lower():  # the name would read as a checkpoint's
        raise bad_request(f"suffix may not contain '{CKPT}': checkpoints' names end with it", "suffix")
    method = body.method.type if body.method is not None else "supervised"
    asked = body.method.asked() if body.method is not None else (body.hyperparameters or Hyperparameters()).asked()
    most = svc.config.fine_tuning.max_jobs_per_key
    waiting = [j for j in await tuner.store.list(caller.key_id, None, 1000) if j.status in OPEN]
    if len(waiting) >= most:  # at once, before the file is read; the store counts again as it writes the job
        raise _too_many(len(waiting))
    examples = await _examples(tuner, caller, body.training_file, "training_file", method)
    if body.validation_file is not None:
        await _examples(tuner, caller, body.validation_file, "validation_file", method)
    job = Job(f"ftjob-{secrets.token_hex(12)}", caller.key_id, int(time.time()), model, body.training_file,
              body.validation_file, resolve(asked, examples, method).public(),
              body.seed if body.seed is not None else secrets.randbelow(2**31), body.suffix, body.metadata or {},
              method=method, start=start)
    name = fine_tuned_name(job)
    if not ADAPTER_NAME.fullmatch(name) or len(name) + CKPT_ROOM > 128:  # the suffix's characters are checked
        raise bad_request(f"the fine-tuned model's name '{name}' would be too long; use a shorter suffix", "suffix")
    try:
        await tuner.store.create(job, most)
    except TooManyJobs as exc:  # other creates of this key's got in while its file was read
        raise _too_many(exc.count) from None
    await tuner.store.add_event(job.id, event("message", "info", f"Validated the training file: {examples} examples; "
                                                                 "job queued"))
    tuner.wake()
    return JSONResponse(public(job))


def _too_many(count: int) -> APIError:
    return APIError(429, f"this key has {count} fine-tuning jobs queued, running or paused, the most it may have; "
                    "wait for one to end, or cancel one", "too_many_jobs", headers={"retry-after": "60"},
                    type="rate_limit_error")


async def _examples(tuner: Tuner, caller: Caller, file_id: str, param: str, method: str) -> int:
    """How many examples the file has (conversations, or for ``dpo`` preferences); 400 naming the
    line that is not one, 404 for no such file."""
    info = await tuner.files.get_file(file_id)
    if info is None or not (caller.admin or info.owner == caller.key_id):
        raise not_found(f"no such file: '{file_id}'", param, "file_not_found")
    if info.purpose != "fine-tune":
        raise bad_request(f"the file's purpose is {info.purpose!r}; fine-tuning reads files uploaded with purpose "
                          "'fine-tune'", param, "invalid_file_purpose")
    content = await tuner.files.file_content(file_id)
    if content is None:
        raise not_found(f"no such file: '{file_id}'", param, "file_not_found")
    try:
        read = preferences if method == "dpo" else conversations
        return len(await asyncio.to_thread(read, content, f"the {param.replace('_', ' ')}"))
    except FileProblem as exc:
        raise bad_request(str(exc), param, "invalid_file_format") from None


async def _owned(tuner: Tuner, caller: Caller, job_id: str) -> Job:
    job = await tuner.store.get(job_id, None if caller.admin else caller.key_id)
    if job is None:
        raise not_found(f"no such fine-tuning job: '{job_id}'", "fine_tuning_job_id", "fine_tuning_job_not_found")
    return job


def _page_limit(request: Request) -> int:
    raw = request.query_params.get("limit", "20")
    if not is_count(raw) or not 1 <= int(raw) <= 100:
        raise bad_request(f"limit must be an integer from 1 to 100, not {raw!r}", "limit")
    return int(raw)


def _page(items: list[dict], limit: int) -> Response:
    return JSONResponse({"object": "list", "data": items[:limit], "has_more": len(items) > limit})


async def list_jobs(request: Request) -> Response:
    """GET /v1/fine_tuning/jobs?after=&limit=&metadata[k]=v: newest first."""
    _, tuner, caller = _context(request)
    limit = _page_limit(request)
    wanted = {k[len("metadata["):-1]: v for k, v in request.query_params.items()
              if k.startswith("metadata[") and k.endswith("]")}
    owner = None if caller.admin else caller.key_id
    after, jobs = request.query_params.get("after") or None, []
    while len(jobs) <= limit:  # metadata filters a page: read on until the page is full or the jobs end
        page = await tuner.store.list(owner, after, 100)
        jobs += [j for j in page if all(j.metadata.get(k) == v for k, v in wanted.items())]
        if len(page) < 100:
            break
        after = page[-1].id
    return _page([public(j) for j in jobs], limit)


async def get_job(request: Request) -> Response:
    _, tuner, caller = _context(request)
    return JSONResponse(public(await _owned(tuner, caller, request.path_params["job_id"])))


async def cancel_job(request: Request) -> Response:
    """POST /v1/fine_tuning/jobs/{id}/cancel: a queued, running or paused job stops (a running one
    at its next optimizer step: at once in this process, within ``RENEW_S`` in another); 409 for
    one that has ended."""
    done = await _stop(request, ("queued", "running", "paused"), "job_not_cancellable", status="cancelled",
                       finished_at=int(time.time()), estimated_finish=None)  # OpenAI's: null when not running
    if done.previous == "paused":  # no process runs it: its folder here goes now (others' at their next start)
        _, tuner, _ = _context(request)
        await asyncio.to_thread(shutil.rmtree, tuner.scratch / done.job.id, True)
    return JSONResponse(public(done.job))


async def pause_job(request: Request) -> Response:
    """POST /v1/fine_tuning/jobs/{id}/pause: a queued or running job waits ``paused`` until it is
    resumed (a running one stops at its next optimizer step, as a cancel stops it, its LoRA and
    optimizer's state kept in its folder); 409 otherwise."""
    done = await _stop(request, ("queued", "running"), "job_not_pausable", status="paused", estimated_finish=None)
    return JSONResponse(public(done.job))


async def resume_job(request: Request) -> Response:
    """POST /v1/fine_tuning/jobs/{id}/resume: a paused job waits ``queued`` again, and goes on from
    the step it was paused at in a process that has its folder (another starts it over); 409 for
    a job that is not paused."""
    _, tuner, caller = _context(request)
    job = await _owned(tuner, caller, request.path_params["job_id"])
    if job.status != "paused":
        raise APIError(409, f"cannot resume a job that is {job.status}: only a paused one", "job_not_paused")
    done = await tuner.store.change(job, ["paused"], status="queued")
    if done is None:
        raise APIError(409, "the job changed while it was being resumed; try again", "job_busy")
    await tuner.store.add_event(job.id, event("message", "info", "The job was resumed"))
    tuner.wake()
    return JSONResponse(public(done))


@dataclass(frozen=True)
class _Stopped:
    job: Job
    previous: str  # its status before


async def _stop(request: Request, allowed: tuple[str, ...], refused: str, **changes: Any) -> _Stopped:
    """The caller's job with ``changes`` written, from one of the ``allowed`` statuses, and its
    work in this process stopped; the event says so. 409 (code ``refused``) from another status."""
    _, tuner, caller = _context(request)
    for _ in range(3):  # a process may take the job (a new attempt) between the read and the write
        job = await _owned(tuner, caller, request.path_params["job_id"])
        if job.status not in allowed:
            verb = {"cancelled": "cancel", "paused": "pause"}[changes["status"]]
            raise APIError(409, f"cannot {verb} a job that is {job.status}", refused)
        done = await tuner.store.change(job, allowed, **changes)
        if done is not None:
            tuner.stop_job(job.id)
            await tuner.store.add_event(job.id, event("message", "info", f"The job was {changes['status']}"))
            return _Stopped(done, job.status)
    raise APIError(409, f"the job changed while it was being {changes['status']}; try again", "job_busy")


async def list_events(request: Request) -> Response:
    _, tuner, caller = _context(request)
    job = await _owned(tuner, caller, request.path_params["job_id"])
    limit = _page_limit(request)
    return _page(await tuner.store.events(job.id, request.query_params.get("after") or None, limit + 1), limit)


async def list_checkpoints(request: Request) -> Response:
    _, tuner, caller = _context(request)
    job = await _owned(tuner, caller, request.path_params["job_id"])
    limit = _page_limit(request)
    page = await tuner.store.checkpoints(job.id, request.query_params.get("after") or None, limit + 1)
    data = page[:limit]
    return JSONResponse({"object": "list", "data": data, "has_more": len(page) > limit,
                         "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})


async def delete_model(request: Request) -> Response:
    """DELETE /v1/models/{model}: a fine-tuned model (or one of its checkpoints) of the caller's
    jobs (an admin's: anyone's) is removed from its adapter folder: renamed out of sight first,
    so no request reads it half removed, then deleted. Any other model is not the caller's to
    delete (403); one that does not exist, another key's, or one outside the key's allow-lists
    (docs/ACCOUNTS.md: to it, one that does not exist) is a 404."""
    svc, tuner, caller = _context(request)
    name = request.path_params["model"]
    job = await _job_of(tuner, caller, name)
    if job is None:
        spec = svc.arbiter.specs.get(svc.model_name(name))
        # as the key sees them (resolve_as): a model or adapter outside its allow-lists does not exist
        served = ((spec is not None and spec.kind != "train" and may_use(spec.name))
                  or svc.adapters.base_of(name) is not None)
        if name.startswith("ft:") or not served:  # another key's fine-tuned model is as good as none
            raise not_found(f"the model '{name}' does not exist", "model", "model_not_found")
        raise APIError(403, f"the model '{name}' is not a fine-tuned model of this key: it cannot be deleted",
                       "model_not_deletable", "model", type="invalid_request_error")
    folder = svc.config.tuning_dir(job.model)
    if folder is None or not await asyncio.to_thread(remove_adapter, folder, name):
        raise not_found(f"the model '{name}' does not exist", "model", "model_not_found")
    return JSONResponse({"id": name, "object": "model", "deleted": True})


async def _job_of(tuner: Tuner, caller: Caller, name: str) -> Job | None:
    """The caller's job whose fine-tuned model (or a checkpoint of it) is ``name``."""
    if not name.startswith("ft:"):
        return None
    checkpoint = CHECKPOINT.fullmatch(name)  # not a split at the first: a suffix made before it was refused may hold it
    model = checkpoint.group(1) if checkpoint else name
    after = None
    while True:
        page = await tuner.store.list(None if caller.admin else caller.key_id, after, 100)
        for job in page:
            if job.fine_tuned_model == model:
                return job
        if len(page) < 100:
            return None
        after = page[-1].id


def tuner_for(svc: Services, files) -> Tuner:
    """The process's fine-tuning runner on the batch store's backend, started and stopped with the app."""
    from tuning.store import open_fine_tuning_store

    store = svc.keep_open(open_fine_tuning_store(svc.config.batch.store, svc.config.data_dir()))
    tuner = Tuner(svc, store, files)
    if svc.config.fine_tuning.models:
        svc.on_startup.append(tuner.start)
        svc.on_shutdown.append(tuner.stop)  # run in reverse: before its store (opened above) closes
    svc.metrics.registry.register(tuner)
    return tuner
