"""Test helper: run pixelsac.train under DDP and, on every rank, save that rank's weights and
counters at the end (``<dump_dir>/rank<r>.pt``). With ``POISON_UPDATE=k`` rank 1 alone sets one
critic gradient to inf right before the critic scaler's overflow check at update k -- after
DDP has averaged the gradients, so only the scaler's all-reduced flag can make rank 0 skip too.

``NO_REDUCE=1`` turns the scalers' all-reduce off (a negative control: the replicas diverge).

Every rank also counts the ``torch.distributed.barrier`` and ``all_reduce`` calls made inside
``SACModule.update`` (``barriers_in_updates``, ``all_reduces_in_updates`` in the dump).

Lightning's DDP launcher re-runs this same script for rank 1, so the patches apply on all ranks.
"""

import os
import sys
from pathlib import Path

import lightning as L
import torch
from overrides import merged  # this script's folder is on sys.path

import pixelsac.run as run_mod
import pixelsac.train as train_mod
from pixelsac import lowp

dump_dir = Path(os.environ["DUMP_DIR"])
poison_update = int(os.environ.get("POISON_UPDATE", "-1"))


calls_in_updates = {"barrier": 0, "all_reduce": 0}
inside_update = [False]


def counted(name):
    real = getattr(torch.distributed, name)

    def call(*args, **kwargs):
        if inside_update[0]:
            calls_in_updates[name] += 1
        return real(*args, **kwargs)

    setattr(torch.distributed, name, call)


counted("barrier")
counted("all_reduce")


class DumpRankState(L.Callback):
    def on_train_end(self, trainer, module):
        torch.save(
            {
                "state_dict": module.state_dict(),
                "updates": module.updates,
                "skipped": dict(module.skipped),
                "scales": module.loss_scales(),
                "env_frames": self.collector.env_frames,
                "barriers_in_updates": calls_in_updates["barrier"],
                "all_reduces_in_updates": calls_in_updates["all_reduce"],
            },
            dump_dir / f"rank{trainer.global_rank}.pt",
        )


real_build = run_mod.build_run


def build_run(cfg, resume_from=None, **kwargs):
    run = real_build(cfg, resume_from, **kwargs)
    dump = DumpRankState()
    dump.collector = run.collector
    run.trainer.callbacks.append(dump)
    module = run.module
    real_check = lowp.CompoundLossScaler._check_gradients

    def poisoned_check(scaler, optimizer):  # after the step's backward, before its check
        if run.trainer.global_rank == 1 and module.updates == poison_update and scaler is module.scalers["critic"]:
            next(p for g in optimizer.param_groups for p in g["params"] if p.grad is not None).grad[0] = float("inf")
        return real_check(scaler, optimizer)

    lowp.CompoundLossScaler._check_gradients = poisoned_check
    real_update = module.update

    def update(*args, **kwargs):
        inside_update[0] = True
        try:
            return real_update(*args, **kwargs)
        finally:
            inside_update[0] = False

    module.update = update
    if os.environ.get("NO_REDUCE") == "1":  # negative control: each rank decides alone
        module._reduce_found_inf = lambda: None
    return run


if __name__ == "__main__":  # an env worker, started by spawn, imports this script again
    run_mod.build_run = build_run
    sys.exit(train_mod.main(merged(*sys.argv[1:])))
