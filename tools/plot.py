"""Learning curves: evaluation return against environment frames, from run directories.

    tools/plot runs/cheetah_run/* runs/walker_walk/* --out curves.png
    tools/plot 'runs/*/*' --stat iqm --out results/iqm.png
    tools/plot runs/ --by agent.batch_size          # a folder of runs is searched for them

Each run directory holds ``metrics.csv`` (``eval/return`` rows, with ``env_frames``) and
``config.yaml`` (task, precision, ``lowp.*`` switches, seed). Runs are grouped by task (one
subplot each) and precision mode (one line each): an fp16 run with all six modifications off is
"fp16 naive", an ablation is "fp16 -<switch>", a switch added to a mode that lacks it
"+<switch>". Several seeds of one group are interpolated onto a common frame grid (the frames
every seed has reached -- curves are never extrapolated) and drawn as their mean (or IQM,
``--stat iqm``) with a bootstrapped 95% confidence band over seeds. DrQ's published returns
(10 seeds, mean ± std) mark the six PlaNet tasks at 100k and 500k frames. Writes PNG and SVG
and prints the final return of every group. Missing or empty metrics: one ``error:`` line, exit 2.

Legends and the table count distinct seeds (two runs of seed 1 are ``2 runs, 1 seed``). A group
whose runs repeat a seed, or whose configurations differ in anything but the seed, the run
directory and how the run was started (``resume``, ``overwrite``, ``trust_checkpoint``), gets a
``warning:`` line on stderr naming the keys and their values: such a band mixes experiments.
"""

from __future__ import annotations

import argparse
import csv
import glob
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: make `pixelsac` importable
    sys.path.insert(0, str(REPO))

#: DrQ (Kostrikov et al. 2020), from pixels, 10 seeds: env frames -> (mean, std) per task.
DRQ_REFERENCE: dict[str, dict[int, tuple[float, float]]] = {
    "cartpole_swingup": {100_000: (759, 92), 500_000: (868, 10)},
    "reacher_easy": {100_000: (601, 213), 500_000: (942, 71)},
    "cheetah_run": {100_000: (344, 67), 500_000: (660, 96)},
    "finger_spin": {100_000: (901, 104), 500_000: (938, 103)},
    "ball_in_cup_catch": {100_000: (913, 53), 500_000: (963, 9)},
    "walker_walk": {100_000: (612, 164), 500_000: (921, 45)},
}
STATS = ("mean", "iqm")


class PlotError(ValueError):
    """A problem with the runs asked for, in one line (exit code 2)."""


@dataclass
class Run:
    """One training run's evaluation curve and what it is grouped by."""

    path: Path
    task: str
    label: str
    seed: Any
    frames: np.ndarray  # env frames of each evaluation, increasing
    returns: np.ndarray  # eval/return at those frames
    config: dict[str, Any] = field(default_factory=dict)  # the run's config.yaml


@dataclass
class Curve:
    """The runs of one (task, label) group on their common frame grid."""

    task: str
    label: str
    runs: list[Run]
    grid: np.ndarray = field(default_factory=lambda: np.zeros(0))
    values: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # (runs, grid)
    center: np.ndarray = field(default_factory=lambda: np.zeros(0))
    low: np.ndarray = field(default_factory=lambda: np.zeros(0))
    high: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def seeds(self) -> int:
        """Distinct seeds among the runs (two runs of one seed are one seed, not two)."""
        return len({str(run.seed) for run in self.runs})

    @property
    def count_text(self) -> str:
        """``3 seeds``, or ``2 runs, 1 seed`` when seeds repeat."""
        seeds = f"{self.seeds} seed{'s' if self.seeds != 1 else ''}"
        return seeds if len(self.runs) == self.seeds else f"{len(self.runs)} runs, {seeds}"


# --- finding and reading runs -----------------------------------------------------------------------
def find_run_dirs(patterns: Sequence[str]) -> list[Path]:
    """Run directories from paths or glob patterns; a folder without metrics.csv is searched
    for run directories below it."""
    found: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise PlotError(f"no run directory matches {pattern!r}")
        for match in map(Path, matches):
            if not match.is_dir():
                raise PlotError(f"{match} is not a run directory (expected a folder with metrics.csv)")
            if (match / "metrics.csv").is_file() or (match / "config.yaml").is_file():
                found.append(match)
            else:
                below = sorted(p.parent for p in match.rglob("metrics.csv"))
                if not below:
                    raise PlotError(f"{match} holds no metrics.csv (not a run directory, nor a folder of runs)")
                found.extend(below)
    unique = list(dict.fromkeys(p.resolve() for p in found))
    if not unique:
        raise PlotError("no run directories given")
    return unique


def read_eval_curve(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(env frames, eval/return) of a run, sorted by frames; the last value wins at a repeated
    frame count (a resumed run evaluates its resume point again)."""
    metrics = run_dir / "metrics.csv"
    if not metrics.is_file():
        raise PlotError(f"{run_dir} has no metrics.csv")
    points: dict[float, float] = {}
    try:
        with open(metrics, newline="") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames or "eval/return" not in reader.fieldnames:
                raise PlotError(f"{metrics} has no eval/return column (the run never evaluated)")
            frame_column = "env_frames" if "env_frames" in reader.fieldnames else "step"
            for row in reader:
                value, frames = row.get("eval/return") or "", row.get(frame_column) or ""
                if value.strip() and frames.strip():
                    points[float(frames)] = float(value)
    except (OSError, UnicodeDecodeError, csv.Error, ValueError) as exc:
        if isinstance(exc, PlotError):
            raise
        raise PlotError(f"cannot read {metrics}: {exc}") from exc
    if not points:
        raise PlotError(f"{metrics} has no eval/return values yet (the run has not evaluated)")
    frames = np.array(sorted(points))
    return frames, np.array([points[f] for f in frames])


def read_config(run_dir: Path) -> dict[str, Any]:
    """The run's config.yaml as plain containers, over the defaults in conf/config.yaml so that
    older runs lacking newer keys still resolve."""
    import yaml
    from omegaconf import OmegaConf

    from pixelsac.config import conf_dir

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise PlotError(f"{run_dir} has no config.yaml (needed for its task, precision and seed)")
    try:
        run_cfg = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PlotError(f"cannot read {path}: {str(exc).splitlines()[0]}") from exc
    if not isinstance(run_cfg, dict) or "task" not in run_cfg:
        raise PlotError(f"{path} is not a pixelsac run configuration (no task)")
    defaults = OmegaConf.load(conf_dir() / "config.yaml")
    return OmegaConf.to_container(OmegaConf.merge(defaults, run_cfg), resolve=True)  # type: ignore[return-value]


def precision_label(config: dict[str, Any]) -> str:
    """``fp32``, ``fp16``, ``fp16 naive``, ``fp16 -hadam -normal_fix``, ``bf16 +loss_scaling``...

    The switches are resolved by the precision policy itself (one place decides them) and
    compared with what the mode turns on by default.
    """
    from omegaconf import OmegaConf

    from pixelsac.precision import SIX, PrecisionPolicy

    mode = str(config.get("precision"))
    try:
        resolved = PrecisionPolicy.from_config(OmegaConf.create(config), "cuda")
        default = PrecisionPolicy.from_config(
            OmegaConf.create({**config, "lowp": {**config["lowp"], "all": None, **dict.fromkeys(SIX, None)}}), "cuda"
        )
    except (KeyError, AttributeError, TypeError):  # a mode or layout this version does not know
        return mode
    removed = [name for name in SIX if getattr(default, name) and not getattr(resolved, name)]
    added = [name for name in SIX if getattr(resolved, name) and not getattr(default, name)]
    if mode == "fp16" and not any(getattr(resolved, name) for name in SIX):
        label = "fp16 naive"
    else:
        label = " ".join([mode, *(f"-{n}" for n in removed), *(f"+{n}" for n in added)])
    if config.get("env", {}).get("obs", "pixels") != "pixels":
        label += f" ({config['env']['obs']})"
    return label


def _select(config: dict[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise PlotError(f"--by {dotted}: no such key in the run configuration")
        value = value[part]
    return value


def load_run(run_dir: Path, by: Sequence[str] = ()) -> Run:
    """A run's curve, task, group label (precision, plus any ``by`` keys) and seed."""
    frames, returns = read_eval_curve(run_dir)
    config = read_config(run_dir)
    label = " ".join([precision_label(config), *(f"{key}={_select(config, key)}" for key in by)])
    return Run(run_dir, str(config["task"]), label, config.get("seed"), frames, returns, config)


#: configuration keys that may differ between the runs of one curve: which seed, where it wrote,
#: and how it was started (none of them changes what a run computes)
BOOKKEEPING_KEYS = ("seed", "run_dir", "resume", "overwrite", "trust_checkpoint")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def config_differences(runs: Sequence[Run]) -> dict[str, list[Any]]:
    """Keys (dotted) whose values differ between ``runs``, with the values seen, in run order;
    :data:`BOOKKEEPING_KEYS` are left out."""
    flats = [_flat(run.config) for run in runs]
    keys = sorted(set().union(*flats)) if flats else []
    differ: dict[str, list[Any]] = {}
    for key in keys:
        if key.split(".")[0] in BOOKKEEPING_KEYS:
            continue
        values = [flat.get(key, "<absent>") for flat in flats]
        if any(value != values[0] for value in values[1:]):
            differ[key] = list(dict.fromkeys(map(str, values)))
    return differ


def curve_warnings(curves: Sequence[Curve]) -> list[str]:
    """One line per curve whose runs repeat a seed or differ in configuration (a curve is meant to
    be the same experiment over seeds)."""
    lines = []
    for curve in curves:
        name = f"{curve.task} {curve.label}"
        if len(curve.runs) > curve.seeds:
            lines.append(f"warning: {name}: {curve.count_text} -- a seed is plotted more than once")
        differ = config_differences(curve.runs)
        if differ:
            shown = "; ".join(f"{key} ({', '.join(values)})" for key, values in list(differ.items())[:5])
            more = f"; and {len(differ) - 5} more" if len(differ) > 5 else ""
            lines.append(f"warning: {name}: the runs' configurations differ in {shown}{more}")
    return lines


# --- statistics ----------------------------------------------------------------------------------------
def iqm(values: np.ndarray, axis: int = 0) -> np.ndarray:
    """Interquartile mean: the mean of the middle half (``trim_mean(x, 0.25)``, as rliable).

    With fewer than four values nothing is trimmed.
    """
    values = np.sort(np.asarray(values, dtype=float), axis=axis)
    n = values.shape[axis]
    cut = int(0.25 * n)
    return np.take(values, np.arange(cut, n - cut), axis=axis).mean(axis=axis)


def _stat(values: np.ndarray, stat: str, axis: int) -> np.ndarray:
    return iqm(values, axis) if stat == "iqm" else np.mean(values, axis=axis)


def bootstrap_band(
    values: np.ndarray, stat: str = "mean", resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Statistic over runs (axis 0) of a (runs, points) array, with a percentile bootstrap
    confidence band (runs resampled with replacement). One run: the band is the line itself."""
    values = np.asarray(values, dtype=float)
    center = _stat(values, stat, axis=0)
    if values.shape[0] < 2:
        return center, center.copy(), center.copy()
    rng = np.random.default_rng(seed)  # fixed: the same runs give the same figure
    picks = rng.integers(0, values.shape[0], size=(resamples, values.shape[0]))
    resampled = _stat(values[picks], stat, axis=1)  # (resamples, points)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(resampled, [tail, 100 - tail], axis=0)
    return center, low, high


def common_grid(runs: Sequence[Run]) -> np.ndarray:
    """Every evaluation frame of the runs within the range all of them cover."""
    start = max(float(run.frames[0]) for run in runs)
    end = min(float(run.frames[-1]) for run in runs)
    frames = np.unique(np.concatenate([run.frames for run in runs]))
    return frames[(frames >= start) & (frames <= end)]


def build_curves(runs: Sequence[Run], stat: str = "mean", resamples: int = 2000) -> list[Curve]:
    """Group runs by (task, label), interpolate each group onto its grid, aggregate."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.task, run.label), []).append(run)
    curves = []
    for (task, label), members in sorted(groups.items()):
        grid = common_grid(members)
        if grid.size == 0:  # e.g. one seed evaluated only before another's first evaluation
            grid = np.array([min(float(run.frames[-1]) for run in members)])
        values = np.stack([np.interp(grid, run.frames, run.returns) for run in members])
        center, low, high = bootstrap_band(values, stat, resamples)
        curves.append(Curve(task, label, members, grid, values, center, low, high))
    return curves


# --- output ----------------------------------------------------------------------------------------
def _frames_text(frames: float) -> str:
    if frames >= 1e6:
        return f"{frames / 1e6:g}M"
    return f"{frames / 1e3:g}k" if frames >= 1e3 else f"{frames:g}"


def summary_table(curves: Sequence[Curve], stat: str = "mean") -> str:
    """Final return of every group (at the last frame all its runs reached), as text."""
    name = "IQM" if stat == "iqm" else "mean"
    header = f"{'task':<20} {'precision':<24} {'seeds':>5} {'env frames':>11}  {name + ' [95% CI]':<26} {'std':>6}  DrQ"
    lines = [header, "-" * len(header)]
    for curve in curves:
        final = curve.values[:, -1]
        ci = (
            f"{curve.center[-1]:.1f} [{curve.low[-1]:.1f}, {curve.high[-1]:.1f}]"
            if len(final) > 1
            else f"{curve.center[-1]:.1f}"
        )
        reference = _nearest_reference(curve.task, float(curve.grid[-1]))
        lines.append(
            f"{curve.task:<20} {curve.label:<24} {curve.seeds:>5} {int(curve.grid[-1]):>11,}  "
            f"{ci:<26} {float(np.std(final)):>6.1f}  {reference}"
        )
    return "\n".join(lines)


def _nearest_reference(task: str, frames: float) -> str:
    for ref_frames, (mean, std) in DRQ_REFERENCE.get(task, {}).items():
        if abs(frames - ref_frames) <= 0.1 * ref_frames:
            return f"{mean:.0f}±{std:.0f} @{_frames_text(ref_frames)}"
    return ""


def panels(count: int, labels: Sequence[str]) -> tuple[Any, list[Any], dict[str, Any]]:
    """A figure of ``count`` panels, three to a row, and a colour per label (the same label has
    the same colour in every panel); the figure's spare panels are hidden."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    columns = min(3, count)
    rows = math.ceil(count / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.8 * rows), squeeze=False)
    for ax in list(axes.flat)[count:]:
        ax.set_visible(False)
    colors = {label: plt.get_cmap("tab10")(i % 10) for i, label in enumerate(labels)}
    return fig, list(axes.flat)[:count], colors


def save_figure(fig: Any, paths: Sequence[Path], dpi: int = 120) -> list[Path]:
    """Lay the figure out, write it to every path (the format from the suffix) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return list(paths)


def plot_curves(curves: Sequence[Curve], out: Path, stat: str = "mean", reference: str = "auto") -> list[Path]:
    """One subplot per task, one line (with its band) per label; writes ``out`` as PNG and SVG."""
    from matplotlib.ticker import FuncFormatter

    tasks = sorted({curve.task for curve in curves})
    fig, axes, colors = panels(len(tasks), sorted({curve.label for curve in curves}))
    band_name = "IQM" if stat == "iqm" else "mean"
    for ax, task in zip(axes, tasks):
        task_curves = [c for c in curves if c.task == task]
        for curve in task_curves:
            color = colors[curve.label]
            ax.plot(
                curve.grid,
                curve.center,
                color=color,
                lw=1.8,
                marker="o" if curve.grid.size == 1 else None,
                label=f"{curve.label} ({curve.count_text})",
            )
            if len(curve.runs) > 1:
                ax.fill_between(curve.grid, curve.low, curve.high, color=color, alpha=0.2, lw=0)
        _reference_marks(ax, task, max(float(c.grid[-1]) for c in task_curves), reference)
        ax.set_title(task)
        ax.set_xlabel("env frames")
        ax.set_ylabel(f"eval return ({band_name}, 95% CI)")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _frames_text(x)))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    return save_figure(fig, [out.with_suffix(".png"), out.with_suffix(".svg")])


def _reference_marks(ax: Any, task: str, last_frames: float, reference: str) -> None:
    if reference == "none":
        return
    points = [
        (frames, mean, std)
        for frames, (mean, std) in DRQ_REFERENCE.get(task, {}).items()
        if reference == "all" or frames <= 1.1 * last_frames
    ]  # a far-off mark would squash the curves
    if points:
        frames, means, stds = zip(*points)
        ax.errorbar(
            frames, means, yerr=stds, fmt="D", color="black", ms=5, capsize=4, label="DrQ (10 seeds, mean ± std)"
        )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/plot", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="run directories, glob patterns or folders of runs")
    parser.add_argument("--out", default="curves.png", help="output file; .png and .svg are both written")
    parser.add_argument("--stat", choices=STATS, default="mean", help="statistic over seeds (iqm: interquartile mean)")
    parser.add_argument(
        "--by",
        action="append",
        default=[],
        metavar="KEY",
        help="also split lines by this config key (e.g. agent.batch_size); repeatable",
    )
    parser.add_argument(
        "--reference",
        choices=("auto", "all", "none"),
        default="auto",
        help="DrQ reference marks: within the plotted frames (auto), all, or none",
    )
    parser.add_argument(
        "--skip-incomplete",
        action="store_true",
        help="leave out runs without metrics or evaluations (with a warning) instead of stopping",
    )
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples for the band")
    args = parser.parse_args(argv)
    if args.resamples < 1:
        parser.error("--resamples must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: 0 on success, 2 with one ``error:`` line on bad input."""
    args = parse_args(sys.argv[1:] if argv is None else argv)  # argparse itself exits 2 on bad flags
    try:
        runs = []
        for run_dir in find_run_dirs(args.runs):
            try:
                runs.append(load_run(run_dir, args.by))
            except PlotError as exc:
                if not args.skip_incomplete:
                    raise PlotError(f"{exc} (pass --skip-incomplete to leave such runs out)") from None
                print(f"warning: skipped: {exc}", file=sys.stderr)
        if not runs:
            raise PlotError("none of the runs has evaluation results to plot")
        curves = build_curves(runs, args.stat, args.resamples)
    except PlotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in curve_warnings(curves):
        print(line, file=sys.stderr)
    written = plot_curves(curves, Path(args.out), args.stat, args.reference)
    print(summary_table(curves, args.stat))
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
