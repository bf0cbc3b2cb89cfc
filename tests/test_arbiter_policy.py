"""The arbiter's pure decisions: who is evicted for whom, refusals, host cache, batch yielding.

Unless a test says otherwise: a 10 GiB budget, 4 GiB models, tiers paid=0 > sub=1 > free=2 >
batch=3, a 60 s protection window, now = 1000.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from arbiter.policy import (
    MAX_RETRY_AFTER_S,
    ArbiterView,
    Evict,
    Fit,
    Impossible,
    LoadCooldown,
    ModelState,
    Refuse,
    after_load_failure,
    batch_must_yield,
    blocker,
    host_cache_plan,
    next_cooldown,
    pick_oom_victim,
    plan_load,
    retry_after_s,
    served,
    value_key,
)

GiB = 1024**3
PAID, SUB, FREE, BATCH = 0, 1, 2, 3
NOW = 1000.0
WINDOW = 60.0


def m(name, gib=4, place="resident", served_at=None, **kw) -> ModelState:
    """A model; ``served_at`` maps tier -> seconds *ago* (relative to NOW) for readability."""
    at = {tier: NOW - ago for tier, ago in (served_at or {}).items()}
    return ModelState(name, "chat", int(gib * GiB), place, at, **kw)


def view(*models, budget=10, host=0, now=NOW, window=WINDOW, queued=None) -> ArbiterView:
    return ArbiterView(
        {x.name: x for x in models}, int(budget * GiB), int(host * GiB), now, window, queued or {}
    )


def plan(v: ArbiterView, model: str, tier: int):
    return plan_load(v, model, tier, BATCH)


# --- fitting -------------------------------------------------------------------------------


def test_fits_in_free_memory():
    v = view(m("a"), m("b", place="cold"))
    assert plan(v, "b", FREE) == Fit()


@pytest.mark.parametrize("place", ["resident", "loading"])
def test_already_there(place):
    v = view(m("a"), m("b"), m("c", place=place, gib=2))
    assert plan(v, "c", BATCH) == Fit()


def test_loading_model_counts_against_the_budget():
    v = view(m("a", place="loading"), m("b", place="loading"), m("c", place="cold"))
    assert isinstance(plan(v, "c", PAID), Impossible)
    assert plan(v, "c", PAID).waiting_on == ("a", "b")


def test_bigger_than_the_budget_is_impossible():
    """Never, whatever runs now: no busy model to wait for."""
    v = view(m("huge", gib=11, place="cold"), m("a", running_nonbatch=1))
    d = plan(v, "huge", PAID)
    assert isinstance(d, Impossible) and d.waiting_on == () and "budget" in d.reason


# --- the 10 GiB / four 4 GiB scenario --------------------------------------------------------

FOUR = dict(
    a=m("a", served_at={FREE: 10}),  # free tier, 10 s ago: protected from free/batch
    b=m("b", served_at={PAID: 30}),  # paid, 30 s ago: protected from everyone
    c=m("c", place="cold"),
    d=m("d", place="warm"),
)


def test_paid_request_evicts_the_free_tier_model():
    v = view(*FOUR.values())
    d = plan(v, "c", PAID)
    assert isinstance(d, Evict) and d.victims == ("a",)


def test_free_request_blocked_by_protection_is_refused_until_it_ends():
    v = view(FOUR["a"], m("b", served_at={PAID: 30.5}), FOUR["c"])
    d = plan(v, "c", FREE)
    # a's protection ends in 50 s, b's in 29.5 s: b's is the earliest that frees enough
    assert d == Refuse(30, d.reason)  # 29.5 rounded up
    later = view(FOUR["a"], m("b", served_at={PAID: 30.5}), FOUR["c"], now=NOW + 29.5)
    assert plan(later, "c", FREE) == Evict(("b",), to_cold=("b",))


def test_retry_after_is_capped_at_120():
    v = view(m("a", served_at={PAID: 1}), m("b", served_at={PAID: 1}), m("c", place="cold"),
             window=3600)  # fmt: skip
    assert plan(v, "c", FREE) == Refuse(MAX_RETRY_AFTER_S, plan(v, "c", FREE).reason)


def test_retry_after_waits_for_enough_memory_not_the_first_expiry():
    """Freeing a 1 GiB model first is not enough: the refusal lasts until the 4 GiB one's ends."""
    v = view(m("small", gib=1, served_at={SUB: 50}), m("big", served_at={SUB: 20}),
             m("new", place="cold"), budget=5)  # fmt: skip
    assert plan(v, "new", FREE).retry_after == 40


def test_protection_ends_exactly_at_the_window():
    v = view(m("a", served_at={PAID: 60}), m("b", served_at={PAID: 59}), m("c", place="cold"))
    assert plan(v, "c", FREE) == Evict(("a",), to_cold=("a",))


@pytest.mark.parametrize(
    "seconds, expected", [(0, 1), (0.2, 1), (1.0, 1), (1.0000001, 2), (119.5, 120), (500, 120)]
)
def test_retry_after_rounding(seconds, expected):
    assert retry_after_s(seconds) == expected


# --- who may evict whom ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "last_tier, requester, allowed",
    [
        (FREE, PAID, True),
        (FREE, SUB, True),
        (FREE, FREE, False),  # the same tier may not
        (FREE, BATCH, False),
        (PAID, PAID, False),
        (SUB, PAID, True),
        (BATCH, FREE, True),
        (BATCH, BATCH, False),
    ],
)
def test_protection_by_tier(last_tier, requester, allowed):
    v = view(m("a", served_at={last_tier: 5}), m("b", served_at={PAID: 5}), m("c", place="cold"))
    d = plan(v, "c", requester)
    assert (d == Evict(("a",), to_cold=("a",))) if allowed else isinstance(d, Refuse)


def test_protection_remembers_every_tier_in_the_window():
    """Served to paid 50 s ago and to free 5 s ago: paid's window holds it against everyone for
    10 s more; then free's holds it against free and batch only."""
    a = served(served(m("a", place="resident"), PAID, NOW - 50), FREE, NOW - 5)
    others = (m("b", served_at={PAID: 5}), m("c", place="cold"))
    assert plan(view(a, *others), "c", SUB) == Refuse(10, plan(view(a, *others), "c", SUB).reason)
    assert plan(view(a, *others), "c", PAID).retry_after == 10
    assert plan(view(a, *others, now=NOW + 10), "c", SUB).victims == ("a",)
    assert plan(view(a, *others, now=NOW + 10), "c", FREE).retry_after == 45


@pytest.mark.parametrize(
    "served_at, own_ago, requester, allowed",
    [
        ({FREE: 5}, 5, FREE, True),  # its own step, the last serve of its tier: no protection from it
        ({FREE: 5}, None, FREE, False),  # another request's: protected
        ({FREE: 2}, 5, FREE, False),  # its tier served it again after the request's own use
        ({FREE: 5, SUB: 30}, 5, FREE, False),  # a higher tier's serve protects it from the request
        ({PAID: 5}, 5, PAID, True),
        ({PAID: 5, SUB: 1}, 5, PAID, True),  # a lower tier's serve never protects from paid
        ({PAID: 5}, 5, FREE, False),  # the request's own use at another tier is not its tier's serve
    ],
)
def test_a_requests_own_earlier_step_does_not_protect_the_model_from_its_next(served_at, own_ago, requester, allowed):
    """A chain (speech in, a chat, speech out) whose models do not fit together: its next step may
    evict the model its own earlier step used, as long as no one else's serve protects it."""
    v = view(m("a", served_at=served_at), m("b", served_at={PAID: 1}), m("c", place="cold"))
    own = {} if own_ago is None else {"a": NOW - own_ago}
    d = plan_load(v, "c", requester, BATCH, own)
    assert (d == Evict(("a",), to_cold=("a",))) if allowed else isinstance(d, Refuse)
    assert blocker(v, v.models["a"], requester, BATCH, own.get("a")) == (None if allowed else "protected")


def test_batch_requester_never_evicts_a_model_used_in_the_window():
    for tier in (PAID, SUB, FREE, BATCH):
        v = view(m("a", served_at={tier: 59}), m("b", served_at={PAID: 1}), m("c", place="cold"))
        assert isinstance(plan(v, "c", BATCH), Refuse)
    v = view(m("a", served_at={FREE: 61}), m("b", served_at={PAID: 1}), m("c", place="cold"))
    assert plan(v, "c", BATCH).victims == ("a",)


def test_running_nonbatch_work_is_never_evicted():
    a = m("a", running_nonbatch=1)  # least valuable: never served
    v = view(a, m("b", served_at={PAID: 100}), m("c", place="cold"))
    assert plan(v, "c", PAID).victims == ("b",)
    alone = view(a, m("b", pinned=True), m("c", place="cold"))
    assert plan(alone, "c", PAID) == Impossible(plan(alone, "c", PAID).reason, waiting_on=("a",), drain=("a",))


# Which busy models a waiting request drains (no new lower-tier work on them until it fits): 10 GiB,
# "c" (4 GiB) to load, "p" pinned (4 GiB) unless a case says otherwise. Each row: the models, the
# requester, what it waits on, what it drains.
DRAINS = [
    ("one busy free model: paid drains it",
     [m("a", served_at={FREE: 1}, running_nonbatch=2), m("p", pinned=True)], PAID, ("a",), ("a",)),
    ("the requester's own tier's model is protected from it once idle: nothing to drain",
     [m("a", served_at={PAID: 1}, running_nonbatch=1), m("p", pinned=True)], PAID, ("a",), ()),
    ("a subscriber's model: free may not drain it, subscriber's protection holds",
     [m("a", served_at={SUB: 1}, running_nonbatch=1), m("p", pinned=True)], FREE, ("a",), ()),
    ("a protection long over: a subscriber drains a model paid used a while ago, now busy for free",
     [m("a", served_at={PAID: 100, FREE: 1}, running_nonbatch=1), m("p", pinned=True)], SUB, ("a",), ("a",)),
    ("free's own recent use protects a busy model from another free request: nothing to drain",
     [m("a", served_at={FREE: 1}, running_nonbatch=1), m("p", pinned=True)], FREE, ("a",), ()),
    ("two busy 2 GiB models, 4 GiB needed beside 2 free: only the least valuable one is drained",
     [m("a", gib=2, served_at={FREE: 5}, running_nonbatch=1), m("b", gib=2, served_at={SUB: 90}, running_nonbatch=1),
      m("p", pinned=True)], PAID, ("a", "b"), ("a",)),
    ("a model loading for a lower tier counts as what it will be once loaded: never served, drained first",
     [m("a", place="loading", gib=2), m("b", gib=4, served_at={FREE: 1}, running_nonbatch=1),
      m("p", gib=2, pinned=True)],
     PAID, ("a", "b"), ("a",)),
    ("a loading model protected from the requester counts for nothing; the busy one is drained",
     [m("a", place="loading", gib=2, served_at={PAID: 1}), m("b", gib=4, served_at={FREE: 1}, running_nonbatch=1),
      m("p", gib=2, pinned=True)],
     PAID, ("a", "b"), ("b",)),
    ("an idle model it may evict is counted on too: a lower tier must not make it busy",
     [m("a", gib=1, served_at={FREE: 5}), m("b", gib=4, served_at={FREE: 1}, running_nonbatch=1),
      m("p", gib=5, pinned=True)],
     PAID, ("b",), ("a", "b")),
    ("what is drainable cannot free enough alone: a paid protection must end too, nothing drained",
     [m("a", gib=2, served_at={FREE: 1}, running_nonbatch=1), m("b", gib=4, served_at={PAID: 1}, running_nonbatch=1),
      m("p", pinned=True)], SUB, ("a", "b"), ()),
]


@pytest.mark.parametrize("case, models, tier, waiting_on, drain", DRAINS, ids=[row[0] for row in DRAINS])
def test_a_waiting_request_drains_what_it_counts_on(case, models, tier, waiting_on, drain):
    """A request waiting for busy models names what it counts on: the idle models it may evict and
    the busy ones whose work must end for it to fit and that it may evict then; the owner starts no
    lower-tier work on them meanwhile (a lower tier that kept one busy starved a paid request past
    its target: hunt 4 U2)."""
    d = plan(view(*models, m("c", place="cold")), "c", tier)
    assert isinstance(d, Impossible)
    assert (d.waiting_on, d.drain) == (waiting_on, drain)


def test_batch_only_work_is_paused_then_evicted():
    a = m("a", running_batch=2, served_at={BATCH: 1})
    v = view(a, m("b", served_at={PAID: 1}), m("c", place="cold"))
    # the host cache (0 here) is full, but a model holding paused batch work still goes warm:
    # the work resumes from where it stopped once the model is back
    assert plan(v, "c", FREE) == Evict(("a",), pause_batch_on=("a",), to_warm=("a",))


def test_batch_requester_does_not_pause_other_batch_work():
    a = m("a", running_batch=1, served_at={BATCH: 100})
    v = view(a, m("b", pinned=True), m("c", place="cold"))
    d = plan(v, "c", BATCH)
    assert isinstance(d, Impossible) and d.waiting_on == ("a",)
    assert blocker(v, a, BATCH, BATCH) == "busy"
    assert blocker(v, a, FREE, BATCH) is None


def test_pinned_is_never_evicted():
    v = view(m("a", pinned=True), m("b", served_at={FREE: 100}), m("c", place="cold"))
    assert plan(v, "c", PAID).victims == ("b",)
    stuck = view(m("a", pinned=True), m("b", pinned=True), m("c", place="cold"))
    assert plan(stuck, "c", PAID) == Impossible(plan(stuck, "c", PAID).reason, waiting_on=())
    assert pick_oom_victim(stuck, (), PAID, BATCH) is None


def test_protection_that_would_not_free_enough_is_not_a_refusal():
    """The only way in is past busy work: wait for it, whatever protections end meanwhile."""
    v = view(m("a", served_at={PAID: 5}, gib=2), m("b", running_nonbatch=1, gib=6),
             m("c", place="cold", gib=5))  # fmt: skip
    d = plan(v, "c", FREE)
    assert isinstance(d, Impossible) and d.waiting_on == ("b",)


def test_protected_and_pinned_never_enough_is_impossible():
    v = view(m("a", served_at={PAID: 5}, gib=2), m("b", pinned=True, gib=6),
             m("c", place="cold", gib=5))  # fmt: skip
    d = plan(v, "c", FREE)
    assert isinstance(d, Impossible) and d.waiting_on == ()


# --- the value order: each rule decides one case -------------------------------------------


@pytest.mark.parametrize(
    "a, b, victim",
    [
        # lowest last tier first, even if more recently used
        ({"served_at": {FREE: 100}}, {"served_at": {PAID: 500}}, "a"),
        # never served is the lowest tier of all
        ({}, {"served_at": {BATCH: 500}}, "a"),
        # the tier last served decides, not the highest tier ever served
        ({"served_at": {PAID: 500, BATCH: 400}}, {"served_at": {SUB: 500}}, "a"),
        # same tier: least recently used first
        ({"served_at": {SUB: 100}}, {"served_at": {SUB: 500}}, "b"),
        # same tier and time: largest first
        ({"served_at": {SUB: 100}}, {"served_at": {SUB: 100}, "gib": 5}, "b"),
    ],
)
def test_least_valuable_is_evicted(a, b, victim):
    v = view(m("a", **a), m("b", **b), m("c", place="cold", gib=1), budget=8)
    assert plan(v, "c", PAID).victims == (victim,)


def test_value_key_orders_tier_then_lru_then_size():
    models = [
        m("paid_old", served_at={PAID: 900}),
        m("free_new", served_at={FREE: 1}),
        m("never"),
        m("free_old_small", served_at={FREE: 800}, gib=1),
        m("free_old_big", served_at={FREE: 800}, gib=6),
    ]
    order = [x.name for x in sorted(models, key=value_key)]
    assert order == ["never", "free_old_big", "free_old_small", "free_new", "paid_old"]


# --- by memory, not by count ---------------------------------------------------------------


@pytest.mark.parametrize(
    "budget, victims",
    [
        (9, ("a", "b", "c")),  # free 0, need 4: a + b + c = 4, each needed
        (10, ("a", "c")),  # free 1, need 3 more: a, b, c (4) is one too many; b goes back
        (11, ("a", "b")),  # free 2, need 2 more: a + b; c alone would do but is worth more
    ],
)
def test_victims_until_the_freed_bytes_fit(budget, victims):
    v = view(m("a", gib=1, served_at={BATCH: 10}), m("b", gib=1, served_at={FREE: 10}),
             m("c", gib=2, served_at={SUB: 10}), m("d", gib=5, served_at={PAID: 10}),
             m("new", gib=4, place="cold"), budget=budget)  # fmt: skip
    assert plan(v, "new", PAID).victims == victims


def test_unnecessary_victims_are_dropped():
    """The 1 GiB batch model is least valuable but the 4 GiB free one alone makes room."""
    v = view(m("a", gib=1, served_at={BATCH: 10}), m("b", gib=4, served_at={FREE: 10}),
             m("c", gib=4, served_at={PAID: 10}), m("new", gib=4, place="cold"))  # fmt: skip
    assert plan(v, "new", PAID).victims == ("b",)


def test_smallest_victim_set_keeps_value_order():
    v = view(m("a", gib=2, served_at={BATCH: 10}), m("b", gib=2, served_at={FREE: 10}),
             m("c", gib=3, served_at={SUB: 10}), m("d", gib=3, served_at={PAID: 10}),
             m("new", gib=4, place="cold"))  # fmt: skip
    # free 0, need 4: greedy a, b (4): fits, nothing to drop
    assert plan(v, "new", PAID).victims == ("a", "b")


# --- the host cache ------------------------------------------------------------------------


def test_evicted_model_goes_warm_when_there_is_room():
    v = view(m("a", served_at={FREE: 100}), m("b", served_at={PAID: 1}), m("c", place="cold"),
             host=4)  # fmt: skip
    assert plan(v, "c", PAID) == Evict(("a",), to_warm=("a",))


def test_full_host_cache_drops_the_least_valuable_warm_models():
    v = view(m("a", served_at={SUB: 100}), m("b", served_at={PAID: 1}), m("c", place="cold"),
             m("w_batch", place="warm", gib=2, served_at={BATCH: 50}),
             m("w_free", place="warm", gib=2, served_at={FREE: 50}),
             m("w_paid", place="warm", gib=2, served_at={PAID: 50}),
             host=7)  # fmt: skip
    # 1 GiB free in the cache; a needs 4: drop w_batch (3), w_free (5)
    assert plan(v, "c", PAID) == Evict(("a",), to_warm=("a",), drop_warm=("w_batch", "w_free"))


def test_full_host_cache_sends_the_evicted_model_cold_when_the_warm_are_worth_more():
    v = view(m("a", served_at={FREE: 100}), m("b", served_at={PAID: 1}), m("c", place="cold"),
             m("w_sub", place="warm", served_at={SUB: 500}), host=6)  # fmt: skip
    assert plan(v, "c", PAID) == Evict(("a",), to_cold=("a",))


def test_model_bigger_than_the_host_cache_goes_cold():
    v = view(m("a", gib=5, served_at={FREE: 100}), m("c", place="cold", gib=6), host=4)
    assert plan(v, "c", PAID) == Evict(("a",), to_cold=("a",))


def test_the_model_being_loaded_from_the_cache_leaves_its_room_to_its_victim():
    """Its host copy leaves the cache in the same load: a swap of two models through a cache that
    holds one keeps both a copy away (the victim went cold every time: hunt 4 U4); it is never
    dropped to cold to make that room, and other warm models stay."""
    v = view(m("a", served_at={SUB: 100}), m("b", served_at={PAID: 1}),
             m("c", place="warm", served_at={BATCH: 900}), host=4)  # fmt: skip
    assert plan(v, "c", PAID) == Evict(("a",), to_warm=("a",))
    fuller = view(m("a", served_at={SUB: 100}), m("b", served_at={PAID: 1}),
                  m("c", place="warm", served_at={BATCH: 900}), m("w", place="warm", gib=2, served_at={BATCH: 950}),
                  host=6)  # fmt: skip
    assert plan(fuller, "c", PAID) == Evict(("a",), to_warm=("a",))


def test_host_cache_plan_most_valuable_victim_gets_the_room():
    v = view(m("a", served_at={FREE: 100}), m("b", served_at={SUB: 100}), host=4)
    plan_ = host_cache_plan(v, ["a", "b"])
    assert (plan_.to_warm, plan_.to_cold, plan_.drop_warm) == (("b",), ("a",), ())


def test_host_bytes_may_differ_from_the_footprint():
    a = ModelState("a", "chat", 4 * GiB, "resident", {FREE: 900.0}, host_bytes=3 * GiB)
    v = view(a, m("b", served_at={PAID: 1}), m("c", place="cold"), host=3)
    assert plan(v, "c", PAID) == Evict(("a",), to_warm=("a",))


# --- out of memory -------------------------------------------------------------------------


def test_oom_victim_is_the_least_valuable_evictable():
    v = view(m("a", served_at={FREE: 100}), m("b", served_at={BATCH: 100}, running_batch=1),
             m("c", served_at={PAID: 100}, gib=1), m("d", running_nonbatch=1, gib=1))  # fmt: skip
    expected = Evict(("b",), pause_batch_on=("b",), to_warm=("b",))
    assert pick_oom_victim(v, (), PAID, BATCH) == expected
    assert pick_oom_victim(v, ("b",), PAID, BATCH).victims == ("a",)
    assert pick_oom_victim(v, ("a", "b"), PAID, BATCH).victims == ("c",)
    assert pick_oom_victim(v, ("a", "b", "c"), PAID, BATCH) is None


def test_oom_victim_respects_protection():
    v = view(m("a", served_at={FREE: 5}), m("b", served_at={PAID: 5}))
    assert pick_oom_victim(v, (), BATCH, BATCH) is None
    assert pick_oom_victim(v, (), SUB, BATCH).victims == ("a",)


# --- batch yields --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "models, queued, others_busy, paused",
    [
        ([m("a", running_batch=1)], {}, False, set()),  # only batch: it runs
        ([m("a", running_batch=1)], {BATCH: 5}, False, set()),  # more batch queued: still runs
        ([m("a", running_batch=1), m("b", running_nonbatch=1)], {}, False, {"a"}),  # other work runs
        ([m("a", running_batch=1, running_nonbatch=1)], {}, False, {"a"}),  # even on the same model
        ([m("a", running_batch=1), m("b", running_batch=2)], {FREE: 1}, False, {"a", "b"}),  # queued
        ([m("a", running_batch=1)], {PAID: 0}, False, set()),  # an empty queue entry is no work
        ([m("a"), m("b", running_nonbatch=1)], {SUB: 3}, False, set()),  # nothing to pause
        # the gate holds other tiers' work the arbiter has not seen yet (admitted or queued there)
        ([m("a", running_batch=1)], {}, True, {"a"}),
        ([m("a", running_batch=1), m("b", running_batch=1, place="warm")], {BATCH: 2}, True, {"a", "b"}),
        ([m("a"), m("b")], {}, True, set()),  # busy, but no batch work to pause
        ([m("a", running_batch=1), m("b", running_nonbatch=1)], {}, True, {"a"}),  # both say pause
    ],
)
def test_batch_must_yield(models, queued, others_busy, paused):
    assert batch_must_yield(view(*models, queued=queued), BATCH, others_busy) == paused


# --- failed loads --------------------------------------------------------------------------


def test_next_cooldown_doubles_up_to_the_cap():
    seq, prev = [], None
    for _ in range(8):
        prev = next_cooldown(prev)
        seq.append(prev)
    assert seq == [2, 4, 8, 16, 32, 60, 60, 60]
    assert next_cooldown(None, base=0.5, cap=1.5) == 0.5
    assert next_cooldown(1.0, base=0.5, cap=1.5) == 1.5


def test_load_cooldown_record():
    c = after_load_failure(None, now=100.0)
    assert c == LoadCooldown(seconds=2.0, until=102.0, failures=1)
    assert c.active(101.9) and not c.active(102.0)
    assert c.retry_after(100.5) == 2
    c2 = after_load_failure(c, now=103.0)
    assert c2 == LoadCooldown(seconds=4.0, until=107.0, failures=2)


# --- invariants over many random states ----------------------------------------------------


def random_view(rng: random.Random) -> ArbiterView:
    models = []
    for i in range(rng.randint(1, 7)):
        served_at = {t: rng.uniform(0, 200) for t in range(4) if rng.random() < 0.4}
        models.append(
            m(
                f"m{i}",
                gib=rng.choice([0.5, 1, 2, 3, 4, 6]),
                place=rng.choice(["resident", "resident", "warm", "cold", "loading"]),
                served_at=served_at,
                running_nonbatch=int(rng.random() < 0.15),
                running_batch=int(rng.random() < 0.2),
                pinned=rng.random() < 0.1,
            )
        )
    return view(*models, budget=12, host=rng.choice([0, 4, 8]), window=rng.choice([30, 60, 300]))


def test_decisions_hold_their_invariants():
    rng = random.Random(1234)
    seen = set()
    for _ in range(4000):
        v = random_view(rng)
        if v.used > v.budget or v.host_used > v.host_cache_budget:
            continue
        target = rng.choice([x for x in v.models.values() if x.place in ("warm", "cold")] or [None])
        if target is None:
            continue
        tier = rng.randint(0, BATCH)
        d = plan(v, target.name, tier)
        seen.add(type(d).__name__)
        need = target.footprint - v.free
        if isinstance(d, Fit):
            assert need <= 0
        elif isinstance(d, Evict):
            victims = [v.models[n] for n in d.victims]
            assert all(x.place == "resident" for x in victims)
            assert all(blocker(v, x, tier, BATCH) is None for x in victims)
            freed = sum(x.footprint for x in victims)
            assert freed >= need  # never start a load that does not fit
            assert all(freed - x.footprint < need for x in victims)  # no unnecessary victim
            assert d.pause_batch_on == tuple(x.name for x in victims if x.running_batch)
            assert sorted(d.to_warm + d.to_cold) == sorted(d.victims)
            assert target.name not in d.drop_warm
            host = v.host_used - sum(v.models[n].warm_bytes for n in d.drop_warm)
            if target.place == "warm":  # its copy leaves the cache in the same load
                host -= target.warm_bytes
            # only models holding paused batch work may go past the host cache budget
            free_to_warm = [n for n in d.to_warm if not v.models[n].running_batch]
            assert host + sum(v.models[n].warm_bytes for n in free_to_warm) <= v.host_cache_budget
            assert all(not v.models[n].running_batch for n in d.to_cold)
        else:
            # with every protection over: a refusal becomes an eviction, the impossible stays so
            unprotected = {n: replace(x, served_at={}) for n, x in v.models.items()}
            after = plan(replace(v, models=unprotected), target.name, tier)
            if isinstance(d, Refuse):
                assert 1 <= d.retry_after <= MAX_RETRY_AFTER_S
                assert isinstance(after, Evict)
            else:
                assert isinstance(after, Impossible)
                assert all(blocker(v, v.models[n], tier, BATCH) == "busy" for n in d.waiting_on)
    assert seen == {"Fit", "Evict", "Refuse", "Impossible"}
