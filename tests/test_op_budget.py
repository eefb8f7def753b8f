"""The op budget of a sync-free update on a GPU, counted on the CPU (HAdam's docstring).

A GPU pays a kernel launch (5-10 µs of host time) per op, so an update that dispatches thousands
of small ops is slower than fp32 before any arithmetic. Counted here with a TorchDispatchMode
(``dispatch_count.py``: every aten op the Python code issues, views included, a foreach op
once) in the GPU's settings: hAdam on whole buckets (``chunk_numel=None``, what
``HAdam.chunk_for("cuda")`` picks), the finiteness checks in their foreach form, no
tensor-core emulation. The networks are DrQ's at a small image size: the op count depends on how
many parameter tensors there are, not on their sizes.
"""

from __future__ import annotations

import pytest
import torch
from dispatch_count import DispatchCount
from test_module import fit, make_batch, make_module, mode

import pixelsac.lowp.finite as finite
from pixelsac.lowp import HAdam

# a whole fp16 update; a critic-only one. The full-size fixes cost ~80 of them (the adaptive
# target scale ~25, Q in fp32 ~30, the loss scalers' overflow records ~7 a step)
FULL_BUDGET, CRITIC_BUDGET = 1_550, 700
FP32_FULL = 612  # fp32's full update, for scale (fused torch Adam: one op per step)


def step_budget(n_params: int) -> int:
    """hAdam's budget for one sync-free step of a bucket of ``n_params`` parameters."""
    return 180 + 6 * n_params


def count_update_ops(precision: str, chunk_numel: int | None, monkeypatch) -> tuple[list, list]:
    """Ops of each update (after the first of its kind, which also creates optimizer state) and
    of each hAdam step: ``[(kind, ops)]``, ``[(parameters, ops)]``."""
    monkeypatch.setattr(finite, "foreach_by_default", lambda device: True)  # as on a GPU
    torch.manual_seed(0)
    module = make_module(
        *mode(precision),
        "perf.sync_free=true",
        "perf.aug_backend=index",
        "lowp.fp32_accumulate=false",
        "lowp.growth_interval=1000",
        "train.log_every_updates=1000",
    )
    updates, steps = [], []
    update = module.update

    def counted(batch, with_actor, with_target, graph_safe=False):
        for optimizer in module.optimizers():
            optimizer = getattr(optimizer, "optimizer", optimizer)
            if isinstance(optimizer, HAdam):
                optimizer.chunk_numel = chunk_numel
        with DispatchCount() as count:
            metrics = update(batch, with_actor, with_target, graph_safe)
        updates.append(("full" if with_actor else "critic-only", count.total))
        return metrics

    hadam_step = HAdam.step

    def counted_step(self, *args, **kwargs):
        with DispatchCount() as count:
            result = hadam_step(self, *args, **kwargs)
        steps.append((sum(p.grad is not None for g in self.param_groups for p in g["params"]), count.total))
        return result

    module.update = counted
    monkeypatch.setattr(HAdam, "step", counted_step)
    fit(module, [make_batch(seed=i) for i in range(4)])
    return updates[2:], steps[4:]  # updates 0 and 1 made the state of each kind


@pytest.mark.parametrize("precision", ["fp16", "fp16-six", "bf16"])
def test_a_gpu_sized_update_stays_within_its_op_budget(precision, monkeypatch):
    updates, steps = count_update_ops(precision, None, monkeypatch)
    budget = {"full": FULL_BUDGET, "critic-only": CRITIC_BUDGET}
    assert {kind for kind, _ in updates} == {"full", "critic-only"}
    assert all(ops <= budget[kind] for kind, ops in updates), updates
    assert steps and all(ops <= step_budget(n) for n, ops in steps), steps
    print(f"{precision}: {updates}, hAdam steps (parameters, ops) {steps}; fp32 full update {FP32_FULL}")


def test_cpu_sized_chunks_would_break_the_budget(monkeypatch):
    """The budget can fail: chunks far smaller than the parameters (as 2^18 is for DrQ's 84×84
    critic, whose trunk alone has 2M weights) cost ~30 ops each."""
    updates, steps = count_update_ops("fp16", 64, monkeypatch)
    full = [ops for kind, ops in updates if kind == "full"]
    assert full and min(full) > 3 * FULL_BUDGET, updates
    assert any(ops > step_budget(n) for n, ops in steps), steps
