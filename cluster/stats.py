"""What a replica (one device: one gate, one arbiter) reports to the router.

One function, :func:`replica_stats`, computes it from the live ``Arbiter`` and ``Gate``, asking
the arbiter's own policy (``arbiter.policy.plan_load``) what a request of each tier would need for
each model, and the gate (``Gate.predict_wait``) how long each tier would wait. The router
(``cluster.router``) only reads these answers, so the router and the arbiter cannot disagree
except by staleness; the chosen replica re-checks with the same function (``admits``).

Per model and tier the answer is one ``Need``:
    ``resident``  resident or loading already;
    ``warm``      warm in host memory, and it can be brought back now (fits, or evictable room);
    ``fits``      cold, fits in free budget;
    ``evict``     cold, fits after evicting models this tier may evict;
    ``wait``      fits only after running work ends (the arbiter queues it);
    ``refuse``    only protected models stand in the way: ``retry_after`` seconds;
    ``never``     bigger than the budget or blocked by pinned models.
The stats travel as plain dicts (Ray's ``record_routing_stats`` takes a dict).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Mapping

from arbiter.policy import ArbiterView, Evict, Fit, Impossible, Refuse, plan_load

if TYPE_CHECKING:  # the router reads these stats inside the ingress, which imports no torch
    from arbiter.residency import Arbiter
    from gateway.admission import Gate

Need = Literal["resident", "warm", "fits", "evict", "wait", "refuse", "never"]


@dataclass(frozen=True)
class Option:
    """What serving one model to one tier needs on this replica."""

    need: Need
    retry_after: int = 0  # for ``refuse``: when the earliest protection that frees enough ends


@dataclass(frozen=True)
class ReplicaStats:
    replica: str
    at: float  # wall-clock time of the report (seconds since the epoch)
    options: Mapping[str, Mapping[int, Option]]  # model -> tier rank -> what it needs
    wait_s: Mapping[int, float]  # tier rank -> predicted wait at the gate
    free_bytes: int = 0  # device budget not used by resident or loading models
    places: Mapping[str, str] = field(default_factory=dict)  # model -> resident | warm | cold | loading

    def to_dict(self) -> dict:
        return {
            "replica": self.replica,
            "at": self.at,
            "free_bytes": self.free_bytes,
            "places": dict(self.places),
            "wait_s": {str(t): w for t, w in self.wait_s.items()},
            "options": {m: {str(t): [o.need, o.retry_after] for t, o in by.items()}
                        for m, by in self.options.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "ReplicaStats":
        return cls(
            replica=d["replica"],
            at=float(d["at"]),
            free_bytes=int(d.get("free_bytes", 0)),
            places=dict(d.get("places", {})),
            wait_s={int(t): float(w) for t, w in d["wait_s"].items()},
            options={m: {int(t): Option(need, int(ra)) for t, (need, ra) in by.items()}
                     for m, by in d["options"].items()},
        )


def option(view: ArbiterView, model: str, tier: int, batch_rank: int) -> Option:
    """What a request of ``tier`` for ``model`` needs, by the arbiter's own policy."""
    place = view.models[model].place
    if place in ("resident", "loading"):
        return Option("resident")
    decision = plan_load(view, model, tier, batch_rank)
    if isinstance(decision, (Fit, Evict)):
        if place == "warm":
            return Option("warm")
        return Option("fits" if isinstance(decision, Fit) else "evict")
    if isinstance(decision, Refuse):
        return Option("refuse", decision.retry_after)
    assert isinstance(decision, Impossible)
    return Option("wait" if decision.waiting_on else "never")


def stats_of(replica: str, view: ArbiterView, wait_s: Mapping[int, float], batch_rank: int,
             at: float) -> ReplicaStats:
    """The report of a replica whose arbiter state is ``view`` and whose gate predicts ``wait_s``."""
    return ReplicaStats(
        replica=replica,
        at=at,
        options={name: {t: option(view, name, t, batch_rank) for t in wait_s} for name in view.models},
        wait_s=dict(wait_s),
        free_bytes=view.free,
        places={name: m.place for name, m in view.models.items()},
    )


def replica_stats(replica: str, arbiter: Arbiter, gate: Gate, clock=time.time) -> ReplicaStats:
    """The report of one replica, from its live arbiter and gate."""
    waits = {p.rank: gate.predict_wait(p) for p in sorted(gate.tiers.values(), key=lambda p: p.rank)}
    return stats_of(replica, arbiter.view(), waits, arbiter.batch_rank, clock())
