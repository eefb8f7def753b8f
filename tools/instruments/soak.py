#!/usr/bin/env python
"""Soak test: thousands of tiny updates with collection, checkpointing and resume, in one process.

    .venv/bin/python tools/instruments/soak.py [--segments 8] [--frames-per-segment 2560] [--precision fp32]

The run is cut into segments; each segment resumes the previous one's last checkpoint (replay
buffer included) in the same process, as a pre-empted job would. After every segment it checks
that the counters add up (env frames = agent steps x action repeat, updates = (agent steps -
seed steps) x updates per step, one CSV row per evaluation, no duplicates) and records the
process's resident memory. It fails if memory keeps growing after the first segments warm up.
Prints one line per segment and a JSON summary.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from pixelsac.train import resolve_config, train  # noqa: E402

TINY = [
    "task=cartpole_swingup",
    "env.image_size=32",
    "env.episode_frames=256",
    "replay.capacity=2000",
    "agent.batch_size=8",
    "agent.num_filters=8",
    "agent.feature_dim=16",
    "agent.hidden_dim=32",
    "train.seed_steps=32",
    "train.eval_episodes=1",
    "train.log_every_updates=50",
    "train.video_every_evals=0",
    "trainer.enable_progress_bar=false",
]


def rss_mb() -> float:
    """Resident memory now (not the high-water mark), from /proc."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def check_counters(run, seed_steps: int, run_dir: Path) -> None:
    c, m = run.collector, run.module
    assert c.env_frames == c.agent_steps * run.env.action_repeat, (c.env_frames, c.agent_steps)
    assert m.updates == max(c.agent_steps - seed_steps, 0) * run.cfg.train.updates_per_step, (m.updates, c.agent_steps)
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    evals = [int(float(r["step"])) for r in rows if r.get("eval/return")]
    assert evals == sorted(set(evals)), f"duplicate or unordered eval rows: {evals}"
    assert evals[-1] == c.env_frames, (evals[-1], c.env_frames)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--frames-per-segment", type=int, default=2560)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument(
        "--growth-limit-mb", type=float, default=64.0, help="allowed resident-memory growth from segment 3 to the last"
    )
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pixelsac-soak-")) / "run"
    history = []
    start = time.perf_counter()
    for segment in range(1, args.segments + 1):
        frames = segment * args.frames_per_segment
        overrides = [f"train.env_frames={frames}", f"train.eval_every_frames={args.frames_per_segment // 2}"]
        if segment == 1:
            argv = [*TINY, f"precision={args.precision}", f"run_dir={run_dir}", *overrides]
        else:
            argv = [f"resume={run_dir}", *overrides]
        cfg, resume_from, resume_frames = resolve_config(argv)
        run = train(cfg, resume_from, resume_frames)
        check_counters(run, cfg.train.seed_steps, run_dir)
        history.append(
            {
                "segment": segment,
                "env_frames": run.collector.env_frames,
                "updates": run.module.updates,
                "rss_mb": round(rss_mb(), 1),
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
        print(json.dumps(history[-1]), flush=True)
        del run
    warm = history[min(2, len(history) - 1)]["rss_mb"]
    growth = history[-1]["rss_mb"] - warm
    summary = {
        "segments": args.segments,
        "env_frames": history[-1]["env_frames"],
        "updates": history[-1]["updates"],
        "rss_mb_first": history[0]["rss_mb"],
        "rss_mb_after_warmup": warm,
        "rss_mb_last": history[-1]["rss_mb"],
        "growth_mb": round(growth, 1),
        "growth_limit_mb": args.growth_limit_mb,
        "run_dir": str(run_dir),
    }
    print(json.dumps(summary))
    if growth > args.growth_limit_mb:
        print(f"FAIL: resident memory grew {growth:.1f} MB after warm-up", file=sys.stderr)
        return 1
    print("soak ok: counters add up and memory is flat")
    return 0


if __name__ == "__main__":
    sys.exit(main())
