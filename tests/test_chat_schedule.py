"""The transformers chat engine's scheduler as a pure function (workers/chat_schedule.py): a
table of cases, then invariants over random snapshots.

Unless a case says otherwise: max_num_seqs = 3, the base model merged, tiers paid=0 > free=2 >
batch=3. Rows are named by their arrival number."""

from __future__ import annotations

import random

import pytest

from workers.chat_schedule import EngineView, Prefill, Row, StepPlan, plan_step, prefill_passes

PAID, FREE, BATCH = 0, 2, 3
BASE: tuple = ()
A = (("pirate", 1.0),)
B = (("poet", 1.0),)


def r(arrival, priority=FREE, stack=BASE, **flags) -> Row:
    return Row(arrival, priority, stack, **flags)


def v(running=(), waiting=(), stack=BASE, max_num_seqs=3) -> EngineView:
    return EngineView(stack, tuple(running), tuple(waiting), max_num_seqs)


CASES = {
    "nothing to do": (v(), StepPlan()),
    "running rows alone keep running": (v([r(0), r(1)]), StepPlan()),
    # admission up to max_num_seqs
    "an empty batch admits up to max_num_seqs": (
        v(waiting=[r(0), r(1), r(2), r(3), r(4)]), StepPlan(admit=(0, 1, 2))),
    "a running batch admits only into free places": (
        v([r(0), r(1)], [r(2), r(3)]), StepPlan(admit=(2,))),
    "a full batch admits nobody": (v([r(0), r(1), r(2)], [r(3, PAID)]), StepPlan()),
    # best waiting row by priority, then arrival
    "priority first, then arrival": (
        v(waiting=[r(0, BATCH), r(1, FREE), r(2, PAID), r(3, PAID)]), StepPlan(admit=(2, 3, 1))),
    "the best rows get the last places": (
        v([r(0), r(1)], [r(2, BATCH), r(3, PAID), r(4, FREE)]), StepPlan(admit=(3,))),
    # one stack per batch; same-stack rows share one merge
    "an empty batch switches to the best row's stack and admits all who want it": (
        v(waiting=[r(0, stack=A), r(1, stack=B), r(2, stack=A)]), StepPlan(switch_to=A, admit=(0, 2))),
    "the base model is switched back to like any stack": (
        v(waiting=[r(0), r(1, stack=A)], stack=A), StepPlan(switch_to=BASE, admit=(0,))),
    "no switch when the best row wants the merged stack": (
        v(waiting=[r(0, stack=A), r(1)], stack=A), StepPlan(admit=(0,))),
    "the stack that stays merged costs no merge": (
        v(waiting=[r(0, stack=A), r(1, stack=A)], stack=A), StepPlan(admit=(0, 1))),
    # switching stacks only when the running batch drains
    "a running batch never switches, even for paid": (
        v([r(0, stack=A)], [r(1, PAID, stack=B)], stack=A), StepPlan()),
    "a running batch admits its stack's rows ranked ahead of other stacks": (
        v([r(0, stack=A)], [r(1, stack=A), r(2, stack=B)], stack=A), StepPlan(admit=(1,))),
    "a higher tier of the running stack overtakes a waiting other stack": (
        v([r(0, stack=A)], [r(1, FREE, stack=B), r(2, PAID, stack=A)], stack=A), StepPlan(admit=(2,))),
    # no starvation of other stacks
    "later same-stack arrivals do not overtake a waiting other stack": (
        v([r(0, stack=A)], [r(1, stack=B), r(2, stack=A), r(3, stack=A)], stack=A), StepPlan()),
    "a batch-tier row of another stack holds back only rows ranked after it": (
        v([r(0, stack=A)], [r(1, BATCH, stack=B), r(2, FREE, stack=A), r(3, BATCH, stack=A)], stack=A),
        StepPlan(admit=(2,))),
    "once drained, the oldest other stack gets its turn": (
        v(waiting=[r(1, stack=B), r(2, stack=A), r(3, stack=A)], stack=A), StepPlan(switch_to=B, admit=(1,))),
    # paused rows leave and rejoin
    "a paused running row leaves, keeping its place for a ready row": (
        v([r(0, BATCH, paused=True), r(1), r(2)], [r(3, PAID)]), StepPlan(pause=(0,), admit=(3,))),
    "a paused waiting row is not admitted": (
        v(waiting=[r(0, BATCH, paused=True), r(1)]), StepPlan(admit=(1,))),
    "a row whose pause lifted rejoins by rank": (
        v([r(5)], [r(0, BATCH), r(6, FREE)]), StepPlan(admit=(6, 0))),
    "a batch drained by pauses may switch stacks in the same plan": (
        v([r(0, BATCH, stack=A, paused=True)], [r(1, PAID, stack=B)], stack=A),
        StepPlan(pause=(0,), switch_to=B, admit=(1,))),
    "a paused row's stack neither drives a switch nor holds others back": (
        v([r(0, stack=A)], [r(1, PAID, stack=B, paused=True), r(2, stack=A)], stack=A), StepPlan(admit=(2,))),
    "every row paused: nothing is admitted, nothing switched": (
        v([r(0, BATCH, paused=True)], [r(1, BATCH, stack=A, paused=True)]), StepPlan(pause=(0,))),
    # cancelled rows
    "cancelled waiting rows are forgotten, and not admitted": (
        v(waiting=[r(0, cancelled=True), r(1, stack=A, cancelled=True), r(2)]), StepPlan(forget=(0, 1), admit=(2,))),
    "a cancelled running row is left to the decode step, not paused": (
        v([r(0, paused=True, cancelled=True)]), StepPlan()),
}


@pytest.mark.parametrize("view, plan", CASES.values(), ids=list(CASES))
def test_plan(view: EngineView, plan: StepPlan):
    assert plan_step(view) == plan


def random_view(rng: random.Random) -> EngineView:
    stacks = [BASE, A, B]
    arrivals = iter(rng.sample(range(100), 12))
    merged = rng.choice(stacks)
    n_max = rng.randint(1, 5)
    running = [Row(next(arrivals), rng.choice([PAID, FREE, BATCH]), merged,
                   paused=rng.random() < 0.3, cancelled=rng.random() < 0.1) for _ in range(rng.randint(0, n_max))]
    waiting = [Row(next(arrivals), rng.choice([PAID, FREE, BATCH]), rng.choice(stacks),
                   paused=rng.random() < 0.3, cancelled=rng.random() < 0.1) for _ in range(rng.randint(0, 6))]
    return EngineView(merged, tuple(running), tuple(waiting), n_max)


@pytest.mark.parametrize("seed", range(300))
def test_invariants_over_random_snapshots(seed):
    view = random_view(random.Random(seed))
    plan = plan_step(view)
    waiting = {row.arrival: row for row in view.waiting}
    staying = [row for row in view.running if row.arrival not in plan.pause]
    ready = [row for row in view.waiting if not row.paused and not row.cancelled]
    stack = view.stack if plan.switch_to is None else plan.switch_to
    assert set(plan.forget) == {row.arrival for row in view.waiting if row.cancelled}
    assert set(plan.pause) == {row.arrival for row in view.running if row.paused and not row.cancelled}
    assert len(staying) + len(plan.admit) <= view.max_num_seqs
    assert all(waiting[a] in ready and waiting[a].stack == stack for a in plan.admit)
    assert [waiting[a].rank for a in plan.admit] == sorted(waiting[a].rank for a in plan.admit)
    if plan.switch_to is not None:  # only a drained batch switches, to the best ready row's stack
        assert not staying and plan.switch_to != view.stack
        assert plan.switch_to == min(ready, key=lambda row: row.rank).stack
    if ready and len(staying) < view.max_num_seqs and (not staying or min(ready, key=lambda x: x.rank).stack == stack):
        assert plan.admit  # work conserving: a free place and an eligible best row means admission
    if staying:  # nobody overtakes a ready row of another stack while a batch runs
        others = [row.rank for row in ready if row.stack != stack]
        assert all(waiting[a].rank < min(others) for a in plan.admit) if others else True


# -- prefills together (prefill_passes): rows named by arrival, (arrival, prompt length, plain)
def p(arrival, length, plain=True) -> Prefill:
    return Prefill(arrival, length, plain)


PREFILLS = {
    "nothing admitted, no pass": ([], 64, []),
    "a lone row is a pass of its own": ([p(0, 10)], 64, [(0,)]),
    "plain rows of like lengths share one pass": ([p(0, 10), p(1, 12), p(2, 9)], 64, [(0, 1, 2)]),
    "a row that is not plain is alone and splits the run": (
        [p(0, 10), p(1, 10), p(2, 10, plain=False), p(3, 10), p(4, 10)], 64, [(0, 1), (2,), (3, 4)]),
    "rows not plain are never together": ([p(0, 10, False), p(1, 10, False)], 64, [(0,), (1,)]),
    "the budget counts rows times the longest": ([p(0, 10), p(1, 10), p(2, 10), p(3, 10)], 30, [(0, 1, 2), (3,)]),
    "a row too long for the budget is alone": ([p(0, 10), p(1, 100), p(2, 10)], 64, [(0,), (1,), (2,)]),
    "a pass is at most half padding": ([p(0, 4), p(1, 4), p(2, 30)], 256, [(0, 1), (2,)]),
    "exactly half padding still shares": ([p(0, 5), p(1, 15)], 64, [(0, 1)]),
    "short rows join long ones while the pass stays half real": (
        [p(0, 30), p(1, 30), p(2, 2), p(3, 2), p(4, 2)], 256, [(0, 1, 2, 3), (4,)]),
}


@pytest.mark.parametrize("rows, budget, passes", PREFILLS.values(), ids=list(PREFILLS))
def test_prefill_passes(rows, budget, passes):
    assert prefill_passes(rows, budget) == passes


def test_prefill_passes_keep_the_order_and_every_row_once():
    rng = random.Random(7)
    for _ in range(500):
        rows = [p(i, rng.randint(1, 80), rng.random() < 0.8) for i in range(rng.randint(0, 12))]
        budget = rng.choice([16, 64, 256])
        passes = prefill_passes(rows, budget)
        assert [a for group in passes for a in group] == [r.arrival for r in rows]
        by = {r.arrival: r for r in rows}
        for group in passes:
            if len(group) > 1:
                lengths = [by[a].length for a in group]
                assert all(by[a].plain for a in group)
                assert max(lengths) * len(group) <= min(budget, 2 * sum(lengths))
