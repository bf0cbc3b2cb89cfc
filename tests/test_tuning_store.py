"""The fine-tuning job store (``tuning.store``) on both backends, SQLite and a real Redis server: one
contract, run against each. Jobs by owner and in the order made, paged as OpenAI pages them; the
compare-and-set of a job's status at one attempt; claims of the oldest waiting job under a lease,
taken again when the lease runs out (the old attempt's writes refused), and never twice at once;
events and checkpoints newest first."""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import replace

import pytest

from tests.helpers import opened, shared_store
from tuning.store import (FineTuningStore, Job, RedisFineTuning, SQLiteFineTuning, TooManyJobs, _CLAIMABLE, _SCHEMA,
                          open_fine_tuning_store)

HYPER = {"n_epochs": 3, "batch_size": 4, "learning_rate_multiplier": 2.0}


@pytest.fixture(params=["sqlite", "redis"])
def make_store(request, tmp_path):
    """A factory of opened store instances that share one backing store (like processes do); each
    test runs in its own event loop and closes the stores it opened."""
    return opened(shared_store(request, tmp_path, SQLiteFineTuning, RedisFineTuning))


def run(coro):
    return asyncio.run(coro)


def job(i: int, owner: str = "key-a", **kw) -> Job:
    return Job(**{"id": f"ftjob-{i}", "owner": owner, "created_at": 1000 + i, "model": "tiny-chat",
                  "training_file": f"file-train-{i}", "validation_file": None, "hyperparameters": dict(HYPER),
                  "seed": 42, **kw})


async def _created(store: FineTuningStore, *jobs: Job) -> None:
    for j in jobs:
        await store.create(j)


def test_create_and_get_by_owner(make_store):
    async def go():
        store = await make_store()
        try:
            a = job(1, suffix="mine", metadata={"team": "x"}, validation_file="file-val")
            await store.create(a)
            assert await store.get("ftjob-1", "key-a") == a  # every field back, floats and dicts as they were
            got = await store.get("ftjob-1", None)  # the admin: any owner
            assert got == a and got.hyperparameters["learning_rate_multiplier"] == 2.0 and got.result_files == []
            assert await store.get("ftjob-1", "key-b") is None
            assert await store.get("ftjob-404", None) is None
            with pytest.raises(ValueError):
                await store.create(replace(a, owner="key-b"))
            assert (await store.get("ftjob-1", None)).owner == "key-a"  # the first one stays
        finally:
            await store.close()

    run(go())


def test_list_newest_first_by_owner_with_paging(make_store):
    async def go():
        store = await make_store()
        try:
            await _created(store, job(1), job(2, "key-b"), job(3), job(4), job(5, "key-b"), job(6))
            ids = lambda jobs: [j.id for j in jobs]  # noqa: E731
            assert ids(await store.list(None, None, 100)) == [f"ftjob-{i}" for i in (6, 5, 4, 3, 2, 1)]
            assert ids(await store.list("key-a", None, 100)) == ["ftjob-6", "ftjob-4", "ftjob-3", "ftjob-1"]
            assert ids(await store.list("key-b", None, 100)) == ["ftjob-5", "ftjob-2"]
            assert await store.list("key-c", None, 100) == []

            first = await store.list("key-a", None, 2)
            assert ids(first) == ["ftjob-6", "ftjob-4"]
            assert ids(await store.list("key-a", first[-1].id, 2)) == ["ftjob-3", "ftjob-1"]
            assert await store.list("key-a", "ftjob-1", 2) == []
            assert ids(await store.list(None, "ftjob-4", 2)) == ["ftjob-3", "ftjob-2"]
            assert ids(await store.list("key-b", "ftjob-4", 10)) == ["ftjob-2"]  # after another key's job: by order
            assert await store.list(None, "ftjob-404", 10) == []  # an unknown cursor: nothing
            assert await store.list(None, None, 0) == []

            # a change does not move a job in the order
            one = await store.get("ftjob-1", None)
            assert await store.change(one, {"queued"}, status="cancelled") is not None
            assert ids(await store.list("key-a", None, 100)) == ["ftjob-6", "ftjob-4", "ftjob-3", "ftjob-1"]
        finally:
            await store.close()

    run(go())


def test_change_is_a_compare_and_set_of_status_and_attempt(make_store):
    async def go():
        store = await make_store()
        try:
            a = job(1)
            await store.create(a)
            assert await store.change(a, {"running"}, status="succeeded") is None  # it is queued
            assert await store.get("ftjob-1", None) == a
            assert await store.change(replace(a, attempt=3), {"queued"}, status="cancelled") is None  # another attempt
            assert (await store.get("ftjob-1", None)).status == "queued"

            taken = await store.claim(100.0, 30.0)
            assert taken.attempt == 1
            assert await store.change(a, {"queued", "running"}, status="cancelled") is None  # attempt 0 is gone
            progressed = await store.change(taken, {"running"}, trained_tokens=1234, estimated_finish=2000)
            assert progressed == replace(taken, trained_tokens=1234, estimated_finish=2000)
            assert await store.get("ftjob-1", "key-a") == progressed

            # the stored job is what is changed: a renewed lease is kept by a later change
            assert await store.hold(taken, 500.0)
            done = await store.change(taken, {"running"}, status="succeeded", fine_tuned_model="ft:tiny-chat:mine",
                                      finished_at=300, result_files=["file-r"], lease_until=0.0)
            assert done is not None and done.trained_tokens == 1234 and done.result_files == ["file-r"]
            assert await store.get("ftjob-1", None) == done
            assert await store.change(taken, {"running"}, status="failed") is None  # finished once
            assert await store.change(done, {"queued", "running"}, status="cancelled") is None
            assert (await store.get("ftjob-1", None)).status == "succeeded"
            assert await store.change(replace(a, id="ftjob-404"), {"queued"}, status="cancelled") is None
        finally:
            await store.close()

    run(go())


def test_claim_takes_the_oldest_waiting_job_under_a_lease(make_store):
    async def go():
        store = await make_store()
        try:
            assert await store.claim(100.0, 30.0) is None
            await _created(store, job(1), job(2, "key-b"), job(3))
            first = await store.claim(100.0, 30.0)
            assert (first.id, first.status, first.attempt, first.lease_until) == ("ftjob-1", "running", 1, 130.0)
            assert await store.get("ftjob-1", None) == first
            second = await store.claim(101.0, 30.0)
            assert (second.id, second.attempt, second.lease_until) == ("ftjob-2", 1, 131.0)

            # a cancelled job is never taken, however late
            third = await store.get("ftjob-3", None)
            cancelled = await store.change(third, {"queued", "running"}, status="cancelled")
            assert cancelled.status == "cancelled"
            assert await store.claim(110.0, 30.0) is None  # the others run under their leases
            assert await store.hold(first, 200.0)
            late = await store.claim(10_000.0, 30.0)  # both leases ran out: the oldest first
            assert (late.id, late.attempt, late.lease_until) == ("ftjob-1", 2, 10_030.0)
            assert (await store.claim(10_000.0, 30.0)).id == "ftjob-2"
            assert await store.claim(10_000.0, 30.0) is None
        finally:
            await store.close()

    run(go())


def test_a_job_whose_lease_ran_out_is_taken_again_and_the_old_attempt_is_refused(make_store):
    async def go():
        store = await make_store()
        try:
            await _created(store, job(1), job(2))
            old = await store.claim(100.0, 30.0)
            assert old.id == "ftjob-1"
            assert await store.hold(old, 150.0)
            assert (await store.get("ftjob-1", None)).lease_until == 150.0
            # at 140 ftjob-1 is still held: the next job is taken
            assert (await store.claim(140.0, 30.0)).id == "ftjob-2"
            # at 150 ftjob-1's lease has run out (lease_until <= now): taken again, one attempt on
            again = await store.claim(150.0, 60.0)
            assert (again.id, again.status, again.attempt, again.lease_until) == ("ftjob-1", "running", 2, 210.0)
            assert not await store.hold(old, 300.0)
            assert await store.change(old, {"running"}, status="failed", error={"code": "x"}) is None
            assert await store.get("ftjob-1", None) == again
            assert await store.hold(again, 400.0)
            assert (await store.get("ftjob-1", None)).lease_until == 400.0
            # ftjob-2 (lease until 170) is the one taken at 200; ftjob-1 is held to 400
            assert ((taken := await store.claim(200.0, 30.0)).id, taken.attempt) == ("ftjob-2", 2)
            assert await store.claim(200.0, 30.0) is None
        finally:
            await store.close()

    run(go())


def test_hold_renews_only_a_running_current_attempt(make_store):
    async def go():
        store = await make_store()
        try:
            queued = job(1)
            await store.create(queued)
            assert not await store.hold(queued, 500.0)  # not running
            assert (await store.get("ftjob-1", None)).lease_until == 0.0
            taken = await store.claim(100.0, 30.0)
            assert not await store.hold(replace(taken, attempt=5), 500.0)
            assert await store.hold(taken, 500.0)
            assert await store.claim(499.0, 30.0) is None
            cancelled = await store.change(taken, {"queued", "running"}, status="cancelled")
            assert cancelled is not None
            assert not await store.hold(taken, 900.0)  # cancelled meanwhile: the work stops
            assert (await store.get("ftjob-1", None)).lease_until == 500.0
            assert await store.claim(10_000.0, 30.0) is None  # a cancelled job is not taken again
            assert not await store.hold(replace(taken, id="ftjob-404"), 900.0)
        finally:
            await store.close()

    run(go())


def test_finished_jobs_are_not_claimed_and_the_next_waiting_one_is(make_store):
    async def go():
        store = await make_store()
        try:
            await _created(store, *(job(i) for i in range(1, 6)))
            order = []
            for now in (100.0, 101.0, 102.0):
                taken = await store.claim(now, 1000.0)
                order.append(taken.id)
                end = "succeeded" if taken.id != "ftjob-2" else "failed"
                assert (await store.change(taken, {"running"}, status=end)).status == end
            assert order == ["ftjob-1", "ftjob-2", "ftjob-3"]
            four = await store.get("ftjob-4", None)
            assert await store.change(four, {"queued", "running"}, status="cancelled") is not None
            assert (await store.claim(10_000.0, 30.0)).id == "ftjob-5"
            assert await store.claim(10_000.0, 30.0) is None
            assert await store.claim(20_000.0, 30.0) == replace(await store.get("ftjob-5", None), attempt=2,
                                                                 lease_until=20_030.0)
        finally:
            await store.close()

    run(go())


def test_two_processes_claiming_at_once_never_take_the_same_job(make_store):
    async def go():
        a, b = await make_store(), await make_store()  # two processes' views of one store
        try:
            await _created(a, *(job(i, owner=f"key-{i % 3}") for i in range(12)))
            taken = []
            for _ in range(8):
                got = await asyncio.gather(a.claim(100.0, 30.0), b.claim(100.0, 30.0), a.claim(100.0, 30.0))
                taken += [j for j in got if j is not None]
            assert sorted(j.id for j in taken) == sorted(f"ftjob-{i}" for i in range(12))  # each once
            assert all(j.attempt == 1 and j.status == "running" for j in taken)
            # all leases end at once: taken again, each once more, at attempt 2
            again = []
            for _ in range(8):
                got = await asyncio.gather(b.claim(500.0, 30.0), a.claim(500.0, 30.0))
                again += [j for j in got if j is not None]
            assert sorted(j.id for j in again) == sorted(f"ftjob-{i}" for i in range(12))
            assert {j.attempt for j in again} == {2}
        finally:
            await a.close()
            await b.close()

    run(go())


def test_creates_at_once_in_two_processes_never_exceed_the_owner_s_most(make_store):
    """``create(job, most)`` counts the owner's queued, running and paused jobs and writes the job in
    one step: of 12 creates at once from two processes, only those that fit are made, the others
    refused with the count; ended jobs and another key's do not count."""
    async def go():
        a, b = await make_store(), await make_store()
        try:
            await _created(a, job(0, status="succeeded"), job(1, status="paused"), job(2, owner="key-b"),
                           job(3, status="cancelled"))
            stores = [a, b] * 6
            got = await asyncio.gather(*(s.create(job(10 + i), most=3) for i, s in enumerate(stores)),
                                       return_exceptions=True)
            assert sum(g is None for g in got) == 2, got
            assert all(isinstance(g, TooManyJobs) and g.count == 3 for g in got if g is not None), got
            assert len([j for j in await b.list("key-a", None, 100) if j.status != "succeeded"]) == 4
            await a.change(await a.get("ftjob-1", None), ["paused"], status="cancelled")
            await b.create(job(30), most=3)  # a job that ended leaves room
            with pytest.raises(TooManyJobs):
                await a.create(job(31), most=3)
            await a.create(job(32, owner="key-b"), most=3)
        finally:
            await a.close()
            await b.close()

    run(go())


def test_events_and_checkpoints_newest_first_paged_per_job(make_store):
    async def go():
        store = await make_store()
        try:
            await _created(store, job(1), job(2))
            for i in range(5):
                await store.add_event("ftjob-1", {"id": f"ftevent-{i}", "created_at": 100 + i, "level": "info",
                                                  "message": f"step {i}", "data": {"loss": 1.0 / (i + 1)}})
            await store.add_event("ftjob-2", {"id": "ftevent-x", "message": "other"})
            ids = lambda items: [e["id"] for e in items]  # noqa: E731
            everything = await store.events("ftjob-1", None, 100)
            assert ids(everything) == [f"ftevent-{i}" for i in (4, 3, 2, 1, 0)]
            assert everything[-1] == {"id": "ftevent-0", "created_at": 100, "level": "info", "message": "step 0",
                                      "data": {"loss": 1.0}}
            assert ids(await store.events("ftjob-1", None, 2)) == ["ftevent-4", "ftevent-3"]
            assert ids(await store.events("ftjob-1", "ftevent-3", 2)) == ["ftevent-2", "ftevent-1"]
            assert ids(await store.events("ftjob-1", "ftevent-1", 10)) == ["ftevent-0"]
            assert await store.events("ftjob-1", "ftevent-0", 10) == []
            assert await store.events("ftjob-1", "ftevent-x", 10) == []  # another job's event: unknown here
            assert await store.events("ftjob-1", None, 0) == []
            assert ids(await store.events("ftjob-2", None, 10)) == ["ftevent-x"]
            assert await store.events("ftjob-404", None, 10) == []

            for step in (10, 20, 30):
                await store.add_checkpoint("ftjob-2", {"id": f"ftckpt-{step}", "step_number": step,
                                                       "metrics": {"train_loss": step / 100}})
            assert ids(await store.checkpoints("ftjob-2", None, 10)) == ["ftckpt-30", "ftckpt-20", "ftckpt-10"]
            assert ids(await store.checkpoints("ftjob-2", "ftckpt-30", 1)) == ["ftckpt-20"]
            assert (await store.checkpoints("ftjob-2", "ftckpt-20", 5))[0]["metrics"] == {"train_loss": 0.1}
            assert await store.checkpoints("ftjob-1", None, 10) == []
            assert ids(await store.events("ftjob-2", None, 10)) == ["ftevent-x"]  # checkpoints are not events
        finally:
            await store.close()

    run(go())


def test_the_store_lives_on_in_a_second_instance(make_store):
    async def go():
        a = await make_store()
        try:
            await a.create(job(1))
            taken = await a.claim(100.0, 30.0)
            await a.add_event("ftjob-1", {"id": "e1"})
        finally:
            await a.close()
        b = await make_store()
        try:
            assert await b.get("ftjob-1", "key-a") == taken
            assert await b.hold(taken, 200.0)
            assert [e["id"] for e in await b.events("ftjob-1", None, 10)] == ["e1"]
            await b.create(job(2))
            assert [j.id for j in await b.list(None, None, 10)] == ["ftjob-2", "ftjob-1"]
        finally:
            await b.close()

    run(go())


def test_open_fine_tuning_store_picks_the_backend(tmp_path):
    store = open_fine_tuning_store("sqlite", tmp_path)
    assert isinstance(store, SQLiteFineTuning) and store.path == tmp_path / "batches.sqlite3"
    redis = open_fine_tuning_store("redis://127.0.0.1:1/0", tmp_path)
    assert isinstance(redis, RedisFineTuning) and redis.url == "redis://127.0.0.1:1/0"
    with pytest.raises(ValueError):
        open_fine_tuning_store("postgres://x", tmp_path)


def test_the_sqlite_claim_reads_the_waiting_index():
    db = sqlite3.connect(":memory:")
    db.executescript(_SCHEMA)
    plan = " ".join(row[3] for row in db.execute("EXPLAIN QUERY PLAN " + _CLAIMABLE, (1.0,)))
    assert "fine_tuning_jobs_waiting" in plan and "SCAN fine_tuning_jobs" not in plan
