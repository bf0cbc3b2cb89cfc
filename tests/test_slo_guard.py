"""The SLO guard as a pure function over a table of windows and times (measurements age out; when
to decide again with no traffic), its place in the gate (limits grow back on the gate's timer
after a slow spell and silence), its wiring in the server (the config's settings; chat reports
time to first token, the others their whole time; lowered limits recover with no traffic), and
the gate's cost model fitted from running sums (equal to a plain least-squares fit)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from openai import OpenAI

from gateway.admission import CostModel, Gate, TierPolicy
from gateway.slo_guard import GuardSettings, TierWindow, next_decision_at, next_limits, quantile, tier_state

S = GuardSettings(trigger=0.8, recover=0.5, quantile=0.9, min_samples=3)  # window_s 10, interval_s 1
TARGET = 1.0
NOW = 50.0


def at(when: float, *seconds: float) -> tuple[tuple[float, float], ...]:
    """Latencies measured at ``when``."""
    return tuple((when, s) for s in seconds)


def table(paid=(), sub=(), free=(), batch=(), caps=(8, 8, 8, 8), when=NOW) -> list[TierWindow]:
    """The four tiers; plain latencies are measured at ``when``, (when, seconds) pairs as given."""
    names = ["paid", "subscriber", "free", "batch"]
    samples = [tuple(x if isinstance(x, tuple) else (when, x) for x in tier) for tier in (paid, sub, free, batch)]
    return [TierWindow(n, i, TARGET, caps[i], n == "batch", samples[i]) for i, n in enumerate(names)]


HOT, MID, COOL = (0.9, 0.95, 1.2), (0.6, 0.7, 0.65), (0.1, 0.2, 0.3)


@pytest.mark.parametrize(
    "case, windows, limits, expected",
    [
        ("all idle: everyone at the cap", table(), {}, {"paid": 8, "subscriber": 8, "free": 8, "batch": 8}),
        ("paid hot: every tier below halves, batch untouched", table(paid=HOT), {},
         {"paid": 8, "subscriber": 4, "free": 4, "batch": 8}),
        ("paid hot again: halves again", table(paid=HOT), {"subscriber": 4, "free": 4},
         {"paid": 8, "subscriber": 2, "free": 2, "batch": 8}),
        ("floor of one", table(paid=HOT), {"subscriber": 1, "free": 1},
         {"paid": 8, "subscriber": 1, "free": 1, "batch": 8}),
        ("paid between recover and trigger: hold", table(paid=MID), {"subscriber": 3, "free": 2},
         {"paid": 8, "subscriber": 3, "free": 2, "batch": 8}),
        ("paid calm: grow back by one", table(paid=COOL), {"subscriber": 3, "free": 2},
         {"paid": 8, "subscriber": 4, "free": 3, "batch": 8}),
        ("growth stops at the configured cap", table(paid=COOL), {"subscriber": 8, "free": 8},
         {"paid": 8, "subscriber": 8, "free": 8, "batch": 8}),
        ("subscriber hot: only free shrinks", table(paid=COOL, sub=HOT), {"subscriber": 5, "free": 8},
         {"paid": 8, "subscriber": 6, "free": 4, "batch": 8}),
        ("paid holding, subscriber calm: free holds too", table(paid=MID, sub=COOL), {"subscriber": 5, "free": 5},
         {"paid": 8, "subscriber": 5, "free": 5, "batch": 8}),
        ("too few samples are not judged", table(paid=(5.0, 5.0)), {"subscriber": 2, "free": 2},
         {"paid": 8, "subscriber": 3, "free": 3, "batch": 8}),
        ("the lowest tier's own latency changes nobody", table(free=HOT), {"free": 4},
         {"paid": 8, "subscriber": 8, "free": 5, "batch": 8}),
        ("a limit above a lowered cap comes down to the cap", table(caps=(8, 2, 2, 8)), {"subscriber": 6},
         {"paid": 8, "subscriber": 2, "free": 2, "batch": 8}),
    ],
)
def test_next_limits(case, windows, limits, expected):
    assert next_limits(windows, limits, S, NOW) == expected, case


LOW = {"subscriber": 2, "free": 2}  # lowered by an earlier decision


@pytest.mark.parametrize(
    "case, windows, now, expected",
    [
        ("hot, just measured: halve", table(paid=HOT), NOW, {"subscriber": 1, "free": 1}),
        ("hot, nearly window_s old: still counts", table(paid=HOT), NOW + 9.99, {"subscriber": 1, "free": 1}),
        ("hot, window_s old: aged out, paid idle: grow back", table(paid=HOT), NOW + 10.0,
         {"subscriber": 3, "free": 3}),
        ("long after a slow spell: idle, grow back", table(paid=HOT), NOW + 3600.0, {"subscriber": 3, "free": 3}),
        ("one of three aged out: too few to judge", table(paid=at(39.0, 0.9) + at(49.0, 0.95, 1.2)), NOW,
         {"subscriber": 3, "free": 3}),
        ("the slow one aged out, the middling ones hold", table(paid=at(44.0, 5.0) + at(49.0, *MID)), 54.0,
         {"subscriber": 2, "free": 2}),
        ("... and just before, all four judged: hot", table(paid=at(44.0, 5.0) + at(49.0, *MID)), 53.9,
         {"subscriber": 1, "free": 1}),
        ("subscriber's slowness aged out, paid's not: free holds", table(paid=at(48.0, *MID), sub=at(39.0, *HOT)),
         NOW, {"subscriber": 2, "free": 2}),
    ],
)
def test_next_limits_as_the_window_ages(case, windows, now, expected):
    limits = next_limits(windows, LOW, S, now)
    assert {t: limits[t] for t in expected} == expected, case


@pytest.mark.parametrize(
    "case, windows, limits, now, expected",
    [
        ("every tier at its limit: no timer", table(), {}, NOW, None),
        ("at its limit though paid is hot: no timer", table(paid=HOT), {"subscriber": 8, "free": 8}, NOW, None),
        ("the guard off: no timer", table(), LOW, NOW, "off"),
        ("lowered, paid idle: grows at the next decision", table(), LOW, NOW, NOW + 1.0),
        ("lowered, paid's slow samples aged out: the next decision", table(paid=HOT, when=NOW - 10.0), LOW, NOW,
         NOW + 1.0),
        ("lowered below hot paid: when its oldest sample ages out", table(paid=at(44.0, 5.0) + at(49.0, *HOT)),
         LOW, NOW, 54.0),
        ("... holding paid too", table(paid=at(47.5, *MID)), LOW, NOW, 57.5),
        ("... but not before the next decision", table(paid=at(40.5, 5.0) + at(49.0, *HOT)), LOW, NOW, NOW + 1.0),
        ("subscriber lowered with paid calm: the next decision", table(paid=COOL, sub=HOT), {"subscriber": 5},
         NOW, NOW + 1.0),
        ("only free lowered, below a hot subscriber", table(paid=COOL, sub=at(45.0, *HOT)), {"free": 4}, NOW, 55.0),
    ],
)
def test_next_decision_at(case, windows, limits, now, expected):
    if expected == "off":
        assert next_decision_at(windows, limits, GuardSettings(enabled=False), now) is None, case
    else:
        assert next_decision_at(windows, limits, S, now) == expected, case


def test_decisions_at_the_times_named_recover_after_a_slow_spell_and_silence():
    """Paid is slow, then nothing is measured: each decision at the time the last one named
    lowers the tiers below once, waits for paid's samples to age out, then grows them back one
    per interval to their configured limits, and names no further time."""
    windows = table(paid=at(NOW, *HOT), caps=(8, 8, 4, 8))
    limits, now, seen = {}, NOW, []
    while now is not None and len(seen) < 20:
        limits = next_limits(windows, limits, S, now)
        seen.append((now, limits["subscriber"], limits["free"]))
        now = next_decision_at(windows, limits, S, now)
    assert seen == [(50.0, 4, 2), (60.0, 5, 3), (61.0, 6, 4), (62.0, 7, 4), (63.0, 8, 4)]


def test_quantile_is_nearest_rank():
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([1.0] * 9 + [10.0], 0.9) == 1.0
    assert quantile([1.0] * 9 + [10.0], 0.95) == 10.0
    assert quantile([4.0], 0.9) == 4.0


def test_one_slow_outlier_in_ten_does_not_trigger():
    window = table(paid=(0.1,) * 9 + (5.0,))[0]
    assert tier_state(window, S, NOW) == "calm"


def test_disabled_guard_leaves_every_cap():
    off = GuardSettings(enabled=False)
    assert next_limits(table(paid=HOT), {"free": 1}, off, NOW) == {"paid": 8, "subscriber": 8, "free": 8, "batch": 8}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def gate_with_guard(clock: Clock) -> Gate:
    tiers = [TierPolicy("paid", 0, 8, 64, TARGET), TierPolicy("free", 1, 4, 64, TARGET),
             TierPolicy("batch", 2, 4, 64, TARGET, is_batch=True)]
    return Gate(tiers, slots=16, clock=clock, guard=GuardSettings(window_s=5.0, interval_s=1.0, min_samples=3))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_gate_shrinks_free_while_paid_is_slow_and_hands_out_slots_when_it_recovers():
    async def run() -> None:
        clock = Clock()
        gate = gate_with_guard(clock)
        for _ in range(3):
            gate.observe_latency("paid", 0.95)  # above 0.8 x target
        assert gate.limits["free"] == 4  # decided on the first sample (too few to judge), then once per interval
        clock.t += 1.0
        gate.observe_latency("paid", 0.95)
        assert gate.limits["free"] == 2
        clock.t += 1.0
        gate.observe_latency("paid", 0.95)
        assert gate.limits["free"] == 1
        held = await gate.acquire("free", "m")
        waiter = asyncio.ensure_future(gate.acquire("free", "m"))
        await settle()
        assert not waiter.done()  # the second free request waits: free's effective limit is 1
        clock.t += 10.0  # paid's slow samples leave the window; free's latency arrives
        gate.observe_latency("free", 0.2)
        await settle()
        assert gate.limits["free"] == 2
        assert waiter.done()  # the grown limit handed the slot over at once
        gate.release(held)
        gate.release(waiter.result())

    asyncio.run(run())


def test_gate_grows_limits_back_on_its_timer_after_a_slow_spell_and_silence():
    """Paid is slow, then nothing more is reported: once paid's samples age out of the window,
    the gate's timer grows free back to its configured limit (a waiter is handed the slots),
    one step per interval, and then sets no timer (none on an idle server)."""
    async def run() -> None:
        tiers = [TierPolicy("paid", 0, 8, 64, TARGET), TierPolicy("free", 1, 4, 64, TARGET)]
        # requests of 0.1 s: the waiters' predicted wait (free's work over its lowered limit) is within its target
        gate = Gate(tiers, slots=16, costs=CostModel(prior_s=0.1),
                    guard=GuardSettings(window_s=1.0, interval_s=0.05, min_samples=3))
        for _ in range(3):
            gate.observe_latency("paid", 0.95)
        await asyncio.sleep(0.06)
        gate.observe_latency("paid", 0.95)
        assert gate.limits["free"] == 2
        held = [await gate.acquire("free", "m") for _ in range(2)]
        waiters = [asyncio.ensure_future(gate.acquire("free", "m")) for _ in range(2)]
        await asyncio.sleep(0.2)  # paid's samples are still in the window
        assert gate.limits["free"] <= 2 and not any(w.done() for w in waiters)
        await asyncio.sleep(1.5)  # they age out 1 s after the last; then two steps of 0.05 s
        assert gate.limits == {"paid": 8, "free": 4}
        assert all(w.done() for w in waiters)  # the grown limit handed out the slots
        assert gate._guard_timer is None
        for ticket in held + [w.result() for w in waiters]:
            gate.release(ticket)
        await gate.stop()

    asyncio.run(run())


def test_gate_stop_cancels_the_guards_timer():
    async def run() -> None:
        clock = Clock()
        gate = gate_with_guard(clock)
        for _ in range(3):
            gate.observe_latency("paid", 0.95)
        clock.t += 1.0
        gate.observe_latency("paid", 0.95)
        assert gate.limits["free"] == 2 and gate._guard_timer is not None
        await gate.stop()
        assert gate._guard_timer is None

    asyncio.run(run())


def test_gate_without_guard_keeps_configured_limits():
    clock = Clock()
    gate = Gate([TierPolicy("paid", 0, 8, 64, TARGET), TierPolicy("free", 1, 4, 64, TARGET)], slots=16, clock=clock)
    for _ in range(10):
        gate.observe_latency("paid", 50.0)
        clock.t += 1.0
    assert gate.limits == {"paid": 8, "free": 4}


def plain_fit(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    n = len(pairs)
    mx = sum(u for u, _ in pairs) / n
    my = sum(s for _, s in pairs) / n
    var = sum((u - mx) ** 2 for u, _ in pairs)
    if var == 0:
        return my, 0.0
    b = max(sum((u - mx) * (s - my) for u, s in pairs) / var, 0.0)
    return my - b * mx, b


@pytest.mark.parametrize("window", [1, 2, 8, 64])
def test_running_sums_equal_a_plain_fit_over_the_window(window):
    rng = random.Random(window)
    costs = CostModel(window=window)
    seen: list[tuple[float, float]] = []
    for i in range(500):
        units = rng.choice([rng.uniform(1, 1e6), 512.0, rng.uniform(1e8, 1e9)])
        seconds = 0.01 + 1e-6 * units * rng.uniform(0.5, 1.5)
        costs.observe("m", units, seconds)
        seen.append((units, seconds))
        a, b = plain_fit(seen[-window:])
        for probe in (1.0, 1000.0, 5e5):
            expect = max(a + b * probe, 0.0)
            assert costs.predict("m", probe) == pytest.approx(expect, rel=1e-6, abs=1e-9), (i, probe)


def test_equal_sizes_predict_the_mean():
    costs = CostModel(window=4)
    for s in (1.0, 2.0, 3.0, 4.0, 5.0):
        costs.observe("m", 100.0, s)
    assert costs.predict("m", 100.0) == pytest.approx(3.5)
    assert costs.predict("m", 1e9) == pytest.approx(3.5)


# -- wired into the server: the guard is on with the config's settings, and every request reports --


@pytest.fixture(scope="module")
def server(tiny_chat, tiny_tts, tmp_path_factory):
    from tests.helpers import start_server, write_config

    folder = tmp_path_factory.mktemp("guarded")
    running = start_server(write_config(folder, {"tiny-chat": ("chat", tiny_chat), "tiny-tts": ("tts", tiny_tts)},
                                        "gate:\n  slo_guard:\n    trigger: 0.7\n"))
    yield running
    running.stop()


def reported(server, monkeypatch, method: str = "observe_latency") -> list[tuple[str, float, float]]:
    """What the server's gate is told through ``method``, as (tier, seconds, when it was told)."""
    gate = server.services.gate
    seen: list[tuple[str, float, float]] = []
    real = getattr(gate, method)

    def observe(tier: str, seconds: float) -> None:
        seen.append((tier, seconds, time.monotonic()))
        real(tier, seconds)

    monkeypatch.setattr(gate, method, observe)
    return seen


def test_the_servers_gate_has_the_configs_guard(server):
    assert server.services.gate.guard == GuardSettings(trigger=0.7)  # on; the rest the shipped defaults


def test_chat_reports_its_time_to_first_token(server, monkeypatch):
    seen = reported(server, monkeypatch)
    client = OpenAI(base_url=server.base_url, api_key=server.keys["paid"])
    start = time.monotonic()
    stream = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=32, stream=True)
    arrivals = [time.monotonic() for _ in stream]
    assert len(seen) == 1, seen  # once per request, not again at its end
    tier, seconds, told = seen[0]
    assert tier == "paid" and 0 < seconds <= told - start
    assert told < arrivals[0]  # told before the first token left the server: the TTFT, not the whole time


def test_speech_reports_its_whole_time(server, monkeypatch):
    seen = reported(server, monkeypatch)
    client = OpenAI(base_url=server.base_url, api_key=server.keys["free"])
    start = time.monotonic()
    audio = client.audio.speech.create(model="tiny-tts", voice="alloy", input="hello there", response_format="wav")
    audio.read()
    done = time.monotonic()
    assert len(seen) == 1, seen
    tier, seconds, told = seen[0]
    assert tier == "free" and 0 < seconds <= done - start


def token_table(paid_tokens=(), paid_token_target=0.01, paid=COOL) -> list[TierWindow]:
    rows = table(paid=paid)
    rows[0] = TierWindow("paid", 0, TARGET, 8, False, at(NOW, *paid), paid_token_target, at(NOW, *paid_tokens))
    return rows


SLOW_TOKENS, MID_TOKENS, FAST_TOKENS = (0.009, 0.0095, 0.012), (0.006, 0.007, 0.0065), (0.001, 0.002, 0.003)


@pytest.mark.parametrize(
    "case, windows, limits, expected",
    [
        ("paid's first tokens on time but its replies slow: the tiers below halve",
         token_table(SLOW_TOKENS), {}, {"paid": 8, "subscriber": 4, "free": 4, "batch": 8}),
        ("token latency between recover and trigger: hold",
         token_table(MID_TOKENS), {"subscriber": 3, "free": 2}, {"paid": 8, "subscriber": 3, "free": 2, "batch": 8}),
        ("both fast: grow back", token_table(FAST_TOKENS), {"subscriber": 3, "free": 2},
         {"paid": 8, "subscriber": 4, "free": 3, "batch": 8}),
        ("no token target: slow replies are not judged", token_table(SLOW_TOKENS, None), {"subscriber": 3},
         {"paid": 8, "subscriber": 4, "free": 8, "batch": 8}),
        ("too few token samples are not judged", token_table(SLOW_TOKENS[:2]), {"subscriber": 3},
         {"paid": 8, "subscriber": 4, "free": 8, "batch": 8}),
        ("fast replies do not hide a late first token", token_table(FAST_TOKENS, paid=HOT), {},
         {"paid": 8, "subscriber": 4, "free": 4, "batch": 8}),
    ],
)
def test_next_limits_judges_token_latency(case, windows, limits, expected):
    assert next_limits(windows, limits, S, NOW) == expected, case


def test_token_latencies_age_out_too():
    windows = token_table(paid_tokens=(0.05, 0.05, 0.05))
    assert next_limits(windows, {"free": 4}, S, NOW)["free"] == 2
    assert next_limits(windows, {"free": 4}, S, NOW + 10.0)["free"] == 5
    assert next_decision_at(windows, {"free": 4}, S, NOW) == NOW + 10.0


def test_gate_feeds_token_latencies_to_the_guard():
    """Through the gate: paid's replies slowing down token by token (its first tokens fast)
    halve free's effective max_inflight, and fast replies let it grow back."""
    now = [0.0]
    tiers = [TierPolicy("paid", 0, 4, 8, 1.0, token_latency_target_s=0.01), TierPolicy("free", 1, 4, 8, 10.0)]
    gate = Gate(tiers, 8, clock=lambda: now[0], guard=GuardSettings(interval_s=1.0, window_s=5.0))
    for _ in range(3):
        gate.observe_latency("paid", 0.001)
        gate.observe_token_latency("paid", 0.02)
    now[0] = 1.5
    gate.observe_token_latency("paid", 0.02)
    assert gate.limits["free"] == 2
    now[0] = 10.0  # the slow replies have aged out of the window: one decision grows free by one
    gate.observe_token_latency("paid", 0.001)
    assert gate.limits["free"] == 3
    now[0] = 11.1
    gate.observe_token_latency("paid", 0.001)
    assert gate.limits["free"] == 4


def test_chat_reports_its_mean_time_per_later_token(server, monkeypatch):
    """A streamed reply of n tokens reports (end - first token) / (n - 1) once, as it ends; a
    speech request (no tokens) reports none."""
    seen = reported(server, monkeypatch, "observe_token_latency")
    client = OpenAI(base_url=server.base_url, api_key=server.keys["paid"])
    start = time.monotonic()
    stream = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=32, stream=True, stream_options={"include_usage": True},
                                            temperature=0)  # greedy: a sampled first token may be the end
    chunks = list(stream)
    elapsed = time.monotonic() - start
    tokens = chunks[-1].usage.completion_tokens
    assert tokens > 1  # the random demo model does not stop at once (else this test would show nothing)
    assert len(seen) == 1, seen
    tier, seconds, _ = seen[0]
    assert tier == "paid" and 0 < seconds * (tokens - 1) < elapsed
    seen.clear()
    client.audio.speech.create(model="tiny-tts", voice="alloy", input="hello", response_format="wav").read()
    assert seen == []


# -- in the server: limits lowered by a slow spell are back at their configured values after the window, with no traffic


@pytest.fixture(scope="module")
def quick_guard(tiny_tts, tmp_path_factory):
    """A server whose paid tier's target (1 ms) every request misses, with a short window (1.5 s)."""
    from tests.helpers import start_server, write_config

    folder = tmp_path_factory.mktemp("quick-guard")
    path = write_config(folder, {"tiny-tts": ("tts", tiny_tts)},
                        "gate:\n  slo_guard:\n    window_s: 1.5\n    interval_s: 0.1\n")
    text = path.read_text()
    path.write_text(text.replace("latency_target_s: 600", "latency_target_s: 0.001", 1))  # the first tier: paid
    running = start_server(path)
    yield running
    running.stop()


def effective_limits(server) -> dict[str, float]:
    import httpx

    lines = httpx.get(server.url + "/metrics", timeout=30).text.splitlines()
    return {line.split('"')[1]: float(line.split()[-1]) for line in lines
            if line.startswith("tiergate_effective_max_inflight{")}


def test_lowered_limits_grow_back_with_no_traffic(quick_guard):
    client = OpenAI(base_url=quick_guard.base_url, api_key=quick_guard.keys["paid"])
    assert quick_guard.services.gate.tiers["paid"].latency_target_s == 0.001
    for _ in range(5):  # three samples to judge; decisions at most one per 0.1 s
        client.audio.speech.create(model="tiny-tts", voice="alloy", input="hi", response_format="wav").read()
        time.sleep(0.12)
    lowered = effective_limits(quick_guard)
    assert lowered["paid"] == 4 and lowered["subscriber"] < 4 and lowered["free"] < 4, lowered
    time.sleep(3.0)  # no requests: paid's samples age out after 1.5 s, then up to three steps of 0.1 s
    assert effective_limits(quick_guard) == {"paid": 4, "subscriber": 4, "free": 4, "batch": 4}
    changes = [e.data["limits"] for e in quick_guard.services.gate.events.recent if e.kind == "limits_changed"]
    assert changes[-1] == {"paid": 4, "subscriber": 4, "free": 4, "batch": 4}  # the dashboard's stream saw it
