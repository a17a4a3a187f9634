"""The ``ray`` executor: one Ray actor per rank, in a placement group, behind the engine's
``Backend`` interface (the same ``Worker`` as the ``mp`` executor's processes).

The engine joins the Ray cluster ``ray_address`` names (or that ``RAY_ADDRESS`` names, or
starts a local one with a logical CPU per rank at least), reserves one CPU bundle per rank in
a placement group packed onto as few nodes as it can, and starts the actors in it. The weights
go to the actors through Ray's object store: one copy per node, mapped read-only by every actor
there, each keeping its cut.

The ranks' collectives are the shared-memory ones (comm.py), so every rank must be on the
engine's node: ranks placed on another node are refused (an all-reduce across machines needs
NCCL or a network collective, not built). Pipeline parallel hands each stage's hidden state to
the next as an object ref: every stage's call is submitted at once, and Ray starts a stage's
task when the one before has put its (hidden, residual) in the object store, the engine never
holding them.

A rank that raises comes back as a RuntimeError naming it; a rank whose actor dies, the same
within seconds (Ray marks its calls failed); either way every actor is killed and the placement
group removed.
"""

from __future__ import annotations

import os
import time
import weakref

from engine.devices.comm import ShmComm
from engine.emulation.nccl import remove_block
from engine.executor.executor import START_TIMEOUT, Executor, Worker
from model_loader.config import ModelConfig


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError(
            "distributed_executor_backend 'ray' needs the ray package: pip install ray"
        ) from None
    return ray


class RayWorker:
    """The actor: a Worker, and what the executor asks of the actor itself."""

    def __init__(self, rank: int, plan: dict, cfg, weights, engine_config):
        self.worker = Worker(rank, plan, cfg, weights, engine_config)

    def call(self, name: str, args: tuple):
        return self.worker.call(name, args)

    def stage(self, name: str, batch, hidden):
        """Pipeline parallel: this rank's stage of ``name`` (forward, forward_greedy or
        hidden_states) on the previous stage's (hidden, residual), which Ray resolved from its
        object store."""
        out = self.worker.backend.forward_stage(batch, hidden, name)
        return out if self.worker.answers or not self.worker.backend.stage.last else None

    def node(self) -> str:
        return _ray().get_runtime_context().get_node_id()


class RayExecutor(Executor):
    """The ranks as Ray actors on the engine's node."""

    kind = "ray"

    def __init__(
        self, cfg: ModelConfig, weights, engine_config, backend="numpy", timeout: float = 60.0
    ):
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slot = self._plan(cfg, engine_config, timeout, backend)
        if not ray.is_initialized():
            address = engine_config.ray_address or os.environ.get("RAY_ADDRESS")
            # a new local instance gets a logical CPU per rank at least (a CPU is a label to
            # Ray: the ranks share this host's cores, as the mp executor's do)
            cpus = None if address else max(os.cpu_count() or 1, self.world)
            ray.init(address=address, num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        self.ray = ray
        bundle = {"CPU": 1, "GPU": 1} if backend == "cuda" else {"CPU": 1}
        self.pg = placement_group([bundle] * self.world, strategy="PACK")
        numpy_ranks = backend == "numpy"  # the GPU backend's ranks have NCCL instead
        self.comms = [ShmComm(self.tp, slot, timeout) for _ in range(self.pp) if numpy_ranks]
        self.actors: list = []
        self._finalizer = weakref.finalize(
            self, _stop, ray, self.actors, self.pg, remove_placement_group, self.comms,
            self.nccl_ids,
        )  # fmt: skip
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout)
        if not ready:
            self._finalizer()
            free = ray.available_resources()
            have = ", ".join(f"{free.get(k, 0):g} {k}" for k in bundle)
            raise RuntimeError(
                f"ray: no room for {self.world} ranks of {bundle} each ({have} free)"
            )
        plan = dict(tp=self.tp, pp=self.pp, world=self.world, comms=self.comms, links={})
        plan["output_rank"], plan["backend"] = self.output_rank, backend
        actor = ray.remote(num_cpus=1, num_gpus=bundle.get("GPU", 0))(RayWorker)
        weights_ref = ray.put(weights)
        for rank in range(self.world):
            place = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
            self.actors.append(
                actor.options(scheduling_strategy=place, name=None).remote(
                    rank, plan, cfg, weights_ref, engine_config
                )
            )
        nodes = self._gather([a.node.remote() for a in self.actors], "starting", START_TIMEOUT)
        here = ray.get_runtime_context().get_node_id()
        away = [r for r, n in enumerate(nodes) if n != here]
        if away and numpy_ranks:
            self._finalizer()
            raise ValueError(
                f"ray placed ranks {away} on another node; the shared-memory all-reduce needs "
                "every rank on the engine's node (NCCL across nodes is not built)"
            )
        self._started()

    def _call(self, name: str, *args, all_ranks: bool = False):
        results = self._gather([a.call.remote(name, args) for a in self.actors], name)
        return results if all_ranks else results[self.output_rank]

    def forward(self, batch):
        return self._staged("forward", batch) if self.pp > 1 else self._call("forward", batch)

    def forward_greedy(self, batch):
        if self.pp > 1:
            return self._staged("forward_greedy", batch)
        return self._call("forward_greedy", batch)

    def hidden_states(self, batch):
        """The pooling runner's rows (stage by stage with pipeline parallel)."""
        if self.pp > 1:
            return self._staged("hidden_states", batch)
        return self._call("hidden_states", batch)

    def _staged(self, name: str, batch):
        """A step stage by stage: every call goes out at once, each rank of stage s + 1 taking
        the object ref of the same tensor-parallel rank's output in stage s (Ray starts it when
        that is ready and hands it over in its object store); the output rank's answer."""
        batch_ref, tp = self.ray.put(batch), self.tp
        hidden, refs = [None] * tp, []
        for s in range(self.pp):
            ranks = self.actors[s * tp : (s + 1) * tp]
            hidden = [
                a.stage.remote(name, batch_ref, h) for a, h in zip(ranks, hidden, strict=True)
            ]
            refs += hidden
        return self._gather(refs, name)[self.output_rank]

    def _gather(self, refs: list, what: str, timeout: float | None = None) -> list:
        """Each rank's answer, in rank order; RuntimeError naming the first rank that raised,
        died or did not answer in ``timeout`` seconds (the executor's own by default)."""
        ray, pending, results = self.ray, {ref: r for r, ref in enumerate(refs)}, {}
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(left, 0))
            if not ready:
                self._fail(min(pending.values()), f"no answer to {what} in {timeout:g} s")
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    self._fail(rank, "its actor died")
                except ray.exceptions.RayTaskError as e:
                    cause = e.cause if e.cause is not None else e
                    self._fail(rank, f"{type(cause).__name__}: {cause}")
        return [results[r] for r in range(len(refs))]

    def _fail(self, rank: int, why: str):
        self._finalizer()
        raise RuntimeError(f"{self._where(rank)}: {why}")


def _stop(ray, actors: list, pg, remove_placement_group, comms: list[ShmComm], nccl_ids) -> None:
    """Kill every actor, free the placement group, remove the shared blocks (the numpy ranks'
    ShmComm; the emulated NCCL's, which a killed first rank leaves behind)."""
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already gone
            pass
    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - the cluster is gone
        pass
    for comm in comms:
        comm.close()
    for commId in nccl_ids:
        remove_block(commId)
