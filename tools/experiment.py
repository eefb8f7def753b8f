"""Experiment grid: precision modes x tasks x seeds, run, resumed, and tabulated.

    .venv/bin/python tools/experiment.py --tasks cartpole_swingup,walker_walk --seeds 1,2,3 \\
        --modes main --out grids/main train.env_frames=500000
    .venv/bin/python tools/experiment.py --modes all --tasks cheetah_run --seeds 1,2,3 --out grids/abl \\
        --obs state preset=state train.env_frames=30000 --jobs 4
    .venv/bin/python tools/experiment.py --out grids/main --collect-only --budgets 100000,500000

Each run is ``python -m pixelsac.train`` in ``OUT/<task>/<mode>/s<seed>`` (log: ``train.log``
there), with ``train.num_threads=1`` unless overridden. Modes: fp32, fp16 (all six
modifications and unbiased optimizer moments, the default), fp16-six and bf16-six (the published
six alone, ``lowp.unbiased_moments=false``), fp16-naive (``lowp.all=false``), amp, bf16, and
fp16-no-<switch> for each of the six; ``main`` = fp32,fp16,fp16-naive; ``all`` = main + fp16-six +
amp + the six ablations.

Running the same command again resumes the grid: a run whose last.ckpt reached the budget is
skipped, one short of it is continued with ``resume=RUN_DIR`` (so raising ``train.env_frames``
extends finished runs), a numerical failure (failure.json, exit 3) is kept as a result and not
retried unless ``--retry-failed`` (which starts it afresh), and a missing run starts. grid.json
records the spec and every run's status after each run ends. Then every run's metrics.csv is
collected into results.md / results.csv (per task x mode at fixed env-frame budgets: mean ± std
over seeds, IQM with a bootstrap 95% CI from tools/plot.py, seeds counted, failed runs counted
as failed, not as zero), seeds.csv (every seed's return at each budget) and paired.csv (each
mode against each mode of ``--paired-against``, fp32 by default: the same seed's difference, its
mean over the seeds both reached with a bootstrap 95% CI), and learning curves (curves.png/svg, tools/plot.py).
Bad arguments: one ``error:`` line, exit 2. Exit 1 when a run crashed or was refused (see its
train.log); else 75 when a run was stopped by a signal with its work saved (the next start
resumes it).

One grid writes an ``--out`` folder at a time: it holds a lock on it (``OUT/.lock``) from its
first write to its exit, and a second grid (or ``--collect-only``) there is refused in one line.
A SIGTERM or SIGINT to the grid is passed on to the runs in progress (they save their work and
exit 75), no further run starts, grid.json records them as stopped and the rest as pending, and
the grid exits 75: the same command resumes it. A grid.json that cannot be read is refused in
one line, never overwritten (it holds the grid's history).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pixelsac import lifeline  # noqa: E402  (the repository is on sys.path from here)
from pixelsac.cli import UsageError  # noqa: E402
from pixelsac.config import SIX as SWITCHES  # noqa: E402
from pixelsac.provenance import git_state  # noqa: E402
from pixelsac.rundir import RunDirLock  # noqa: E402

MODES: dict[str, list[str]] = {
    "fp32": ["precision=fp32"],
    "fp16": ["precision=fp16"],
    "fp16-naive": ["precision=fp16", "lowp.all=false"],
    "amp": ["precision=amp"],
    "bf16": ["precision=bf16"],
    "fp16-six": [
        "precision=fp16",
        "lowp.unbiased_moments=false",
        "lowp.adaptive_target_scale=false",
        "lowp.fp32_q_output=false",
        "lowp.headroom_growth=false",
    ],
    # today's fp16 before the full-size fixes: one K for the target copy and Q in fp16
    "fp16-fixed_k": [
        "precision=fp16",
        "lowp.adaptive_target_scale=false",
        "lowp.fp32_q_output=false",
        "lowp.headroom_growth=false",
    ],
    # the published five: none of the switches beyond the paper that bf16 turns on by default
    "bf16-six": [
        "precision=bf16",
        "lowp.unbiased_moments=false",
        "lowp.adaptive_target_scale=false",
        "lowp.fp32_q_output=false",
        "lowp.fp32_actor_loss=false",
        "lowp.fp32_actor_features=false",
    ],
    "bf16-no-fp32_actor_loss": ["precision=bf16", "lowp.fp32_actor_loss=false"],
    "bf16-no-fp32_actor_features": ["precision=bf16", "lowp.fp32_actor_features=false"],
    # fp16 with bf16's actor-loss arithmetic: its actor gradient's tail against float64 (grad_fidelity)
    "fp16-fp32_actor_loss": ["precision=fp16", "lowp.fp32_actor_loss=true"],
    **{f"fp16-no-{s}": ["precision=fp16", f"lowp.{s}=false"] for s in SWITCHES},
}
MAIN = ["fp32", "fp16", "fp16-naive"]
ALL = [*MAIN, "fp16-six", "amp", *(f"fp16-no-{s}" for s in SWITCHES)]
#: keys the grid itself sets for every run; an override of them would break the layout
RESERVED = ("task", "seed", "precision", "run_dir", "resume", "overwrite", "env.obs")
EXIT_BAD_INPUT, EXIT_NUMERICAL_FAILURE, EXIT_STOPPED = 2, 3, 75
#: a budget counts as reached when the last evaluation is within this fraction below it
#: (budgets are rounded up to whole agent steps of action repeat frames)
REACH_TOLERANCE = 0.02


class GridError(ValueError):
    """A problem with the arguments, in one line (exit code 2)."""


def load_plot() -> Any:
    """tools/plot.py, imported by path (tools/ is not a package)."""
    name = "pixelsac_tools_plot"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / "plot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


# --- the grid ------------------------------------------------------------------------------------------
@dataclass
class RunSpec:
    task: str
    mode: str
    seed: int
    run_dir: Path
    budget: int  # train.env_frames of this run
    overrides: list[str]  # everything after the mode/task/seed (the user's key=value, num_threads)

    @property
    def key(self) -> str:
        return f"{self.task}/{self.mode}/s{self.seed}"

    def fresh_args(self) -> list[str]:
        # overwrite: the folder is the grid's own and already holds this run's train.log
        return [
            f"task={self.task}",
            *MODES[self.mode],
            f"seed={self.seed}",
            *self.overrides,
            f"run_dir={self.run_dir}",
            "overwrite=true",
        ]

    def resume_args(self) -> list[str]:
        from pixelsac.config import RESUMABLE

        kept = [
            o
            for o in self.overrides
            if o.split("=", 1)[0].startswith(RESUMABLE) and o.split("=", 1)[0] != "train.env_frames"
        ]
        return [f"resume={self.run_dir}", *kept, f"train.env_frames={self.budget}"]


@dataclass
class Plan:
    spec: RunSpec
    action: str  # skip-done | skip-failed | resume | fresh | restart (dir without a checkpoint)
    frames: int | None = None  # env frames of last.ckpt, when there is one
    args: list[str] = field(default_factory=list)


def parse_list(text: str, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise GridError(f"--{what} is empty")
    return list(dict.fromkeys(items))


def parse_modes(text: str) -> list[str]:
    modes: list[str] = []
    for item in parse_list(text, "modes"):
        if item == "main":
            modes += MAIN
        elif item == "all":
            modes += ALL
        elif item in MODES:
            modes.append(item)
        else:
            import difflib

            close = difflib.get_close_matches(item, [*MODES, "main", "all"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise GridError(f"unknown mode {item!r}{hint}; modes: main, all, {', '.join(MODES)}")
    return list(dict.fromkeys(modes))


def parse_ints(text: str, what: str) -> list[int]:
    values = []
    for item in parse_list(text, what):
        try:
            number = float(item)  # 1e5 and 100000 alike
        except ValueError:
            raise GridError(f"--{what}: {item!r} is not a whole number") from None
        if not number.is_integer():
            raise GridError(f"--{what}: {item!r} is not a whole number")
        value = int(number)
        if value < (0 if what == "seeds" else 1):
            raise GridError(f"--{what}: {item!r} must be {'non-negative' if what == 'seeds' else 'positive'}")
        values.append(value)
    return list(dict.fromkeys(values))


def build_grid(
    tasks: Sequence[str],
    modes: Sequence[str],
    seeds: Sequence[int],
    obs: str | None,
    overrides: Sequence[str],
    out: Path,
) -> list[RunSpec]:
    """Every run of the grid, its configuration composed and validated as training would (a bad
    override or task is a GridError before anything runs)."""
    from pixelsac.config import ConfigError, check_each_key_once, load_config, parse_overrides

    try:
        check_each_key_once(list(overrides))
        given = parse_overrides(list(overrides))
    except ConfigError as exc:
        raise GridError(str(exc)) from None
    for key in given:
        if key in RESERVED or key.startswith("lowp."):
            raise GridError(
                f"{key}= is set by the grid (use --tasks, --seeds, --modes, --obs); leave it out of the overrides"
            )
    extra = list(overrides)
    if "train.num_threads" not in given:
        extra.append("train.num_threads=1")
    if obs is not None:
        extra.append(f"env.obs={obs}")
    try:
        from pixelsac.envs import available_tasks

        valid = available_tasks()
    except Exception:  # noqa: BLE001 -- dm_control missing: training reports it per run
        valid = None
    specs = []
    for task in tasks:
        for mode in modes:
            try:  # every run's own configuration, as training will check it (seeds have a range too)
                configs = [
                    load_config(RunSpec(task, mode, s, out, 0, extra).fresh_args()[:-2], valid_tasks=valid)
                    for s in seeds
                ]
            except ConfigError as exc:
                raise GridError(str(exc)) from None
            cfg = configs[0]
            for seed in seeds:
                specs.append(
                    RunSpec(task, mode, seed, out / task / mode / f"s{seed}", int(cfg.train.env_frames), extra)
                )
    return specs


def checkpoint_frames(run_dir: Path) -> int | None:
    """Env frames stored in the run's last.ckpt (None without a readable one)."""
    import torch

    file = run_dir / "checkpoints" / "last.ckpt"
    if not file.is_file():
        return None
    try:
        stored = torch.load(file, map_location="cpu", weights_only=True)
        return int(stored["callbacks"]["Checkpointer"]["collector"]["env_frames"])
    except Exception:  # noqa: BLE001 -- truncated or foreign: treat as no checkpoint
        return None


def evaluated_frames(run_dir: Path) -> int | None:
    """The env frame of the run's last evaluation in metrics.csv (None without one)."""
    plot = load_plot()
    try:
        frames, _ = plot.read_eval_curve(run_dir)
    except plot.PlotError:
        return None
    return int(frames[-1]) if frames.size else None


#: one line per start of a run: when, how (fresh, resume, restart), the hardware and the code.
#: Runs of one grid may come from several machines (an export's runs copied into another's
#: --out); a paired difference is read with the machines both runs were trained on.
MACHINE_FILE = "machine.txt"

#: what --export keeps of each finished run: enough to tabulate and plot it, and for a later
#: invocation to count it as done (summary.json, and evaluations up to the budget in metrics.csv),
#: and where it ran, without checkpoints or replay files
EXPORTED_FILES = ("metrics.csv", "summary.json", "failure.json", "config.yaml", MACHINE_FILE)


def plan_run(spec: RunSpec, retry_failed: bool) -> Plan:
    run_dir = spec.run_dir
    if (run_dir / "failure.json").is_file() and not retry_failed:
        return Plan(spec, "skip-failed")
    if (run_dir / "failure.json").is_file():
        return Plan(spec, "restart", None, spec.fresh_args())
    frames = checkpoint_frames(run_dir)
    if frames is None and (run_dir / "summary.json").is_file():
        # an exported run (no checkpoint kept): done when its evaluations reached the budget
        evaluated = evaluated_frames(run_dir)
        if evaluated is not None and evaluated >= spec.budget * (1 - REACH_TOLERANCE):
            return Plan(spec, "skip-done", evaluated)
    if frames is not None and frames >= spec.budget:
        return Plan(spec, "skip-done", frames)
    if frames is not None:
        return Plan(spec, "resume", frames, spec.resume_args())
    if run_dir.exists() and any(run_dir.iterdir()):  # started, stopped before its first checkpoint
        return Plan(spec, "restart", None, spec.fresh_args())
    return Plan(spec, "fresh", None, spec.fresh_args())


def train_command(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "pixelsac.train", *args]


def code_version() -> str:
    """The commit the runs train with (``+ uncommitted changes`` when the tree differs from it)."""
    commit, changed = git_state(REPO)
    if commit is None:
        return "unknown (not a git checkout)"
    return commit[:7] + (" + uncommitted changes" if changed else "")


def cpu_line() -> str:
    """The CPU's model and which 16-bit float extensions it has (from /proc/cpuinfo): fp16 and
    bf16 runs take other kernels, at other speeds, on a CPU with or without them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    extensions = [flag for flag in ("avx512_bf16", "avx512_fp16", "amx_bf16") if flag in flags]
    return f"{model} ({' '.join(extensions) or 'no avx512_bf16/avx512_fp16/amx_bf16'})"


def hardware_line() -> str:
    import torch

    device = (
        f"CUDA {torch.cuda.get_device_name(0)} (x{torch.cuda.device_count()})"
        if torch.cuda.is_available()
        else "no CUDA device"
    )
    return f"{cpu_line()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {device}"


def relative(path: str | Path) -> str:
    """A path inside the repository relative to it (records stay true on another machine)."""
    for absolute in (Path(os.path.abspath(path)), Path(path).resolve()):  # a runs/ symlink stays inside
        try:
            return str(absolute.relative_to(REPO))
        except ValueError:
            continue
    return str(path)


def as_typed(command: Sequence[str]) -> str:
    """A training command as a user would type it in the repository: ``python``, relative paths."""
    words = ["python" if word == sys.executable else word for word in command]
    words = [
        f"{word.split('=', 1)[0]}={relative(word.split('=', 1)[1])}"
        if word.startswith(("run_dir=", "resume="))
        else word
        for word in words
    ]
    return shlex.join(words)


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(["python", "tools/experiment.py", *argv])


# --- grid.json ------------------------------------------------------------------------------------------
class GridState:
    """grid.json: the spec, the commands that ran, and each run's status; rewritten atomically."""

    def __init__(self, out: Path) -> None:
        self.path = out / "grid.json"
        self.lock = threading.Lock()
        self.data: dict[str, Any] = {"spec": {}, "invocations": [], "runs": {}}
        if self.path.exists() or self.path.is_symlink():
            try:
                saved = json.loads(self.path.read_text())
                if not isinstance(saved, dict) or not all(
                    isinstance(saved.get(key, {}), kind) for key, kind in (("spec", dict), ("runs", dict))
                ):
                    raise ValueError("not the mapping of spec, invocations and runs a grid writes")
            except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
                raise GridError(
                    f"{self.path} cannot be read ({reason}); it holds the grid's history, so it is not "
                    "overwritten: repair it, or move it aside to start a new record"
                ) from None
            self.data.update(saved)

    def update_run(self, key: str, **fields: Any) -> None:
        with self.lock:
            self.data["runs"].setdefault(key, {}).update(fields)
            self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(".grid.json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, self.path)


class GridStop:
    """A stop signal to the grid (SIGTERM, SIGINT): passed on to the runs in progress as SIGTERM
    (each saves its work and exits 75), and no run starts after it."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.runs: set[subprocess.Popen] = set()
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self.handle) for signum in self.SIGNALS}

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def handle(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name
        with contextlib.suppress(OSError):
            os.write(2, f"grid: {self.signal_name}: stopping the runs in progress (their work is saved)\n".encode())
        for run in list(self.runs):
            self.pass_on(run)

    def pass_on(self, run: subprocess.Popen) -> None:
        with contextlib.suppress(OSError):
            if run.poll() is None:
                run.send_signal(signal.SIGTERM)


def execute(plan: Plan, state: GridState, stop: GridStop | None = None) -> str:
    """Run one training subprocess, its output appended to train.log; returns its status
    ("not started" after a stop signal: grid.json keeps it pending)."""
    stop = stop or GridStop()
    if stop.signal_name:
        return "not started"
    spec = plan.spec
    if plan.action == "restart" and spec.run_dir.exists():
        shutil.rmtree(spec.run_dir)  # a failed or checkpoint-less run starts afresh, nothing stale kept
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now().isoformat(timespec="seconds")
    with open(spec.run_dir / MACHINE_FILE, "a") as f:
        f.write(f"{now} {plan.action}: {hardware_line()}; code {code_version()}\n")
    log = spec.run_dir / "train.log"
    command = train_command(plan.args)
    env = {
        **os.environ,
        "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    state.update_run(spec.key, status="running", action=plan.action, command=as_typed(command))
    started = time.monotonic()
    with open(log, "a") as f:
        f.write(f"# {now} {plan.action}: {shlex.join(command)}\n")
        f.flush()
        # SIGTERM when the grid process ends, however it ends: the run stops as on Ctrl-C (its work
        # saved, exit 75) and the grid's next start resumes it; its own workers go with it
        tie = lifeline.tie_before_exec(signal.SIGTERM)
        run = subprocess.Popen(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, preexec_fn=tie)
        stop.runs.add(run)
        if stop.signal_name:  # the signal came while it started
            stop.pass_on(run)
        try:
            rc = run.wait()
        finally:
            stop.runs.discard(run)
    seconds = round(time.monotonic() - started, 1)
    status = run_status(rc, spec.run_dir)
    if stop.signal_name and rc in (-signal.SIGTERM, 128 + signal.SIGTERM):
        status = "stopped"  # ended by the signal before its own handlers were in place: nothing lost
    state.update_run(
        spec.key,
        status=status,
        returncode=rc,
        seconds=seconds,
        env_frames=checkpoint_frames(spec.run_dir),
        budget=spec.budget,
    )
    print(f"{status:<8} {spec.key} (exit {rc}, {seconds:.0f} s; log {log})", flush=True)
    return status


def run_status(returncode: int, run_dir: Path) -> str:
    """What a training run's exit code says: done, failed (numerical failure), refused (bad
    input), stopped (a signal stopped it with its work saved, exit 75: the grid's next start
    resumes it) or crashed (anything else)."""
    if returncode == 0:
        return "done"
    if returncode == EXIT_NUMERICAL_FAILURE or (run_dir / "failure.json").is_file():
        return "failed"
    if returncode == EXIT_BAD_INPUT:
        return "refused"
    if returncode == EXIT_STOPPED:
        return "stopped"
    return "crashed"


# --- collecting results -------------------------------------------------------------------------------
@dataclass
class RunResult:
    task: str
    mode: str
    seed: int
    run_dir: Path
    frames: np.ndarray
    returns: np.ndarray
    failed_at: float | None  # env frame of a numerical failure (inf: unknown frame), None: no failure


def read_result(task: str, mode: str, seed: int, run_dir: Path) -> RunResult:
    plot = load_plot()
    failed_at = None
    failure = run_dir / "failure.json"
    if failure.is_file():
        try:
            frames = json.loads(failure.read_text()).get("env_frames")
            failed_at = float(frames) if frames is not None else 0.0
        except (OSError, ValueError, AttributeError):
            failed_at = 0.0
    try:
        frames, returns = plot.read_eval_curve(run_dir)
    except plot.PlotError:
        frames, returns = np.zeros(0), np.zeros(0)
    return RunResult(task, mode, seed, run_dir, frames, returns, failed_at)


def value_at(result: RunResult, budget: int) -> tuple[str, float | None]:
    """``("ok", return)``, ``("failed", None)`` or ``("missing", None)`` at a budget.

    The return at a budget is the evaluation curve interpolated there (as tools/plot does); a run
    counts once its last evaluation is within REACH_TOLERANCE of the budget. A run that ended in a
    numerical failure before the budget is failed there, never zero; its earlier budgets count.
    """
    if result.failed_at is not None and result.failed_at <= budget:
        return "failed", None
    if result.frames.size == 0 or result.frames[-1] < budget * (1 - REACH_TOLERANCE):
        return "missing", None
    return "ok", float(np.interp(budget, result.frames, result.returns))


@dataclass
class Row:
    task: str
    mode: str
    budget: int
    seeds: int
    n: int
    failed: int
    missing: int
    mean: float | None = None
    std: float | None = None
    iqm: float | None = None
    iqm_low: float | None = None
    iqm_high: float | None = None
    reference: str = ""


def table_rows(
    results: Sequence[RunResult], budgets: Sequence[int], resamples: int = 2000, seeds: int | None = None
) -> list[Row]:
    """Per task x mode x budget: mean ± std (population std over seeds, as tools/plot), IQM with
    a bootstrap 95% CI (tools/plot.bootstrap_band), and how many seeds counted, failed, are missing
    (``seeds``: the grid's seeds per group, so that runs never started count as missing)."""
    plot = load_plot()
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for result in results:
        groups.setdefault((result.task, result.mode), []).append(result)
    rows = []
    for (task, mode), members in groups.items():
        for budget in budgets:
            outcomes = [value_at(m, budget) for m in members]
            values = np.array([v for s, v in outcomes if s == "ok"], dtype=float)
            expected = max(seeds or 0, len(members))
            row = Row(
                task,
                mode,
                budget,
                expected,
                len(values),
                sum(s == "failed" for s, _ in outcomes),
                sum(s == "missing" for s, _ in outcomes) + expected - len(members),
                reference=plot._nearest_reference(task, float(budget)),
            )
            if values.size:
                center, low, high = plot.bootstrap_band(values[:, None], "iqm", resamples)
                row.mean, row.std = float(values.mean()), float(values.std())
                row.iqm, row.iqm_low, row.iqm_high = float(center[0]), float(low[0]), float(high[0])
            rows.append(row)
    return rows


#: ``(task, mode, budget) -> {seed: value_at(...)}``
SeedValues = dict[tuple[str, str, int], dict[int, tuple[str, float | None]]]


def seed_values(results: Sequence[RunResult], budgets: Sequence[int]) -> SeedValues:
    """``(task, mode, budget) -> {seed: value_at(...)}``: every run's outcome at every budget."""
    table: SeedValues = {}
    for result in results:
        for budget in budgets:
            table.setdefault((result.task, result.mode, budget), {})[result.seed] = value_at(result, budget)
    return table


@dataclass
class Pair:
    """One mode against a reference mode at one budget, seed by seed.

    With ``d_s = R_mode(s) - R_against(s)`` over the seeds ``s`` at which both runs reached the
    budget (a seed that failed or is missing in either is left out and counted), ``mean`` is
    ``mean_s d_s`` and ``[low, high]`` its percentile-bootstrap 95% CI (seeds resampled, as for
    the IQM). Pairing removes what a seed does to both modes alike (its environment draws, its
    initial weights): the spread left is the modes' disagreement, not the seeds' spread.
    """

    task: str
    mode: str
    against: str
    budget: int
    seeds: list[int]
    differences: list[float]
    left_out: int
    mean: float | None = None
    low: float | None = None
    high: float | None = None

    @property
    def ahead(self) -> int:
        """Seeds on which ``mode`` scored higher than ``against``."""
        return sum(d > 0 for d in self.differences)

    @property
    def reading(self) -> str:
        """What the interval says: which mode is ahead, or that it cannot tell."""
        if self.mean is None:
            return "no seed reached the budget in both"
        if len(self.seeds) < 2:
            return "one pair: no interval"
        if self.low > 0:
            return f"{self.mode} higher"
        if self.high < 0:
            return f"{self.mode} lower"
        return "the CI covers 0"


def paired_rows(values: SeedValues, budgets: Sequence[int], against: str, resamples: int = 2000) -> list[Pair]:
    """Every other mode against ``against``, per task and budget (see :class:`Pair`), from the
    seeds' values at the budgets (:func:`seed_values`)."""
    plot = load_plot()
    tasks = list(dict.fromkeys(task for task, _, _ in values))
    modes = list(dict.fromkeys(mode for _, mode, _ in values))
    pairs = []
    for task in tasks:
        for mode in modes:
            if mode == against or (task, mode, budgets[0]) not in values:
                continue
            for budget in budgets:
                ours, theirs = values[(task, mode, budget)], values.get((task, against, budget), {})
                seeds = sorted(set(ours) | set(theirs))
                both = [s for s in seeds if ours.get(s, ("",))[0] == "ok" and theirs.get(s, ("",))[0] == "ok"]
                differences = [ours[s][1] - theirs[s][1] for s in both]
                pair = Pair(task, mode, against, budget, both, differences, len(seeds) - len(both))
                if differences:
                    center, low, high = plot.bootstrap_band(np.array(differences)[:, None], "mean", resamples)
                    pair.mean, pair.low, pair.high = float(center[0]), float(low[0]), float(high[0])
                pairs.append(pair)
    return pairs


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _seed_text(outcome: tuple[str, float | None] | None) -> str:
    if outcome is None:
        return "–"
    status, value = outcome
    return f"{value:.1f}" if status == "ok" else "failed" if status == "failed" else "–"


def _write_table(path: Path, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def write_seed_csv(values: SeedValues, path: Path) -> None:
    rows = [
        [task, mode, seed, budget, status, _fmt(value)]
        for (task, mode, budget), outcomes in values.items()
        for seed, (status, value) in sorted(outcomes.items())
    ]
    _write_table(path, ["task", "mode", "seed", "env_frames", "status", "return"], rows)


def write_paired_csv(pairs: Sequence[Pair], path: Path) -> None:
    header = ["task", "mode", "against", "env_frames", "pairs", "left_out", "seeds", "differences"]
    header += ["mean_difference", "ci_low", "ci_high", "higher_in", "reading"]
    rows = [
        [
            p.task,
            p.mode,
            p.against,
            p.budget,
            len(p.seeds),
            p.left_out,
            " ".join(map(str, p.seeds)),
            " ".join(f"{d:.1f}" for d in p.differences),
            _fmt(p.mean),
            _fmt(p.low),
            _fmt(p.high),
            p.ahead,
            p.reading,
        ]
        for p in pairs
    ]
    _write_table(path, header, rows)


def write_csv(rows: Sequence[Row], path: Path) -> None:
    header = ["task", "mode", "env_frames", "seeds", "n", "failed", "missing", "mean", "std", "iqm"]
    header += ["iqm_ci_low", "iqm_ci_high", "drq_reference"]
    table = [
        [
            r.task,
            r.mode,
            r.budget,
            r.seeds,
            r.n,
            r.failed,
            r.missing,
            _fmt(r.mean),
            _fmt(r.std),
            _fmt(r.iqm),
            _fmt(r.iqm_low),
            _fmt(r.iqm_high),
            r.reference,
        ]
        for r in rows
    ]
    _write_table(path, header, table)


def markdown(
    rows: Sequence[Row],
    header: dict[str, str],
    notes: Sequence[str],
    values: SeedValues | None = None,
    seeds: Sequence[int] = (),
    pairs: Sequence[Pair] = (),
) -> str:
    plot = load_plot()
    values = values or {}
    lines = ["# Experiment grid results", ""]
    lines += [f"- {name}: {value}" for name, value in header.items()]
    lines += [
        "",
        "Eval return (deterministic policy) at each env-frame budget, over seeds: mean ± std "
        "(population std), IQM with a bootstrap 95% CI over seeds. `n/seeds` = runs that reached "
        "the budget; **failed** = runs stopped by a numerical failure (non-finite values, "
        "failure.json) before the budget, counted as failed, not as zero; *missing* = not run "
        "yet or still short of the budget.",
        "",
    ]
    for budget in sorted({r.budget for r in rows}):
        lines += [
            f"## {plot._frames_text(budget)} env frames ({budget:,})",
            "",
            "| task | mode | n/seeds | mean ± std | IQM [95% CI] | failed | missing | DrQ |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in [r for r in rows if r.budget == budget]:
            mean = f"{r.mean:.1f} ± {r.std:.1f}" if r.mean is not None else "–"
            iqm = f"{r.iqm:.1f} [{r.iqm_low:.1f}, {r.iqm_high:.1f}]" if r.iqm is not None else "–"
            failed = f"**{r.failed} failed** ✗" if r.failed else "0"
            lines.append(
                f"| {r.task} | {r.mode} | {r.n}/{r.seeds} | {mean} | {iqm} | {failed} | {r.missing} | {r.reference} |"
            )
        lines.append("")
        if seeds:
            lines += [
                "Per seed (– : missing):",
                "",
                "| task | mode | " + " | ".join(f"s{s}" for s in seeds) + " |",
                "|---|---|" + "---|" * len(seeds),
            ]
            for r in [r for r in rows if r.budget == budget]:
                outcomes = values.get((r.task, r.mode, budget), {})
                cells = " | ".join(_seed_text(outcomes.get(s)) for s in seeds)
                lines.append(f"| {r.task} | {r.mode} | {cells} |")
            lines.append("")
        for against in dict.fromkeys(p.against for p in pairs):
            here = [p for p in pairs if p.budget == budget and p.against == against]
            if not here:
                continue
            lines += [
                f"Paired with {against}, seed by seed (mode − {against} on the seeds both "
                "reached; mean with a bootstrap 95% CI over those seeds):",
                "",
                "| task | mode | pairs | differences (seed: value) | mean difference [95% CI] | higher in | reading |",
                "|---|---|---|---|---|---|---|",
            ]
            for p in here:
                listed = ", ".join(f"s{s}: {d:+.1f}" for s, d in zip(p.seeds, p.differences)) or "–"
                mean = f"{p.mean:+.1f} [{p.low:+.1f}, {p.high:+.1f}]" if p.mean is not None else "–"
                pairs_text = f"{len(p.seeds)}" + (f" ({p.left_out} left out)" if p.left_out else "")
                higher = f"{p.ahead}/{len(p.seeds)}"
                lines.append(f"| {p.task} | {p.mode} | {pairs_text} | {listed} | {mean} | {higher} | {p.reading} |")
            lines.append("")
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines).rstrip() + "\n"


def collect(
    out: Path,
    tasks: Sequence[str],
    modes: Sequence[str],
    seeds: Sequence[int],
    budgets: Sequence[int],
    argv: Sequence[str],
    state: GridState,
    resamples: int = 2000,
    against: Sequence[str] = ("fp32",),
) -> list[Row]:
    """Write results.md, results.csv, seeds.csv, paired.csv (every other mode against each mode
    of ``against`` that the grid has) and curves.png/svg for the grid in ``out``."""
    plot = load_plot()
    results, runs, notes = [], [], []
    for task in tasks:
        for mode in modes:
            for seed in seeds:
                run_dir = out / task / mode / f"s{seed}"
                if not run_dir.is_dir():
                    continue
                result = read_result(task, mode, seed, run_dir)
                results.append(result)
                if result.failed_at is None and result.frames.size:
                    try:
                        runs.append(plot.load_run(run_dir))
                    except plot.PlotError as exc:
                        notes.append(f"{task}/{mode}/s{seed} left out of the curves: {exc}")
    if not results:
        raise GridError(f"{out} holds no runs of this grid (expected {out}/<task>/<mode>/s<seed>)")
    # a group never run at all still gets its rows (all missing)
    present = {(r.task, r.mode) for r in results}
    rows = table_rows(results, budgets, resamples, seeds=len(seeds))
    for task in tasks:
        for mode in modes:
            if (task, mode) not in present:
                rows += [Row(task, mode, b, len(seeds), 0, 0, len(seeds)) for b in budgets]
    order = {(t, m): i for i, (t, m) in enumerate((t, m) for t in tasks for m in modes)}
    rows.sort(key=lambda r: (r.budget, order[(r.task, r.mode)]))
    failed_runs = [f"{r.task}/{r.mode}/s{r.seed} at {r.failed_at:g} frames" for r in results if r.failed_at is not None]
    if failed_runs:
        notes.append(f"{len(failed_runs)} run(s) ended in a numerical failure: {', '.join(failed_runs)}")
    if runs:
        written = plot.plot_curves(plot.build_curves(runs, "mean", resamples), out / "curves.png")
        notes.append(
            "learning curves (mean over seeds, bootstrap 95% band; failed runs left out): "
            + ", ".join(p.name for p in written)
        )
    spec = state.data.get("spec", {})
    header = {
        "command": f"`{command_line(argv)}`",
        "grid command": f"`{spec.get('command', '(unknown: no grid.json)')}`",
        "hardware (collected on)": hardware_line(),
        "hardware (runs)": spec.get("hardware", "(unknown)"),
        "code (runs)": spec.get("code", "(not recorded)"),
        "tasks": ", ".join(tasks),
        "modes": ", ".join(f"{m} ({' '.join(MODES[m])})" for m in modes),
        "seeds": ", ".join(map(str, seeds)),
        "overrides": " ".join(spec.get("overrides", [])) or "(none)",
        "written": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    values = seed_values(results, budgets)
    pairs: list[Pair] = []
    references = [mode for mode in dict.fromkeys(against) if mode in modes]
    for i, reference in enumerate(references):  # a later reference is not paired back with an earlier one
        pairs += [p for p in paired_rows(values, budgets, reference, resamples) if p.mode not in references[:i]]
    (out / "results.md").write_text(markdown(rows, header, notes, values, seeds, pairs))
    write_csv(rows, out / "results.csv")
    write_seed_csv(values, out / "seeds.csv")
    (out / "paired.csv").unlink(missing_ok=True)  # a table left from other modes would mislead
    if pairs:
        write_paired_csv(pairs, out / "paired.csv")
    return rows


def export(out: Path, dest: Path, tasks: Sequence[str], modes: Sequence[str], seeds: Sequence[int]) -> None:
    """Copy the results (results.md/csv, curves, grid.json) and each finished or failed run's
    EXPORTED_FILES to ``dest``, ``dest/runs/<task>/<mode>/s<seed>/`` for the runs; in every text
    file the grid folder's absolute path becomes ``GRID`` (e.g. ``run_dir: GRID/<task>/...``, and
    the ``--out`` of the commands grid.json and results.md record), so an export names no path of
    the machine that ran it."""

    def copy_text(source: Path, target: Path) -> None:
        text = source.read_text()
        for absolute in (str(out.resolve()), str(out.absolute())):  # a relative --out names no machine
            text = text.replace(absolute, "GRID")
        target.write_text(text)
        shutil.copystat(source, target)

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("results.md", "results.csv", "seeds.csv", "paired.csv", "grid.json"):
        if (out / name).is_file():
            copy_text(out / name, dest / name)
    for name in ("curves.png", "curves.svg"):
        if (out / name).is_file():
            shutil.copy2(out / name, dest / name)
    copied = 0
    for task in tasks:
        for mode in modes:
            for seed in seeds:
                run_dir = out / task / mode / f"s{seed}"
                if not ((run_dir / "summary.json").is_file() or (run_dir / "failure.json").is_file()):
                    continue  # still running, or never started
                target = dest / "runs" / task / mode / f"s{seed}"
                target.mkdir(parents=True, exist_ok=True)
                for name in EXPORTED_FILES:
                    if (run_dir / name).is_file():
                        copy_text(run_dir / name, target / name)
                copied += 1
    print(f"exported the results and {copied} finished runs to {dest}")


# --- command line ---------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/experiment.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides passed to every run")
    parser.add_argument("--out", required=True, help="grid folder; runs go to OUT/<task>/<mode>/s<seed>")
    parser.add_argument("--modes", default=None, help="comma-separated modes, or main / all (default: main)")
    parser.add_argument("--tasks", default=None, help="comma-separated dm_control tasks (domain_task)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default: 1,2,3)")
    parser.add_argument("--obs", choices=("pixels", "state"), default=None, help="observations (env.obs)")
    parser.add_argument("--jobs", type=int, default=1, help="training runs at once (default 1)")
    parser.add_argument(
        "--budgets", default=None, help="env-frame budgets of the table (default: the grid's final budget and its half)"
    )
    parser.add_argument("--retry-failed", action="store_true", help="start numerically failed runs again")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    parser.add_argument("--collect-only", action="store_true", help="only (re)write results from existing runs")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples for the IQM CI")
    parser.add_argument(
        "--paired-against",
        default="fp32",
        help="comma-separated modes every other mode is paired with, seed by seed (default fp32; "
        "'none': no paired table)",
    )
    parser.add_argument(
        "--export",
        default=None,
        help="also copy the results and each finished run's metrics, summary and config (no "
        "checkpoints) here, e.g. docs/results/NAME; copying its runs/ back into --out lets a "
        "later invocation on another machine skip them",
    )

    def error(message: str) -> None:
        raise GridError(message)

    parser.error = error  # type: ignore[method-assign] -- one `error:` line, exit 2, no usage dump
    args = parser.parse_args(list(argv))
    if args.jobs < 1:
        raise GridError("--jobs must be at least 1")
    if args.resamples < 1:
        raise GridError("--resamples must be positive")
    if args.paired_against == "none":
        args.paired_against = []
    else:
        try:
            args.paired_against = parse_modes(args.paired_against)
        except GridError as exc:
            raise GridError(f"--paired-against: {exc}") from None
    if args.dry_run and args.collect_only:
        raise GridError("--dry-run and --collect-only exclude each other")
    for item in args.overrides:
        if "=" not in item:
            raise GridError(f"{item!r} is not a key=value override (flags start with --)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    locks: list[RunDirLock] = []
    try:
        args = parse_args(argv)
        return run(args, argv, locks)
    except GridError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        for lock in locks:
            lock.release()


def claim(out: Path, locks: list[RunDirLock]) -> GridState:
    """Lock ``out`` for this grid (added to ``locks``, which the caller releases at its end) and
    read its grid.json again under the lock: another grid may have ended since it was first read."""
    try:
        locks.append(RunDirLock(out, key="--out").acquire())
    except UsageError as exc:
        raise GridError(str(exc)) from None
    return GridState(out)


def run(args: argparse.Namespace, argv: Sequence[str], locks: list[RunDirLock] | None = None) -> int:
    locks = [] if locks is None else locks
    out = Path(os.path.abspath(args.out))
    state = GridState(out)
    spec = state.data.get("spec") or {}
    if args.collect_only and not spec and args.tasks is None:
        raise GridError(f"{out} has no grid.json; pass --tasks/--modes/--seeds to say which runs to collect")
    modes = parse_modes(args.modes) if args.modes else spec.get("modes", MAIN) if args.collect_only else MAIN
    tasks = parse_list(args.tasks, "tasks") if args.tasks else spec.get("tasks") if args.collect_only else None
    if not tasks:
        raise GridError("--tasks is required (e.g. --tasks cartpole_swingup,walker_walk)")
    seeds = (
        parse_ints(args.seeds, "seeds")
        if args.seeds
        else spec.get("seeds", [1, 2, 3])
        if args.collect_only
        else [1, 2, 3]
    )
    budgets = parse_ints(args.budgets, "budgets") if args.budgets else None

    if args.collect_only:
        if budgets is None:
            final = int(spec.get("budget") or 0)
            if not final:
                raise GridError("--budgets is required when grid.json does not say the grid's budget")
            budgets = sorted({final // 2, final})
        state = claim(out, locks)
        collect(out, tasks, modes, seeds, budgets, argv, state, args.resamples, args.paired_against)
        print(f"wrote {out / 'results.md'}, {out / 'results.csv'}")
        if args.export:
            export(out, Path(args.export), tasks, modes, seeds)
        return 0

    specs = build_grid(tasks, modes, seeds, args.obs, args.overrides, out)
    final = max(s.budget for s in specs)
    budgets = budgets or sorted({final // 2, final})
    plans = [plan_run(s, args.retry_failed) for s in specs]
    for plan in plans:
        what = {
            "skip-done": f"done ({plan.frames} >= {plan.spec.budget} frames), skipped",
            "skip-failed": "failed numerically earlier, not retried (--retry-failed to retry)",
        }.get(plan.action)
        if what:
            print(f"{plan.action:<11} {plan.spec.key}: {what}")
        else:
            frames = f" from {plan.frames} frames" if plan.action == "resume" else ""
            print(f"{plan.action:<11} {plan.spec.key}{frames}: {shlex.join(train_command(plan.args))}")
    todo = [p for p in plans if not p.action.startswith("skip")]
    if args.dry_run:
        print(f"dry run: {len(todo)} of {len(plans)} runs would train, {args.jobs} at a time")
        return 0
    state = claim(out, locks)

    state.data["spec"] = {
        "tasks": tasks,
        "modes": modes,
        "seeds": seeds,
        "obs": args.obs,
        "overrides": list(args.overrides),
        "budget": final,
        "out": relative(out),
        "jobs": args.jobs,
        "command": command_line(argv),
        "hardware": hardware_line(),
        "code": code_version(),
    }
    state.data.setdefault("invocations", []).append(
        {"command": command_line(argv), "time": datetime.datetime.now().isoformat(timespec="seconds")}
    )
    for plan in plans:
        if plan.action == "skip-done":
            state.data["runs"].setdefault(plan.spec.key, {}).update(
                status="done", env_frames=plan.frames, budget=plan.spec.budget
            )
        elif plan.action == "skip-failed":
            state.data["runs"].setdefault(plan.spec.key, {}).update(status="failed")
        else:
            state.data["runs"].setdefault(plan.spec.key, {}).update(status="pending", action=plan.action)
    state.write()

    statuses = []
    stop = GridStop()
    stop.install()
    try:
        if todo:
            with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                statuses = list(pool.map(lambda p: execute(p, state, stop), todo))
    finally:
        stop.restore()
    if stop.signal_name:
        print(
            f"grid: stopped by {stop.signal_name}: {statuses.count('stopped')} run(s) stopped with their work saved, "
            f"{statuses.count('not started')} not started; run the same command to resume; {out / 'grid.json'}"
        )
        return EXIT_STOPPED
    counts = {s: statuses.count(s) for s in dict.fromkeys(statuses)}
    skipped = len(plans) - len(todo)
    print(
        f"grid: {len(todo)} trained ({', '.join(f'{n} {s}' for s, n in counts.items()) or 'none'}), "
        f"{skipped} skipped; {out / 'grid.json'}"
    )
    try:
        collect(out, tasks, modes, seeds, budgets, argv, state, args.resamples, args.paired_against)
        print(f"wrote {out / 'results.md'}, {out / 'results.csv'}")
        if args.export:
            export(out, Path(args.export), tasks, modes, seeds)
    except GridError as exc:
        print(f"warning: no results: {exc}", file=sys.stderr)
    if any(s in ("crashed", "refused") for s in statuses):
        return 1
    return EXIT_STOPPED if "stopped" in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
