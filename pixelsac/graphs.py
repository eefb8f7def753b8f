"""CUDA graphs for the update step (``perf.cuda_graphs``).

A DrQ update at batch 512 launches a few thousand small kernels (three losses, their backward
passes, three optimizer steps over tens of parameter tensors, the target update). On a fast GPU
the launches, not the arithmetic, bound the step. A CUDA graph records those launches once and
replays them with one call. That needs an update that never waits for the host, and tensors at
fixed addresses, which the rest of pixelsac already arranges:

* ``perf.sync_free``: loss-scale skips, counters and the target's K·θ check stay on the device;
  hAdam and torch Adam are capturable (step counts on the device);
* the random shift (either ``perf.aug_backend``) draws its offsets on the device;
* the batch is copied into static input tensors before each replay.

Each distinct kind of update -- critic only, or critic + actor + temperature, with or without
the target update -- gets its own graph, captured after ``warmup_updates`` eager updates of that
kind (real updates, on a side stream, as capture requires: lazily created state and library
workspaces exist before recording). The graphs share one memory pool; everything that must live
between replays (weights, optimizer state, loss scales, skip counts, the losses handed to logging)
is allocated outside it. Under capture the update leaves out what a replay cannot do: Lightning's
optimizer wrappers and hooks (the module steps the torch optimizers itself) and the loss
scalers' host half -- counting steps and, once per ``growth_interval``, the growth check --
which runs after each replay.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_NEEDS = "perf.cuda_graphs needs"  # how every conflict message starts


def graph_conflicts(cfg: Any, device_type: str, world_size: int) -> str | None:
    """Why ``perf.cuda_graphs`` cannot run with this configuration, or None when it can."""
    from pixelsac.precision import PrecisionPolicy

    if device_type != "cuda":
        return f"{_NEEDS} a CUDA device (training runs on {device_type}); set perf.cuda_graphs=false"
    if world_size > 1:
        return (
            f"{_NEEDS} one device: DDP's gradient all-reduce runs from autograd hooks outside a "
            "capturable step; set perf.cuda_graphs=false or trainer.devices=1"
        )
    policy = PrecisionPolicy.from_config(cfg, device_type)
    if not policy.sync_free:
        return f"{_NEEDS} perf.sync_free (a captured step cannot read the device from the host)"
    if policy.mode == "amp":
        return (
            f"{_NEEDS} pure fp16, bf16 or fp32: AMP's GradScaler keeps Python-side state per step; "
            "use precision=fp16 (pure fp16 with the six modifications)"
        )
    if policy.loss_scaling and not policy.hadam:
        return (
            f"{_NEEDS} hAdam when loss scaling is on: only its step skips on the device "
            "(lowp.hadam=true or lowp.loss_scaling=false)"
        )
    if cfg.perf.get("compile") and cfg.perf.get("compile_mode") in ("reduce-overhead", "max-autotune"):
        return f"{_NEEDS} perf.compile_mode without CUDA graphs of its own (default or max-autotune-no-cudagraphs)"
    return None


def update_cycle(actor_every: int, target_every: int) -> int:
    """Updates after which the schedule of update kinds repeats: the critic runs every update,
    the actor and temperature every ``actor_every``-th, the target update every
    ``target_every``-th. Timing whole cycles times the kinds in a run's own proportions (DrQ:
    critic-only and full updates 1:1)."""
    return math.lcm(max(int(actor_every), 1), max(int(target_every), 1))


def updates_to_capture(actor_every: int, target_every: int, warmup_updates: int, start: int = 0) -> int:
    """How many updates, from update number ``start``, until every kind of update has run its
    ``warmup_updates`` eager updates and its capture (:class:`UpdateGraphs`): from then on every
    update is a replay. Timing must start after these, or it times eager and capturing updates."""
    kinds = {
        (u % actor_every == 0, u % target_every == 0)
        for u in range(start, start + update_cycle(actor_every, target_every))
    }
    seen: dict[tuple[bool, bool], int] = {}
    count = 0
    while any(seen.get(kind, 0) <= max(int(warmup_updates), 1) for kind in kinds):
        u = start + count
        kind = (u % actor_every == 0, u % target_every == 0)
        seen[kind] = seen.get(kind, 0) + 1
        count += 1
    return count


class GraphRunner:
    """Records a function into a CUDA graph and replays it (the one part that needs a GPU)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.side_stream = torch.cuda.Stream()

    def eager(self, fn: Any) -> Any:
        """Run ``fn`` on a side stream, as warm-up before capture must."""
        self.side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side_stream):
            result = fn()
        torch.cuda.current_stream().wait_stream(self.side_stream)
        return result

    def capture(self, fn: Any) -> Any:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph

    @staticmethod
    def replay(graph: Any) -> None:
        graph.replay()

    def pool_bytes(self) -> int:
        """Bytes the graphs' private memory pool holds (reserved for replays, which allocate
        nothing through the caching allocator, so ``max_memory_allocated`` never sees them)."""
        pool = tuple(self.pool)
        return sum(
            int(segment["total_size"])
            for segment in torch.cuda.memory_snapshot()
            if tuple(segment.get("segment_pool_id", ())) == pool
        )


class UpdateGraphs:
    """Runs a :class:`~pixelsac.module.SACModule`'s updates as replays of captured graphs.

    Args:
        module: the module whose ``update(batch, with_actor, with_target)`` is recorded.
        warmup_updates: eager updates of each kind before its graph is captured.
        runner: what records and replays (``GraphRunner`` on a GPU; tests pass a stand-in).
    """

    def __init__(self, module: Any, warmup_updates: int = 3, runner: Any = None) -> None:
        self.module = module
        self.warmup_updates = max(int(warmup_updates), 1)
        self._runner = runner
        self.graphs: dict[tuple[bool, bool], Any] = {}
        self.outputs: dict[tuple[bool, bool], dict[str, torch.Tensor]] = {}
        self.eager_updates: dict[tuple[bool, bool], int] = {}
        self.static_batch: dict[str, torch.Tensor] | None = None
        self.last_update: str | None = None  # "eager", "capture" or "replay": what the last run() did

    @property
    def runner(self) -> Any:
        if self._runner is None:
            self._runner = GraphRunner()
        return self._runner

    def run(self, batch: dict[str, torch.Tensor], with_actor: bool, with_target: bool) -> dict[str, torch.Tensor]:
        """One update on ``batch``; returns its losses (tensors that the next replay overwrites)."""
        kind = (with_actor, with_target)
        if self.static_batch is None:
            self.static_batch = {k: torch.empty_like(v) for k, v in batch.items()}
        for key, value in batch.items():
            self.static_batch[key].copy_(value, non_blocking=True)

        if kind not in self.graphs:
            if self.eager_updates.get(kind, 0) < self.warmup_updates:
                self.eager_updates[kind] = self.eager_updates.get(kind, 0) + 1
                metrics = self.runner.eager(lambda: self.module.update(self.static_batch, *kind))
                if kind not in self.outputs:  # allocated outside the graphs' pool: lives between replays
                    self.outputs[kind] = {k: v.detach().clone() for k, v in metrics.items()}
                else:
                    for k, v in metrics.items():
                        self.outputs[kind][k].copy_(v)
                self.last_update = "eager"
                return self.outputs[kind]
            self.graphs[kind] = self.runner.capture(lambda: self._recorded_update(kind))
            self.last_update = "capture"  # capturing, then the first replay: not a replay's time
        else:
            self.last_update = "replay"
        self.runner.replay(self.graphs[kind])
        self._count_host_steps(with_actor)
        return self.outputs[kind]

    @property
    def replaying(self) -> bool:
        """Whether the last update was a plain replay (not a warm-up or a capture)."""
        return self.last_update == "replay"

    def pool_bytes(self) -> int | None:
        """Bytes held by the graphs' memory pool (0 before a capture, or with a stand-in runner;
        None where the allocator's snapshot cannot say: a figure, never a reason to fail)."""
        if not self.graphs or not hasattr(self.runner, "pool_bytes"):
            return 0
        try:
            return int(self.runner.pool_bytes())
        except Exception:  # the snapshot's layout is torch's private business
            return None

    def _recorded_update(self, kind: tuple[bool, bool]) -> None:
        metrics = self.module.update(self.static_batch, *kind)
        for key, value in metrics.items():
            self.outputs[kind][key].copy_(value)

    def _count_host_steps(self, with_actor: bool) -> None:
        """What a replay cannot do: the compound scalers' step counting and growth checks."""
        from pixelsac.lowp import CompoundLossScaler

        optimizers = [getattr(opt, "optimizer", opt) for opt in self.module.optimizers()]
        names = ("critic", "actor", "alpha") if with_actor else ("critic",)
        for name, optimizer in zip(("critic", "actor", "alpha"), optimizers):
            scaler = self.module.scalers.get(name)
            if name in names and isinstance(scaler, CompoundLossScaler):
                scaler.count_step(optimizer)
