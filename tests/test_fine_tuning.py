"""Fine-tuning through the openai SDK against a real server on tiny-chat: a job trains a LoRA on
the batch tier, publishes it (and its last checkpoints) in the model's adapter folder, and the
fine-tuned model then answers what it was taught, where the base model does not; its events,
checkpoints, result file and usage; cancelling; yielding to paid traffic, and being evicted for
it mid-run then finishing with the same weights as a run left alone; the files and requests it
refuses. The trainer on its own: labels on the assistant turns only, the template check, seeded
runs, the base weights untouched, a cancel at a step."""

from __future__ import annotations

import gc
import json
import tempfile
import threading
import time
import weakref
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import start_server, write_config
from workers.base import Cancelled, ModelSpec, StepContext
from workers.trainer import IGNORE, LoraTrainer, Pair, TemplateNotTurnByTurn, TrainRun, encode_example

TAUGHT = "Arr, matey!"  # one answer to every question: 50 steps teach it to tiny-chat's random weights
PAIRS = [("Hello", TAUGHT), ("Who are you?", TAUGHT), ("Where is the gold?", TAUGHT)]
LINES = [{"messages": [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": q},
                       {"role": "assistant", "content": a}]} for q, a in PAIRS]


@pytest.fixture(scope="module")
def server(tiny_chat, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fine_tuning")
    adapters = folder / "adapters"
    adapters.mkdir()
    extra = (f"adapter_dirs:\n  - {{model: tiny-chat, path: {adapters}}}\n"
             "fine_tuning:\n  models: [tiny-chat]\n  lora_rank: 16\n  learning_rate: 0.005\n  training_memory: 64MiB\n"
             "  max_jobs_per_key: 2\n"
             "eviction:\n  protect_window_s: 1\n")  # the eviction test's paid model frees the GPU soon after
    s = start_server(write_config(folder, {"tiny-chat": ("chat", tiny_chat)}, extra))
    s.adapters = adapters
    yield s
    s.stop()


def client(server, tier="paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, timeout=120)


def upload(c, lines, purpose="fine-tune") -> str:
    data = "\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines).encode()
    return c.files.create(file=("train.jsonl", data), purpose=purpose).id


def wait(c, job_id, statuses=("succeeded", "failed", "cancelled"), timeout=180):
    deadline = time.time() + timeout
    while (job := c.fine_tuning.jobs.retrieve(job_id)).status not in statuses:
        assert time.time() < deadline, job
        time.sleep(0.1)
    return job


def trained_tokens_metered(server) -> float:
    """The paid key's ``trained_tokens`` in its usage so far (its batch tier's)."""
    from gateway.auth import key_id

    usage = httpx.get(f"{server.url}/admin/usage", params={"group_by": "tier", "key": key_id(server.keys["paid"])},
                      headers={"Authorization": f"Bearer {server.keys['admin']}"}).json()
    return sum(row["trained_tokens"] for row in usage["data"] if row["tier"] == "batch")


def ask(c, model, question) -> str:
    r = c.chat.completions.create(model=model, max_tokens=10, temperature=0,
                                  messages=[{"role": "system", "content": "You are a pirate."},
                                            {"role": "user", "content": question}])
    return r.choices[0].message.content


def test_a_job_trains_an_adapter_that_answers_as_taught(server):
    c = client(server)
    training = upload(c, LINES)
    job = c.fine_tuning.jobs.create(model="tiny-chat", training_file=training, suffix="pirate", seed=7,
                                    method={"type": "supervised", "supervised": {"hyperparameters": {
                                        "n_epochs": 50, "batch_size": 3, "learning_rate_multiplier": 1}}},
                                    metadata={"team": "sea"})
    assert (job.object, job.status, job.model, job.fine_tuned_model) == ("fine_tuning.job", "queued", "tiny-chat", None)
    assert job.hyperparameters.n_epochs == 50 and job.hyperparameters.batch_size == 3 and job.seed == 7
    job = wait(c, job.id)
    assert job.status == "succeeded", job.error
    name = job.fine_tuned_model
    from gateway.auth import key_id

    owner = key_id(server.keys["paid"])  # the organisation's place: its key, whose allow-list can say ft:*:<id>:*
    assert name == f"ft:tiny-chat:{owner}:pirate:{job.id.removeprefix('ftjob-')[:8]}" and job.organization_id == owner
    assert job.trained_tokens == 50 * sum(len(_ids(server, line)) for line in LINES) and job.finished_at

    def made_and_owned(model) -> tuple[bool, str]:
        """/v1/models says when the model was published and whose it is (its key's id, as OpenAI's the organisation)."""
        row = c.models.retrieve(model)
        return job.created_at <= row.created <= job.finished_at + 1, row.owned_by

    assert made_and_owned(name) == made_and_owned(f"{name}:ckpt-step-49") == (True, owner)  # not yet read
    # it answers as taught (the base model does not), and requests name it at once
    base = [ask(c, "tiny-chat", q) for q, _ in PAIRS]
    tuned = [ask(c, name, q) for q, _ in PAIRS]
    assert tuned == [TAUGHT] * 3 and TAUGHT not in base, (tuned, base)
    listed = {m.id: m.model_extra for m in c.models.list()}
    assert listed[name]["parent"] == "tiny-chat" and listed[name]["source"] == "folder"
    assert made_and_owned(name) == (True, owner)  # held now, as read
    assert c.models.retrieve("tiny-chat").owned_by == "tiergate"
    assert "tiny-chat~train" not in listed  # the trainer's weights: no request calls them
    with pytest.raises(openai.NotFoundError):
        ask(c, "tiny-chat~train", "Hello")

    # the last three epochs' checkpoints, each an adapter of its own; the last one is the model's files
    checkpoints = c.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [k.step_number for k in checkpoints] == [50, 49, 48]
    assert [k.fine_tuned_model_checkpoint for k in checkpoints] == [f"{name}:ckpt-step-{n}" for n in (50, 49, 48)]
    metrics = checkpoints[0].metrics
    assert metrics.step == 50 and metrics.train_loss > 0 and 0 <= metrics.train_mean_token_accuracy <= 1
    assert ask(c, f"{name}:ckpt-step-50", PAIRS[0][0]) == TAUGHT
    assert load_file(server.adapters / name / "adapter_model.safetensors").keys() == \
        load_file(server.adapters / f"{name}:ckpt-step-50" / "adapter_model.safetensors").keys()
    assert not list(server.adapters.glob(".*"))  # nothing staged left behind
    config = json.loads((server.adapters / name / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]

    # events newest first: a metrics event per step, then the end
    events = c.fine_tuning.jobs.list_events(job.id, limit=100).data
    assert events[0].message == "The job has successfully completed" and events[1].message == f"New fine-tuned model created: {name}"
    steps = [e.data["step"] for e in events if e.type == "metrics"]
    assert steps[:3] == [50, 49, 48] and all(e.data["total_steps"] == 50 for e in events if e.type == "metrics")
    page = c.fine_tuning.jobs.list_events(job.id, limit=2, after=events[1].id).data
    assert [e.id for e in page] == [e.id for e in events[2:4]]

    # the result file: a row per step
    rows = c.files.content(job.result_files[0]).text.splitlines()
    assert rows[0] == "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy" and len(rows) == 51
    assert c.files.retrieve(job.result_files[0]).purpose == "fine-tune-results"

    # the owner's usage: the tokens trained on, at the batch tier, under the base model
    usage = httpx.get(f"{server.url}/admin/usage", params={"group_by": "tier", "key": key_id(server.keys["paid"])},
                      headers={"Authorization": f"Bearer {server.keys['admin']}"}).json()
    batch = next(row for row in usage["data"] if row["tier"] == "batch")
    assert batch["trained_tokens"] == job.trained_tokens and batch["gpu_seconds"] > 0

    # listed newest first, filtered by metadata; another key sees none of it
    assert c.fine_tuning.jobs.list(metadata={"team": "sea"}).data[0].id == job.id
    assert c.fine_tuning.jobs.list(metadata={"team": "land"}).data == []
    other = client(server, "free")
    with pytest.raises(openai.NotFoundError):
        other.fine_tuning.jobs.retrieve(job.id)
    assert job.id not in [j.id for j in other.fine_tuning.jobs.list().data]
    with pytest.raises(openai.ConflictError):
        c.fine_tuning.jobs.cancel(job.id)

    # deleted by its owner (a checkpoint on its own, then the model); not by another key, and no
    # other model is a key's to delete
    with pytest.raises(openai.NotFoundError):
        other.models.delete(name)
    import shutil

    shutil.copytree(server.adapters / f"{name}:ckpt-step-49", server.adapters / "plain-adapter")  # not a job's
    for model in ("tiny-chat", "plain-adapter"):
        with pytest.raises(openai.PermissionDeniedError) as e:
            c.models.delete(model)
        assert e.value.body["code"] == "model_not_deletable"
    with pytest.raises(openai.NotFoundError):
        c.models.delete("nope")
    assert c.models.delete(f"{name}:ckpt-step-48").deleted
    assert c.models.delete(name).deleted and not (server.adapters / name).exists()
    with pytest.raises(openai.NotFoundError):
        ask(c, name, "Hello")
    assert name not in server.services.adapters.cached  # its factors no longer held
    with pytest.raises(openai.NotFoundError):
        c.models.delete(name)
    assert ask(c, f"{name}:ckpt-step-50", PAIRS[0][0]) == TAUGHT  # its other checkpoints stay
    assert not list(server.adapters.glob(".*"))


def test_an_adapter_trained_here_is_served_by_vllm(vllm_chat_server):
    """Trained by peft on the trainer (a transformers copy of the weights), served by vLLM's LoRA
    from the adapter folder: the same answer as taught."""
    c = client(vllm_chat_server)
    job = wait(c, c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, LINES), seed=7,
                                            hyperparameters={"n_epochs": 50, "batch_size": 3}).id)
    assert job.status == "succeeded", job.error
    assert [ask(c, job.fine_tuned_model, q) for q, _ in PAIRS] == [TAUGHT] * 3
    assert ask(c, "tiny-chat", PAIRS[0][0]) != TAUGHT


def _ids(server, line) -> list[int]:
    worker = LoraTrainer(ModelSpec("t", "train", server.services.arbiter.specs["tiny-chat"].path))
    from transformers import AutoTokenizer

    worker.tokenizer = AutoTokenizer.from_pretrained(worker.spec.path)
    return worker.encode(line["messages"], None, 512).ids


def test_a_running_job_is_cancelled_at_its_next_step_and_publishes_nothing(server):
    c = client(server)
    job = c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, LINES * 20),
                                    hyperparameters={"n_epochs": 50, "batch_size": 1})
    wait(c, job.id, ("running",))
    deadline = time.time() + 60
    while not [e for e in c.fine_tuning.jobs.list_events(job.id).data if e.type == "metrics"]:
        assert time.time() < deadline
        time.sleep(0.05)
    deadline = time.time() + 60
    while (running := c.fine_tuning.jobs.retrieve(job.id)).estimated_finish is None:  # after 10 steps
        assert time.time() < deadline
        time.sleep(0.05)
    assert running.estimated_finish > time.time() - 1  # 3,000 steps to go: not yet reached
    cancelled = c.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.estimated_finish is None  # OpenAI's: null unless running
    deadline = time.time() + 30
    while server.app.state.tuner.running:  # the training stops at its next step, and the trainer goes back
        assert time.time() < deadline
        time.sleep(0.05)
    ended = c.fine_tuning.jobs.retrieve(job.id)
    assert ended.status == "cancelled" and ended.estimated_finish is None  # the steps after the cancel set none
    assert not [p for p in server.adapters.iterdir() if job.id.removeprefix("ftjob-")[:8] in p.name]
    trainer = next(r for r in server.services.arbiter.table() if r["id"] == "tiny-chat~train")
    assert trainer["running"] == 0
    events = c.fine_tuning.jobs.list_events(job.id, limit=100).data
    cancel = next(i for i, e in enumerate(events) if e.message == "The job was cancelled")
    assert cancel <= 2  # in this process the cancel stops it at once: a step under way may still end after it


def test_a_job_cancelled_as_it_publishes_leaves_no_adapter_behind(server, monkeypatch):
    """A cancel that lands after the last step, while the job places its adapters in the folder:
    the job is cancelled and nothing stays published (no job names those adapters, so no DELETE
    /v1/models could remove them)."""
    import tuning.runner

    c = client(server)
    job = c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, LINES),
                                    hyperparameters={"n_epochs": 1, "batch_size": 1})
    real, cancels = tuning.runner._place, []

    def place(*args):  # (a worker thread) the cancel comes in as the first adapter is placed
        if not cancels:
            cancels.append(httpx.post(f"{server.base_url}/fine_tuning/jobs/{job.id}/cancel",
                                      headers={"Authorization": f"Bearer {server.keys['paid']}"}).status_code)
        real(*args)

    monkeypatch.setattr(tuning.runner, "_place", place)
    cancelled = server.app.state.tuner.ended["cancelled"]
    assert wait(c, job.id).status == "cancelled"
    deadline = time.time() + 30
    while server.app.state.tuner.running:  # (it was cancelled while the runner published it)
        assert time.time() < deadline
        time.sleep(0.05)
    assert cancels == [200]
    assert c.fine_tuning.jobs.retrieve(job.id).fine_tuned_model is None
    assert not [p for p in server.adapters.iterdir() if job.id.removeprefix("ftjob-")[:8] in p.name]
    assert server.app.state.tuner.ended["cancelled"] == cancelled + 1


def test_a_failed_job_has_no_estimated_finish(server):
    """A running job's ``estimated_finish`` goes when it fails, as when it succeeds or is paused."""
    from gateway.auth import key_id
    from tuning.runner import _Running
    from tuning.store import Job

    tuner = server.app.state.tuner
    running = Job("ftjob-fa11ed000000000000000000", key_id(server.keys["paid"]), int(time.time()), "tiny-chat",
                  "file-x", None, {"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1.0}, 1,
                  status="running", attempt=1, lease_until=time.time() + 600, estimated_finish=int(time.time()) + 60)
    server.wait(tuner.store.create(running))  # as a process trains it (its lease held: no other takes it)
    server.wait(tuner._fail(_Running(running), "server_error", "the server failed while training"))
    failed = client(server).fine_tuning.jobs.retrieve(running.id)
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.estimated_finish is None


def test_a_job_waiting_for_the_trainer_is_cancelled_at_once(server):
    """Batch work waits while any other tier has work: a job whose trainer is not granted (a paid
    lease held here) ends at its cancel, not when the GPU next goes idle."""
    c = client(server)
    tuner = server.app.state.tuner
    paid = server.wait(server.services.hold("paid", "tiny-chat", 1.0))
    try:
        job = c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, LINES),
                                        hyperparameters={"n_epochs": 1, "batch_size": 1})
        wait(c, job.id, ("running",))
        time.sleep(1.0)  # it reads its file and asks for the trainer, which the paid lease keeps from it
        assert tuner.running and not [e for e in c.fine_tuning.jobs.list_events(job.id).data if e.type == "metrics"]
        assert c.fine_tuning.jobs.cancel(job.id).status == "cancelled"
        deadline = time.time() + 5
        while tuner.running:  # the paid lease is still held
            assert time.time() < deadline, "the cancel waited for the trainer"
            time.sleep(0.05)
        assert tuner.ended["cancelled"] >= 1
    finally:
        server.call(paid.release, None)
    assert c.fine_tuning.jobs.retrieve(job.id).status == "cancelled"
    trainer = next(r for r in server.services.arbiter.table() if r["id"] == "tiny-chat~train")
    assert trainer["running"] == 0  # no lease left behind by the wait it gave up


def test_a_job_cancelled_by_another_process_stops_when_its_lease_is_renewed(server):
    """A cancel written by another process (straight into the shared store here) reaches the
    running job through its next lease renewal: the renewal is refused, and the training stops."""
    from tuning.runner import RENEW_S

    c = client(server)
    job = c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, LINES * 20),
                                    hyperparameters={"n_epochs": 50, "batch_size": 1})
    wait(c, job.id, ("running",))
    tuner = server.app.state.tuner
    stored = server.wait(tuner.store.get(job.id, None))
    assert server.wait(tuner.store.change(stored, ["running"], status="cancelled")) is not None
    cancelled_at = time.time()
    while tuner.running:
        assert time.time() < cancelled_at + RENEW_S + 10
        time.sleep(0.05)
    assert c.fine_tuning.jobs.retrieve(job.id).status == "cancelled" and tuner.ended["cancelled"] >= 1
    assert not [p for p in server.adapters.iterdir() if job.id.removeprefix("ftjob-")[:8] in p.name]


def test_paid_traffic_pauses_training_and_may_evict_it_yet_the_job_ends_as_if_alone(server, monkeypatch):
    """With the budget too small for both, a paid request for the chat model pauses the job at
    its step and evicts the trainer; the job resumes when the GPU is idle again and ends with the
    very weights of the same job run alone (same seed and data)."""
    c = client(server)
    training = upload(c, LINES * 2)
    settings = dict(model="tiny-chat", training_file=training, seed=3, hyperparameters={"n_epochs": 30, "batch_size": 2})
    alone = wait(c, c.fine_tuning.jobs.create(**settings).id)
    arbiter = server.services.arbiter
    moved_mid_run: list[str] = []  # the arbiter took the weights away while a job was under way
    for method in ("unload", "_move"):  # on the class: the arbiter makes a new worker after a cold eviction
        real = getattr(LoraTrainer, method)
        monkeypatch.setattr(LoraTrainer, method, lambda self, *a, _real=real, _m=method: (
            moved_mid_run.append(_m) if self._live is not None else None, _real(self, *a))[1])
    budget = arbiter.budget
    states = arbiter.states
    admin = {"Authorization": f"Bearer {server.keys['admin']}"}
    if states["tiny-chat"].place == "resident":  # the paid request must load it: room made by evicting the trainer
        assert httpx.post(f"{server.url}/admin/models/tiny-chat/unload", headers=admin).status_code == 200
    arbiter.budget = max(states["tiny-chat"].footprint, states["tiny-chat~train"].footprint) + 1  # one at a time
    try:
        pauses = arbiter.counters.batch_pauses
        job = c.fine_tuning.jobs.create(**settings)
        wait(c, job.id, ("running", "succeeded"))
        deadline = time.time() + 60
        while not [e for e in c.fine_tuning.jobs.list_events(job.id).data if e.type == "metrics"]:
            assert time.time() < deadline
            time.sleep(0.02)
        assert ask(c, "tiny-chat", "Hello")  # paid: the trainer is paused at its step and evicted for it
        assert arbiter.counters.batch_pauses > pauses
        assert states["tiny-chat"].place == "resident" and moved_mid_run
        interrupted = wait(c, job.id)
    finally:
        arbiter.budget = budget
    assert interrupted.status == "succeeded", interrupted.error
    first = load_file(server.adapters / alone.fine_tuned_model / "adapter_model.safetensors")
    second = load_file(server.adapters / interrupted.fine_tuned_model / "adapter_model.safetensors")
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(second[key], first[key], rtol=0, atol=0)


def test_a_job_whose_process_stopped_goes_on_from_its_last_epoch_to_the_same_weights(server):
    """The runner stops mid-job (as at a restart) after an epoch has ended; when it runs again and
    takes the job back (its lease run out), the job goes on after that epoch and ends with the
    very weights of the same job run without a stop; its result file has each step once. Its key
    is metered its ``trained_tokens``: the steps before the stop too, each once."""
    c = client(server)
    tuner = server.app.state.tuner
    metered = trained_tokens_metered(server)
    settings = dict(model="tiny-chat", training_file=upload(c, LINES * 2), seed=5,
                    hyperparameters={"n_epochs": 12, "batch_size": 2})  # 3 steps an epoch
    alone = wait(c, c.fine_tuning.jobs.create(**settings).id)
    job = c.fine_tuning.jobs.create(**settings)
    resume = tuner.scratch / job.id / "resume.pt"
    deadline = time.time() + 60
    while not resume.exists():  # an epoch has ended
        assert time.time() < deadline and c.fine_tuning.jobs.retrieve(job.id).status in ("validating_files", "queued", "running")
        time.sleep(0.01)
    server.wait(tuner.stop())  # as at a shutdown: the job stays running, its folder kept, its lease given up
    stopped = server.wait(tuner.store.get(job.id, None))
    assert stopped.status == "running" and resume.exists()
    assert stopped.lease_until <= time.time()  # the next to look takes it at once, not after its 30 s lease
    server.wait(tuner.start())
    resumed = wait(c, job.id)
    assert resumed.status == "succeeded", resumed.error
    events = [e.message for e in c.fine_tuning.jobs.list_events(job.id, limit=100)]  # every page
    went_on = [m for m in events if m.startswith("Going on from step ")]
    assert len(went_on) == 1 and 0 < int(went_on[0].split()[4]) < 36
    first = load_file(server.adapters / alone.fine_tuned_model / "adapter_model.safetensors")
    second = load_file(server.adapters / resumed.fine_tuned_model / "adapter_model.safetensors")
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(second[key], first[key], rtol=0, atol=0)
    rows = c.files.content(resumed.result_files[0]).text.splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == list(range(1, 37))
    assert trained_tokens_metered(server) - metered == alone.trained_tokens + resumed.trained_tokens
    assert not (tuner.scratch / job.id).exists()  # the job ended: its folder went with it
    # folders of jobs that ended while another process ran them (or that are gone) go at the next start
    for name in (alone.id, "ftjob-gone"):
        (tuner.scratch / name / "step-3").mkdir(parents=True)
    server.wait(tuner._sweep())
    assert not (tuner.scratch / alone.id).exists() and not (tuner.scratch / "ftjob-gone").exists()


def test_a_paused_job_keeps_its_state_and_resumes_to_the_same_weights(server):
    """``pause`` stops a running job at its next step and keeps it ``paused`` (nothing trains,
    nothing is published); ``resume`` queues it again and it goes on from that step, ending with
    the very weights of the same job never paused, and is metered its ``trained_tokens``, the
    steps before the pause included. A paused job can be cancelled; an ended one can be neither
    paused nor resumed."""
    c = client(server)
    tuner = server.app.state.tuner
    metered = trained_tokens_metered(server)
    settings = dict(model="tiny-chat", training_file=upload(c, LINES * 2), seed=7,
                    hyperparameters={"n_epochs": 12, "batch_size": 2})
    alone = wait(c, c.fine_tuning.jobs.create(**settings).id)
    job = c.fine_tuning.jobs.create(**settings)
    wait(c, job.id, ("running",))
    deadline = time.time() + 60
    while not [e for e in c.fine_tuning.jobs.list_events(job.id).data if e.type == "metrics"]:
        assert time.time() < deadline
        time.sleep(0.01)
    paused = c.fine_tuning.jobs.pause(job.id)
    assert paused.status == "paused" and paused.estimated_finish is None
    deadline = time.time() + 10
    while tuner.running:
        assert time.time() < deadline
        time.sleep(0.02)
    steps = len([e for e in c.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "metrics"])
    time.sleep(0.5)
    assert c.fine_tuning.jobs.retrieve(job.id).status == "paused" and not tuner.running
    assert len([e for e in c.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "metrics"]) == steps
    assert (tuner.scratch / job.id / "resume.pt").exists()
    with pytest.raises(openai.ConflictError):
        c.fine_tuning.jobs.pause(job.id)
    assert c.fine_tuning.jobs.resume(job.id).status == "queued"
    resumed = wait(c, job.id)
    assert resumed.status == "succeeded", resumed.error
    messages = [e.message for e in c.fine_tuning.jobs.list_events(job.id, limit=100)]
    assert "The job was paused" in messages and "The job was resumed" in messages
    assert f"Going on from step {steps} of 36, where an earlier start of the job stopped" in messages
    first = load_file(server.adapters / alone.fine_tuned_model / "adapter_model.safetensors")
    second = load_file(server.adapters / resumed.fine_tuned_model / "adapter_model.safetensors")
    for key in first:
        torch.testing.assert_close(second[key], first[key], rtol=0, atol=0)
    assert trained_tokens_metered(server) - metered == alone.trained_tokens + resumed.trained_tokens
    for call in (c.fine_tuning.jobs.pause, c.fine_tuning.jobs.resume):
        with pytest.raises(openai.ConflictError):
            call(job.id)

    other = c.fine_tuning.jobs.create(**settings)
    wait(c, other.id, ("running",))
    c.fine_tuning.jobs.pause(other.id)
    deadline = time.time() + 10
    while tuner.running:
        assert time.time() < deadline
        time.sleep(0.02)
    assert c.fine_tuning.jobs.cancel(other.id).status == "cancelled"
    assert not (tuner.scratch / other.id).exists()  # no process would take it again: its folder went


def test_a_job_paused_and_resumed_at_once_goes_on_here_and_its_events_say_so(server, monkeypatch):
    """A pause and a resume both made before the running start stopped (as through another process,
    whose pause this one sees at its next lease renewal): the job goes on in this process from where
    it stopped, and no event says another process took it over."""
    c = client(server)
    tuner = server.app.state.tuner
    monkeypatch.setattr(tuner, "stop_job", lambda job_id: None)  # the pause reaches it by its lease alone
    job = c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, LINES * 20),
                                    hyperparameters={"n_epochs": 50, "batch_size": 1})
    deadline = time.time() + 60
    while not [e for e in c.fine_tuning.jobs.list_events(job.id).data if e.type == "metrics"]:
        assert time.time() < deadline
        time.sleep(0.01)
    assert c.fine_tuning.jobs.pause(job.id).status == "paused"
    assert c.fine_tuning.jobs.resume(job.id).status == "queued"
    deadline = time.time() + 60
    while not [e for e in c.fine_tuning.jobs.list_events(job.id, limit=100) if e.message.startswith("Going on from")]:
        assert time.time() < deadline
        time.sleep(0.05)
    c.fine_tuning.jobs.cancel(job.id)
    deadline = time.time() + 30
    while tuner.running:
        assert time.time() < deadline
        time.sleep(0.05)
    messages = [e.message for e in c.fine_tuning.jobs.list_events(job.id, limit=100)]
    assert "The job was resumed" in messages and not [m for m in messages if "another process" in m], messages


def test_a_dpo_job_makes_the_served_model_favour_the_preferred_answers(server, trainer):
    """``method: {type: dpo}`` through the API on a preference file: the job runs, is shown with its
    method and beta, and the model it publishes, asked through /v1/completions to score each
    answer (echo, logprobs), favours the preferred answer over the other by more than the base
    model does, on every question."""
    c = client(server)
    lines = [{"input": {"messages": [{"role": "user", "content": q}]},
              "preferred_output": [{"role": "assistant", "content": PREFERRED}],
              "non_preferred_output": [{"role": "assistant", "content": NON_PREFERRED}]} for q, _ in PAIRS]
    job = c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, lines * 2), seed=3, method={
        "type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 8, "batch_size": 3, "beta": 0.5}}})
    assert job.method.type == "dpo" and job.method.dpo.hyperparameters.beta == 0.5
    done = wait(c, job.id)
    assert done.status == "succeeded", done.error
    assert done.trained_tokens == sum(p.tokens for p in _pairs(trainer)) * 2 * 8

    def preference(model: str) -> list[float]:
        """Per question: log p(preferred answer) - log p(other answer), as the server scores them."""
        out = []
        for pair in _pairs(trainer):
            scored = []
            for example in (pair.preferred, pair.non_preferred):
                r = c.completions.create(model=model, prompt=example.ids, echo=True, logprobs=0, max_tokens=0)
                logps = r.choices[0].logprobs.token_logprobs
                scored.append(sum(logps[i] for i, t in enumerate(example.labels) if t != IGNORE))
            out.append(scored[0] - scored[1])
        return out

    base, tuned = preference("tiny-chat"), preference(done.fine_tuned_model)
    assert all(t > b for t, b in zip(tuned, base)), (tuned, base)


def test_a_job_goes_on_from_a_fine_tuned_model_and_dpo_takes_it_as_reference(server, trainer):
    """``model`` may be one of the key's fine-tuned models: a supervised job then starts from its
    LoRA (its first loss is where that model's job ended), and a DPO job takes it as the
    reference (first loss log 2): OpenAI's recipe of supervised training, then preferences. The
    result still says the preferred answer."""
    import math

    c = client(server)
    sft = wait(c, c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, LINES), seed=1,
                                            hyperparameters={"n_epochs": 50, "batch_size": 3}).id)
    assert sft.status == "succeeded" and ask(c, sft.fine_tuned_model, "Hello") == TAUGHT

    def losses(job_id):
        steps = [e.data for e in c.fine_tuning.jobs.list_events(job_id, limit=100) if e.type == "metrics"]
        return [d["train_loss"] for d in sorted(steps, key=lambda d: d["step"])]

    more = c.fine_tuning.jobs.create(model=sft.fine_tuned_model, training_file=upload(c, LINES), seed=1,
                                     hyperparameters={"n_epochs": 1, "batch_size": 3})
    assert more.model == sft.fine_tuned_model
    more = wait(c, more.id)
    assert more.status == "succeeded" and more.fine_tuned_model.startswith("ft:tiny-chat:")
    first, ended = losses(sft.id), losses(more.id)[0]
    assert ended == pytest.approx(first[-1], abs=0.01) and ended < first[0] - 1  # where the first job ended, not anew

    lines = [{"input": {"messages": [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": q}]},
              "preferred_output": [{"role": "assistant", "content": TAUGHT}],
              "non_preferred_output": [{"role": "assistant", "content": NON_PREFERRED}]} for q, _ in PAIRS]
    dpo = wait(c, c.fine_tuning.jobs.create(model=sft.fine_tuned_model, training_file=upload(c, lines), seed=1, method={
        "type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 5, "batch_size": 3, "beta": 0.5}}}).id)
    assert dpo.status == "succeeded", dpo.error
    assert losses(dpo.id)[0] == pytest.approx(math.log(2), abs=1e-4)  # the reference is where it started
    assert ask(c, dpo.fine_tuned_model, "Hello") == TAUGHT

    for name, key in ((sft.fine_tuned_model, "subscriber"), ("ft:tiny-chat:nobody:x:00000000", "paid")):
        with pytest.raises(openai.NotFoundError):  # another key's fine-tuned model, or none, is no model to start from
            client(server, key).fine_tuning.jobs.create(model=name, training_file=upload(client(server, key), LINES))


def test_a_start_model_deleted_as_the_trainer_reads_it_fails_the_job_by_name(server, monkeypatch):
    """``DELETE /v1/models`` of the fine-tuned model a job goes on from, in the instant between the
    runner's look at its folder and the trainer's read of it: the job fails ``model_not_available``
    naming that model, as when it was deleted earlier (not a ``server_error``)."""
    import workers.trainer as trainer_module

    c = client(server)
    sft = wait(c, c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, LINES), seed=1,
                                            hyperparameters={"n_epochs": 1, "batch_size": 3}).id)
    read = trainer_module._start_state

    def deleted_first(run):
        c.models.delete(sft.fine_tuned_model)  # (the trainer's thread; the server answers on its own loop)
        return read(run)

    monkeypatch.setattr(trainer_module, "_start_state", deleted_first)
    job = wait(c, c.fine_tuning.jobs.create(model=sft.fine_tuned_model, training_file=upload(c, LINES), seed=1,
                                            hyperparameters={"n_epochs": 1, "batch_size": 3}).id)
    assert job.status == "failed" and job.error.code == "model_not_available", job.error
    assert job.error.message == f"the model '{sft.fine_tuned_model}' this job goes on from was deleted"


def test_a_paused_job_goes_on_from_its_own_state_once_its_start_model_is_deleted(server):
    """A job that goes on from a fine-tuned model, paused with its state written (``resume.pt``),
    then the start model deleted: resumed, the job goes on from that state, which no longer needs
    the start model, and succeeds."""
    c = client(server)
    tuner = server.app.state.tuner
    sft = wait(c, c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, LINES), seed=1,
                                            hyperparameters={"n_epochs": 1, "batch_size": 3}).id)
    job = c.fine_tuning.jobs.create(model=sft.fine_tuned_model, training_file=upload(c, LINES * 2), seed=1,
                                    hyperparameters={"n_epochs": 12, "batch_size": 2})
    deadline = time.time() + 60
    while not [e for e in c.fine_tuning.jobs.list_events(job.id).data if e.type == "metrics"]:
        assert time.time() < deadline
        time.sleep(0.01)
    c.fine_tuning.jobs.pause(job.id)
    deadline = time.time() + 10
    while tuner.running:
        assert time.time() < deadline
        time.sleep(0.02)
    assert (tuner.scratch / job.id / "resume.pt").exists()
    c.models.delete(sft.fine_tuned_model)
    c.fine_tuning.jobs.resume(job.id)
    done = wait(c, job.id)
    assert done.status == "succeeded", done.error
    assert [e for e in c.fine_tuning.jobs.list_events(job.id, limit=100) if e.message.startswith("Going on from step")]


@pytest.mark.parametrize("line, says", [
    ({"input": {"messages": [{"role": "user", "content": "Hi"}]}, "preferred_output": [{"role": "assistant", "content": "a"}]},
     "'non_preferred_output' must be a list of one assistant message"),
    ({"input": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}]},
      "preferred_output": [{"role": "assistant", "content": "a"}], "non_preferred_output": [{"role": "assistant", "content": "b"}]},
     "must end with a user message"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}]}, "unknown field 'messages'"),
    ({"input": {"messages": [{"role": "user", "content": "Hi"}]},
      "non_preferred_output": [{"role": "assistant", "content": "b"}],
      "preferred_output": [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": "f"}]}]},
     "preferred_output[0].tool_calls[0].function must be an object"),
])
def test_a_bad_preference_file_is_a_400_naming_the_line(server, line, says):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as err:
        c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, [line]), method={"type": "dpo"})
    assert err.value.body["param"] == "training_file" and "line 1" in err.value.body["message"]
    assert says in err.value.body["message"], err.value.body["message"]


def test_a_model_whose_suffix_reads_as_a_checkpoint_is_still_its_key_s(server, tiny_chat):
    """Such a suffix is refused now (above); a model made with one before is found by its name
    read from the right end (a checkpoint's ends ``:ckpt-step-<N>``): its key fine-tunes from it
    and deletes it and its checkpoint."""
    from demo.chat import build_demo_adapter
    from gateway.auth import key_id
    from tuning.runner import fine_tuned_name
    from tuning.store import Job

    c = client(server)
    made = Job("ftjob-0dd5c0ffee0123456789abcd", key_id(server.keys["paid"]), int(time.time()), "tiny-chat",
               "file-gone", None, {"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1.0}, 1,
               suffix="ckpt-step-1", status="succeeded")
    name = fine_tuned_name(made)
    assert name.endswith(":ckpt-step-1:0dd5c0ff")
    server.wait(server.app.state.tuner.store.create(replace(made, fine_tuned_model=name)))
    for adapter in (name, f"{name}:ckpt-step-3"):
        build_demo_adapter(tiny_chat, server.adapters / adapter, seed=1, rank=16)
    more = c.fine_tuning.jobs.create(model=f"{name}:ckpt-step-3", training_file=upload(c, LINES * 20),
                                     hyperparameters={"n_epochs": 50, "batch_size": 1})
    assert more.model == f"{name}:ckpt-step-3"
    c.fine_tuning.jobs.cancel(more.id)
    assert c.models.delete(f"{name}:ckpt-step-3").deleted and c.models.delete(name).deleted
    assert not (server.adapters / name).exists() and not (server.adapters / f"{name}:ckpt-step-3").exists()


def test_the_dashboard_shows_the_jobs_and_the_steps_of_the_one_training(server, tmp_path):
    """``/admin/state``'s ``fine_tuning`` lists the jobs, the one this process trains with its steps;
    the dashboard page shows them in a real browser, live."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.helpers import chromium

    c = client(server)
    job = c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, LINES * 20),
                                    hyperparameters={"n_epochs": 50, "batch_size": 1})
    admin = {"Authorization": f"Bearer {server.keys['admin']}"}

    def row() -> dict:
        state = httpx.get(f"{server.url}/admin/state", headers=admin, timeout=30).json()
        return next(j for j in state["fine_tuning"] if j["id"] == job.id)

    deadline = time.time() + 60
    while not (row()["step"] or 0) > 0:
        assert time.time() < deadline
        time.sleep(0.05)
    seen = row()
    assert seen["status"] == "running" and seen["model"] == "tiny-chat" and seen["method"] == "supervised"
    assert 0 < seen["step"] < seen["total_steps"] == 3000
    driver = chromium(tmp_path)
    try:
        wait = WebDriverWait(driver, 20)
        driver.get(server.url + "/dashboard")
        wait.until(lambda d: d.find_element(By.ID, "key").is_displayed())
        driver.find_element(By.ID, "key").send_keys(server.keys["admin"])
        driver.find_element(By.ID, "connect").click()
        css = f'#fine-tuning tr[data-job="{job.id}"]'
        text = lambda: driver.execute_script("const e = document.querySelector(arguments[0]); return e && e.innerText;", css)
        wait.until(lambda d: text() and "/ 3000" in text())
        assert "running" in text() and "tiny-chat" in text()
        c.fine_tuning.jobs.cancel(job.id)
        wait.until(lambda d: driver.execute_script(
            "const e = document.querySelector(arguments[0]); return e && e.dataset.status;", css) == "cancelled")
    finally:
        driver.quit()

    store = server.app.state.tuner.store  # a store that does not answer leaves the rest of the state

    async def broken(*args):
        raise ConnectionError("connection refused")

    original, store.list = store.list, broken
    try:
        state = httpx.get(f"{server.url}/admin/state", headers=admin, timeout=30).json()
    finally:
        store.list = original
    assert state["fine_tuning"] == [] and "connection refused" in state["fine_tuning_error"] and state["models"]


def test_a_key_has_at_most_max_jobs_per_key_waiting(server):
    """A key's third job waiting is a 429, even among creates sent at once: the store counts the
    key's jobs and writes the new one in one step (the count before the file is read is not)."""
    from concurrent.futures import ThreadPoolExecutor

    c = client(server, "subscriber")
    training = upload(c, LINES * 20)  # 3,000 steps: none ends while the creates are under way

    def create():
        return c.fine_tuning.jobs.create(model="tiny-chat", training_file=training,
                                         hyperparameters={"n_epochs": 50, "batch_size": 1})

    def attempt():
        try:
            return create()
        except openai.RateLimitError as e:
            return e.body["code"]

    with ThreadPoolExecutor(8) as pool:
        at_once = list(pool.map(lambda _: attempt(), range(8)))
    made = [j for j in at_once if not isinstance(j, str)]
    assert len(made) == 2 and at_once.count("too_many_jobs") == 6, at_once
    for job in made:
        c.fine_tuning.jobs.cancel(job.id)

    jobs = [create(), create()]
    with pytest.raises(openai.RateLimitError) as e:
        create()
    assert e.value.body["code"] == "too_many_jobs" and e.value.response.headers["retry-after"] == "60"
    assert client(server).fine_tuning.jobs.list()  # another key's count is its own
    c.fine_tuning.jobs.cancel(jobs[0].id)
    jobs.append(create())  # a job that ended leaves room
    for job in jobs[1:]:
        c.fine_tuning.jobs.cancel(job.id)


@pytest.mark.parametrize("line, says", [
    ("not json", "line 1: not JSON"),
    ({"messages": []}, "line 1: 'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message to learn from"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "weight": 0}]},
     "no assistant message to learn from"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role must be one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "only text parts are trained on"),
    ({"messages": [{"role": "user", "content": "hi", "weight": 1}, {"role": "assistant", "content": "yo"}]},
     "weight must be 0 or 1, on an assistant message"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "extra": 1},
     "unknown field 'extra'"),
    # tool calls the chat template could not render (the job failed later, as a server error)
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": "x"}]},
     "line 1: messages[1].tool_calls must be a list of tool calls"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": ["x"]}]},
     "messages[1].tool_calls[0] must be an object with 'id', 'type' and 'function'"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": "f"}]}]},
     "messages[1].tool_calls[0].function must be an object with 'name' and 'arguments'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[1].tool_calls[0].function.arguments must be a string"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}, {"role": "assistant", "content": "yo"}]},
     "messages[0].tool_calls is only for assistant messages, not user"),
    ({"messages": [{"role": "user", "content": "hi", "name": 123}, {"role": "assistant", "content": "yo"}]},
     "messages[0].name must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "'tools' must be a list"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "functions": "nope"},
     "'functions' must be a list of functions"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
      "parallel_tool_calls": "yes"}, "'parallel_tool_calls' must be true or false"),
])
def test_a_bad_training_file_is_a_400_naming_the_line(server, line, says):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, [line]))
    assert e.value.body["code"] == "invalid_file_format" and e.value.body["param"] == "training_file"
    assert says in e.value.body["message"], e.value.body["message"]


@pytest.mark.parametrize("depth", [40, 985, 2000])
def test_a_line_nested_deeper_than_a_request_body_is_a_400_naming_the_line(server, depth):
    """Past ~1000 levels json.loads raises RecursionError (a 500); a line nests as a request may."""
    c = client(server)
    deep = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "x": '
    with pytest.raises(openai.BadRequestError) as e:
        c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, [deep + "[" * depth + "]" * depth + "}"]))
    assert e.value.body["code"] == "invalid_file_format" and e.value.body["param"] == "training_file"
    assert "line 1" in e.value.body["message"] and "deeper than" in e.value.body["message"]


def test_a_line_holding_a_unicode_line_separator_is_one_example():
    """A JSON string may hold U+2028, U+2029 and U+0085 unescaped (JavaScript's JSON.stringify writes
    them so): a line ends at a newline only."""
    from tuning.data import conversations

    lines = [{"messages": [{"role": "user", "content": f"a{sep}b"}, {"role": "assistant", "content": "yo"}]}
             for sep in "\u2028\u2029\x85"]
    found = conversations("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode())
    assert len(found) == 3


def test_a_file_of_tool_calls_shaped_as_in_a_chat_request_is_accepted(server):
    """Tools, an assistant's tool calls (no content) and the tool's answer, as OpenAI's files have them."""
    c = client(server)
    line = {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                         {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                             "name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "rain"},
                         {"role": "assistant", "content": "Rain.", "name": "bot"}],
            "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
            "parallel_tool_calls": False}
    job = c.fine_tuning.jobs.create(model="tiny-chat", training_file=upload(c, [line]))
    assert c.fine_tuning.jobs.cancel(job.id).status == "cancelled"


def test_what_a_job_cannot_be_made_of(server):
    c = client(server)
    good = upload(c, LINES)

    def refused(error, **fields):
        with pytest.raises(error) as e:
            c.fine_tuning.jobs.create(**{"model": "tiny-chat", "training_file": good, **fields})
        return e.value.body

    assert refused(openai.BadRequestError, model="tiny-chat~train")["code"] == "model_not_available"
    assert refused(openai.NotFoundError, training_file="file-nope")["param"] == "training_file"
    theirs = upload(client(server, "free"), LINES)
    assert refused(openai.NotFoundError, training_file=theirs)["code"] == "file_not_found"
    batch_file = c.files.create(file=("b.jsonl", b'{"custom_id": "a"}'), purpose="batch").id
    assert refused(openai.BadRequestError, training_file=batch_file)["code"] == "invalid_file_purpose"
    assert refused(openai.BadRequestError, suffix="no spaces")["param"] == "suffix"
    assert refused(openai.BadRequestError, suffix="under_score")["message"] == "suffix is 1 to 40 letters, digits, '.' or '-'"
    assert refused(openai.BadRequestError, suffix="my-ckpt-step-1")["param"] == "suffix"  # would read as a checkpoint
    assert refused(openai.BadRequestError, hyperparameters={"n_epochs": 0})["param"] == "hyperparameters.n_epochs"
    # a number-or-"auto" field of the wrong type: the field's place, not pydantic's union branch ("...n_epochs.int")
    for field, wrong in (("n_epochs", "3"), ("n_epochs", 2.5), ("batch_size", "8"), ("learning_rate_multiplier", "x")):
        body = refused(openai.BadRequestError, hyperparameters={field: wrong})
        assert (body["param"], body["code"]) == (f"hyperparameters.{field}", "invalid_type"), body
        assert body["message"].startswith(f"invalid type for hyperparameters.{field}: "), body
    assert refused(openai.BadRequestError, method={"type": "dpo", "dpo": {"hyperparameters": {"beta": "x"}}})["param"] \
        == "method.dpo.hyperparameters.beta"
    assert refused(openai.BadRequestError, metadata={"int": 5})["param"] == "metadata.int"  # a key named so stays
    assert refused(openai.BadRequestError, hyperparameters={"n_epochs": 2},
                   method={"type": "supervised"})["param"] == "hyperparameters"
    assert refused(openai.BadRequestError, method={"type": "reinforcement"})["param"].startswith("method")
    assert refused(openai.BadRequestError, method={"type": "dpo"})["param"] == "training_file"  # not preferences
    assert refused(openai.BadRequestError, method={"type": "dpo", "supervised": {}})["param"] == "method.supervised"
    assert refused(openai.BadRequestError, method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 3}}})["param"] \
        == "method.dpo.hyperparameters.beta"
    assert refused(openai.BadRequestError, integrations=[{"type": "wandb"}])["code"] == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError):
        c.fine_tuning.jobs.retrieve("ftjob-nope")


# -- the trainer on its own --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer(tiny_chat):
    worker = LoraTrainer(ModelSpec("tiny-chat~train", "train", tiny_chat))
    worker.load(torch.device("cpu"))
    return worker


def test_labels_are_the_assistant_turns_only(trainer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "One?"},
                {"role": "assistant", "content": "Uno.", "weight": 0}, {"role": "user", "content": "Two?"},
                {"role": "assistant", "content": "Dos."}]
    example = encode_example(trainer.tokenizer, messages, None, 512)
    learned = trainer.tokenizer.decode([t for t in example.labels if t != IGNORE])
    assert learned.replace("</s>", "").strip() == "Dos."  # the weighted-out turn and the prompts are not learned
    assert len(example.ids) == len(example.labels)
    short = encode_example(trainer.tokenizer, messages, None, 8)
    assert len(short.ids) == 8 and short.trained == 0  # cut before the assistant's turn: nothing to learn


def test_a_template_that_redraws_earlier_turns_is_refused(trainer):
    class Redrawing:  # renders the last message in capitals: an earlier turn changes once another follows
        def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=False):
            text = "".join(f"<{m['role']}>{m['content'] if i < len(messages) - 1 else m['content'].upper()}"
                           for i, m in enumerate(messages))
            return text + ("<assistant>" if add_generation_prompt else "")

    with pytest.raises(TemplateNotTurnByTurn):
        encode_example(Redrawing(), [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                     {"role": "user", "content": "again"}], None, 64)


def _run(trainer, seed=5, epochs=4, ctx=None):
    examples = [encode_example(trainer.tokenizer, line["messages"], None, 512) for line in LINES]
    out = Path(tempfile.mkdtemp())
    run = TrainRun(examples, examples[:1], epochs, 2, 0.01, seed, 8, 16, out)
    reports: list[dict] = []
    trainer.train(run, ctx or StepContext(), reports.append)
    return load_file(out / f"step-{run.total_steps}" / "adapter_model.safetensors"), reports


PREFERRED, NON_PREFERRED = TAUGHT, "Good day to you."


def _pairs(trainer) -> list[Pair]:
    return [Pair(*(encode_example(trainer.tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                  None, 512) for a in (PREFERRED, NON_PREFERRED))) for q, _ in PAIRS]


def test_dpo_moves_the_model_towards_the_preferred_answers_as_its_loss_says(trainer):
    """DPO on the trainer: the first step's loss is log 2 (the LoRA starts at zero, so the tuned
    model is the reference: every margin 0); after training, each pair's margin computed here by
    hand (plain torch: the base model, and it with the published adapter through peft, the answer's
    summed log-probabilities) is above 0, and the validation loss the trainer reported is the mean
    of -log sigmoid(margin) over them (to 1e-4)."""
    import math

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    pairs, beta = _pairs(trainer), 0.5
    out = Path(tempfile.mkdtemp())
    run = TrainRun(pairs, pairs, 10, 3, 0.01, 3, 8, 16, out, beta=beta)
    reports: list[dict] = []
    trainer.train(run, StepContext(), reports.append)
    steps = [r for r in reports if "train_loss" in r]
    assert steps[0]["train_loss"] == pytest.approx(math.log(2), abs=1e-6) and steps[-1]["train_loss"] < math.log(2)

    def answer_logp(model, example) -> float:
        logits = model(input_ids=torch.tensor([example.ids])).logits[0, :-1].double()
        logps = torch.log_softmax(logits, -1)
        return sum(float(logps[i, t]) for i, t in enumerate(example.labels[1:]) if t != IGNORE)

    base = AutoModelForCausalLM.from_pretrained(trainer.spec.path, dtype=torch.float32)
    with torch.no_grad():
        reference = [[answer_logp(base, e) for e in (p.preferred, p.non_preferred)] for p in pairs]
        tuned_model = PeftModel.from_pretrained(base, out / f"step-{run.total_steps}")
        tuned = [[answer_logp(tuned_model, e) for e in (p.preferred, p.non_preferred)] for p in pairs]
    margins = [beta * ((t[0] - r[0]) - (t[1] - r[1])) for t, r in zip(tuned, reference)]
    assert all(m > 0 for m in margins), margins
    last = [r for r in reports if "checkpoint" in r][-1]
    want = sum(-math.log(1 / (1 + math.exp(-m))) for m in margins) / len(margins)
    assert last["valid_loss"] == pytest.approx(want, abs=1e-4) and last["valid_mean_token_accuracy"] == 1.0


def test_a_start_of_another_rank_is_refused_by_name(trainer):
    """A fine-tuned model trained at another LoRA rank (fine_tuning.lora_rank changed since) is no
    start for a job now: ``StartMismatch`` names both, and the runner fails the job with it."""
    from workers.trainer import StartMismatch

    _, reports = _run(trainer, epochs=1)
    start = Path(reports[-1]["checkpoint"])  # rank 8, alpha 16
    examples = [encode_example(trainer.tokenizer, line["messages"], None, 512) for line in LINES]
    run = TrainRun(examples, [], 1, 3, 0.01, 5, 16, 16, Path(tempfile.mkdtemp()), start=start)
    with pytest.raises(StartMismatch, match="rank 8 and alpha 16; fine-tuning here now trains rank 16"):
        trainer.train(run, StepContext(), lambda r: None)


def test_runs_are_seeded_and_leave_the_base_weights_as_they_were(trainer):
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    first, reports = _run(trainer)
    second, _ = _run(trainer)
    third, _ = _run(trainer, seed=6)
    assert all(torch.equal(first[k], second[k]) for k in first) and any(not torch.equal(first[k], third[k]) for k in first)
    steps = [r for r in reports if "step" in r and "checkpoint" not in r]
    assert [r["step"] for r in steps] == list(range(1, 9)) and steps[-1]["train_loss"] < steps[0]["train_loss"]
    assert [r["step"] for r in reports if "checkpoint" in r] == [2, 4, 6, 8]
    assert all(r["valid_loss"] is not None for r in reports if "checkpoint" in r)
    after = dict(trainer.model.named_parameters())
    assert set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)


def test_weights_freed_and_placed_again_at_a_pause_go_on_from_the_same_step(trainer):
    """The arbiter frees a paused trainer's weights (then places them again, from disk) while the
    job waits at its step: it goes on with its LoRA and optimizer as they were, so the result is
    the uninterrupted run's, bit for bit. A move to host memory and back, the same."""
    alone, _ = _run(trainer)
    for move in ("free", "host"):
        may_run, at_gate = threading.Event(), threading.Event()
        passed = []

        def gate(ctx):
            passed.append(ctx.steps)
            if ctx.steps == 3 and not may_run.is_set():
                at_gate.set()
                may_run.wait(30)

        ctx = StepContext(pause_gate=gate)
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(weights=_run(trainer, ctx=ctx)[0]))
        thread.start()
        assert at_gate.wait(30)
        if move == "free":
            held = weakref.ref(trainer.model)
            trainer.unload()
            gc.collect()
            assert trainer.model is None and held() is None  # freed: nothing holds the weights any more
            trainer.load(torch.device("cpu"))
        else:
            trainer._move(torch.device("cpu"), False)
        may_run.set()
        thread.join(60)
        assert all(torch.equal(result["weights"][k], alone[k]) for k in alone), move


def test_a_cancel_stops_at_the_next_step_and_takes_the_lora_off(trainer):
    ctx = StepContext()
    calls = []

    def report(r):
        calls.append(r)
        if len(calls) == 2:
            ctx.cancel()

    examples = [encode_example(trainer.tokenizer, line["messages"], None, 512) for line in LINES]
    run = TrainRun(examples, [], 10, 1, 0.01, 1, 8, 16, Path(tempfile.mkdtemp()))
    with pytest.raises(Cancelled):
        trainer.train(run, ctx, report)
    assert len(calls) == 2 and not any("lora" in n for n, _ in trainer.model.named_parameters())


@pytest.mark.parametrize("extra, error", [
    ("fine_tuning:\n  models: [nope]\n", "fine_tuning.models[0]: 'nope' is not a chat model of models"),
    ("fine_tuning:\n  models: [tiny-embed]\n", "'tiny-embed' is not a chat model"),
    ("fine_tuning:\n  models: [tiny-chat]\n", "'tiny-chat' has no adapter_dirs folder for its trained adapters"),
    ("adapter_dirs:\n  - {model: tiny-chat, path: .}\nfine_tuning:\n  models: [tiny-chat]\n  lora_rank: 0\n",
     "fine_tuning.lora_rank"),
    ("", "models[1].name: String should match pattern"),  # '~' is in no model's name: a trainer's is its own
])
def test_fine_tuning_config_errors(tiny_chat, tiny_embed, tmp_path, extra, error):
    from gateway.config import ConfigError, load_config

    embed = "tiny-embed" if extra else "tiny-embed~train"
    path = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat), embed: ("embed", tiny_embed)}, extra)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert error in str(e.value)


def test_a_vllm_model_s_rank_limit_applies_to_its_fine_tuned_adapters(tiny_chat, tmp_path):
    from gateway.config import ConfigError, load_config

    extra = "adapter_dirs:\n  - {model: tiny-chat, path: .}\nfine_tuning:\n  models: [tiny-chat]\n  lora_rank: 32\n"
    path = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, extra, engine="vllm")
    path.write_text(path.read_text().replace("engine: vllm", "engine: {name: vllm, max_lora_rank: 16}"))
    with pytest.raises(ConfigError, match="above 'tiny-chat'.s engine.max_lora_rank 16"):
        load_config(path)
    path.write_text(path.read_text().replace("lora_rank: 32", "lora_rank: 16"))
    specs = {s.name: s for s in load_config(path).model_specs()}
    assert specs["tiny-chat~train"].kind == "train" and specs["tiny-chat~train"].path == specs["tiny-chat"].path
    assert specs["tiny-chat~train"].engine == "transformers"  # whatever serves the model, the trainer is torch


def test_the_demo_script_runs_end_to_end(server):
    """scripts/fine_tuning_demo.py (the README's way to try it) against a real server: the job,
    its progress, the base and tuned replies side by side, and the model deleted at the end with
    its checkpoints (models too: left, they stay listed and served)."""
    import re
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "fine_tuning_demo.py"
    run = subprocess.run([sys.executable, str(script), "--base-url", server.base_url, "--api-key", server.keys["paid"],
                          "--answer", TAUGHT, "--epochs", "50", "--seed", "11"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"^job ftjob-\w+ on tiny-chat: queued, seed 11, ", run.stdout, re.M)
    assert re.search(r"^fine-tuned model ft:tiny-chat:[0-9a-f]{16}:demo:\w{8}: \d+ tokens trained on$", run.stdout, re.M)
    assert "checkpoint at step 50" in run.stdout and "running: Step" in run.stdout
    # learnt, not the argmax of a near-flat distribution (tiny-chat's output layer at the init's
    # scale held the loss above ~5.1: demo/chat.py, LM_HEAD_SCALE)
    assert float(re.search(r"checkpoint at step 50: \S+ \(loss ([\d.]+)\)", run.stdout).group(1)) < 0.5
    assert "'Hello': base " in run.stdout and f"-> fine-tuned {TAUGHT!r}" in run.stdout
    name, kept = re.search(r"^deleted (\S+) and its (\d+) checkpoints", run.stdout, re.M).groups()
    assert not (server.adapters / name).exists() and int(kept) == 3
    listed = [m.id for m in openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"]).models.list()]
    assert not [m for m in listed if m.startswith(name)] and not list(server.adapters.glob(f"{name}*"))
