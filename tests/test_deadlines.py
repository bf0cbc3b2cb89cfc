"""gateway/deadlines.py: deadlines of one length on a FIFO fire as ``call_later`` would, in order,
once, and never once cancelled."""

import asyncio
import contextvars
import random

import pytest

from gateway.deadlines import Deadlines

S = 0.02


def queue_of(deadlines: Deadlines):
    return deadlines._queues[asyncio.get_running_loop()]


def test_a_deadline_fires_when_a_call_later_of_its_length_would():
    async def main():
        loop = asyncio.get_running_loop()
        fired: dict[str, float] = {}
        deadline = Deadlines(S).after(lambda: fired.setdefault("deadline", loop.time()))
        reference_set = loop.time()
        loop.call_later(S, lambda: fired.setdefault("reference", loop.time()) and fired.setdefault("before", "deadline" in fired))
        await asyncio.sleep(S * 5)
        return deadline.when, reference_set, fired

    when, reference_set, fired = asyncio.run(main())
    assert fired["deadline"] >= when - 1e-3  # not early (the loop's own slack is its clock resolution)
    assert fired["before"] is True  # not later: it has fired by the time the call_later set after it does
    assert reference_set - S - 1e-3 <= when - S <= reference_set


def test_deadlines_fire_in_order_with_their_arguments_and_only_once():
    async def main():
        fired = []
        deadlines = Deadlines(S)
        for i in range(5):
            deadlines.after(fired.append, i)
            await asyncio.sleep(0.002)
        await asyncio.sleep(S * 3)
        return fired, deadlines.pending()

    assert asyncio.run(main()) == ([0, 1, 2, 3, 4], 0)


def test_a_cancelled_deadline_never_fires_and_cancel_is_idempotent():
    async def main():
        fired = []
        deadlines = Deadlines(S)
        kept = deadlines.after(fired.append, "kept")
        dropped = deadlines.after(fired.append, "dropped")
        dropped.cancel()
        dropped.cancel()
        assert deadlines.pending() == 1
        await asyncio.sleep(S * 3)
        kept.cancel()  # after it fired: nothing happens
        return fired, deadlines.pending()

    assert asyncio.run(main()) == (["kept"], 0)


def test_with_the_front_cancelled_the_next_fires_at_its_own_time_not_before():
    async def main():
        loop = asyncio.get_running_loop()
        fired = {}
        deadlines = Deadlines(S)
        front = deadlines.after(fired.setdefault, "front", 0.0)
        await asyncio.sleep(S / 2)
        second = deadlines.after(lambda: fired.setdefault("second", loop.time()))
        front.cancel()
        await asyncio.sleep(S * 3)
        return second.when, fired

    when, fired = asyncio.run(main())
    assert "front" not in fired
    assert fired["second"] >= when - 1e-3


def test_the_timer_is_rearmed_after_the_queue_drains_and_fills_again():
    async def main():
        fired = []
        deadlines = Deadlines(S)
        deadlines.after(fired.append, 1).cancel()  # empties the queue; its loop timer stays armed
        await asyncio.sleep(S * 2)
        deadlines.after(fired.append, 2)
        await asyncio.sleep(S * 3)
        return fired

    assert asyncio.run(main()) == [2]


def test_a_random_mix_of_kept_and_cancelled_deadlines_fires_exactly_the_kept_in_order():
    rng = random.Random(7)

    async def main():
        loop = asyncio.get_running_loop()
        deadlines = Deadlines(S)
        fired, kept, set_ = [], [], []
        for i in range(300):
            set_.append((i, deadlines.after(lambda i=i: fired.append((i, loop.time())))))
            if rng.random() < 0.3:
                await asyncio.sleep(0)
            if rng.random() < 0.7:
                rng.choice(set_)[1].cancel()
        for i, deadline in set_:
            if deadline.callback is not None:
                kept.append((i, deadline.when))
        await asyncio.sleep(S * 4)
        return fired, kept, deadlines.pending()

    fired, kept, pending = asyncio.run(main())
    assert [i for i, _ in fired] == [i for i, _ in kept] and pending == 0
    assert all(at >= when - 1e-3 for (_, at), (_, when) in zip(fired, kept))
    assert 0 < len(kept) < 300


def test_a_long_lived_front_does_not_keep_every_cancelled_deadline_behind_it():
    async def main():
        deadlines = Deadlines(60.0)
        front = deadlines.after(print, "never")
        for _ in range(1000):
            deadlines.after(print, "never").cancel()
        length = len(queue_of(deadlines).items)
        front.cancel()
        return length, len(queue_of(deadlines).items)

    length, after = asyncio.run(main())
    assert length <= 2 * 1 + 17 and after == 0


def test_a_failing_callback_goes_to_the_loops_handler_and_the_rest_still_fire():
    async def main():
        loop = asyncio.get_running_loop()
        handled, fired = [], []
        loop.set_exception_handler(lambda _loop, context: handled.append(context["exception"]))
        deadlines = Deadlines(S)
        deadlines.after(lambda: 1 / 0)
        deadlines.after(fired.append, "after")
        await asyncio.sleep(S * 3)
        return handled, fired

    handled, fired = asyncio.run(main())
    assert [type(e) for e in handled] == [ZeroDivisionError] and fired == ["after"]


def test_a_callback_may_set_and_cancel_deadlines():
    async def main():
        fired = []
        deadlines = Deadlines(S)
        later = []

        def first():
            fired.append("first")
            later.append(deadlines.after(fired.append, "again"))
            doomed.cancel()

        deadlines.after(first)
        doomed = deadlines.after(fired.append, "doomed")
        await asyncio.sleep(S * 4)
        return fired

    assert asyncio.run(main()) == ["first", "again"]


def test_callbacks_run_outside_the_context_that_set_them():
    request = contextvars.ContextVar("request", default=None)

    async def main():
        seen = []
        request.set("r1")
        Deadlines(S).after(lambda: seen.append(request.get()))
        await asyncio.sleep(S * 3)
        return seen

    assert asyncio.run(main()) == [None]


def test_one_instance_serves_a_new_loop_after_the_old_one_closed():
    deadlines = Deadlines(S)

    async def main(tag):
        fired = []
        deadlines.after(fired.append, tag)
        deadlines.after(fired.append, "cancelled").cancel()
        await asyncio.sleep(S * 3)
        return fired

    assert asyncio.run(main("one")) == ["one"]
    assert asyncio.run(main("two")) == ["two"]


def test_on_uvloop_deadlines_keep_the_loops_own_clock():
    uvloop = pytest.importorskip("uvloop")

    async def main():
        loop = asyncio.get_running_loop()
        fired = {}
        deadline = Deadlines(S).after(lambda: fired.setdefault("at", loop.time()))
        loop.call_later(S, lambda: fired.setdefault("before", "at" in fired))
        await asyncio.sleep(S * 5)
        return deadline.when, fired

    loop = uvloop.new_event_loop()
    try:
        when, fired = loop.run_until_complete(main())
    finally:
        loop.close()
    assert fired["at"] >= when - 1e-3 and fired["before"] is True
