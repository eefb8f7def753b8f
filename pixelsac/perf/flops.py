"""The arithmetic of one update: floating-point operations of its convolutions and matmuls.

What a GPU's time per update can at best be is the update's arithmetic over the rate the
hardware sustains: ``ms ≥ GFLOP / TFLOP/s``. :func:`count_update_flops` counts the arithmetic;
the benchmark divides it by each cell's measured time (achieved TFLOP/s, a column of
``pixelsac-bench``), so a GPU figure says how far it is from the hardware, and a CPU can say what
a goal in ms asks of a GPU before one is at hand.

Counted, with :class:`torch.utils.flop_counter.FlopCounterMode`: every convolution (forward and
both gradients), ``mm``, ``addmm`` and ``bmm``, at 2 FLOPs per multiply-add (a convolution of
``C_in → C_out`` channels with a ``k×k`` kernel over an ``H×W`` output: ``2·C_in·k²·C_out·H·W`` per
image forward; its backward twice that, less the input's gradient at the first layer). Not
counted: elementwise work (augmentation, activations, losses, the optimizers and the target
update), which moves memory rather than computing; on a GPU it is bounded by bandwidth, not by
this figure.

The count is exact and cheap because the arithmetic is linear in the batch: every product has
the batch (times the augmented copies) as one of its dimensions, so an update of batch ``B``
does ``B / b`` times what one of batch ``b`` does. The agent is built at its configured widths,
image size and copies, counted at batch :data:`COUNT_BATCH` on a CPU in fp32 (about two
seconds at DrQ's sizes, building the agent included) and scaled; tests/test_flops.py holds the
scaling exact and the count equal in every precision mode (fp16, bf16 and AMP do the same
products in other dtypes; the CPU's tensor-core emulation, ``lowp.fp32_accumulate``, is left
out, as it computes weight gradients the actor's step then drops).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from typing import Any

from torch.utils.flop_counter import FlopCounterMode

from pixelsac.graphs import update_cycle
from pixelsac.perf.calibration import metered_updates, without_log_intervals

#: The batch the update is counted at (then scaled to the configured one).
COUNT_BATCH = 2


@dataclasses.dataclass
class UpdateFlops:
    """FLOPs of one update of each kind at ``batch_size``, and their mean over an update cycle."""

    batch_size: int
    full: int  # critic, actor and temperature (and the target, which computes no product)
    critic_only: int
    cycle: int  # one whole update cycle (graphs.update_cycle), every update of it
    cycle_updates: int
    full_by_op: dict[str, int]  # "convolution", "convolution_backward", "addmm", "mm", "bmm"

    @property
    def per_update(self) -> float:
        """The mean over one update cycle: what ms/update divides."""
        return self.cycle / self.cycle_updates

    @property
    def gflop_per_update(self) -> float:
        return self.per_update / 1e9

    def achieved_tflops(self, ms_per_update: float) -> float:
        """The rate an update of ``ms_per_update`` ms sustains, in TFLOP/s (GFLOP per ms)."""
        return self.gflop_per_update / ms_per_update

    def at_batch(self, batch_size: int) -> UpdateFlops:
        """The same update at ``batch_size`` (exact: every count is the batch times a whole number)."""

        def scaled(flops: int) -> int:
            return flops * batch_size // self.batch_size

        return UpdateFlops(
            batch_size=batch_size,
            full=scaled(self.full),
            critic_only=scaled(self.critic_only),
            cycle=scaled(self.cycle),
            cycle_updates=self.cycle_updates,
            full_by_op={op: scaled(n) for op, n in self.full_by_op.items()},
        )

    def floor_ms(self, tflops: float) -> float:
        """The time an update cannot beat at a sustained ``tflops`` TFLOP/s, in ms."""
        return self.gflop_per_update / tflops


def counting_form(
    config: dict[str, Any], count_batch: int = COUNT_BATCH, keep_precision: bool = False
) -> dict[str, Any]:
    """``config`` (plain data) as it is counted: fp32 (unless ``keep_precision``), eager and
    uncompiled, at batch ``count_batch``; widths, copies and the update schedule as configured.
    The caller's dict is left as it is."""
    config = copy.deepcopy(dict(config))
    if not keep_precision:
        config["precision"] = "fp32"
    # compiled or graphed, the same products run; eager, nothing is compiled on the CPU to count them
    config["perf"] = {**(config.get("perf") or {}), "compile": False, "compile_optimizer": False, "cuda_graphs": False}
    config["agent"] = {**config["agent"], "batch_size": int(count_batch)}
    return without_log_intervals(config)


def count_update_flops(
    config: dict[str, Any],
    obs_shape: tuple[int, ...],
    action_dim: int,
    count_batch: int = COUNT_BATCH,
    keep_precision: bool = False,
) -> UpdateFlops:
    """FLOPs of the update ``config`` (plain data) describes, at its ``agent.batch_size``: one
    update cycle of a fresh agent counted at batch ``count_batch`` on a CPU, in fp32 unless
    ``keep_precision``, and scaled (module docstring). The caller's random streams are left as
    they were."""
    batch_size = int(config["agent"]["batch_size"])
    counted_config = counting_form(config, count_batch, keep_precision)
    agent = counted_config["agent"]
    cycle = update_cycle(int(agent["actor_update_every"]), int(agent["critic_target_update_every"]))
    metered = metered_updates(
        counted_config, tuple(obs_shape), action_dim, cycle, lambda: FlopCounterMode(display=False)
    )
    counted = [
        (full, Counter({str(op).removeprefix("aten."): n for op, n in meter.get_flop_counts()["Global"].items()}))
        for full, meter in metered
    ]

    full = {sum(c.values()) for with_actor, c in counted if with_actor}
    critic = {sum(c.values()) for with_actor, c in counted if not with_actor}
    if len(full) > 1 or len(critic) > 1:  # the same products every time, or the count is wrong
        raise RuntimeError(f"updates of one kind counted different FLOPs: full {full}, critic-only {critic}")
    full_by_op = next((c for with_actor, c in counted if with_actor), Counter())
    at_count_batch = UpdateFlops(
        batch_size=count_batch,
        full=full.pop() if full else 0,
        critic_only=critic.pop() if critic else 0,
        cycle=sum(sum(c.values()) for _, c in counted),
        cycle_updates=len(counted),
        full_by_op=dict(sorted(full_by_op.items())),
    )
    return at_count_batch.at_batch(batch_size)
