"""The verdict rule of a paired comparison (docs/results/full_size_cpu/decision.md), and the decision grid's table.

    .venv/bin/python tools/verdict.py grids/decide                      # fp16 against fp32, 70k-100k
    .venv/bin/python tools/verdict.py grids/decide --mode bf16 --window 70000,100000 --out docs/results/x

Given paired differences d_i = score(mode, i) - score(reference, i) over units i (seeds, or branch
pairs) and the reference's mean score R:

* **matches** when the two-sided 90% t-interval of mean(d) lies inside ±margin·R (margin 10%);
* **lags** when the two-sided 95% t-interval lies below 0 (and **leads** when it lies above 0);
* else **undecided**, with the number of units at which the observed spread would decide it.

The grid form reads ``GRID/<task>/<mode>/s<seed>/metrics.csv`` (tools/experiment.py's layout); a
run's score is the mean of its evaluation returns inside the window (both ends included); a seed
counts once both modes have every evaluation of the window. A run stopped by a numerical failure
before the window's end scores its last evaluation for the evaluations it did not reach (and is
named as failed). ``--verdict-seeds N``: the rule reads its verdict once, at N seeds; with fewer
the reading is *interim* and its line carries no "matches", "lags" or "leads". Each seed's row
names the machine its runs were trained on (the last line of their ``machine.txt``, which
tools/experiment.py writes). Writes ``verdict.md`` and ``verdict.json`` with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import plot  # noqa: E402  (tools/ is on sys.path from here)


def t_quantile(probability: float, dof: int) -> float:
    """Student's t quantile (scipy, which dm_control installs)."""
    from scipy import stats

    return float(stats.t.ppf(probability, dof))


@dataclass
class Verdict:
    reading: str  # matches | lags | leads | undecided | too few
    n: int
    mean: float | None
    sd: float | None
    ci90: tuple[float, float] | None
    ci95: tuple[float, float] | None
    reference_mean: float
    margin: float  # the ± band of "matches", in return units
    units_to_match: int | None  # units at which the 90% interval would fit the band, the mean and sd as observed
    units_to_lag: int | None  # units at which the 95% interval would exclude 0 (lags or leads)

    def sentence(self, what: str = "fp16 - fp32", units: str = "pairs", decides: bool = True) -> str:
        """The verdict in one sentence; ``units`` names what was paired (seeds, pairs, bases).

        ``decides=False`` is a reading that is not the verdict (interim, or a unit the rule does
        not decide by): the same figures without the word "matches", "lags" or "leads", so that a
        reader who skims never takes it for one."""
        said = f"{self.reading}: " if decides else ""
        if self.mean is None or self.ci95 is None or self.ci90 is None:
            return f"{said}{self.n} {units}, too few for an interval"
        text = (
            f"{said}{what} = {self.mean:+.1f} over {self.n} {units}, 90% interval "
            f"[{self.ci90[0]:+.1f}, {self.ci90[1]:+.1f}], 95% [{self.ci95[0]:+.1f}, {self.ci95[1]:+.1f}]; "
            f"band of 'matches' ±{self.margin:.1f} (10% of the reference's {self.reference_mean:.1f})"
        )
        if self.reading == "undecided":
            need = []
            if self.units_to_match is not None:
                need.append(f"'matches' at ~{self.units_to_match}")
            if self.units_to_lag is not None:
                need.append(f"'{'lags' if self.mean < 0 else 'leads'}' at ~{self.units_to_lag}")
            text += f"; {units} that would decide it with this mean and spread: " + (
                ", ".join(need) if need else "none (the mean sits at the band's edge)"
            )
        return text


def _units_needed(sd: float, room: float, probability: float, limit: int = 10_000) -> int | None:
    """The smallest n >= 2 with t(probability, n-1)·sd/√n < room, or None."""
    if room <= 0:
        return None
    if sd == 0:
        return 2
    for n in range(2, limit):
        if t_quantile(probability, n - 1) * sd / math.sqrt(n) < room:
            return n
    return None


def paired_verdict(differences: Sequence[float], reference_mean: float, margin_fraction: float = 0.10) -> Verdict:
    """The verdict of the rule in the module docstring."""
    d = np.asarray(list(differences), dtype=np.float64)
    band = margin_fraction * abs(reference_mean)
    if d.size < 2:
        mean = float(d.mean()) if d.size else None
        return Verdict("too few", int(d.size), mean, None, None, None, reference_mean, band, None, None)
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    se = sd / math.sqrt(d.size)
    half90, half95 = t_quantile(0.95, d.size - 1) * se, t_quantile(0.975, d.size - 1) * se
    ci90, ci95 = (mean - half90, mean + half90), (mean - half95, mean + half95)
    if -band <= ci90[0] and ci90[1] <= band:
        reading = "matches"
    elif ci95[1] < 0:
        reading = "lags"
    elif ci95[0] > 0:
        reading = "leads"
    else:
        reading = "undecided"
    return Verdict(
        reading,
        int(d.size),
        mean,
        sd,
        ci90,
        ci95,
        reference_mean,
        band,
        _units_needed(sd, band - abs(mean), 0.95),
        _units_needed(sd, abs(mean), 0.975) if mean != 0 else None,
    )


# --- the decision grid ---------------------------------------------------------------------------
@dataclass
class RunScore:
    seed: int
    mode: str
    score: float | None  # None: the window is not complete
    evaluations: int
    failed: bool


def run_score(run_dir: Path, seed: int, mode: str, window: tuple[int, int], every: int) -> RunScore:
    """The mean evaluation return of a run inside ``window`` (see the module docstring)."""
    expected = list(range(window[0], window[1] + 1, every))
    failed = (run_dir / "failure.json").is_file()
    try:
        frames, returns = plot.read_eval_curve(run_dir)
    except plot.PlotError:
        return RunScore(seed, mode, None, 0, failed)
    by_frame = {int(round(f)): float(r) for f, r in zip(frames, returns)}
    values = [by_frame[f] for f in expected if f in by_frame]
    if len(values) < len(expected):
        if not failed or not returns.size:
            return RunScore(seed, mode, None, len(values), failed)
        values += [float(returns[-1])] * (len(expected) - len(values))  # a failed run keeps its last return
    return RunScore(seed, mode, float(np.mean(values)), len(expected), failed)


def grid_scores(grid: Path, task: str, mode: str, window: tuple[int, int], every: int) -> dict[int, RunScore]:
    folder = grid / task / mode
    scores = {}
    for run_dir in sorted(folder.glob("s*")) if folder.is_dir() else []:
        if run_dir.name[1:].isdigit():
            seed = int(run_dir.name[1:])
            scores[seed] = run_score(run_dir, seed, mode, window, every)
    return scores


def grid_verdict(
    grid: Path, task: str, mode: str, reference: str, window: tuple[int, int], every: int
) -> tuple[Verdict, list[tuple[int, float, float]], list[RunScore]]:
    ours, theirs = grid_scores(grid, task, mode, window, every), grid_scores(grid, task, reference, window, every)
    pairs = [
        (seed, ours[seed].score, theirs[seed].score)
        for seed in sorted(set(ours) & set(theirs))
        if ours[seed].score is not None and theirs[seed].score is not None
    ]
    reference_mean = float(np.mean([p[2] for p in pairs])) if pairs else 0.0
    verdict = paired_verdict([p[1] - p[2] for p in pairs], reference_mean)
    return verdict, pairs, [*ours.values(), *theirs.values()]


def run_machine(run_dir: Path) -> str | None:
    """The hardware a run last started on: its ``machine.txt``'s last line without the time,
    the action and the code (``AMD EPYC (avx512_bf16), 2 CPUs, torch ...``), or None."""
    try:
        lines = (run_dir / "machine.txt").read_text().splitlines()
    except OSError:
        return None
    last = next((line for line in reversed(lines) if ": " in line), None)
    return last.split(": ", 1)[1].split("; code")[0] if last else None


def seed_machine(grid: Path, task: str, modes: Sequence[str], seed: int) -> str:
    """The machine(s) a seed's runs were trained on, once when they agree."""
    machines = [run_machine(grid / task / mode / f"s{seed}") or "not recorded" for mode in modes]
    return machines[0] if len(set(machines)) == 1 else " / ".join(f"{m}: {h}" for m, h in zip(modes, machines))


def interim(n: int, read_at: int, units: str) -> str:
    """The label of a reading that is not the verdict: fewer units than the rule reads it at."""
    return f"interim, {n} of the {read_at} {units} the verdict is read at"


def is_interim(verdict: Verdict, verdict_seeds: int | None) -> bool:
    return verdict_seeds is not None and verdict.n < verdict_seeds


def markdown(
    verdict: Verdict, pairs: list[tuple[int, float, float]], runs: list[RunScore], args: argparse.Namespace
) -> str:
    before_the_verdict = is_interim(verdict, args.verdict_seeds)
    line = verdict.sentence(f"{args.mode} - {args.reference}", units="seeds", decides=not before_the_verdict)
    if before_the_verdict:
        line = f"{interim(verdict.n, args.verdict_seeds, 'seeds')}; decides nothing: {line}"
    lines = [
        f"# {args.mode} against {args.reference}: {args.task}, score = mean evaluation return over "
        f"{args.window[0]:,}-{args.window[1]:,} frames",
        "",
        f"**{line}**",
        "",
        f"| seed | {args.mode} | {args.reference} | difference | trained on |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {s} | {a:.1f} | {b:.1f} | {a - b:+.1f} | "
        f"{seed_machine(args.grid, args.task, (args.mode, args.reference), s)} |"
        for s, a, b in pairs
    ]
    waiting = [r for r in runs if r.score is None]
    if waiting:
        lines += ["", "Not yet scored (window incomplete): " + ", ".join(f"{r.mode} s{r.seed}" for r in waiting)]
    failed = [r for r in runs if r.failed]
    if failed:
        lines += ["", "Stopped by a numerical failure: " + ", ".join(f"{r.mode} s{r.seed}" for r in failed)]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("grid", type=Path, help="a tools/experiment.py grid folder")
    parser.add_argument("--task", default="cartpole_swingup")
    parser.add_argument("--mode", default="fp16")
    parser.add_argument("--reference", default="fp32")
    parser.add_argument("--window", default="70000,100000", help="first,last env frame of the scored evaluations")
    parser.add_argument("--every", type=int, default=10_000, help="frames between evaluations")
    parser.add_argument("--out", type=Path, default=None, help="write verdict.md and verdict.json here")
    parser.add_argument(
        "--verdict-seeds",
        type=int,
        default=None,
        help="seeds at which the rule reads its verdict (fewer: an interim reading that decides nothing)",
    )
    args = parser.parse_args(argv)
    try:
        first, last = (int(x) for x in args.window.split(","))
    except ValueError:
        parser.error(f"--window takes FIRST,LAST env frames, got {args.window!r}")
    if args.verdict_seeds is not None and args.verdict_seeds < 2:
        parser.error(f"--verdict-seeds takes 2 or more seeds (an interval needs two), got {args.verdict_seeds}")
    if not args.grid.is_dir():
        parser.error(f"{args.grid} is not a folder; pass a tools/experiment.py grid (its --out)")
    args.window = (first, last)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    verdict, pairs, runs = grid_verdict(args.grid, args.task, args.mode, args.reference, args.window, args.every)
    text = markdown(verdict, pairs, runs, args)
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "verdict.md").write_text(text)
        record = {
            "verdict": asdict(verdict),
            "interim": is_interim(verdict, args.verdict_seeds),
            "verdict_seeds": args.verdict_seeds,
            "pairs": pairs,
            "window": list(args.window),
        }
        (args.out / "verdict.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
