"""Batch work fills an idle engine and still yields whole (issue 17): the runner keeps as many
lines in flight as the engine is wide, grouped by shape (model + adapter stack), a paid arrival
pauses every batch row at once and batch grows back after it, and a wide batch survives kill -9.
What the engine did is read from its own step records (``ChatWorker.step_log``: the tier rank of
each row of each decode step)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from pathlib import Path

import openai
import pytest

from gateway.admission import Gate, TierPolicy
from tests.helpers import TIERS, start_server
from tests.test_batch_store import redis_server
from tests.test_batches import (
    Proc,
    _no_stray_processes,  # noqa: F401 - the fixture kills strays
    chat_line,
    check_exactly_once,
    jsonl,
    submit,
    wait,
)

PAID, BATCH = TIERS.index("paid"), TIERS.index("batch")


def fill_config(folder: Path, models: dict[str, Path], width: int, extra: str = "") -> Path:
    """Every tier but batch with max_inflight 4; the batch tier with none set (the engines' widths)."""
    lines = ["tiers:"]
    for t in TIERS:
        lines += [f"  - name: {t}", f"    keys_env: TEST_KEYS_{t.upper()}", "    max_queued: 1000",
                  "    latency_target_s: 600"]
        lines += ["    batch: true"] if t == "batch" else ["    max_inflight: 4"]
    lines.append("models:")
    for name, path in models.items():
        lines += [f"  - name: {name}", "    kind: chat", f"    path: {path}",
                  "    engine: {name: transformers, max_num_seqs: %d}" % width]
    lines += ["gpu:", "  device: cpu", "  vram_budget: 4GiB", "limits:", "  max_chat_tokens: 128"]
    path = folder / "tiers.yaml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def sdk(server, who: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[who], max_retries=0)


def until(check, timeout: float = 60, what: str = "") -> None:
    deadline = time.time() + timeout
    while not check():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_the_gate_lets_batch_fill_past_the_slots_of_the_other_tiers():
    async def go():
        tiers = [TierPolicy("paid", 0, 2, 8, 60.0), TierPolicy("batch", 1, 12, 100, 3600.0, is_batch=True)]
        gate = Gate(tiers, slots=2)
        held = [await asyncio.wait_for(gate.acquire("batch", "m"), 1) for _ in range(12)]  # slots=2 is no limit
        more = asyncio.create_task(gate.acquire("batch", "m"))  # the batch tier's own limit is
        await asyncio.sleep(0.01)
        assert not more.done() and gate.inflight["batch"] == 12
        paid = await asyncio.wait_for(gate.acquire("paid", "m"), 1)  # batch never keeps paid out
        gate.release(held.pop())
        await asyncio.sleep(0.01)
        assert not more.done()  # ... and waits while paid runs
        gate.release(paid)
        await asyncio.wait_for(more, 1)

    asyncio.run(go())


def test_batch_fills_the_engine_when_idle_pauses_whole_for_paid_and_grows_back(tiny_chat, tmp_path):
    width = 6
    srv = start_server(fill_config(tmp_path, {"tiny-chat": tiny_chat}, width))
    try:
        paid = sdk(srv, "paid")
        paid.chat.completions.create(model="tiny-chat", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
        worker = srv.services.arbiter.workers["tiny-chat"]
        batch = submit(sdk(srv, "free"), jsonl([chat_line(i, max_tokens=60, temperature=0) for i in range(40)]))

        def full_batch_steps(since: int) -> int:
            return sum(1 for ranks in list(worker.step_log)[since:] if ranks.count(BATCH) == width)

        until(lambda: full_batch_steps(0) >= 3, what="batch to fill the engine")
        assert max(len(r) for r in list(worker.step_log)) == width  # never wider than the engine

        # the steps logged when the paid request reaches the gate (the pause order): a step in flight then is
        # logged after it, so at most one batch step may come between that mark and the paid row's first
        gate, at_order = srv.services.gate, []
        told = gate.on_change

        def on_change() -> None:
            told()
            if gate.others_busy() and not at_order:
                at_order.append(len(worker.step_log))

        gate.on_change = on_change
        before = len(worker.step_log)
        stream = paid.chat.completions.create(model="tiny-chat", max_tokens=24, temperature=0, stream=True,
                                              messages=[{"role": "user", "content": "paid goes first"}])
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        after = len(worker.step_log)
        steps = list(worker.step_log)[before:after]
        with_paid = [ranks for ranks in steps if PAID in ranks]
        assert len(with_paid) >= 20, steps  # the paid row decoded (24 tokens: the first from its prefill)
        assert all(ranks == (PAID,) for ranks in with_paid), [r for r in with_paid if r != (PAID,)]
        first = steps.index(with_paid[0])
        assert at_order and before <= at_order[0] <= before + first, (before, at_order)
        assert first - (at_order[0] - before) <= 1, steps[: first + 1]  # at most one batch step after the order
        assert text

        until(lambda: full_batch_steps(after) >= 3, what="batch to grow back to the engine's width")
        done = wait(sdk(srv, "free"), batch.id, timeout=180)
        assert done.status == "completed" and done.request_counts.completed == 40
    finally:
        srv.stop()


def test_lines_over_two_models_and_two_stacks_run_grouped_by_shape(tiny_chat, demo_dir, tmp_path):
    from demo import build_demo_models

    adapters = build_demo_models(demo_dir, names=["tiny-chat-pirate", "tiny-chat-poet"])
    extra = "adapters:\n" + "".join(f"  - {{name: {n}, model: tiny-chat, path: {adapters[n]}}}\n"
                                    for n in ("tiny-chat-pirate", "tiny-chat-poet"))
    srv = start_server(fill_config(tmp_path, {"tiny-chat": tiny_chat, "tiny-chat-b": tiny_chat}, 4, extra))
    try:
        # interleaved: pirate, poet, the second model, ... as a careless script would write them
        models = ["tiny-chat-pirate", "tiny-chat-poet", "tiny-chat-b"]
        rows = [chat_line(i, model=models[i % 3], max_tokens=4) for i in range(36)]
        c = sdk(srv, "free")
        done = wait(c, submit(c, jsonl(rows)).id, timeout=180)
        assert done.status == "completed" and done.request_counts.completed == 36, done
        chat = srv.services.arbiter.workers["tiny-chat"]
        other = srv.services.arbiter.workers["tiny-chat-b"]
        assert chat.stack_merges == 2 < 24  # one merge per stack, not one per line (24 lines on tiny-chat)
        assert other.stack_merges == 0 and len(other.step_log) > 0
        assert max(len(r) for r in chat.step_log) == 4  # each stack's lines filled the engine together
    finally:
        srv.stop()


def in_flight_at_kill(store: str, folder: Path) -> int:
    """Backlog entries claimed (by the killed process) and not recorded."""
    if store == "sqlite":
        with contextlib.closing(sqlite3.connect(folder / "tiergate-data" / "batches.sqlite3")) as db:
            return db.execute("SELECT COUNT(*) FROM backlog WHERE claimed_by IS NOT NULL").fetchone()[0]
    import redis

    client = redis.Redis.from_url(store)
    try:
        return sum(client.xpending(key, "runners")["pending"] for key in client.scan_iter("tg:backlog:*"))
    finally:
        client.close()


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_kill_9_in_a_wide_batch_loses_nothing_and_records_nothing_twice(store, tiny_chat, tmp_path):
    """The Batch API's crash test, on each store: a tiergate process is killed with ``kill -9``
    mid-batch while it holds claimed lines it has not recorded; its restart reclaims them, and the
    batch ends with exactly one outcome per line, the restart having run only what the first had
    not recorded."""
    width, n = 16, 96  # six waves: the kill comes in the third
    with contextlib.ExitStack() as stack:
        if store == "redis":
            store = stack.enter_context(redis_server(tmp_path))
        config = fill_config(tmp_path, {"tiny-chat": tiny_chat}, width,
                             f"batch:\n  store: {store}\n  reclaim_after_s: 2\n")
        keys = {t: f"key-{t}" for t in TIERS}
        first = Proc(config, keys, tmp_path / "first.log").ready()
        c = first.client(keys["free"])
        b = submit(c, jsonl([chat_line(i, max_tokens=24) for i in range(n)]))
        where = "sqlite" if not store.startswith("redis") else store
        wait(c, b.id, until=lambda x: x.request_counts.completed >= 20, timeout=120)
        # kill it while it is wide: more lines in flight than the old cap of 4 (lines of one wave end
        # in the same step, so between a wave and the next fewer may be claimed for a moment)
        until(lambda: in_flight_at_kill(where, tmp_path) > 4, 60, "a wide batch in flight")
        first.kill9()
        lost = in_flight_at_kill(where, tmp_path)
        assert lost > 0, lost  # it died with lines claimed and not recorded: the restart must reclaim them
        second = Proc(config, keys, tmp_path / "second.log").ready()
        check_exactly_once(second.client(keys["free"]), b.id, n)
        recorded = second.stop()
        assert 0 < recorded <= n - 20  # the restart ran only what the first had not recorded


def test_paused_rows_resume_in_chunks_once_per_pause_and_a_paid_arrival_waits_one_step():
    """The pure scheduler, step by step: 12 batch rows paused with their tokens resume
    ``resume_chunk`` per step; a paid row arriving mid-resume is admitted at the next step, the
    resumed rows pause again and the rest never get prefilled meanwhile; each row is prefilled
    once per pause."""
    from workers.chat_schedule import EngineView, Row, plan_step

    batch_rows = [Row(i, priority=BATCH, resumes=True) for i in range(12)]
    prefills = {r.arrival: 0 for r in batch_rows}
    running: list[Row] = []
    waiting = list(batch_rows)

    def step(paused: bool, arrivals: tuple[Row, ...] = ()) -> tuple[int, ...]:
        nonlocal running, waiting
        flag = lambda r: Row(r.arrival, r.priority, r.stack, paused and r.priority == BATCH, False, r.resumes)  # noqa: E731
        waiting += arrivals
        plan = plan_step(EngineView((), tuple(map(flag, running)), tuple(map(flag, waiting)), max_num_seqs=16,
                                    resume_chunk=4))
        out = [r for r in running if r.arrival in plan.pause]
        running = [r for r in running if r.arrival not in plan.pause]
        admitted = [r for r in waiting if r.arrival in plan.admit]
        for r in admitted:
            prefills[r.arrival] = prefills.get(r.arrival, 0) + 1
        waiting = [r for r in waiting if r.arrival not in plan.admit] + out
        running += admitted
        return plan.admit

    assert len(step(paused=False)) == 4  # the pause lifted: the first chunk
    assert len(step(paused=False)) == 4
    paid = Row(100, priority=PAID)
    assert step(paused=True, arrivals=(paid,)) == (100,)  # paid arrives: admitted at once
    assert [r.arrival for r in running] == [100]  # every batch row left the batch for it
    assert all(n <= 1 for n in prefills.values()) and sum(prefills.values()) == 8 + 1
    running = []  # paid finished
    for _ in range(3):
        step(paused=False)
    assert sorted(r.arrival for r in running) == list(range(12)) and not waiting
    assert {n for a, n in prefills.items() if a < 12} == {1, 2}  # the 8 paused twice were prefilled twice
