"""The tier-aware router plugged into Ray Serve as its custom ``RequestRouter`` (alpha API).

Ray hands it the replicas it may use and the pending request; it reads each replica's last
report (``RunningReplica.routing_stats``, from ``TierReplica.record_routing_stats``) and asks
``cluster.router.choose``. Replicas that have not reported yet form a last rank. When no replica
can take the request the verdict (429 with Retry-After, or 503) travels in the request's
``verdict`` argument to a replica, which answers it without touching a model (unless its live state
can take the request after all: the reports were stale), so the client gets the cluster-wide
answer through the same path as every other response. A call with a ``replica`` argument (a
realtime session's client messages, or a request that names an id that replica made:
``gateway.origin``) goes to that replica while it lives.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cluster.router import Refusal, Route, choose
from cluster.stats import ReplicaStats


class TierRouter(RequestRouter):
    def initialize_state(self, paid_target_s: float = 10.0, max_copies: dict[str, int] | None = None,
                         **kwargs: Any) -> None:
        self.paid_target_s = paid_target_s
        self.max_copies = dict(max_copies or {})

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        kwargs = pending_request.kwargs
        if (pinned := kwargs.get("replica")) is not None:  # a realtime session's messages, an id it made
            held = [r for r in candidate_replicas if r.replica_id.unique_id == pinned]
            if held:
                return [held]  # (gone: routed as any other call, and answered there)
        avoid = set(kwargs.get("avoid") or ())
        usable = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid] or candidate_replicas
        model = kwargs.get("model")
        if model is None:  # no model needed (files, batches, model list): the least loaded
            return [usable]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        reports = [ReplicaStats.from_dict(r.routing_stats) for r in candidate_replicas if r.routing_stats]
        silent = [r for r in usable if not r.routing_stats]
        choice = choose(reports, model, kwargs.get("tier", 0), time.time(), self.paid_target_s,
                        self.max_copies.get(model, 1), avoid, kwargs.get("affinity"))
        kwargs["verdict"] = None
        if isinstance(choice, Route):
            return [[by_id[choice.replica]]] + ([silent] if silent else [])
        if silent:  # they may have room: try them before refusing
            return [silent]
        if isinstance(choice, Refusal):
            kwargs["verdict"] = {"status": 429, "code": "model_protected", "type": "rate_limit_error",
                                 "message": choice.reason, "retry_after": choice.retry_after}
        else:
            kwargs["verdict"] = {"status": 503, "code": "model_unavailable", "message": choice.reason}
        return [usable]
