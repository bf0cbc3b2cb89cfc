"""The event stream (arbiter/events.py) and each tier's recent figures (gateway/tier_stats.py),
as plain objects with injected clocks; and what the arbiter's owner reports into the stream as it
pauses batch work, evicts (naming who caused it) and relieves out-of-memory errors."""

from __future__ import annotations

import asyncio

import pytest

import torch

from arbiter.events import EventLog, Lagged
from arbiter.residency import Arbiter
from gateway.tier_stats import TierStats
from workers.base import ModelSpec

GiB = 2**30
TIERS = ["paid", "subscriber", "free", "batch"]
PAID, FREE, BATCH = 0, 2, 3


def test_ring_keeps_the_last_events_with_growing_ids_and_times():
    now = [100.0]
    log = EventLog(capacity=3, clock=lambda: now[0])
    for i in range(5):
        now[0] += 1
        log.emit("eviction", model=f"m{i}")
    assert [e.id for e in log.recent] == [3, 4, 5] and log.last_id == 5
    assert [e.public() for e in log.since(3)] == [
        {"id": 4, "at": 104.0, "kind": "eviction", "model": "m3"},
        {"id": 5, "at": 105.0, "kind": "eviction", "model": "m4"}]
    assert [e.id for e in log.since(0, limit=2)] == [4, 5]


def test_subscribers_get_every_event_in_order_and_leave():
    async def main():
        log = EventLog()
        with log.subscribe() as a, log.subscribe() as b:
            log.emit("load_started", model="x")
            log.emit("load_finished", model="x")
            assert [(await a.next(1)).kind for _ in range(2)] == ["load_started", "load_finished"]
            assert (await b.next(1)).kind == "load_started"
            assert await a.next(0.01) is None  # nothing more: a timeout, not an error
        assert not log._subscribers
        log.emit("refusal")  # no subscribers: nothing blocks, nothing is queued
        assert log.last_id == 3

    asyncio.run(main())


def test_a_subscriber_that_falls_behind_reads_what_it_has_then_lags():
    async def main():
        log = EventLog(queue_size=2)
        sub = log.subscribe()
        for kind in ("a", "b", "c"):  # the third does not fit: the subscriber is dropped
            log.emit(kind)
        assert [(await sub.next(1)).kind for _ in range(2)] == ["a", "b"]
        with pytest.raises(Lagged):
            await sub.next(1)
        assert not log._subscribers

    asyncio.run(main())


def test_tier_figures_count_the_last_minute_and_quantiles_over_five_minutes():
    now = [1000.0]
    stats = TierStats(["paid", "free"], clock=lambda: now[0])
    for seconds in [0.1] * 50 + [0.2] * 49 + [3.0]:
        stats.latency("paid", seconds)
    stats.admitted("paid")
    stats.refused("free", "queue_full")
    stats.refused("free", "model_protected")
    stats.refused("free", "queue_full")
    paid, free = stats.figures("paid"), stats.figures("free")
    assert (paid.admitted_per_min, paid.refused_per_min, paid.latency_samples) == (1, 0, 100)
    assert 0.1 <= paid.p50_s <= 0.105 and 0.2 <= paid.p99_s <= 0.21  # 5% bins, never below the truth
    assert free.refused_per_min == 3 and free.refused_by_reason_per_min == {"queue_full": 2, "model_protected": 1}
    assert free.p50_s is None and free.latency_samples == 0

    now[0] += 90  # past the minute: the counts go; latencies stay for five minutes
    paid = stats.figures("paid")
    assert (paid.admitted_per_min, paid.latency_samples) == (0, 100)
    stats.latency("paid", 3.0)
    assert stats.figures("paid").latency_samples == 101
    now[0] += 300  # past five minutes: only the newest latency is left
    paid = stats.figures("paid")
    assert paid.latency_samples == 1 and 3.0 <= paid.p50_s == paid.p99_s <= 3.15
    now[0] += 400
    assert stats.figures("paid").latency_samples == 0


def test_tier_figures_keep_a_bounded_record_under_load():
    now = [0.0]
    stats = TierStats(["paid"], clock=lambda: now[0], bucket_s=5.0, span_s=300.0)
    for i in range(200_000):
        now[0] = i * 0.01  # 2000 s of traffic at 100 requests a second
        stats.admitted("paid")
        stats.latency("paid", 0.05 + (i % 100) / 1000)
    buckets = stats._buckets["paid"]
    assert len(buckets) <= 62 and all(len(b.latency) <= 40 for b in buckets)
    paid = stats.figures("paid")
    assert 5500 <= paid.admitted_per_min <= 6500 and paid.latency_samples >= 30_000
    assert 0.099 <= paid.p50_s <= 0.106 and 0.148 <= paid.p99_s <= 0.156


def arbiter(tiny_chat, host_cache: int = 8 * GiB) -> Arbiter:
    """Four 4 GiB chat models (declared) on a 10 GiB budget: two fit at a time."""
    specs = [ModelSpec(n, "chat", tiny_chat, 4 * GiB) for n in "abcd"]
    return Arbiter(specs, torch.device("cpu"), 10 * GiB, host_cache, protect_window_s=60, batch_rank=BATCH,
                   tier_names=TIERS)


def kinds(arb: Arbiter, since: int = 0) -> list[tuple]:
    return [(e.kind, e.data.get("model")) for e in arb.events.since(since)]


async def use(arb: Arbiter, model: str, tier: int) -> None:
    (await arb.acquire(model, tier, is_batch=tier == BATCH)).release()


def test_evictions_name_who_caused_them_and_where_the_victim_went(tiny_chat):
    async def main():
        arb = arbiter(tiny_chat, host_cache=4 * GiB)  # room for one warm copy
        for model in "ab":
            await use(arb, model, FREE)
        await use(arb, "c", PAID)  # a (least recently used) goes warm
        await use(arb, "d", PAID)  # b goes warm, pushing a's warm copy out to disk
        evictions = [e.data for e in arb.events.since(0) if e.kind == "eviction"]
        assert evictions == [
            {"model": "a", "from_place": "resident", "to_place": "warm", "reason": "make_room", "by_model": "c", "by_tier": "paid"},
            {"model": "a", "from_place": "warm", "to_place": "cold", "reason": "host_cache", "by_model": "d", "by_tier": "paid"},
            {"model": "b", "from_place": "resident", "to_place": "warm", "reason": "make_room", "by_model": "d", "by_tier": "paid"},
        ]
        loads = [e.data for e in arb.events.since(0) if e.kind == "load_finished"]
        assert [(d["model"], d["from_place"]) for d in loads] == [("a", "cold"), ("b", "cold"), ("c", "cold"), ("d", "cold")]
        started = [e.data for e in arb.events.since(0) if e.kind == "load_started"]
        assert [(d["model"], d["tier"]) for d in started] == [("a", "free"), ("b", "free"), ("c", "paid"), ("d", "paid")]
        await arb.unload("c")
        assert arb.events.recent[-1].data == {
            "model": "c", "from_place": "resident", "to_place": "warm", "reason": "admin", "by_model": None, "by_tier": None}
        await arb.stop()

    asyncio.run(main())


def test_refusals_and_batch_pauses_are_reported(tiny_chat):
    async def main():
        arb = arbiter(tiny_chat)
        await use(arb, "a", PAID)
        await use(arb, "b", PAID)
        mark = arb.events.last_id
        with pytest.raises(Exception):
            await use(arb, "c", FREE)  # both protected against free
        refusal = arb.events.since(mark)[0]
        assert refusal.kind == "refusal" and refusal.data["tier"] == "free" and refusal.data["model"] == "c"
        assert refusal.data["reason"] == "model_protected" and refusal.data["retry_after_s"] == 60

        lease = await arb.acquire("a", BATCH, is_batch=True)
        mark = arb.events.last_id
        arb.set_demand(True)  # another tier has work: batch work pauses
        arb.set_demand(True)  # no change, no event
        arb.set_demand(False)
        assert kinds(arb, mark) == [("batch_paused", "a"), ("batch_resumed", "a")]
        lease.release()
        await arb.stop()

    asyncio.run(main())


def test_out_of_memory_relief_is_reported_with_its_victim(tiny_chat):
    async def main():
        arb = arbiter(tiny_chat)
        await use(arb, "a", FREE)
        await use(arb, "b", PAID)
        mark = arb.events.last_id
        assert await arb.relieve_oom("b", PAID)
        relief, eviction = arb.events.since(mark)
        assert (relief.kind, relief.data) == ("oom_relief", {"model": "b", "victim": "a", "tier": "paid"})
        assert eviction.kind == "eviction" and eviction.data["reason"] == "oom" and eviction.data["by_model"] == "b"
        await arb.stop()

    asyncio.run(main())


def test_the_gate_reports_refusals_and_the_guards_limit_changes():
    from gateway.admission import Gate, Rejected, TierPolicy
    from gateway.slo_guard import GuardSettings

    now = [100.0]
    events = EventLog()
    tiers = [TierPolicy("paid", 0, 8, 64, 1.0), TierPolicy("free", 1, 4, 0, 1.0)]
    gate = Gate(tiers, slots=16, clock=lambda: now[0], events=events,
                guard=GuardSettings(window_s=5.0, interval_s=1.0, min_samples=3))

    async def main():
        for _ in range(4):
            await gate.acquire("free", "m")  # free's four slots
        with pytest.raises(Rejected):
            await gate.acquire("free", "m")  # no room to queue either

    asyncio.run(main())
    refusal = events.recent[-1]
    assert (refusal.kind, refusal.data) == ("refusal", {"tier": "free", "model": "m", "reason": "queue_full",
                                                        "retry_after_s": 1})
    assert gate.stats.figures("free").refused_by_reason_per_min == {"queue_full": 1}
    for _ in range(3):
        gate.observe_latency("paid", 0.95)  # paid near its target: free gives way
        now[0] += 1.0
    changes = [e.data for e in events.recent if e.kind == "limits_changed"]
    assert changes == [{"limits": {"paid": 8, "free": 2}, "before": {"paid": 8, "free": 4}}]


def test_a_reader_cancelled_as_its_event_arrives_stops_and_the_event_stays_queued():
    """On Python 3.11 ``asyncio.wait_for`` returns the result instead of raising when the
    cancellation lands after the inner get completed: the reader then never stopped (the
    dashboard's stream, the collector's follower). ``next`` must raise, and lose nothing."""
    import asyncio

    async def main():
        log = EventLog()
        sub = log.subscribe()
        reader = asyncio.create_task(sub.next(timeout=60))
        await asyncio.sleep(0)  # the reader waits on the queue
        log.emit("load_finished", model="m")
        reader.cancel()  # before the loop runs again: the get has its item, the reader its cancel
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert (await sub.next(timeout=1)).kind == "load_finished"

    asyncio.run(main())
