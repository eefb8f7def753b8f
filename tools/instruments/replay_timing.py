"""Sampling a batch from the replay rings of several environments, timed side by side in one
process: this checkout's ``pixelsac/replay.py`` against another commit's (``--baseline``).

Both ``ReplaySet``s get the same history (``--envs`` rings of ``--slots`` 84×84 RGB frames each,
or ``--total-slots`` over all of them; stacks of 3, 6-D actions, episodes of 125 agent steps); a
batch of each is checked equal first (the same random stream). Rounds alternate which goes first;
the table gives the median time of one ``sample()`` and the ratio. Placements: host memory (numpy
rings, a CPU run's default); with CUDA also page-locked host batches and rings on the GPU
(``replay.device``; timed to the end of the gather with ``torch.cuda.synchronize``).

    python tools/instruments/replay_timing.py --baseline 21c7915 --total-slots 8000 \\
        --out docs/results/replay_rings/sample_cpu

Prints a markdown table (and writes ``OUT.md`` / ``OUT.json``). Measure with nothing else on
the cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/
from table_files import write_table_files  # noqa: E402

import pixelsac.replay as current  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
FRAME, STACK, ACTION_DIM, EPISODE_STEPS = (3, 84, 84), 3, 6, 125


def baseline_module(rev: str) -> ModuleType:
    """``pixelsac/replay.py`` as it was at ``rev``, imported as a module of its own."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:pixelsac/replay.py"], capture_output=True, text=True, check=True
    ).stdout
    spec = importlib.util.spec_from_loader(f"replay_{rev}", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"{rev}:pixelsac/replay.py", "exec"), module.__dict__)
    return module


def filled(module: ModuleType, envs: int, slots: int, placement: dict[str, Any]) -> Any:
    """A ``ReplaySet`` of ``module`` with ``slots`` slots a ring, every one written."""
    replay = module.ReplaySet(envs, envs * slots, FRAME, np.uint8, STACK, ACTION_DIM, **placement)
    rng = np.random.default_rng(0)
    for written in range(slots):
        for env in range(envs):
            frame = rng.integers(0, 256, FRAME, dtype=np.uint8)
            if written % (EPISODE_STEPS + 1) == 0:
                replay.add_first(env, frame)
            else:
                replay.add(env, rng.uniform(-1, 1, ACTION_DIM), float(rng.normal()), False, frame)
    return replay


def timed_sample(replay: Any, batch: int, rng: np.random.Generator, cuda: bool) -> float:
    start = time.perf_counter()
    replay.sample(batch, rng)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the commit whose pixelsac/replay.py is timed against")
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--slots", type=int, default=1000, help="slots a ring")
    parser.add_argument(
        "--total-slots", type=int, help="slots over all rings instead (every row then holds the same frames)"
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    baseline = baseline_module(args.baseline)
    placements = {"host": {}}
    if torch.cuda.is_available():
        placements.update({"pinned host batches": {"pin_memory": True}, "rings on the GPU": {"device": "cuda"}})
    lines = [
        f"| placement | envs | batch | {args.baseline}, ms | this checkout, ms | ratio |",
        "|---|---|---|---|---|---|",
    ]
    rows = []
    for name, placement in placements.items():
        cuda = placement.get("device") == "cuda"
        for envs in args.envs:
            slots = args.slots if args.total_slots is None else args.total_slots // envs
            replays = {"baseline": filled(baseline, envs, slots, placement)}
            replays["current"] = filled(current, envs, slots, placement)
            for batch in args.batches:
                first = [replays[which].sample(batch, np.random.default_rng(1)) for which in ("baseline", "current")]
                if not all(torch.equal(first[0][key].cpu(), first[1][key].cpu()) for key in first[0]):
                    raise SystemExit(f"error: the two sample different batches ({name}, {envs} envs, batch {batch})")
                times: dict[str, list[float]] = {"baseline": [], "current": []}
                rngs = {which: np.random.default_rng(2) for which in times}
                for round_index in range(args.rounds):
                    order = ("baseline", "current") if round_index % 2 == 0 else ("current", "baseline")
                    for which in order:
                        times[which].append(timed_sample(replays[which], batch, rngs[which], cuda))
                old, new = (statistics.median(times[which]) * 1e3 for which in ("baseline", "current"))
                lines.append(f"| {name} | {envs} | {batch} | {old:.2f} | {new:.2f} | {new / old:.2f} |")
                rows.append({"placement": name, "envs": envs, "batch": batch, "baseline_ms": old, "current_ms": new})
                print(lines[-1], flush=True)
            del replays
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        meta = {"threads": args.threads, "rounds": args.rounds, "slots": args.slots, "total_slots": args.total_slots}
        meta["rows"] = rows
        write_table_files(args.out, "instruments/replay_timing.py", argv, table, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
