"""The engine deployment's Ray Serve request router: ``routing.Router``'s policy over the live
replicas (imported only when serving: it imports Ray Serve). Its decisions are counted on the
metrics board (``replicas.metrics.MetricsBoard``), where the ingress's ``/metrics`` reads them.

Serve calls ``choose_replicas`` for each request, with the replicas it may go to; the request's
prompt token ids are its first argument. The decision ranks the chosen replica first and the
others after it (Serve falls back to them if the chosen one's queue is full). The prompt is
remembered as sent to the replica that Serve actually sent it to (``on_request_routed``), and a
replica whose actor died is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict

import ray
from ray.serve.request_router import FIFOMixin, RequestRouter

from engine.entrypoints.replicas.routing import Router

BOARD = "pagedllm_board"  # the metrics board's actor name, in Serve's namespace
PENDING = 4096  # decisions kept for requests not yet routed (a cancelled one never is)


class PolicyRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "prefix-aware", imbalance: int = 4, **_):
        self.router = Router(policy, imbalance)
        self.decided: OrderedDict = OrderedDict()  # Serve's request id -> (ids, replica, reason)
        self.board = None  # the metrics board, found by name at the first routed request

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        args = pending_request.args if pending_request is not None else ()
        request = args[0] if args and isinstance(args[0], dict) else None
        if request is None:  # not a generation (a health ping): any replica
            return [candidate_replicas]
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {name: cache.get(r.replica_id) or 0 for name, r in by_name.items()}
        ids = request.get("route_ids") or request["prompt_token_ids"]  # an adapter's: its own
        pick, reason = self.router.decide(ids, loads)
        self.decided[pending_request.metadata.internal_request_id] = (
            ids,
            pick,
            reason,
        )
        while len(self.decided) > PENDING:  # the oldest were cancelled before they were routed
            self.decided.popitem(last=False)
        rest = [r for name, r in by_name.items() if name != pick]
        return [[by_name[pick]], rest] if rest else [[by_name[pick]]]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        decided = self.decided.pop(pending_request.metadata.internal_request_id, None)
        if decided is not None:
            ids, pick, reason = decided
            name = replica_id.unique_id
            reason = reason if name == pick else "fallback"
            self.router.record(ids, name, reason)
            self._count(name, reason)

    def _count(self, replica: str, reason: str) -> None:
        """The decision on the metrics board (its counters are /metrics')."""
        if self.board is None:
            try:
                self.board = ray.get_actor(BOARD, namespace="serve")
            except ValueError:  # no board: a deployment without the server's metrics
                return
        self.board.count.remote(replica, reason)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.router.forget(replica_id.unique_id)
