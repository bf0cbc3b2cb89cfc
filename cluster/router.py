"""The tier-aware router: which replica (device) serves a request, as a pure function.

It reads the replicas' reports (``cluster.stats.ReplicaStats``: for every model and tier what a
request would need there, and each tier's predicted wait at its gate) and ranks the replicas:

    1. the model is resident (or loading) there;
    2. it is warm in host memory there (and can be brought back now);
    3. it fits in free budget there;
    4. the replica holds models this tier may evict to make room;
    5. it fits there once running work ends (the arbiter queues it);
    otherwise 429 (``Refusal``) with Retry-After = the earliest protection end across replicas,
    or 503 (``Unplaceable``) when no replica could ever hold it.

Ties go to the shortest predicted wait for the request's tier (then the replica's name, only to
be deterministic). A request with an **affinity** (its ``prompt_cache_key``, or the response or
conversation it continues) that finds its model on several replicas goes to the same one as the
other requests of that affinity, where the prompts share their start and vLLM's prefix cache
holds it: the replica that rendezvous hashing picks for the affinity among those holding the
model whose wait for the tier is within ``AFFINITY_SLACK`` of paid's target (at least
``AFFINITY_MIN_SLACK_S``) of the shortest (so a busy replica is left for a free one, and a
replica leaving moves only its own affinities). A model resident on some replicas goes to one of them, except that a hot model
may load one more copy (up to ``max_copies``) when every replica holding it predicts a wait for the
highest tier (paid, rank 0) beyond that tier's latency target: then the best replica where it could
be loaded now (ranks 2-4) takes it.

Reports are stale by up to their period, so the chosen replica re-checks (``admits``) and answers
"redirect" when it would refuse; the caller routes again with that replica in ``avoid``. A
refusal whose Retry-After has passed since its report counts as ``evict``: that protection is over.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from arbiter.policy import retry_after_s
from cluster.stats import Need, Option, ReplicaStats

RANK: dict[Need, int] = {"resident": 1, "warm": 2, "fits": 3, "evict": 4, "wait": 5}
LOAD_NOW: frozenset[Need] = frozenset({"warm", "fits", "evict"})  # a second copy may start with these
AFFINITY_SLACK = 0.25  # of paid's latency target: how much longer a wait an affinity may accept
AFFINITY_MIN_SLACK_S = 0.05  # and at least this: a cached prompt saves a prefill, tens of ms


@dataclass(frozen=True)
class Route:
    replica: str
    need: Need
    wait_s: float


@dataclass(frozen=True)
class Refusal:
    """429: every replica that could hold the model has it protected (or is avoided)."""

    retry_after: int
    reason: str


@dataclass(frozen=True)
class Unplaceable:
    """503: no replica can ever hold it (too big, pinned models in the way, unknown model)."""

    reason: str


Choice = Route | Refusal | Unplaceable


def _option(s: ReplicaStats, model: str, tier: int) -> Option | None:
    return s.options.get(model, {}).get(tier)


def _best(candidates: list[tuple[ReplicaStats, Option]], tier: int) -> Route:
    s, o = min(candidates, key=lambda c: (RANK[c[1].need], c[0].wait_s.get(tier, 0.0), c[0].replica))
    return Route(s.replica, o.need, s.wait_s.get(tier, 0.0))


def _affine(holding: list[tuple[ReplicaStats, Option]], tier: int, affinity: str, slack_s: float) -> Route:
    """Among replicas holding the model, the one rendezvous hashing gives ``affinity``, of those
    whose wait for ``tier`` is within ``slack_s`` of the shortest."""
    shortest = min(s.wait_s.get(tier, 0.0) for s, _ in holding)
    near = [(s, o) for s, o in holding if s.wait_s.get(tier, 0.0) <= shortest + slack_s]
    s, o = max(near, key=lambda c: hashlib.blake2b(f"{affinity}\0{c[0].replica}".encode(), digest_size=8).digest())
    return Route(s.replica, o.need, s.wait_s.get(tier, 0.0))


def choose(
    stats: Sequence[ReplicaStats],
    model: str,
    tier: int,
    now: float,
    paid_target_s: float,
    max_copies: int = 1,
    avoid: Collection[str] = (),
    affinity: str | None = None,
) -> Choice:
    """The replica for a request of ``tier`` (rank; 0 is paid) for ``model`` at wall time ``now``;
    ``affinity`` keeps requests that share a prompt's start on one replica (module doc)."""
    options = [(s, o) for s in stats if (o := _option(s, model, tier)) is not None]
    if not options:
        return Unplaceable(f"no replica serves the model '{model}'")
    options = [(s, _aged(s, o, now)) for s, o in options]
    copies = sum(1 for _, o in options if o.need == "resident")
    usable = [(s, o) for s, o in options if s.replica not in avoid and o.need in RANK]
    holding = [(s, o) for s, o in usable if o.need == "resident"]
    if holding:
        hot = all(s.wait_s.get(0, 0.0) > paid_target_s for s, _ in holding)
        spare = [(s, o) for s, o in usable if o.need in LOAD_NOW]
        if hot and copies < max_copies and spare:
            return _best(spare, tier)
        if affinity and len(holding) > 1:
            return _affine(holding, tier, affinity, max(AFFINITY_SLACK * paid_target_s, AFFINITY_MIN_SLACK_S))
        return _best(holding, tier)
    if usable:
        return _best(usable, tier)
    refusals = [retry_after_s(o.retry_after - max(0.0, now - s.at)) for s, o in options if o.need == "refuse"]
    if refusals:
        return Refusal(min(refusals), f"'{model}' needs memory held by models other requests used recently "
                                      "on every replica")
    if any(s.replica in avoid for s, _ in options):
        return Refusal(1, f"no other replica can take '{model}' now")
    return Unplaceable(f"'{model}' does not fit on any replica")


def _aged(s: ReplicaStats, o: Option, now: float) -> Option:
    """A refusal whose protection has ended since the report was made: the models in the way may
    be evicted now (the replica re-checks)."""
    if o.need == "refuse" and o.retry_after <= now - s.at:
        return Option("evict")
    return o


def admits(own: ReplicaStats, model: str, tier: int) -> bool:
    """The chosen replica's re-check on its fresh stats: False means answer "redirect"."""
    o = _option(own, model, tier)
    return o is not None and o.need in RANK
