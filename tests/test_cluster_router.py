"""The tier-aware router's pure choice over a table of replica reports, and the reports as the
real arbiter and gate compute them (so the router and the arbiter agree).

Unless a test says otherwise: tiers paid=0 > sub=1 > free=2 > batch=3, paid's latency target
10 s, reports made at NOW (wall clock) and read at NOW.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from arbiter.residency import Arbiter
from cluster.router import Refusal, Route, Unplaceable, admits, choose
from cluster.stats import Option, ReplicaStats, replica_stats
from gateway.admission import Gate, TierPolicy
from workers.base import ModelSpec

PAID, SUB, FREE, BATCH = 0, 1, 2, 3
NOW = 1_000_000.0
TARGET = 10.0
GiB = 2**30


def r(name, needs, wait=None, at=NOW) -> ReplicaStats:
    """A replica: ``needs`` maps model -> need for every tier, or -> {tier: need}; a need may be
    ("refuse", seconds). ``wait`` maps tier -> predicted wait (default 0 for every tier)."""
    def opt(n):
        return Option(*n) if isinstance(n, tuple) else Option(n)

    options = {}
    for model, need in needs.items():
        by = need if isinstance(need, dict) else {t: need for t in range(4)}
        options[model] = {t: opt(n) for t, n in by.items()}
    return ReplicaStats(name, at, options, {t: 0.0 for t in range(4)} | (wait or {}))


def pick(*replicas, model="m", tier=PAID, max_copies=1, avoid=(), now=NOW, affinity=None):
    return choose(replicas, model, tier, now, TARGET, max_copies, avoid, affinity)


# Each row: the replicas' needs for model "m" (and their waits for the tier), then the expected
# replica. The ranking: resident > warm > fits > evict > wait; ties to the shorter wait.
TABLE = [
    ("resident beats warm", [("A", "warm", 0), ("B", "resident", 5)], "B"),
    ("warm beats fits", [("A", "fits", 0), ("B", "warm", 5)], "B"),
    ("fits beats evict", [("A", "evict", 0), ("B", "fits", 5)], "B"),
    ("evict beats waiting on running work", [("A", "wait", 0), ("B", "evict", 5)], "B"),
    ("a refusal is skipped", [("A", ("refuse", 30), 0), ("B", "evict", 5)], "B"),
    ("never is skipped", [("A", "never", 0), ("B", "wait", 5)], "B"),
    ("tie: the shorter wait", [("A", "resident", 3), ("B", "resident", 1), ("C", "resident", 2)], "B"),
    ("tie on fits: the shorter wait", [("A", "fits", 1.5), ("B", "fits", 0.5)], "B"),
    ("equal waits: by name", [("B", "evict", 0), ("A", "evict", 0)], "A"),
]


@pytest.mark.parametrize("name,rows,expected", TABLE, ids=[t[0] for t in TABLE])
def test_ranking_table(name, rows, expected):
    replicas = [r(n, {"m": need}, {PAID: wait}) for n, need, wait in rows]
    choice = pick(*replicas)
    assert isinstance(choice, Route) and choice.replica == expected


def test_the_wait_compared_is_the_requesting_tiers():
    a = r("A", {"m": "resident"}, {PAID: 0.0, FREE: 9.0})
    b = r("B", {"m": "resident"}, {PAID: 5.0, FREE: 1.0})
    assert pick(a, b, tier=PAID).replica == "A"
    assert pick(a, b, tier=FREE).replica == "B"


def test_needs_differ_by_tier():
    # paid may evict on A; free would have to wait out a protection there, and fits on B only after work ends
    a = r("A", {"m": {PAID: "evict", FREE: ("refuse", 20)}})
    b = r("B", {"m": {PAID: "wait", FREE: "wait"}})
    assert pick(a, b, tier=PAID).replica == "A"
    assert pick(a, b, tier=FREE).replica == "B"


def test_everywhere_protected_is_429_with_the_earliest_protection_end():
    choice = pick(r("A", {"m": ("refuse", 40)}), r("B", {"m": ("refuse", 25)}), r("C", {"m": "never"}))
    assert isinstance(choice, Refusal) and choice.retry_after == 25


def test_retry_after_counts_from_the_report_not_from_now():
    # B reported 10 s ago that its protection ends in 25 s: 15 s are left
    choice = pick(r("A", {"m": ("refuse", 40)}), r("B", {"m": ("refuse", 25)}, at=NOW - 10))
    assert choice == Refusal(15, choice.reason)
    # a protection that has ended since the report: the model in the way may be evicted now
    assert pick(r("A", {"m": ("refuse", 5)}, at=NOW - 30)) == Route("A", "evict", 0.0)
    assert pick(r("A", {"m": ("refuse", 5)}, at=NOW - 4)).retry_after == 1


def test_no_replica_can_ever_hold_it_is_503():
    assert isinstance(pick(r("A", {"m": "never"}), r("B", {"m": "never"})), Unplaceable)
    assert isinstance(pick(r("A", {"other": "fits"})), Unplaceable)  # nobody serves "m"


def test_avoid_skips_the_replica_that_redirected():
    a = r("A", {"m": "resident"})
    b = r("B", {"m": "evict"}, {PAID: 9.0})
    assert pick(a, b).replica == "A"
    assert pick(a, b, avoid={"A"}).replica == "B"
    # nowhere else to go: a short 429, not a 503
    assert pick(a, avoid={"A"}) == Refusal(1, pick(a, avoid={"A"}).reason)
    # others protected: their protection end
    assert pick(a, r("B", {"m": ("refuse", 12)}), avoid={"A"}).retry_after == 12


# --- affinity: requests sharing a prompt's start stay on one replica ----------------------------

def test_an_affinity_keeps_to_one_replica_of_those_holding_the_model():
    """Each affinity always gets the same replica of three holding the model (not always the one
    with the shortest wait, which a request without one gets), the affinities spread over all
    three, and a replica leaving moves only its own affinities (rendezvous hashing)."""
    reps = [r(n, {"m": "resident"}, {PAID: w}) for n, w in (("A", 0.3), ("B", 0.0), ("C", 0.6))]
    keys = [f"user-{i}" for i in range(60)]
    chosen = {k: pick(*reps, affinity=k).replica for k in keys}
    assert chosen == {k: pick(*reversed(reps), affinity=k).replica for k in keys}  # the order of reports: no matter
    assert set(chosen.values()) == {"A", "B", "C"}
    assert pick(*reps).replica == "B"  # no affinity: the shortest wait
    without_c = {k: pick(*reps[:2], affinity=k).replica for k in keys}
    assert all(without_c[k] == chosen[k] for k in keys if chosen[k] != "C")


def test_an_affinity_leaves_a_replica_whose_wait_is_past_the_slack():
    """A wait longer than the shortest by more than a quarter of paid's target is not worth the
    cache: the affinity's replica is skipped; within it, kept. Only resident copies take part."""
    from cluster.router import AFFINITY_SLACK

    keys = [f"k{i}" for i in range(40)]
    near = [r("A", {"m": "resident"}, {PAID: 0.0}), r("B", {"m": "resident"}, {PAID: AFFINITY_SLACK * TARGET})]
    far = [near[0], r("B", {"m": "resident"}, {PAID: AFFINITY_SLACK * TARGET + 0.01})]
    assert {pick(*near, affinity=k).replica for k in keys} == {"A", "B"}
    assert {pick(*far, affinity=k).replica for k in keys} == {"A"}
    warm = [r("A", {"m": "resident"}), r("B", {"m": "warm"})]
    assert {pick(*warm, affinity=k).replica for k in keys} == {"A"}
    # a short target: the slack is still 50 ms (a wait a request in flight leaves in a report)
    from cluster.router import AFFINITY_MIN_SLACK_S

    busy = [near[0], r("B", {"m": "resident"}, {PAID: AFFINITY_MIN_SLACK_S - 0.01})]
    assert {choose(busy, "m", PAID, NOW, 0.001, 1, (), k).replica for k in keys} == {"A", "B"}
    busier = [near[0], r("B", {"m": "resident"}, {PAID: AFFINITY_MIN_SLACK_S + 0.01})]
    assert {choose(busier, "m", PAID, NOW, 0.001, 1, (), k).replica for k in keys} == {"A"}


def test_affinity_of_a_request_body():
    from cluster.ingress import affinity_of

    assert affinity_of({"prompt_cache_key": "pk", "previous_response_id": "resp_1"}) == "pk"
    assert affinity_of({"previous_response_id": "resp_1", "conversation": "conv_1"}) == "resp_1"
    assert affinity_of({"conversation": {"id": "conv_1"}}) == "conv_1"
    assert affinity_of({"prompt_cache_key": 5, "user": "u"}) is None and affinity_of({}) is None


# --- max_copies: a hot model loads a second copy -------------------------------------------------

def test_hot_model_loads_a_second_copy_when_paid_waits_past_its_target():
    hot = r("A", {"m": "resident"}, {PAID: TARGET + 1, FREE: TARGET + 1})
    spare = r("B", {"m": "fits"}, {PAID: 0.0})
    assert pick(hot, spare, max_copies=1).replica == "A"  # one copy allowed: queue where it is
    assert pick(hot, spare, max_copies=2).replica == "B"  # a second copy
    assert pick(hot, spare, max_copies=2, tier=FREE).replica == "B"  # for any tier: paid's wait decides


def test_no_second_copy_while_paid_is_within_its_target():
    busy = r("A", {"m": "resident"}, {PAID: TARGET - 1})
    assert pick(busy, r("B", {"m": "fits"}), max_copies=2).replica == "A"


def test_no_more_copies_than_max_copies_and_none_that_must_wait():
    a = r("A", {"m": "resident"}, {PAID: TARGET + 5})
    b = r("B", {"m": "resident"}, {PAID: TARGET + 1})
    c = r("C", {"m": "fits"})
    assert pick(a, b, c, max_copies=2).replica == "B"  # two copies already: the shorter queue
    assert pick(a, b, c, max_copies=3).replica == "C"
    assert pick(a, r("B", {"m": "wait"}), max_copies=2).replica == "A"  # a copy that must wait is no relief
    assert pick(a, r("B", {"m": ("refuse", 9)}), max_copies=2).replica == "A"


def test_stats_round_trip_through_a_dict():
    s = r("A", {"m": {PAID: "resident", FREE: ("refuse", 7)}}, {PAID: 1.5})
    s = ReplicaStats(s.replica, s.at, s.options, s.wait_s, 123, {"m": "resident"})
    assert ReplicaStats.from_dict(s.to_dict()) == s


def test_admits_is_the_replicas_recheck():
    own = r("A", {"m": {PAID: "evict", FREE: ("refuse", 20), BATCH: "never"}})
    assert admits(own, "m", PAID)
    assert not admits(own, "m", FREE)
    assert not admits(own, "m", BATCH)
    assert not admits(own, "other", PAID)


# --- the reports, from a real arbiter and gate ----------------------------------------------------

def _gate(slots=1) -> Gate:
    tiers = [TierPolicy("paid", 0, 4, 8, TARGET), TierPolicy("subscriber", 1, 4, 8, 30),
             TierPolicy("free", 2, 4, 8, 60), TierPolicy("batch", 3, 4, 100, 3600, is_batch=True)]
    return Gate(tiers, slots)


def test_replica_stats_follow_the_real_arbiter(tiny_chat):
    """Two resident 4 GiB models in a 10 GiB budget, one served to paid just now, one to free:
    a third model is resident nowhere, fits nowhere, and each tier's need is the arbiter's own."""
    clock = [1000.0]
    specs = [ModelSpec(n, "chat", tiny_chat, 4 * GiB) for n in "abc"]
    gate = _gate()

    async def main():
        arb = Arbiter(specs, torch.device("cpu"), 10 * GiB, 4 * GiB, protect_window_s=60,
                      batch_rank=BATCH, clock=lambda: clock[0])
        for model, tier in (("a", PAID), ("b", FREE)):
            (await arb.acquire(model, tier)).release()
        clock[0] += 5
        stats = replica_stats("A", arb, gate, clock=lambda: NOW)
        assert stats.places == {"a": "resident", "b": "resident", "c": "cold"}
        assert stats.free_bytes == 2 * GiB
        assert stats.options["a"][FREE] == Option("resident")
        c = stats.options["c"]
        assert c[PAID] == Option("evict")  # paid may evict the free tier's b
        assert c[SUB] == Option("evict")
        assert c[FREE] == Option("refuse", 55)  # b's protection for free ends in 55 s
        assert c[BATCH] == Option("refuse", 55)
        # the router reads it as the arbiter would act
        assert choose([stats], "c", PAID, NOW, TARGET) == Route("A", "evict", 0.0)
        assert choose([stats], "c", FREE, NOW, TARGET) == Refusal(55, choose([stats], "c", FREE, NOW, TARGET).reason)
        # and the arbiter acts so: paid evicts b (it goes warm), and b is then warm for paid
        (await arb.acquire("c", PAID)).release()
        after = replica_stats("A", arb, gate, clock=lambda: NOW)
        assert after.places == {"a": "resident", "b": "warm", "c": "resident"}
        assert after.options["b"][PAID] == Option("refuse", 55)  # a (paid's, 5 s ago) and c stand in the way
        clock[0] += 61  # every protection is over: b can come back from host memory
        assert replica_stats("A", arb, gate).options["b"][FREE] == Option("warm")
        await arb.stop()

    asyncio.run(main())


def test_replica_stats_carry_the_gates_predicted_wait(tiny_chat):
    gate = _gate(slots=1)
    arb = Arbiter([ModelSpec("a", "chat", tiny_chat, GiB)], torch.device("cpu"), 2 * GiB, 0,
                  protect_window_s=60, batch_rank=BATCH)

    async def main():
        gate.costs.observe("a", 1.0, 4.0)  # a request of "a" takes 4 s
        held = await gate.acquire("free", "a")
        queued = asyncio.ensure_future(gate.acquire("free", "a"))
        await asyncio.sleep(0)
        stats = replica_stats("A", arb, gate)
        assert stats.wait_s[PAID] == pytest.approx(4.0, abs=0.1)  # behind the running one
        assert stats.wait_s[FREE] == pytest.approx(8.0, abs=0.1)  # behind it and the queued free one
        gate.release(held)
        gate.release(await queued)
        assert replica_stats("A", arb, gate).wait_s == {PAID: 0.0, SUB: 0.0, FREE: 0.0, BATCH: 0.0}

    asyncio.run(main())


# --- tiergate serve stays free of Ray ------------------------------------------------------------

def test_only_the_cluster_package_imports_ray(tmp_path):
    """Every import statement outside cluster/ (lazy ones included), and what `tiergate serve`
    imports at run time (every gateway module, in a process forked from one that imported only
    `tiergate serve`'s stack: tests/forked.py; had that stack pulled Ray in, the child has it too)."""
    import ast
    from pathlib import Path

    from tests.forked import run_script

    root = Path(__file__).resolve().parents[1]
    offenders = []
    for package in ("gateway", "batch", "accounts", "arbiter", "workers", "lora_kernels", "demo"):
        for path in (root / package).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                offenders += [f"{path.name}: {n}" for n in names if n == "ray" or n.startswith("ray.")]
    assert offenders == []
    code = ("import importlib, pkgutil, sys, gateway\n"
            "for m in pkgutil.iter_modules(gateway.__path__): importlib.import_module('gateway.' + m.name)\n"
            "from gateway.cli import main\n"
            "print(sorted(n for n in sys.modules if n == 'ray' or n.startswith('ray.')))")
    (tmp_path / "imports.py").write_text(code)
    out = run_script(tmp_path / "imports.py", [], root, tmp_path, 120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_clusters_redis_url_is_every_replicas_batch_and_accounts_store(tmp_path):
    from cluster.deployments import shared_store
    from gateway.accounts import store_for
    from gateway.config import load_config

    path = tmp_path / "tiers.yaml"
    path.write_text("tiers:\n  - {name: paid, keys_env: K, latency_target_s: 10}\n")
    plain = load_config(path)
    assert shared_store(plain) == plain and plain.batch.store == "sqlite"
    path.write_text(path.read_text() + "cluster:\n  redis_url: redis://127.0.0.1:6390/0\n")
    shared = shared_store(load_config(path))
    assert shared.batch.store == "redis://127.0.0.1:6390/0"
    assert type(store_for(shared)).__name__ == "RedisAccounts"
