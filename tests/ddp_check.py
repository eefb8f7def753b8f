"""Test helper: run pixelsac.train under DDP and, on every rank, save that rank's weights and
counters at the end (``<dump_dir>/rank<r>.pt``). With ``POISON_UPDATE=k`` rank 1 alone sets one
critic gradient to inf right before the critic scaler's overflow check at update k -- after
DDP has averaged the gradients, so only the scaler's all-reduced flag can make rank 0 skip too.

``NO_REDUCE=1`` turns the scalers' all-reduce off (a negative control: the replicas diverge).

Lightning's DDP launcher re-runs this same script for rank 1, so the patches apply on all ranks.
"""

import os
import sys
from pathlib import Path

import lightning as L
import torch

import pixelsac.run as run_mod
import pixelsac.train as train_mod
from pixelsac import lowp

dump_dir = Path(os.environ["DUMP_DIR"])
poison_update = int(os.environ.get("POISON_UPDATE", "-1"))


class DumpRankState(L.Callback):
    def on_train_end(self, trainer, module):
        torch.save(
            {
                "state_dict": module.state_dict(),
                "updates": module.updates,
                "skipped": dict(module.skipped),
                "scales": module.loss_scales(),
                "env_frames": self.collector.env_frames,
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
    real_step = lowp.CompoundLossScaler.step

    def poisoned_step(scaler, optimizer, reduce_found_inf=None):
        if run.trainer.global_rank == 1 and module.updates == poison_update and scaler is module.scalers["critic"]:
            next(p for g in optimizer.param_groups for p in g["params"] if p.grad is not None).grad[0] = float("inf")
        return real_step(scaler, optimizer, reduce_found_inf)

    lowp.CompoundLossScaler.step = poisoned_step
    if os.environ.get("NO_REDUCE") == "1":  # negative control: each rank decides alone
        module._reduce_found_inf = lambda: None
    return run


run_mod.build_run = build_run
sys.exit(train_mod.main(sys.argv[1:]))
