#!/usr/bin/env python
"""Where the wall time of a training run goes: one ``python -m pixelsac.train`` run in this
process, with exclusive timers around the parts of the loop.

    .venv/bin/python tools/profile_run.py [--out FILE.json] -- KEY=VALUE ...   # training overrides

Each timed part counts its own time only: time spent in a timed part it calls is that part's
(an evaluation episode's renders are "render (eval)", not "evaluation"), so the rows add up to
the wall time, and "the rest" -- Lightning's per-step loop, the progress bar, data-loader
plumbing, start-up -- is what no timer covered. Timers cost ~1 µs per call; nothing else is
changed, so the run's results are those of the same command without the profiler.

Parts: the gradient update (``SACModule.training_step``), the policy forward pass for acting
(``SACModule.act``), rendering (``DMCEnv._render_hwc``), physics and the rest of an env step
(``DMCEnv.step``/``reset`` less rendering), replay writes and sampling, evaluation episodes
(``run_episodes`` less their acting and rendering), checkpoint writes, and the logging callbacks.
Collection and evaluation are told apart for acting and rendering. Environments in worker
processes (``env.num_envs`` > 1, ``train.overlap_collection``) render and step there: this
process sees the time it waits for them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class ExclusiveTimers:
    """Exclusive wall time per label: a timed call pauses its caller's clock."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[list[Any]] = []  # [label, start, time taken by timed callees]
        self.in_eval = 0

    def wrap(self, owner: Any, name: str, label: str | Callable[[], str]) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            tag = label() if callable(label) else label
            frame = [tag, time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return original(*args, **kwargs)
            finally:
                self._stack.pop()
                elapsed = time.perf_counter() - frame[1]
                self.seconds[tag] = self.seconds.get(tag, 0.0) + elapsed - frame[2]
                self.calls[tag] = self.calls.get(tag, 0) + 1
                if self._stack:
                    self._stack[-1][2] += elapsed

        setattr(owner, name, timed)


def install(timers: ExclusiveTimers) -> None:
    from pixelsac import callbacks, collect, module, perf, replay
    from pixelsac.envs import dmc, vector

    def phase(what: str) -> Callable[[], str]:
        return lambda: f"{what} ({'eval' if timers.in_eval else 'collect'})"

    timers.wrap(module.SACModule, "training_step", "update (training_step)")
    timers.wrap(module.SACModule, "act", phase("act"))
    timers.wrap(dmc.DMCEnv, "_render_hwc", phase("render"))
    timers.wrap(dmc.DMCEnv, "step", phase("physics + env step"))
    timers.wrap(dmc.DMCEnv, "reset", phase("physics + env step"))
    timers.wrap(replay.ReplaySet, "add", "replay add")
    timers.wrap(replay.ReplaySet, "add_first", "replay add")
    timers.wrap(replay.ReplaySet, "sample", "replay sample")
    # the stream begins and finishes each step apart (train.overlap_collection); step() is both
    timers.wrap(collect.Collector, "begin_step", "collector bookkeeping")
    timers.wrap(collect.Collector, "finish_step", "collector bookkeeping")
    timers.wrap(vector.ParallelEnvs, "step_wait", "waiting for env workers")
    timers.wrap(vector.ParallelEnvs, "reset", "waiting for env workers")
    timers.wrap(callbacks.Checkpointer, "save", "checkpoint writes")
    timers.wrap(callbacks.TrainingLogger, "on_train_batch_end", "logging callbacks")
    timers.wrap(perf.PerfTracker, "on_train_batch_end", "logging callbacks")
    timers.wrap(perf.PerfTracker, "on_train_batch_start", "logging callbacks")

    original_episodes = collect.run_episodes

    @functools.wraps(original_episodes)
    def episodes(*args: Any, **kwargs: Any) -> Any:
        timers.in_eval += 1
        try:
            return original_episodes(*args, **kwargs)
        finally:
            timers.in_eval -= 1

    collect.run_episodes = episodes
    callbacks.run_episodes = episodes  # the Evaluator's own reference
    timers.wrap(callbacks, "run_episodes", "evaluation (the rest of it)")


def table(timers: ExclusiveTimers, wall: float) -> list[dict[str, Any]]:
    rows = [
        {
            "part": label,
            "seconds": s,
            "share": s / wall,
            "calls": timers.calls[label],
            "ms_per_call": 1e3 * s / max(timers.calls[label], 1),
        }
        for label, s in sorted(timers.seconds.items(), key=lambda kv: -kv[1])
    ]
    rest = wall - sum(timers.seconds.values())
    rows.append(
        {
            "part": "the rest (Lightning loop, progress bar, start-up)",
            "seconds": rest,
            "share": rest / wall,
            "calls": None,
            "ms_per_call": None,
        }
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the table as JSON here")
    parser.add_argument("overrides", nargs="*", help="training overrides (key=value)")
    args = parser.parse_args(argv)
    os.environ.setdefault("MUJOCO_GL", "egl")
    timers = ExclusiveTimers()
    install(timers)
    from pixelsac import train

    start = time.perf_counter()
    code = train.main(list(args.overrides))
    wall = time.perf_counter() - start
    rows = table(timers, wall)
    print(f"\nwall {wall:.1f} s (exit {code})")
    print(f"{'part':<52} {'s':>8} {'share':>7} {'calls':>8} {'ms/call':>9}")
    for row in rows:
        calls = "" if row["calls"] is None else str(row["calls"])
        per = "" if row["ms_per_call"] is None else f"{row['ms_per_call']:.2f}"
        print(f"{row['part']:<52} {row['seconds']:8.1f} {row['share']:7.1%} {calls:>8} {per:>9}")
    if args.out:
        args.out.write_text(
            json.dumps({"wall_s": wall, "exit": code, "overrides": args.overrides, "rows": rows}, indent=2)
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
