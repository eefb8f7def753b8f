"""A sync-free update (``perf.sync_free=true``) reads nothing on the host, in every precision mode.

Counted with a TorchDispatchMode (``dispatch_count.py``), which sees the reads that a
TorchFunctionMode misses: a 0-dim device tensor handed to a foreach op's Scalar overload. The
recorded (graph-safe) update is counted in ``test_graphs.py``. Growth checks -- one host read per
``lowp.growth_interval`` clean steps, by design -- are set out of reach here.
"""

from __future__ import annotations

import pytest
import torch
from dispatch_count import DispatchCount
from test_module import fit, make_batch, make_module, mode

MODES = ["fp32", "fp16", "fp16-six", "bf16", "amp"]
SYNC_FREE = [
    "perf.sync_free=true",
    "perf.aug_backend=index",
    "lowp.growth_interval=1000",
    "train.log_every_updates=1000",
]


def count_updates(module) -> list[tuple[str, DispatchCount]]:
    """Wrap ``module.update`` so that each call is counted: ``(kind, count)`` per update."""
    counts = []
    update = module.update

    def counted(batch, with_actor, with_target):
        with DispatchCount() as count:
            metrics = update(batch, with_actor, with_target)
        counts.append(("full" if with_actor else "critic-only", count))
        return metrics

    module.update = counted
    return counts


def overflowing_batch(seed: int) -> dict[str, torch.Tensor]:
    """A reward whose squared TD error overflows fp16: the loss scalers must skip on the device."""
    batch = make_batch(seed=seed)
    batch["reward"].fill_(3e4)
    return batch


def test_the_counter_sees_a_read_inside_a_foreach_op():
    """The counter can fail: a 0-dim tensor picks ``_foreach_add_``'s Scalar overload, which reads it."""
    with DispatchCount() as count:
        torch._foreach_add_([torch.zeros(3)], torch.ones(()))
        torch.ones(()).item()
    assert count.host_reads == 2, count.ops


@pytest.mark.parametrize("precision", MODES)
def test_a_sync_free_update_reads_nothing_on_the_host(precision):
    """Critic-only and full (critic + actor + temperature) updates, before and after a loss-scale
    rescale has made ε a device tensor, and a skipped step in the loss-scaled modes."""
    torch.manual_seed(0)
    module = make_module(*mode(precision), *SYNC_FREE)
    counts = count_updates(module)
    scaled = precision in ("fp16", "fp16-six", "amp")
    batches = [make_batch(seed=i) for i in range(4)]
    if scaled:
        batches[2:2] = [overflowing_batch(10), make_batch(seed=11)]
    fit(module, batches)

    assert {kind for kind, _ in counts} == {"full", "critic-only"}
    reads = [(kind, count.host_reads, dict(count.read_sites)) for kind, count in counts]
    assert all(n == 0 for _, n, _ in reads), reads
    if scaled:
        assert module.skipped["critic"] >= 1, module.skipped  # the overflow was met, and skipped


def test_a_sync_free_update_with_kornia_reads_nothing_on_the_host():
    """The default shift on CUDA (kornia's warp) inside a whole fp16 update."""
    torch.manual_seed(0)
    module = make_module("precision=fp16", *SYNC_FREE, "perf.aug_backend=kornia")
    counts = count_updates(module)
    fit(module, [make_batch(seed=i) for i in range(2)])
    assert module.augment.backend == "kornia"
    reads = [(kind, count.host_reads, dict(count.read_sites)) for kind, count in counts]
    assert len(reads) == 2 and all(n == 0 for _, n, _ in reads), reads
