"""The admission gate: ordering, direct hand-off, leaving, refusals, batch, cost model."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission import CostModel, Gate, Rejected, TierPolicy


def tiers(max_queued=100, target=1000.0, inflight=100):
    return [
        TierPolicy("paid", 0, inflight, max_queued, target),
        TierPolicy("subscriber", 1, inflight, max_queued, target),
        TierPolicy("free", 2, inflight, max_queued, target),
        TierPolicy("batch", 3, inflight, max_queued, target, is_batch=True),
    ]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_paid_queued_after_50_free_is_admitted_first():
    async def main():
        gate = Gate(tiers(), slots=1)
        first = await gate.acquire("free", "m")
        order = []

        async def one(tier, i):
            t = await gate.acquire(tier, "m")
            order.append((tier, i))
            gate.release(t)

        tasks = [asyncio.create_task(one("free", i)) for i in range(50)]
        await settle()
        tasks.append(asyncio.create_task(one("paid", 0)))
        await settle()
        assert gate.queued("free") == 50 and gate.queued("paid") == 1
        gate.release(first)
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(main())
    assert order[0] == ("paid", 0)
    assert order[1:] == [("free", i) for i in range(50)]  # FIFO within the tier


def test_slot_is_handed_over_directly_no_barging():
    async def main():
        gate = Gate(tiers(), slots=1)
        held = await gate.acquire("free", "m")
        waiter = asyncio.create_task(gate.acquire("free", "m"))
        await settle()
        gate.release(held)
        # the waiter owns the slot before it has even run again
        assert gate.inflight["free"] == 1 and gate.queued("free") == 0
        newcomer = asyncio.create_task(gate.acquire("free", "m"))
        await settle()
        assert not newcomer.done()  # it queues behind: the slot is taken
        t = await waiter
        gate.release(t)
        gate.release(await newcomer)

    asyncio.run(main())


def test_cancelled_waiter_leaves_the_queue():
    async def main():
        gate = Gate(tiers(), slots=1)
        held = await gate.acquire("paid", "m")
        a = asyncio.create_task(gate.acquire("free", "m"))
        b = asyncio.create_task(gate.acquire("free", "m"))
        await settle()
        a.cancel()
        await settle()
        assert gate.queued("free") == 1
        gate.release(held)
        t = await b
        assert gate.inflight["free"] == 1
        gate.release(t)

    asyncio.run(main())


def test_slot_handed_to_a_waiter_that_is_leaving_passes_on():
    async def main():
        gate = Gate(tiers(), slots=1)
        held = await gate.acquire("paid", "m")
        a = asyncio.create_task(gate.acquire("free", "m"))
        b = asyncio.create_task(gate.acquire("free", "m"))
        await settle()
        gate.release(held)  # hands the slot to a ...
        a.cancel()  # ... which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await a
        t = await asyncio.wait_for(b, 1)  # b got the slot a gave back
        assert gate.inflight["free"] == 1
        gate.release(t)
        assert gate.total_inflight == 0

    asyncio.run(main())


def test_queue_full_is_rejected_with_retry_after():
    async def main():
        gate = Gate(tiers(max_queued=2), slots=1)
        held = await gate.acquire("free", "m")
        waiting = [asyncio.create_task(gate.acquire("free", "m")) for _ in range(2)]
        await settle()
        with pytest.raises(Rejected) as exc:
            await gate.acquire("free", "m")
        assert exc.value.reason == "queue_full"
        assert 1 <= exc.value.retry_after <= 120
        assert gate.rejected[("free", "queue_full")] == 1
        for w in waiting:
            w.cancel()
        gate.release(held)

    asyncio.run(main())


def test_predicted_wait_over_target_is_rejected_at_once():
    async def main():
        clock = Clock()
        costs = CostModel()
        for _ in range(3):
            costs.observe("m", 10, 4.0)  # 4 s per request
        gate = Gate(tiers(target=10.0), slots=1, costs=costs, clock=clock)
        held = await gate.acquire("free", "m", 10)
        q = [asyncio.create_task(gate.acquire("free", "m", 10)) for _ in range(2)]
        await settle()
        # running 4 s + 2 queued x 4 s = 12 s > 10 s target
        with pytest.raises(Rejected) as exc:
            await gate.acquire("free", "m", 10)
        assert exc.value.reason == "latency_target"
        assert exc.value.retry_after == 2
        # a paid request sees only its own tier's queue: 4 s of running work, admitted to wait
        paid = asyncio.create_task(gate.acquire("paid", "m", 10))
        await settle()
        assert gate.queued("paid") == 1
        for t in q + [paid]:
            t.cancel()
        gate.release(held)

    asyncio.run(main())


def test_retry_after_is_capped_at_120():
    async def main():
        costs = CostModel()
        costs.observe("m", 1, 1000.0)
        gate = Gate(tiers(target=1.0), slots=1, costs=costs, clock=Clock())
        held = await gate.acquire("free", "m")
        with pytest.raises(Rejected) as exc:
            await gate.acquire("free", "m")
        assert exc.value.retry_after == 120
        gate.release(held)

    asyncio.run(main())


def test_batch_runs_only_while_others_are_idle():
    async def main():
        gate = Gate(tiers(), slots=4)
        paid = await gate.acquire("paid", "m")
        batch = asyncio.create_task(gate.acquire("batch", "m"))
        await settle()
        assert not batch.done()  # paid is running
        gate.release(paid)
        bt = await asyncio.wait_for(batch, 1)
        # batch holds a slot but does not keep others out: it will yield at its next step
        others = [await gate.acquire("free", "m") for _ in range(4)]
        assert gate.inflight["free"] == 4
        second = asyncio.create_task(gate.acquire("batch", "m"))
        await settle()
        assert not second.done()
        for t in others:
            gate.release(t)
        gate.release(await asyncio.wait_for(second, 1))
        gate.release(bt)

    asyncio.run(main())


def test_cost_model_fits_size_and_updates():
    costs = CostModel(window=8, prior_s=1.0)
    assert costs.predict("m", 100) == 1.0
    for units in (10, 20, 30, 40):
        costs.observe("m", units, 0.5 + 0.1 * units)
    assert costs.predict("m", 100) == pytest.approx(10.5, rel=1e-6)
    for _ in range(8):  # the window forgets the old regime
        costs.observe("m", 50, 1.0)
    assert costs.predict("m", 100) == pytest.approx(1.0)


def test_rate_headers_count_the_tier():
    async def main():
        gate = Gate(tiers(max_queued=5, inflight=3), slots=10)
        t = await gate.acquire("free", "m")
        h = gate.rate_headers("free")
        assert h["x-ratelimit-limit-requests"] == "8"
        assert h["x-ratelimit-remaining-requests"] == "7"
        assert h["x-ratelimit-reset-requests"] == "0s"
        gate.release(t)

    asyncio.run(main())


def test_rate_headers_of_a_refusal_leave_no_room():
    """A refused request is told that nothing is left until its Retry-After, even when its own
    tier has nobody in flight (the slot it wanted is another tier's)."""

    async def main():
        gate = Gate(tiers(max_queued=0, inflight=3), slots=1)
        held = await gate.acquire("paid", "m")
        assert gate.rate_headers("free")["x-ratelimit-remaining-requests"] == "3"
        with pytest.raises(Rejected) as refusal:
            gate.refuse_if_full("free")
        h = gate.rate_headers("free", refused_for=refusal.value.retry_after)
        assert h["x-ratelimit-limit-requests"] == "3"
        assert h["x-ratelimit-remaining-requests"] == "0"
        assert h["x-ratelimit-reset-requests"] == f"{refusal.value.retry_after}s"
        gate.release(held)

    asyncio.run(main())


def test_refuse_if_full_answers_before_any_work():
    async def main():
        gate = Gate(tiers(max_queued=1), slots=1)
        gate.refuse_if_full("free")  # a slot is free: nothing to refuse
        held = await gate.acquire("free", "m")
        gate.refuse_if_full("free")  # no slot, but room in the queue
        waiting = asyncio.create_task(gate.acquire("free", "m"))
        await settle()
        with pytest.raises(Rejected) as exc:
            gate.refuse_if_full("free")  # no slot and the queue is full
        assert exc.value.reason == "queue_full" and 1 <= exc.value.retry_after <= 120
        assert gate.rejected[("free", "queue_full")] == 1
        gate.refuse_if_full("paid")  # other tiers are not affected
        waiting.cancel()
        gate.release(held)

    asyncio.run(main())


def test_waiters_that_leave_stop_counting_and_are_not_kept():
    """A cancelled waiter stops counting at once; the gate forgets it (no pile-up of dead waiters
    under a stream of clients that give up), and the next live waiter still gets the slot."""

    async def main():
        gate = Gate(tiers(max_queued=10_000), slots=1)
        held = await gate.acquire("free", "m")
        for _ in range(50):
            leaving = [asyncio.create_task(gate.acquire("free", "m")) for _ in range(20)]
            await settle()
            assert gate.queued("free") == 20
            for t in leaving:
                t.cancel()
            await settle()
            assert gate.queued("free") == 0
        assert len(gate._lanes["free"].queue) <= 20 + 16  # dead waiters are dropped as they pile up
        last = asyncio.create_task(gate.acquire("free", "m"))
        await settle()
        gate.release(held)
        gate.release(await asyncio.wait_for(last, 1))
        assert gate.total_inflight == 0 and gate.queued("free") == 0

    asyncio.run(main())


# -- demand from the door: an arrival pauses batch before its body is read ---------------------------


def test_an_arrival_is_demand_until_its_ticket_counts_in_its_place():
    async def main():
        gate = Gate(tiers(), slots=4)
        told = []
        gate.on_change = lambda: told.append(gate.others_busy())
        arrival = gate.arrive("paid")
        assert gate.others_busy() and told == [True]
        ticket = await gate.acquire("paid", "m", arrival=arrival)
        assert arrival.ended and gate.others_busy() and told == [True]  # no idle flip in between
        gate.release(ticket)
        assert not gate.others_busy() and told == [True, False]
        gate.left(arrival)  # idempotent
        assert told == [True, False]
        assert gate.arrive("batch") is None  # batch never pauses batch

    asyncio.run(main())


def test_an_arrival_that_never_reaches_the_gate_lapses(monkeypatch):
    import gateway.admission as admission

    monkeypatch.setattr(admission, "DOOR_WINDOW_S", 0.01)

    async def main():
        gate = Gate(tiers(), slots=4)
        told = []
        gate.on_change = lambda: told.append(gate.others_busy())
        gate.arrive("free")
        await asyncio.sleep(0.05)
        return told, gate.others_busy()

    assert asyncio.run(main()) == ([True, False], False)


def test_batch_waits_while_a_request_is_on_its_way_and_starts_when_it_leaves():
    async def main():
        gate = Gate(tiers(), slots=4)
        arrival = gate.arrive("subscriber")
        batch = asyncio.create_task(gate.acquire("batch", "m"))
        await settle()
        assert not batch.done() and gate.queued("batch") == 1
        gate.left(arrival)  # it failed on its way (bad input): batch goes on at once
        await settle()
        assert batch.done()
        gate.release(batch.result())

    asyncio.run(main())


def test_a_refused_arrival_stops_counting():
    async def main():
        gate = Gate(tiers(max_queued=0), slots=1)
        first = await gate.acquire("paid", "m")
        arrival = gate.arrive("free")
        with pytest.raises(Rejected):
            await gate.acquire("free", "m", arrival=arrival)
        assert arrival.ended
        gate.release(first)
        assert not gate.others_busy()

    asyncio.run(main())


def test_a_tier_at_its_own_limit_waits_for_its_own_work():
    """A tier held at its own max_inflight passes through that many slots, not all of them: its
    predicted wait is its own work over its limit (10 s here, not 10 s over 8 slots), so the latency
    target refuses what would wait too long, and a client back after the Retry-After is queued."""

    async def main():
        clock = Clock()
        costs = CostModel()
        costs.observe("m", 1, 10.0)
        gate = Gate([TierPolicy("paid", 0, 8, 10, 5.0), TierPolicy("free", 1, 1, 10, 5.0)], slots=8,
                    costs=costs, clock=clock)
        held = await gate.acquire("free", "m")
        second = asyncio.create_task(gate.acquire("free", "m"))
        await settle()
        if not second.done():  # queued for 10 s against a 5 s target (not awaited: the test would hang)
            second.cancel()
            pytest.fail(f"queued, its wait predicted {gate.predict_wait(gate.tiers['free'])} s")
        with pytest.raises(Rejected) as exc:
            second.result()
        assert exc.value.reason == "latency_target" and exc.value.retry_after == 5
        clock.t += exc.value.retry_after
        back = asyncio.create_task(gate.acquire("free", "m"))
        await settle()
        assert gate.queued("free") == 1  # queued: 5 s left, within the target
        assert gate.predict_wait(gate.tiers["paid"]) == 0.0  # paid has slots of its own
        gate.release(held)
        gate.release(await back)
        assert gate.total_inflight == 0 and gate.predict_wait(gate.tiers["free"]) == 0.0

    asyncio.run(main())
