"""The arbiter's owner on CPU with declared footprints: a 10 GiB simulated budget and four
4 GiB models (real tiny chat models under four names). Each scenario checks the model table
after each step."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from arbiter.residency import Arbiter, Refused, Unavailable
from workers.registry import make_worker
from workers.base import ModelSpec

GiB = 2**30
PAID, SUB, FREE, BATCH = 0, 1, 2, 3


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def specs(tiny_chat, names="abcd", vram=4 * GiB):
    return [ModelSpec(n, "chat", tiny_chat, vram) for n in names]


def places(arb: Arbiter) -> dict[str, str]:
    return {r["id"]: r["place"] for r in arb.table()}


async def use(arb: Arbiter, model: str, tier: int):
    lease = await arb.acquire(model, tier, is_batch=tier == BATCH)
    lease.release()


def make(tiny_chat, clock, factory=make_worker, budget=10 * GiB, host=8 * GiB, names="abcd"):
    return Arbiter(specs(tiny_chat, names), torch.device("cpu"), budget, host, protect_window_s=60,
                   batch_rank=BATCH, clock=clock, worker_factory=factory)


def test_paid_request_evicts_the_free_tier_model(tiny_chat):
    clock = Clock()

    async def main():
        arb = make(tiny_chat, clock)
        await use(arb, "a", FREE)
        clock.t += 1
        await use(arb, "b", SUB)
        assert places(arb) == {"a": "resident", "b": "resident", "c": "cold", "d": "cold"}
        clock.t += 1
        await use(arb, "c", PAID)  # 12 GiB > 10: someone must go, and it is the free-tier one
        assert places(arb) == {"a": "warm", "b": "resident", "c": "resident", "d": "cold"}
        assert arb.counters.evictions == {("a", "make_room"): 1}
        row = next(r for r in arb.table() if r["id"] == "c")
        assert row["last_tier"] == PAID and row["footprint_bytes"] == 4 * GiB
        await arb.stop()

    asyncio.run(main())


def test_free_request_blocked_by_protection_gets_retry_after_then_succeeds(tiny_chat):
    clock = Clock()

    async def main():
        arb = make(tiny_chat, clock)
        await use(arb, "a", PAID)
        clock.t += 10
        await use(arb, "b", PAID)
        clock.t += 5
        with pytest.raises(Refused) as exc:
            await use(arb, "c", FREE)
        # a's protection (served 15 s ago, 60 s window) is the first to end: in 45 s
        assert exc.value.retry_after == 45
        assert places(arb) == {"a": "resident", "b": "resident", "c": "cold", "d": "cold"}
        with pytest.raises(Refused):  # batch never evicts a model in its window either
            await use(arb, "c", BATCH)
        clock.t += 46  # a's window is over, b's is not
        await use(arb, "c", FREE)
        assert places(arb) == {"a": "warm", "b": "resident", "c": "resident", "d": "cold"}
        await arb.stop()

    asyncio.run(main())


def test_higher_tier_may_evict_a_model_protected_for_a_lower_tier(tiny_chat):
    clock = Clock()

    async def main():
        arb = make(tiny_chat, clock)
        await use(arb, "a", FREE)
        await use(arb, "b", SUB)
        clock.t += 1
        with pytest.raises(Refused):
            await use(arb, "c", FREE)  # both protected against free
        await use(arb, "c", SUB)  # subscriber may evict the free-protected one
        assert places(arb)["a"] == "warm" and places(arb)["c"] == "resident"
        await arb.stop()

    asyncio.run(main())


def test_busy_model_is_never_evicted_and_the_request_waits(tiny_chat):
    clock = Clock()

    async def main():
        arb = make(tiny_chat, clock, budget=5 * GiB)
        lease = await arb.acquire("a", FREE)  # running free work on a
        clock.t += 1000  # protection long over; only the running work keeps it
        waiting = asyncio.create_task(arb.acquire("b", PAID))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        assert places(arb)["a"] == "resident"
        lease.release()
        b = await asyncio.wait_for(waiting, 30)
        assert places(arb) == {"a": "warm", "b": "resident", "c": "cold", "d": "cold"}
        b.release()
        await arb.stop()

    asyncio.run(main())


def test_a_model_chosen_for_eviction_is_not_granted_to_a_request_waiting_for_it(tiny_chat):
    """A free request's load of ``a`` ends while paid waits for ``b`` (one model fits): paid's
    load evicts ``a``, and the free request, granted ``a`` in the same pass before the eviction
    ran, ran on an evicted model (a 500 without a host cache: hunt 4 U1). Now the victim is busy
    from the decision on: the free request waits, then gets paid's protection as a 429."""
    clock = Clock()

    async def main():
        arb = make(tiny_chat, clock, budget=5 * GiB)
        free = asyncio.create_task(arb.acquire("a", FREE))
        await asyncio.sleep(0)  # free's load of a starts
        assert places(arb)["a"] == "loading"
        paid = await asyncio.wait_for(arb.acquire("b", PAID), 30)
        assert places(arb) == {"a": "warm", "b": "resident", "c": "cold", "d": "cold"}
        paid.release()
        with pytest.raises(Refused):
            await asyncio.wait_for(free, 30)
        assert all(r["running"] == 0 for r in arb.table())
        await arb.stop()

    asyncio.run(main())


def test_lower_tiers_start_no_new_work_on_a_busy_model_a_higher_tier_waits_to_evict(tiny_chat):
    """Paid waits for ``a``'s running free work to end (one model fits). Free requests kept
    being granted ``a`` meanwhile, so with free traffic that overlapped, paid waited as long as it
    lasted (19 s for a 10 s target: hunt 4 U2). New free requests for ``a`` now get a 429 at once
    (Retry-After 1: by then paid's model is in) and paid goes in when the running one ends."""
    clock = Clock()

    async def main():
        arb = make(tiny_chat, clock, budget=5 * GiB)
        running = await arb.acquire("a", FREE)
        paid = asyncio.create_task(arb.acquire("b", PAID))
        await asyncio.sleep(0.05)
        assert not paid.done()
        with pytest.raises(Refused) as refused:
            await arb.acquire("a", FREE)
        assert refused.value.retry_after == 1
        clock.t += 1
        running.release()
        (await asyncio.wait_for(paid, 30)).release()
        assert places(arb) == {"a": "warm", "b": "resident", "c": "cold", "d": "cold"}
        await arb.stop()

    asyncio.run(main())


def test_the_drain_holds_while_another_model_loads(tiny_chat):
    """While a subscriber's load of ``b`` runs, paid waits for ``a``'s running free work to end
    (``c`` fits only without it). Every waiter was skipped while the device was busy loading, so
    the drain was never worked out and free requests were handed ``a`` through the whole load: 10-40
    s on a vLLM engine (hunt 4 U2, second round). They get the drain's 429 during loads too."""
    import threading

    clock = Clock()
    go = threading.Event()

    def factory(spec):
        worker = make_worker(spec)
        if spec.name == "b":
            load = worker.load

            def held(device):
                go.wait(30)
                return load(device)

            worker.load = held
        return worker

    async def main():
        arb = make(tiny_chat, clock, factory=factory)
        arb.pin("b", True)  # (so that paid cannot count on evicting it once loaded: a must drain)
        running = await arb.acquire("a", FREE)
        sub = asyncio.create_task(arb.acquire("b", SUB))
        await asyncio.sleep(0)
        assert places(arb)["b"] == "loading"
        paid = asyncio.create_task(arb.acquire("c", PAID))
        await asyncio.sleep(0.05)
        with pytest.raises(Refused) as refused:
            await arb.acquire("a", FREE)
        assert refused.value.retry_after == 1
        go.set()
        (await asyncio.wait_for(sub, 30)).release()
        running.release()
        (await asyncio.wait_for(paid, 30)).release()
        assert places(arb) == {"a": "warm", "b": "resident", "c": "resident", "d": "cold"}
        await arb.stop()

    asyncio.run(main())


def test_no_lower_tier_load_starts_while_a_higher_tier_drains(tiny_chat):
    """Paid waits for ``a``'s free work to end, counting on every free byte as well: a subscriber's
    load that started meanwhile took that memory, so paid then had to evict it too (hunt 4 U2, second
    round). A lower tier's load is refused (429, Retry-After 1) while a higher tier drains, and
    starts once it is served."""
    clock = Clock()

    async def main():
        sizes = {"a": 4, "b": 4, "c": 4, "e": 1}
        arb = Arbiter([ModelSpec(n, "chat", tiny_chat, g * GiB) for n, g in sizes.items()], torch.device("cpu"),
                      10 * GiB, 8 * GiB, protect_window_s=60, batch_rank=BATCH, clock=clock)
        await arb.load("b")
        arb.pin("b", True)  # 2 GiB free beside a and b
        running = await arb.acquire("a", FREE)
        paid = asyncio.create_task(arb.acquire("c", PAID))
        await asyncio.sleep(0.05)
        assert not paid.done()
        with pytest.raises(Refused) as refused:
            await arb.acquire("e", SUB)  # it fits in the 2 GiB paid counts on
        assert refused.value.retry_after == 1 and places(arb)["e"] == "cold"
        running.release()
        (await asyncio.wait_for(paid, 30)).release()
        await use(arb, "e", SUB)
        assert places(arb) == {"a": "warm", "b": "resident", "c": "resident", "e": "resident"}
        await arb.stop()

    asyncio.run(main())


def test_a_load_that_serves_no_one_gives_no_protection(tiny_chat):
    """A preload or an admin's load (``Arbiter.load``) made the model paid's for the protection
    window, so even paid got 429 ``model_protected`` for memory no request had used (hunt 4 U3).
    It is now no tier's use: the model is the first to make room until a request uses it."""
    clock = Clock()

    async def main():
        arb = make(tiny_chat, clock, budget=5 * GiB)
        await arb.load("a")
        row = next(r for r in arb.table() if r["id"] == "a")
        assert (row["place"], row["last_tier"], row["protected_until_s"]) == ("resident", None, 0.0)
        await use(arb, "b", FREE)  # even free may take its room
        assert places(arb)["a"] == "warm"
        await arb.stop()

    asyncio.run(main())


def test_a_batch_pause_is_counted_once_when_the_paused_model_is_then_evicted(tiny_chat):
    """Batch work paused for the gate's demand, whose model a paid request then evicts, was
    counted twice in ``tiergate_batch_pauses_total`` for its one ``batch_paused`` event (hunt 4 U5)."""
    clock = Clock()

    async def main():
        arb = make(tiny_chat, clock, budget=5 * GiB)
        batch = await arb.acquire("a", BATCH, is_batch=True)
        arb.set_demand(True)  # paid arrives at the gate: the batch work pauses
        assert arb.counters.batch_pauses == 1
        (await asyncio.wait_for(arb.acquire("b", PAID), 30)).release()  # and a makes room
        assert places(arb)["a"] == "warm"
        assert arb.counters.batch_pauses == 1
        assert [e.kind for e in arb.events.since(0)].count("batch_paused") == 1
        batch.release()
        await arb.stop()

    asyncio.run(main())


def test_warm_reload_is_faster_than_cold_load(tiny_chat):
    clock = Clock()

    async def main():
        arb = make(tiny_chat, clock, budget=5 * GiB)
        await use(arb, "a", FREE)
        cold = arb.counters.last_load["a"]
        await use(arb, "b", PAID)  # evicts a to the host cache
        assert places(arb)["a"] == "warm"
        clock.t += 100
        await use(arb, "a", PAID)  # b (paid, 100 s ago) is out of its window
        warm = arb.counters.last_load["a"]
        assert cold[0] == "cold" and warm[0] == "warm"
        assert warm[1] < cold[1]
        await arb.stop()

    asyncio.run(main())


def test_host_cache_full_sends_the_evicted_model_cold(tiny_chat):
    clock = Clock()

    async def main():
        arb = make(tiny_chat, clock, budget=5 * GiB, host=0)
        await use(arb, "a", FREE)
        await use(arb, "b", PAID)
        assert places(arb)["a"] == "cold"
        assert "a" not in arb.workers  # its weights are gone
        await arb.stop()

    asyncio.run(main())


class OOMOnce:
    """A worker factory whose load raises torch.OutOfMemoryError the first ``times`` times for
    ``model``."""

    def __init__(self, model: str, times: int = 1):
        self.model, self.left, self.calls = model, times, 0

    def __call__(self, spec):
        worker = make_worker(spec)
        if spec.name == self.model:
            self.calls += 1
            if self.left > 0:
                self.left -= 1

                def boom(device):
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")

                worker.load = boom
        return worker


def test_oom_during_load_evicts_the_least_valuable_and_retries_once(tiny_chat):
    clock = Clock()

    async def main():
        factory = OOMOnce("c")
        arb = make(tiny_chat, clock, factory=factory, budget=12 * GiB)
        await use(arb, "a", FREE)
        clock.t += 100
        await use(arb, "b", SUB)
        await use(arb, "c", PAID)  # fits by the numbers, but the device says no the first time
        assert factory.calls == 2
        assert places(arb) == {"a": "warm", "b": "resident", "c": "resident", "d": "cold"}
        assert arb.counters.evictions == {("a", "make_room"): 1}
        await arb.stop()

    asyncio.run(main())


def test_oom_twice_is_503_and_the_table_stays_true(tiny_chat):
    clock = Clock()

    async def main():
        factory = OOMOnce("c", times=2)
        arb = make(tiny_chat, clock, factory=factory, budget=12 * GiB)
        await use(arb, "a", FREE)
        clock.t += 100
        with pytest.raises(Unavailable) as exc:
            await use(arb, "c", PAID)
        assert "out of memory" in str(exc.value)
        assert places(arb) == {"a": "warm", "b": "cold", "c": "cold", "d": "cold"}
        await use(arb, "b", PAID)  # the arbiter still works
        assert places(arb)["b"] == "resident"
        await arb.stop()

    asyncio.run(main())


def test_failed_load_answers_503_with_cooldown_instead_of_retrying(tiny_chat, tmp_path):
    clock = Clock()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    calls = []

    def factory(spec):
        calls.append(spec.name)
        return make_worker(spec)

    async def main():
        arb = Arbiter([ModelSpec("x", "chat", broken, GiB)], torch.device("cpu"), 10 * GiB, GiB, 60, BATCH,
                      clock=clock, worker_factory=factory)
        with pytest.raises(Unavailable) as first:
            await use(arb, "x", PAID)
        assert first.value.retry_after == 2
        with pytest.raises(Unavailable) as second:  # no new attempt during the cooldown
            await use(arb, "x", PAID)
        assert len(calls) == 1 and second.value.retry_after == 2
        clock.t += 2.5
        with pytest.raises(Unavailable) as third:  # tried again, failed again: cooldown doubles
            await use(arb, "x", PAID)
        assert len(calls) == 2 and third.value.retry_after == 4
        assert places(arb) == {"x": "cold"}

    asyncio.run(main())


def test_stop_ends_a_load_under_way_and_releases_its_worker(tiny_chat):
    """The server stops while a model loads (a preload, a load for a request): ``stop`` does not
    leave the load running for the process's exit to wait on (a vLLM engine's start: tens of
    seconds, past the drain's timeout) but cancels it, and releases its worker, not yet among the
    loaded ones (the engine's start abandoned, its processes ended)."""
    clock = Clock()
    released = []

    def factory(spec):
        worker = make_worker(spec)
        real = worker.release

        async def place(device):
            await asyncio.sleep(3600)  # a start that has not ended when the server stops

        async def release():
            released.append(spec.name)
            await real()

        worker.place, worker.release = place, release
        return worker

    async def main():
        arb = make(tiny_chat, clock, factory=factory)
        loading = asyncio.create_task(arb.load("a"))
        while places(arb)["a"] != "loading":
            await asyncio.sleep(0.01)
        async with asyncio.timeout(10):
            await arb.stop()
        assert released == ["a"]
        loading.cancel()

    asyncio.run(main())


class Loads:
    """A worker factory whose loads take ``seconds`` and fail for the models in ``failing`` (an
    Exception) or ``oom_once`` (torch.OutOfMemoryError, the first time), counting the loads that
    ran at once (``most``)."""

    def __init__(self, seconds: float = 0.2, failing=(), oom_once=()):
        self.seconds, self.failing, self.oom = seconds, set(failing), set(oom_once)
        self.running = self.most = 0

    def __call__(self, spec):
        worker = make_worker(spec)
        real = worker.load

        def load(device):
            self.running += 1
            self.most = max(self.most, self.running)
            try:
                time.sleep(self.seconds)
                if spec.name in self.failing:
                    raise OSError(f"{spec.name}: weights unreadable (injected)")
                if spec.name in self.oom:
                    self.oom.discard(spec.name)
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")
                real(device)
            finally:
                self.running -= 1

        worker.load = load
        return worker


def test_a_failed_load_leaves_the_next_waiter_loading_without_another_request(tiny_chat):
    """A request that waited for the device while another model's load failed is served: the
    failure's handling used to look for the next load while the failed one still held the
    device, and nothing looked again until some later request came."""
    clock = Clock()

    async def main():
        factory = Loads(failing={"b"})
        arb = make(tiny_chat, clock, factory=factory)
        failed = asyncio.create_task(use(arb, "b", FREE))
        await asyncio.sleep(0.05)  # b's load under way
        async with asyncio.timeout(30):
            served = asyncio.create_task(use(arb, "a", PAID))
            with pytest.raises(Unavailable):
                await failed
            await served
        assert places(arb) == {"a": "resident", "b": "cold", "c": "cold", "d": "cold"}
        await arb.stop()

    asyncio.run(main())


def test_an_oom_retry_holds_the_device_as_any_load_does(tiny_chat):
    """One load at a time on a device: while the out-of-memory retry runs, another model's load
    waits for it (the retry's start used to be cleared by the failed attempt's end)."""
    clock = Clock()

    async def main():
        factory = Loads(oom_once={"c"})
        arb = make(tiny_chat, clock, factory=factory, budget=12 * GiB)
        await use(arb, "a", FREE)
        clock.t += 100
        retried = asyncio.create_task(use(arb, "c", PAID))
        await asyncio.sleep(0.3)  # c's first attempt failed; its retry is loading
        async with asyncio.timeout(30):
            await asyncio.gather(retried, use(arb, "b", PAID))
        assert factory.most == 1
        assert places(arb) == {"a": "warm", "b": "resident", "c": "resident", "d": "cold"}
        await arb.stop()

    asyncio.run(main())


def test_a_chain_whose_models_do_not_fit_together_evicts_its_own_first_model(tiny_chat):
    """One request's steps on two models that do not fit together (speech in, then a chat): the
    second step evicts the first step's model, which only the request's own use protected; a
    request of the same tier without that use is refused, as is the chain once another request
    used the model after it."""
    clock = Clock()

    async def main():
        arb = make(tiny_chat, clock, budget=6 * GiB, names="ab")
        used: dict[str, float] = {}
        (await arb.acquire("a", PAID, used=used)).release()
        assert used == {"a": clock.t}
        clock.t += 1
        with pytest.raises(Refused):
            await use(arb, "b", PAID)  # another paid request: a is protected from it
        (await arb.acquire("b", PAID, used=used)).release()
        assert places(arb) == {"a": "warm", "b": "resident"}
        clock.t += 1
        await use(arb, "b", PAID)  # another paid request uses b after the chain did
        with pytest.raises(Refused):
            await arb.acquire("a", PAID, used=used)
        await arb.stop()

    asyncio.run(main())


def test_an_eviction_that_fails_sends_its_victim_cold_instead_of_stranding_it(tiny_chat):
    """A victim's move to the host cache fails (pinning host memory, say) while it makes room:
    it is released and goes cold, the load goes on, and the victim's next request loads it again
    (it stayed ``loading`` for good, its bytes counted, and that request waited forever)."""
    clock = Clock()

    def factory(spec):
        worker = make_worker(spec)
        if spec.name == "a":
            async def to_host(pin):
                raise RuntimeError("cannot pin host memory (injected)")

            worker.to_host = to_host
        return worker

    async def main():
        arb = make(tiny_chat, clock, factory=factory, budget=6 * GiB)
        await use(arb, "a", FREE)
        clock.t += 100
        await use(arb, "b", PAID)
        assert places(arb) == {"a": "cold", "b": "resident", "c": "cold", "d": "cold"}
        assert arb.view().used == 4 * GiB
        clock.t += 100
        async with asyncio.timeout(30):
            await use(arb, "a", PAID)
        assert places(arb)["a"] == "resident"
        await arb.stop()

    asyncio.run(main())


def test_a_failed_reload_from_the_host_cache_frees_the_host_copy(tiny_chat):
    """Bringing a warm model back fails (not for memory): the model goes cold, and its host copy
    and engine thread are released first (they were dropped unreleased: a whole model's host
    memory and a thread leaked per failure, and batch work paused on it then placed the same
    worker again over its live thread, which hung the server's stop)."""
    clock = Clock()
    released = []

    def factory(spec):
        worker = make_worker(spec)
        if spec.name == "a":
            real = worker.release

            async def to_device(device):
                raise OSError("host copy unreadable (injected)")

            async def release():
                released.append(spec.name)
                await real()

            worker.to_device, worker.release = to_device, release
        return worker

    async def main():
        arb = make(tiny_chat, clock, factory=factory, budget=6 * GiB)
        await use(arb, "a", FREE)
        thread = arb.workers["a"]._thread
        clock.t += 100
        await use(arb, "b", PAID)
        assert places(arb)["a"] == "warm" and released == []
        clock.t += 100
        with pytest.raises(Unavailable):
            await use(arb, "a", PAID)
        assert places(arb)["a"] == "cold" and released == ["a"] and not thread.is_alive()
        await arb.stop()

    asyncio.run(main())


def test_bringing_back_a_paused_batch_model_keeps_the_failed_load_cooldown(tiny_chat):
    """Batch work paused on a model evicted meanwhile; bringing the model back fails (its files
    went bad): the next try waits for the cooldown, as a request's would (it was tried again at
    once, thousands of times a second, on the event loop), and once the model loads again the
    work resumes."""
    clock = Clock()
    attempts, broken = [], [False]

    def factory(spec):
        worker = make_worker(spec)
        if spec.name == "a":
            for method in ("place", "to_device"):
                async def move(device, real=getattr(worker, method)):
                    attempts.append(device)
                    if broken[0]:
                        raise OSError("weights unreadable (injected)")
                    await real(device)

                setattr(worker, method, move)
        return worker

    async def main():
        arb = make(tiny_chat, clock, factory=factory, budget=6 * GiB)
        batch = await arb.acquire("a", BATCH, is_batch=True)
        arb.set_demand(True)  # another tier's request: the batch work pauses
        clock.t += 100
        await use(arb, "b", PAID)  # evicts a, its batch work paused
        assert places(arb)["a"] == "warm"
        attempts.clear()
        broken[0] = True
        clock.t += 100  # b's protection over
        arb.set_demand(False)  # idle: a is brought back for its batch work, and that fails
        await asyncio.sleep(0.5)
        assert len(attempts) == 1 and places(arb)["a"] == "cold"
        broken[0] = False
        clock.t += 3  # the cooldown is over
        arb.set_demand(True)
        arb.set_demand(False)
        async with asyncio.timeout(30):
            while places(arb)["a"] != "resident":
                await asyncio.sleep(0.02)
        assert len(attempts) == 2 and arb._may_run["a"].is_set()  # the batch work resumes
        batch.release()
        await arb.stop()

    asyncio.run(main())


def test_a_trainers_room_for_training_stays_in_its_footprint_once_measured(tiny_chat):
    """``fine_tuning.training_memory`` is counted beside the trainer's weights: in the estimate
    before its first load and in the measured footprint after it (where the measurement, which
    sees the weights only, replaced it)."""
    clock = Clock()

    async def main():
        spec = ModelSpec("t", "train", tiny_chat, options={"training_bytes": GiB})
        arb = Arbiter([spec], torch.device("cpu"), 10 * GiB, 0, 60, BATCH, clock=clock)
        before = arb.states["t"].footprint
        assert before > GiB
        await use(arb, "t", BATCH)
        row = next(r for r in arb.table() if r["id"] == "t")
        assert row["place"] == "resident" and row["footprint_source"] == "measured"
        assert GiB < row["footprint_bytes"] <= before + GiB // 100
        await arb.stop()

    asyncio.run(main())


def test_concurrent_requests_for_one_model_share_one_load(tiny_chat):
    clock = Clock()
    calls = []

    def factory(spec):
        calls.append(spec.name)
        return make_worker(spec)

    async def main():
        arb = make(tiny_chat, clock, factory=factory)
        leases = await asyncio.gather(*[arb.acquire("a", t) for t in (PAID, FREE, SUB, FREE)])
        assert calls == ["a"]
        assert all(lease.worker is leases[0].worker for lease in leases)
        for lease in leases:
            lease.release()
        await arb.stop()

    asyncio.run(main())


def test_pinned_model_is_never_evicted(tiny_chat):
    clock = Clock()

    async def main():
        arb = make(tiny_chat, clock, budget=5 * GiB)
        await use(arb, "a", FREE)
        arb.pin("a", True)
        clock.t += 1000
        with pytest.raises(Unavailable):
            await use(arb, "b", PAID)
        arb.pin("a", False)
        await use(arb, "b", PAID)
        assert places(arb)["a"] == "warm"
        await arb.stop()

    asyncio.run(main())


class AlwaysDecides(Arbiter):
    """The owner without the shortcut for non-batch changes: every schedule re-decides batch work."""

    def _schedule(self, non_batch_only: bool = False) -> None:
        super()._schedule(non_batch_only=False)


def test_non_batch_schedules_decide_batch_work_as_a_full_schedule_does(tiny_chat):
    """Random leases (batch and not) and demand changes on two models, applied to an owner with
    the shortcut and one without: the same states, the same paused models and pause counts,
    and the same run/pause signal for every model with batch work, after every step."""
    import random

    rng = random.Random(7)

    async def main():
        clock = Clock()
        arbs = [make(tiny_chat, clock, names="ab"),
                AlwaysDecides(specs(tiny_chat, "ab"), torch.device("cpu"), 10 * GiB, 8 * GiB,
                              protect_window_s=60, batch_rank=BATCH, clock=clock)]
        held: list[list] = [[], []]
        for _ in range(300):
            clock.t += 1
            op = rng.random()
            model, tier, pick, busy = rng.choice("ab"), rng.randrange(4), rng.random(), rng.random() < 0.5
            for arb, leases in zip(arbs, held):
                if op < 0.45:
                    leases.append(await arb.acquire(model, tier, is_batch=tier == BATCH))
                elif op < 0.9 and leases:
                    leases.pop(int(pick * len(leases))).release()
                else:
                    arb.set_demand(busy)
                await asyncio.sleep(0)
            fast, full = arbs
            assert fast.states == full.states
            assert fast._paused == full._paused
            assert fast.counters.batch_pauses == full.counters.batch_pauses
            for name, state in full.states.items():
                if state.running_batch:
                    assert fast._may_run[name].is_set() == full._may_run[name].is_set()
        assert any(s.running_batch for s in arbs[0].states.values()) or arbs[0].counters.batch_pauses
        for arb in arbs:
            await arb.stop()

    asyncio.run(main())


def test_looking_again_later_keeps_the_sooner_timer(tiny_chat):
    """The arbiter keeps one timer to look at paused batch work again (each pass that found the
    same wait added one of its own): a later wait asked for does not put off a sooner one."""
    async def main():
        arb = make(tiny_chat, Clock())
        loop = asyncio.get_running_loop()
        arb._look_again(5)
        first = arb._later.when()
        arb._look_again(30)  # later: the sooner timer stays
        assert arb._later.when() == first
        arb._look_again(1)  # sooner: it takes the timer's place
        assert arb._later.when() < first and loop.time() + 0.9 < arb._later.when()
        await arb.stop()

    asyncio.run(main())
