"""Does acting in 16 bits cost return? One checkpoint evaluated in its trained arithmetic and with its
weights widened exactly to fp32 and float64, on the same episodes, compared episode by episode.

    .venv/bin/python tools/eval_arithmetic.py grids/decide/cartpole_swingup/fp16/s1 --episodes 20 \\
        --out docs/results/full_size_cpu/eval_arithmetic/fp16_s1_40k

Each arm is ``pixelsac-evaluate checkpoint=CKPT prefer=last video=false episodes=N arithmetic=A``
(pixelsac.evaluate.evaluate, in this process) with the same episode seed, so episode i starts from
the same state in every arm and only the policy's arithmetic differs. Per episode
d = return(trained) - return(fp64) (and fp32 - fp64); the reading (docs/results/full_size_cpu/decision.md):
acting in the trained arithmetic **costs return** when the 95% t-interval of mean d lies below 0,
**does not** when it lies inside ±2% of float64's mean return, else **undecided**. Writes
``results.md`` and ``results.json`` (every episode's return in every arm) with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"
for path in (REPO, TOOLS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from verdict import paired_verdict  # noqa: E402

from pixelsac.checkpoint import CheckpointError  # noqa: E402
from pixelsac.config import ConfigError  # noqa: E402
from pixelsac.evaluate import EvalOptions, evaluate  # noqa: E402

ARMS = ("trained", "fp32", "fp64")
#: the band of "does not cost return", a fraction of float64's mean return
BAND = 0.02


def compare(returns: dict[str, list[float]], against: str = "fp64") -> dict[str, dict[str, Any]]:
    """Per arm: the mean paired difference to ``against`` with its 95% t-interval and the reading."""
    reference = np.asarray(returns[against])
    rows = {}
    for arm, values in returns.items():
        if arm == against:
            continue
        d = np.asarray(values) - reference
        paired = paired_verdict(d, float(reference.mean()), margin_fraction=BAND)
        low, high = paired.ci95 if paired.ci95 is not None else (-math.inf, math.inf)
        within = -paired.margin <= low and high <= paired.margin
        reading = "costs return" if high < 0 else "does not" if within else "undecided"
        if low > 0:
            reading = "gains return"
        rows[arm] = {
            "mean_difference": float(d.mean()),
            "ci95": [low, high],
            "band": paired.margin,
            "reading": reading,
            "episodes_differing": int(np.count_nonzero(d)),
        }
    return rows


def markdown(checkpoint: str, results: dict[str, dict[str, Any]], rows: dict[str, dict[str, Any]]) -> str:
    trained = results["trained"]
    lines = [
        f"# Acting arithmetic: {trained['precision']} checkpoint at {trained['env_frames']:,} env frames",
        "",
        f"`{checkpoint}`, {trained['episodes']} deterministic episodes, episode seed {trained['seed']}, the same "
        "episodes in every arm.",
        "",
        "| arm | mean return | − float64, mean | 95% interval | episodes differing | reading |",
        "|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        mean = results[arm]["mean"]
        if arm in rows:
            row = rows[arm]
            lines.append(
                f"| {arm} | {mean:.2f} | {row['mean_difference']:+.2f} | "
                f"[{row['ci95'][0]:+.2f}, {row['ci95'][1]:+.2f}] | {row['episodes_differing']} of "
                f"{results[arm]['episodes']} | {row['reading']} (band ±{row['band']:.2f}) |"
            )
        else:
            lines.append(f"| {arm} | {mean:.2f} | (the judge) | | | |")
    lines += ["", "| episode | " + " | ".join(ARMS) + " |", "|---|" + "---|" * len(ARMS)]
    for i in range(trained["episodes"]):
        lines.append(f"| {i} | " + " | ".join(f"{results[arm]['returns'][i]:.2f}" for arm in ARMS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a .ckpt file or a run directory (its last.ckpt)")
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None, help="episode seed (default: the evaluation default)")
    parser.add_argument("--out", type=Path, default=None, help="write results.md and results.json here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.episodes < 2:
        parser.error("--episodes must be at least 2 (the interval needs two episodes)")
    results = {}
    with tempfile.TemporaryDirectory() as scratch:  # each arm's own results.json, gathered below
        for arm in ARMS:
            options = EvalOptions(
                checkpoint=args.checkpoint,
                prefer="last",
                episodes=args.episodes,
                seed=args.seed,
                video=False,
                out_dir=str(Path(scratch) / arm),
                arithmetic=arm,
            )
            try:
                evaluation = evaluate(options, out=lambda line: None)
            except (CheckpointError, ConfigError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            results[arm] = {**evaluation.results, "checkpoint": args.checkpoint}  # as given, not this machine's path
            print(f"{arm:>8}: mean {evaluation.results['mean']:.2f} over {args.episodes} episodes", flush=True)
    rows = compare({arm: results[arm]["returns"] for arm in ARMS})
    text = markdown(args.checkpoint, results, rows)
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text)
        record = {"checkpoint": args.checkpoint, "arms": results, "against_fp64": rows}
        (args.out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
