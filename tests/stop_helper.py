"""Test helper: ``python tests/stop_helper.py KEY=VALUE...`` runs pixelsac.train with hooks that
make a stop happen at a chosen point. Lightning's DDP launcher re-runs this script for the other
ranks, so the hooks (set through the environment) apply on every rank.

Environment variables, all optional:

``MARK_FILE`` + ``MARK_UPDATES``
    write the number of updates done into MARK_FILE once MARK_UPDATES updates are done (rank 0);
    the test then sends the signal from outside.
``UPDATE_SLEEP``
    seconds to sleep after every update once the mark is written, so that a signal from outside
    lands within a few updates of it however busy the machine is.
``SELF_SIGNAL=SIGTERM@6@1``
    after update 6, rank 1 sends itself SIGTERM (without ``@rank``: rank 0).
``SIGNAL_AT_SETUP=SIGTERM``
    send it to ourselves while the Trainer sets up, before any agent step.
``SIGNAL_AT_EVAL=SIGTERM``
    send it to ourselves as the first evaluation starts (rank 0).
``SIGNAL_DURING_SAVE=SIGINT@2x2``
    send SIGINT twice to ourselves while the 2nd ``last.ckpt`` is written: after its temporary
    file is complete, before the rename that makes it the checkpoint.
``EVAL_RESULTS_ON_WAIT=1``
    with ``train.eval_in_worker``: take the worker's results only where the run waits for them
    (before the next evaluation, at the end), never as they arrive, so that a checkpoint written
    after an evaluation began surely holds it in flight.
``DUMP_DIR``
    every rank writes ``pid-rank<r>`` at start, ``rank<r>.pt`` (weights, updates, env frames) at
    the end of training, and ``exit-rank<r>`` (its exit code) at exit.
"""

import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from marks import write_whole  # this script's folder is on sys.path
from overrides import merged

import pixelsac.callbacks as callbacks
import pixelsac.run as run_mod
import pixelsac.train as train_mod

env = os.environ
dump_dir = Path(env["DUMP_DIR"]) if env.get("DUMP_DIR") else None
rank = int(env.get("LOCAL_RANK", "0"))  # set by Lightning's launcher for the ranks it starts
signum = lambda name: int(signal.Signals[name])  # noqa: E731


class Hooks(L.Callback):
    def __init__(self, collector):
        self.collector = collector
        self.marked = False
        self.self_signal = env.get("SELF_SIGNAL", "").split("@")

    def setup(self, trainer, module, stage):
        if dump_dir is not None:
            write_whole(dump_dir / f"pid-rank{trainer.global_rank}", str(os.getpid()))
        if env.get("SIGNAL_AT_SETUP"):
            os.kill(os.getpid(), signum(env["SIGNAL_AT_SETUP"]))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if env.get("MARK_FILE") and not self.marked and module.updates >= int(env["MARK_UPDATES"]):
            self.marked = True
            if trainer.global_rank == 0:  # every rank writing one file raced on its partial name
                write_whole(Path(env["MARK_FILE"]), str(module.updates))
        if len(self.self_signal) >= 2 and module.updates == int(self.self_signal[1]):
            target = int(self.self_signal[2]) if len(self.self_signal) > 2 else 0
            if trainer.global_rank == target:
                os.kill(os.getpid(), signum(self.self_signal[0]))
        if env.get("UPDATE_SLEEP") and self.marked:
            time.sleep(float(env["UPDATE_SLEEP"]))

    def on_train_end(self, trainer, module):
        if dump_dir is not None:
            torch.save(
                {"state_dict": module.state_dict(), "updates": module.updates, "env_frames": self.collector.env_frames},
                dump_dir / f"rank{trainer.global_rank}.pt",
            )


real_build = run_mod.build_run


def build_run(cfg, resume_from=None, **kwargs):
    run = real_build(cfg, resume_from, **kwargs)
    run.trainer.callbacks.append(Hooks(run.collector))
    return run


run_mod.build_run = build_run

if env.get("SIGNAL_AT_EVAL"):
    real_episodes = callbacks.run_episodes
    evals = {"started": 0}

    def run_episodes(*args, **kwargs):
        evals["started"] += 1
        if evals["started"] == 1:
            os.kill(os.getpid(), signum(env["SIGNAL_AT_EVAL"]))
        return real_episodes(*args, **kwargs)

    callbacks.run_episodes = run_episodes

if env.get("SIGNAL_DURING_SAVE"):
    name, _, plan = env["SIGNAL_DURING_SAVE"].partition("@")
    nth, _, times = plan.partition("x")
    real_replace = callbacks._fsync_and_replace
    saves = {"last.ckpt": 0}

    def signalling_replace(tmp: Path, path: Path) -> None:
        if path.name == "last.ckpt":
            saves["last.ckpt"] += 1
            if saves["last.ckpt"] == int(nth):
                for _ in range(int(times or 1)):
                    os.kill(os.getpid(), signum(name))
        real_replace(tmp, path)

    callbacks._fsync_and_replace = signalling_replace

if env.get("EVAL_RESULTS_ON_WAIT"):
    real_collect = callbacks.Evaluator._collect
    callbacks.Evaluator._collect = lambda self, trainer, wait: real_collect(self, trainer, wait) if wait else None

if __name__ == "__main__":  # the evaluation worker (spawn) imports this module again
    code = train_mod.main(merged(*sys.argv[1:]))
    if dump_dir is not None:
        write_whole(dump_dir / f"exit-rank{rank}", str(code))
    sys.exit(code)
